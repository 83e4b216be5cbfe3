"""The SharedAttentionRuntime slots while the stack traces one call (reference.md "Shared
slots"): what each layer published, and what a reader gets from them.

Within a call `compress_kv`, `topk_idxs` and `candidates` are dataflow edges from the most
recent writer to its readers. `index_k` can carry over from an earlier call: an owner
republishes its key cache only on a call where its compressor completed a group, so the
slot is read through a `publisher` state (which owner published last).

Caches are written in place, so a value read from an owner's key cache before the owner
writes it this call must be computed before that write: the slots keep those reads and
hand them to the owner's write as ordering edges (`reads_before_write`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.export.layer import LayerOutput, Publication, SlotReads
from csa2onnx.export.plan import LayerPlan, StackPlan


@dataclass
class Slots:
    """The slots as graph values, owned by the stack builder that traces the call.

    compress_kv/index_k map a source layer to its cache as of now (a later layer's cache is
    its state from the previous call, as the reference's mutable tensors would be);
    topk_idxs/candidates hold the latest writer's value; publisher is the int64 [1] layer
    id the index_k slot points to; external holds slot inputs from outside the range."""

    plan: StackPlan
    compress_kv: dict[int, ir.Value] = field(default_factory=dict)
    index_k: dict[int, ir.Value] = field(default_factory=dict)
    publisher: ir.Value | None = None
    external: dict[str, ir.Value] = field(default_factory=dict)
    topk_idxs: dict[int, ir.Value] = field(default_factory=dict)
    candidates: ir.Value | None = None
    _written: set[int] = field(default_factory=set)
    _old_reads: dict[int, list[ir.Value]] = field(default_factory=dict)

    def note_key_read(self, read: ir.Value) -> None:
        """A read of the index_k slot: owners later in the stack have not written yet, so it
        sees their previous call's cache, and their in-place writes must wait for it."""
        for layer in self.index_k:
            if layer not in self._written:
                self._old_reads.setdefault(layer, []).append(read)

    def reads_before_write(self, owner: int) -> list[ir.Value]:
        """Reads of `owner`'s key cache made this call before its write (ordering edges)."""
        return self._old_reads.pop(owner, [])

    def publish(self, op: OpBuilder, layer: int, pub: Publication) -> None:
        """A kv source's caches after its writes; an owner points the index_k slot at its
        keys when it publishes (Publication.published)."""
        self.compress_kv[layer] = pub.compress_kv
        if pub.index_k is None:
            return
        self.index_k[layer] = pub.index_k
        self._written.add(layer)
        if self.publisher is not None and pub.published is not None:
            self.publisher = op.Where(pub.published, op.Constant(value_ints=[layer]),
                                      self.publisher)

    def publish_selection(self, layer: int, out: LayerOutput) -> None:
        if out.topk_idxs is not None:
            self.topk_idxs[layer] = out.topk_idxs
        if out.candidates is not None:
            self.candidates = out.candidates

    def reads(self, p: LayerPlan) -> SlotReads | None:
        """What compressed layer `p` reads (None for a window-only layer)."""
        if not p.compressed:
            return None
        cache = self.compress_kv.get(p.kv_from) if p.kv_from is not None else None
        topk = self.topk_idxs.get(p.topk_from) if p.topk_from is not None else None
        index_k = candidates = None
        if p.index_source:
            # The packed key cache, read in place by the indexer's IndexerScore (its first
            # end_pos // r rows); index_keys="own": an owner reads its own cache; the shared
            # slot: whichever cache it points to at run time (KeySlotRead).
            index_k = (self._read_index_k() if self.plan.reads_index_k_slot(p)
                       else self.index_k[p.layer])
            topk = None  # it selects its own
        if p.uses_candidates:
            candidates = self.candidates if self.candidates is not None \
                else self.external["candidates"]
        return SlotReads(
            compress_kv=self.external["compress_kv"] if cache is None else cache,
            index_k=index_k,
            topk_idxs=(self.external["topk_idxs"] if topk is None and not p.index_source
                       else topk),
            candidates=candidates)

    def _read_index_k(self) -> KeySlotRead:
        """The key cache the index_k slot points to: an in-range owner's current cache when
        `publisher` names it, else the external slot input (or, with none, the last owner)."""
        owners = list(self.index_k.items())
        fallback = self.external.get("index_k")
        if not owners and fallback is None:
            raise ValueError("an indexer reads the index_k slot but nothing can fill it")
        if owners and self.publisher is None:
            raise ValueError("index_k publisher state missing for a stack with owners")
        if fallback is None:
            *owners, (_, fallback) = owners
        return KeySlotRead(self, owners, fallback)


@dataclass
class KeySlotRead:
    """The index_k slot as one indexer reads it (graphs.indexer.KeyCacheChoice): the scoring
    runs in an If branch per candidate cache, on that cache in place, so only its results
    leave the branches: the caches (O(context) rows) are never copied."""

    slots: Slots
    owners: list[tuple[int, ir.Value]]  # (layer, its cache), chosen when publisher == layer
    fallback: ir.Value  # chosen when no owner is named

    def apply(self, op: OpBuilder, fn: Callable[[OpBuilder, ir.Value], Sequence[ir.Value]],
              outputs: Sequence[tuple[str, ir.DataType]]) -> tuple[ir.Value, ...]:
        def choose(o: OpBuilder, owners: list[tuple[int, ir.Value]]) -> tuple[ir.Value, ...]:
            if not owners:
                return tuple(fn(o, self.fallback))
            (layer, cache), rest = owners[0], owners[1:]
            return _if(o, o.Equal(self.slots.publisher, layer), lambda b: fn(b, cache),
                       lambda b: choose(b, rest), outputs)

        results = choose(op, self.owners)
        self.slots.note_key_read(results[0])
        return results


def _if(op: OpBuilder, condition: ir.Value, then: Callable[[OpBuilder], Sequence[ir.Value]],
        otherwise: Callable[[OpBuilder], Sequence[ir.Value]],
        outputs: Sequence[tuple[str, ir.DataType]]) -> tuple[ir.Value, ...]:
    """If(condition) then `then` else `otherwise`, each a subgraph of the named outputs, each
    [b, s, ?] (the candidate caches differ in rows, so Where cannot choose between them)."""
    builder = op.builder

    def branch(fn: Callable[[OpBuilder], Sequence[ir.Value]], name: str) -> ir.Graph:
        return builder.subgraph(lambda b: list(fn(b)), inputs=[],
                                outputs=[ir.Value(name=n) for n, _ in outputs], name=name)

    results = op.If(op.Squeeze(condition, [0]), then_branch=branch(then, "slot_is_this_owner"),
                    else_branch=branch(otherwise, "slot_is_another"), _outputs=len(outputs))
    results = (results,) if isinstance(results, ir.Value) else tuple(results)
    for result, (_, dtype) in zip(results, outputs, strict=True):
        result.type = ir.TensorType(dtype)
        result.shape = ir.Shape([None, None, None])
    return results
