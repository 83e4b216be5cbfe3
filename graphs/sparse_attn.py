"""sparse_attn: attention over an explicit index list per query, reproducing the reference
kernel's blockwise ONLINE softmax (blocks of 64 indices, bf16-rounded probabilities).

The kernel walks the index list in blocks; after block `c` its running max is
M_c = max(-1e30, max of logits in blocks 0..c), its probabilities are exp(l - M_c) and
earlier partial sums get rescaled by exp(M_old - M_new). Unrolled, the final state is

    p_j = exp(l_j - M_block(j))                       (float32)
    sum = sum_j p_j * exp(M_block(j) - M_last)
    acc = sum_j bf16(p_j) * exp(M_block(j) - M_last) * kv_j

which is what this graph computes in one pass (float32 reassociation only; the bf16
rounding of p with its own block's running max is kept, since that rounding is what moves
the output by up to ~0.3% against a plain softmax).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.graphs.numerics import INT64, round_bf16

BLOCK = 64  # the reference kernel's block of indices
RUNNING_MAX_INIT = -1e30  # finite, so an all -1 row gives exp(sink + 1e30) = inf -> o = 0


def sparse_attn(op: OpBuilder, q: ir.Value, kv: ir.Value, attn_sink: ir.Value,
                idx: ir.Value, softmax_scale: float) -> ir.Value:
    """o[b,t,h] = attention of q[b,t,h] ([b,s,h,d]) over rows kv[b, idx[b,t,:]] ([b,n,d]).

    `idx` [b,s,k] (int32/int64, k dynamic, any size including 0); -1 entries are skipped.
    Each row is both key and value. `attn_sink` [h] (float32) joins the denominator only.
    Returns bf16 values in float32, [b,s,h,d].
    """
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    idx = _pad_to_blocks(op, op.Cast(idx, to=INT64))  # [b, s, nb*64], padding is -1
    valid = op.GreaterOrEqual(idx, 0)
    rows = _gather_rows(op, kv, idx, valid)  # [b, s, K, d]

    # rows @ q^T then transpose the small [b, s, K, h] result, not the big rows tensor.
    logits = op.MatMul(rows, op.Transpose(q, perm=[0, 1, 3, 2]))
    logits = op.Mul(op.Transpose(logits, perm=[0, 1, 3, 2]), softmax_scale)
    logits = op.Where(op.Unsqueeze(valid, [2]), logits, -np.inf)  # [b, s, h, K]
    # Explicit sizes, not -1: Reshape cannot infer a dimension of an empty tensor.
    nb = op.Div(op.Slice(op.Shape(idx), [-1], [2**62]), BLOCK)
    blocks = op.Reshape(logits, op.Concat(op.Slice(op.Shape(logits), [0], [3]), nb, [BLOCK],
                                          axis=0))  # [b, s, h, nb, 64]

    running = _running_max(op, op.ReduceMax(blocks, [-1], keepdims=0))  # [b, s, h, nb]
    # The final running max; written as a max over [init, logits] so k == 0 works too.
    last = op.Max(op.ReduceMax(logits, [-1], keepdims=0), RUNNING_MAX_INIT)  # [b, s, h]
    rescale = op.Unsqueeze(op.Exp(op.Sub(running, op.Unsqueeze(last, [-1]))), [-1])

    p = op.Exp(op.Sub(blocks, op.Unsqueeze(running, [-1])))  # f32, per block's max
    total = op.ReduceSum(op.Mul(p, rescale), [-2, -1], keepdims=0)  # [b, s, h]
    weights = op.Mul(round_bf16(op, p), rescale)
    weights = op.Reshape(weights, op.Shape(logits))  # [b, s, h, K]
    acc = op.MatMul(weights, rows)  # [b, s, h, d]

    denom = op.Add(total, op.Exp(op.Sub(attn_sink, last)))
    return round_bf16(op, op.Div(acc, op.Unsqueeze(denom, [-1])))


def _pad_to_blocks(op: OpBuilder, idx: ir.Value) -> ir.Value:
    """Append -1 entries so the last axis is a multiple of BLOCK (the kernel's padded tail)."""
    k = op.Slice(op.Shape(idx), [-1], [2**62])
    pad = op.Mod(op.Sub(BLOCK, op.Mod(k, BLOCK)), BLOCK)
    pads = op.Concat(op.Constant(value=ir.tensor(np.zeros(5, np.int64))), pad, axis=0)
    return op.Pad(idx, pads, op.Constant(value=ir.tensor(np.array(-1, np.int64))))


def _gather_rows(op: OpBuilder, kv: ir.Value, idx: ir.Value, valid: ir.Value) -> ir.Value:
    """kv[b, idx[b, t, j]] as [b, s, K, d]; a -1 index gives a zero row (never 0 * inf)."""
    kv_shape = op.Shape(kv)
    batch, n = op.Slice(kv_shape, [0], [1]), op.Slice(kv_shape, [1], [2])
    base = op.Unsqueeze(op.Mul(op.Range(0, op.Squeeze(batch, [0]), 1), n), [1, 2])
    flat = op.Add(op.Max(idx, 0), base)  # index into kv viewed [b*n, d]
    kv_flat = op.Reshape(kv, op.Concat(op.Mul(batch, n), op.Slice(kv_shape, [2], [3]), axis=0))
    rows = op.Gather(kv_flat, flat, axis=0)
    return op.Where(op.Unsqueeze(valid, [-1]), rows, 0.0)


def _running_max(op: OpBuilder, block_max: ir.Value) -> ir.Value:
    """M_c = max(-1e30, block_max[..., 0..c]): a prefix max via a lower-triangular mask."""
    nb = op.Squeeze(op.Slice(op.Shape(block_max), [-1], [2**62]), [0])
    ar = op.Range(0, nb, 1)
    upto = op.LessOrEqual(op.Unsqueeze(ar, [0]), op.Unsqueeze(ar, [1]))  # [c, c']: c' <= c
    masked = op.Where(upto, op.Unsqueeze(block_max, [-2]), -np.inf)  # [..., nb, nb]
    return op.Max(op.ReduceMax(masked, [-1], keepdims=0), RUNNING_MAX_INIT)
