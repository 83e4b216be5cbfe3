"""NumPy definitions of the quantisers and of the packed state rows, written to be read
beside reference.md.

These are the readable specification the C++ kernels and the graphs are tested against;
they are not used at run time.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes

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
    with np.errstate(over="ignore", invalid="ignore"):  # inf / inf, inf * 0: NaN, as in torch
        y = round_bf16(round_e4m3(blocks / scales) * scales)
    return y.reshape(x.shape), scales[..., 0]


E4M3_MAX_INV = np.float32(1.0 / 448.0)  # tilelang's f32 immediate for 1 / fp8_max
FP8_BLOCK = 32


def act_quant_e4m3(x: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """act_quant(x, 32, "ue8m0") without the round trip: (xq, xs).

    xq: e4m3 values as float32, x's shape; xs: float32 [..., last // block], powers of two.
    Per block: amax = max|x| (a NaN propagates), clamped below at f32(1e-4);
    xs = 2^ceil(log2(amax * f32(1/448))) exactly; xq = e4m3(clamp(x / xs, -448, 448)),
    nearest even. Non-finite blocks: NaN amax gives xs = NaN and xq all NaN; an inf gives
    xs = inf, xq NaN where x is +-inf and (signed) 0 elsewhere.
    """
    x = np.asarray(x, np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"block {block} does not divide the last dimension {x.shape[-1]}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    a = np.abs(blocks)
    amax = np.where(np.isnan(a).any(axis=-1, keepdims=True), np.float32(np.nan),
                    a.max(axis=-1, keepdims=True, initial=np.float32(0.0)))
    amax = np.where(amax < FP8_AMAX_FLOOR, FP8_AMAX_FLOOR, amax).astype(np.float32)
    scales = pow2_ceil(amax * E4M3_MAX_INV)
    with np.errstate(invalid="ignore"):
        q = round_e4m3(blocks / scales)  # round_e4m3 clamps to +-448 first; NaN stays NaN
    return q.reshape(x.shape), scales[..., 0]


def fp8_linear(x: np.ndarray, w: np.ndarray, w_scale: np.ndarray,
               block: int = FP8_BLOCK) -> np.ndarray:
    """Fp8Linear: fp8_gemm(act_quant(x), w, w_scale), float32 [..., N], not rounded to bf16.

    x float32 [..., K]; w [N, K] e4m3 values as float32 (NaN for the NaN codes); w_scale
    float32 [ceil(N/32), K/32]. For each K block kb in order: dot = sum over the block of
    xq * w in float64 (exact: e4m3 products are multiples of 2^-18 below 2^18), rounded once
    to float32; acc = acc + dot * (xs[m, kb] * w_scale[n // 32, kb]) in float32 from 0.
    So a row of x holding a NaN or an inf gives a NaN row, a NaN weight a NaN column.
    """
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    w_scale = np.asarray(w_scale, np.float32)
    n, k = w.shape
    if k % block or x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape}: K must match and be a multiple of {block}")
    kb = k // block
    if w_scale.shape != (-(-n // block), kb):
        raise ValueError(f"w_scale shape {w_scale.shape} != {(-(-n // block), kb)}")
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))  # -1 cannot stand for it when K = 0
    xq, xs = act_quant_e4m3(x.reshape(rows, k), block)
    ws = np.repeat(w_scale, block, axis=0)[:n]  # [N, kb]: column n's scales
    acc = np.zeros((xq.shape[0], n), np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(kb):
            cols = slice(b * block, (b + 1) * block)
            dot = (xq[:, cols].astype(np.float64) @ w[:, cols].astype(np.float64).T)
            scale = xs[:, b:b + 1] * ws[:, b][None, :]  # float32 product of the two scales
            acc = acc + dot.astype(np.float32) * scale
    return acc.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------- packed state rows
def _e4m3_codes(q: np.ndarray) -> np.ndarray:
    """float8 e4m3fn codes of values that are exactly e4m3 (NaN -> 0x7F)."""
    codes = np.asarray(q, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(q), np.uint8(0x7F), codes).astype(np.uint8)


def _e4m3_values() -> np.ndarray:
    """The value of every e4m3fn code, [256] float32 (NaN at 0x7F and 0xFF)."""
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _e8m0_values() -> np.ndarray:
    """2^(byte - 127) for every byte, [256] float32 (2^-127 at 0, NaN at 0xFF)."""
    values = np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32)
    return np.append(values, np.float32(np.nan)).astype(np.float32)


def _packed_format(fmt: str, d: int) -> tuple[int, int]:
    packed_row_bytes(fmt, d)  # checks the format and d
    return PACKED_FORMATS[fmt]


def pack_quantized(x: np.ndarray, fmt: str) -> np.ndarray:
    """PackQuantized: float32 [..., d] -> uint8 [..., row_bytes] (constants.packed_row_bytes).

    Quantises as the round trips do (fp4_round_trip for "fp4_e4m3_16" / "fp4_e8m0_32",
    act_quant_e4m3 for "fp8_e8m0_32") and stores the codes, then one scale byte per block.
    fp4: e2m1 codes (magnitude index in E2M1_GRID, sign in bit 3), element 2i in the low
    nibble of byte i, 2i+1 in the high one. fp8: one e4m3fn code a value. Scale bytes: the
    e4m3fn code of an e4m3 scale, the biased exponent of an e8m0 one (0xFF: NaN or inf).
    A block whose scale is NaN or inf (every value of its round trip NaN) has codes 0.
    """
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    block, per_byte = _packed_format(fmt, d)
    lead = x.shape[:-1]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if fmt == "fp8_e8m0_32":
            q, scales = act_quant_e4m3(x, block)
            codes = _e4m3_codes(q).reshape(*lead, d // block, block)
        else:
            scale_format = "e4m3" if fmt == "fp4_e4m3_16" else "e8m0"
            scales = fp4_block_scales(x, block, scale_format)
            blocks = x.reshape(*lead, d // block, block)
            q = e2m1_rne(np.clip(blocks / scales, -6.0, 6.0))
            scales = scales[..., 0]
            index = np.searchsorted(E2M1_GRID, np.where(np.isnan(q), 0, np.abs(q)))
            codes = (index + 8 * np.signbit(q)).astype(np.uint8)
    bad = ~np.isfinite(scales)
    codes = np.where(bad[..., None], np.uint8(0), codes).reshape(*lead, d)
    if per_byte == 2:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    if fmt == "fp4_e4m3_16":
        scale_bytes = _e4m3_codes(scales)
    else:
        scale_bytes = ((scales.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    return np.concatenate([codes.astype(np.uint8), scale_bytes], axis=-1)


def unpack_quantized(p: np.ndarray, fmt: str, dim: int) -> np.ndarray:
    """UnpackQuantized: uint8 [..., row_bytes] -> float32 [..., dim], value(code) * scale in
    float32: bit for bit the round trip's bf16(q * s) (exact, or inf where that overflows);
    NaN for every value of a block with a NaN scale byte."""
    p = np.asarray(p, np.uint8)
    block, per_byte = _packed_format(fmt, dim)
    if p.shape[-1:] != (packed_row_bytes(fmt, dim),):
        raise ValueError(f"{fmt} rows of {dim} values are {packed_row_bytes(fmt, dim)} bytes, "
                         f"got shape {p.shape}")
    lead = p.shape[:-1]
    code_bytes = dim // per_byte
    codes, scale_bytes = p[..., :code_bytes], p[..., code_bytes:]
    if per_byte == 2:
        codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*lead, dim)
        signed_grid = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)
        values = signed_grid[codes]
    else:
        values = _e4m3_values()[codes]
    scales = (_e4m3_values() if fmt == "fp4_e4m3_16" else _e8m0_values())[scale_bytes]
    with np.errstate(invalid="ignore", over="ignore"):
        y = values.reshape(*lead, dim // block, block) * scales[..., None]
    return y.astype(np.float32).reshape(*lead, dim)


def sparse_attention_rows(kv: np.ndarray, compressed: np.ndarray | None = None,
                          fmt: str | None = None) -> np.ndarray:
    """The rows SparseAttention reads, [b, n_window + n_cache, d]: KV's rows, then the packed
    compressed cache's rows unpacked (index i >= n_window reads compressed row i - n_window).
    The op's result with `Compressed` equals its result on these rows, bit for bit."""
    kv = np.asarray(kv, np.float32)
    if compressed is None:
        return kv
    if fmt is None:
        raise ValueError("a packed compressed cache needs its format")
    return np.concatenate([kv, unpack_quantized(compressed, fmt, kv.shape[-1])], axis=1)


def write_rows(cache: np.ndarray, rows: np.ndarray, row_start: int) -> np.ndarray:
    """WriteRows: cache [B, R, ...] with rows row_start .. row_start+n-1 of its first b
    entries replaced by rows [b, n, ...] (any element type, the cache's)."""
    out = np.array(cache, copy=True)
    if rows.shape[0] > cache.shape[0] or rows.shape[2:] != cache.shape[2:]:
        raise ValueError(f"rows {rows.shape} do not fit cache {cache.shape}")
    if not 0 <= row_start <= cache.shape[1] - rows.shape[1]:
        raise ValueError(f"rows {row_start}..{row_start + rows.shape[1] - 1} are past the "
                         f"cache's {cache.shape[1]} rows")
    out[:rows.shape[0], row_start:row_start + rows.shape[1]] = rows
    return out


def block_max(x: np.ndarray, block_size: int) -> np.ndarray:
    """BlockMax: the max of each block of `block_size` values on the last axis, the last
    block shorter ([..., T] -> [..., ceil(T / block_size)]): NaN (0x7FC00000) where a block
    holds a NaN, else its largest value, +0 above -0 (IEEE 754-2019 maximum)."""
    x = np.asarray(x, np.float32)
    t = x.shape[-1]
    n = -(-t // block_size)
    size = block_size if n > 1 else t  # one block (or none) is the row, however large the size
    padded = np.full((*x.shape[:-1], n * size), -np.inf, np.float32)
    padded[..., :t] = x
    blocks = padded.reshape(*x.shape[:-1], n, size)
    bits = blocks.view(np.int32)
    # the total order -inf < ... < -0 < +0 < ... < +inf on the bits: flip negatives' magnitude
    keys = np.where(bits < 0, bits ^ np.int32(0x7FFFFFFF), bits)
    top = keys.max(axis=-1, initial=np.iinfo(np.int32).min)
    out = np.where(top < 0, top ^ np.int32(0x7FFFFFFF), top).astype(np.int32).view(np.float32)
    return np.where(np.isnan(blocks).any(axis=-1), np.uint32(0x7FC00000).view(np.float32), out)


def candidate_mask(blocks: np.ndarray, keep: np.ndarray, width: int,
                   block_size: int) -> np.ndarray:
    """CandidateMask: bool [..., width], position t true iff block t // block_size is among
    its row's `blocks` (int64 [..., k], distinct, each in [0, ceil(width / block_size))) with
    `keep` true: the picks' marks scattered into zeros, each position inheriting its block's."""
    n = -(-width // block_size)
    marks = np.zeros((*blocks.shape[:-1], n), bool)
    np.put_along_axis(marks, blocks, keep, axis=-1)
    return marks[..., np.arange(width) // block_size]
