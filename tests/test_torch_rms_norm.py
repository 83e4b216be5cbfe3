"""TorchRMSNorm against torch's own RMSNorm arithmetic (bit for bit, before the bf16 cast)
and its errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session


def rms_model(w_type: int) -> bytes:
    node = helper.make_node("TorchRMSNorm", ["X", "W"], ["Y"], domain="csa2onnx",
                            epsilon=1e-20)
    graph = helper.make_graph(
        [node], "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                        helper.make_tensor_value_info("W", w_type, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "n"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("csa2onnx", 1)]
                             ).SerializeToString()


@pytest.mark.parametrize("n", [8, 20, 64, 100, 128, 512, 1280, 1536, 4096])
def test_matches_torch_bit_for_bit(n: int) -> None:
    torch = pytest.importorskip("torch", reason="compares against torch's RMSNorm")
    rng = np.random.default_rng(n)
    x = torch.from_numpy(rng.standard_normal((300, n)).astype(np.float32)).bfloat16().float()
    w = torch.from_numpy(rng.random(n).astype(np.float32) + 0.5)
    # The reference: weight * (x * rsqrt(mean(x^2) + eps)) in float32.
    want = (w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-20))).numpy()
    (got,) = make_session(rms_model(TensorProto.FLOAT)).run(None, {"X": x.numpy(),
                                                                  "W": w.numpy()})
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bfloat16_weights() -> None:
    import ml_dtypes

    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = (rng.random(64) + 0.5).astype(ml_dtypes.bfloat16)
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(x),
             "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(w.view(np.uint16),
                                                                   TensorProto.BFLOAT16)}
    session = make_session(rms_model(TensorProto.BFLOAT16))
    (y,) = session.run_with_ort_values(["Y"], feeds)
    (y32,) = make_session(rms_model(TensorProto.FLOAT)).run(None, {
        "X": x, "W": w.astype(np.float32)})
    np.testing.assert_array_equal(y.numpy(), y32)


def test_errors_are_clear() -> None:
    session = make_session(rms_model(TensorProto.FLOAT))
    with pytest.raises(Exception, match=r"TorchRMSNorm: W must have shape \[8\]"):
        session.run(None, {"X": np.ones((2, 8), np.float32), "W": np.ones(7, np.float32)})
    y = session.run(None, {"X": np.ones((0, 8), np.float32), "W": np.ones(8, np.float32)})[0]
    assert y.shape == (0, 8)


@pytest.mark.parametrize("n", [8, 20, 64, 128, 300, 1280, 1536])
def test_portable_spelling_sums_in_the_same_order(n: int) -> None:
    """A portable graph spells TorchRMSNorm out in standard ops with torch's summation
    order: bit for bit the kernel's result, with no custom node left."""
    from csa2onnx.custom_ops.ops import torch_rms_norm
    from csa2onnx.graphs.numerics import FLOAT
    from csa2onnx.graphs.standalone import build_model

    rng = np.random.default_rng(n)
    x = (rng.standard_normal((64, n)) * 3).astype(np.float32)
    w = (rng.random(n) + 0.5).astype(np.float32)

    def body(op, x):
        return torch_rms_norm(op, x, op.Constant(value=__import__("onnx_ir").tensor(w)), 1e-6)

    portable = build_model("rms", [("x", FLOAT, ["r", n])], ["y"], body, portable=True)
    assert all(node.domain != "csa2onnx" for node in portable.graph.node)
    got = ort.InferenceSession(portable.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    node = helper.make_node("TorchRMSNorm", ["X", "W"], ["Y"], domain="csa2onnx", epsilon=1e-6)
    graph = helper.make_graph(
        [node], "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                        helper.make_tensor_value_info("W", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "n"])])
    kernel = make_session(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("csa2onnx", 1)]).SerializeToString())
    want = kernel.run(None, {"X": x, "W": w})[0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
