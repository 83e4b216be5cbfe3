"""NumPy definitions of the quantisers, written to be read beside reference.md.

These are the readable specification the C++ kernels and the graphs are tested against;
they are not used at run time.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP4_E8M0_AMAX_FLOOR = np.float32(6.0 * 2.0**-126)
FP4_E4M3_AMAX_FLOOR = np.float32(6.0 * 2.0**-9)
FP8_AMAX_FLOOR = np.float32(1e-4)
E4M3_MAX = np.float32(448.0)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even) and back."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to float8 e4m3fn (nearest even), saturating at +-448."""
    clipped = np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def pow2_ceil(t: np.ndarray) -> np.ndarray:
    """Exactly 2^ceil(log2 t) for t > 0 (a float log2 is not exact near powers of two)."""
    t = np.asarray(t, np.float32)
    mantissa, exponent = np.frexp(t)  # t = m * 2^e, m in [0.5, 1)
    up = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    # NaN and inf pass through (frexp gives them exponent 0), as torch's log2/ceil/pow do.
    return np.where((mantissa == 0.5) | ~np.isfinite(t), t, up).astype(np.float32)


def e2m1_rne(v: np.ndarray) -> np.ndarray:
    """Values in [-6, 6] onto the e2m1 grid; ties go to the even code (codes in grid order)."""
    a = np.abs(v)
    # Index of the nearest grid point; at an exact midpoint pick the even code.
    upper = np.searchsorted(E2M1_GRID, a, side="left").clip(1, 7)
    lo, hi = E2M1_GRID[upper - 1], E2M1_GRID[upper]
    mid = (lo + hi) / 2
    code = np.where(a < mid, upper - 1, np.where(a > mid, upper, np.where(upper % 2 == 0, upper,
                                                                         upper - 1)))
    q = E2M1_GRID[code]
    return np.where(np.isnan(v), v, np.copysign(q, v)).astype(np.float32)


def fp4_block_scales(x: np.ndarray, block: int, scale_format: str) -> np.ndarray:
    """Per-block scales, shape [..., last // block, 1]."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    if scale_format == "e8m0":
        return pow2_ceil(np.maximum(amax, FP4_E8M0_AMAX_FLOOR) * np.float32(1.0 / 6.0))
    if scale_format == "e4m3":
        return round_e4m3(np.maximum(amax, FP4_E4M3_AMAX_FLOOR) / np.float32(6.0))
    raise ValueError(f"unknown scale_format {scale_format!r}")


def fp4_round_trip(x: np.ndarray, block: int, scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """fp4_act_quant(x, block, inplace=True[, scale_dtype]): (bf16-valued y, scales)."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"block {block} does not divide the last dimension {x.shape[-1]}")
    scales = fp4_block_scales(x, block, scale_format)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = e2m1_rne(np.clip(blocks / scales, -6.0, 6.0))
        y = round_bf16(q * scales)
    return y.reshape(x.shape), scales[..., 0]


def fp8_act_quant(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """act_quant round trip: power-of-two (ue8m0) block scales, e4m3 values: (y, scales)."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), FP8_AMAX_FLOOR)
    scales = pow2_ceil(amax * np.float32(1.0 / 448.0))
    with np.errstate(over="ignore"):
        y = round_bf16(round_e4m3(blocks / scales) * scales)
    return y.reshape(x.shape), scales[..., 0]
