"""The custom ops' output types and shapes: registered ONNX schemas (custom_ops/schemas.py)
for onnx's shape inference and checker and for the exporter's builder; onnxruntime's own
copy of the rules (custom_ops/src/shape_inference.cc), which must agree; and an exported
stack, whose every custom-op output gets a type and rank (static dims where static), from
the file as saved (value_info, what Netron shows) and from onnx.shape_inference alone."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from helpers import golden
from onnx import TensorProto, helper

from csa2onnx.custom_ops import ops
from csa2onnx.custom_ops.constants import packed_row_bytes
from csa2onnx.custom_ops.library import make_session
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.stack import export_stack
from csa2onnx.export.weights import from_golden
from csa2onnx.graphs.standalone import IR_VERSION

Shape = list[int | str | None]  # None: an unknown dim


@dataclass
class Case:
    """One node of op `op` over graph inputs (name -> (type, shape or None)) and constant
    initializers; `want`: each output's shape, None for an unknown rank."""

    op: str
    inputs: dict[str, tuple[int, Shape | None]]
    outputs: list[str]
    want: list[Shape | None]
    attributes: dict[str, object] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    def node(self) -> onnx.NodeProto:
        return helper.make_node(self.op, [*self.inputs, *self.constants], self.outputs,
                                domain="csa2onnx", **self.attributes)

    def model(self) -> onnx.ModelProto:
        out_types = {  # declared without a shape: inference alone gives one
            "Indices": TensorProto.INT64, "P": TensorProto.UINT8}
        cache_type = self.inputs.get("Cache", (TensorProto.FLOAT, None))[0]
        graph = helper.make_graph(
            [self.node()], self.op,
            [helper.make_tensor_value_info(n, t, s) for n, (t, s) in self.inputs.items()],
            [helper.make_tensor_value_info(
                o, cache_type if o == "CacheOut" else out_types.get(o, self.x_type(o)), None)
             for o in self.outputs],
            initializer=[onnx.numpy_helper.from_array(a, n) for n, a in self.constants.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("csa2onnx", 1)],
                                  ir_version=IR_VERSION)
        return model

    def x_type(self, output: str) -> int:
        if self.op in ("Fp4QuantDequant", "TorchTopK") and output in ("Y", "Values"):
            return next(iter(self.inputs.values()))[0]
        return TensorProto.FLOAT


F, BF16, I64, U8 = TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.INT64, TensorProto.UINT8
CASES = [
    Case("Fp4QuantDequant", {"X": (F, ["b", 3, 64])}, ["Y", "Scale"],
         [["b", 3, 64], ["b", 3, 2]], {"block_size": 32, "scale_format": "e8m0"}),
    Case("Fp4QuantDequant", {"X": (BF16, ["b", "n"])}, ["Y", "Scale"],
         [["b", "n"], ["b", None]], {"block_size": 16, "scale_format": "e4m3"}),
    Case("Fp4QuantDequant", {"X": (F, None)}, ["Y"], [None],
         {"block_size": 32, "scale_format": "e8m0"}),
    Case("TorchTopK", {"X": (F, ["b", 1, 40])}, ["Values", "Indices"],
         [["b", 1, 5], ["b", 1, 5]], constants={"K": np.array([5], np.int64)}),
    Case("TorchTopK", {"X": (F, ["b", 40]), "K": (I64, [1])}, ["Values", "Indices"],
         [["b", None], ["b", None]]),
    Case("TorchLinear", {"X": (F, ["b", "s", 16]), "W": (F, [8, 16])}, ["Y"], [["b", "s", 8]]),
    Case("TorchLinear", {"X": (F, ["m", 16]), "W": (BF16, ["n", 16])}, ["Y"], [["m", "n"]]),
    Case("TorchLinear", {"X": (F, ["b", "s", 16]), "W": (BF16, [1, 8, 64, 2])}, ["Y"],
         [["b", "s", 70]], {"weight_layout": "panels64", "out_features": 70,
                            "in_features": 16}),
    Case("TorchLinear", {"X": (F, ["b", "s", 16]), "W": (F, None)}, ["Y"], [["b", "s", None]]),
    Case("TorchLinear", {"X": (F, ["b", "s", 48]), "W": (BF16, [24, 16])}, ["Y"],
         [["b", "s", 24]], {"groups": 3}),
    Case("TorchLinear", {"X": (F, ["b", "s", 48]), "W": (BF16, [6, 8, 64, 2])}, ["Y"],
         [["b", "s", 210]], {"weight_layout": "panels64", "out_features": 70,
                             "in_features": 16, "groups": 3}),
    Case("Fp8Linear", {"X": (F, ["b", 1, 64]), "W": (TensorProto.FLOAT8E4M3FN, [40, 64]),
                       "WScale": (F, [2, 2])}, ["Y"], [["b", 1, 40]]),
    Case("Fp8Linear", {"X": (F, ["b", 1, 64]), "W": (TensorProto.FLOAT8E4M3FN, [3, 2, 512]),
                       "WScale": (F, [2, 2])}, ["Y"], [["b", 1, 48]],
         {"weight_layout": "pairs16"}),
    Case("Fp8Linear", {"X": (F, ["b", 1, 64]), "W": (TensorProto.FLOAT8E4M3FN, ["g", 2, 512]),
                       "WScale": (F, [2, 2])}, ["Y"], [["b", 1, None]],
         {"weight_layout": "pairs16"}),
    Case("TorchRMSNorm", {"X": (F, ["b", "s", 32]), "W": (BF16, [32])}, ["Y"],
         [["b", "s", 32]], {"epsilon": 1e-6}),
    Case("SparseAttention", {"Q": (F, ["b", "s", 4, 64]), "KV": (F, ["b", "n", 64]),
                             "Sink": (F, [4]), "Idx": (I64, ["b", "s", "k"])}, ["O"],
         [["b", "s", 4, 64]], {"softmax_scale": 0.125}),
    Case("SparseAttention", {"Q": (F, ["b", "s", 4, 64]), "KV": (F, ["b", "n", 64]),
                             "Sink": (F, [4]), "Idx": (TensorProto.INT32, ["b", "s", "k"]),
                             "Compressed": (U8, ["b", "m", 36])}, ["O"],
         [["b", "s", 4, 64]], {"softmax_scale": 0.125, "compressed_format": "fp4_e4m3_16"}),
    Case("IndexerScore", {"Q": (F, ["b", "s", 4, 64]), "W": (F, ["b", "s", 4]),
                          "Keys": (U8, ["b", "R", 34])}, ["Score"], [["b", "s", 7]],
         {"keys_format": "fp4_e8m0_32"}, constants={"Width": np.array([7], np.int64)}),
    Case("IndexerScore", {"Q": (F, ["b", "s", 4, 64]), "W": (F, ["b", "s", 4]),
                          "Keys": (F, ["b", "R", 64]), "Width": (I64, [1])}, ["Score"],
         [["b", "s", None]]),
    Case("RopeCosSin", {"Positions": (I64, ["s"])}, ["Cos", "Sin"], [["s", 3], ["s", 3]],
         {"inverse_frequencies": [1.0, 0.5, 0.25], "max_positions": 64}),
    Case("RopeCosSin", {"Positions": (I64, ["b", 7])}, ["Cos", "Sin"],
         [["b", 7, 2], ["b", 7, 2]], {"inverse_frequencies": [1.0, 0.5], "max_positions": 64}),
    Case("ApplyRope", {"X": (F, ["b", "s", 4, 64]), "Cos": (F, ["s", 16]),
                       "Sin": (F, ["s", 16])}, ["Y"], [["b", "s", 4, 64]],
         {"rope_head_dim": 32}),
    Case("ApplyRope", {"X": (F, ["b", "s", 64]), "Cos": (F, ["b", "s", 32]),
                       "Sin": (F, ["b", "s", 32])}, ["Y"], [["b", "s", 64]],
         {"rope_head_dim": 64, "inverse": 1}),
    Case("WriteRows", {"Cache": (F, ["B", "R", 8]), "Rows": (F, ["b", "n", 8]),
                       "RowStart": (I64, [1])}, ["CacheOut"], [["B", "R", 8]]),
    Case("WriteRows", {"Cache": (U8, ["B", "R", 72]), "Rows": (U8, ["b", "n", 72]),
                       "RowStart": (I64, [1]), "After": (I64, [3])}, ["CacheOut"],
         [["B", "R", 72]]),
    Case("PackQuantized", {"X": (F, ["b", "n", 128])}, ["P"],
         [["b", "n", packed_row_bytes("fp4_e4m3_16", 128)]], {"format": "fp4_e4m3_16"}),
    Case("PackQuantized", {"X": (F, ["b", 64])}, ["P"],
         [["b", packed_row_bytes("fp8_e8m0_32", 64)]], {"format": "fp8_e8m0_32"}),
    Case("PackQuantized", {"X": (F, ["b", "d"])}, ["P"], [["b", None]],
         {"format": "fp4_e8m0_32"}),
    Case("UnpackQuantized", {"P": (U8, ["b", "n", 72])}, ["Y"], [["b", "n", 128]],
         {"format": "fp4_e4m3_16", "dim": 128}),
    Case("BlockMax", {"X": (F, ["b", "s", 1001])}, ["Y"], [["b", "s", 126]],
         {"block_size": 8}),
    Case("BlockMax", {"X": (F, ["b", "s", "t"])}, ["Y"], [["b", "s", None]],
         {"block_size": 8}),
]
# What onnxruntime's inference context cannot express (shape_inference.cc): K's and Width's
# values, and how many outputs a node has (the optional Scale).
ORT_LEAVES_UNKNOWN = {("TorchTopK", 0), ("TorchTopK", 1), ("Fp4QuantDequant", 1),
                      ("IndexerScore", 0)}


def dims_of(t: onnx.TypeProto) -> Shape | None:
    if not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in t.tensor_type.shape.dim]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{'-'.join(c.inputs)}")
def test_schema_inference_and_onnxruntime_agree(case: Case) -> None:
    """The schema's inference (what onnx tooling and the exporter's builder use) gives the
    expected shapes, the checker accepts the node, and onnxruntime, loading the model with
    the library, infers the same shape for every output whose dims are all known."""
    schema = onnx.defs.get_schema(case.op, 1, "csa2onnx")
    model = case.model()
    types = {i.name: i.type for i in model.graph.input}
    for init in model.graph.initializer:
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    data = {init.name: init for init in model.graph.initializer}
    inferred = onnx.shape_inference.infer_node_outputs(schema, case.node(), types, data)
    got = [dims_of(inferred[o]) for o in case.outputs]
    assert got == case.want
    context = onnx.checker.C.CheckerContext()
    context.ir_version, context.opset_imports = 10, {"": 21, "csa2onnx": 1}
    onnx.checker.check_node(case.node(), context)  # attributes and arity, by the schema

    session = make_session(model.SerializeToString())
    by_name = {o.name: o.shape for o in session.get_outputs()}
    for i, (name, want) in enumerate(zip(case.outputs, case.want, strict=True)):
        known = want is not None and all(d is not None for d in want)
        if known and (case.op, i) not in ORT_LEAVES_UNKNOWN:
            assert by_name[name] == want, f"{case.op} output {name}"
        else:
            assert by_name[name] == [], f"{case.op} output {name}: {by_name[name]}"


def test_ops_module_sets_no_output_type_by_hand() -> None:
    """The wrappers rely on the schemas for their outputs' types and shapes."""
    source = inspect.getsource(ops)
    assert not re.search(r"\.(type|shape|dtype)\s*=[^=]", source)
    assert "_typed" not in source


# ------------------------------------------------------------------ an exported stack
EXPECTED_LAST_DIM = {  # op -> the static last dim of output 0, from its attributes or weights
    "TorchLinear": "N", "Fp8Linear": "N", "RopeCosSin": "freqs", "UnpackQuantized": "dim"}


@pytest.fixture(scope="module", params=[False, True], ids=["default", "portable"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> list[onnx.ModelProto]:
    g = golden("case3_r4_r128")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    folder = tmp_path_factory.mktemp("shapes")
    export_stack(plan, from_golden(g.arrays, range(len(g.meta["layer_roles"]))), folder,
                 portable=request.param)
    return [onnx.load(str(folder / f"{mode}.onnx")) for mode in ("prefill", "decode")]


def custom_outputs(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, int, str]]:
    return [(n, i, o) for n in model.graph.node if n.domain == "csa2onnx"
            for i, o in enumerate(n.output) if o]


def expected_last(model: onnx.ModelProto, node: onnx.NodeProto) -> int | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    kind = EXPECTED_LAST_DIM.get(node.op_type)
    if kind == "N":  # a panels64 W's out_features is a group's
        if "out_features" in attrs:
            return attrs.get("groups", 1) * attrs["out_features"]
        if attrs.get("weight_layout") == "pairs16":  # W [N/16, K/32, 512]
            return 16 * shapes[node.input[1]][0]
        return shapes.get(node.input[1], [None])[0]
    if kind == "freqs":
        return len(attrs["inverse_frequencies"])
    if kind == "dim":
        return attrs["dim"]
    return None


def test_every_custom_output_is_typed_in_the_saved_file(exported) -> None:
    """Tools that do not know the ops (Netron) read value_info: every custom-op output of
    both models has an element type and a rank there."""
    for model in exported:
        infos = {v.name: v.type for v in [*model.graph.value_info, *model.graph.output]}
        for node, _, name in custom_outputs(model):
            assert name in infos, f"{node.op_type} {name}: no value_info"
            assert infos[name].tensor_type.elem_type != 0, name
            assert dims_of(infos[name]) is not None, f"{node.op_type} {name}: no rank"


def test_onnx_shape_inference_alone_types_every_custom_output(exported) -> None:
    """With value_info stripped, onnx.shape_inference (strict) gives every custom-op output a
    type and the rank the exporter saved, the same dims, and the static last dim each op's
    attributes or weights fix (TorchLinear's N, RopeCosSin's frequencies, ...)."""
    for model in exported:
        saved = {v.name: v.type for v in [*model.graph.value_info, *model.graph.output]}
        stripped = onnx.ModelProto()
        stripped.CopyFrom(model)
        del stripped.graph.value_info[:]
        inferred = onnx.shape_inference.infer_shapes(stripped, strict_mode=True)
        infos = {v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.output]}
        checked = 0
        for node, index, name in custom_outputs(model):
            assert infos[name].tensor_type.elem_type == saved[name].tensor_type.elem_type
            dims = dims_of(infos[name])
            assert dims is not None and len(dims) == len(dims_of(saved[name])), name
            for got, want in zip(dims, dims_of(saved[name]), strict=True):
                if want is not None and not str(want).startswith("unk__"):
                    assert got == want, f"{node.op_type} {name}: {dims} vs {dims_of(saved[name])}"
            last = expected_last(model, node) if index == 0 else None
            if last is not None:
                assert dims[-1] == last, f"{node.op_type} {name}: {dims}, want last {last}"
                checked += 1
        assert checked > 10

