"""A prefill run in chunks (start_pos > 0 with many tokens), merged into the one-shot
prefill's shapes so that it can be checked against a one-shot golden.

What a chunk returns differs from the one-shot call in layout only where the call's extent
shows: selections are offset past this call's window rows (min(P, win) + s instead of the
prompt length), scores and candidates have end_pos // r columns, and the window part of the
attention index list is as wide as the chunk can see. Merging undoes that: selections
become compressed positions, scores are padded with -inf and candidate blocks expanded to their end
(the one-shot's values for positions no query of the chunk can reach). Floats then differ only
where sums do: torch's linear sums a row in an order that depends on the number of rows,
and the attention blocks its index list differently, so they are judged by the cross-CPU
rule; selections must be equal, except on rows where ties decide, which must still be a
valid top-k of the scores (`valid_topk`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from csa2onnx.export.runtime import AttentionRuntime, StepOutputs

# Per-layer outputs merged along the query axis as they are.
_ROWS = ("qr", "q_rope", "window_kv", "attn_o")


def as_positions(idx: np.ndarray, offset: int) -> np.ndarray:
    """Offset selections [b, s, k] -> compressed positions sorted ascending, -1 last."""
    pos = np.where(idx >= 0, np.asarray(idx, np.int64) - offset, -1)
    key = np.where(pos >= 0, pos, np.iinfo(np.int64).max)
    return np.take_along_axis(pos, np.argsort(key, axis=-1, kind="stable"), axis=-1)


def _pad_columns(a: np.ndarray, width: int, fill: float | bool) -> np.ndarray:
    pad = [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])]
    return np.pad(a, pad, constant_values=fill)


def _pad_blocks(mask: np.ndarray, width: int, block: int) -> np.ndarray:
    """Candidates [..., w] -> [..., width]: a kept block the chunk cut short is kept to
    its end (as the one-shot expands it), later blocks are not."""
    w = mask.shape[-1]
    columns = np.arange(width)
    first = (columns // block) * block  # each column's block start
    source = np.where(columns < w, columns, first)
    if w == 0:
        return np.zeros((*mask.shape[:-1], width), bool)
    return np.take(mask, np.minimum(source, w - 1), axis=-1) & (source < w)


def _pad_k(a: np.ndarray, k: int) -> np.ndarray:
    if a.shape[-1] >= k:
        return a[..., :k]
    return _pad_columns(a, k, -1)


def run_chunked_prefill(runtime: AttentionRuntime, xs: dict[int, np.ndarray], chunk: int,
                        progress: Callable[[str], None] | None = None
                        ) -> tuple[StepOutputs, list[tuple[int, StepOutputs]]]:
    """Prefill xs in chunks of `chunk` tokens: (merged outputs, the chunks with their
    start positions). Merged: `out`, and the debug outputs in `_ROWS`, `latent`,
    `index_score` (padded with -inf), `candidates` (the blocks kept, expanded) and
    `index_topk_positions` (compressed positions, ascending, -1 last) with
    `index_topk_k` (the k of each query row)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    total = next(iter(xs.values())).shape[1]
    window = int(runtime.manifest.config["window_size"])
    chunks: list[tuple[int, StepOutputs]] = []
    for start in range(0, total, chunk):
        part = {layer: x[:, start:start + chunk] for layer, x in xs.items()}
        chunks.append((start, runtime.prefill(part, start_pos=start)))
        if progress:
            progress(f"prefill chunk at {start}")
    out = {layer: np.concatenate([c.out[layer] for _, c in chunks], axis=1) for layer in xs}
    extra: dict[str, np.ndarray] = {}
    names = set(chunks[0][1].extra)
    for layer in xs:
        for name in (*_ROWS, "latent"):
            key = f"L{layer}.{name}"
            if key in names:
                extra[key] = np.concatenate([c.extra[key] for _, c in chunks], axis=1)
        score_key, cand_key = f"L{layer}.index_score", f"L{layer}.candidates"
        if score_key in names:
            width = max(c.extra[score_key].shape[-1] for _, c in chunks)
            extra[score_key] = np.concatenate(
                [_pad_columns(c.extra[score_key], width, -np.inf) for _, c in chunks], axis=1)
        if cand_key in names:
            width = max(c.extra[cand_key].shape[-1] for _, c in chunks)
            block = int(runtime.manifest.config["candidate_block_size"])
            extra[cand_key] = np.concatenate(
                [_pad_blocks(c.extra[cand_key], width, block) for _, c in chunks], axis=1)
        topk_key = f"L{layer}.index_topk_idxs"
        if topk_key in names:
            k = max(c.extra[topk_key].shape[-1] for _, c in chunks)
            extra[f"L{layer}.index_topk_positions"] = np.concatenate(
                [_pad_k(as_positions(c.extra[topk_key],
                                     min(start, window) + c.extra[topk_key].shape[1]), k)
                 for start, c in chunks], axis=1)
            # the k each query row's top-k ran with: min(index_topk, end_pos // r)
            extra[f"L{layer}.index_topk_k"] = np.concatenate(
                [np.full(c.extra[topk_key].shape[1], c.extra[topk_key].shape[-1])
                 for _, c in chunks])
    return StepOutputs(out, extra), chunks


def valid_topk(picked: np.ndarray, score: np.ndarray, k: int) -> bool:
    """Whether the positions `picked` (one row, -1 = nothing) can be a top-k of `score`
    (one row; unreachable positions -inf) under SOME tie order: every picked position
    scores at least the k-th largest value, every position above it is picked, and no
    more than k are."""
    chosen = picked[picked >= 0]
    if len(chosen) > k or len(set(chosen.tolist())) != len(chosen):
        return False
    if k == 0:
        return len(chosen) == 0
    kth = np.sort(score)[::-1][k - 1]
    above = np.flatnonzero(score > kth)
    return bool((score[chosen] >= kth).all() and np.isin(above, chosen).all())
