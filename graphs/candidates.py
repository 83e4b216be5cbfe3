"""select_candidate_blocks (reference.md): level one of the two-level top-k.

The candidate source picks the best `topk_blocks` blocks of `block_size` compressed
positions per query (by block max); a later indexer only selects inside them. The block
holding the query's newest reachable position is forced in with +inf.
"""

from __future__ import annotations

from typing import NamedTuple

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops.ops import (
    block_max,
    candidate_mask,
    newest_block_forced,
    torch_topk,
)
from csa2onnx.graphs.common import NEG_INF


class CandidateBlocks(NamedTuple):
    """candidates: bool [b, s, T] (shaped like the logits); the rest are the block-level
    intermediates: block_scores [b, s, nb] (with the forced +inf), and the sorted top-k
    values and int64 block indices [b, s, min(topk_blocks, nb)]."""

    candidates: ir.Value
    block_scores: ir.Value
    topk_values: ir.Value
    topk_indices: ir.Value


def select_candidate_blocks(op: OpBuilder, logits: ir.Value, compress_lens: ir.Value,
                            topk_blocks: int, block_size: int) -> CandidateBlocks:
    """logits [b, s, T] f32 (-inf where unreachable); compress_lens int64 broadcastable to
    [b, s] (reachable positions per query). T and the sizes are dynamic; T = 0 gives an
    empty mask. (A portable graph swaps torch's tie order for ONNX TopK's.)"""
    _check_sizes(topk_blocks, block_size)
    # A block's score is its max (the last block as if padded with -inf), read in place.
    width = op.Slice(op.Shape(logits), [2], [3])
    return candidates_of_blocks(op, block_max(op, logits, block_size), width, compress_lens,
                                topk_blocks, block_size)


def candidates_of_blocks(op: OpBuilder, block_scores: ir.Value, width: ir.Value,
                         compress_lens: ir.Value, topk_blocks: int, block_size: int, *,
                         forced: bool = False) -> CandidateBlocks:
    """select_candidate_blocks from the logits' block maxes [b, s, ceil(T / block_size)]
    (BlockMax's, or IndexerTopK's BlockScores: the logits themselves need not exist);
    width int64 [1] is T. `forced`: the block scores already hold the +inf below
    (IndexerTopK's force_newest_block)."""
    _check_sizes(topk_blocks, block_size)
    n_blocks = op.Slice(op.Shape(block_scores), [2], [3])
    # Force the block of the newest reachable position in.
    if not forced:
        block_scores = newest_block_forced(op, block_scores, compress_lens, block_size)

    k = op.Min(n_blocks, op.Constant(value_ints=[topk_blocks]))
    values, indices = torch_topk(op, block_scores, k, largest=True, sorted=True)

    # A block is kept iff picked with a value > -inf: the reference's scatter of the picks'
    # marks into zeros [b, s, nb] (the k indices of a row are distinct, so the scatter is
    # exact); a position inherits its block's mark (CandidateMask writes that mask at once).
    keep = op.Greater(values, op.Constant(value_float=NEG_INF))
    candidates = candidate_mask(op, indices, keep, width, block_size)
    return CandidateBlocks(candidates, block_scores, values, indices)


def _check_sizes(topk_blocks: int, block_size: int) -> None:
    if topk_blocks <= 0:
        raise ValueError(f"candidate_topk_blocks must be > 0, got {topk_blocks}")
    if block_size <= 0:
        raise ValueError(f"candidate_block_size must be > 0, got {block_size}")
