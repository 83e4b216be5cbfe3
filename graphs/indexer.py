"""The Indexer (reference.md "Indexer"): picks which compressed positions each query reads.

Two entry points, both through the module's __call__ (so parameter names get its scope):
- `keys(op, latent, positions)`: an index-key owner's new keys from its compressor's
  pre-RoPE latents (the caller writes them to its key cache and publishes the slot).
- `select(op, x, qr, index_k, ...)`: scores the queries against the first end_pos // r rows
  of `index_k` (whatever key cache the shared slot holds, possibly another layer's, read
  packed in place) and returns the top-k selection, offset past the window rows. The scores
  and their top-k are one IndexerTopK op (no [b, s, T] scores: a GiB for a 256-token chunk at
  1M keys); keep_score adds the scores themselves, for inspection, from IndexerScore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.constants import INDEXER_SCORE_MAX_DIM
from csa2onnx.custom_ops.ops import (
    candidates_per_key,
    indexer_score,
    indexer_topk,
    mask_scores,
    pack_quantized,
    torch_topk,
    unpack_quantized,
)
from csa2onnx.graphs.candidates import candidates_of_blocks, select_candidate_blocks
from csa2onnx.graphs.common import Mode, scalar_i64
from csa2onnx.graphs.kv_cache import INDEX_KEY_FORMAT
from csa2onnx.graphs.numerics import (
    Linear,
    RMSNorm,
    TorchWeight,
    Weight,
    linear,
    reduce_axis,
    round_bf16,
)
from csa2onnx.graphs.quant import fp4_e8m0
from csa2onnx.graphs.rope import FreqsCis, RopeParams, apply_rotary_emb, token_positions


class KeyCacheChoice(Protocol):
    """A key cache chosen at run time among several (the shared index_k slot,
    export/slots.py): `apply(op, fn, outputs)` is fn(op, cache) for whichever cache it is,
    each candidate read in place, so that no cache is copied to be chosen; `outputs` names
    fn's results and their types (each [b, s, ?])."""

    def apply(self, op: OpBuilder, fn: Callable[[OpBuilder, ir.Value], Sequence[ir.Value]],
              outputs: Sequence[tuple[str, ir.DataType]]) -> tuple[ir.Value, ...]: ...


@dataclass(frozen=True)
class CandidateConfig:
    """The candidate source's select_candidate_blocks sizes (candidate_topk_blocks,
    candidate_block_size in ModelArgs)."""

    topk_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.topk_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"candidate topk_blocks and block_size must be > 0, got {self}")


class IndexKeyRows(NamedTuple):
    """An owner's new index keys [b, n, D] after RoPE, and their fp4 (e8m0 scales) packed
    (uint8 [b, n, row bytes]): the rows written to its key cache."""

    rope_prequant: ir.Value
    rows: ir.Value


class IndexerOutput(NamedTuple):
    """topk_idxs int64 [b, s, min(index_topk, end_pos // r)]: ascending compressed
    positions + offset, -1 where unreachable; score f32 [b, s, end_pos // r] as handed to
    top-k (None where IndexerTopK ranked it and select() did not keep it); candidates bool
    [b, s, ceil(end_pos // r / candidate_block_size)] (candidate source only, else None): the
    blocks it keeps, as later indexers read them; the rest are intermediates for
    inspection: the reference's candidates, a value a position [b, s, end_pos // r] (the
    candidate source with keep_score, else None), the queries before / after fp4
    [b, s, H, D] and top-k's raw indices in its returned order."""

    topk_idxs: ir.Value
    score: ir.Value | None
    candidates: ir.Value | None
    candidate_positions: ir.Value | None
    q_rope_prequant: ir.Value
    q_rope: ir.Value
    raw_indices: ir.Value


class IndexKeyProjection(nn.Module):
    """An index-key owner's keys: k = RoPE(k_norm(wk(latent))) at the group positions, and
    their fp4 (e8m0, block 32) packed, the rows written to the index-key cache."""

    def __init__(self, wk: TorchWeight, k_norm: np.ndarray, norm_eps: float,
                 rope: RopeParams) -> None:
        super().__init__()
        self.wk = Linear(wk)
        self.k_norm = RMSNorm(k_norm, norm_eps)
        self.rope_head_dim = rope.rope_head_dim
        self.freqs_cis = FreqsCis(rope)

    def forward(self, op: OpBuilder, latent: ir.Value, positions: ir.Value) -> IndexKeyRows:
        cos, sin = self.freqs_cis(op, positions)
        k = apply_rotary_emb(op, self.k_norm(op, self.wk(op, latent)), cos, sin,
                             self.rope_head_dim)
        return IndexKeyRows(k, pack_quantized(op, k, INDEX_KEY_FORMAT))


class Indexer(nn.Module):
    """Indexer(wq_b, weights_proj, wk, k_norm, ...), names as upstream.

    wk/k_norm are given only for an index-key owner (an index source that is also a kv
    source). `candidates` makes this the candidate source; `uses_candidates` makes it a
    later index source that selects inside the published candidates, which hold a value per
    block of `candidate_block_size` positions (the source's block size for the blocks it
    publishes; 1: a mask of positions, as the goldens record it). In a portable graph
    top-k is ONNX TopK (lowest-index ties): a control, NOT the reference.
    Build a fresh module per exported model: parameters bind to one graph.
    """

    def __init__(self, wq_b: Weight, weights_proj: TorchWeight,
                 wk: TorchWeight | None = None, k_norm: np.ndarray | None = None, *,
                 index_n_heads: int, index_head_dim: int, index_topk: int, ratio: int,
                 rope: RopeParams, norm_eps: float, window_size: int,
                 candidates: CandidateConfig | None = None, uses_candidates: bool = False,
                 candidate_block_size: int = 1) -> None:
        super().__init__()
        heads, dim = index_n_heads, index_head_dim
        if heads <= 0 or dim <= 0:
            raise ValueError(f"index_n_heads and index_head_dim must be > 0, got {heads}, {dim}")
        if index_topk <= 0:
            raise ValueError(f"index_topk must be > 0, got {index_topk}")
        if ratio < 1:
            raise ValueError(f"an Indexer needs compress ratio >= 1, got {ratio}")
        if window_size <= 0:
            raise ValueError(f"window_size must be > 0, got {window_size}")
        if rope.rope_head_dim > dim:
            raise ValueError(f"rope_head_dim {rope.rope_head_dim} > index_head_dim {dim}")
        if np.ndim(wq_b) != 2 or np.shape(wq_b)[0] != heads * dim:
            raise ValueError(f"indexer wq_b must be [index_n_heads*index_head_dim={heads * dim},"
                             f" q_lora_rank], got {np.shape(wq_b)}")
        if np.ndim(weights_proj) != 2 or np.shape(weights_proj)[0] != heads:
            raise ValueError(f"indexer weights_proj must be [index_n_heads={heads}, dim], got "
                             f"{np.shape(weights_proj)}")
        if (wk is None) != (k_norm is None):
            raise ValueError("an index-key owner needs both wk and k_norm (or neither)")
        if wk is not None and (np.ndim(wk) != 2 or np.shape(wk)[0] != dim):
            raise ValueError(f"indexer wk must be [index_head_dim={dim}, head_dim], got "
                             f"{np.shape(wk)}")
        if candidates is not None and uses_candidates:
            raise ValueError("the candidate source cannot also select inside candidates")
        if candidate_block_size < 1:
            raise ValueError(f"candidate_block_size must be >= 1, got {candidate_block_size}")
        self.n_heads, self.head_dim, self.index_topk = heads, dim, index_topk
        self.ratio, self.window_size, self.rope_head_dim = ratio, window_size, rope.rope_head_dim
        self.candidate_config, self.uses_candidates = candidates, uses_candidates
        self.candidate_block = candidate_block_size
        # D^-0.5 (softmax_scale) * H^-0.5, applied to the bf16 head weights.
        self.weights_scale = float(np.float32(dim ** -0.5 * heads ** -0.5))

        self.wq_b = linear(wq_b)
        self.weights_proj = Linear(weights_proj)
        if wk is not None:
            self.key_projection = IndexKeyProjection(wk, k_norm, norm_eps, rope)
        self.owns_keys = wk is not None
        self.freqs_cis = FreqsCis(rope)  # compress_rope_theta (+ YaRN) of this layer

    def keys(self, op: OpBuilder, latent: ir.Value, positions: ir.Value) -> IndexKeyRows:
        """latent [b, n, head_dim] (pre-RoPE, n may be 0), positions int64 [n]."""
        if not self.owns_keys:
            raise ValueError("keys() needs an index-key owner (built with wk and k_norm)")
        return self.key_projection(op, latent, positions)

    def select(self, op: OpBuilder, x: ir.Value, qr: ir.Value,
               index_k: ir.Value | KeyCacheChoice, *,
               start_pos: ir.Value | None = None, candidates: ir.Value | None = None,
               window_rows: ir.Value | None = None, mode: Mode = "prefill",
               keep_score: bool = True) -> IndexerOutput:
        """x [b, s, dim], qr [b, s, q_lora_rank]; index_k the key cache in the shared slot,
        float [b, R, D] or packed (uint8 [b, R, row_bytes], INDEX_KEY_FORMAT, read in place)
        (R >= end_pos // r), or a KeyCacheChoice among such caches; start_pos int64 scalar
        or [1] (decode; in prefill only when continuing a sequence, else 0); candidates
        bool [b, s, ceil(end_pos // r / candidate_block_size)] when uses_candidates (the
        candidate source's IndexerOutput.candidates); window_rows int64 [1]: how many
        window rows precede the compressed ones in this call's KV list (the selection's
        offset; default s in prefill, the window size in decode). keep_score: return the
        [b, s, T] scores and candidates too (for inspection: IndexerScore beside the
        selection's IndexerTopK, which never holds them whole)."""
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
        if mode == "decode" and start_pos is None:
            raise ValueError("start_pos is required in decode")
        if self.uses_candidates != (candidates is not None):
            raise ValueError("candidates must be given exactly when uses_candidates is set")
        return self(op, x, qr, index_k, start_pos, candidates, window_rows, mode=mode,
                    keep_score=keep_score)

    def _rope(self, op: OpBuilder, x: ir.Value, positions: ir.Value) -> ir.Value:
        cos, sin = self.freqs_cis(op, positions)
        return apply_rotary_emb(op, x, cos, sin, self.rope_head_dim)

    def _score(self, op: OpBuilder, q: ir.Value, w: ir.Value,
               index_k: ir.Value | KeyCacheChoice, width: ir.Value,
               candidates: ir.Value | None, lengths: ir.Value | None) -> ir.Value:
        """score[b,t,p] = bf16(sum_h bf16(relu(bf16(q[b,t,h] . k[p])) * w[b,t,h])) for the
        first `width` rows of index_k (float rows, or the packed cache read in place), -inf
        where `candidates` (if given) is false or p >= lengths[t] (if given): the
        IndexerScore op (bit for bit the standard ops below as onnxruntime runs them, with
        no [b, s, H, T] intermediate, and no dot computed where the score is -inf), or those
        standard ops where D is past the op's limit."""
        if not isinstance(index_k, ir.Value):  # chosen at run time: scored where it lies
            (score,) = index_k.apply(
                op, lambda o, cache: (self._score(o, q, w, cache, width, candidates, lengths),),
                [("score", ir.DataType.FLOAT)])
            return score
        packed = index_k.dtype == ir.DataType.UINT8
        if self.head_dim <= INDEXER_SCORE_MAX_DIM:
            return indexer_score(op, q, w, index_k, width, INDEX_KEY_FORMAT if packed else None,
                                 self.head_dim, candidates, lengths, self.candidate_block)
        k = op.Slice(index_k, [0], width, [1])  # [b, T, D]
        if packed:
            k = unpack_quantized(op, k, INDEX_KEY_FORMAT, self.head_dim)
        dots = round_bf16(op, op.MatMul(q, op.Unsqueeze(op.Transpose(k, perm=[0, 2, 1]), [1])))
        weighted = round_bf16(op, op.Mul(op.Relu(dots), op.Unsqueeze(w, [-1])))  # [b,s,H,T]
        score = round_bf16(op, reduce_axis(op, "Sum", weighted, 2))
        if candidates is not None:
            candidates = candidates_per_key(op, candidates, width, self.candidate_block)
        return mask_scores(op, score, width, candidates, lengths)

    def _top_k(self, op: OpBuilder, q: ir.Value, w: ir.Value,
               index_k: ir.Value | KeyCacheChoice, width: ir.Value,
               candidates: ir.Value | None, lengths: ir.Value | None,
               block_size: int) -> tuple[ir.Value, ir.Value | None]:
        """_score's scores, top-k'd as torch.topk(score, min(index_topk, T), sorted=False)
        (its indices in its order) and with block_size their block maxes [b, s, T/bs], the
        newest reachable block forced to +inf (select_candidate_blocks' ranking): one
        IndexerTopK (the scores never whole), reading the packed cache in place."""
        if not isinstance(index_k, ir.Value):  # chosen at run time: ranked where it lies
            outputs = [("raw_indices", ir.DataType.INT64)]
            if block_size:
                outputs.append(("block_scores", ir.DataType.FLOAT))
            results = index_k.apply(
                op, lambda o, cache: [v for v in self._top_k(
                    o, q, w, cache, width, candidates, lengths, block_size) if v is not None],
                outputs)
            return results[0], results[1] if block_size else None
        packed = index_k.dtype == ir.DataType.UINT8
        return indexer_topk(op, q, w, index_k, width, self.index_topk,
                            INDEX_KEY_FORMAT if packed else None, self.head_dim, candidates,
                            lengths, block_size, force_newest_block=block_size > 0,
                            candidate_block_size=self.candidate_block)

    def forward(self, op: OpBuilder, x: ir.Value, qr: ir.Value,
                index_k: ir.Value | KeyCacheChoice,
                start_pos: ir.Value | None, candidates: ir.Value | None,
                window_rows: ir.Value | None, *, mode: Mode,
                keep_score: bool = True) -> IndexerOutput:
        """select(): called through __call__, so the parameters are realised in scope."""
        s = op.Slice(op.Shape(qr), [1], [2])
        start = op.Constant(value_ints=[0]) if start_pos is None else scalar_i64(op, start_pos)
        end = op.Add(start, s)
        # built as the attention's queries build theirs, so that a decode step computes the
        # positions and RoPE rows once for both (the exporter merges identical nodes)
        positions = token_positions(op, x, start if start_pos is None else start_pos)

        # Queries [b, s, H, D], RoPE at start_pos.., fp4 with e8m0 scales.
        q = op.Reshape(self.wq_b(op, qr), [0, 0, self.n_heads, self.head_dim])
        q_prequant = self._rope(op, q, positions)
        q = fp4_e8m0(op, q_prequant, width=self.head_dim)
        w = round_bf16(op, op.Mul(self.weights_proj(op, x), self.weights_scale))  # [b, s, H]

        width = op.Div(end, self.ratio)
        # Reachable compressed positions per query: prefill (pos+1)//r (those past it score
        # -inf), decode end_pos//r (all).
        if mode == "prefill":
            lens = op.Div(op.Add(positions, 1), self.ratio)  # [s]
            offset: ir.Value | int = s if window_rows is None else window_rows
        else:
            lens = width  # [1]
            offset = self.window_size if window_rows is None else window_rows
        # Level two (a later index source): non-candidates score -inf too (none of these
        # is computed) but stay selectable (reference quirk 2).
        reach = lens if mode == "prefill" else None
        k_sel = op.Min(width, op.Constant(value_ints=[self.index_topk]))
        # The candidate source's blocks come from the reachability-masked score (the goldens'
        # block scores say so).
        cc = self.candidate_config
        published = score = positions = None
        if self.head_dim > INDEXER_SCORE_MAX_DIM:  # standard ops: every score, then top-k
            score = self._score(op, q, w, index_k, width, candidates, reach)  # [b, s, T]
            if cc is not None:
                published = select_candidate_blocks(op, score, lens, cc.topk_blocks,
                                                    cc.block_size).kept
            _, raw = torch_topk(op, score, k_sel, largest=True, sorted=False)
        else:
            raw, block_scores = self._top_k(op, q, w, index_k, width, candidates, reach,
                                            cc.block_size if cc is not None else 0)
            if cc is not None:
                published = candidates_of_blocks(op, block_scores, lens, cc.topk_blocks,
                                                 cc.block_size, forced=True).kept
            if keep_score:  # for inspection only: the selection above does not read it
                score = self._score(op, q, w, index_k, width, candidates, reach)
        ascending, _ = op.TopK(raw, k_sel, axis=-1, largest=0, sorted=1, _outputs=2)
        reachable = op.Less(ascending, op.Unsqueeze(lens, [-1]))
        topk_idxs = op.Where(reachable, op.Add(ascending, offset), op.Constant(value_int=-1))
        if published is not None and keep_score:
            positions = candidates_per_key(op, published, width, cc.block_size)
        return IndexerOutput(topk_idxs, score, published, positions, q_prequant, q, raw)
