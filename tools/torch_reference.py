"""An independent PyTorch oracle for DeepSeek-V4.1 compressed sparse attention.

A compact re-implementation of ../shared/spec/reference.md (the semantics of the upstream
`inference/model.py` on the CPU with bf16 activations), written from the spec, not from the
exporter, and checked against the shared goldens (`--check`). It runs a stack of layers
call by call with the four shared slots of SharedAttentionRuntime, and records every
intermediate under the goldens' array names so tools/make_golden.py can write new cases.

    python tools/torch_reference.py --check            # oracle vs goldens/, every case

Weights are named as `Attention.named_parameters()` names them; bf16 except `attn_sink` and
the ratio > 1 compressor's `wkv`/`wgate` (f32). The config is a ModelArgs dict (a golden's
`model_args`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from csa2onnx.graphs.standalone import IR_VERSION

BF16, F32, E4M3, E8M0 = torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu
# The linears an fp8 checkpoint stores as e4m3 with [32, 32] ue8m0 block scales.
FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b")
NEG_INF = float("-inf")
ATTN_BLOCK = 64  # sparse_attn's online-softmax block
Record = Callable[[str, torch.Tensor], None]


# ---------------------------------------------------------------- building blocks
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype)


def precompute_freqs_cis(rd: int, max_seq_len: int, original_seq_len: int, base: float,
                         factor: float, beta_fast: float, beta_slow: float) -> torch.Tensor:
    """[max_seq_len, rd/2] complex64; YaRN when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=F32) / rd))
    if original_seq_len > 0:
        def corr(rot: float) -> float:
            return rd * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=F32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(max_seq_len, dtype=F32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """apply_rotary_emb on the last rd features of x [b, s, (H,) d]: adjacent pairs as complex
    numbers times freqs_cis [s, rd/2] (per token) in f32, rounded back to x's dtype."""
    rd = 2 * freqs_cis.size(-1)
    z = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    f = freqs_cis.conj() if inverse else freqs_cis
    f = f.view(1, x.size(1), *([1] * (x.ndim - 3)), rd // 2)
    out = x.clone()
    out[..., -rd:] = torch.view_as_real(z * f).flatten(-2)
    return out


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive normal f32 v, exactly (frexp: v = m * 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(v)
    e = e - (m == 0.5).to(e.dtype)
    return ((e + 127).to(torch.int32) << 23).view(F32)


def act_quant_scaled(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values (as f32) and their power-of-two (ue8m0) scales, one per `block` inputs."""
    v = x.float().unflatten(-1, (-1, block))
    s = pow2_ceil(v.abs().amax(-1, keepdim=True).clamp(min=1e-4) * (1 / 448))
    return (v / s).clamp(-448, 448).to(E4M3).float().flatten(-2), s.squeeze(-1)


def act_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """fp8 e4m3 round trip with power-of-two (ue8m0) block scales."""
    q, s = act_quant_scaled(x, block)
    return (q.unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(BF16)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """reference.md "fp8 linears": act_quant(x) (block 32), then per K block in order an
    exact block dot (float64 holds any 32 e4m3 products) rounded once to f32, times
    xs * ws in f32, added to an f32 accumulator; bf16 at the end."""
    q, xs = act_quant_scaled(x)
    n, k = w.shape
    ws = w_scale.float().repeat_interleave(32, dim=0)[:n]  # [n, k/32]
    acc = torch.zeros(*x.shape[:-1], n, dtype=F32)
    for kb in range(k // 32):
        cols = slice(32 * kb, 32 * kb + 32)
        dot = (q[..., cols].double() @ w[:, cols].double().T).float()
        acc = acc + dot * (xs[..., kb:kb + 1] * ws[:, kb])
    return acc.to(BF16)


E2M1_GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F32)
E2M1_MID = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
E2M1_UP_ON_TIE = torch.arange(7) % 2 == 1  # a tie goes to the EVEN code: k+1 even


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    a = v.abs().unsqueeze(-1)
    code = ((a > E2M1_MID) | ((a == E2M1_MID) & E2M1_UP_ON_TIE)).sum(-1)
    return torch.copysign(E2M1_GRID[code], v)


def fp4_quant(x: torch.Tensor, block: int, e4m3_scale: bool = False) -> torch.Tensor:
    """fp4 e2m1 round trip: e8m0 scales (block 32) or e4m3 scales (block 16)."""
    v = x.float().unflatten(-1, (-1, block))
    amax = v.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        s = (amax.clamp(min=6 * 2.0**-9) / 6).clamp(max=448).to(E4M3).float()
    else:
        s = pow2_ceil(amax.clamp(min=6 * 2.0**-126) * (1 / 6))
    return (e2m1_rne((v / s).clamp(-6, 6)) * s).flatten(-2).to(BF16)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float, round_p: bool = True) -> torch.Tensor:
    """q [b,s,H,d], kv [b,n,d] (key = value), idx [b,s,K] (-1: nothing) -> bf16 [b,s,H,d].
    Online softmax over idx in blocks of 64; probabilities rounded to bf16 before P@V; the
    sink only in the denominator. (`round_p=False`: a deliberate bug, for negative
    controls.)"""
    b, s, h, d = q.shape
    m = torch.full((b, s, h), -1e30, dtype=F32)
    total = torch.zeros(b, s, h, dtype=F32)
    acc = torch.zeros(b, s, h, d, dtype=F32)
    batch = torch.arange(b).view(b, 1, 1)
    # The final block is padded with -1 to a full 64 (exact zeros, but the f32 sums then run
    # in the order the goldens hold, bit for bit).
    idx = F.pad(idx, (0, -idx.size(-1) % ATTN_BLOCK), value=-1)
    for j in range(0, idx.size(-1), ATTN_BLOCK):
        block = idx[..., j:j + ATTN_BLOCK]
        rows = kv[batch, block.clamp(min=0)].float()  # [b, s, n, d]
        logits = torch.einsum("bshd,bsnd->bshn", q.float(), rows) * scale
        logits = logits.masked_fill((block < 0).unsqueeze(2), NEG_INF)
        m_new = torch.maximum(m, logits.amax(-1))
        p = torch.exp(logits - m_new.unsqueeze(-1))
        alpha = torch.exp(m - m_new)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum(
            "bshn,bsnd->bshd", p.to(BF16).float() if round_p else p, rows)
        m = m_new
    return (acc / (total + torch.exp(sink.view(1, 1, h) - m)).unsqueeze(-1)).to(BF16)


def tie_left_out(score: torch.Tensor, top_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(ties at the k-th value [.., n], whether top-k left one of them out [..]): rows where
    the tie rule decides what is picked."""
    kth = top_values.amin(-1, keepdim=True)
    tied = score == kth
    return tied, tied.sum(-1) > (top_values == kth).sum(-1), kth.squeeze(-1)


def select_candidate_blocks(logits: torch.Tensor, compress_lens: torch.Tensor,
                            topk_blocks: int, block_size: int,
                            record: Record | None = None) -> torch.Tensor:
    n = logits.size(-1)
    n_blocks = -(-n // block_size)
    padded = F.pad(logits, (0, n_blocks * block_size - n), value=NEG_INF)
    blocks = padded.unflatten(-1, (n_blocks, block_size)).amax(-1)
    last = torch.div(compress_lens - 1, block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(n_blocks) == last.unsqueeze(-1), float("inf"))
    top = blocks.topk(min(topk_blocks, n_blocks), dim=-1, sorted=True)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter(-1, top.indices, top.values > NEG_INF)
    if record:
        record("cand_block_scores", blocks)
        record("cand_block_topk_values", top.values)
        record("cand_block_topk_indices", top.indices)
        _, left_out, kth = tie_left_out(blocks, top.values)
        record("cand_block_topk_ambiguous", left_out & (kth > NEG_INF))
    return keep.repeat_interleave(block_size, dim=-1)[..., :n]


def window_idxs(win: int, b: int, s: int, start_pos: int) -> torch.Tensor:
    """get_window_topk_idxs: prefill matrix [b, s, min(s, win)]; decode ring order [b, 1, win]."""
    if start_pos > 0:  # oldest first; a slot past start_pos (ring still filling) is -1
        p = start_pos % win
        row = torch.cat([torch.arange(p + 1, win), torch.arange(0, p + 1)])
        row = torch.where(row > start_pos, -1, row)
    else:
        t = torch.arange(s).unsqueeze(1)
        row = (t - win + 1).clamp(min=0) + torch.arange(min(s, win))
        row = torch.where(row > t, -1, row)
    return row.expand(b, s, -1) if row.ndim == 1 else row.expand(b, -1, -1)


# ---------------------------------------------------------------- config and roles
def layer_roles(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer, as the goldens' `layer_roles` hold them."""
    roles = []
    cand = args.get("candidate_source_layer", -1)
    for layer, ratio in enumerate(args["compress_ratios"][:args["n_layers"]]):
        kv, idx = layer in args["kv_source_layers"], layer in args["index_source_layers"]
        role = {"layer": layer, "compress_ratio": ratio, "is_kv_source": kv,
                "is_index_source": idx}
        if ratio:
            role |= {"indexer_owns_k": idx and kv, "is_candidate_source": layer == cand,
                     "uses_candidates": idx and cand != -1 and layer > cand}
        roles.append(role)
    return roles


def parameter_dtype(name: str, ratio: int, fp8: bool = False) -> torch.dtype:
    if fp8 and name.removesuffix(".weight").removesuffix(".scale") in FP8_LINEARS:
        return E8M0 if name.endswith(".scale") else E4M3
    f32 = name == "attn_sink" or (ratio > 1 and name in ("compressor.wkv.weight",
                                                        "compressor.wgate.weight"))
    return F32 if f32 else BF16


def parameter_shapes(args: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    a, role = args, layer_roles(args)[layer]
    hd, g = a["head_dim"], a["o_groups"]
    shapes = {"attn_sink": (a["n_heads"],), "wq_a.weight": (a["q_lora_rank"], a["dim"]),
              "q_norm.weight": (a["q_lora_rank"],),
              "wq_b.weight": (a["n_heads"] * hd, a["q_lora_rank"]),
              "wkv.weight": (hd, a["dim"]), "kv_norm.weight": (hd,),
              "wo_a.weight": (g * a["o_lora_rank"], a["n_heads"] * hd // g),
              "wo_b.weight": (a["dim"], g * a["o_lora_rank"])}
    if role["is_kv_source"]:
        shapes["compressor.wkv.weight"] = (hd, a["dim"])
        if role["compress_ratio"] > 1:
            shapes["compressor.wgate.weight"] = (hd, a["dim"])
        shapes["compressor.norm.weight"] = (hd,)
    if role["is_index_source"]:
        shapes["indexer.wq_b.weight"] = (a["index_n_heads"] * a["index_head_dim"],
                                         a["q_lora_rank"])
        shapes["indexer.weights_proj.weight"] = (a["index_n_heads"], a["dim"])
        if role["indexer_owns_k"]:
            shapes["indexer.wk.weight"] = (a["index_head_dim"], hd)
            shapes["indexer.k_norm.weight"] = (a["index_head_dim"],)
    return shapes


def layer_freqs_cis(args: dict[str, Any], ratio: int) -> torch.Tensor:
    a = args
    if ratio == 0:  # window-only layers: rope_theta, no YaRN
        return precompute_freqs_cis(a["rope_head_dim"], a["max_seq_len"], 0, a["rope_theta"],
                                    a["rope_factor"], a["beta_fast"], a["beta_slow"])
    return precompute_freqs_cis(a["rope_head_dim"], a["max_seq_len"], a["original_seq_len"],
                                a["compress_rope_theta"], a["rope_factor"], a["beta_fast"],
                                a["beta_slow"])


def rope_tables(args: dict[str, Any]) -> dict[str, np.ndarray]:
    """`freqs_cis.window` / `.compress` as the goldens hold them: [max_seq_len, rd/2, 2]."""
    ratios = args["compress_ratios"][:args["n_layers"]]
    tables = {"window": 0, "compress": 1} if any(ratios) else {"window": 0}
    return {f"freqs_cis.{name}": torch.view_as_real(layer_freqs_cis(args, r)).numpy()
            for name, r in tables.items()}


# ---------------------------------------------------------------- the layer and the stack
class SharedAttentionRuntime:
    """The four process-wide slots; each holds what was LAST written to it (never reset)."""

    def __init__(self) -> None:
        self.compress_kv: torch.Tensor | None = None  # a kv source's compressed cache
        self.index_k: torch.Tensor | None = None  # an index-key owner's key cache
        self.topk_idxs: torch.Tensor | None = None  # the last index source's selection
        self.candidates: torch.Tensor | None = None  # the candidate source's mask


class Attention:
    def __init__(self, args: dict[str, Any], layer: int, weights: dict[str, torch.Tensor],
                 shared: SharedAttentionRuntime, owner_reads_own_index_k: bool = False):
        a = self.args = args
        role = layer_roles(args)[layer]
        self.layer, self.shared, self.own_k = layer, shared, owner_reads_own_index_k
        self.ratio, self.kv_source = role["compress_ratio"], role["is_kv_source"]
        self.index_source = role["is_index_source"]
        self.owns_k = role.get("indexer_owns_k", False)
        self.candidate_source = role.get("is_candidate_source", False)
        self.uses_candidates = role.get("uses_candidates", False)
        fp8 = args.get("dtype") == "fp8"
        # e8m0 scales are kept as their (exact) f32 values
        self.w = {k: v.float() if k.endswith(".scale") else
                  v.to(parameter_dtype(k, self.ratio, fp8)) for k, v in weights.items()}
        self.freqs_cis = layer_freqs_cis(args, self.ratio)
        b, hd, r = a["max_batch_size"], a["head_dim"], self.ratio
        self.window_kv = torch.zeros(b, a["window_size"], hd, dtype=BF16)
        if r and self.kv_source:
            self.compress_kv = torch.zeros(b, a["max_seq_len"] // r, hd, dtype=BF16)
            self.kv_state = torch.zeros(b, r, hd, dtype=F32)
            self.score_state = torch.full((b, r, hd), NEG_INF, dtype=F32)
        if self.owns_k:
            self.index_k = torch.zeros(b, a["max_seq_len"] // r, a["index_head_dim"], dtype=BF16)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if f"{name}.scale" in self.w:  # an fp8 checkpoint's linear
            return fp8_linear(x, self.w[f"{name}.weight"].float(), self.w[f"{name}.scale"])
        return F.linear(x, self.w[f"{name}.weight"])

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[f"{name}.weight"], self.args["norm_eps"])

    def forward(self, x: torch.Tensor, start_pos: int, record: Record) -> torch.Tensor:
        a, r, shared = self.args, self.ratio, self.shared
        b, s, _ = x.shape
        end_pos, win, hd = start_pos + s, a["window_size"], a["head_dim"]
        freqs = self.freqs_cis[start_pos:end_pos]

        qr = self.norm(self.linear(x, "wq_a"), "q_norm")
        q = rope(self.linear(qr, "wq_b").unflatten(-1, (a["n_heads"], hd)), freqs)
        kv = rope(self.norm(self.linear(x, "wkv"), "kv_norm"), freqs)
        record("qr", qr)
        record("q_rope", q)
        record("window_kv_prequant", kv)
        kv = act_quant(kv)
        record("window_kv", kv)
        if start_pos == 0:
            for p in range(max(0, s - win), s):
                self.window_kv[:b, p % win] = kv[:, p]
            attn_kv, offset = kv, s
        else:
            self.window_kv[:b, start_pos % win] = kv[:, 0]
            attn_kv, offset = self.window_kv[:b], win
        idx = window_idxs(win, b, s, start_pos)

        if r:
            latent = self.compressor(x, start_pos, record) if self.kv_source else None
            if self.index_source:
                shared.topk_idxs = self.indexer(x, qr, start_pos, latent, offset, record)
            if latent is not None:  # RoPE at the group positions, fp4 (e4m3, 16), cache write
                row = start_pos // r
                latent = rope(latent, self.freqs_cis[row * r:(row + latent.size(1)) * r:r])
                record("latent_rope_prequant", latent)
                latent = fp4_quant(latent, 16, e4m3_scale=True)
                record("latent_rope_quant", latent)
                self.compress_kv[:b, row:row + latent.size(1)] = latent
                record("compress_kv_rows", latent)
                record("compress_kv_row_start", torch.tensor(row))
            if self.kv_source:
                shared.compress_kv = self.compress_kv
            attn_kv = torch.cat([attn_kv, shared.compress_kv[:b, :end_pos // r]], dim=1)
            idx = torch.cat([idx, shared.topk_idxs], dim=-1)
        record("attn_kv", attn_kv)
        record("attn_topk_idxs", idx.to(torch.int32))
        o = sparse_attn(q, attn_kv, self.w["attn_sink"], idx, hd**-0.5)
        record("attn_o", o)
        o = rope(o, freqs, inverse=True).view(b, s, a["o_groups"], -1)
        wo_a = self.w["wo_a.weight"].view(a["o_groups"], a["o_lora_rank"], -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.linear(o.flatten(2), "wo_b")

    def compressor(self, x: torch.Tensor, start_pos: int, record: Record) -> torch.Tensor | None:
        """The pre-RoPE latents this call completes (None if none)."""
        r = self.ratio
        b, s, _ = x.shape
        if r == 1:
            latent = self.norm(self.linear(x, "compressor.wkv"), "compressor.norm")
            record("latent", latent)
            return latent
        kv, score = self.linear(x.float(), "compressor.wkv"), self.linear(x.float(),
                                                                          "compressor.wgate")
        if start_pos == 0:  # whole groups pool now, the remainder waits in the state
            whole = s - s % r
            self.kv_state[:b, :s % r] = kv[:, whole:]
            self.score_state[:b, :s % r] = score[:, whole:]
            record("compressor_kv_state_after", self.kv_state[:b])
            record("compressor_score_state_after", self.score_state[:b])
            if whole == 0:
                return None
            kv, score = kv[:, :whole].unflatten(1, (-1, r)), score[:, :whole].unflatten(1, (-1, r))
        else:  # one token into slot start_pos % r; pool when the group completes
            self.kv_state[:b, start_pos % r] = kv[:, 0]
            self.score_state[:b, start_pos % r] = score[:, 0]
            if (start_pos + 1) % r:
                return None
            kv, score = self.kv_state[:b].unsqueeze(1), self.score_state[:b].unsqueeze(1)
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        latent = self.norm(pooled.to(BF16), "compressor.norm")
        record("latent", latent)
        return latent

    def indexer(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int,
                latent: torch.Tensor | None, offset: int, record: Record) -> torch.Tensor:
        """The compressed part of the selection [b, s, k_sel], offset, -1 unreachable."""
        a, r, shared = self.args, self.ratio, self.shared
        b, s, _ = x.shape
        end_pos = start_pos + s
        if self.owns_k and latent is not None:  # publish keys for the new groups
            row = start_pos // r
            k = self.norm(self.linear(latent, "indexer.wk"), "indexer.k_norm")
            k = rope(k, self.freqs_cis[row * r:(row + k.size(1)) * r:r])
            record("index_k_rope_prequant", k)
            k = fp4_quant(k, 32)
            record("index_k_rope_quant", k)
            self.index_k[:b, row:row + k.size(1)] = k
            record("index_k_rows", k)
            shared.index_k = self.index_k
        n = end_pos // r
        if n == 0:  # no compressed position yet: an empty selection
            record("index_topk_idxs", torch.zeros(b, s, 0, dtype=torch.int32))
            return torch.zeros(b, s, 0, dtype=torch.long)
        keys = (self.index_k if self.own_k and self.owns_k else shared.index_k)[:b, :n]
        hi, di = a["index_n_heads"], a["index_head_dim"]
        q = rope(self.linear(qr, "indexer.wq_b").unflatten(-1, (hi, di)),
                 self.freqs_cis[start_pos:end_pos])
        record("index_q_rope_prequant", q)
        q = fp4_quant(q, 32)
        record("index_q_rope_quant", q)
        weights = self.linear(x, "indexer.weights_proj") * (di**-0.5 * hi**-0.5)
        score = torch.einsum("bshd,btd->bsht", q, keys)
        score = (score.relu() * weights.unsqueeze(-1)).sum(dim=2)
        if start_pos == 0:
            compress_lens = torch.arange(1, s + 1) // r
            score = score.masked_fill(torch.arange(n) >= compress_lens.unsqueeze(1), NEG_INF)
        else:
            compress_lens = torch.tensor(n)
        if self.candidate_source:
            shared.candidates = select_candidate_blocks(
                score, compress_lens, a["candidate_topk_blocks"], a["candidate_block_size"],
                record)
            record("candidates", shared.candidates)
        if self.uses_candidates:
            score = score.masked_fill(~shared.candidates, NEG_INF)
        record("index_score", score)
        top = score.topk(min(a["index_topk"], n), dim=-1, sorted=False)  # torch CPU ties
        record("index_topk_values", top.values)
        record("index_topk_indices_raw", top.indices)
        reachable = torch.arange(n) < compress_lens.view(-1, 1)
        tied, left_out, _ = tie_left_out(score, top.values)
        record("index_topk_ambiguous", left_out & (tied & reachable).any(-1))
        idx = top.indices.sort(dim=-1).values
        idx = torch.where(idx < compress_lens.view(-1, 1), idx + offset, -1)
        record("index_topk_idxs", idx.to(torch.int32))
        return idx


class Stack:
    """Layers in stack order sharing one SharedAttentionRuntime; state persists across calls."""

    def __init__(self, args: dict[str, Any], weights: dict[int, dict[str, torch.Tensor]],
                 owner_reads_own_index_k: bool = False):
        self.args = args
        self.shared = SharedAttentionRuntime()
        self.layers = [Attention(args, layer, weights[layer], self.shared,
                                 owner_reads_own_index_k) for layer in range(args["n_layers"])]

    @torch.no_grad()
    def step(self, xs: dict[int, torch.Tensor], start_pos: int
             ) -> tuple[dict[int, torch.Tensor], dict[str, np.ndarray]]:
        """One call: each layer gets its own x. Returns outputs and `L{l}.{name}` arrays."""
        outs, arrays = {}, {}
        for layer in self.layers:
            def record(name: str, value: torch.Tensor, prefix: str = f"L{layer.layer}.") -> None:
                value = value.detach()
                arrays[prefix + name] = (value.float() if value.is_floating_point()
                                         else value).numpy().copy()
            outs[layer.layer] = layer.forward(xs[layer.layer].to(BF16), start_pos, record)
            arrays[f"L{layer.layer}.out"] = outs[layer.layer].float().numpy()
        return outs, arrays

    def final_state(self, b: int, end_pos: int) -> dict[str, np.ndarray]:
        """The caches after the last call: the ring, and the compressed rows written so far."""
        arrays = {}
        for layer in self.layers:
            arrays[f"L{layer.layer}.window_kv_cache_after"] = layer.window_kv[:b].float().numpy()
            if layer.ratio and layer.kv_source:
                arrays[f"L{layer.layer}.compress_kv_cache_after"] = (
                    layer.compress_kv[:b, :end_pos // layer.ratio].float().numpy())
        return arrays


# ---------------------------------------------------------------- check against goldens
CHECK_CASES = ("case1_r2_r1", "case1_r2_r1_ownk", "case2_candidates", "case3_r4_r128",
               "case3_r4_r128_ownk")
EXACT = ("index_topk_idxs", "attn_topk_idxs", "candidates", "index_topk_indices_raw",
         "compress_kv_row_start", "index_topk_ambiguous", "cand_block_topk_indices",
         "cand_block_topk_ambiguous")


def weights_from_arrays(arrays: dict[str, np.ndarray], n_layers: int
                        ) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in range(n_layers):
        prefix = f"weights.L{layer}."
        out[layer] = {k[len(prefix):]: torch.from_numpy(np.asarray(v, np.float32))
                      for k, v in arrays.items() if k.startswith(prefix)}
    return out


def run_case(meta: dict[str, Any], arrays: dict[str, np.ndarray],
             owner_reads_own_index_k: bool | None = None) -> dict[str, np.ndarray]:
    """Run a case's schedule on the oracle (golden x per step and layer): `{step}.L{l}.name`."""
    args = meta["model_args"]
    if owner_reads_own_index_k is None:
        owner_reads_own_index_k = "owner_reads_own_index_k" in str(meta.get("behaviour_patch"))
    stack = Stack(args, weights_from_arrays(arrays, args["n_layers"]), owner_reads_own_index_k)
    result: dict[str, np.ndarray] = {}
    for entry in meta["schedule"]:
        step = entry["step"]
        xs = {layer: torch.from_numpy(arrays[f"{step}.L{layer}.x"])
              for layer in range(args["n_layers"])}
        _, step_arrays = stack.step(xs, entry["start_pos"])
        result.update({f"{step}.{k}": v for k, v in step_arrays.items()})
    result.update(rope_tables(args))
    last = meta["schedule"][-1]
    final = stack.final_state(meta["batch"], last["start_pos"] + last["seqlen"])
    result.update({f"{last['step']}.{k}": v for k, v in final.items()})
    return result


def identical(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: the same value, bit for bit for floats (f32 patterns, -0 != 0)."""
    a, b = np.asarray(a), np.asarray(b)
    if b.dtype.kind == "f":
        return a.astype(np.float32).view(np.uint32) == b.astype(np.float32).view(np.uint32)
    return a == b


def check_case(folder: Path, name: str, verbose: bool = True, rule: str = "same_cpu"
               ) -> tuple[bool, dict[str, list[int]]]:
    """Oracle vs golden, every step/layer array both hold (the golden `x` fed to each layer).
    Selections and flags (EXACT) must be equal, floats within the goldens' tolerance
    (rtol 1.6e-2, atol 1e-3 max|golden|), or under the cross-CPU rule (export/cross_cpu.py)
    with `rule="cross_cpu"`. Returns (ok, per array name: [arrays, elements, bit-identical
    elements])."""
    from csa2onnx.export.goldens import load_case

    case = load_case(folder / f"{name}.json")
    for key, dtype in case.meta["parameter_dtypes"].items():
        layer, param = key.split(".", 1)
        ratio = case.model_args["compress_ratios"][int(layer[1:])]
        fp8 = case.model_args.get("dtype") == "fp8"
        assert str(parameter_dtype(param, ratio, fp8)) == f"torch.{dtype}", (key, dtype)
    return compare_arrays(run_case(case.meta, case.arrays), case.arrays, name, verbose, rule)


def compare_arrays(ours: dict[str, np.ndarray], golden: dict[str, np.ndarray], name: str,
                   verbose: bool = True, rule: str = "same_cpu"
                   ) -> tuple[bool, dict[str, list[int]]]:
    """check_case's comparison of `{step}.L{l}.array` dicts (the rule's count included)."""
    from csa2onnx.export.cross_cpu import MovedCounts, step_group
    from csa2onnx.export.goldens import compare

    ok, stats, moved = True, {}, MovedCounts()
    for key, want in golden.items():
        step, array = key.split(".", 1)[0], key.split(".", 2)[-1]
        if key not in ours or array == "x":
            continue
        result = compare(ours[key], want, exact=array in EXACT, name=array, rule=rule)
        group = "state" if array.endswith("_after") else step_group(step)
        moved.add(array, group, result.moved, result.size)
        counts = stats.setdefault(array, [0, 0, 0])
        counts[0] += 1
        counts[1] += want.size
        counts[2] += int(identical(ours[key], want).sum())
        if not result.ok:
            ok = False
            if verbose:
                print(f"  MISMATCH {name} {key}: {result.detail} "
                      f"(max err {result.max_abs_err:.3g})")
    if rule == "cross_cpu":
        for violation in moved.violations():
            ok = False
            if verbose:
                print(f"  MISMATCH {name} count rule: {violation}")
    return ok, stats


def machine_info() -> dict[str, Any]:
    """The `machine` entry of a case made here (FORMAT.md, "Which CPU made a case"), with
    `summation_class` from torch_sums_like_goldens(): what the comparison rule keys on, since
    a forced instruction set (ONEDNN_MAX_CPU_ISA) changes torch's sums but not cpuinfo."""
    flags, model = set(), ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": model, "isa": [f for f in wanted if f in flags],
            "torch_threads": torch.get_num_threads(),
            "summation_class": "reference" if torch_sums_like_goldens() else "other"}


def torch_sums_like_goldens() -> bool:
    """Whether this process's torch sums like the CPU that made the shared goldens: its bf16
    F.linear (oneDNN) and f32 F.linear (MKL) at the goldens' shapes against csa2onnx's
    TorchLinear, which reproduces that CPU's orders on every CPU. False on AMX CPUs, on
    AVX2-only ones, and under ONEDNN_MAX_CPU_ISA=AVX2."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from csa2onnx.custom_ops import make_session

    def session(w_type: int) -> ort.InferenceSession:
        graph = helper.make_graph(
            [helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx")], "probe",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, None),
             helper.make_tensor_value_info("W", w_type, None)],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
        return make_session(helper.make_model(graph, opset_imports=[
            helper.make_opsetid("", 21), helper.make_opsetid("csa2onnx", 1)],
                                              ir_version=IR_VERSION).SerializeToString())

    sessions = {BF16: session(TensorProto.BFLOAT16), F32: session(TensorProto.FLOAT)}
    generator = torch.Generator().manual_seed(0)
    for m, k, n in ((77, 256, 128), (77, 128, 512), (637, 256, 128), (1, 256, 512),
                    (77, 512, 256)):
        for dtype in (BF16, F32):
            x = torch.randn(m, k, generator=generator).to(dtype)
            w = torch.randn(n, k, generator=generator).to(dtype)
            want = F.linear(x, w).float().numpy()
            w_bits = (w.view(torch.int16).numpy().view(np.uint16) if dtype == BF16
                      else w.numpy())
            feeds = {"X": ort.OrtValue.ortvalue_from_numpy(x.float().numpy()),
                     "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                         w_bits, TensorProto.BFLOAT16 if dtype == BF16 else TensorProto.FLOAT)}
            got = sessions[dtype].run_with_ort_values(["Y"], feeds)[0].numpy()
            if dtype == BF16:  # the graphs round the op's f32 output where torch does
                got = torch.from_numpy(got).to(BF16).float().numpy()
            if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shared goldens")
    parser.add_argument("--goldens", type=Path,
                        default=Path(__file__).resolve().parents[1] / "goldens")
    parser.add_argument("cases", nargs="*", default=list(CHECK_CASES))
    opts = parser.parse_args(argv)
    if not opts.check:
        parser.print_help()
        return 0
    all_ok = True
    for name in opts.cases:
        ok, stats = check_case(opts.goldens, name)
        all_ok &= ok
        arrays, elements, same = (sum(c[i] for c in stats.values()) for i in range(3))
        print(f"{name}: {'OK' if ok else 'MISMATCH'}: {arrays} arrays, {same} of "
              f"{elements} elements bit-identical ({same / elements:.6%})")
        for array, (n, size, equal) in sorted(stats.items()):
            if equal != size:
                print(f"  {array:<30}{n:>5} arrays  {size - equal} of {size} elements differ")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
