"""The layer plan: each layer's role, where each shared slot it reads comes from, and the
state it carries between calls.

The reference's SharedAttentionRuntime has four slots that layers write and read in stack
order. Within one call three of them are plain dataflow edges (the most recent writer at or
before the reader); only `index_k` can carry over from an earlier call, because an owner
republishes its key cache only on a call where its compressor completed a group. The plan
makes that explicit: `index_k` is read through a per-stack "publisher" state (which owner
published last), everything else is an edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from csa2onnx.export.config import AttentionConfig, ConfigError
from csa2onnx.export.state_layout import StateLayout, StateTensor

IndexKeys = Literal["shared", "own"]


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    ratio: int
    kv_source: bool
    index_source: bool
    owns_index_k: bool
    candidate_source: bool
    uses_candidates: bool
    kv_from: int | None  # layer whose compressed-KV cache this layer reads
    topk_from: int | None  # layer whose selection this layer uses

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def role(self) -> str:
        if not self.compressed:
            return "window-only"
        parts = []
        if self.kv_source:
            parts.append("kv source")
        if self.index_source:
            parts.append("index source")
        if self.owns_index_k:
            parts.append("index-key owner")
        if self.candidate_source:
            parts.append("candidate source")
        if self.uses_candidates:
            parts.append("candidate user")
        if not parts:
            parts.append(f"consumer of L{self.kv_from}/L{self.topk_from}")
        return ", ".join(parts)


@dataclass(frozen=True)
class StackPlan:
    config: AttentionConfig
    layers: tuple[LayerPlan, ...]
    index_keys: IndexKeys

    @property
    def first(self) -> int:
        return self.layers[0].layer

    @property
    def last(self) -> int:
        return self.layers[-1].layer

    def layer(self, index: int) -> LayerPlan:
        return self.layers[index - self.first]

    @property
    def owners(self) -> tuple[int, ...]:
        return tuple(p.layer for p in self.layers if p.owns_index_k)

    def reads_index_k_slot(self, p: LayerPlan) -> bool:
        """Upstream, every indexer reads the shared slot; with index_keys="own" an owner
        reads its own cache (the goldens' _ownk overlays) and only non-owners read the slot."""
        return p.index_source and (self.index_keys == "shared" or not p.owns_index_k)

    @property
    def slot_readers(self) -> tuple[int, ...]:
        return tuple(p.layer for p in self.layers if self.reads_index_k_slot(p))

    def external_slots(self) -> tuple[str, ...]:
        """Slots some layer in the range reads but no layer in the range writes first: they
        are inputs of a model over this range (a sub-stack, a single layer)."""
        needed = []
        for p in self.layers:
            if p.compressed and (p.kv_from is None or p.kv_from < self.first):
                needed.append("compress_kv")
            if p.compressed and (p.topk_from is None or p.topk_from < self.first):
                needed.append("topk_idxs")
            if p.uses_candidates and self.config.candidate_source_layer < self.first:
                needed.append("candidates")
        # The index_k slot can hold the cache of an owner outside the range.
        all_owners = {i for i in self.config.kv_source_layers
                      if i in self.config.index_source_layers}
        if self.slot_readers and not all_owners <= set(self.owners):
            needed.append("index_k")
        return tuple(dict.fromkeys(needed))

    def state_layout(self) -> StateLayout:
        """Every tensor carried between calls, in a fixed order: per layer the window
        ring, the compressor's partial group (r > 1 kv sources), the compressed-KV cache
        (kv sources) and the index-key cache (owners); then the index_k publisher.

        Both calls read everything: a prefill may continue a sequence (chunked prefill), and
        one at start_pos 0 ignores the ring and the open group (its caches are written in
        place from row 0: a new sequence overwrites; the publisher persists, as the
        reference's slot does)."""
        c = self.config
        tensors: list[StateTensor] = []
        for p in self.layers:
            tensors.append(StateTensor("window_kv", p.layer, c.window_size, c.head_dim,
                                       "replaced", "ring buffer: position p in slot p % window"))
            if p.kv_source and p.ratio > 1:
                for role in ("compressor.kv_state", "compressor.score_state"):
                    tensors.append(StateTensor(role, p.layer, p.ratio, c.head_dim, "replaced",
                                               "compressor's open group (f32)"))
            if p.kv_source:
                kv_readers = [q.ratio for q in self.layers if q.kv_from == p.layer]
                tensors.append(StateTensor("compress_kv", p.layer, c.max_seq_len // p.ratio,
                                           c.head_dim, "in_place",
                                           "compressed-KV cache",
                                           read_ratio=min([p.ratio, *kv_readers])))
            if p.owns_index_k:
                # Through the shared slot any slot reader may slice this cache, at its ratio.
                slot_readers = [self.layer(i).ratio for i in self.slot_readers]
                tensors.append(StateTensor("index_k", p.layer, c.max_seq_len // p.ratio,
                                           c.index_head_dim, "in_place",
                                           "index-key cache",
                                           read_ratio=min([p.ratio, *slot_readers])))
        if self.slot_readers and self.owners:
            tensors.append(StateTensor("index_k_publisher", None, 1, 1, "replaced",
                                       "layer whose index-key cache the shared slot "
                                       "holds (-1: none yet)"))
        return StateLayout(tuple(tensors))


def plan_layer(config: AttentionConfig, layer: int) -> LayerPlan:
    c = config
    ratio = c.compress_ratios[layer]
    kv_source = layer in c.kv_source_layers
    index_source = layer in c.index_source_layers
    kv_before = [s for s in c.kv_source_layers if s <= layer]
    index_before = [s for s in c.index_source_layers if s <= layer]
    return LayerPlan(
        layer=layer,
        ratio=ratio,
        kv_source=kv_source,
        index_source=index_source,
        owns_index_k=kv_source and index_source,
        candidate_source=layer == c.candidate_source_layer,
        uses_candidates=(index_source and c.candidate_source_layer != -1
                         and layer > c.candidate_source_layer),
        kv_from=(max(kv_before) if kv_before else None) if ratio > 0 else None,
        topk_from=(max(index_before) if index_before else None) if ratio > 0 else None,
    )


def plan_stack(config: AttentionConfig, first: int = 0, last: int | None = None,
               index_keys: IndexKeys = "shared") -> StackPlan:
    """The plan for layers first..last (inclusive) of `config`."""
    last = config.n_layers - 1 if last is None else last
    if first > last:
        raise ConfigError(f"layers: range {first}..{last} is empty (its first layer is after "
                          "its last)")
    if not 0 <= first <= last < config.n_layers:
        raise ConfigError(f"layers: range {first}..{last} is outside 0..{config.n_layers - 1}")
    if index_keys not in ("shared", "own"):
        raise ConfigError(f"index_keys must be 'shared' or 'own', got {index_keys!r}")
    layers = tuple(plan_layer(config, i) for i in range(first, last + 1))
    return StackPlan(config, layers, index_keys)
