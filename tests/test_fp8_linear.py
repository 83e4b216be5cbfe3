"""Fp8Linear through onnxruntime: bit for bit against the NumPy definition
(custom_ops/reference.py `fp8_linear`) on every instruction-set path and thread count, edge
inputs (amax floor, e4m3 subnormals, saturation, exponent spreads where a float32 block sum
would be inexact, signed zeros, NaN and inf), the upstream oracle (kernel_cpu.act_quant +
fp8_gemm through torch), the standard-op body, the graph wrapper's typing, and errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import build_cpp_driver, cast_pair, load_module
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops import ops as csa_ops
from csa2onnx.custom_ops.library import fp8_linear_counts
from csa2onnx.custom_ops.portable import portable_functions
from csa2onnx.custom_ops.reference import act_quant_e4m3, fp8_linear, round_bf16
from csa2onnx.graphs.standalone import IR_VERSION, build_model

# avx512-nofp16 and avx512-novbmi: forced for tests only
ISAS = ("avx512", "avx512-nofp16", "avx512-novbmi", "avx2", "scalar")
# the upstream reference beside the checkout (tools/upstream.py's rule)
REFERENCE_DIR = Path(os.environ.get("CSA2ONNX_UPSTREAM")
                     or Path(__file__).resolve().parents[2] / "shared" / "reference")
E4M3 = ml_dtypes.float8_e4m3fn
NAN_CODES = (0x7F, 0xFF)
Errors = (ort.capi.onnxruntime_pybind11_state.InvalidArgument,
          ort.capi.onnxruntime_pybind11_state.InvalidGraph,
          ort.capi.onnxruntime_pybind11_state.NotImplemented,
          ort.capi.onnxruntime_pybind11_state.RuntimeException,
          ort.capi.onnxruntime_pybind11_state.Fail)


# ------------------------------------------------------------------------- helpers
def fp8_model(codes: np.ndarray | None = None, w_scale: np.ndarray | None = None, *,
              portable: bool = False, attrs: dict | None = None,
              types: tuple[int, int, int] = (TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN,
                                             TensorProto.FLOAT),
              inputs: tuple[str, str, str] = ("X", "W", "WScale")) -> bytes:
    """Y = Fp8Linear(X, W, WScale); W and WScale graph inputs, or initializers when given."""
    graph_inputs, initializers = [helper.make_tensor_value_info("X", types[0], None)], []
    if codes is None:
        graph_inputs.append(helper.make_tensor_value_info("W", types[1], None))
    else:
        initializers.append(helper.make_tensor("W", TensorProto.FLOAT8E4M3FN, codes.shape,
                                               np.ascontiguousarray(codes).tobytes(), raw=True))
    if w_scale is None:
        graph_inputs.append(helper.make_tensor_value_info("WScale", types[2], None))
    else:
        initializers.append(onnx.numpy_helper.from_array(w_scale.astype(np.float32), "WScale"))
    node = helper.make_node("Fp8Linear", list(inputs), ["Y"], domain="csa2onnx", **(attrs or {}))
    graph = helper.make_graph([node], "fp8", graph_inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)],
                              functions=portable_functions() if portable else [],
                              ir_version=IR_VERSION)
    return model.SerializeToString()


def session_for(model: bytes, isa: str | None = None, threads: int = 0,
                denormals_as_zero: bool = False) -> ort.InferenceSession:
    """A session whose Fp8Linear kernels take the `isa` path (read at kernel creation)."""
    old = os.environ.get("CSA_FP8_LINEAR_ISA")
    if isa is not None:
        os.environ["CSA_FP8_LINEAR_ISA"] = isa
    try:
        options = session_options(threads)
        options.log_severity_level = 4  # expected errors would otherwise print red log lines
        if denormals_as_zero:
            options.add_session_config_entry("session.set_denormal_as_zero", "1")
        return make_session(model, options=options)
    finally:
        if old is None:
            os.environ.pop("CSA_FP8_LINEAR_ISA", None)
        else:
            os.environ["CSA_FP8_LINEAR_ISA"] = old


def run(session: ort.InferenceSession, x: np.ndarray, codes: np.ndarray | None = None,
        w_scale: np.ndarray | None = None) -> np.ndarray:
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(np.asarray(x, np.float32, order="C"))}
    if codes is not None:
        feeds["W"] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(codes, np.uint8), TensorProto.FLOAT8E4M3FN)
    if w_scale is not None:
        feeds["WScale"] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(w_scale,
                                                                                np.float32))
    return session.run_with_ort_values(["Y"], feeds)[0].numpy()


def values(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes -> their values as float32 (NaN for 0x7F / 0xFF)."""
    return np.asarray(codes, np.uint8).view(E4M3).astype(np.float32)


def codes_of(v: np.ndarray) -> np.ndarray:
    """float32 values already on the e4m3 grid -> codes."""
    return np.asarray(v, np.float32).astype(E4M3).view(np.uint8)


def assert_same(got: np.ndarray, want: np.ndarray, msg: str = "") -> None:
    """Bit for bit, except that any NaN matches any NaN (payloads are not specified)."""
    assert got.shape == want.shape, (got.shape, want.shape, msg)
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = (g != w) & ~(np.isnan(got) & np.isnan(want))
    assert not bad.any(), f"{int(bad.sum())} of {bad.size} outputs differ {msg}"


def random_case(rng: np.random.Generator, m: int, n: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x over many binades (per element and per row), every finite e4m3 code in W
    (subnormals, +-0 and +-448 included), power-of-two scales over a wide range."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-12, 12, (m, k)) // 3 +
                                              rng.integers(-20, 20, (m, 1)))
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x7E
    w_scale = np.exp2(rng.integers(-24, 8, (-(-n // 32), k // 32))).astype(np.float32)
    return x.astype(np.float32), codes, w_scale


@pytest.fixture(scope="module")
def fed_sessions() -> dict[str, ort.InferenceSession]:
    """isa -> session with W and WScale fed as inputs, for every path this CPU has."""
    out = {}
    for isa in ISAS:
        try:
            out[isa] = session_for(fp8_model(), isa)
        except Errors as e:
            assert "does not support it" in str(e)
    assert "scalar" in out
    return out


# ------------------------------------------------------------- vs the NumPy definition
SHAPES = [  # (M, N, K): N off the 32-column panels, K from one block to 8192, M past the
    (1, 40, 32), (2, 1000, 64), (4, 40, 256), (3, 7, 8192), (1, 1000, 1280),  # tiles
    (5, 33, 96), (6, 64, 160), (13, 100, 512), (130, 65, 96), (11, 1, 64),  # and the chunk
]


def defined_case(m: int, n: int, k: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """random_case seeded by its shape, and the definition's (finite) output."""
    x, codes, w_scale = random_case(np.random.default_rng(m * 1000003 + n * 1009 + k), m, n, k)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isfinite(want).all()
    return x, codes, w_scale, want


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_path_matches_the_numpy_definition(fed_sessions, m: int, n: int, k: int) -> None:
    x, codes, w_scale, want = defined_case(m, n, k)
    for isa, session in fed_sessions.items():
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")


def test_constant_weights_give_the_same_bits(fed_sessions) -> None:
    rng = np.random.default_rng(5)
    x, codes, w_scale = random_case(rng, 50, 200, 640)
    for isa in fed_sessions:
        const = session_for(fp8_model(codes, w_scale), isa)
        for rows in (1, 2, 5, 49):
            assert_same(run(const, x[:rows]), run(fed_sessions[isa], x[:rows], codes, w_scale),
                        f"isa={isa} M={rows}")


def test_thread_count_and_path_do_not_change_a_bit(fed_sessions) -> None:
    rng = np.random.default_rng(3)
    x, codes, w_scale = random_case(rng, 300, 300, 1024)
    want = fp8_linear(x, values(codes), w_scale)
    for isa in fed_sessions:
        for threads in (1, 2):
            session = session_for(fp8_model(codes, w_scale), isa, threads)
            for rows in (1, 4, 300):
                assert_same(run(session, x[:rows]), want[:rows], f"isa={isa} threads={threads}")


# ------------------------------------------------------------------------ edge inputs
def edge_rows(k: int) -> np.ndarray:
    """One row per edge case, k = 4 blocks of 32."""
    rows = np.zeros((8, k), np.float32)
    rows[1, :32] = 3e-5  # below the amax floor: xs = 2^ceil(log2(1e-4/448))
    rows[1, 32:] = -0.0
    rows[2] = np.exp2(-np.arange(k) % 40 - 3.0)  # down to e4m3 subnormals after scaling
    rows[3] = 448.0 * np.sign(np.sin(np.arange(k) + 1.0))  # amax = 448 * 2^0: saturating
    rows[3, ::5] = 447.9  # rounds up to 448
    rows[4] = np.where(np.arange(k) % 2, 1e30, -1e-30)  # huge spread: most round to 0
    rows[5] = (np.arange(k) - k / 2) * 2.0**-10  # crossing zero, ties in e4m3
    rows[6] = -np.abs(rows[5])
    rows[6, ::3] = -0.0
    rows[7] = np.float32(3.3895314e38) * np.cos(np.arange(k))  # near the float32 maximum
    return rows


def edge_case() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """edge_rows against random codes with 0, -0, subnormals and 448 in every row, and a
    zero weight scale; and the definition's output."""
    k, n = 128, 70
    x = edge_rows(k)
    rng = np.random.default_rng(17)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[np.isin(codes, NAN_CODES)] = 0x01  # the smallest subnormal
    codes[:, :8] = [0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE]  # 0, -0, subnormals, 448
    w_scale = np.exp2(rng.integers(-10, 4, (3, 4))).astype(np.float32)
    w_scale[1, 2] = 0.0
    return x, codes, w_scale, fp8_linear(x, values(codes), w_scale)


def test_edge_inputs_match_the_definition(fed_sessions) -> None:
    x, codes, w_scale, want = edge_case()
    for isa, session in fed_sessions.items():
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")
    xq, xs = act_quant_e4m3(x)
    assert xs[1, 0] == np.float32(2.0**-22) and (np.abs(xq[3]) == 448).sum() > 0
    assert ((xq[2] != 0) & (np.abs(xq[2]) < 2.0**-6)).any()  # e4m3 subnormals in xq
    assert np.signbit(xq[6][x[6] == 0]).all()  # negative zeros stay negative


def test_act_quant_sixteen_blocks_at_a_time(fed_sessions) -> None:
    """The AVX-512 act_quant takes 16 blocks of a row at once (its reductions across the
    blocks) and falls back to one block at a time for a group holding a NaN, an inf or a
    scale past 2^127: edge_rows' cases inside such groups, beside plain ones, K = 36 blocks
    (two groups and a tail), against the definition on every path."""
    k = 36 * 32
    rng = np.random.default_rng(29)
    plain = activations(rng, 1, k)[0]
    edges = edge_rows(k)
    x = np.tile(plain, (12, 1))
    for i, row in enumerate(edges):  # each edge case in one block of a group, then all of it
        at = 32 * (3 + 5 * i % 13)
        x[i, at:at + 32] = row[:32]
    x[8] = edges[4]  # every block a spread (most round to 0; blocks that are not int16)
    x[9, 32 * 7 + 5] = np.nan  # group 0 falls back, group 1 does not
    x[10, 32 * 20 + 1] = np.inf
    x[11, 32 * 33:] = edges[7, :96]  # near the float32 maximum in the tail
    x[11, 32 * 18:32 * 19] = edges[7, :32]  # ... and in a group: scales of 2^120 and more
    codes, w_scale = checkpoint_like(rng, 40, k)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isnan(want[9]).all() and not np.isnan(want[:9]).any()
    for isa, session in fed_sessions.items():
        for rows in (slice(0, 12), slice(9, 12), slice(0, 3)):  # tiles and few rows
            assert_same(run(session, x[rows], codes, w_scale), want[rows], f"isa={isa}")
    # the same block figures (max, sum and norm of the units) on every path: the same wide
    # sums (a block of X that is not int16 against one of W), and the same rows summed in
    # two digits by row patches (tiles, NaN rows left out); the AVX-512 tiles sum the rows
    # whose block is not int16 themselves, the same (row, block)s on each AVX-512 path
    x = np.concatenate([x[:9], activations(rng, 40, k)])
    grown = {isa: counts_after(lambda s=session: run(s, x, codes, w_scale))
             for isa, session in fed_sessions.items()}
    assert grown["scalar"]["row_sums"] > 0 and grown["scalar"]["wide_sums"] > 0, grown
    for isa, grew in grown.items():
        for key in ("wide_sums", "lane_sums"):
            assert grew[key] == grown["scalar"][key], (isa, key, grown)
        same_tiles = "avx512" if tiles_sum_wide_rows(isa) else "scalar"
        for key in ("row_sums", "tile_wide_rows"):
            assert grew[key] == grown[same_tiles][key], (isa, key, grown)
        assert (grew["tile_wide_rows"] > 0) == tiles_sum_wide_rows(isa), (isa, grown)
        if tiles_sum_wide_rows(isa):  # fewer row patches: those of blocks not int16 are gone
            assert grew["row_sums"] < grown["scalar"]["row_sums"], (isa, grown)


def test_exact_block_sums_matter(fed_sessions) -> None:
    """One product of 448 * 448 then 31 of 2^-8, a quarter of float32's ulp there each: a
    float32 running sum drops them all, the exact sum rounded once does not."""
    x = np.full((1, 32), 0.0625, np.float32)
    x[0, 0] = 448.0  # amax 448: xs = 1, xq = x
    w = np.full((32, 32), 0.0625, np.float32)
    w[:, 0] = 448.0
    codes, w_scale = codes_of(w), np.ones((1, 1), np.float32)
    naive = np.float32(0.0)
    for p in (x[0] * w[0]).astype(np.float32):
        naive = np.float32(naive + p)
    exact = np.float32(448.0 * 448.0 + 31 * 2.0**-8)
    assert naive == np.float32(200704.0) and exact == np.float32(200704.125) != naive
    want = fp8_linear(x, w, w_scale)
    assert (want == exact).all()
    for isa, session in fed_sessions.items():
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")


def test_zero_codes_in_coarse_blocks(fed_sessions) -> None:
    """W blocks whose nonzero values are all multiples of 2^t for t = 0..13 (so t is large)
    with zeros among them: the AVX-512 conversion's shift count of a zero code is then past
    15 (11 + t) and must still give 0; every row count (few-rows path and tiles)."""
    rng = np.random.default_rng(23)
    n, k = 72, 32 * 14
    units = np.zeros((n, k), np.int64)
    for kb in range(k // 32):  # block kb: mantissas 8..15 (or 1..7 in binade 0) times 2^kb
        mant = rng.integers(8 if kb else 1, 16 if kb else 8, (n, 32))
        units[:, 32 * kb:32 * kb + 32] = mant << kb
    units *= rng.integers(0, 3, (n, k)) > 0  # a third of the values zero
    units *= np.where(rng.integers(0, 2, (n, k)) > 0, 1, -1)
    w = (units / 512.0).astype(np.float32)
    assert np.array_equal(values(codes_of(w)), w)  # on the e4m3 grid
    codes = codes_of(w)
    w_scale = np.exp2(rng.integers(-12, -4, (-(-n // 32), k // 32))).astype(np.float32)
    for m in (1, 3, 4, 5, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = fp8_linear(x, values(codes), w_scale)
        for isa, session in fed_sessions.items():
            assert_same(run(session, x, codes, w_scale), want, f"isa={isa} M={m}")


def nan_inf_case() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """NaN and +-inf in rows 1-3 of X, NaN codes in columns 7 and 66; the definition's
    output, checked NaN exactly there."""
    rng = np.random.default_rng(23)
    x, codes, w_scale = random_case(rng, 5, 70, 96)
    x[1, 40], x[2, 3], x[3, 95] = np.nan, np.inf, -np.inf
    codes[7, 50], codes[66, 0] = 0x7F, 0xFF
    want = fp8_linear(x, values(codes), w_scale)
    expect = np.zeros(want.shape, bool)
    expect[[1, 2, 3]] = True
    expect[:, [7, 66]] = True
    np.testing.assert_array_equal(np.isnan(want), expect)
    return x, codes, w_scale, want


def test_nan_and_inf(fed_sessions) -> None:
    """A NaN or inf in a row of X makes that row NaN; a NaN weight code its column."""
    x, codes, w_scale, want = nan_inf_case()
    for isa, session in fed_sessions.items():
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")
        assert_same(run(session_for(fp8_model(codes, w_scale), isa), x), want, f"isa={isa}")


def test_denormals_as_zero_sessions_give_the_same_bits() -> None:
    """With onnxruntime's denormals-as-zero option the AVX-512 path converts the weights
    through f16 (all normal values) instead of integer bit moves, whose subnormal e4m3
    codes are subnormal doubles; both give the definition's bits (outputs here are all
    normal floats, which flush-to-zero leaves alone)."""
    rng = np.random.default_rng(41)
    x, codes, w_scale = random_case(rng, 9, 70, 256)
    codes[:, :4] = [0x01, 0x83, 0x07, 0x00]  # subnormal weights in every column
    want = fp8_linear(x, values(codes), w_scale)
    assert (np.abs(want[want != 0]) >= np.finfo(np.float32).tiny).all()
    for threads in (1, 2):
        options = session_options(threads)
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
        session = make_session(fp8_model(codes, w_scale), options=options)
        assert_same(run(session, x), want, f"threads={threads}")


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_few_rows_subnormal_weights_with_denormals_as_zero(m: int) -> None:
    """The few-rows kernel's int16 blocks holding subnormal codes, with and without
    onnxruntime's denormals-as-zero option: the half-float conversion (AVX512-FP16 ignores
    MXCSR's DAZ and FTZ) and the tables both give the definition's bits. Every W block
    spans less than int16 (codes below 64 in value), so no block leaves the int16 sums."""
    rng = np.random.default_rng(43 + m)
    n, k = 70, 256
    exponent = rng.integers(0, 13, (n, k))  # e4m3 exponent fields 0..12: |w| < 64
    codes = (rng.integers(0, 2, (n, k)) << 7 | exponent << 3 | rng.integers(0, 8, (n, k)))
    codes = codes.astype(np.uint8)
    codes[:, ::32] = 0x01  # the smallest subnormal in every block: t = 0
    codes[:, 1::32] = 0x85
    x = activations(rng, m, k)
    w_scale = np.exp2(rng.integers(-12, -4, (-(-n // 32), k // 32))).astype(np.float32)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isfinite(want).all() and (np.abs(want[want != 0]) >= np.finfo(np.float32).tiny).all()
    for isa in ("avx512", "avx512-nofp16"):
        for denormals_as_zero in (False, True):
            try:
                session = session_for(fp8_model(codes, w_scale), isa, 2, denormals_as_zero)
            except Errors as e:
                assert "does not support it" in str(e)
                continue
            label = f"isa={isa} denormals_as_zero={denormals_as_zero}"
            grew = counts_after(lambda s=session, t=label: assert_same(run(s, x), want, t))
            assert grew["lane_sums"] == 0, grew  # no W block left the int16 sums
            assert_few_rows_path(isa, grew)


def test_ranks_and_empty_shapes(fed_sessions) -> None:
    session = fed_sessions["scalar"]
    rng = np.random.default_rng(9)
    x, codes, w_scale = random_case(rng, 6, 40, 64)
    x3 = x.reshape(2, 3, 64)
    y3 = run(session, x3, codes, w_scale)
    assert y3.shape == (2, 3, 40)
    assert_same(y3, fp8_linear(x, values(codes), w_scale).reshape(2, 3, 40))
    assert_same(run(session, x[0], codes, w_scale), fp8_linear(x[0], values(codes), w_scale))
    assert run(session, np.zeros((0, 64), np.float32), codes, w_scale).shape == (0, 40)
    assert run(session, x3, codes[:0], w_scale[:0]).shape == (2, 3, 0)
    y = run(session, np.ones((4, 0), np.float32), np.zeros((3, 0), np.uint8),
            np.zeros((1, 0), np.float32))
    assert y.shape == (4, 3) and not y.any()
    # the definition agrees there (no K block: every output 0), at any rank
    assert_same(y, fp8_linear(np.ones((4, 0), np.float32), np.zeros((3, 0), np.float32),
                              np.zeros((1, 0), np.float32)))
    assert_same(fp8_linear(np.ones(0, np.float32), np.zeros((3, 0), np.float32),
                           np.zeros((1, 0), np.float32)), np.zeros(3, np.float32))


# ------------------------------------------------- the integer sums and their fallbacks
# The kernel sums each block in int32 lanes where that is exact (fp8_int_blocks.h) and
# elsewhere in two int16 digits or int64; these cases are built to take each way, and the
# kernel's counts (fp8_linear_counts) check that they did.
def checkpoint_like(rng: np.random.Generator, n: int, k: int, dof: float | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """W as a checkpoint holds it: normal (or Student-t) values, one ue8m0 scale per 32x32
    block mapping the block's largest value into (224, 448], then e4m3 codes."""
    nb, kb = -(-n // 32), k // 32
    w = rng.standard_normal((nb * 32, k)) if dof is None else rng.standard_t(dof, (nb * 32, k))
    blocks = w.reshape(nb, 32, kb, 32)
    amax = np.abs(blocks).max(axis=(1, 3))
    w_scale = np.exp2(np.ceil(np.log2(amax / 448.0))).astype(np.float32)
    q = (blocks / w_scale[:, None, :, None]).reshape(nb * 32, k)[:n].astype(np.float32)
    return codes_of(np.clip(q, -448, 448)), w_scale


def activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """bf16 activations: normal values with a few outlier features (as LLM activations)."""
    x = rng.standard_normal((m, k))
    x[:, rng.choice(k, max(1, k // 64), replace=False)] *= 40.0
    return round_bf16(x.astype(np.float32))


def tiles_sum_wide_rows(isa: str) -> bool:
    """Whether that path's tiles (more than 4 rows) sum a row whose block of X is not int16
    in two digits themselves (the AVX-512 tiles) rather than by row patches."""
    return isa.startswith("avx512")


CPUINFO = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
HAS_VBMI = " avx512vbmi " in CPUINFO
# the few-rows kernel's other conversion of W needs both
HAS_FP16 = " avx512_fp16 " in CPUINFO and " gfni " in CPUINFO


def assert_few_rows_path(isa: str, grew: dict[str, int], few_rows: bool = True,
                         pairs16: bool = False) -> None:
    """The few-rows path ran exactly where it should: AVX512-VBMI's, converting W by
    AVX512-FP16 on the default path of a CPU that has it, by tables on the others; AVX2's
    for a pairs16 W only."""
    small = few_rows and ((isa in ("avx512", "avx512-nofp16") and HAS_VBMI)
                          or (isa == "avx2" and pairs16))
    assert (grew["small_tasks"] > 0) == small, (isa, grew)
    assert (grew["fp16_tasks"] > 0) == (small and isa == "avx512" and HAS_FP16), (isa, grew)


def counts_after(fn) -> dict[str, int]:
    """fn() run; the growth of each of Fp8Linear's counts."""
    before = fp8_linear_counts()
    fn()
    after = fp8_linear_counts()
    return {key: after[key] - before[key] for key in after}


CHECKPOINT_SHAPES = [  # (M, N, K): the few-rows path (M <= 4), tile remainders, two chunks
    (1, 300, 1280), (2, 40, 64), (4, 1000, 512), (5, 96, 256), (7, 130, 1024),
    (13, 64, 96), (260, 72, 320),
]


@pytest.mark.parametrize(("m", "n", "k"), CHECKPOINT_SHAPES)
def test_checkpoint_like_weights_on_every_path(fed_sessions, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    codes, w_scale = checkpoint_like(rng, n, k, dof=4.0)
    x = activations(rng, m, k)
    want = fp8_linear(x, values(codes), w_scale)
    for isa, session in fed_sessions.items():
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")
    for threads in (1, 2):
        session = session_for(fp8_model(codes, w_scale), threads=threads)
        assert_same(run(session, x), want, f"constant W, threads={threads}")


def block_of(values_: list[float], k: int = 32) -> np.ndarray:
    """A row of k values: values_ then zeros... repeated over the K blocks."""
    row = np.zeros(k, np.float32)
    row[:len(values_)] = values_
    return row


def fallback_case(kind: str, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [m, 64], codes [40, 64], w_scale for one of the kernel's fallbacks:
    "w_wide": a W block spanning 448 down to the smallest subnormal (not int16);
    "x_wide": an x block likewise (act_quant keeps 448 and 2^-9 in one block);
    "both": the two together (int64 sums);
    "int32": int16 blocks whose products sum past 2^31 (two digits)."""
    rng = np.random.default_rng(hash(kind) % 1000 + m)
    x = activations(rng, m, 64)
    codes, w_scale = checkpoint_like(rng, 40, 64)
    w = values(codes)
    wide = np.array([448.0] * 16 + [2.0**-9] + [-3.0] * 15, np.float32)  # units >> 0: 2^17.8
    big = np.array([448.0] * 31 + [2.0**-6], np.float32)  # t = 3: 28672 each, sums ~2^34.6
    if kind in ("w_wide", "both"):
        w[3, :32] = wide
        w[33, 32:] = -wide[::-1]
    if kind in ("x_wide", "both"):
        x[:, :32] = wide * (1 + np.arange(m)[:, None])  # act_quant scales by a power of two
    if kind == "int32":
        w[5, 32:] = big
        w[6, 32:] = -big
        x[:, 32:] = big
    return x, codes_of(w), w_scale


@pytest.mark.parametrize("m", [1, 7])  # the few-rows path and the tiles
@pytest.mark.parametrize(("kind", "count"), [("w_wide", "lane_sums"), ("x_wide", "row_sums"),
                                             ("both", "wide_sums"), ("int32", "row_sums")])
def test_each_exact_fallback_is_taken(fed_sessions, kind: str, count: str, m: int) -> None:
    x, codes, w_scale = fallback_case(kind, m)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isfinite(want).all()
    for isa, session in fed_sessions.items():
        grew = counts_after(lambda s=session, i=isa: assert_same(run(s, x, codes, w_scale), want,
                                                                 f"isa={i} {kind}"))
        tiles_take_it = kind in ("x_wide", "both") and m > 4 and tiles_sum_wide_rows(isa)
        if kind == "x_wide" and tiles_take_it:  # the tiles' two digits, no row patch
            assert grew["tile_wide_rows"] > 0 and grew["row_sums"] == 0, (isa, kind, grew)
        else:
            assert grew[count] > 0, (isa, kind, grew)
        assert grew["calls"] == 1, (isa, grew)
        if tiles_take_it:
            assert grew["tile_wide_rows"] > 0, (isa, kind, grew)
        elif m <= 4 or not tiles_sum_wide_rows(isa):  # few rows: row patches, as elsewhere
            assert grew["tile_wide_rows"] == 0, (isa, kind, grew)
        assert_few_rows_path(isa, grew, few_rows=m <= 4)


def norm_bound_blocks() -> tuple[np.ndarray, np.ndarray]:
    """An x block and a w block on the e4m3 grid (amax 448: act_quant keeps x as it is) whose
    int16 units fail both max * sum bounds of fp8_int_blocks.h, while the product of their
    norms, rounded up, is below 2^31 (so |S| is too: Cauchy-Schwarz). The last value of each
    sets its block's power of two (found by a random search over the grid's top binades)."""
    x = [448, -28, 56, -28, 448, 112, 56, -112, -448, 224, -7, -224, 14, 14, 112, 56, 14, 28,
         14, 28, 28, 7, 14, 224, -28, 448, -112, 112, -224, 7, -448, 2.0**-5]
    w = [448, -56, 224, 28, 224, -56, 56, -28, -28, -224, 56, 112, 56, -28, 56, 28, -56, 56,
         -112, 224, 28, 28, 224, 0, -28, 56, -14, -56, 56, -112, 224, 2.0**-6]
    return np.array(x, np.float32), np.array(w, np.float32)


def test_norm_bound_spares_blocks_the_sum_bounds_would_flag(fed_sessions) -> None:
    xb, wb = norm_bound_blocks()

    def int16_units(v: np.ndarray) -> np.ndarray:
        u = np.round(v.astype(np.float64) * 512).astype(np.int64)
        low = np.bitwise_or.reduce(np.abs(u))
        return u >> (int(low & -low).bit_length() - 1)

    ux, uw = np.abs(int16_units(xb)), np.abs(int16_units(wb))
    assert ux.max() < 2**15 and uw.max() < 2**15
    assert ux.max() * uw.sum() >= 2**31 and ux.sum() * uw.max() >= 2**31
    norms = [int(np.ceil(np.sqrt(float((u * u).sum())))) for u in (ux, uw)]
    assert norms[0] * norms[1] < 2**31
    for blocks in (2, 34):  # one at a time, and 16 at a time (AVX-512 act_quant) with a tail
        codes = codes_of(np.tile(wb, (40, blocks)))
        w_scale = np.full((2, blocks), 2.0**-8, np.float32)
        for m in (1, 7):  # the few-rows path and the tiles
            x = np.tile(xb, (m, blocks))
            want = fp8_linear(x, values(codes), w_scale)
            for isa, session in fed_sessions.items():
                grew = counts_after(lambda s=session, i=isa, x=x, c=codes, ws=w_scale, want=want:
                                    assert_same(run(s, x, c, ws), want, f"isa={i}"))
                assert grew["calls"] == 1 and grew["row_sums"] == 0, (isa, m, blocks, grew)


def test_norm_figures_are_exact_ceilings(tmp_path: Path) -> None:
    """The norm bound is safe only if no norm is rounded down: tests/cpp/fp8_int_blocks.cc
    checks sqrt_ceil and analyse_block's l2 against integer brute force."""
    exe = build_cpp_driver(Path(__file__).resolve().parent / "cpp" / "fp8_int_blocks.cc",
                           tmp_path)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("bad=0"), out.stdout[-500:]


# The few-rows kernel (AVX512-VBMI, M <= 4) reads each W row in order, four K blocks at a
# time, and sums lanes over k; these shapes reach its edges: block counts that leave a last
# quad of one, two or three blocks, one block, K past one chunk of 256 blocks (a chunk of one
# block after it), N off the 16-column groups, and W rows whose blocks need each fallback,
# with NaN codes.
DECODE_SHAPES = [(1, 17, 96), (2, 65, 32), (3, 1, 800), (4, 130, 544), (1, 40, 32 * 257),
                 (2, 33, 32 * 300), (1, 23, 32 * 6), (1, 70, 32 * 21), (1, 9, 32)]


def decode_case(rng: np.random.Generator, m: int, n: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checkpoint-like W and activations with, in the last K block, a W row that is not
    int16, an x block that is not int16 (row 0) and a pair past int32 (row m - 1), and NaN
    codes in two columns."""
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    w = values(codes)
    wide = np.array([448.0] * 16 + [2.0**-9] + [-3.0] * 15, np.float32)
    big = np.array([448.0] * 31 + [2.0**-6], np.float32)
    w[n // 2, k - 32:] = wide
    x[0, k - 32:] = wide
    if n > 3:
        w[n - 1, k - 32:] = big
    if m > 1:
        x[m - 1, k - 32:] = big
    codes = codes_of(w)
    codes[0, k // 2] = 0x7F
    codes[n - 1, 5] = 0xFF
    return x, codes, w_scale


@pytest.mark.parametrize(("m", "n", "k"), DECODE_SHAPES)
def test_few_rows_path_on_every_edge(fed_sessions, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m * 131 + n * 17 + k)
    x, codes, w_scale = decode_case(rng, m, n, k)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isnan(want[:, 0]).all() and np.isfinite(want[:, 1:n - 1]).all()
    for isa, session in fed_sessions.items():
        grew = counts_after(lambda s=session, i=isa: assert_same(run(s, x, codes, w_scale), want,
                                                                 f"isa={i}"))
        assert_few_rows_path(isa, grew)
        assert grew["lane_sums"] > 0 and grew["row_sums"] > 0, (isa, grew)
    for threads in (1, 2):
        session = session_for(fp8_model(codes, w_scale), threads=threads)
        assert_same(run(session, x), want, f"constant W, threads={threads}")


def test_int32_case_really_overflows_int32() -> None:
    """The "int32" case's block dot is past 2^31 in its units: a plain int32 sum would wrap."""
    x, codes, _ = fallback_case("int32", 1)
    xq, _ = act_quant_e4m3(x)
    units_x = np.round(xq[0, 32:] * 512).astype(np.int64) >> 3
    units_w = np.round(values(codes)[5, 32:] * 512).astype(np.int64) >> 3
    assert np.abs(units_x).max() < 2**15 and np.abs(units_w).max() < 2**15  # both int16
    assert abs(int(units_x @ units_w)) >= 2**31


def test_calls_with_changing_shapes_keep_nothing_stale() -> None:
    """One session called with shapes that grow and shrink (the kernel keeps per-thread
    buffers between calls), on two threads, twice over: every call gives the definition's bits."""
    session = session_for(fp8_model(), threads=2)
    rng = np.random.default_rng(43)
    shapes = [(1, 40, 64), (3, 1000, 256), (16, 96, 1280), (2, 64, 5120), (300, 70, 96),
              (4, 64, 5120), (16, 96, 1280)]
    cases = [random_case(rng, *shape) for shape in shapes]
    for _ in range(2):
        for (m, n, k), (x, codes, w_scale) in zip(shapes, cases, strict=True):
            x = round_bf16(x)
            assert_same(run(session, x, codes, w_scale), fp8_linear(x, values(codes), w_scale),
                        f"M={m} N={n} K={k}")


def test_extreme_scales_and_activations(fed_sessions) -> None:
    """WScale of 0, inf, NaN, denormal and near the float range's ends; x rows of zeros, of
    values below the amax floor and near the float32 maximum: IEEE float arithmetic, as the
    definition (every product xs * ws and every term rounded once)."""
    rng = np.random.default_rng(47)
    codes, w_scale = checkpoint_like(rng, 100, 192)
    w_scale[0, :] = [0.0, np.inf, np.nan, 2.0**-140, 2.0**-126, 2.0**120]  # NaN columns
    w_scale[1, :] = [2.0**-140, 2.0**-142, 3.0 * 2.0**-142, 2.0**-145, 2.0**-149, 2.0**-141]
    w_scale[2, :] = [2.0**100, 2.0**120, 2.0**127, 2.0**110, 1.5, -0.5]
    w_scale[3, :] = [0.0, 0.5, -0.0, 2.0**-149, 1.0, 0.0]
    x = activations(rng, 6, 192)
    x[1] = 0.0
    x[2] = 1e-38 * np.sin(np.arange(192))
    x[3] = 3.0e38 * np.cos(np.arange(192))
    x[4, ::7] = 1e-30
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isnan(want).any() and np.isinf(want).any() and (want == 0).any()
    assert ((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)).any()  # denormal outputs
    for isa, session in fed_sessions.items():
        for rows in (slice(0, 6), slice(2, 3)):  # the tiles and the few-rows path
            assert_same(run(session, x[rows], codes, w_scale), want[rows], f"isa={isa}")


@pytest.mark.parametrize(("scale", "folds"), [(np.ldexp(1 + 2.0**-23, -86), True),
                                               (np.ldexp(1 + 2.0**-23, -100), False)])
def test_tiles_fold_the_scales_only_where_exact(fed_sessions, scale: float, folds: bool) -> None:
    """The AVX-512 tiles multiply a lane's float(sum) * 2^t_w by one per-row product (xs * ws)
    * 2^(t_x - 18) where that product is exact for every row: every WScale 0, inf, NaN or at
    least 2^-86 in size (xs >= 2^-22 at the amax floor, 2^(t_x - 18) >= 2^-18). A block scale
    of (1 + 2^-23) * 2^-100 makes the product subnormal for rows at the amax floor, where
    folding would round it (a different output); the call keeps both multiplies. Rows at the
    floor (xs = 2^-22) and ordinary rows, against the definition on every path."""
    rng = np.random.default_rng(53)
    codes, w_scale = checkpoint_like(rng, 96, 256)
    w_scale[1, 3] = np.float32(scale)
    x = activations(rng, 9, 256)
    x[::2] *= np.float32(2.0**-22)  # amax below the floor: xs = 2^-22
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isfinite(want).all() and (want != 0).all()
    for isa, session in fed_sessions.items():
        before = fp8_linear_counts()["folded_calls"]
        assert_same(run(session, x, codes, w_scale), want, f"isa={isa}")
        assert fp8_linear_counts()["folded_calls"] == before + int(folds), isa


def anon_rss_bytes() -> int:
    """This process's resident anonymous memory (not file mappings)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_constant_w_is_read_in_place(tmp_path: Path) -> None:
    """A 64 MiB constant W handed to two sessions as one OrtValue (as the runtime shares its
    mapped weights file, SessionOptions.add_initializer): creating and running them adds far
    less memory than a copy of W (the kernel keeps ~0.09 bytes of figures per weight), and
    both give the definition's bits."""
    n, k = 8192, 8192
    rng = np.random.default_rng(53)
    codes = rng.integers(0, 0x7E, (n, k), dtype=np.uint8)  # no NaN codes
    w_scale = np.exp2(rng.integers(-12, -4, (n // 32, k // 32))).astype(np.float32)
    (tmp_path / "w.bin").write_bytes(codes.tobytes())
    proto = onnx.load_from_string(fp8_model(None, w_scale))
    w_init = TensorProto(name="W", data_type=TensorProto.FLOAT8E4M3FN, dims=[n, k],
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(codes.nbytes))):
        w_init.external_data.add(key=key, value=value)
    proto.graph.initializer.append(w_init)
    proto.graph.input.remove(next(i for i in proto.graph.input if i.name == "W"))
    onnx.save(proto, str(tmp_path / "m.onnx"))
    w_value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(codes, TensorProto.FLOAT8E4M3FN)
    x = activations(rng, 1, k)
    sessions = []
    before = anon_rss_bytes()
    for _ in range(2):
        options = session_options(2)
        options.add_initializer("W", w_value)  # used as is: never loaded from w.bin
        sessions.append(ort.InferenceSession(str(tmp_path / "m.onnx"), sess_options=options,
                                             providers=["CPUExecutionProvider"]))
        run(sessions[-1], x)
    grown = anon_rss_bytes() - before
    assert grown < codes.nbytes // 4, f"two sessions took {grown / 2**20:.1f} MiB"
    want = fp8_linear(x, values(codes), w_scale)
    for session in sessions:
        assert_same(run(session, x), want)


# ------------------------------------------------------------------- upstream oracle
def kernel_cpu() -> ModuleType:
    pytest.importorskip("torch", reason="the upstream oracle runs on torch; not installed")
    path = REFERENCE_DIR / "kernel_cpu.py"
    if not path.is_file():
        pytest.skip(f"{REFERENCE_DIR} (the upstream kernel_cpu.py oracle) is absent")
    return load_module(path, "csa2onnx_test_kernel_cpu")


def test_matches_upstream_act_quant_and_fp8_gemm() -> None:
    """Y equals upstream's fp8 linear, act_quant(x, 32, "ue8m0") then fp8_gemm, on bf16
    activations (as in the model): fp8_gemm rounds to torch's default dtype, float32 here
    (the model sets bf16, which the graph applies after the op); and the quantiser equals
    act_quant."""
    kc = kernel_cpu()
    import torch

    session = session_for(fp8_model())
    rng = np.random.default_rng(29)
    for m, n, k in [(1, 40, 64), (3, 1000, 256), (16, 96, 1280), (2, 64, 5120)]:
        x, codes, w_scale = random_case(rng, m, n, k)
        x = round_bf16(x)
        xt = torch.from_numpy(x).to(torch.bfloat16)
        q, s = kc.act_quant(xt, 32, "ue8m0")
        w = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn)
        assert torch.get_default_dtype() == torch.float32
        want = kc.fp8_gemm(q, s, w, torch.from_numpy(w_scale)).numpy()
        assert_same(run(session, x, codes, w_scale), want, f"M={m} N={n} K={k}")
        xq, xs = act_quant_e4m3(x)
        assert_same(xq, q.float().numpy())
        assert_same(xs, s.float().numpy())


# ------------------------------------------------------------ portable body, wrapper
def test_portable_body_matches_the_kernel_bit_for_bit() -> None:
    """The standard-op body computes each block dot exactly (double MatMul) and adds the
    blocks in order (Loop), so the rule asserted is equality of every bit, NaN for NaN."""
    rng = np.random.default_rng(31)
    x, codes, w_scale = random_case(rng, 14, 100, 256)
    x[3, 7] = np.nan
    codes[9, 100] = 0x7F
    x = np.concatenate([x, edge_rows(256)])
    model = fp8_model(codes, w_scale, portable=True)
    portable = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    kernel = session_for(model)
    got, want = portable.run(["Y"], {"X": x})[0], run(kernel, x)
    assert_same(got, want)
    assert_same(want, fp8_linear(x, values(codes), w_scale))
    got3 = portable.run(["Y"], {"X": x[:12].reshape(3, 4, 256)})[0]
    assert_same(got3, want[:12].reshape(3, 4, 100))


def test_wrapper_types_the_output_and_runs() -> None:
    k, n = 64, 40
    model = build_model(
        "fp8", [("x", ir.DataType.FLOAT, ["b", "s", k]),
                ("w", ir.DataType.FLOAT8E4M3FN, [n, k]),
                ("ws", ir.DataType.FLOAT, [2, 2])], ["y"], csa_ops.fp8_linear)
    out = model.graph.output[0].type.tensor_type
    assert out.elem_type == TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in out.shape.dim] == ["b", "s", n]
    rng = np.random.default_rng(37)
    x, codes, w_scale = random_case(rng, 6, n, k)
    feeds = {"x": ort.OrtValue.ortvalue_from_numpy(x.reshape(2, 3, k)),
             "w": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(codes,
                                                                  TensorProto.FLOAT8E4M3FN),
             "ws": ort.OrtValue.ortvalue_from_numpy(w_scale)}
    y = make_session(model.SerializeToString()).run_with_ort_values(["y"], feeds)[0].numpy()
    assert_same(y, fp8_linear(x, values(codes), w_scale).reshape(2, 3, n))


# ------------------------------------------------------------ round_output (fused Casts)
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_round_output_is_the_cast_pair_on_every_path(numerics: str) -> None:
    """round_output=1 is onnxruntime's Cast pair of the unrounded Y, bit for bit, on every
    path (the fast kernel where the CPU has it), W fed and constant, one to 300 rows (the
    few-rows path, the tiles, two 256-row chunks), with NaN and inf rows and a NaN column."""
    rng = np.random.default_rng(53)
    n, k = 100, 256
    x, codes, w_scale = random_case(rng, 300, n, k)
    x[3, 7], x[5, 2] = np.nan, np.inf
    codes[9, 100] = 0x7F
    base = {} if numerics == "exact" else {"numerics": "fast"}
    isas = ISAS if numerics == "exact" else (None,)
    for isa in isas:
        for constant in (False, True):
            weights = (codes, w_scale) if constant else (None, None)
            models = [fp8_model(*weights, attrs=base),
                      fp8_model(*weights, attrs={**base, "round_output": 1})]
            try:
                plain, rounded = (session_for(model, isa) for model in models)
            except Errors as e:
                assert "does not support it" in str(e)
                continue
            feeds = () if constant else (codes, w_scale)
            for m in (1, 3, 7, 130, 300):
                unrounded = run(plain, x[:m], *feeds)
                want = cast_pair(unrounded)
                assert not np.array_equal(unrounded.view(np.uint32), want.view(np.uint32))
                np.testing.assert_array_equal(run(rounded, x[:m], *feeds).view(np.uint32),
                                              want.view(np.uint32),
                                              err_msg=f"{isa} constant={constant} M={m}")


def test_round_output_must_be_0_or_1() -> None:
    with pytest.raises(Errors, match="Fp8Linear: round_output must be 0 or 1, got 2"):
        session_for(fp8_model(attrs={"round_output": 2}))


def test_wrapper_rounds_in_the_kernel_or_by_casts_when_portable() -> None:
    """ops.fp8_linear(rounded=True): the node's round_output in a library graph, a Cast pair
    after the node in a portable one (whose standard-op body has no such attribute)."""
    k, n = 64, 40
    inputs = [("x", ir.DataType.FLOAT, ["m", k]), ("w", ir.DataType.FLOAT8E4M3FN, [n, k]),
              ("ws", ir.DataType.FLOAT, [2, 2])]

    def rounded(op, x, w, ws):
        return csa_ops.fp8_linear(op, x, w, ws, rounded=True)

    fused = build_model("fp8", inputs, ["y"], rounded)
    portable = build_model("fp8", inputs, ["y"], rounded, portable=True)
    assert [(nd.op_type, [a.name for a in nd.attribute]) for nd in fused.graph.node] == [
        ("Fp8Linear", ["round_output"])]
    assert [nd.op_type for nd in portable.graph.node] == ["Fp8Linear", "Cast", "Cast"]
    rng = np.random.default_rng(59)
    x, codes, w_scale = random_case(rng, 6, n, k)
    feeds = {"x": x, "w": codes, "ws": w_scale}
    want = cast_pair(fp8_linear(x, values(codes), w_scale))
    library_free = ort.InferenceSession(portable.SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    for session in (make_session(fused.SerializeToString()), library_free):
        y = session.run_with_ort_values(["y"], {
            name: (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v, TensorProto.FLOAT8E4M3FN)
                   if name == "w" else ort.OrtValue.ortvalue_from_numpy(v))
            for name, v in feeds.items()})[0].numpy()
        assert_same(y, want)


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("x_shape", "w_shape", "ws_shape", "message"), [
    ((3, 64), (4, 32), (1, 1), r"Fp8Linear: the last dimension of X \(64\) must equal K, the "
                               r"second dimension of W \(32\); X shape \[3, 64\], W shape "
                               r"\[4, 32\]"),
    ((3, 64), (2, 4, 64), (1, 2), r"Fp8Linear: W must be \[N, K\] \(rank 2\), got shape "
                                  r"\[2, 4, 64\]"),
    ((3, 48), (4, 48), (1, 1), r"Fp8Linear: K \(48, the second dimension of W \[4, 48\]\) "
                               r"must be a multiple of the block size 32"),
    ((3, 64), (40, 64), (1, 2), r"Fp8Linear: WScale must be \[ceil\(N/32\), K/32\] = \[2, 2\] "
                                r"for W \[40, 64\], got shape \[1, 2\]"),
    ((3, 64), (40, 64), (2, 2, 1), r"WScale must be .* got shape \[2, 2, 1\]"),
    ((), (4, 64), (1, 2), r"Fp8Linear: X must have rank >= 1, got a scalar"),
])
def test_bad_shapes_are_clear_errors(fed_sessions, x_shape: tuple, w_shape: tuple,
                                     ws_shape: tuple, message: str) -> None:
    for session in fed_sessions.values():
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
            run(session, np.ones(x_shape, np.float32), np.zeros(w_shape, np.uint8),
                np.ones(ws_shape, np.float32))


def test_constant_weights_of_a_bad_shape_are_reported_at_run_time() -> None:
    session = session_for(fp8_model(np.zeros((4, 48), np.uint8), np.ones((1, 1), np.float32)))
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"must be a multiple of the block size 32"):
        run(session, np.ones((1, 48), np.float32))


@pytest.mark.parametrize("types", [
    (TensorProto.DOUBLE, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT),
    (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT),
    (TensorProto.FLOAT, TensorProto.FLOAT8E5M2, TensorProto.FLOAT),
    (TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN, TensorProto.BFLOAT16),
])
def test_wrong_types_are_clear_errors(types: tuple[int, int, int]) -> None:
    with pytest.raises(Errors, match="Fp8Linear"):
        session_for(fp8_model(types=types))


@pytest.mark.parametrize("block_size", [16, 64, 0])
def test_unsupported_block_size_is_a_clear_error(block_size: int) -> None:
    with pytest.raises(Errors, match=f"Fp8Linear: block_size must be 32 \\(the only size "
                                     f"supported\\), got {block_size}"):
        session_for(fp8_model(attrs={"block_size": block_size}))
    session_for(fp8_model(attrs={"block_size": 32}))  # explicit default is fine


def test_missing_inputs_are_clear_errors() -> None:
    for i in range(3):
        names = ["X", "W", "WScale"]
        names[i] = ""
        with pytest.raises(Errors, match=f"Fp8Linear: input {i} is required"):
            session_for(fp8_model(inputs=tuple(names)))


def test_unknown_path_is_a_clear_error() -> None:
    with pytest.raises(Errors, match=r"CSA_FP8_LINEAR_ISA=\"sse9\" \(expected avx512, avx2, scalar "
                                     r"or avx512bf16\)"):
        session_for(fp8_model(), "sse9")
