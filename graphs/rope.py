"""Rotary embeddings: the reference's precompute_freqs_cis (plain and YaRN) and
apply_rotary_emb on the LAST `rope_head_dim` features, adjacent pairs as complex numbers."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.library import libm_cos_sin
from csa2onnx.custom_ops.ops import apply_rope, is_portable, rope_cos_sin
from csa2onnx.graphs.numerics import FLOAT, INT64, weight


@dataclass(frozen=True)
class RopeParams:
    """precompute_freqs_cis's arguments; `original_seq_len == 0` turns YaRN off."""

    rope_head_dim: int
    max_seq_len: int
    base: float
    original_seq_len: int = 0
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_head_dim <= 0 or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim must be even and > 0, got {self.rope_head_dim}")
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {self.max_seq_len}")


def layer_rope_params(args: Mapping[str, Any], ratio: int) -> RopeParams:
    """The RoPE a layer of compress ratio `ratio` uses (`args` in ModelArgs names): ratio-0
    layers rope_theta without YaRN, compressed layers compress_rope_theta with YaRN."""
    common = {"rope_head_dim": args["rope_head_dim"], "max_seq_len": args["max_seq_len"]}
    if ratio == 0:
        return RopeParams(base=args["rope_theta"], **common)
    return RopeParams(base=args["compress_rope_theta"], original_seq_len=args["original_seq_len"],
                      factor=args["rope_factor"], beta_fast=args["beta_fast"],
                      beta_slow=args["beta_slow"], **common)


def inverse_frequencies(p: RopeParams) -> np.ndarray:
    """f_i = 1 / base^(2i/rd) in float32, with YaRN's ramp when original_seq_len > 0."""
    dim = p.rope_head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # torch's float32 pow here is correctly rounded: evaluate in float64, round once.
    powers = np.power(np.float64(p.base), exponents.astype(np.float64)).astype(np.float32)
    freqs = np.float32(1.0) / powers
    if p.original_seq_len > 0:
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(p.original_seq_len / (rotations * 2 * math.pi))
                    / (2 * math.log(p.base)))

        low = max(math.floor(correction_dim(p.beta_fast)), 0)
        high = min(math.ceil(correction_dim(p.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                       / np.float32(high - low), 0, 1).astype(np.float32)
        smooth = np.float32(1) - ramp
        freqs = (freqs / np.float32(p.factor) * (np.float32(1) - smooth) + freqs * smooth)
    return freqs.astype(np.float32)


@functools.lru_cache(maxsize=2)  # as upstream's: the modules of a layer share one pair
def freqs_cis(p: RopeParams) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) tables [max_seq_len, rd/2] of the float32 angles pos * f_i (read-only).

    The angle is the float32 product torch.outer computes; cos and sin come from the C
    library's cosf/sinf, as torch.polar evaluates them, so the tables are bit-exact.
    """
    angles = (np.arange(p.max_seq_len, dtype=np.float32)[:, None]
              * inverse_frequencies(p)[None, :]).astype(np.float32)
    cos, sin = libm_cos_sin(angles)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def token_positions(op: OpBuilder, x: ir.Value, start_pos: ir.Value) -> ir.Value:
    """int64 [s]: start_pos + 0..s-1 for x [b, s, ...]; start_pos is an int scalar or [1].

    Where s is static (a decode step's 1) the positions depend on start_pos alone, so every
    module and layer builds the same nodes, which the exporter then computes once (with
    the RoPE rows read at them)."""
    s = x.shape[1] if x.shape is not None and len(x.shape) > 1 else None
    if isinstance(s, int):
        return op.Add(op.Reshape(op.Cast(start_pos, to=INT64), [-1]), list(range(s)))
    start = op.Reshape(op.Cast(start_pos, to=INT64),
                       op.Constant(value=ir.tensor(np.zeros(0, np.int64))))
    s = op.Squeeze(op.Slice(op.Shape(x), [1], [2]), [0])
    return op.Range(start, op.Add(start, s), 1)


def rope_at(op: OpBuilder, cos_table: ir.Value, sin_table: ir.Value,
            positions: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(cos, sin) rows [n, rd/2] of freqs_cis tables ([max_seq_len, rd/2]) at positions (the
    portable graphs' way; FreqsCis computes the rows instead where the library is)."""
    return op.Gather(cos_table, positions, axis=0), op.Gather(sin_table, positions, axis=0)


class FreqsCis(nn.Module):
    """A layer's freqs_cis rows at given positions: (cos, sin) [..., rd/2] for int64
    positions [...].

    With the custom-op library, RopeCosSin computes the rows each call from the inverse
    frequencies (an attribute): the model holds no table, so neither its size nor its
    export time grows with max_seq_len. A portable graph (no library) keeps the tables as
    two float32 initializers `cos`, `sin` [max_seq_len, rd/2] and gathers from them: ONNX's
    Cos and Sin are not the C library's cosf/sinf (identical tables are stored once per
    artifact by the exporter).
    """

    def __init__(self, params: RopeParams, name: str | None = None) -> None:
        super().__init__(name)
        self.params = params
        self.inverse_frequencies = inverse_frequencies(params)

    def __call__(self, op: OpBuilder, positions: ir.Value) -> tuple[ir.Value, ir.Value]:
        if is_portable(op) and not hasattr(self, "cos"):
            # registered before Module.__call__ realises the parameters in scope
            cos, sin = freqs_cis(self.params)
            self.cos = weight(cos, FLOAT)
            self.sin = weight(sin, FLOAT)
        return super().__call__(op, positions)

    def forward(self, op: OpBuilder, positions: ir.Value) -> tuple[ir.Value, ir.Value]:
        if is_portable(op):
            return rope_at(op, self.cos, self.sin, positions)
        return rope_cos_sin(op, positions, self.inverse_frequencies, self.params.max_seq_len)


def apply_rotary_emb(op: OpBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value,
                     rope_head_dim: int, inverse: bool = False) -> ir.Value:
    """Rotate the last `rope_head_dim` features of x ([b, s, d] or [b, s, h, d]).

    `cos`/`sin` are [s, rd/2] rows already gathered at the tokens' positions (or
    [b, s, rd/2] for per-batch positions); x's other features pass through unchanged.
    The product is float32 and the result is rounded to bf16, as the reference's copy_
    back into a bf16 tensor does. One ApplyRope node (a portable artifact runs its
    standard-op body: custom_ops/portable.py).
    """
    return apply_rope(op, x, cos, sin, rope_head_dim, inverse)
