"""Fp8Linear's weight layout "pairs16" (custom_ops/weight_layout.py): the layout functions
against the kernel's index formula, and sessions reading a pairs16 W (fed and constant) on
every instruction-set path, bit for bit against the NumPy definition and against the plain
layout, on random, checkpoint-like and edge inputs (blocks that are not int16, flagged
rows, NaN codes), with the few-rows kernel taken where it should be; and its errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from test_fp8_linear import (
    ISAS,
    Errors,
    activations,
    assert_few_rows_path,
    assert_same,
    checkpoint_like,
    counts_after,
    decode_case,
    fp8_model,
    random_case,
    run,
    session_for,
    values,
)

from csa2onnx.custom_ops.reference import fp8_linear
from csa2onnx.custom_ops.weight_layout import pack_pairs16, pairs16_shape, unpack_pairs16

PAIRS16 = {"weight_layout": "pairs16"}


def offset(k_total: int, n: int, k: int) -> int:
    """The byte of code (n, k) in a pairs16 W (Fp8::pairs16_offset in fp8_linear.h)."""
    p = (k % 32) // 2
    return (((n // 16) * (k_total // 32) + k // 32) * 512 + 64 * (p // 2) + 16 * ((n % 16) // 4)
            + 8 * (p % 2) + 2 * (n % 4) + k % 2)


def test_layout_is_the_kernels_index_formula_and_round_trips() -> None:
    n, k = 48, 96
    w = np.arange(n * k, dtype=np.int32).reshape(n, k)
    packed = pack_pairs16(w)
    assert packed.shape == pairs16_shape(n, k) == (3, 3, 512)
    flat = packed.reshape(-1)
    for i in range(n):
        for j in range(k):
            assert flat[offset(k, i, j)] == w[i, j], (i, j)
    assert (unpack_pairs16(packed) == w).all()


@pytest.mark.parametrize(("shape", "message"), [
    ((40, 64), r"N a multiple of 16 and K of 32, got \[40, 64\]"),
    ((48, 48), r"N a multiple of 16 and K of 32, got \[48, 48\]"),
])
def test_layout_rejects_shapes_it_cannot_hold(shape: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_pairs16(np.zeros(shape, np.uint8))


@pytest.fixture(scope="module")
def pairs16_sessions() -> dict[str, ort.InferenceSession]:
    """isa -> session reading a fed pairs16 W, for every path this CPU has."""
    out = {}
    for isa in ISAS:
        try:
            out[isa] = session_for(fp8_model(attrs=PAIRS16), isa)
        except Errors as e:
            assert "does not support it" in str(e)
    assert "scalar" in out
    return out


# (M, N, K): one group, a partial panel (3 of 4 groups), several panels; K from one block
# to past the few-rows chunk (256 blocks); M on the few-rows path and past it
SHAPES = [(1, 16, 32), (2, 48, 64), (3, 80, 256), (4, 1008, 1280), (1, 64, 32 * 300),
          (5, 96, 96), (13, 48, 512), (130, 112, 96)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_every_path_matches_the_definition_and_the_plain_layout(pairs16_sessions, m: int, n: int,
                                                                k: int) -> None:
    x, codes, w_scale = random_case(np.random.default_rng(m * 7 + n * 11 + k), m, n, k)
    want = fp8_linear(x, values(codes), w_scale)
    plain = run(session_for(fp8_model()), x, codes, w_scale)
    assert_same(plain, want)
    for isa, session in pairs16_sessions.items():
        grew = counts_after(lambda s=session, i=isa: assert_same(
            run(s, x, pack_pairs16(codes), w_scale), want, f"isa={i}"))
        assert_few_rows_path(isa, grew, few_rows=m <= 4, pairs16=True)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 304, 1280), (4, 1008, 512), (7, 128, 1024),
                                           (260, 64, 320)])
def test_checkpoint_like_weights_constant_and_fed(pairs16_sessions, m: int, n: int,
                                                  k: int) -> None:
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    codes, w_scale = checkpoint_like(rng, n, k, dof=4.0)
    x = activations(rng, m, k)
    want = fp8_linear(x, values(codes), w_scale)
    for isa, session in pairs16_sessions.items():
        assert_same(run(session, x, pack_pairs16(codes), w_scale), want, f"isa={isa}")
        for threads in (1, 2):
            const = session_for(fp8_model(pack_pairs16(codes), w_scale, attrs=PAIRS16), isa,
                                threads)
            assert_same(run(const, x), want, f"constant W, isa={isa}, threads={threads}")


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 32 * 300), (2, 48, 64), (3, 16, 96),
                                           (4, 80, 32 * 21), (9, 48, 128)])
def test_edges_take_every_exact_fallback(pairs16_sessions, m: int, n: int, k: int) -> None:
    """Blocks of W and X that are not int16, a pair past int32 and NaN codes (decode_case)."""
    x, codes, w_scale = decode_case(np.random.default_rng(m * 131 + n * 17 + k), m, n, k)
    want = fp8_linear(x, values(codes), w_scale)
    assert np.isnan(want[:, 0]).all()
    for isa, session in pairs16_sessions.items():
        grew = counts_after(lambda s=session, i=isa: assert_same(
            run(s, x, pack_pairs16(codes), w_scale), want, f"isa={i}"))
        assert_few_rows_path(isa, grew, few_rows=m <= 4, pairs16=True)
        assert grew["lane_sums"] > 0 and grew["row_sums"] > 0, (isa, grew)
        assert grew["wide_sums"] > 0, (isa, grew)


def test_numerics_fast_reads_a_pairs16_w_with_the_exact_kernel() -> None:
    x, codes, w_scale = random_case(np.random.default_rng(9), 20, 64, 256)
    session = session_for(fp8_model(attrs=PAIRS16 | {"numerics": "fast"}))
    grew = counts_after(lambda: assert_same(run(session, x, pack_pairs16(codes), w_scale),
                                            fp8_linear(x, values(codes), w_scale)))
    assert grew["fast_calls"] == 0, grew


@pytest.mark.parametrize(("w_shape", "message"), [
    ((48, 64), r"a pairs16 W must be \[N/16, K/32, 512\] \(rank 3\), got shape \[48, 64\]"),
    ((3, 2, 256), r"a pairs16 W must be \[N/16, K/32, 512\] \(rank 3\), got shape \[3, 2, 256\]"),
])
def test_bad_pairs16_shapes_are_clear_errors(pairs16_sessions, w_shape: tuple,
                                             message: str) -> None:
    for session in pairs16_sessions.values():
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
            run(session, np.ones((1, 64), np.float32), np.zeros(w_shape, np.uint8),
                np.ones((2, 2), np.float32))


def test_wscale_is_checked_against_the_pairs16_dims(pairs16_sessions) -> None:
    for session in pairs16_sessions.values():
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                           match=r"WScale must be \[ceil\(N/32\), K/32\] = \[2, 2\]"):
            run(session, np.ones((1, 64), np.float32), np.zeros((3, 2, 512), np.uint8),
                np.ones((1, 2), np.float32))


def test_unknown_weight_layout_is_a_clear_error() -> None:
    with pytest.raises(Errors, match=r'Fp8Linear: unknown weight_layout "panels64" \(expected '
                                     r'"plain" or "pairs16"\)'):
        session_for(fp8_model(attrs={"weight_layout": "panels64"}))
