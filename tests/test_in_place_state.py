"""In-place state: caches are one buffer bound as past input and present output, written
by WriteRows; reads of a cache's old contents are ordered before its write; capacity grows
with the context; a new sequence reuses the caches without zero-filling them."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import csa2onnx.export.layer as layer_module
import csa2onnx.export.stack as stack_module
from conftest import ROOT, golden
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.goldens import GoldenCase, compare, load_case
from csa2onnx.export.in_place import check_in_place_order
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import build_stack_model, export_stack
from csa2onnx.export.weights import from_golden

CASE = "case1_r2_r1"  # decode steps where layer 1 reads layer 3's keys through the slot


def _plan_and_weights(case: str = CASE):
    g = golden(case)
    config = AttentionConfig.from_model_args(g.model_args)
    n = len(g.meta["layer_roles"])
    return g, plan_stack(config), from_golden(g.arrays, range(n)), n


def _without_ordering_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    real = layer_module.write_rows
    monkeypatch.setattr(layer_module, "write_rows",
                        lambda op, cache, rows, start, after=(): real(op, cache, rows, start))


def test_every_read_of_an_old_cache_is_ordered_before_its_write(monkeypatch) -> None:
    """Layer 1 reads layer 3's index keys through the slot (as they were after the last
    call) before layer 3 writes them: without the edge the export refuses the graph."""
    _, plan, weights, _ = _plan_and_weights()
    for mode in ("prefill", "decode"):
        build_stack_model(plan, weights, mode)  # checked: passes
    _without_ordering_edges(monkeypatch)
    with pytest.raises(ValueError, match=r"past\.L3\.index_k is written in place, but 1 "
                                         r"node\(s\) reading its old contents are not ordered"):
        build_stack_model(plan, weights, "decode")


def _writes_first(path: Path) -> None:
    """Reorder the model's nodes so that every WriteRows runs as early as its inputs allow
    (onnxruntime follows the node order among independent nodes): the order an unlucky
    scheduler could pick."""
    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}

    def reads(node: onnx.NodeProto) -> list[str]:
        names = list(node.input)
        for attr in node.attribute:
            for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                for inner in g.node:
                    names += reads(inner)
        return names

    first: set[int] = set()
    stack = [i for i, n in enumerate(nodes) if n.op_type == "WriteRows"]
    while stack:
        i = stack.pop()
        if i not in first:
            first.add(i)
            stack += [producer[name] for name in reads(nodes[i]) if name in producer]
    order = sorted(first) + [i for i in range(len(nodes)) if i not in first]
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    onnx.save(model, str(path))


def _outputs_match(case: GoldenCase, folder: Path) -> bool:
    n = len(case.meta["layer_roles"])
    runtime = AttentionRuntime(folder)
    ok = True
    for entry in case.meta["schedule"]:
        xs = {layer: case.step(entry["step"], layer, "x") for layer in range(n)}
        out = (runtime.prefill if entry["start_pos"] == 0 else runtime.decode)(xs).out
        ok &= all(compare(out[layer], case.step(entry["step"], layer, "out")).ok
                  for layer in range(n))
    return ok


# Layer 2 (ratio 2, index source, not an owner) reads the slot while it points to owner 3
# (ratio 4) from an earlier call, on calls where owner 3 completes a group and owner 0
# (ratio 8) does not: its end_pos // 2 rows include the row owner 3 writes later in the
# same call, which it must see as it was (zero) before that write.
ORDER_LAYOUT = {"compress_ratios": [8, 2, 2, 4], "kv_source_layers": [0, 1, 3],
                "index_source_layers": [0, 2, 3], "window_size": 8, "index_topk": 8,
                "max_seq_len": 128}


@pytest.fixture(scope="module")
def order_case(tmp_path_factory: pytest.TempPathFactory) -> GoldenCase:
    pytest.importorskip("torch", reason="the oracle (tools/torch_reference.py) needs torch")
    sys.path.insert(0, str(ROOT / "tools"))
    import make_golden

    folder = tmp_path_factory.mktemp("order_case")
    return load_case(make_golden.make_case(folder, "order", seed=21, prefill_len=19,
                                           decode_steps=10, layout=ORDER_LAYOUT))


def test_the_edges_hold_under_an_adverse_node_order(order_case: GoldenCase, tmp_path: Path,
                                                    monkeypatch) -> None:
    """With every write scheduled as early as its inputs allow, the outputs still match the
    oracle (upstream's order: the read sees the old row); without the ordering edges the
    same schedule lets owner 3's write run before layer 2's read, and they do not."""
    plan = plan_stack(AttentionConfig.from_model_args(order_case.model_args))
    weights = from_golden(order_case.arrays, range(4))
    export_stack(plan, weights, tmp_path / "edges")
    for mode in ("prefill", "decode"):
        _writes_first(tmp_path / "edges" / f"{mode}.onnx")
    assert _outputs_match(order_case, tmp_path / "edges")

    _without_ordering_edges(monkeypatch)
    monkeypatch.setattr(stack_module, "check_in_place_order", lambda graph: None)
    export_stack(plan, weights, tmp_path / "no_edges")
    for mode in ("prefill", "decode"):
        _writes_first(tmp_path / "no_edges" / f"{mode}.onnx")
    assert not _outputs_match(order_case, tmp_path / "no_edges")


def test_check_accepts_graphs_without_in_place_writes() -> None:
    import onnx_ir as ir

    check_in_place_order(ir.Graph([], [], nodes=[]))
