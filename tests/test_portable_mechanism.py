"""One way to go portable: every custom op but RopeCosSin has a standard-op function body
(custom_ops/portable.py), and the graph-side wrappers build the same custom nodes whether
the graph is portable or not, except where the README says a body cannot serve (RopeCosSin's
tables, SparseAttention over a packed cache). The op list itself is one list: schemas,
bodies, the package docstring and the README's table agree."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import ROOT, custom_op_model, golden
from onnx import TensorProto, helper

import csa2onnx.custom_ops as custom_ops
from csa2onnx.custom_ops import make_session, ops, schemas
from csa2onnx.custom_ops.portable import portable_functions
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.stack import export_stack
from csa2onnx.export.weights import from_golden
from csa2onnx.graphs.standalone import build_model

F = ir.DataType.FLOAT


def test_every_op_has_a_schema_a_body_or_a_reason_and_docs() -> None:
    """One list of ops: the schemas, the portable bodies (all but RopeCosSin, and IndexerTopK,
    which a portable graph writes as three ops: README), the package docstring and README's
    table name the same ops."""
    names = set(schemas.OP_NAMES)
    assert {f.name for f in portable_functions()} | {"RopeCosSin", "IndexerTopK"} == names
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(\w+)` \|", readme, flags=re.M))
    assert table == names, table ^ names
    documented = set(re.findall(r"^- `(\w+)`", custom_ops.__doc__, flags=re.M))
    documented |= set(re.findall(r"^- `\w+` / `(\w+)`", custom_ops.__doc__, flags=re.M))
    assert documented == names, documented ^ names
    for name in names:
        assert onnx.defs.has(name, "csa2onnx")


def _wrapped(op, x, w, k, cache, rows, start):
    """Every wrapper whose node does not depend on portability, once."""
    y = ops.torch_rms_norm(op, ops.torch_linear(op, x, w), op.Constant(value=ir.tensor(
        np.ones(32, np.float32))), 1e-6)
    values, _ = ops.torch_topk(op, y, k)
    quantised = ops.fp4_quant_dequant(op, y, 8, "e8m0")
    unpacked = ops.unpack_quantized(op, ops.pack_quantized(op, y, "fp8_e8m0_32"),
                                    "fp8_e8m0_32", 32)
    written = ops.write_rows(op, cache, rows, start)
    rows_cs = op.Constant(value=ir.tensor(np.ones((4, 2), np.float32)))
    rotated = ops.apply_rope(op, written, rows_cs, rows_cs, 4)
    return values, quantised, unpacked, rotated


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
def test_wrappers_build_the_same_nodes_either_way(portable: bool) -> None:
    inputs = [("x", F, ["b", 16]), ("w", F, [32, 16]), ("k", ir.DataType.INT64, [1]),
              ("cache", F, [1, 4, 8]), ("rows", F, [1, 1, 8]),
              ("start", ir.DataType.INT64, [1])]
    model = build_model("m", inputs, ["v", "q", "u", "c"], _wrapped, portable=portable)
    nodes = [n.op_type for n in model.graph.node if n.domain == "csa2onnx"]
    assert nodes == ["TorchLinear", "TorchRMSNorm", "TorchTopK", "Fp4QuantDequant",
                     "PackQuantized", "UnpackQuantized", "WriteRows", "ApplyRope"]
    assert {f.name for f in model.functions} == (
        {f.name for f in portable_functions()} if portable else set())


def test_topk_body_is_onnx_topk() -> None:
    """TorchTopK's body: the kernel's result where no tie decides, the lowest index where
    one does (torch's CPU kernel picks otherwise)."""
    node = helper.make_node("TorchTopK", ["X", "K"], ["V", "I"], domain="csa2onnx")
    graph = helper.make_graph(
        [node], "topk", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                         helper.make_tensor_value_info("K", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("V", TensorProto.FLOAT, ["r", "k"]),
         helper.make_tensor_value_info("I", TensorProto.INT64, ["r", "k"])])
    body = ort.InferenceSession(custom_op_model(graph, portable=True),
                                providers=["CPUExecutionProvider"])
    kernel = make_session(custom_op_model(graph))
    rng = np.random.default_rng(0)
    distinct = rng.permutation(4096).astype(np.float32).reshape(4, 1024)
    k = np.array([37], np.int64)
    for got, want in zip(body.run(None, {"X": distinct, "K": k}),
                         kernel.run(None, {"X": distinct, "K": k}), strict=True):
        np.testing.assert_array_equal(got, want)
    ties = np.array([[1, 3, 3, 3, 0, 3]], np.float32)
    _, low = body.run(None, {"X": ties, "K": np.array([2], np.int64)})
    _, torch_order = kernel.run(None, {"X": ties, "K": np.array([2], np.int64)})
    np.testing.assert_array_equal(low, [[1, 2]])
    assert not np.array_equal(low, torch_order)  # else the tie proves nothing


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and its subgraphs' (the index_k slot's If branches)."""
    nodes = []
    for n in graph.node:
        nodes.append(n)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                nodes += _all_nodes(a.g)
    return nodes


@pytest.fixture(scope="module")
def case1_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    g = golden("case1_r2_r1")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    folders = {}
    for portable in (False, True):
        folders[portable] = tmp_path_factory.mktemp(f"portable{int(portable)}")
        export_stack(plan, from_golden(g.arrays, range(6)), folders[portable],
                     portable=portable)
    return folders


def test_an_exported_stack_differs_only_where_a_body_cannot_serve(case1_exports) -> None:
    """Default and portable artifacts hold the same custom nodes, but RopeCosSin (replaced by
    Gathers from tables), the packed-cache SparseAttention (its 5-input node becomes the
    4-input one over one more UnpackQuantized's rows), IndexerTopK (written as IndexerScore,
    TorchTopK and, with block_size, BlockMax; its packed key cache read as the float-key node
    over one more UnpackQuantized's rows) and wo_a's grouped TorchLinear (a node per group,
    each reading its own initializer). The exporter computes identical nodes once, so readers
    of one packed cache share one UnpackQuantized there."""
    args = golden("case1_r2_r1").model_args
    extra_linears = len(args["compress_ratios"]) * (args["o_groups"] - 1)

    def packed_keys(n: onnx.NodeProto) -> bool:
        return (n.op_type in ("IndexerScore", "IndexerTopK")
                and any(a.name == "keys_format" for a in n.attribute))

    for mode in ("prefill", "decode"):
        count, packed_reads, packed_sources, blocks = {}, {}, {}, 0
        for portable, folder in case1_exports.items():
            graph = onnx.load(str(folder / f"{mode}.onnx"), load_external_data=False).graph
            nodes = [n for n in _all_nodes(graph) if n.domain == "csa2onnx"]
            count[portable] = collections.Counter(n.op_type for n in nodes)
            packed_reads[portable] = sum(
                (n.op_type == "SparseAttention" and len(n.input) == 5) or packed_keys(n)
                for n in nodes)
            packed_sources[portable] = (  # what one unpack reads: a cache (keys: and width)
                {tuple(n.input[4:]) for n in nodes
                 if n.op_type == "SparseAttention" and len(n.input) == 5} |
                {tuple(n.input[2:4]) for n in nodes if packed_keys(n)})
            if not portable:
                blocks = sum(n.op_type == "IndexerTopK" and any(
                    a.name == "block_size" for a in n.attribute) for n in nodes)
        default, portable = count[False], count[True]
        assert default["RopeCosSin"] > 0 and portable["RopeCosSin"] == 0
        fused = default["IndexerTopK"]
        assert fused > 0 and default["IndexerScore"] == 0 and portable["IndexerTopK"] == 0
        assert portable["IndexerScore"] == fused
        assert portable["TorchTopK"] - default["TorchTopK"] == fused
        assert portable["BlockMax"] - default["BlockMax"] == blocks
        assert packed_reads[True] == 0 and packed_reads[False] > fused
        assert 0 < len(packed_sources[False]) <= packed_reads[False]
        assert (portable["UnpackQuantized"] - default["UnpackQuantized"]
                == len(packed_sources[False]))
        assert portable["TorchLinear"] - default["TorchLinear"] == extra_linears
        for op in set(default) | set(portable):
            if op not in ("RopeCosSin", "UnpackQuantized", "TorchLinear", "IndexerTopK",
                          "IndexerScore", "TorchTopK", "BlockMax"):
                assert default[op] == portable[op], (mode, op)
