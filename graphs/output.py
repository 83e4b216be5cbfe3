"""Attention.forward steps 4 (the inverse RoPE on sparse_attn's output) and 5 (the grouped
output LoRA: wo_a per group of heads, then wo_b back to `dim`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.ops import split_groups
from csa2onnx.custom_ops.weight_layout import PackedWeight
from csa2onnx.graphs.numerics import Linear, Weight, linear, round_bf16
from csa2onnx.graphs.rope import FreqsCis, RopeParams, apply_rotary_emb, token_positions


class OutputProjection(nn.Module):
    """out = wo_b(flatten(einsum("bsgd,grd->bsgr", o_groups, wo_a))) after undoing the
    RoPE of o's last rope_head_dim features at the query positions.

    o [b, s, n_heads, head_dim] (sparse_attn's output) is viewed as o_groups groups of
    n_heads*head_dim/o_groups features; group g meets its own [o_lora_rank, .] slice of wo_a
    ([o_groups*o_lora_rank, n_heads*head_dim/o_groups], bf16), rounded once to bf16. wo_a is
    one weight of all groups (an array, or a PackedWeight of o_groups groups: the
    exporter's), run as ONE grouped TorchLinear that reads o's groups and writes the result's
    in place; or its o_groups slices as plain arrays (a portable export's: each group's
    MatMul reads its own initializer, where a Split of one weight would fold into a copy).
    """

    def __init__(self, wo_a: np.ndarray | PackedWeight | Sequence[np.ndarray], wo_b: Weight,
                 n_heads: int, head_dim: int, o_groups: int, o_lora_rank: int,
                 rope_head_dim: int, rope: RopeParams, name: str | None = None) -> None:
        super().__init__(name)
        if min(n_heads, head_dim, o_groups, o_lora_rank) <= 0:
            raise ValueError("n_heads, head_dim, o_groups and o_lora_rank must be > 0, got "
                             f"{n_heads}, {head_dim}, {o_groups}, {o_lora_rank}")
        if (n_heads * head_dim) % o_groups:
            raise ValueError(f"n_heads*head_dim ({n_heads * head_dim}) is not divisible by "
                             f"o_groups ({o_groups})")
        if rope.rope_head_dim != rope_head_dim or not 0 < rope_head_dim <= head_dim:
            raise ValueError(f"rope_head_dim {rope_head_dim} must match RopeParams "
                             f"({rope.rope_head_dim}) and lie in 1..head_dim ({head_dim})")
        group_dim = n_heads * head_dim // o_groups
        self.wo_a: Linear | nn.ModuleList
        if isinstance(wo_a, (np.ndarray, PackedWeight)):
            if tuple(np.shape(wo_a)) != (o_groups * o_lora_rank, group_dim):
                raise ValueError(f"wo_a must have shape [o_groups*o_lora_rank, n_heads*head_dim/"
                                 f"o_groups] = {[o_groups * o_lora_rank, group_dim]}, got "
                                 f"{list(np.shape(wo_a))}")
            self.wo_a = Linear(wo_a, groups=o_groups)  # rounded to bf16 in its store
        else:
            groups = list(wo_a)
            if len(groups) != o_groups or any(
                    np.shape(w) != (o_lora_rank, group_dim) for w in groups):
                raise ValueError(f"wo_a as groups must be {o_groups} weights [o_lora_rank, "
                                 f"n_heads*head_dim/o_groups] = {[o_lora_rank, group_dim]}, "
                                 f"got {[list(np.shape(w)) for w in groups]}")
            self.wo_a = nn.ModuleList([Linear(w, rounded=False) for w in groups])
        if np.ndim(wo_b) != 2 or np.shape(wo_b)[1] != o_groups * o_lora_rank:
            raise ValueError(f"wo_b must be [dim, o_groups*o_lora_rank="
                             f"{o_groups * o_lora_rank}], got shape {list(np.shape(wo_b))}")
        self.n_heads, self.head_dim, self.rope_head_dim = n_heads, head_dim, rope_head_dim
        self.o_groups, self.o_lora_rank, self.group_dim = o_groups, o_lora_rank, group_dim
        self.wo_b = linear(wo_b)
        self.freqs_cis = FreqsCis(rope)

    def forward(self, op: OpBuilder, o: ir.Value, start_pos: ir.Value) -> ir.Value:
        cos, sin = self.freqs_cis(op, token_positions(op, o, start_pos))
        o = apply_rotary_emb(op, o, cos, sin, self.rope_head_dim, inverse=True)
        # Group g of o (features g*group_dim.. of a token's) times its own [o_lora_rank,
        # group_dim] rows of wo_a, summed in torch's order (TorchLinear), rounded once.
        o = op.Reshape(o, [0, 0, self.o_groups * self.group_dim])
        if isinstance(self.wo_a, Linear):
            lora = self.wo_a(op, o)  # [b, s, o_groups * o_lora_rank]
        else:
            parts = zip(self.wo_a, split_groups(op, o, self.o_groups), strict=True)
            lora = round_bf16(op, op.Concat(*[wo_a_g(op, x) for wo_a_g, x in parts], axis=-1))
        return self.wo_b(op, lora)
