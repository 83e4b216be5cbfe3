"""One attention layer, Attention.forward for any ratio, composed from the component graphs.

The shared slots are explicit: the layer reads what earlier layers published (`Slots`) and
records what it publishes there. State tensors come in and go out by name (plan.state()).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.export.plan import LayerPlan, StackPlan
from csa2onnx.export.weights import LayerWeights
from csa2onnx.graphs.attention_q import QueryProjection, WindowKVProjection
from csa2onnx.graphs.common import Mode
from csa2onnx.graphs.compressor import Compressor
from csa2onnx.graphs.indexer import CandidateConfig, Indexer
from csa2onnx.graphs.kv_cache import cache_row_start, latent_to_cache_rows, write_rows
from csa2onnx.graphs.numerics import FLOAT, INT64, weight
from csa2onnx.graphs.output import OutputProjection
from csa2onnx.graphs.rope import FreqsCis, layer_rope_params
from csa2onnx.graphs.sparse_attn import sparse_attn
from csa2onnx.graphs.window import window_decode, window_prefill


@dataclass
class Slots:
    """The SharedAttentionRuntime slots while one call is traced, as graph values.

    compress_kv/index_k map a source layer to its cache as of now (a later layer's cache
    is its state from the previous call, as the reference's mutable tensors would be);
    topk_idxs/candidates hold the latest writer's value; publisher is the int64 [1] layer
    id the index_k slot points to; external holds slot inputs from outside the range.

    Caches are written in place, so a value read from an owner's cache before the owner
    writes it this call (`old_reads`) must be computed before that write: the write
    takes it as an ordering edge."""

    compress_kv: dict[int, ir.Value] = field(default_factory=dict)
    index_k: dict[int, ir.Value] = field(default_factory=dict)
    index_k_written: set[int] = field(default_factory=set)
    old_reads: dict[int, list[ir.Value]] = field(default_factory=dict)
    topk_idxs: dict[int, ir.Value] = field(default_factory=dict)
    candidates: ir.Value | None = None
    publisher: ir.Value | None = None
    external: dict[str, ir.Value] = field(default_factory=dict)


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
                                   uses_candidates=plan.uses_candidates)

    def forward(self, op: OpBuilder, x: ir.Value, start_pos: ir.Value | None,
                state: dict[str, ir.Value], slots: Slots, mode: Mode,
                debug: Callable[[str, ir.Value], None]) -> ir.Value:
        """Attention.forward: returns `out`; updates `state` (by name) and `slots`."""
        c, p = self.config, self.plan
        name = f"L{p.layer}"
        pos = op.Constant(value_ints=[0]) if start_pos is None else start_pos
        qr, q = self.attn_q(op, x, pos)
        _, kv = self.window_kv(op, x, pos)  # (before fp8, after): the window reads the latter
        debug("qr", qr)
        debug("q_rope", q)
        debug("window_kv", kv)
        if mode == "prefill":
            window_idx, ring = window_prefill(op, kv, c.window_size)
            window_rows = kv
        else:
            window_idx, ring = window_decode(op, kv, state[f"{name}.window_kv"], pos,
                                             c.window_size)
            window_rows = ring
        state[f"{name}.window_kv"] = ring

        idx, attn_kv = window_idx, window_rows
        if p.compressed:
            end_pos = op.Add(pos, op.Slice(op.Shape(x), [1], [2]))
            n_rows = op.Div(end_pos, p.ratio)
            if p.kv_source:
                self._compress(op, x, pos, state, slots, mode, debug)
            if p.index_source:
                self._index(op, x, qr, pos, slots, mode, debug)
            topk = slots.topk_idxs.get(p.topk_from) if p.topk_from is not None else None
            topk = slots.external["topk_idxs"] if topk is None else topk
            cache = slots.compress_kv.get(p.kv_from) if p.kv_from is not None else None
            cache = slots.external["compress_kv"] if cache is None else cache
            attn_kv = op.Concat(window_rows, op.Slice(cache, [0], n_rows, [1]), axis=1)
            idx = op.Concat(window_idx, op.Cast(topk, to=INT64), axis=-1)
        debug("attn_topk_idxs", idx)
        o = sparse_attn(op, q, attn_kv, self.attn_sink, idx, c.head_dim ** -0.5)
        debug("attn_o", o)
        return self.output(op, o, pos)

    def _compress(self, op: OpBuilder, x: ir.Value, pos: ir.Value, state: dict[str, ir.Value],
                  slots: Slots, mode: Mode, debug: Callable[[str, ir.Value], None]) -> None:
        """Compressor, then (owners) index keys, then RoPE + fp4 rows into the KV cache."""
        c, p = self.config, self.plan
        name = f"L{p.layer}"
        if p.ratio > 1 and mode == "decode":
            out = self.compressor(op, x, state[f"{name}.compressor.kv_state"],
                                  state[f"{name}.compressor.score_state"], pos, mode="decode")
        elif mode == "decode":
            out = self.compressor(op, x, start_pos=pos, mode="decode")
        else:
            out = self.compressor(op, x, mode="prefill")
        if p.ratio > 1:
            state[f"{name}.compressor.kv_state"] = out.kv_state
            state[f"{name}.compressor.score_state"] = out.score_state
        debug("latent", out.latent)
        row_start = cache_row_start(op, pos, p.ratio)
        n_new = op.Slice(op.Shape(out.latent), [1], [2])
        if p.owns_index_k:
            keys = self.indexer.keys(op, out.latent, out.positions)
            k_cache = write_rows(op, state[f"{name}.index_k"], keys.rows, row_start,
                                 after=slots.old_reads.pop(p.layer, []))
            state[f"{name}.index_k"] = slots.index_k[p.layer] = k_cache
            slots.index_k_written.add(p.layer)
            if slots.publisher is not None:  # the slot now points here iff keys were written
                slots.publisher = op.Where(op.Greater(n_new, 0),
                                           op.Constant(value_ints=[p.layer]), slots.publisher)
        cos, sin = self.latent_rope(op, out.positions)
        _, rows = latent_to_cache_rows(op, out.latent, cos, sin, c.rope_head_dim)
        kv_cache = write_rows(op, state[f"{name}.compress_kv"], rows, row_start)
        state[f"{name}.compress_kv"] = slots.compress_kv[p.layer] = kv_cache

    def _index(self, op: OpBuilder, x: ir.Value, qr: ir.Value, pos: ir.Value, slots: Slots,
               mode: Mode, debug: Callable[[str, ir.Value], None]) -> None:
        p = self.plan
        rows = op.Div(op.Add(pos, op.Slice(op.Shape(x), [1], [2])), p.ratio)  # end_pos // r
        if self.stack.reads_index_k_slot(p):
            index_k = read_index_k_slot(op, slots, rows)
        else:  # index_keys="own": an owner reads its own cache
            index_k = slots.index_k[p.layer]
        candidates = None
        if p.uses_candidates:
            candidates = (slots.candidates if slots.candidates is not None
                          else slots.external["candidates"])
        out = self.indexer.select(op, x, qr, index_k, candidates=candidates, mode=mode,
                                  start_pos=pos if mode == "decode" else None)
        debug("index_score", out.score)
        debug("index_topk_idxs", out.topk_idxs)
        slots.topk_idxs[p.layer] = out.topk_idxs
        if out.candidates is not None:
            debug("candidates", out.candidates)
            slots.candidates = out.candidates


def read_index_k_slot(op: OpBuilder, slots: Slots, rows: ir.Value) -> ir.Value:
    """The first `rows` rows of the key cache the index_k slot points to: an in-range
    owner's current cache when `publisher` names it, else the external slot input (or,
    with none, the last owner). Slicing clamps, as the reference's [:end_pos // r] does."""
    owners = list(slots.index_k.items())
    fallback = slots.external.get("index_k")
    if not owners and fallback is None:
        raise ValueError("an indexer reads the index_k slot but nothing can fill it")
    if owners and slots.publisher is None:
        raise ValueError("index_k publisher state missing for a stack with owners")
    if fallback is None:
        *owners, (_, fallback) = owners
    result = op.Slice(fallback, [0], rows, [1])
    for layer, cache in reversed(owners):
        result = _if(op, op.Equal(slots.publisher, layer),
                     lambda o, c=cache: o.Slice(c, [0], rows, [1]), result)
    # Owners later in the stack have not written yet: this read sees their previous call's
    # cache, so their in-place writes must wait for it.
    for layer in slots.index_k:
        if layer not in slots.index_k_written:
            slots.old_reads.setdefault(layer, []).append(result)
    return result


def _if(op: OpBuilder, condition: ir.Value, then: Callable[[OpBuilder], ir.Value],
        otherwise: ir.Value) -> ir.Value:
    """If(condition) then the `then` subgraph else `otherwise`: the candidate caches differ
    in rows, so Where cannot choose between them; only the chosen rows are copied."""
    builder = op.builder
    then_graph = builder.subgraph(then, inputs=[], outputs=[ir.Value(name="k_rows")],
                                  name="slot_is_this_owner")
    else_graph = builder.subgraph(lambda o: o.Identity(otherwise), inputs=[],
                                  outputs=[ir.Value(name="k_rows")], name="slot_is_another")
    result = op.If(op.Squeeze(condition, [0]), then_branch=then_graph, else_branch=else_graph)
    result.type = ir.TensorType(FLOAT)
    return result
