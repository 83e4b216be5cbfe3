"""The Compressor (reference.md "Compressor"): pools every `ratio` tokens into one latent.

Ratio 1 is a plain bf16 projection per token. Ratio r > 1 projects in float32 (f32
weights on f32 x), and per group of r tokens and per feature weights the r kv values by a
softmax over the r gate scores. A prefill pools its complete groups and parks the s % r
leftover tokens in `kv_state`/`score_state`; a decode step writes one slot and pools all
r slots when it completes a group. The pooled f32 vector is rounded to bf16 and
RMSNorm'ed; RoPE and quantisation happen later (kv_cache.latent_to_cache_rows).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.graphs.common import Mode, scalar_i64
from csa2onnx.graphs.numerics import (
    INT64,
    Linear,
    LinearF32,
    RMSNorm,
    TorchWeight,
    reduce_axis,
    round_bf16,
)

# What an empty state slot holds: kv 0 and a -inf score, so it gets zero softmax weight.
KV_STATE_FILL = 0.0
SCORE_STATE_FILL = float("-inf")


class CompressorOutput(NamedTuple):
    """latent [b, n, head_dim] bf16 (n may be 0), positions int64 [n] (the first token of
    each latent's group), and the f32 state [b, r, head_dim] after the call (None at r=1)."""

    latent: ir.Value
    positions: ir.Value
    kv_state: ir.Value | None
    score_state: ir.Value | None


class Compressor(nn.Module):
    """Compressor(wkv, wgate, norm, ratio, head_dim, norm_eps), names as upstream.

    Call `compressor(op, x, mode="prefill")`, or with `kv_state, score_state, start_pos`
    for a prefill that continues a sequence (chunked prefill) or a decode step
    (`mode="decode"`); all return a CompressorOutput. At ratio 1 pass no state (start_pos
    by keyword, when not 0). Build a fresh module per exported model: parameters bind to
    one graph.
    """

    def __init__(self, wkv: TorchWeight, wgate: TorchWeight | None, norm: np.ndarray, *,
                 ratio: int, head_dim: int, norm_eps: float) -> None:
        super().__init__()
        if ratio < 1:
            raise ValueError(f"Compressor ratio must be >= 1 (0 means no compressor), got {ratio}")
        if np.ndim(wkv) != 2 or np.shape(wkv)[0] != head_dim:
            raise ValueError(f"compressor wkv must be [head_dim={head_dim}, dim], got "
                             f"{np.shape(wkv)}")
        if np.shape(norm) != (head_dim,):
            raise ValueError(f"compressor norm must be [{head_dim}], got {np.shape(norm)}")
        self.ratio = ratio
        self.head_dim = head_dim
        if ratio == 1:
            if wgate is not None:
                raise ValueError("a ratio-1 compressor has no wgate (nothing to pool)")
            self.wkv = Linear(wkv)  # bf16 weight, bf16 result
        else:
            if wgate is None or np.shape(wgate) != np.shape(wkv):
                got = None if wgate is None else np.shape(wgate)
                raise ValueError(f"a ratio-{ratio} compressor needs wgate shaped like wkv "
                                 f"{np.shape(wkv)}, got {got}")
            # float32 end to end until the norm (the reference keeps these weights f32).
            self.wkv = LinearF32(wkv)
            self.wgate = LinearF32(wgate)
        self.norm = RMSNorm(norm, norm_eps)

    def forward(self, op: OpBuilder, x: ir.Value, kv_state: ir.Value | None = None,
                score_state: ir.Value | None = None, start_pos: ir.Value | None = None, *,
                mode: Mode = "prefill") -> CompressorOutput:
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if mode == "decode" and start_pos is None:
            raise ValueError("decode needs start_pos")
        if self.ratio == 1:
            if kv_state is not None or score_state is not None:
                raise ValueError("a ratio-1 compressor keeps no state")
            return self._per_token(op, x, start_pos)
        if mode == "prefill":
            if (kv_state is None) != (start_pos is None) or (kv_state is None) != (
                    score_state is None):
                raise ValueError("a prefill that continues a sequence needs kv_state, "
                                 "score_state and start_pos; a first one none of them")
            return self._prefill(op, x, kv_state, score_state, start_pos)
        if kv_state is None or score_state is None:
            raise ValueError(f"a ratio-{self.ratio} decode step needs kv_state and score_state")
        return self._decode(op, x, kv_state, score_state, start_pos)

    def _per_token(self, op: OpBuilder, x: ir.Value,
                   start_pos: ir.Value | None) -> CompressorOutput:
        latent = self.norm(op, self.wkv(op, x))
        s = op.Squeeze(op.Slice(op.Shape(x), [1], [2]), [0])
        start = op.Constant(value_int=0) if start_pos is None else op.Squeeze(
            scalar_i64(op, start_pos), [0])
        positions = op.Range(start, op.Add(start, s), op.Constant(value_int=1))
        return CompressorOutput(latent, positions, None, None)

    def _pool(self, op: OpBuilder, kv: ir.Value, score: ir.Value) -> ir.Value:
        """[..., r, hd] f32 -> RMSNorm(bf16(sum_r softmax_r(score) * kv)) [..., hd]."""
        pooled = reduce_axis(op, "Sum", op.Mul(kv, op.Softmax(score, axis=-2)), -2)
        return self.norm(op, round_bf16(op, pooled))

    def _prefill(self, op: OpBuilder, x: ir.Value, kv_state: ir.Value | None = None,
                 score_state: ir.Value | None = None,
                 start_pos: ir.Value | None = None) -> CompressorOutput:
        """A prefill from start_pos 0, or (with the state and start_pos P) one that
        continues a sequence: the P % r tokens of the open group, kept in slots 0.. of the
        state, go in front of the new ones, so groups start at P - P % r."""
        r = self.ratio
        kv, score = self.wkv(op, x), self.wgate(op, x)
        group_start: ir.Value | int = 0
        if start_pos is not None:
            pos = scalar_i64(op, start_pos)
            pending = op.Mod(pos, r)
            kv = op.Concat(op.Slice(kv_state, [0], pending, [1]), kv, axis=1)
            score = op.Concat(op.Slice(score_state, [0], pending, [1]), score, axis=1)
            group_start = op.Squeeze(op.Sub(pos, pending), [0])
        shape = op.Shape(kv)
        s = op.Slice(shape, [1], [2])
        n = op.Div(s, r)  # complete groups (s >= 0, so truncation is floor)
        cutoff = op.Mul(n, r)

        # Complete groups: [b, n*r, hd] -> [b, n, r, hd]; n may be 0.
        grouped = op.Concat(op.Slice(shape, [0], [1]), n, [r, self.head_dim], axis=0)

        def groups(t: ir.Value) -> ir.Value:
            return op.Reshape(op.Slice(t, [0], cutoff, [1]), grouped)

        latent = self._pool(op, groups(kv), groups(score))
        positions = op.Mul(op.Range(op.Constant(value_int=0), op.Squeeze(n, [0]),
                                    op.Constant(value_int=1)), r)
        if start_pos is not None:
            positions = op.Add(positions, group_start)

        # The s % r leftovers fill slots 0.., the other slots keep their initial fill.
        empty = op.Sub(r, op.Sub(s, cutoff))
        pads = op.Concat([0, 0, 0, 0], empty, [0], axis=0)

        def state(t: ir.Value, fill: float) -> ir.Value:
            return op.Pad(op.Slice(t, cutoff, s, [1]), pads, op.Constant(value_float=fill))

        return CompressorOutput(latent, positions, state(kv, KV_STATE_FILL),
                                state(score, SCORE_STATE_FILL))

    def _decode(self, op: OpBuilder, x: ir.Value, kv_state: ir.Value, score_state: ir.Value,
                start_pos: ir.Value) -> CompressorOutput:
        r = self.ratio
        pos = scalar_i64(op, start_pos)
        # Write slot start_pos % r: a one-hot [r, 1] mask selects the new [b, 1, hd] row.
        slot = op.Unsqueeze(op.Equal(op.Range(op.Constant(value_int=0), op.Constant(value_int=r),
                                               op.Constant(value_int=1)), op.Mod(pos, r)), [-1])
        kv_state = op.Where(slot, self.wkv(op, x), kv_state)
        score_state = op.Where(slot, self.wgate(op, x), score_state)
        # The group completes when start_pos + 1 is a multiple of r: then 1 latent, else 0.
        first = op.Sub(op.Add(pos, 1), r)
        n = op.Cast(op.Equal(op.Mod(op.Add(pos, 1), r), 0), to=INT64)
        pooled = op.Unsqueeze(self._pool(op, kv_state, score_state), [1])  # [b, 1, hd]
        latent = op.Slice(pooled, [0], n, [1])
        positions = op.Slice(first, [0], n, [0])
        return CompressorOutput(latent, positions, kv_state, score_state)
