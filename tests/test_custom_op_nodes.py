"""Nodes that leave out a required input or output get a clear error when the session is
created, for every custom op (onnxruntime would otherwise hand the kernel a null value)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session
from csa2onnx.graphs.standalone import IR_VERSION

OPS = {  # op: (input types, output names, attributes)
    "Fp4QuantDequant": ([TensorProto.FLOAT], ["Y", "Scale"],
                        {"block_size": 32, "scale_format": "e8m0"}),
    "TorchTopK": ([TensorProto.FLOAT, TensorProto.INT64], ["Values", "Indices"], {}),
    "TorchLinear": ([TensorProto.FLOAT, TensorProto.FLOAT], ["Y"], {}),
    "TorchRMSNorm": ([TensorProto.FLOAT, TensorProto.FLOAT], ["Y"], {"epsilon": 1e-6}),
    "Fp8Linear": ([TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT], ["Y"], {}),
    "WriteRows": ([TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64], ["Y"], {}),
    "RopeCosSin": ([TensorProto.INT64], ["Cos", "Sin"],
                   {"inverse_frequencies": [1.0, 0.5], "max_positions": 16}),
}


def model(op: str, inputs: list[str], outputs: list[str]) -> bytes:
    types, _, attrs = OPS[op]
    node = helper.make_node(op, inputs, outputs, domain="csa2onnx", **attrs)
    graph = helper.make_graph(
        [node], op,
        [helper.make_tensor_value_info(f"in{i}", t, None) for i, t in enumerate(types)],
        [helper.make_tensor_value_info(
            name, TensorProto.INT64 if name == "Indices" else TensorProto.FLOAT, None)
         for name in outputs if name])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("csa2onnx", 1)],
                             ir_version=IR_VERSION).SerializeToString()


@pytest.mark.parametrize("op", sorted(OPS))
def test_missing_first_input_is_a_clear_error(op: str) -> None:
    types, outputs, _ = OPS[op]
    inputs = ["", *[f"in{i}" for i in range(1, len(types))]]
    with pytest.raises(Exception, match=f"{op}: input 0 is required"):
        make_session(model(op, inputs, outputs))


@pytest.mark.parametrize("op", sorted(OPS))
def test_missing_first_output_is_a_clear_error(op: str) -> None:
    types, outputs, _ = OPS[op]
    with pytest.raises(Exception, match=f"{op}: output 0 is required"):
        make_session(model(op, [f"in{i}" for i in range(len(types))], ["", *outputs[1:]]))


def test_the_optional_fp4_scale_may_be_left_out() -> None:
    make_session(model("Fp4QuantDequant", ["in0"], ["Y", ""]))
