"""Fp8Linear numerics="fast" (custom_ops/src/fp8_linear_fast.cc): the definition's terms
summed in another order. Checked against the exact kernel (itself checked bit for bit
against the NumPy definition in test_fp8_linear.py) with a bound derived from the
arithmetic, and by how many outputs differ once rounded to bf16 (so that a wrong term, a
dropped block, a missing scale, fails); and where the fast kernel does not run (a CPU
without AVX512-BF16 / VBMI / GFNI, a forced path, scales outside its range, NaN or inf in
X) the bits are the exact kernel's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from test_fp8_linear import (
    NAN_CODES,
    Errors,
    activations,
    assert_same,
    checkpoint_like,
    fp8_model,
    random_case,
    run,
    session_for,
    values,
)

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops import ops as csa_ops
from csa2onnx.custom_ops.library import cpu_isas, fp8_linear_counts
from csa2onnx.custom_ops.reference import act_quant_e4m3, round_bf16
from csa2onnx.graphs.standalone import build_model

FAST = {"numerics": "fast"}
_FLAGS = (Path("/proc/cpuinfo").read_text().split("\n\n")[0]
          if Path("/proc/cpuinfo").is_file() else "")
FAST_CPU = all(f" {flag}" in _FLAGS for flag in ("avx512_bf16", "avx512vbmi", "gfni"))
needs_fast_cpu = pytest.mark.skipif(not FAST_CPU, reason="the fast kernel needs AVX512-BF16, "
                                    "AVX512-VBMI and GFNI; elsewhere fast is the exact kernel")
U = 2.0 ** -24  # float32 unit roundoff
DECODE_ROWS = 4  # the kernel's decode path: M <= 4
CHUNK_K = 512  # the prefill path's chunk of k


def gamma(n: int) -> float:
    """The classic bound of n rounded additions: n u / (1 - n u)."""
    return n * U / (1 - n * U)


def fast_depth(m: int, k: int) -> int:
    """Most rounded additions on the way from a term to an output in the fast kernel:
    decode, per lane K/32 (vdpbf16ps adds two products a step, each rounded; four chains
    of 16 lanes), 2 to join the chains and 4 in the tree; prefill, a chunk of 512 k as
    pairs (512 additions) and one addition per chunk into the output."""
    if m <= DECODE_ROWS:
        return k // 32 + 6
    return min(k, CHUNK_K) + -(-k // CHUNK_K)


def abs_terms(x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """sum over k of |X'[m, k] * W'[n, k]| (X' = act_quant's value, W' = w * ws), float64."""
    xq, xs = act_quant_e4m3(x)
    xv = np.abs(xq.astype(np.float64) * np.repeat(xs.astype(np.float64), 32, axis=-1))
    n = codes.shape[0]
    wv = values(codes).astype(np.float64)
    wv = np.where(np.isnan(wv), 0.0, wv)
    ws = np.repeat(np.repeat(w_scale.astype(np.float64), 32, axis=0)[:n], 32, axis=1)
    return xv.reshape(-1, x.shape[-1]) @ np.abs(wv * ws).T


@dataclass
class Comparison:
    bound: np.ndarray  # per output: how far fast may be from exact
    f32_differ: float  # fraction of outputs whose float32 bits differ
    bf16_differ: int  # how many differ once rounded to bf16

    def bf16_ok(self) -> bool:
        """Few bf16 differences: at most BF16_DIFFER_RATE of the outputs (or 2, for the
        small cases)."""
        return self.bf16_differ <= max(2.0, BF16_DIFFER_RATE * self.bound.size)


def compare(fast: np.ndarray, exact: np.ndarray, x: np.ndarray, codes: np.ndarray,
            w_scale: np.ndarray) -> Comparison:
    """Asserts the derived bounds and returns the counts. Both are f32 sums of the same exact
    terms: the definition rounds each block's dot once, its product with xs * ws once and
    adds K/32 of them (gamma(K/32 + 2)); the fast kernel's additions are fast_depth. Once
    rounded to bf16 they are equal wherever exact lies farther than the bound from a
    rounding boundary (a midpoint of two bf16 values), and one bf16 ulp apart at most where
    the bound is below half a bf16 ulp (elsewhere, outputs that cancel to far below their
    terms, only the bound holds)."""
    m, k = x.reshape(-1, x.shape[-1]).shape
    bound = (gamma(fast_depth(m, k)) + gamma(k // 32 + 2)) * abs_terms(x, codes, w_scale)
    fast2, exact2 = fast.reshape(bound.shape), exact.reshape(bound.shape)
    diff = np.abs(fast2.astype(np.float64) - exact2)
    assert (diff <= bound).all(), f"max excess {(diff / np.maximum(bound, 1e-300)).max()}"
    fb, eb = round_bf16(fast2), round_bf16(exact2)
    # bf16 neighbours of exact: the midpoints between them are the rounding boundaries
    bits = eb.view(np.uint32).astype(np.int64)
    up = (bits + 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)
    down = (bits - 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)
    e64 = eb.astype(np.float64)
    near = np.minimum(np.abs(exact2 - (e64 + up) / 2), np.abs(exact2 - (e64 + down) / 2))
    differ = fb != eb
    assert not (differ & (near > bound)).any(), "bf16 differs away from a rounding boundary"
    ulps = np.abs(fb.view(np.int32).astype(np.int64) - eb.view(np.int32).astype(np.int64))
    fine = bound < np.minimum(np.abs(up - e64), np.abs(e64 - down)) / 2
    assert (ulps[differ & fine] == 0x10000).all(), "more than one bf16 ulp apart"
    return Comparison(bound, float((fast2 != exact2).mean()), int(differ.sum()))


@pytest.fixture(scope="module")
def sessions() -> dict[str, object]:
    """exact and fast, W and WScale fed as inputs."""
    return {"exact": session_for(fp8_model()), "fast": session_for(fp8_model(attrs=FAST))}


def both(sessions, x, codes, w_scale) -> tuple[np.ndarray, np.ndarray, int]:
    """(fast, exact, how many calls the fast kernel summed)."""
    before = fp8_linear_counts()["fast_calls"]
    fast = run(sessions["fast"], x, codes, w_scale)
    calls = fp8_linear_counts()["fast_calls"] - before
    return fast, run(sessions["exact"], x, codes, w_scale), calls


# ------------------------------------------------------------------ the bound and the count
# Measured (AMD EPYC, AVX512-BF16; checkpoint-like W, bf16 activations with outliers, K up
# to 8192, M 1 to 300): 0 to 0.02% of the outputs differ from exact once rounded to bf16
# (every code equally likely: up to 0.05%), 30-85% in float32; the outputs stay within
# 0.3-1.5% of the derived bound. A dropped block or a doubled scale changes most outputs;
# the asserted rate is 10x the measured one and far below a broken term's.
BF16_DIFFER_RATE = 0.005


@needs_fast_cpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 1024), (2, 100, 288), (3, 64, 5120),
                                           (4, 130, 1056), (5, 70, 544), (64, 256, 1024),
                                           (300, 70, 1056), (24, 64, 2080)])
def test_fast_is_within_the_derived_bound(sessions, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m * 1000 + n + k)
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    fast, exact, calls = both(sessions, x, codes, w_scale)
    assert calls == 1, "the fast kernel did not run"
    c = compare(fast, exact, x, codes, w_scale)
    assert c.bf16_ok(), c


@needs_fast_cpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 320), (4, 33, 96), (9, 50, 160)])
def test_every_code_and_wide_scales(sessions, m: int, n: int, k: int) -> None:
    """Every finite e4m3 code (zeros and subnormals take the table conversion), x over
    many binades, scales from 2^-24 to 2^7."""
    x, codes, w_scale = random_case(np.random.default_rng(n + k), m, n, k)
    fast, exact, calls = both(sessions, x, codes, w_scale)
    assert calls == 1
    c = compare(fast, exact, x, codes, w_scale)
    assert c.bf16_ok(), c


@needs_fast_cpu
def test_a_wrong_term_is_caught(sessions) -> None:
    """The checks' power: the exact result with one K block left out, or one block's scale
    doubled, fails the bound on nearly every output (what a broken kernel would give)."""
    rng = np.random.default_rng(5)
    m, n, k = 2, 64, 1024
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    exact = run(sessions["exact"], x, codes, w_scale)
    dropped = codes.copy()
    dropped[:, 32:64] = 0
    wrong_scale = w_scale.copy()
    wrong_scale[:, 3] *= 2
    for broken in (run(sessions["exact"], x, dropped, w_scale),
                   run(sessions["exact"], x, codes, wrong_scale)):
        with pytest.raises(AssertionError):
            compare(broken, exact, x, codes, w_scale)
        assert (round_bf16(broken) != round_bf16(exact)).mean() > 10 * BF16_DIFFER_RATE


AMX = all(f" {flag}" in _FLAGS for flag in ("amx_bf16", "amx_tile"))


@needs_fast_cpu
@pytest.mark.skipif(not AMX, reason="the prefill's AMX tiles need a CPU with AMX-BF16")
@pytest.mark.parametrize(("m", "n", "k"), [(16, 64, 512), (17, 65, 544), (33, 70, 96),
                                           (100, 130, 1056), (481, 64, 64)])
def test_amx_prefill_is_within_the_derived_bound(sessions, m: int, n: int, k: int) -> None:
    """16 rows or more on AMX tiles (amx_bf16_tiles.h): rows past a 32-row strip and a
    480-row task, columns past a panel, K past a 512-k chunk."""
    rng = np.random.default_rng(m + n + k)
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    before = fp8_linear_counts()["fast_amx_calls"]
    fast, exact, calls = both(sessions, x, codes, w_scale)
    assert calls == 1 and fp8_linear_counts()["fast_amx_calls"] == before + 1
    c = compare(fast, exact, x, codes, w_scale)
    assert c.bf16_ok(), c


# ------------------------------------------------------------------ determinism, shapes
@needs_fast_cpu
@pytest.mark.parametrize("m", [1, 3, 4, 5, 200])
def test_threads_and_repeats_give_the_same_bits(m: int) -> None:
    rng = np.random.default_rng(m)
    n, k = 200, 2048
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    model = fp8_model(codes, w_scale, attrs=FAST)
    one, two = session_for(model, threads=1), session_for(model, threads=2)
    first = run(one, x)
    assert_same(run(one, x), first)
    assert_same(run(two, x), first)
    assert_same(run(two, x), first)


@needs_fast_cpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (2, 17, 64), (3, 31, 96), (4, 65, 160),
                                           (5, 1, 32), (7, 63, 96), (13, 129, 544),
                                           (1, 33, 128 * 3 + 32), (6, 64, 512 + 32)])
def test_shapes_off_the_vector_widths(sessions, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m + 10 * n + k)
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    fast, exact, calls = both(sessions, x, codes, w_scale)
    assert calls == 1
    compare(fast, exact, x, codes, w_scale)
    # a constant W gives the same bits as a fed one, and a rank-3 X the same rows
    const = session_for(fp8_model(codes, w_scale, attrs=FAST))
    assert_same(run(const, x), fast)
    assert_same(run(const, x.reshape(1, m, k)), fast.reshape(1, m, n))


def test_empty_shapes(sessions) -> None:
    codes, w_scale = checkpoint_like(np.random.default_rng(1), 40, 64)
    assert run(sessions["fast"], np.zeros((0, 64), np.float32), codes, w_scale).shape == (0, 40)
    y = run(sessions["fast"], np.ones((3, 0), np.float32), np.zeros((5, 0), np.uint8),
            np.zeros((1, 0), np.float32))
    assert_same(y, np.zeros((3, 5), np.float32))


# ------------------------------------------------------------------ NaN, inf, fallbacks
def test_nan_codes_give_nan_columns(sessions) -> None:
    rng = np.random.default_rng(3)
    for m in (1, 8):
        codes, w_scale = checkpoint_like(rng, 70, 256)
        codes[5, 100] = NAN_CODES[0]
        codes[66, 3] = NAN_CODES[1]
        x = activations(rng, m, 256)
        fast, exact, _ = both(sessions, x, codes, w_scale)
        assert np.isnan(fast[:, [5, 66]]).all()
        assert not np.isnan(np.delete(fast, [5, 66], axis=1)).any()
        keep = np.delete(np.arange(70), [5, 66])
        compare(fast[:, keep], exact[:, keep], x, codes[keep], w_scale[keep // 32])
        # a constant W's NaN columns come from the kernel's figures
        const = run(session_for(fp8_model(codes, w_scale, attrs=FAST)), x)
        assert_same(const, fast)


@pytest.mark.parametrize("case", ["nan_x", "inf_x", "huge_x", "inf_scale", "zero_scale",
                                  "odd_scale", "tiny_scale", "big_scale"])
def test_out_of_range_calls_run_the_exact_kernel(sessions, case: str) -> None:
    """Inputs where a term would not be exact in bf16 (or X is not finite): the same bits as
    exact, NaN and inf included, and the fast kernel did not count the call."""
    rng = np.random.default_rng(11)
    m, n, k = 3, 40, 128
    codes, w_scale = checkpoint_like(rng, n, k)
    x = activations(rng, m, k)
    if case == "nan_x":
        x[1, 7] = np.nan
    elif case == "inf_x":
        x[2, 70] = -np.inf
    elif case == "huge_x":
        x[0, 5] = 2.0 ** 60  # xs = 2^52 > 2^40
    else:
        w_scale[1, 2] = {"inf_scale": np.inf, "zero_scale": 0.0, "odd_scale": 0.75,
                         "tiny_scale": 2.0 ** -70, "big_scale": 2.0 ** 30}[case]
    fast, exact, calls = both(sessions, x, codes, w_scale)
    assert calls == 0
    assert_same(fast, exact)
    if case in ("nan_x", "inf_x"):
        assert np.isnan(fast[1 if case == "nan_x" else 2]).all()


@pytest.mark.parametrize(("variable", "isa"), [("CSA_FP8_LINEAR_ISA", "avx512"),
                                               ("CSA_FP8_LINEAR_ISA", "avx512-novbmi"),
                                               ("CSA_FP8_LINEAR_ISA", "avx2"),
                                               ("CSA_FP8_LINEAR_ISA", "scalar"),
                                               ("CSA2ONNX_ISA", "avx512")])
def test_forced_paths_run_the_exact_kernel(variable: str, isa: str) -> None:
    """Without the fast kernel's path (forced here; a CPU without AVX512-BF16 alike) fast is
    the exact kernel, bit for bit."""
    if isa.split("-")[0] not in cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} path (the op refuses to force it)")
    rng = np.random.default_rng(17)
    codes, w_scale = checkpoint_like(rng, 100, 512)
    old = os.environ.get(variable)
    os.environ[variable] = isa
    try:
        fast = session_for(fp8_model(codes, w_scale, attrs=FAST))
        exact = session_for(fp8_model(codes, w_scale))
    finally:
        if old is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = old
    for m in (1, 4, 40):
        x = activations(rng, m, 512)
        before = fp8_linear_counts()["fast_calls"]
        got = run(fast, x)
        assert fp8_linear_counts()["fast_calls"] == before
        assert_same(got, run(exact, x))


@pytest.mark.skipif(FAST_CPU, reason="this CPU has the fast kernel")
def test_without_the_instructions_fast_is_exact() -> None:
    rng = np.random.default_rng(19)
    codes, w_scale = checkpoint_like(rng, 64, 256)
    x = activations(rng, 5, 256)
    assert_same(run(session_for(fp8_model(codes, w_scale, attrs=FAST)), x),
                run(session_for(fp8_model(codes, w_scale)), x))


# ------------------------------------------------------------------ the attribute, wrapper
@pytest.mark.parametrize(("value", "message"), [
    ("fastest", r'Fp8Linear: attribute numerics must be "exact" or "fast", got "fastest"'),
    ("", r'Fp8Linear: attribute numerics must be "exact" or "fast", got ""'),
    (1, r"Fp8Linear: attribute numerics must be a string")])
def test_numerics_attribute_errors(value: object, message: str) -> None:
    with pytest.raises(Errors, match=message):
        session_for(fp8_model(attrs={"numerics": value}))


def test_exact_attribute_is_the_default(sessions) -> None:
    rng = np.random.default_rng(23)
    codes, w_scale = checkpoint_like(rng, 50, 96)
    x = activations(rng, 6, 96)
    assert_same(run(session_for(fp8_model(attrs={"numerics": "exact"})), x, codes, w_scale),
                run(sessions["exact"], x, codes, w_scale))


def wrapper_model(numerics: str, portable: bool = False):
    return build_model(
        "fp8", [("x", ir.DataType.FLOAT, [3, 64]), ("w", ir.DataType.FLOAT8E4M3FN, [40, 64]),
                ("ws", ir.DataType.FLOAT, [2, 2])], ["y"],
        lambda op, x, w, ws: csa_ops.fp8_linear(op, x, w, ws, numerics=numerics),
        portable=portable)


def test_wrapper_emits_the_attribute_only_when_fast() -> None:
    exact = wrapper_model("exact")
    assert [a.name for a in exact.graph.node[0].attribute] == []
    fast = wrapper_model("fast")
    attrs = {a.name: a.s.decode() for a in fast.graph.node[0].attribute}
    assert attrs == {"numerics": "fast"}
    make_session(fast.SerializeToString())  # the schema declares it
    with pytest.raises(ValueError, match="numerics must be one of"):
        wrapper_model("quick")
    with pytest.raises(ValueError, match="portable graph"):
        wrapper_model("fast", portable=True)
    wrapper_model("exact", portable=True)
