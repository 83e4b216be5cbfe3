"""TorchRMSNorm against torch's own RMSNorm arithmetic (bit for bit, before the bf16 cast),
its errors, and its portable function body against the kernel (bit for bit: one summation
order, torch_rms_norm.h's, in C++ and in standard ONNX ops)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from helpers import cast_pair, custom_op_model, run_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session
from csa2onnx.graphs.standalone import IR_VERSION


def rms_model(w_type: int) -> bytes:
    node = helper.make_node("TorchRMSNorm", ["X", "W"], ["Y"], domain="csa2onnx",
                            epsilon=1e-20)
    graph = helper.make_graph(
        [node], "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                        helper.make_tensor_value_info("W", w_type, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "n"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("csa2onnx", 1)],
                             ir_version=IR_VERSION).SerializeToString()


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


# ------------------------------------------------- the portable body: the kernel's order
# Widths: the released dims (q_lora_rank 1536, index / head dims 512 and 128, kv 7168-ish),
# odd widths (a scalar tail and left-over vectors), and the cascade's boundaries: 16 groups
# of 32 values per level-1 sum, 256 and 4096 groups where levels 2 and 3 flush.
WIDTHS = [1, 7, 8, 31, 33, 100, 128, 512, 1536, 1560, 4095, 4096, 7168, 7169, 7224, 8192,
          8224, 131072, 140001]


def adversarial_rows(n: int, seed: int) -> np.ndarray:
    """Rows whose float32 sum of squares depends on the order of the additions: magnitudes
    over 2^+-40 (a row's small squares vanish or not beside its large ones depending on
    when they are added), one huge value among ones, bf16 values, denormal and overflowing
    squares, zeros, inf and NaN; and many plain random rows, since a last-bit change in a
    sum shows in Y only now and then (through the mean's division and the square root)."""
    rng = np.random.default_rng(seed)
    plain = 64 if n <= 16384 else 4
    rows = [rng.standard_normal(n) * np.exp2(rng.uniform(-20, 20, n)),
            *rng.standard_normal((plain, n)), *rng.random((plain, n)),
            np.ones(n), np.zeros(n), np.full(n, 1e-23), np.full(n, 3e19)]
    spike = np.ones(n)
    spike[rng.integers(n)] = 4096.0  # 2^24 + ones: each 1 survives only in a partial sum
    rows.append(spike)
    bf16 = rng.standard_normal(n).astype(ml_dtypes.bfloat16).astype(np.float32)
    rows.append(bf16)
    special = rng.standard_normal(n)
    special[rng.integers(n)] = np.inf
    rows.append(special)
    nan = rng.standard_normal(n)
    nan[rng.integers(n)] = np.nan
    rows.append(nan)
    return np.asarray(rows, np.float32)


def rms_node_model(w_type: int, *, portable: bool, **attributes: int) -> bytes:
    node = helper.make_node("TorchRMSNorm", ["X", "W"], ["Y"], domain="csa2onnx",
                            epsilon=1e-6, **attributes)
    graph = helper.make_graph(
        [node], "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                        helper.make_tensor_value_info("W", w_type, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "n"])])
    return custom_op_model(graph, portable=portable)


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, NaN payloads aside (NaN exactly where the kernel has one)."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.where(nan, 0, got).view(np.uint32),
                                  np.where(nan, 0, want).view(np.uint32), err_msg=what)


@pytest.fixture(scope="module")
def rms_sessions() -> dict[str, ort.InferenceSession]:
    """The kernel, the portable body (no library) and, for the control, ReduceMean."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"])
    w = helper.make_tensor_value_info("W", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "n"])
    reduce_mean = helper.make_graph([  # the order ONNX's ReduceMean sums in
        helper.make_node("Mul", ["X", "X"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["r"]),
        helper.make_node("Mul", ["X", "r"], ["xr"]),
        helper.make_node("Mul", ["W", "xr"], ["Y"])], "mean", [x, w], [y],
        initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
                     helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6])])
    plain = ["CPUExecutionProvider"]
    return {"kernel": make_session(rms_node_model(TensorProto.FLOAT, portable=False)),
            "portable": ort.InferenceSession(rms_node_model(TensorProto.FLOAT, portable=True),
                                             providers=plain),
            "portable_bf16": ort.InferenceSession(
                rms_node_model(TensorProto.BFLOAT16, portable=True), providers=plain),
            "kernel_bf16": make_session(rms_node_model(TensorProto.BFLOAT16, portable=False)),
            "reduce_mean": ort.InferenceSession(custom_op_model(reduce_mean), providers=plain)}


@pytest.mark.parametrize("n", WIDTHS)
def test_portable_body_sums_in_the_kernels_order(n: int, rms_sessions) -> None:
    """TorchRMSNorm's standard-op function body (custom_ops/portable.py, what a portable
    artifact runs without the library) gives the kernel's bits: the same summation order,
    torch_rms_norm.h's, on order-sensitive rows; with float32 and bfloat16 weights."""
    x = adversarial_rows(n, seed=n)
    w = (np.random.default_rng(n + 1).random(n) + 0.5).astype(np.float32)
    feeds = {"X": x, "W": w}
    with np.errstate(over="ignore", invalid="ignore"):
        want = rms_sessions["kernel"].run(None, feeds)[0]
    assert_same_bits(rms_sessions["portable"].run(None, feeds)[0], want, f"n={n}")
    w16 = w.astype(ml_dtypes.bfloat16)
    bf16 = {"X": ort.OrtValue.ortvalue_from_numpy(x),
            "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(w16.view(np.uint16),
                                                                  TensorProto.BFLOAT16)}
    want16 = rms_sessions["kernel_bf16"].run_with_ort_values(["Y"], bf16)[0].numpy()
    got16 = rms_sessions["portable_bf16"].run_with_ort_values(["Y"], bf16)[0].numpy()
    assert_same_bits(got16, want16, f"n={n}, bfloat16 W")


def test_the_rows_tell_summation_orders_apart(rms_sessions) -> None:
    """Control: on the same rows, ReduceMean (another order) differs from the kernel for
    most widths, so the test above could fail."""
    differ = 0
    for n in WIDTHS:
        feeds = {"X": adversarial_rows(n, seed=n), "W": np.ones(n, np.float32)}
        want = rms_sessions["kernel"].run(None, feeds)[0]
        got = rms_sessions["reduce_mean"].run(None, feeds)[0]
        differ += int(not np.array_equal(np.nan_to_num(got).view(np.uint32),
                                         np.nan_to_num(want).view(np.uint32)))
    assert differ > len(WIDTHS) // 2, f"only {differ} of {len(WIDTHS)} widths differ"


@pytest.mark.parametrize("shape", [(1, 0, 64), (0, 7), (3, 0), (2, 0, 0)])
def test_portable_body_on_empty_inputs(shape: tuple[int, ...]) -> None:
    """No rows (a decode step's empty selection) or no columns: an empty Y of X's shape."""
    n = shape[-1]
    x = np.zeros(shape, np.float32)
    w = np.ones(n, np.float32)
    node = helper.make_node("TorchRMSNorm", ["X", "W"], ["Y"], domain="csa2onnx", epsilon=1e-6)
    graph = helper.make_graph(
        [node], "rms", [helper.make_tensor_value_info("X", TensorProto.FLOAT, None),
                        helper.make_tensor_value_info("W", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    for session in (make_session(custom_op_model(graph)),
                    ort.InferenceSession(custom_op_model(graph, portable=True),
                                         providers=["CPUExecutionProvider"])):
        assert session.run(None, {"X": x, "W": w})[0].shape == shape


def test_portable_body_at_a_deeper_cascade(rms_sessions) -> None:
    """Past 2^19 groups (n >= 2^24 + 32) torch's cascade takes 2^5 entries a level: the
    body computes its step from n, as the kernel does (one row of 16.8M values)."""
    n = (1 << 24) + 40
    rng = np.random.default_rng(5)
    block = (rng.standard_normal(4099) * np.exp2(rng.uniform(-12, 12, 4099))).astype(np.float32)
    x = np.resize(block, (1, n))
    feeds = {"X": x, "W": np.ones(n, np.float32)}
    assert_same_bits(rms_sessions["portable"].run(None, feeds)[0],
                     rms_sessions["kernel"].run(None, feeds)[0], f"n={n}")


@pytest.mark.parametrize("w_type", [TensorProto.FLOAT, TensorProto.BFLOAT16], ids=["f32", "bf16"])
def test_round_output_is_the_cast_pair(w_type: int) -> None:
    """round_output=1 rounds Y through bfloat16 as onnxruntime's Cast pair does (NaN, inf,
    ties and values past bf16's range included), for float and bf16 weights."""
    x = adversarial_rows(1536, seed=5)
    x[1, :4] = [3e38, -3e38, 1.0, 1.0]  # Y past bf16's largest finite value
    w = (np.random.default_rng(6).random(1536) + 0.5).astype(np.float32)
    w_feed = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
        w.astype(ml_dtypes.bfloat16).view(np.uint16), TensorProto.BFLOAT16)
        if w_type == TensorProto.BFLOAT16 else ort.OrtValue.ortvalue_from_numpy(w))
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(x), "W": w_feed}
    plain, rounded = (make_session(rms_node_model(w_type, portable=False, round_output=r))
                      for r in (0, 1))
    unrounded = plain.run_with_ort_values(["Y"], feeds)[0].numpy()
    got = rounded.run_with_ort_values(["Y"], feeds)[0].numpy()
    assert not np.array_equal(np.nan_to_num(unrounded), np.nan_to_num(cast_pair(unrounded)))
    assert_same_bits(got, cast_pair(unrounded), "round_output")


def test_round_output_must_be_0_or_1() -> None:
    with pytest.raises(Exception, match="TorchRMSNorm: round_output must be 0 or 1, got 2"):
        make_session(rms_node_model(TensorProto.FLOAT, portable=False, round_output=2))


@pytest.mark.parametrize("rounded", [False, True], ids=["unrounded", "rounded"])
@pytest.mark.parametrize("portable", [False, True], ids=["kernel", "portable"])
def test_wrapper_builds_the_op_node_either_way(portable: bool, rounded: bool) -> None:
    """ops.torch_rms_norm emits the TorchRMSNorm node in every graph (one mechanism): a
    portable model carries the body and runs it without the library, same bits. Rounded,
    the kernel rounds (round_output) where a portable graph has the Cast pair."""
    import onnx_ir as ir

    from csa2onnx.custom_ops.ops import torch_rms_norm
    from csa2onnx.graphs.numerics import FLOAT
    from csa2onnx.graphs.standalone import build_model

    n = 1536
    x = adversarial_rows(n, seed=3)
    w = (np.random.default_rng(4).random(n) + 0.5).astype(np.float32)

    def body(op, x):
        return torch_rms_norm(op, x, op.Constant(value=ir.tensor(w)), 1e-6, rounded=rounded)

    model = build_model("rms", [("x", FLOAT, ["r", n])], ["y"], body, portable=portable)
    assert [node.op_type for node in model.graph.node if node.domain == "csa2onnx"] == [
        "TorchRMSNorm"]
    casts = sum(node.op_type == "Cast" for node in model.graph.node)
    assert casts == (2 if rounded and portable else 0)
    got = run_model(model, {"x": x}, library=not portable)["y"]
    want = make_session(rms_node_model(TensorProto.FLOAT, portable=False)).run(
        None, {"X": x, "W": w})[0]
    assert_same_bits(got, cast_pair(want) if rounded else want, "wrapper")
