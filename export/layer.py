"""One attention layer, Attention.forward for any ratio, composed from the component graphs.

A layer takes its state (`LayerState`, the StateLayout's roles) and what it reads from the
shared slots (`SlotReads`), and returns what it produces as named tuples: a kv source's
`compress` returns its `Publication` (caches written, keys published), `forward` the
`LayerOutput` (out, new state, published selection and candidates). The stack wires them
(export/stack.py); no function here mutates what it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.ops import pack_quantized, unpack_quantized
from csa2onnx.export.plan import LayerPlan, StackPlan
from csa2onnx.export.weights import LayerWeights
from csa2onnx.graphs.attention_q import QueryProjection, WindowKVProjection
from csa2onnx.graphs.common import Mode
from csa2onnx.graphs.compressor import Compressor
from csa2onnx.graphs.indexer import CandidateConfig, Indexer, KeyCacheChoice
from csa2onnx.graphs.kv_cache import (
    COMPRESSED_KV_FORMAT,
    WINDOW_FORMAT,
    cache_row_start,
    latent_to_cache_rows,
    write_rows,
)
from csa2onnx.graphs.numerics import FLOAT, INT64, weight
from csa2onnx.graphs.output import OutputProjection
from csa2onnx.graphs.rope import FreqsCis, layer_rope_params
from csa2onnx.graphs.sparse_attn import sparse_attn
from csa2onnx.graphs.window import window_chunk, window_decode


class Debug:
    """Records named intermediates when a debug export asks for them (`record`), else
    nothing; `enabled` lets a layer skip building a value only debug outputs would use."""

    def __init__(self, record: Callable[[str, ir.Value], None] | None = None) -> None:
        self.record = record

    @property
    def enabled(self) -> bool:
        return self.record is not None

    def __call__(self, name: str, value: ir.Value) -> None:
        if self.record is not None:
            self.record(name, value)


class LayerState(NamedTuple):
    """A layer's state tensors (StateLayout roles), as graph values; None where the layer
    carries no such tensor or the call does not read it (prefill: no window ring, no
    partial group)."""

    window_kv: ir.Value | None = None
    kv_state: ir.Value | None = None
    score_state: ir.Value | None = None
    compress_kv: ir.Value | None = None
    index_k: ir.Value | None = None


# StateLayout role -> LayerState field
STATE_FIELDS: dict[str, str] = {"window_kv": "window_kv", "compressor.kv_state": "kv_state",
                                "compressor.score_state": "score_state",
                                "compress_kv": "compress_kv", "index_k": "index_k"}


class Publication(NamedTuple):
    """What a kv source publishes in the compress_kv/index_k slots during a call."""

    state: LayerState  # the state after the compressor, the cache writes included
    compress_kv: ir.Value  # its compressed-KV cache, this call's rows written
    index_k: ir.Value | None  # owners: the key cache, this call's keys written
    # owners: bool [1], whether the index_k slot now points at index_k. A decode step
    # publishes when it completes a group (reference.md "Shared slots"); a prefill when
    # the sequence so far holds a group: at start_pos 0 the same thing, and chunks of a
    # prefill then read the slot as the one-shot prefill's queries do.
    published: ir.Value | None


class SlotReads(NamedTuple):
    """What a compressed layer reads from the slots: the (packed) cache of the layer it
    takes KV from, the packed key cache in the index_k slot (index sources: the indexer
    reads its first end_pos // r rows in place), the selection of the layer it takes top-k
    from (others), the candidates (candidate users)."""

    compress_kv: ir.Value
    index_k: ir.Value | KeyCacheChoice | None = None
    topk_idxs: ir.Value | None = None
    candidates: ir.Value | None = None


class LayerOutput(NamedTuple):
    out: ir.Value
    state: LayerState
    topk_idxs: ir.Value | None  # index sources: the selection they publish
    candidates: ir.Value | None  # the candidate source: the blocks it publishes


class AttentionLayer(nn.Module):
    def __init__(self, stack: StackPlan, plan: LayerPlan, w: LayerWeights) -> None:
        super().__init__(f"layer{plan.layer}")
        c = stack.config
        self.config, self.plan, self.stack = c, plan, stack
        rope = layer_rope_params(c.to_dict(), plan.ratio)
        self.attn_q = QueryProjection(w["wq_a.weight"], w["q_norm.weight"], w["wq_b.weight"],
                                      c.n_heads, c.head_dim, c.rope_head_dim, c.norm_eps, rope)
        self.window_kv = WindowKVProjection(w["wkv.weight"], w["kv_norm.weight"], c.head_dim,
                                            c.rope_head_dim, c.norm_eps, rope)
        self.attn_sink = weight(w["attn_sink"], FLOAT)
        self.output = OutputProjection(w["wo_a.weight"], w["wo_b.weight"], c.n_heads,
                                       c.head_dim, c.o_groups, c.o_lora_rank, c.rope_head_dim,
                                       rope)
        if plan.kv_source:
            self.compressor = Compressor(w["compressor.wkv.weight"],
                                         w.get("compressor.wgate.weight"),
                                         w["compressor.norm.weight"], ratio=plan.ratio,
                                         head_dim=c.head_dim, norm_eps=c.norm_eps)
            self.latent_rope = FreqsCis(rope)
        if plan.index_source:
            candidates = (CandidateConfig(c.candidate_topk_blocks, c.candidate_block_size)
                          if plan.candidate_source else None)
            self.indexer = Indexer(w["indexer.wq_b.weight"], w["indexer.weights_proj.weight"],
                                   w.get("indexer.wk.weight"), w.get("indexer.k_norm.weight"),
                                   index_n_heads=c.index_n_heads,
                                   index_head_dim=c.index_head_dim, index_topk=c.index_topk,
                                   ratio=plan.ratio, rope=rope, norm_eps=c.norm_eps,
                                   window_size=c.window_size, candidates=candidates,
                                   uses_candidates=plan.uses_candidates,
                                   candidate_block_size=(c.candidate_block_size
                                                         if plan.uses_candidates else 1))


    def compress(self, op: OpBuilder, x: ir.Value, pos: ir.Value, state: LayerState,
                 mode: Mode, debug: Debug, after: Sequence[ir.Value] = ()) -> Publication:
        """A kv source's compressor, then (owners) its index keys, then RoPE + fp4 rows into
        its KV cache. `after`: values read from the old key cache, computed before the
        in-place key write."""
        op.builder.push_module(self.name or "", type(self).__qualname__)  # as __call__ does
        try:
            return self._compress(op, x, pos, state, mode, debug, after)
        finally:
            op.builder.pop_module()

    def _compress(self, op: OpBuilder, x: ir.Value, pos: ir.Value, state: LayerState,
                  mode: Mode, debug: Debug, after: Sequence[ir.Value]) -> Publication:
        c, p = self.config, self.plan
        if p.ratio > 1:  # a prefill may continue a sequence: the open group is in the state
            out = self.compressor(op, x, state.kv_state, state.score_state, pos, mode=mode)
        else:
            out = self.compressor(op, x, start_pos=pos, mode=mode)
        debug("latent", out.latent)
        row_start = cache_row_start(op, pos, p.ratio)
        index_k = published = None
        if p.owns_index_k:
            keys = self.indexer.keys(op, out.latent, out.positions)
            index_k = write_rows(op, state.index_k, keys.rows, row_start, after=after)
            if mode == "decode":
                published = op.Greater(op.Slice(op.Shape(out.latent), [1], [2]), 0)
            else:
                end_pos = op.Add(pos, op.Slice(op.Shape(x), [1], [2]))
                published = op.GreaterOrEqual(end_pos, p.ratio)
        cos, sin = self.latent_rope(op, out.positions)
        _, rows = latent_to_cache_rows(op, out.latent, cos, sin, c.rope_head_dim)
        compress_kv = write_rows(op, state.compress_kv, rows, row_start)
        state = state._replace(kv_state=out.kv_state, score_state=out.score_state,
                               compress_kv=compress_kv, index_k=index_k)
        return Publication(state, compress_kv, index_k, published)

    def forward(self, op: OpBuilder, x: ir.Value, pos: ir.Value, state: LayerState,
                slots: SlotReads | None, mode: Mode, debug: Debug) -> LayerOutput:
        """Attention.forward after the compressor (a kv source runs `compress` first and
        passes the state it returns): window, indexer, sparse attention, output."""
        c, p = self.config, self.plan
        qr, q = self.attn_q(op, x, pos)
        # The ring holds the window packed (act_quant's fp8 codes and scales): the new rows
        # are packed, and attention reads them unpacked (act_quant's values exactly).
        packed = pack_quantized(op, self.window_kv(op, x, pos), WINDOW_FORMAT)
        debug("qr", qr)
        debug("q_rope", q)
        if debug.enabled:
            debug("window_kv", unpack_quantized(op, packed, WINDOW_FORMAT, c.head_dim))
        if mode == "prefill":  # at start_pos 0 (rows = kv) or continuing a sequence
            window_idx, rows, ring = window_chunk(op, packed, state.window_kv, pos,
                                                  c.window_size)
        else:
            window_idx, ring = window_decode(op, packed, state.window_kv, pos, c.window_size)
            rows = ring
        window_rows = unpack_quantized(op, rows, WINDOW_FORMAT, c.head_dim)
        state = state._replace(window_kv=ring)

        idx, compressed, topk, candidates = window_idx, None, None, None
        if p.compressed:
            if slots is None:
                raise ValueError(f"L{p.layer}: a compressed layer reads the slots")
            topk = slots.topk_idxs
            if p.index_source:
                selection = self.indexer.select(
                    op, x, qr, slots.index_k, candidates=slots.candidates, mode=mode,
                    start_pos=pos, window_rows=op.Slice(op.Shape(window_rows), [1], [2]),
                    keep_score=debug.enabled)  # else no [b, s, T] scores (IndexerTopK)
                if selection.score is not None:
                    debug("index_score", selection.score)
                debug("index_topk_idxs", selection.topk_idxs)
                topk, candidates = selection.topk_idxs, selection.candidates
                if selection.candidate_positions is not None:
                    debug("candidates", selection.candidate_positions)
            # The compressed cache is read packed, in place: indices past the window rows
            # are its rows (all < end_pos // r by the selection).
            compressed = slots.compress_kv
            idx = op.Concat(window_idx, op.Cast(topk, to=INT64), axis=-1)
        debug("attn_topk_idxs", idx)
        o = sparse_attn(op, q, window_rows, self.attn_sink, idx, c.head_dim ** -0.5,
                        compressed, COMPRESSED_KV_FORMAT if compressed is not None else None,
                        head_dim=c.head_dim)
        debug("attn_o", o)
        out = self.output(op, o, pos)
        return LayerOutput(out, state, topk if p.index_source else None, candidates)
