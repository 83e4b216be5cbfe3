"""Fp4QuantDequant: the C++ kernel and the standard-op body against the unit goldens and the
NumPy definition (custom_ops/reference.py), and its errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import GOLDENS
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops.portable import fp4_function_proto
from csa2onnx.custom_ops.reference import fp4_round_trip
from csa2onnx.graphs.standalone import IR_VERSION

UNIT = np.load(GOLDENS / "unit_kernels.npz")
GOLDEN_TAGS = [("e8m0_b32.grid_ties", 32, "e8m0"), ("e8m0_b32.edge", 32, "e8m0"),
               ("e4m3_b16.grid_ties", 16, "e4m3"), ("e4m3_b16.edge", 16, "e4m3")]


def fp4_model(block: int, fmt: str, *, dtype: int = TensorProto.FLOAT, portable: bool = False,
              rank: int = 2, with_scale: bool = True) -> bytes:
    dims = [f"d{i}" for i in range(rank)]
    outputs = ["Y", "Scale"] if with_scale else ["Y"]
    nodes = [helper.make_node("Fp4QuantDequant", ["X"], outputs, domain="csa2onnx",
                              block_size=block, scale_format=fmt)]
    if dtype != TensorProto.FLOAT:  # numpy cannot take bfloat16 outputs: read Y as float
        nodes[0].output[0] = "Y_raw"
        nodes.append(helper.make_node("Cast", ["Y_raw"], ["Y"], to=TensorProto.FLOAT))
    out_info = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, dims)]
    if with_scale:
        out_info.append(helper.make_tensor_value_info("Scale", TensorProto.FLOAT, dims))
    graph = helper.make_graph(nodes, "fp4", [helper.make_tensor_value_info("X", dtype, dims)],
                              out_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)],
                              functions=[fp4_function_proto()] if portable else [],
                              ir_version=IR_VERSION)
    return model.SerializeToString()


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("portable", [False, True], ids=["kernel", "portable"])
@pytest.mark.parametrize(("tag", "block", "fmt"), GOLDEN_TAGS)
def test_unit_goldens_bit_exact(tag: str, block: int, fmt: str, portable: bool) -> None:
    x = UNIT[f"fp4.{tag}.input"]
    model = fp4_model(block, fmt, portable=portable)
    session = (ort.InferenceSession(model, providers=["CPUExecutionProvider"]) if portable
               else make_session(model))
    y, scale = session.run(None, {"X": x})
    np.testing.assert_array_equal(bits(y), bits(UNIT[f"fp4.{tag}.output"]))
    np.testing.assert_array_equal(scale, UNIT[f"fp4.{tag}.scale"])


@pytest.mark.parametrize(("tag", "block", "fmt"), GOLDEN_TAGS)
def test_numpy_definition_matches_goldens(tag: str, block: int, fmt: str) -> None:
    y, scale = fp4_round_trip(UNIT[f"fp4.{tag}.input"], block, fmt)
    np.testing.assert_array_equal(bits(y), bits(UNIT[f"fp4.{tag}.output"]))
    np.testing.assert_array_equal(scale, UNIT[f"fp4.{tag}.scale"])


def random_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values over the whole float32 range, with exact grid midpoints and zeros mixed in."""
    wide = rng.standard_normal(n) * np.exp2(rng.integers(-149, 127, n).astype(np.float64))
    grid_ties = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0], n) * np.exp2(
        rng.integers(-10, 10, n).astype(np.float64))
    x = np.where(rng.random(n) < 0.3, grid_ties * rng.choice([-1, 1], n), wide)
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


@pytest.mark.parametrize(("block", "fmt"), [(32, "e8m0"), (16, "e4m3")])
def test_kernel_and_portable_match_numpy_on_a_million_values(block: int, fmt: str) -> None:
    rng = np.random.default_rng(7)
    rows = (1 << 20) // 512
    x = random_values(rng, rows * 512).reshape(rows, 512)
    # whole blocks at one magnitude, so block scales range over every binade too
    x[::3] = (rng.standard_normal((len(x[::3]), 512)) *
              np.exp2(rng.integers(-140, 126, (len(x[::3]), 1)).astype(np.float64))).astype(
                  np.float32)
    want_y, want_scale = fp4_round_trip(x, block, fmt)
    for session in (make_session(fp4_model(block, fmt)),
                    ort.InferenceSession(fp4_model(block, fmt, portable=True),
                                         providers=["CPUExecutionProvider"])):
        y, scale = session.run(None, {"X": x})
        assert int((bits(y) != bits(want_y)).sum()) == 0
        np.testing.assert_array_equal(scale, want_scale)


@pytest.mark.parametrize("dtype", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
def test_half_precision_inputs(dtype: int) -> None:
    import ml_dtypes

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 64)) * 3).astype(np.float32)
    np_type = ml_dtypes.bfloat16 if dtype == TensorProto.BFLOAT16 else np.float16
    xh = x.astype(np_type)
    # onnxruntime's numpy bridge has no bfloat16: pass the raw bits as an OrtValue.
    feed = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(xh.view(np.uint16), dtype)
    session = make_session(fp4_model(32, "e8m0", dtype=dtype, with_scale=False))
    (y,) = session.run_with_ort_values(["Y"], {"X": feed})
    want, _ = fp4_round_trip(xh.astype(np.float32), 32, "e8m0")
    np.testing.assert_array_equal(y.numpy(), want.astype(np_type).astype(np.float32))


def test_higher_rank_and_empty_inputs() -> None:
    rng = np.random.default_rng(5)
    session = make_session(fp4_model(16, "e4m3", rank=4))
    x = rng.standard_normal((2, 3, 5, 32)).astype(np.float32)
    y, scale = session.run(None, {"X": x})
    want, _ = fp4_round_trip(x, 16, "e4m3")
    np.testing.assert_array_equal(bits(y), bits(want))
    assert scale.shape == (2, 3, 5, 2)
    y, scale = session.run(None, {"X": np.zeros((2, 0, 5, 32), np.float32)})
    assert y.shape == (2, 0, 5, 32) and scale.shape == (2, 0, 5, 2)


def test_nan_propagates_to_its_block_only() -> None:
    x = np.ones((2, 32), np.float32)
    x[0, 3] = np.nan
    y, _ = make_session(fp4_model(32, "e8m0")).run(None, {"X": x})
    assert np.isnan(y[0]).all() and not np.isnan(y[1]).any()


@pytest.mark.parametrize(("block", "fmt", "shape", "message"), [
    (24, "e8m0", (4, 32), "does not divide the last dimension 32"),
    (0, "e8m0", (4, 32), "block_size must be > 0"),
    (-16, "e4m3", (4, 32), "block_size must be > 0"),
    (16, "nvfp4", (4, 32), "unknown scale_format"),
])
def test_bad_attributes_and_shapes_are_clear_errors(block: int, fmt: str, shape: tuple[int, ...],
                                                    message: str) -> None:
    # Attribute errors surface when the session creates the kernel (RuntimeException),
    # shape errors from Compute keep INVALID_ARGUMENT.
    with pytest.raises((ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                        ort.capi.onnxruntime_pybind11_state.RuntimeException),
                       match=message):
        make_session(fp4_model(block, fmt)).run(None, {"X": np.ones(shape, np.float32)})


def test_scalar_input_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="at least one dimension"):
        make_session(fp4_model(1, "e8m0", rank=0)).run(None, {"X": np.array(1.0, np.float32)})


def test_wrong_dtype_is_rejected() -> None:
    model = fp4_model(32, "e8m0", dtype=TensorProto.DOUBLE)
    with pytest.raises(Exception, match="Fp4QuantDequant"):
        make_session(model).run(None, {"X": np.ones((2, 32))})


def test_model_with_portable_body_passes_the_checker() -> None:
    onnx.checker.check_model(onnx.load_from_string(fp4_model(32, "e8m0", portable=True)),
                             full_check=True)


@pytest.mark.parametrize("fmt", ["e8m0", "e4m3"])
def test_nan_and_inf_blocks_agree_across_kernel_portable_and_numpy(fmt: str) -> None:
    block = 32 if fmt == "e8m0" else 16
    x = np.ones((4, block), np.float32)
    x[0, 1], x[1, 2], x[2, 3] = np.nan, np.inf, -np.inf
    kernel = make_session(fp4_model(block, fmt)).run(None, {"X": x})
    portable = ort.InferenceSession(fp4_model(block, fmt, portable=True),
                                    providers=["CPUExecutionProvider"]).run(None, {"X": x})
    ref = fp4_round_trip(x, block, fmt)
    for got in (portable, ref):  # NaN payloads may differ: compare values, NaN == NaN
        np.testing.assert_array_equal(got[0], kernel[0])
        np.testing.assert_array_equal(got[1], kernel[1])
