"""TorchLinear through onnxruntime: bit for bit against torch's F.linear (bf16 weights: the
bf16 result; f32 weights: the float32 result), against a NumPy emulation of each summation
order on every instruction-set path the CPU offers, constant and fed weights, thread-count
independence, empty shapes, clear errors, and the standard-op body; W in the panels64 layout
(read in place) against the plain one."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from helpers import cast_pair, custom_op_model
from onnx import TensorProto, helper, numpy_helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.portable import portable_functions
from csa2onnx.custom_ops.weight_layout import PackedWeight, pack_panels, unpack_panels
from csa2onnx.graphs.standalone import IR_VERSION

W_TYPES = {"bf16": TensorProto.BFLOAT16, "f32": TensorProto.FLOAT}
ISAS = ("avx512bf16", "avx512", "avx2", "scalar", "reference")
Errors = (ort.capi.onnxruntime_pybind11_state.InvalidArgument,
          ort.capi.onnxruntime_pybind11_state.InvalidGraph,
          ort.capi.onnxruntime_pybind11_state.NotImplemented,
          ort.capi.onnxruntime_pybind11_state.RuntimeException,
          ort.capi.onnxruntime_pybind11_state.Fail)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even bf16 value, as float32."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def linear_model(w_type: int, w_const: np.ndarray | None = None, *,
                 portable: bool = False) -> bytes:
    """Y = TorchLinear(X, W) with X of unknown rank; W a graph input, or an initializer."""
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)]
    initializers = []
    if w_const is None:
        inputs.append(helper.make_tensor_value_info("W", w_type, None))
    elif w_type == TensorProto.BFLOAT16:
        bits = (np.ascontiguousarray(w_const, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        initializers.append(helper.make_tensor("W", TensorProto.BFLOAT16, w_const.shape,
                                               bits.tobytes(), raw=True))
    else:
        initializers.append(numpy_helper.from_array(np.asarray(w_const, np.float32), "W"))
    graph = helper.make_graph(
        [helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx")], "linear",
        inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)],
                              functions=portable_functions() if portable else [],
                              ir_version=IR_VERSION)
    return model.SerializeToString()


def quiet_options(threads: int = 0) -> ort.SessionOptions:
    options = session_options(threads)
    options.log_severity_level = 4  # expected errors would otherwise print red log lines
    return options


def session_for(model: bytes, isa: str | None = None, threads: int = 0) -> ort.InferenceSession:
    """A session whose TorchLinear kernels take the `isa` path (read at kernel creation)."""
    old = os.environ.get("CSA_TORCH_LINEAR_ISA")
    if isa is not None:
        os.environ["CSA_TORCH_LINEAR_ISA"] = isa
    try:
        return make_session(model, options=quiet_options(threads))
    finally:
        if old is None:
            os.environ.pop("CSA_TORCH_LINEAR_ISA", None)
        else:
            os.environ["CSA_TORCH_LINEAR_ISA"] = old


def w_feed(w: np.ndarray, w_type: str) -> ort.OrtValue:
    if w_type == "bf16":  # w is bf16-valued: the top half of its bits is the bf16
        bits = (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(w, np.float32))


def run(session: ort.InferenceSession, x: np.ndarray, w: np.ndarray | None = None,
        w_type: str = "f32") -> np.ndarray:
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(np.asarray(x, np.float32, order="C"))}
    if w is not None:
        feeds["W"] = w_feed(w, w_type)
    return session.run_with_ort_values(["Y"], feeds)[0].numpy()


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def fed_sessions() -> dict[tuple[str, str], ort.InferenceSession]:
    """(isa, w_type) -> session with W fed as an input, for every path this CPU has."""
    out = {}
    for isa in ISAS:
        for name, onnx_type in W_TYPES.items():
            try:
                out[(isa, name)] = session_for(linear_model(onnx_type), isa)
            except Errors as e:
                assert "does not support it" in str(e)
    return out


# ------------------------------------------------------- NumPy emulation of the orders
def _fma(acc: np.ndarray, p: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, acc) for float64 `acc` (float32 values) and exact products `p`:
    the float64 sum is made round-to-odd (TwoSum error), so rounding it to float32 is the
    correctly rounded fused result."""
    s = acc + p
    bv = s - acc
    err = (acc - (s - bv)) + (p - bv)
    even = (s.view(np.uint64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32).astype(np.float64)


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a + b).astype(np.float32).astype(np.float64)


def emulate(x: np.ndarray, w: np.ndarray, w_bf16: bool) -> np.ndarray:
    """The op's definition (torch_linear.h) on [M, K] x [N, K], in float64 steps."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    (m, k), n = x.shape, w.shape[0]

    def prod(j: int) -> np.ndarray:  # exact in float64
        return np.outer(x[:, j], w[:, j])

    zero = np.zeros((m, n))
    if w_bf16 and m * k * n > 4096:  # oneDNN: pairs (k+1 first), chunks added
        chunk = k if k <= 512 else 512 if (m == 1 or k <= 1024) else 1024
        out = zero
        for k0 in range(0, k, chunk):
            acc = zero
            for j in range(k0, min(k, k0 + chunk), 2):
                if j + 1 < min(k, k0 + chunk):
                    acc = _fma(acc, prod(j + 1))
                acc = _fma(acc, prod(j))
            out = _add(out, acc)
        return out.astype(np.float32)
    if w_bf16:  # torch's 8-lane dot product
        main, vec = k & ~63, k & ~15
        reg = [[zero] * 8 for _ in range(8)]
        for j in range(0, main, 64):
            reg = [[_fma(reg[r][lane], prod(j + 8 * r + lane)) for lane in range(8)]
                   for r in range(8)]
        for off in (4, 2, 1):
            reg = [[_add(reg[r][lane], reg[r + off][lane]) for lane in range(8)]
                   for r in range(off)]

        def fold(v: list[np.ndarray]) -> np.ndarray:
            for off in (4, 2, 1):
                v = [_add(v[lane], v[lane + off]) for lane in range(off)]
            return v[0]

        total = fold(reg[0])
        tail = [zero] * 8
        for j in range(main, vec, 16):
            tail = [_fma(_fma(tail[lane], prod(j + lane)), prod(j + 8 + lane))
                    for lane in range(8)]
        total = _add(total, fold(tail))
        for j in range(vec, k):
            total = _fma(total, prod(j))
        return total.astype(np.float32)
    if m >= 4 and n >= 12:  # MKL sgemm: sequential fma chunks
        chunk = k if k <= 192 else k // 2 if k <= 384 else 192
        out = zero
        for k0 in range(0, k, max(chunk, 1)):
            acc = zero
            for j in range(k0, min(k, k0 + chunk)):
                acc = _fma(acc, prod(j))
            out = _add(out, acc)
        return out.astype(np.float32)
    head = (k - 1) % 4 + 1 if m == 1 and k else 0  # MKL 4 lanes, multiply then add
    lanes = [zero] * 4
    for j in range(k):
        lane = 0 if j < head else (j - head) % 4
        lanes[lane] = _add(lanes[lane], prod(j).astype(np.float32).astype(np.float64))
    return _add(_add(lanes[0], lanes[2]), _add(lanes[1], lanes[3])).astype(np.float32)


EMULATION_SHAPES = [  # (M, N, K): every order, chunk rule, tail and tile edge
    (1, 70, 1100), (2, 131, 1029), (3, 33, 1100), (4, 70, 1100), (7, 64, 701),  # oneDNN pairs
    (3, 70, 513), (4, 131, 1029), (4, 9, 130),
    (13, 65, 130), (50, 20, 96),
    (1, 16, 256), (2, 8, 130), (3, 5, 77), (1, 3, 200), (4, 4, 64),  # torch dot (<= 4096)
    (4, 12, 200), (9, 100, 385), (6, 64, 500), (61, 17, 1000), (5, 13, 7),  # MKL chunks
    (1, 20, 13), (1, 9, 14), (1, 64, 15), (1, 40, 16), (2, 30, 99), (3, 7, 33),  # MKL lanes
    (50, 11, 40),
]


def emulation_cases() -> Iterator[tuple[str, int, int, int]]:
    for m, n, k in EMULATION_SHAPES:
        for w_type in ("bf16", "f32"):
            yield w_type, m, n, k


@pytest.mark.parametrize(("w_type", "m", "n", "k"), list(emulation_cases()))
def test_every_path_matches_the_emulation_bit_for_bit(fed_sessions, w_type: str, m: int,
                                                      n: int, k: int) -> None:
    rng = np.random.default_rng(m * 1000003 + n * 1009 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)  # not bf16-valued: products round
    w = rng.standard_normal((n, k)).astype(np.float32)
    if w_type == "bf16":
        w = bf16_round(w)
    want = emulate(x, w, w_type == "bf16")
    for (isa, wt), session in fed_sessions.items():
        if wt == w_type:
            got = run(session, x, w, w_type)
            np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"isa={isa}")


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_constant_weights_are_packed_once_and_give_the_same_bits(fed_sessions,
                                                                 w_type: str) -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((200, 640)).astype(np.float32)
    if w_type == "bf16":
        w = bf16_round(w)
    for isa in {isa for isa, _ in fed_sessions}:
        const = session_for(linear_model(W_TYPES[w_type], w), isa)
        for m in (1, 2, 5, 49, 100):
            x = bf16_round(rng.standard_normal((m, 640)).astype(np.float32))
            np.testing.assert_array_equal(bits(run(const, x)),
                                          bits(run(fed_sessions[(isa, w_type)], x, w, w_type)))


def test_ranks_and_empty_shapes(fed_sessions) -> None:
    session = fed_sessions[("scalar", "f32")]
    rng = np.random.default_rng(9)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    x3 = rng.standard_normal((2, 3, 5)).astype(np.float32)
    y3 = run(session, x3, w)
    assert y3.shape == (2, 3, 6)
    np.testing.assert_array_equal(bits(y3), bits(run(session, x3.reshape(6, 5), w)).reshape(
        2, 3, 6))
    y1 = run(session, x3[0, 0], w)
    assert y1.shape == (6,)
    np.testing.assert_array_equal(bits(y1), bits(emulate(x3[0, 0][None], w, False)[0]))
    assert run(session, np.zeros((0, 5), np.float32), w).shape == (0, 6)
    assert run(session, x3, np.zeros((0, 5), np.float32)).shape == (2, 3, 0)
    for key in (("scalar", "bf16"), ("reference", "f32")):
        y = run(fed_sessions[key], np.ones((4, 0), np.float32), np.zeros((3, 0), np.float32),
                key[1])
        assert y.shape == (4, 3) and not y.any()


# ---------------------------------------------------------------------- vs torch
def torch_module():
    return pytest.importorskip("torch", reason="compares against torch's F.linear; "
                                               "torch not installed")


@functools.cache
def torch_like_goldens() -> bool:
    """Whether torch here sums F.linear like the goldens' CPU (tools/torch_reference.py's
    probe): torch picks its kernels by CPU (oneDNN: AMX, AVX512-BF16 or neither; MKL: by
    vendor), and each sums in its own order."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import torch_reference

    return torch_reference.torch_sums_like_goldens()


def assert_agrees_with_torch(got: np.ndarray, want: np.ndarray, w_type: str, msg: str,
                             exact_columns: int | None = None) -> None:
    """Bit for bit where torch sums like the goldens' CPU (the first `exact_columns`
    columns, where MKL's leftover columns differ), else the cross-CPU bound on a linear:
    bf16 outputs at most one bf16 step apart (a flipped rounding), f32 within 1e-5."""
    if torch_like_goldens():
        cols = slice(None, exact_columns)
        np.testing.assert_array_equal(bits(got[..., cols]), bits(want[..., cols]), err_msg=msg)
    tol = 2.0**-7 if w_type == "bf16" else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=msg)


TORCH_MS, TORCH_KS, TORCH_NS = (1, 2, 7, 77, 300), (64, 128, 256, 320, 1024), (4, 64, 128, 512)


def assert_matches_torch(w_type: str, shapes: list[tuple[int, int, int]], seed: int) -> None:
    """bf16: bf16(Y) against torch's bf16 F.linear (oneDNN / torch's dot); f32: Y against
    torch's float32 F.linear (MKL sgemm); shapes are (M, N, K). torch runs with 1 thread:
    MKL's f32 order for some row counts depends on its thread count."""
    torch = torch_module()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = session_for(linear_model(W_TYPES[w_type]))
        gen = torch.Generator().manual_seed(seed)
        for m, n, k in shapes:
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            if w_type == "bf16":
                x, w = x.bfloat16(), w.bfloat16()
                want = torch.nn.functional.linear(x, w).float().numpy()
                got = bf16_round(run(session, x.float().numpy(), w.float().numpy(), "bf16"))
            else:
                want = torch.nn.functional.linear(x, w).numpy()
                got = run(session, x.numpy(), w.numpy())
            assert_agrees_with_torch(got, want, w_type, f"{w_type} M={m} K={k} N={n}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_matches_torch_linear_bit_for_bit(w_type: str) -> None:
    """Every shape of the grid, M = 1 included."""
    assert_matches_torch(w_type, [(m, n, k) for m in TORCH_MS for k in TORCH_KS
                                  for n in TORCH_NS], seed=11)


def test_torch_threshold_and_chunk_edges() -> None:
    """bf16 shapes on both sides of torch's M*K*N > 4096 switch and oneDNN's chunk sizes."""
    torch = torch_module()
    torch.set_num_threads(1)
    session = session_for(linear_model(TensorProto.BFLOAT16))
    gen = torch.Generator().manual_seed(12)
    for m, n, k in [(1, 16, 256), (1, 16, 257), (2, 8, 256), (2, 8, 257), (1, 2, 2048),
                    (1, 3, 2048), (1, 64, 513), (1, 64, 2000), (4, 64, 1025), (4, 64, 3000),
                    (2, 64, 1024), (3, 20, 511)]:
        for _ in range(3):
            x = torch.randn(m, k, generator=gen).bfloat16()
            w = torch.randn(n, k, generator=gen).bfloat16()
            want = torch.nn.functional.linear(x, w).float().numpy()
            got = bf16_round(run(session, x.float().numpy(), w.float().numpy(), "bf16"))
            assert_agrees_with_torch(got, want, "bf16", f"M={m} K={k} N={n}")


def test_mkl_leftover_columns_are_close_not_exact() -> None:
    """MKL sums the last N % 4 columns of a lanes-path product (M <= 3 or N < 12) in another
    order: the op is exact on the other columns and close on those."""
    torch = torch_module()
    torch.set_num_threads(1)
    session = session_for(linear_model(TensorProto.FLOAT))
    gen = torch.Generator().manual_seed(13)
    for m, n, k in [(1, 5, 128), (2, 11, 256), (3, 17, 64), (8, 10, 512), (1, 3, 96)]:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        want = torch.nn.functional.linear(x, w).numpy()
        got = run(session, x.numpy(), w.numpy())
        assert_agrees_with_torch(got, want, "f32", f"M={m} K={k} N={n}", n - n % 4)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


# ---------------------------------------------------------- threads, errors, portable
@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_thread_count_does_not_change_a_bit(w_type: str) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 700)).astype(np.float32)
    if w_type == "bf16":
        w = bf16_round(w)
    results = []
    for threads in (1, 2):
        session = session_for(linear_model(W_TYPES[w_type], w), threads=threads)
        results.append([run(session, rng_x) for rng_x in (
            np.random.default_rng(4).standard_normal((m, 700)).astype(np.float32)
            for m in (1, 97, 250))])
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize(("x_shape", "w_shape", "message"), [
    ((3, 5), (4, 6), r"TorchLinear: the last dimension of X \(5\) must equal K, the second "
                     r"dimension of W \(6\); X shape \[3, 5\], W shape \[4, 6\]"),
    ((3, 5), (2, 4, 5), r"TorchLinear: W must be \[N, K\] \(rank 2\), got shape \[2, 4, 5\]"),
    ((3, 5), (5,), r"TorchLinear: W must be \[N, K\] \(rank 2\), got shape \[5\]"),
    ((), (4, 5), r"TorchLinear: X must have rank >= 1, got a scalar"),
])
@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_bad_shapes_are_clear_errors(fed_sessions, x_shape: tuple, w_shape: tuple,
                                     message: str, w_type: str) -> None:
    for (_, wt), session in fed_sessions.items():
        if wt != w_type:
            continue
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
            run(session, np.ones(x_shape, np.float32), np.ones(w_shape, np.float32), w_type)


def test_constant_weights_of_a_bad_rank_are_reported_at_run_time() -> None:
    session = session_for(linear_model(TensorProto.FLOAT, np.ones((2, 3, 4), np.float32)))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"W must be \[N, K\] \(rank 2\), got shape \[2, 3, 4\]"):
        run(session, np.ones((1, 4), np.float32))


def test_unsupported_types_and_paths_are_clear_errors() -> None:
    with pytest.raises(Errors, match="TorchLinear"):  # no float16 kernel
        session_for(linear_model(TensorProto.FLOAT16))
    with pytest.raises(Errors, match=r"CSA_TORCH_LINEAR_ISA=\"sse9\" \(expected avx512, "
                                     r"avx2, scalar, reference or avx512bf16\)"):
        session_for(linear_model(TensorProto.FLOAT), "sse9")


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_portable_body_matches_the_op(w_type: str) -> None:
    rng = np.random.default_rng(8)
    w = rng.standard_normal((96, 320)).astype(np.float32)
    if w_type == "bf16":
        w = bf16_round(w)
    x = bf16_round(rng.standard_normal((2, 7, 320)).astype(np.float32))
    portable = ort.InferenceSession(linear_model(W_TYPES[w_type], w, portable=True),
                                    providers=["CPUExecutionProvider"])
    kernel = session_for(linear_model(W_TYPES[w_type], w))
    got = portable.run(["Y"], {"X": x})[0]
    want = run(kernel, x)
    assert got.shape == want.shape == (2, 7, 96)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


# ------------------------------------------------- the released model's sizes (large K)
LARGE_K_SHAPES = [(2, 128, 5120), (7, 512, 1280), (64, 1024, 4096), (256, 128, 8192),
                  (5, 1280, 5120), (512, 128, 1280)]  # (M, N, K)


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_large_k_matches_torch_bit_for_bit(w_type: str) -> None:
    """K of the released model (1280, 4096, 5120, 8192)."""
    assert_matches_torch(w_type, LARGE_K_SHAPES, seed=14)


# ------------------------------------------- the vdpbf16ps path (avx512bf16, bf16 weights)
def has_avx512bf16() -> bool:
    from csa2onnx.custom_ops.library import cpu_isas

    return "avx512bf16" in cpu_isas()


needs_avx512bf16 = pytest.mark.skipif(not has_avx512bf16(),
                                      reason="this CPU has no AVX512_BF16")


def dp_calls() -> int:
    from csa2onnx.custom_ops.library import torch_linear_dp_calls

    return torch_linear_dp_calls()


def bf16_values(rng: np.random.Generator, shape: tuple[int, ...], exponents: tuple[int, int],
                zeros: float = 0.0) -> np.ndarray:
    """Random bf16 values (as float32): random sign and 7-bit mantissa, exponent uniform in
    [lo, hi], a fraction `zeros` of them +0 or -0."""
    lo, hi = exponents
    sign = rng.integers(0, 2, shape).astype(np.uint32) << 31
    exponent = (rng.integers(lo, hi + 1, shape) + 127).astype(np.uint32) << 23
    mantissa = rng.integers(0, 128, shape).astype(np.uint32) << 16
    v = (sign | exponent | mantissa).view(np.float32)
    return np.where(rng.random(shape) < zeros, np.copysign(np.float32(0), v), v)


def bf16_denormals(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random nonzero bf16 denormals (m * 2^-133, m in 1..127, random sign) as float32."""
    sign = rng.integers(0, 2, shape).astype(np.uint32) << 31
    return (sign | (rng.integers(1, 128, shape).astype(np.uint32) << 16)).view(np.float32)


@pytest.fixture(scope="module")
def dp_and_reference() -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """(avx512bf16, reference) sessions with bf16 W fed as an input."""
    if not has_avx512bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    model = linear_model(TensorProto.BFLOAT16)
    return session_for(model, "avx512bf16"), session_for(model, "reference")


def assert_dp_matches_reference(sessions: tuple[ort.InferenceSession, ort.InferenceSession],
                                x: np.ndarray, w: np.ndarray, *, dp: bool, msg: str) -> None:
    """Bit for bit against the reference; `dp`: whether the call must run on vdpbf16ps (else
    it must fall back to the fmaf tiles). NaN compares equal to NaN."""
    fast, reference = sessions
    before = dp_calls()
    got = run(fast, x, w, "bf16")
    assert dp_calls() - before == int(dp), f"{msg}: vdpbf16ps path {'not ' * dp}taken"
    want = run(reference, x, w, "bf16")
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=msg)
    np.testing.assert_array_equal(bits(np.where(nan, 0, got)), bits(np.where(nan, 0, want)),
                                  err_msg=msg)


# (M, N, K): tiles, chunk edges, odd K, and 1-4 rows over 5 panels (on an AMX CPU decode
# tasks take two panels at a time: two pairs, then one alone)
DP_SHAPES = [(m, n, k) for m in (1, 2, 3, 4, 5, 6, 7, 64, 65) for n, k in
             ((17, 511), (65, 512), (63, 513), (130, 1023), (1, 1024), (64, 1025))] + [
    (2, 70, 2047), (3, 129, 2048), (1, 40, 2049), (13, 65, 3001), (100, 200, 96), (97, 30, 33),
    (12, 350, 1), (200, 5, 2), (49, 64, 4096),
    (1, 300, 1100), (2, 257, 2049), (3, 320, 1024), (4, 300, 2047)]


@pytest.mark.parametrize(("m", "n", "k"), DP_SHAPES)
def test_avx512bf16_matches_the_reference_bit_for_bit(dp_and_reference, m: int, n: int,
                                                      k: int) -> None:
    """bf16-valued X (the case the path is for): normals, and a wide exponent spread with
    signed zeros (exponents -50..50 in X and W, every tenth value +-0)."""
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    x = bf16_round(rng.standard_normal((m, k)).astype(np.float32))
    w = bf16_round(rng.standard_normal((n, k)).astype(np.float32))
    dp = m * n * k > 4096  # smaller problems are torch's dot product: the reference runs them
    assert_dp_matches_reference(dp_and_reference, x, w, dp=dp, msg=f"normal M={m} N={n} K={k}")
    x = bf16_values(rng, (m, k), (-50, 50), zeros=0.1)
    w = bf16_values(rng, (n, k), (-50, 50), zeros=0.1)
    assert_dp_matches_reference(dp_and_reference, x, w, dp=dp, msg=f"wide M={m} N={n} K={k}")


@needs_avx512bf16
def test_avx512bf16_on_adversarial_sums(dp_and_reference) -> None:
    """Cancellation down to the last bits (huge terms of both signs among small ones, as
    torch's summation-tree probes), sums that land on float32 and bf16 ties, rows of -0 and
    +0, and the tiniest exponents the path accepts (products 2^-112, partial sums down to
    2^-126 by cancellation): all on vdpbf16ps, all bit for bit."""
    rng = np.random.default_rng(21)
    m, n, k = 7, 70, 1100
    for trial in range(6):
        x = bf16_round(rng.standard_normal((m, k)).astype(np.float32))
        w = bf16_round(rng.standard_normal((n, k)).astype(np.float32))
        big = rng.integers(0, k, (4,))
        x[:, big] = np.float32(2.0**40) * np.sign(rng.standard_normal((m, 4))).astype(np.float32)
        w[:, big] = np.float32(2.0**20)  # +-2^60 terms: the small ones survive only in order
        assert_dp_matches_reference(dp_and_reference, x, w, dp=True, msg=f"probe {trial}")
    # Ties: 1 + 2^-24 (+ 2^-24 ...) rounds to even at every step, and bf16-boundary sums.
    x = np.ones((3, 1024), np.float32)
    w = np.full((65, 1024), 2.0**-24, np.float32)
    w[:, 0] = 1.0
    w[1::2, 1::3] = 2.0**-8
    assert_dp_matches_reference(dp_and_reference, x, w, dp=True, msg="ties")
    # Signed zeros: rows of -0 times anything, +0 times -0, exact cancellations to 0.
    x = np.full((5, 600), -0.0, np.float32)
    x[1] = 0.0
    x[2, :2] = (1.0, -1.0)
    x[3] = bf16_values(rng, (600,), (-3, 3))
    x[4] = -x[3]
    w = bf16_values(rng, (66, 600), (-3, 3), zeros=0.3)
    w[:3] = np.copysign(np.float32(0), w[:3])
    w[3, :2] = (1.0, 1.0)
    assert_dp_matches_reference(dp_and_reference, x, w, dp=True, msg="signed zeros")
    # The smallest exponents accepted: ex_min + ew_min = -112.
    x = bf16_values(rng, (6, 1030), (-56, -40))
    w = bf16_values(rng, (64, 1030), (-56, -50))
    x[:, 0], w[:, 0] = 2.0**-56, 2.0**-56
    assert_dp_matches_reference(dp_and_reference, x, w, dp=True, msg="tiny exponents")
    # The largest accepted: ex_max + ew_max + 3 + ceil(log2 K) = 127 (K = 1030: 11).
    x = bf16_values(rng, (6, 1030), (40, 56))
    w = bf16_values(rng, (64, 1030), (40, 57))
    x[:, 0], w[:, 0] = 1.5 * 2.0**56, 1.5 * 2.0**57
    assert_dp_matches_reference(dp_and_reference, x, w, dp=True, msg="huge exponents")


@needs_avx512bf16
def test_avx512bf16_falls_back_where_vdpbf16ps_would_differ(dp_and_reference) -> None:
    """vdpbf16ps reads X as bf16 and flushes denormal inputs and results to zero (and an
    overflowing product may be rounded before it is added); fmaf does none of that. Each such
    call runs on the fmaf tiles instead, with the reference's bits. Forcing the path on them
    changes the bits of the non-bf16 X, denormal and underflow cases (checked once by hand);
    the exponent-bound cases are the precondition's edges, conservative on purpose."""
    rng = np.random.default_rng(22)
    m, n, k = 6, 80, 1030
    x0 = bf16_round(rng.standard_normal((m, k)).astype(np.float32))
    w0 = bf16_round(rng.standard_normal((n, k)).astype(np.float32))
    assert_dp_matches_reference(dp_and_reference, x0, w0, dp=True, msg="control")

    def case(msg: str, x: np.ndarray | None = None, w: np.ndarray | None = None) -> None:
        assert_dp_matches_reference(dp_and_reference, x0 if x is None else x,
                                    w0 if w is None else w, dp=False, msg=msg)

    x = x0.copy()
    x[3, 100] = np.nextafter(x[3, 100], np.float32(np.inf))  # one value not bf16-exact
    case("one X value not bf16", x)
    x = rng.standard_normal((m, k)).astype(np.float32)  # products need more than 16 bits
    case("X not bf16", x)
    x = x0.copy()
    x[2] = bf16_denormals(rng, (k,))  # DAZ would read them as 0
    case("denormal X", x)
    w = w0.copy()
    w[5] = bf16_denormals(rng, (k,))
    case("denormal W", w=w)
    # Products below 2^-126 (2^-64 * 2^-64): vdpbf16ps would flush them, fmaf keeps them.
    case("underflowing products", bf16_values(rng, (m, k), (-64, -60)),
         bf16_values(rng, (n, k), (-64, -60)))
    # Normal products whose sum is a denormal: (1 + 2^-7) 2^-126 - 2^-126 = 2^-133.
    x = np.zeros((m, k), np.float32)
    w = np.zeros((n, k), np.float32)
    x[:, 0], x[:, 1], w[:, :2] = (1 + 2.0**-7) * 2.0**-63, -(2.0**-63), 2.0**-63
    case("denormal partial sum", x, w)
    # One step past the smallest accepted exponent sum: ex_min + ew_min = -113.
    x = bf16_values(rng, (m, k), (-56, -40))
    w = bf16_values(rng, (n, k), (-56, -50))
    x[0, 0], w[0, 0] = 2.0**-57, 2.0**-56
    case("exponent sum -113", x, w)
    # 2^64 * 2^64 overflows as a float32 product, while fmaf adds it exactly to the partial
    # sum -2^127 (k = 1 comes first in the pair) and stays finite: 2^127. (This CPU's
    # vdpbf16ps keeps the product exact too; the path does not rely on it.)
    x = x0.copy()
    w = w0.copy()
    x[:, 0], w[:, 0] = 2.0**64, 2.0**64
    x[:, 1], w[:, 1] = -(2.0**127), 1.0
    case("overflowing product", x, w)
    x = x0.copy()
    x[1, 1] = np.inf
    x[4, 2] = np.nan
    case("inf and NaN in X", x)
    w = w0.copy()
    w[7, 3] = -np.inf
    case("inf in W", w=w)
    x = bf16_values(rng, (m, k), (40, 56))
    w = bf16_values(rng, (n, k), (40, 57))
    x[:, 0], w[:, 0] = 1.5 * 2.0**56, 1.5 * 2.0**58  # one past the largest accepted
    case("exponent sum past the overflow bound", x, w)
    # X is converted in groups of 32 rows, in parallel: a value in a late group counts too.
    many = bf16_round(rng.standard_normal((300, k)).astype(np.float32))
    assert_dp_matches_reference(dp_and_reference, many, w0, dp=True, msg="300 rows")
    for row, value, msg in ((290, np.float32(1 + 2.0**-20), "row 290 not bf16"),
                            (200, np.float32(2.0**-130), "denormal in row 200")):
        x = many.copy()
        x[row, 5] = value
        case(msg, x)


@needs_avx512bf16
def test_avx512bf16_thread_count_and_constant_weights(dp_and_reference) -> None:
    """1 or 2 threads, constant W (packed once), the same bits as the reference; all on
    vdpbf16ps."""
    rng = np.random.default_rng(23)
    w = bf16_round(rng.standard_normal((300, 1100)).astype(np.float32))
    ref = dp_and_reference[1]
    for threads in (1, 2):
        const = session_for(linear_model(TensorProto.BFLOAT16, w), "avx512bf16",
                            threads=threads)
        for m in (1, 4, 97, 250):
            x = bf16_round(rng.standard_normal((m, 1100)).astype(np.float32))
            before = dp_calls()
            got = run(const, x)
            assert dp_calls() == before + 1
            np.testing.assert_array_equal(bits(got), bits(run(ref, x, w, "bf16")),
                                          err_msg=f"threads={threads} M={m}")


def test_avx512bf16_is_a_clear_error_where_the_cpu_lacks_it() -> None:
    if has_avx512bf16():
        session_for(linear_model(TensorProto.FLOAT), "avx512bf16")  # f32 W: the avx512 tiles
        return
    with pytest.raises(Errors, match="CSA_TORCH_LINEAR_ISA=avx512bf16 but this CPU does not "
                                     "support it"):
        session_for(linear_model(TensorProto.BFLOAT16), "avx512bf16")


# ------------------------------------------------------------------ the panels64 layout
def panels_model(w: np.ndarray, w_type: str, *, const: bool = True,
                 attrs: dict | None = None) -> bytes:
    """Y = TorchLinear(X, W) with W (bf16-valued float32 or float32 [N, K]) in the panels64
    layout: an initializer (`const`) or a graph input; `attrs` replaces the node's."""
    n, k = w.shape
    packed = pack_panels(w.astype(ml_dtypes.bfloat16) if w_type == "bf16" else w).panels
    return panels_model_of(packed, W_TYPES[w_type], const=const,
                           attrs={"weight_layout": "panels64", "out_features": n,
                                  "in_features": k} if attrs is None else attrs)


def panels_model_of(panels: np.ndarray, w_type: int, *, const: bool = True,
                    attrs: dict) -> bytes:
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)]
    initializers = []
    if not const:
        inputs.append(helper.make_tensor_value_info("W", w_type, None))
    elif w_type == TensorProto.BFLOAT16:
        initializers.append(helper.make_tensor("W", w_type, panels.shape,
                                               panels.view(np.uint16).tobytes(), raw=True))
    else:
        initializers.append(numpy_helper.from_array(panels, "W"))
    graph = helper.make_graph(
        [helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx", **attrs)],
        "linear", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        initializers)
    return custom_op_model(graph)


def panels_feed(w: np.ndarray, w_type: str) -> ort.OrtValue:
    if w_type == "bf16":
        panels = pack_panels(w.astype(ml_dtypes.bfloat16)).panels
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(panels.view(np.uint16),
                                                               TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(pack_panels(w).panels)


def run_fed_panels(session: ort.InferenceSession, x: np.ndarray, w: np.ndarray,
                   w_type: str) -> np.ndarray:
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, np.float32)),
             "W": panels_feed(w, w_type)}
    return session.run_with_ort_values(["Y"], feeds)[0].numpy()


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_pack_panels_is_the_documented_layout(w_type: str) -> None:
    rng = np.random.default_rng(31)
    for n, k in ((1, 1), (64, 2), (65, 3), (130, 97), (5, 0), (0, 4)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        w = w.astype(ml_dtypes.bfloat16) if w_type == "bf16" else w
        packed = pack_panels(w)
        p = packed.panels
        assert packed.shape == (n, k) and p.dtype == w.dtype
        assert p.shape == ((-(-n // 64), -(-k // 2), 64, 2) if w_type == "bf16"
                           else (-(-n // 64), k, 64))
        np.testing.assert_array_equal(unpack_panels(packed), w)
        # Element [p, i, c, h] is w[64p + c, 2i + h] (f32: [p, k, c] is w[64p + c, k]), and
        # everything no weight lands on is +0.
        want = np.zeros(p.shape, p.dtype)
        cols, ks = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
        if w_type == "bf16":
            want[cols // 64, ks // 2, cols % 64, ks % 2] = w
        else:
            want[cols // 64, ks, cols % 64] = w
        uint = np.uint16 if w_type == "bf16" else np.uint32
        np.testing.assert_array_equal(p.view(uint), want.view(uint))
    with pytest.raises(ValueError, match=r"has shape \[1, 2, 64, 2\], got \[1, 2, 64\]"):
        PackedWeight(np.zeros((1, 2, 64), ml_dtypes.bfloat16), 3, 4)


PANEL_SHAPES = [  # (M, N, K): every order, odd K, N past a multiple of 64, tiny and empty
    (1, 70, 1100), (7, 64, 701), (13, 65, 130), (100, 130, 97), (3, 129, 2049),  # pairs
    (2, 64, 530), (4, 131, 1029),
    (1, 16, 256), (3, 5, 77), (1, 3, 200), (2, 1, 1),  # torch dot (<= 4096)
    (9, 100, 385), (61, 17, 1000), (5, 13, 7),  # MKL chunks
    (1, 20, 13), (2, 30, 99), (50, 11, 40)]  # MKL lanes


@pytest.mark.parametrize(("m", "n", "k"), PANEL_SHAPES)
@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_panels64_gives_the_plain_bits_on_every_path(fed_sessions, w_type: str, m: int,
                                                     n: int, k: int) -> None:
    """A panels64 W, constant or fed, against the plain layout (checked against the
    emulation above) on every path this CPU has; X bf16-valued (the vdpbf16ps path's case)
    and not."""
    rng = np.random.default_rng(m * 7 + n * 131 + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w = bf16_round(w) if w_type == "bf16" else w
    xs = (bf16_round(rng.standard_normal((m, k)).astype(np.float32)),
          rng.standard_normal((m, k)).astype(np.float32))
    for isa in sorted({isa for isa, _ in fed_sessions}):
        plain = fed_sessions[(isa, w_type)]
        const = session_for(panels_model(w, w_type), isa)
        fed = session_for(panels_model(w, w_type, const=False), isa)
        for x in xs:
            want = bits(run(plain, x, w, w_type))
            np.testing.assert_array_equal(bits(run(const, x)), want, err_msg=f"isa={isa}")
            np.testing.assert_array_equal(bits(run_fed_panels(fed, x, w, w_type)), want,
                                          err_msg=f"isa={isa}, fed")
    y = run(session_for(panels_model(w, w_type)), np.zeros((2, 0, k), np.float32))
    assert y.shape == (2, 0, n)


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_panels64_thread_count_does_not_change_a_bit(w_type: str) -> None:
    rng = np.random.default_rng(32)
    w = rng.standard_normal((300, 701)).astype(np.float32)
    w = bf16_round(w) if w_type == "bf16" else w
    plain = session_for(linear_model(W_TYPES[w_type], w), threads=1)
    for threads in (1, 2):
        packed = session_for(panels_model(w, w_type), threads=threads)
        for m in (1, 97, 250):
            x = bf16_round(np.random.default_rng(m).standard_normal((m, 701)).astype(np.float32))
            np.testing.assert_array_equal(bits(run(packed, x)), bits(run(plain, x)),
                                          err_msg=f"threads={threads} M={m}")


@needs_avx512bf16
def test_panels64_runs_on_vdpbf16ps_with_the_reference_bits(dp_and_reference) -> None:
    """The exponent range the path needs is read off the panels (constant: once; fed: per
    call), and a denormal in a fed W still sends the call to the fmaf tiles."""
    rng = np.random.default_rng(33)
    w = bf16_round(rng.standard_normal((130, 1101)).astype(np.float32))
    ref = dp_and_reference[1]
    const = session_for(panels_model(w, "bf16"), "avx512bf16", threads=2)
    fed = session_for(panels_model(w, "bf16", const=False), "avx512bf16")
    for m in (1, 6, 97):
        x = bf16_round(rng.standard_normal((m, 1101)).astype(np.float32))
        want = bits(run(ref, x, w, "bf16"))
        before = dp_calls()
        np.testing.assert_array_equal(bits(run(const, x)), want)
        np.testing.assert_array_equal(bits(run_fed_panels(fed, x, w, "bf16")), want)
        assert dp_calls() == before + 2
    w_denormal = w.copy()
    w_denormal[129, 1100] = bf16_denormals(rng, (1,))[0]
    before = dp_calls()
    np.testing.assert_array_equal(bits(run_fed_panels(fed, x, w_denormal, "bf16")),
                                  bits(run(ref, x, w_denormal, "bf16")))
    assert dp_calls() == before


@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_a_constant_panels64_w_is_read_where_it_lies(w_type: str) -> None:
    """A session given the panels as its own buffer (add_initializer, as the runtime hands
    the shared weights file to both sessions) reads that buffer on every call: negating W
    in it afterwards negates Y. The plain layout packs its own copy at session creation
    and does not see the change."""
    rng = np.random.default_rng(34)
    n, k = 70, 301
    w = rng.standard_normal((n, k)).astype(np.float32)
    w = bf16_round(w) if w_type == "bf16" else w
    x = bf16_round(rng.standard_normal((5, k)).astype(np.float32))
    onnx_type = W_TYPES[w_type]
    for layout in ("panels64", "plain"):
        plain = w.astype(ml_dtypes.bfloat16) if w_type == "bf16" else w.copy()
        if layout == "panels64":
            held = pack_panels(plain).panels
            model = panels_model(w, w_type)
        else:
            held = plain
            model = linear_model(onnx_type, w)
        held = held.view(np.uint16) if w_type == "bf16" else held
        value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(held, onnx_type)
        for isa in ("avx512bf16" if has_avx512bf16() else "avx2", "scalar", "reference"):
            options = quiet_options()
            options.add_initializer("W", value)
            os.environ["CSA_TORCH_LINEAR_ISA"] = isa
            try:
                session = make_session(model, options=options)
            finally:
                os.environ.pop("CSA_TORCH_LINEAR_ISA")
            before = run(session, x)
            sign = np.uint16(0x8000) if w_type == "bf16" else np.uint32(0x80000000)
            as_bits = held.view(np.uint16 if w_type == "bf16" else np.uint32)
            nonzero = as_bits != 0  # the padding stays +0
            as_bits[nonzero] ^= sign
            after = run(session, x)
            as_bits[nonzero] ^= sign
            expected = -before if layout == "panels64" or isa == "reference" else before
            np.testing.assert_array_equal(after, expected, err_msg=f"{layout} isa={isa}")


def test_panels64_bad_shapes_and_attributes_are_clear_errors() -> None:
    w = bf16_round(np.random.default_rng(35).standard_normal((70, 31)).astype(np.float32))
    panels = pack_panels(w.astype(ml_dtypes.bfloat16)).panels
    bf16 = TensorProto.BFLOAT16

    def attrs(**kw: object) -> dict:
        return {"weight_layout": "panels64", "out_features": 70, "in_features": 31} | kw

    for model, message in [
        (panels_model_of(panels, bf16, attrs=attrs(out_features=130)),
         r"a panels64 W \(bfloat16\) for out_features 130 and in_features 31 must have shape "
         r"\[3, 16, 64, 2\] \(\[ceil\(N/64\), ceil\(K/2\), 64, 2\]\), got \[2, 16, 64, 2\]"),
        (panels_model_of(panels, bf16, attrs=attrs(in_features=33)),
         r"must have shape \[2, 17, 64, 2\] .*, got \[2, 16, 64, 2\]"),
        (panels_model_of(panels.reshape(2, 16, 128), bf16, attrs=attrs()),
         r"must have shape \[2, 16, 64, 2\] .*, got \[2, 16, 128\]"),
        (panels_model_of(np.zeros((2, 31, 64), np.float32), TensorProto.FLOAT,
                         attrs=attrs(in_features=32)),
         r"a panels64 W \(float\) for out_features 70 and in_features 32 must have shape "
         r"\[2, 32, 64\] \(\[ceil\(N/64\), K, 64\]\), got \[2, 31, 64\]"),
        (panels_model_of(panels, bf16, attrs={"weight_layout": "panels64", "in_features": 31}),
         r"weight_layout \"panels64\" needs the attributes out_features \(N\) and in_features"),
        (panels_model_of(panels, bf16, attrs=attrs(out_features=-1)),
         r"out_features and in_features must be >= 0, got -1 and 31"),
        (panels_model_of(panels, bf16, attrs=attrs(out_features=2**63 - 1, in_features=2**63 - 1)),
         r"must have shape \[144115188075855872, 4611686018427387904, 64, 2\] .*, got "
         r"\[2, 16, 64, 2\]"),
        (panels_model_of(panels, bf16, attrs=attrs(weight_layout="rows")),
         r"unknown weight_layout \"rows\" \(expected \"plain\" or \"panels64\"\)"),
        (panels_model_of(panels, bf16, attrs=attrs(weight_layout=1)),
         r"attribute weight_layout must be a string"),
        (panels_model_of(panels, bf16, attrs=attrs(in_features=31.0)),
         r"attribute in_features must be an int"),
        (panels_model_of(w.astype(ml_dtypes.bfloat16), bf16,
                         attrs={"out_features": 70, "in_features": 31}),
         r"out_features and in_features belong to weight_layout \"panels64\""),
    ]:
        with pytest.raises(Errors, match="TorchLinear: .*" + message):
            session_for(model)  # a constant W is checked when the session is created
    for where, column, k in (((1, 3, 6, 0), 70, 6), ((0, 15, 5, 1), 5, 31)):
        bad = panels.copy()
        bad[where] = 1.0  # a column past N, or the unused half of an odd K's last pair
        with pytest.raises(Errors, match=rf"TorchLinear: a panels64 W must hold zeros in its "
                                         rf"padding; column {column} \(N is 70\), k {k} \(K is "
                                         rf"31\) is not zero"):
            session_for(panels_model_of(bad, bf16, attrs=attrs()))
        fed = session_for(panels_model_of(bad, bf16, const=False, attrs=attrs()))
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                           match="must hold zeros in its padding"):
            fed.run_with_ort_values(["Y"], {
                "X": ort.OrtValue.ortvalue_from_numpy(np.ones((2, 31), np.float32)),
                "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bad.view(np.uint16), bf16)})
    fed = session_for(panels_model(w, "bf16", const=False))
    for x_shape, w_value, message in [
        ((2, 30), panels, r"the last dimension of X \(30\) must equal in_features \(31\); X "
                          r"shape \[2, 30\]"),
        ((2, 31), panels[:1], r"must have shape \[2, 16, 64, 2\] .*, got \[1, 16, 64, 2\]"),
        ((), panels, r"X must have rank >= 1, got a scalar")]:
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                           match="TorchLinear: .*" + message):
            fed.run_with_ort_values(["Y"], {
                "X": ort.OrtValue.ortvalue_from_numpy(np.ones(x_shape, np.float32)),
                "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(w_value).view(np.uint16), bf16)})


# ------------------------------------------------------------ round_output (fused Casts)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_type", ["bf16", "f32"])
def test_round_output_is_the_cast_pair_on_every_path(isa: str, w_type: str) -> None:
    rng = np.random.default_rng(47)
    n, k = 130, 96
    w = bf16_round(rng.standard_normal((n, k)).astype(np.float32))
    plain = panels_model(w, w_type)
    rounded = panels_model(w, w_type, attrs={"weight_layout": "panels64", "out_features": n,
                                             "in_features": k, "round_output": 1})
    try:
        sessions = [session_for(m, isa) for m in (plain, rounded)]
    except Errors as e:
        assert "does not support it" in str(e)
        pytest.skip(f"this CPU has no {isa} path")
    for m in (1, 7, 100):
        x = bf16_round(rng.standard_normal((m, k)).astype(np.float32))
        x[0, :3] = [np.inf, 0.0, 1.0] if m > 1 else x[0, :3]  # inf and NaN outputs too
        x[-1, 5] = np.nan if m > 1 else x[-1, 5]
        unrounded, got = (s.run(None, {"X": x})[0] for s in sessions)
        assert not np.array_equal(bits(unrounded), bits(cast_pair(unrounded)))
        np.testing.assert_array_equal(bits(got), bits(cast_pair(unrounded)),
                                      err_msg=f"{isa} {w_type} M={m}")


def test_round_output_must_be_0_or_1() -> None:
    w = np.ones((4, 8), np.float32)
    model = panels_model(w, "f32", attrs={"weight_layout": "panels64", "out_features": 4,
                                          "in_features": 8, "round_output": 2})
    with pytest.raises(Errors, match="round_output must be 0 or 1, got 2"):
        session_for(model)
