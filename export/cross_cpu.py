"""The cross-CPU comparison rule: how a golden made on another CPU class may differ.

csa2onnx's kernels sum in the orders torch 2.13 uses on an x86 CPU with AVX512-BF16 and no
AMX (REFERENCE_CLASS: the AMD EPYC that made the shared goldens), on every CPU, so its
outputs are the same bits everywhere. torch itself is not: on AMX CPUs (and AVX2-only ones)
its bf16 matmul sums in another order, a last-bit difference now and then flips a bf16
rounding, and the flip travels downstream. Against a golden from another class (its JSON
`machine` says so) the bar is therefore not "bit-identical" but this rule:

1. Selections, masks and every integer array: EXACT (the classes agree on them).
2. inf/NaN where the golden has them, and nowhere else.
3. How far: every element within its envelope.
   - bf16 tensors before any quantiser (qr, q, window KV before fp8, latents):
     |a - g| <= 2^-5 |g| + 2^-6 max|g| (a few bf16 steps of a flip that went through a few
     linears; near-cancelling elements get the array-scale term).
   - quantised tensors move in whole quantisation steps: at most one step of their block's
     grid, bounded by the block's largest step: fp8 e4m3 (window KV, block 32) 2^-3 of the
     block max, fp4 e2m1 (compressed KV block 16, index keys and queries block 32) 1/3 of
     the block max (the 4 -> 6 step of a block whose max is 6 scale units).
   - tensors computed from quantised operands (attention output and the layer output,
     which average fp8/fp4 KV rows; index scores, top-k values and candidate block scores,
     dot products of fp4 queries and keys): one quantisation step of an operand moves them
     in proportion, so 2^-3 max|g| + 2^-5 |g|.
4. How many: in each group (array name x prefill / decode / final state, over every step
   and layer of the case) at most 1/8 of the elements may differ from the golden as bf16.
   A flip moves the rows that read it, not everything: measured across classes the worst
   group moves 3% (case3 `out` in prefill, torch forced to AVX2); a systematic error moves
   far more (bf16 rounding of the softmax probabilities left out: 33% of attn_o, 56% of
   out), and a missing quantiser or a wrong tie rule breaks the envelope or a selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Rule = Literal["same_cpu", "cross_cpu"]

# The class whose summation orders csa2onnx reproduces: AVX512-BF16 without AMX.
REFERENCE_CLASS = "x86 AVX512-BF16, no AMX"

BF16_RTOL = 2.0**-5
BF16_ATOL_FRACTION = 2.0**-6
DERIVED_ATOL_FRACTION = 2.0**-3
MAX_MOVED_FRACTION = 1 / 8

# Quantised arrays: (grid, block size along the last axis).
FP8_ARRAYS = {"window_kv": 32, "window_kv_cache_after": 32}
FP4_ARRAYS = {
    "compress_kv_cache_after": 16, "compress_kv_rows": 16, "latent_rope_quant": 16,
    "attn_kv": 16,  # window rows (fp8, block 32) then compressed rows (fp4, block 16)
    "index_k_rope_quant": 32, "index_k_rows": 32, "index_q_rope_quant": 32,
}
DERIVED_ARRAYS = frozenset({"attn_o", "out", "index_score", "index_topk_values",
                            "cand_block_scores", "cand_block_topk_values"})


def cpu_class(machine: dict[str, Any] | None) -> str:
    """The summation class of a golden's `machine` entry (FORMAT.md: absent means the
    AVX512-BF16 EPYC that made the shared goldens)."""
    if not machine:
        return REFERENCE_CLASS
    if "summation_class" in machine:  # cases made by tools/make_golden.py: torch was probed
        return REFERENCE_CLASS if machine["summation_class"] == "reference" else "probed other"
    isa = set(machine.get("isa", ()))
    if "amx_bf16" in isa:
        return "x86 AMX"
    if "avx512_bf16" in isa:
        return REFERENCE_CLASS
    return "x86 AVX2" if "avx2" in isa else "other"


def rule_for(meta: dict[str, Any]) -> Rule:
    """same_cpu for a golden made on the class csa2onnx reproduces, else cross_cpu."""
    return "same_cpu" if cpu_class(meta.get("machine")) == REFERENCE_CLASS else "cross_cpu"


def _block_max(g: np.ndarray, block: int) -> np.ndarray:
    """max|g| over blocks of `block` on the last axis, broadcast back to g's shape."""
    a = np.abs(np.where(np.isfinite(g), g, 0.0))
    n = g.shape[-1]
    if n % block:
        return np.broadcast_to(a.max(axis=-1, keepdims=True), g.shape)
    blocks = a.reshape(*g.shape[:-1], n // block, block).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks, (*g.shape[:-1], n // block, block)).reshape(g.shape)


def envelope(name: str, golden: np.ndarray) -> np.ndarray:
    """The largest |actual - golden| each element may have under the cross-CPU rule."""
    g = np.asarray(golden, np.float64)
    finite = np.where(np.isfinite(g), g, 0.0)
    scale = float(np.abs(finite).max()) if g.size else 0.0
    if name in FP8_ARRAYS:
        return _block_max(g, FP8_ARRAYS[name]) * 2.0**-3
    if name in FP4_ARRAYS:
        return _block_max(g, FP4_ARRAYS[name]) / 3.0
    atol = DERIVED_ATOL_FRACTION if name in DERIVED_ARRAYS else BF16_ATOL_FRACTION
    return BF16_RTOL * np.abs(finite) + atol * scale


def step_group(step: str) -> str:
    """prefill / decode / state: the count rule's groups within an array name."""
    return "prefill" if step.startswith("prefill") else "decode"


@dataclass
class MovedCounts:
    """Elements that differ from the golden as bf16, per (array name, group)."""

    counts: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def add(self, name: str, group: str, moved: int, size: int) -> None:
        entry = self.counts.setdefault((name, group), [0, 0])
        entry[0] += moved
        entry[1] += size

    def violations(self, limit: float = MAX_MOVED_FRACTION) -> list[str]:
        return [f"{name} ({group}): {moved} of {size} elements moved "
                f"({moved / size:.1%} > {limit:.1%})"
                for (name, group), (moved, size) in sorted(self.counts.items())
                if size and moved > limit * size]

    def worst(self) -> float:
        return max((m / s for m, s in self.counts.values() if s), default=0.0)
