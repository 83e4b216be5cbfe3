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
    """kept: bool [b, s, nb], the blocks kept (nb = ceil(T / block_size)): the candidates
    as later indexers read them, a value a block (ops.candidates_per_key makes the
    reference's mask of positions, shaped like the logits, from it); the rest are the
    intermediates: block_scores [b, s, nb] (with the forced +inf), and the sorted top-k
    values and int64 block indices [b, s, min(topk_blocks, nb)]."""

    kept: ir.Value
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
    return candidates_of_blocks(op, block_max(op, logits, block_size), compress_lens,
                                topk_blocks, block_size)


def candidates_of_blocks(op: OpBuilder, block_scores: ir.Value, compress_lens: ir.Value,
                         topk_blocks: int, block_size: int, *,
                         forced: bool = False) -> CandidateBlocks:
    """select_candidate_blocks from the logits' block maxes [b, s, ceil(T / block_size)]
    (BlockMax's, or IndexerTopK's BlockScores: the logits themselves need not exist).
    `forced`: the block scores already hold the +inf below (IndexerTopK's
    force_newest_block)."""
    _check_sizes(topk_blocks, block_size)
    n_blocks = op.Slice(op.Shape(block_scores), [2], [3])
    # Force the block of the newest reachable position in.
    if not forced:
        block_scores = newest_block_forced(op, block_scores, compress_lens, block_size)

    k = op.Min(n_blocks, op.Constant(value_ints=[topk_blocks]))
    values, indices = torch_topk(op, block_scores, k, largest=True, sorted=True)

    # A block is kept iff picked with a value > -inf: the reference's scatter of the picks'
    # marks into zeros [b, s, nb] (the k indices of a row are distinct, so the scatter is
    # exact). A position inherits its block's mark, so the blocks' marks are the candidates,
    # 1 / block_size of the positions' bytes (at 1M keys a 256-token chunk's mask of
    # positions is 256 MiB).
    keep = op.Greater(values, op.Constant(value_float=NEG_INF))
    kept = candidate_mask(op, indices, keep, n_blocks, 1)
    return CandidateBlocks(kept, block_scores, values, indices)



def _check_sizes(topk_blocks: int, block_size: int) -> None:
    if topk_blocks <= 0:
        raise ValueError(f"candidate_topk_blocks must be > 0, got {topk_blocks}")
    if block_size <= 0:
        raise ValueError(f"candidate_block_size must be > 0, got {block_size}")
