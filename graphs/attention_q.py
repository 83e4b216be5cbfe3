"""Attention.forward steps 1-2 up to the window: the query path (wq_a, q_norm, wq_b, RoPE)
and the window KV projection (wkv, kv_norm, RoPE, fp8 round trip).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.graphs import quant
from csa2onnx.graphs.numerics import RMSNorm, Weight, linear
from csa2onnx.graphs.rope import FreqsCis, RopeParams, apply_rotary_emb, token_positions


def _check_rope(rope: RopeParams, rope_head_dim: int, head_dim: int) -> None:
    if rope.rope_head_dim != rope_head_dim:
        raise ValueError(f"RopeParams.rope_head_dim {rope.rope_head_dim} != rope_head_dim "
                         f"{rope_head_dim}")
    if not 0 < rope_head_dim <= head_dim:
        raise ValueError(f"rope_head_dim must be in 1..head_dim ({head_dim}), got "
                         f"{rope_head_dim}")


def _check_shape(name: str, w: np.ndarray, shape: tuple[int, ...]) -> None:
    if tuple(np.shape(w)) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(np.shape(w))}")


class QueryProjection(nn.Module):
    """qr = q_norm(wq_a(x)); q = wq_b(qr) as [b, s, n_heads, head_dim], RoPE'd at the
    tokens' positions. Returns (qr, q): the indexer reads qr, sparse_attn reads q."""

    def __init__(self, wq_a: Weight, q_norm: np.ndarray, wq_b: Weight, n_heads: int,
                 head_dim: int, rope_head_dim: int, norm_eps: float, rope: RopeParams,
                 name: str | None = None) -> None:
        super().__init__(name)
        if n_heads <= 0 or head_dim <= 0:
            raise ValueError(f"n_heads and head_dim must be > 0, got {n_heads}, {head_dim}")
        _check_rope(rope, rope_head_dim, head_dim)
        if np.ndim(wq_a) != 2:
            raise ValueError(f"wq_a must be [q_lora_rank, dim], got shape {np.shape(wq_a)}")
        q_lora_rank = np.shape(wq_a)[0]
        _check_shape("q_norm", q_norm, (q_lora_rank,))
        _check_shape("wq_b", wq_b, (n_heads * head_dim, q_lora_rank))
        self.n_heads, self.head_dim, self.rope_head_dim = n_heads, head_dim, rope_head_dim
        self.wq_a = linear(wq_a)
        self.q_norm = RMSNorm(q_norm, norm_eps)
        self.wq_b = linear(wq_b)
        self.freqs_cis = FreqsCis(rope)

    def forward(self, op: OpBuilder, x: ir.Value,
                start_pos: ir.Value) -> tuple[ir.Value, ir.Value]:
        qr = self.q_norm(op, self.wq_a(op, x))
        q = op.Reshape(self.wq_b(op, qr), [0, 0, self.n_heads, self.head_dim])
        cos, sin = self.freqs_cis(op, token_positions(op, x, start_pos))
        return qr, apply_rotary_emb(op, q, cos, sin, self.rope_head_dim)


class WindowKVProjection(nn.Module):
    """kv = kv_norm(wkv(x)) [b, s, head_dim], RoPE'd at the tokens' positions: the window
    KV before its fp8 round trip (act_quant), which the layer does as it packs the rows
    for the ring (kv_cache.WINDOW_FORMAT; unpacked, they are act_quant's values)."""

    def __init__(self, wkv: Weight, kv_norm: np.ndarray, head_dim: int, rope_head_dim: int,
                 norm_eps: float, rope: RopeParams, name: str | None = None) -> None:
        super().__init__(name)
        _check_rope(rope, rope_head_dim, head_dim)
        if np.ndim(wkv) != 2 or np.shape(wkv)[0] != head_dim:
            raise ValueError(f"wkv must be [head_dim={head_dim}, dim], got shape "
                             f"{np.shape(wkv)}")
        _check_shape("kv_norm", kv_norm, (head_dim,))
        if head_dim % quant.FP8_BLOCK:
            raise ValueError(f"head_dim {head_dim} must be a multiple of the fp8 block "
                             f"{quant.FP8_BLOCK}")
        self.rope_head_dim = rope_head_dim
        self.wkv = linear(wkv)
        self.kv_norm = RMSNorm(kv_norm, norm_eps)
        self.freqs_cis = FreqsCis(rope)

    def forward(self, op: OpBuilder, x: ir.Value, start_pos: ir.Value) -> ir.Value:
        kv = self.kv_norm(op, self.wkv(op, x))
        cos, sin = self.freqs_cis(op, token_positions(op, x, start_pos))
        return apply_rotary_emb(op, kv, cos, sin, self.rope_head_dim)
