"""sparse_attn: attention over an explicit index list per query, reproducing the reference
kernel's blockwise ONLINE softmax (blocks of 64 indices, bf16-rounded probabilities).

The kernel walks the index list in blocks (the last one padded with -1); after block `c`
its running max is M_c = max(-1e30, max of logits in blocks 0..c), its probabilities are
p = exp(l - M_c) and earlier partial sums get rescaled by alpha = exp(M_old - M_new):

    sum = sum * alpha + sum_j p_j                     (float32)
    acc = acc * alpha + sum_j bf16(p_j) * kv_j
    o   = bf16(acc / (sum + exp(sink - M_last)))

The rounding of p to bf16 with its own block's running max is what moves the output by up
to ~0.3% against a plain softmax. The graph emits one csa2onnx `SparseAttention` node: the
C++ kernel walks each query row's list in this order with torch CPU's float32 summation
orders (custom_ops/src/sparse_attention.h), never materialising the gathered rows
[b, s, k, d]; a portable artifact carries a standard-op body for it (custom_ops/portable.py:
the rows gathered and the recurrence unrolled, exact up to float32 reassociation).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops.constants import SPARSE_ATTENTION_BLOCK, SPARSE_ATTENTION_RUNNING_MAX_INIT
from csa2onnx.custom_ops.ops import sparse_attention

BLOCK = SPARSE_ATTENTION_BLOCK
RUNNING_MAX_INIT = SPARSE_ATTENTION_RUNNING_MAX_INIT


def sparse_attn(op: OpBuilder, q: ir.Value, kv: ir.Value, attn_sink: ir.Value,
                idx: ir.Value, softmax_scale: float, compressed: ir.Value | None = None,
                compressed_format: str | None = None, head_dim: int | None = None) -> ir.Value:
    """o[b,t,h] = attention of q[b,t,h] ([b,s,h,d]) over rows kv[b, idx[b,t,:]] ([b,n,d]).

    `idx` [b,s,k] (int32/int64, k dynamic, any size including 0); -1 entries are skipped.
    Each row is both key and value. `attn_sink` [h] (float32) joins the denominator only.
    `compressed` (packed rows [b, n_cache, bytes] in `compressed_format`): indices >= n
    read its row i - n, as if it were concatenated to kv unpacked (`head_dim`: d, which a
    portable graph needs to unpack it when kv's shape is not static).
    Returns bf16 values in float32, [b,s,h,d].
    """
    return sparse_attention(op, q, kv, attn_sink, idx, softmax_scale, compressed,
                            compressed_format, head_dim=head_dim)
