"""Every custom op but RopeCosSin and IndexerTopK (a portable graph writes it as IndexerScore,
TorchTopK and BlockMax: custom_ops/ops.py) as an ONNX function of standard ops (domain csa2onnx,
version 1): the one way a graph goes portable (custom_ops/ops.py).

Attached to a model as local functions, they let the model run on any onnxruntime without
the custom-op library; where the library is registered its kernels are used instead. What
each body computes against its kernel (tests/test_*: each "portable" test):

- Fp4QuantDequant: bit-exact for float32 input.
- TorchTopK: ONNX TopK, exact except where a tie decides (ONNX keeps the lowest index, the
  kernel torch CPU's order); always sorted.
- TorchLinear: a MatMul, the same sum in the runtime's summation order instead of torch's
  (last-bit differences). One group only: a portable graph spells `groups` G > 1 as G
  nodes and a Concat (custom_ops/ops.py).
- TorchRMSNorm: bit-exact. The mean is summed in torch CPU's order, the kernel's
  (custom_ops/src/torch_rms_norm.h): the cascade is spelled out with Loops of Adds, for any
  width; tests/test_torch_rms_norm.py checks the two against each other on order-sensitive
  rows.
- SparseAttention: the rows gathered [b, s, k, d] and the blockwise online softmax unrolled
  (graphs/sparse_attn.py): exact up to float32 reassociation (~99.8% of bf16 outputs
  identical to the reference), and far more memory than the kernel's row-by-row walk. Float
  rows only: a portable graph feeds it Concat(KV, UnpackQuantized(Compressed)) instead of a
  packed cache (custom_ops/ops.py).
- Fp8Linear: bit-exact with the kernel and the NumPy definition (NaN payloads aside):
  act_quant in float ops (the power of two corrected to exactness, the e4m3 rounding a
  saturating Cast), each K block's dot a DOUBLE MatMul (exact whatever the runtime's order,
  then one Cast to float), and the blocks added in order by a Loop, so the accumulation order
  is exactly the definition's, not only up to reassociation. It widens W to float32
  (onnxruntime may constant-fold that Cast, keeping 4 bytes per weight for the session) and
  each block's [32, N] slice to double.
- IndexerScore: the standard ops it replaced (MatMul against the transposed keys, Casts to
  bf16, Relu, Mul, ReduceSum over heads): bit-exact, as the kernel is defined as onnxruntime's
  run of these ops (tests/test_indexer_score.py), but it materialises [b, s, H, T] three
  times. Float keys only: a portable graph feeds it UnpackQuantized(Slice(cache)) instead of
  the packed cache (custom_ops/ops.py).
- WriteRows: Slices and Concats (any element type): exact, but it copies the whole cache on
  every call (the kernel writes only the new rows when the runtime binds the cache in place).
- PackQuantized, UnpackQuantized: bit-exact (NaN payloads aside): the quantisers' own steps,
  then the codes by exact arithmetic and the values from tables.

- BlockMax: a Pad with -inf to whole blocks, ReduceMax over each, and a NaN wherever IsNaN
  finds one (onnxruntime's ReduceMax skips a NaN that is not a block's first value): exact,
  except the sign of a zero maximum where a block holds both zeros (ReduceMax returns
  either; the kernel +0), and it copies X once.

- CandidateMask: the standard ops it replaced (graphs/candidates.py before the op: the keep
  marks ScatterElements'd into zeros, Expanded to block_size copies, Reshaped and Sliced to the
  width): exact for valid Blocks (in range, distinct in a row; the kernel refuses others), but
  it writes four tensors of the mask's size where the kernel writes the mask once.

- ApplyRope: the standard ops it replaced (graphs/rope.py's apply_rotary_emb before the op:
  Slices, Mul, Sub, Add, Concat, Cast to bf16 and back): bit-exact, NaN signs aside where
  both operands of a Mul or of the Add are NaN (tests/test_apply_rope.py), but it copies X
  about five times where the kernel reads it once (and, in place, writes only the rotated
  features).

RopeCosSin has none: ONNX Cos and Sin are not the C library's cosf and sinf, so a portable
graph keeps the RoPE tables instead (graphs/rope.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnxscript import BOOL, FLOAT, INT64, script
from onnxscript import opset21 as op
from onnxscript.values import Opset

from csa2onnx.custom_ops.constants import SPARSE_ATTENTION_RUNNING_MAX_INIT

csa2onnx = Opset("csa2onnx", 1)

# EMPTY_REDUCE: a reduction that can see an empty tensor (no rows, no keys) has its output
# shape pinned by a Reshape (allowzero) of its input's shape: onnxruntime 1.30 and 1.31 (the
# newest onnxruntime-gpu) return an empty input unreduced. graphs/numerics.py `reduce_axis`.

_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126
_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
_FP8_AMAX_FLOOR = float(np.float32(1e-4))
_FP8_MAX_INV = float(np.float32(1.0 / 448.0))


@script(csa2onnx)
def Fp4QuantDequant(X: FLOAT, block_size: int, scale_format: str) -> tuple[FLOAT, FLOAT]:
    shape = op.Shape(X)
    block = op.Reshape(op.Constant(value_int=block_size), [1])
    lead = op.Slice(shape, [0], [-1])
    blocks_shape = op.Concat(lead, op.Div(op.Slice(shape, [-1], [9223372036854775807]), block),
                             block, axis=0)
    x = op.Reshape(X, blocks_shape)
    kept = op.Concat(op.Shape(x, end=-1), [1], axis=0)  # reductions' shapes (EMPTY_REDUCE)
    amax = op.Reshape(op.ReduceMax(op.Abs(x), [-1], keepdims=1), kept, allowzero=1)
    # ReduceMax may skip NaN; the reference's amax propagates it to the whole block.
    has_nan = op.Cast(op.Reshape(op.ReduceMax(op.Cast(op.IsNaN(x), to=onnx.TensorProto.FLOAT),
                                              [-1], keepdims=1), kept, allowzero=1),
                      to=onnx.TensorProto.BOOL)
    amax = op.Where(has_nan, op.Constant(value_float=float("nan")), amax)

    # e8m0: exactly 2^ceil(log2(t)); the float log2 estimate is off by at most one, so
    # one correction each way makes it exact.
    t = op.Max(amax, op.Constant(value_float=_E8M0_AMAX_FLOOR)) * op.Constant(
        value_float=1.0 / 6.0)
    p = op.Pow(op.Constant(value_float=2.0),
               op.Ceil(op.Div(op.Log(t), op.Constant(value_float=0.6931471805599453))))
    p = op.Where(op.Less(p, t), p * 2.0, p)
    half = p * 0.5
    s_e8m0 = op.Where(op.GreaterOrEqual(half, t), half, p)
    # e4m3: amax / 6 rounded through float8 e4m3fn (nearest even, saturating at 448).
    a4 = op.Max(amax, op.Constant(value_float=_E4M3_AMAX_FLOOR))
    s_e4m3 = op.Cast(op.Cast(op.Div(a4, op.Constant(value_float=6.0)),
                             to=onnx.TensorProto.FLOAT8E4M3FN, saturate=1),
                     to=onnx.TensorProto.FLOAT)
    is_e8m0 = op.Equal(op.Constant(value_string=scale_format), op.Constant(value_string="e8m0"))
    s = op.Where(is_e8m0, s_e8m0, s_e4m3)

    v = op.Clip(op.Div(x, s), op.Constant(value_float=-6.0), op.Constant(value_float=6.0))
    a = op.Abs(v)
    # e2m1 with ties to the even code: Round is half-to-even, and on each binade of the
    # grid (step .5 below 2, 1 below 4, 2 above) the even codes sit on the even multiples.
    q = op.Where(op.Less(a, op.Constant(value_float=2.0)), op.Round(a * 2.0) * 0.5,
                 op.Where(op.Less(a, op.Constant(value_float=4.0)), op.Round(a),
                          op.Round(a * 0.5) * 2.0))
    negative = op.Or(op.Less(v, op.Constant(value_float=0.0)),
                     op.Less(op.Reciprocal(v), op.Constant(value_float=0.0)))  # keeps -0
    # A multiply keeps the sign of zero; onnxruntime's Where(negative, Neg(q), q) did not.
    q = q * op.Where(negative, op.Constant(value_float=-1.0), op.Constant(value_float=1.0))
    y = op.Cast(op.Cast(q * s, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)
    Y = op.Reshape(y, shape)
    Scale = op.Squeeze(s, [-1])
    return Y, Scale


@script(csa2onnx)
def TorchTopK(X, K, largest: int = 1, sorted: int = 1):
    # ONNX TopK breaks ties by the lowest index, torch's CPU kernel its own way; always sorted
    # (the kernel too whenever K*64 <= n).
    values, indices = op.TopK(X, op.Reshape(K, [1]), axis=-1, largest=largest, sorted=1)
    return values, indices


@script(csa2onnx)
def TorchLinear(X: FLOAT, W) -> FLOAT:
    return op.MatMul(X, op.Transpose(op.Cast(W, to=onnx.TensorProto.FLOAT), perm=[1, 0]))


# torch CPU's float32 sum over the last axis (custom_ops/src/torch_rms_norm.h, aten's
# SumKernel): 8-lane vectors, 4 interleaved accumulators over groups of 4 vectors, a cascade
# of 4 levels of `step` = 2^max(4, ceil(log2(groups)) // 4) entries each, then the left-over
# vectors, the accumulators, the scalar tail and the 8 lanes, in that order. Each level below
# sums chunks of `step` entries one Add at a time from zero; a short last chunk is padded
# with zeros, which adds nothing (the summands are squares, never -0), and a partial sum
# joins the next level as one more entry, where the kernel adds it in at the end: one Add of
# the same two values either way (float addition commutes). tests/test_torch_rms_norm.py
# checks this body against the kernel bit for bit.
_POWERS_OF_TWO = [1 << b for b in range(63)]


@script(csa2onnx)
def TorchRMSNorm(X: FLOAT, W, epsilon: float) -> FLOAT:
    shape = op.Shape(X)
    n = op.Slice(shape, [-1], [9223372036854775807])
    rows = op.ReduceProd(op.Slice(shape, [0], [-1]), keepdims=1)  # not -1: n may be 0
    # allowzero: a computed 0 (no rows, no groups, no chunks) is a size, not "copy the input's"
    sq = op.Reshape(X * X, op.Concat(rows, n, axis=0), allowzero=1)  # [rows, n]
    vectors = op.Div(n, op.Constant(value_ints=[8]))
    groups = op.Div(vectors, op.Constant(value_ints=[4]))
    powers = op.Constant(value_ints=_POWERS_OF_TWO)
    ceil_log2 = op.ReduceSum(op.Cast(op.Less(powers, groups), to=onnx.TensorProto.INT64),
                             keepdims=1)
    level_power = op.Max(op.Div(ceil_log2, op.Constant(value_ints=[4])),
                         op.Constant(value_ints=[4]))
    step = op.Gather(powers, level_power)  # [1]
    lanes32 = op.Constant(value_ints=[32])
    # [groups, rows, 32]: group g's 4 vectors (accumulator k is columns 8k .. 8k+7)
    entries = op.Transpose(op.Reshape(op.Slice(sq, [0], op.Mul(groups, lanes32), [1]),
                                      op.Concat(rows, groups, lanes32, axis=0), allowzero=1),
                           perm=[1, 0, 2])

    # The cascade, one Loop of Adds for every level: levels 1..3 sum chunks of `step` entries
    # (acc[k]'s flushes into acc[k + 1]), a short last chunk padded with zeros; level 4 is
    # acc[3] taking every level-3 sum, i.e. one chunk of them all. [m, rows, 32] entries
    # become [chunks, rows, 32] sums each level; level 4 leaves one.
    for level in range(4):
        cascading = op.Less(level, 3)
        m = op.Slice(op.Shape(entries), [0], [1])
        size = op.Where(cascading, step, m)
        chunks = op.Where(cascading,
                          op.Div(op.Sub(op.Add(m, step), op.Constant(value_ints=[1])), step),
                          op.Constant(value_ints=[1]))
        padded = op.Pad(entries, op.Concat(op.Constant(value_ints=[0, 0, 0]),
                                           op.Sub(op.Mul(chunks, size), m),
                                           op.Constant(value_ints=[0, 0]), axis=0))
        blocks = op.Reshape(padded, op.Concat(chunks, size, rows, lanes32, axis=0), allowzero=1)
        acc = op.ConstantOfShape(op.Concat(chunks, rows, lanes32, axis=0))
        for j in range(op.Squeeze(size, [0])):
            acc = op.Add(acc, op.Gather(blocks, j, axis=1))
        entries = acc
    total = op.Squeeze(entries, [0])  # [rows, 32]

    # The vectors past the last group (up to 3) into accumulator 0, then accumulators 1..3.
    lanes = op.Constant(value_ints=[8])
    left = op.Slice(sq, op.Mul(groups, lanes32), op.Mul(vectors, lanes), [1])
    left = op.Pad(left, op.Concat(op.Constant(value_ints=[0, 0, 0]),
                                  op.Sub(op.Constant(value_ints=[24]),
                                         op.Slice(op.Shape(left), [1], [2])), axis=0))
    part = op.Slice(total, [0], [8], [1])
    part = op.Add(part, op.Slice(left, [0], [8], [1]))
    part = op.Add(part, op.Slice(left, [8], [16], [1]))
    part = op.Add(part, op.Slice(left, [16], [24], [1]))
    part = op.Add(part, op.Slice(total, [8], [16], [1]))
    part = op.Add(part, op.Slice(total, [16], [24], [1]))
    part = op.Add(part, op.Slice(total, [24], [32], [1]))
    # The scalar tail (up to 7, from zero), then the 8 lanes one after another.
    tail = op.Slice(sq, op.Mul(vectors, lanes), n, [1])
    tail = op.Pad(tail, op.Concat(op.Constant(value_ints=[0, 0, 0]),
                                  op.Sub(op.Constant(value_ints=[7]),
                                         op.Slice(op.Shape(tail), [1], [2])), axis=0))
    terms = op.Transpose(op.Concat(tail, part, axis=1), perm=[1, 0])  # [7 + 8, rows]
    s = op.ConstantOfShape(rows)
    for t in range(15):
        s = op.Add(s, op.Gather(terms, t, axis=0))
    mean = op.Unsqueeze(s, [1])  # [rows, 1]
    mean = op.Div(mean, op.Cast(n, to=onnx.TensorProto.FLOAT))
    rsqrt = op.Reciprocal(op.Sqrt(mean + op.Constant(value_float=epsilon)))
    y = op.Cast(W, to=onnx.TensorProto.FLOAT) * (op.Reshape(X, op.Shape(sq), allowzero=1) * rsqrt)
    return op.Reshape(y, shape, allowzero=1)


@script(csa2onnx)
def SparseAttention(Q: FLOAT, KV: FLOAT, Sink: FLOAT, Idx, softmax_scale: float) -> FLOAT:
    # The index list padded with -1 to a multiple of 64 (the kernel's padded last block).
    idx = op.Cast(Idx, to=onnx.TensorProto.INT64)
    block = op.Constant(value_ints=[64])
    k = op.Slice(op.Shape(idx), [-1], [9223372036854775807])
    pad = op.Mod(op.Sub(block, op.Mod(k, block)), block)
    # no index at all: one block of -1 (as a row of -1: zeros), so no reduction below runs
    # over an empty axis (EMPTY_REDUCE)
    pad = op.Add(pad, op.Mul(op.Cast(op.Equal(k, op.Constant(value_ints=[0])),
                                     to=onnx.TensorProto.INT64), block))
    idx = op.Pad(idx, op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0]), pad, axis=0),
                 op.Constant(value_int=-1))
    valid = op.GreaterOrEqual(idx, op.Constant(value_int=0))
    # kv[b, idx] as [b, s, K, d]; a -1 index gives a zero row (never 0 * inf).
    kv_shape = op.Shape(KV)
    batch = op.Slice(kv_shape, [0], [1])
    n = op.Slice(kv_shape, [1], [2])
    base = op.Unsqueeze(op.Mul(op.Range(op.Constant(value_int=0), op.Squeeze(batch, [0]),
                                        op.Constant(value_int=1)), n), [1, 2])
    flat = op.Add(op.Max(idx, op.Constant(value_int=0)), base)
    kv_flat = op.Reshape(KV, op.Concat(op.Mul(batch, n), op.Slice(kv_shape, [2], [3]), axis=0))
    rows = op.Where(op.Unsqueeze(valid, [-1]), op.Gather(kv_flat, flat, axis=0),
                    op.Constant(value_float=0.0))

    neg_inf = op.Constant(value_float=float("-inf"))
    init = op.Constant(value_float=SPARSE_ATTENTION_RUNNING_MAX_INIT)
    logits = op.MatMul(rows, op.Transpose(Q, perm=[0, 1, 3, 2]))
    logits = op.Mul(op.Transpose(logits, perm=[0, 1, 3, 2]),
                    op.Constant(value_float=softmax_scale))
    logits = op.Where(op.Unsqueeze(valid, [2]), logits, neg_inf)  # [b, s, h, K]
    nb = op.Div(op.Slice(op.Shape(idx), [-1], [9223372036854775807]), block)
    blocks = op.Reshape(logits, op.Concat(op.Slice(op.Shape(logits), [0], [3]), nb, block,
                                          axis=0))  # [b, s, h, nb, 64]
    # The running max after each block: a prefix max via a lower-triangular mask.
    block_max = op.Reshape(op.ReduceMax(blocks, [-1], keepdims=0), op.Shape(blocks, end=-1),
                           allowzero=1)  # [b, s, h, nb] (EMPTY_REDUCE)
    ar = op.Range(op.Constant(value_int=0), op.Squeeze(nb, [0]), op.Constant(value_int=1))
    upto = op.LessOrEqual(op.Unsqueeze(ar, [0]), op.Unsqueeze(ar, [1]))
    masked = op.Where(upto, op.Unsqueeze(block_max, [-2]), neg_inf)
    running = op.Max(op.Reshape(op.ReduceMax(masked, [-1], keepdims=0),
                                op.Shape(masked, end=-1), allowzero=1), init)
    last = op.Max(op.Reshape(op.ReduceMax(logits, [-1], keepdims=0), op.Shape(logits, end=-1),
                             allowzero=1), init)  # [b, s, h]
    rescale = op.Unsqueeze(op.Exp(op.Sub(running, op.Unsqueeze(last, [-1]))), [-1])

    p = op.Exp(op.Sub(blocks, op.Unsqueeze(running, [-1])))
    total = op.Reshape(op.ReduceSum(op.Mul(p, rescale), [-2, -1], keepdims=0),
                       op.Shape(p, end=-2), allowzero=1)
    p_bf16 = op.Cast(op.Cast(p, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)
    weights = op.Reshape(op.Mul(p_bf16, rescale), op.Shape(logits))
    acc = op.MatMul(weights, rows)
    denom = op.Add(total, op.Exp(op.Sub(Sink, last)))
    o = op.Div(acc, op.Unsqueeze(denom, [-1]))
    return op.Cast(op.Cast(o, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)


@script(csa2onnx)
def Fp8Linear(X: FLOAT, W, WScale: FLOAT, block_size: int = 32) -> FLOAT:
    # block_size: only 32 exists (the kernel rejects others); the body uses 32.
    shape = op.Shape(X)
    w_shape = op.Shape(W)
    n = op.Slice(w_shape, [0], [1])
    k = op.Slice(w_shape, [1], [2])
    kb = op.Div(k, op.Constant(value_ints=[32]))
    x = op.Reshape(X, op.Concat(op.Constant(value_ints=[-1]), kb,
                                op.Constant(value_ints=[32]), axis=0))  # [M, KB, 32]
    # act_quant: amax (a NaN propagates; ReduceMax may skip it), floor, exact power of two.
    kept = op.Concat(op.Shape(x, end=-1), [1], axis=0)  # reductions' shapes (EMPTY_REDUCE)
    amax = op.Reshape(op.ReduceMax(op.Abs(x), [-1], keepdims=1), kept, allowzero=1)
    has_nan = op.Cast(op.Reshape(op.ReduceMax(op.Cast(op.IsNaN(x), to=onnx.TensorProto.FLOAT),
                                              [-1], keepdims=1), kept, allowzero=1),
                      to=onnx.TensorProto.BOOL)
    amax = op.Where(has_nan, op.Constant(value_float=float("nan")), amax)
    floor = op.Constant(value_float=_FP8_AMAX_FLOOR)
    amax = op.Where(op.Less(amax, floor), floor, amax)  # NaN stays NaN
    t = amax * op.Constant(value_float=_FP8_MAX_INV)
    # 2^ceil(log2 t): the float log2 estimate is off by at most one, so one correction
    # each way makes it exact (inf and NaN pass through).
    p = op.Pow(op.Constant(value_float=2.0),
               op.Ceil(op.Div(op.Log(t), op.Constant(value_float=0.6931471805599453))))
    p = op.Where(op.Less(p, t), p * 2.0, p)
    half = p * 0.5
    xs = op.Where(op.GreaterOrEqual(half, t), half, p)  # [M, KB, 1]
    # e4m3 nearest even, saturating at +-448 (the clamp); NaN stays NaN.
    xq = op.Cast(op.Cast(op.Div(x, xs), to=onnx.TensorProto.FLOAT8E4M3FN, saturate=1),
                 to=onnx.TensorProto.FLOAT)
    xq = op.Cast(op.Transpose(xq, perm=[1, 0, 2]), to=onnx.TensorProto.DOUBLE)  # [KB, M, 32]
    w = op.Reshape(op.Cast(W, to=onnx.TensorProto.FLOAT),
                   op.Concat(n, kb, op.Constant(value_ints=[32]), axis=0))
    w = op.Transpose(w, perm=[1, 2, 0])  # [KB, 32, N]
    # WScale row n // 32 for every column n, then xs * ws per block: [KB, M, N].
    nb = op.Slice(op.Shape(WScale), [0], [1])
    ws = op.Expand(op.Unsqueeze(WScale, [1]),
                   op.Concat(nb, op.Constant(value_ints=[32]), kb, axis=0))
    ws = op.Slice(op.Reshape(ws, op.Concat(op.Constant(value_ints=[-1]), kb, axis=0)),
                  op.Constant(value_ints=[0]), n, op.Constant(value_ints=[0]))  # [N, KB]
    scale = op.Mul(op.Transpose(xs, perm=[1, 0, 2]),
                   op.Unsqueeze(op.Transpose(ws, perm=[1, 0]), [1]))
    # Blocks in order: each dot exact in double, rounded once, scaled, then added.
    acc = op.ConstantOfShape(op.Concat(op.Slice(op.Shape(x), [0], [1]), n, axis=0))
    for i in range(op.Squeeze(kb, [0])):
        dot = op.Cast(op.MatMul(op.Gather(xq, i, axis=0),
                                op.Cast(op.Gather(w, i, axis=0), to=onnx.TensorProto.DOUBLE)),
                      to=onnx.TensorProto.FLOAT)
        acc = op.Add(acc, op.Mul(dot, op.Gather(scale, i, axis=0)))
    return op.Reshape(acc, op.Concat(op.Slice(shape, [0], [-1]), n, axis=0))


@script(csa2onnx)
def IndexerScore(Q: FLOAT, W: FLOAT, Keys: FLOAT, Width: INT64) -> FLOAT:
    # graphs/indexer.py's score before the op, node for node (the kernel's definition).
    k = op.Slice(Keys, [0], op.Reshape(Width, [1]), [1])
    dots = op.MatMul(Q, op.Unsqueeze(op.Transpose(k, perm=[0, 2, 1]), [1]))
    dots = op.Cast(op.Cast(dots, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)
    weighted = op.Mul(op.Relu(dots), op.Unsqueeze(W, [-1]))
    weighted = op.Cast(op.Cast(weighted, to=onnx.TensorProto.BFLOAT16),
                       to=onnx.TensorProto.FLOAT)
    score = op.Reshape(op.ReduceSum(weighted, [2], keepdims=0),  # no keys: (EMPTY_REDUCE)
                       op.Concat(op.Shape(weighted, end=2), op.Shape(weighted, start=3), axis=0),
                       allowzero=1)
    return op.Cast(op.Cast(score, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)


@script(csa2onnx)
def BlockMax(X: FLOAT, block_size: int) -> FLOAT:
    block = op.Reshape(op.Constant(value_int=block_size), [1])
    shape = op.Shape(X)
    width = op.Slice(shape, [-1], [9223372036854775807])
    n = op.Div(op.Add(width, op.Sub(block, [1])), block)
    padded = op.Pad(X, op.Concat([0], op.Sub(op.Mul(n, block), width), axis=0),
                    op.Constant(value_float=float("-inf")), [-1])
    blocks = op.Reshape(padded, op.Concat(op.Slice(shape, [0], [-1]), n, block, axis=0))
    out_shape = op.Concat(op.Slice(shape, [0], [-1]), n, axis=0)  # no rows: (EMPTY_REDUCE)
    top = op.Reshape(op.ReduceMax(blocks, [-1], keepdims=0), out_shape, allowzero=1)
    nan = op.Reshape(op.ReduceMax(op.Cast(op.IsNaN(blocks), to=onnx.TensorProto.FLOAT), [-1],
                                  keepdims=0), out_shape, allowzero=1)
    return op.Where(op.Greater(nan, [0.0]), op.Constant(value_float=float("nan")), top)


@script(csa2onnx)
def CandidateMask(Blocks: INT64, Keep: BOOL, Width: INT64, block_size: int) -> BOOL:
    # The marks scattered into zeros [..., nb], block_size copies of each, cut to the width.
    block = op.Reshape(op.Constant(value_int=block_size), [1])
    rows = op.Slice(op.Shape(Blocks), [0], [-1])
    width = op.Reshape(Width, [1])
    n = op.Div(op.Add(width, op.Sub(block, [1])), block)
    zeros = op.ConstantOfShape(op.Concat(rows, n, axis=0))
    marks = op.ScatterElements(zeros, Blocks, op.Cast(Keep, to=onnx.TensorProto.FLOAT), axis=-1)
    copies = op.Expand(op.Unsqueeze(op.Greater(marks, [0.0]), [-1]),
                       op.Concat(rows, n, block, axis=0))
    positions = op.Reshape(copies, op.Concat(rows, [-1], axis=0), allowzero=1)
    return op.Slice(positions, [0], width, [-1])


@script(csa2onnx)
def WriteRows(Cache, Rows, RowStart: INT64, After: INT64):
    # Any element type (float caches, uint8 packed rows). After only orders the write after
    # its producers; the copy needs no ordering.
    start = op.Reshape(RowStart, [1])
    end = op.Add(start, op.Slice(op.Shape(Rows), [1], [2]))
    b = op.Slice(op.Shape(Rows), [0], [1])
    top = op.Slice(Cache, [0], b, [0])  # the batch entries Rows covers
    written = op.Concat(op.Slice(top, [0], start, [1]), Rows,
                        op.Slice(top, end, [9223372036854775807], [1]), axis=1)
    return op.Concat(written, op.Slice(Cache, b, [9223372036854775807], [0]), axis=0)


# Packed rows (custom_ops/src/packed_quant.h). One body serves the three formats: the block,
# the codes per byte and each step are picked by the format attribute (Where), every
# variant computed (the library-free path is not the fast one).
_E4M3_VALUES = [float(v) for v in
                np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)]
_E8M0_VALUES = [float(np.ldexp(np.float32(1.0), b - 127)) for b in range(255)] + [float("nan")]
_E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                -4.0, -6.0] + [0.0] * 240  # padded to 256 to share the e4m3 table's shape
# 2^k for k = -5 .. 8: an e4m3 value's exponent is -6 plus how many of these it reaches.
_E4M3_BINADES = [2.0**k for k in range(-5, 9)]


@script(csa2onnx)
def PackQuantized(X: FLOAT, format: str):
    # Quantises as Fp4QuantDequant / act_quant (the same floors, one float operation each);
    # then the codes by exact arithmetic: an e2m1 code by the rounding thresholds, an e4m3
    # code of an exact e4m3 value a as 8E + 48 + a * 2^(3 - E) (E its exponent, -6 below the
    # normals, where this is a * 512), an e8m0 byte as log2(s) + 127 (s a power of two).
    fmt = op.Constant(value_string=format)
    is_e4m3 = op.Equal(fmt, op.Constant(value_string="fp4_e4m3_16"))
    is_fp8 = op.Equal(fmt, op.Constant(value_string="fp8_e8m0_32"))
    block = op.Where(is_e4m3, op.Constant(value_ints=[16]), op.Constant(value_ints=[32]))
    shape = op.Shape(X)
    lead = op.Slice(shape, [0], [-1])
    d = op.Slice(shape, [-1], [9223372036854775807])
    x = op.Reshape(X, op.Concat(lead, op.Div(d, block), block, axis=0))
    kept = op.Concat(op.Shape(x, end=-1), [1], axis=0)  # reductions' shapes (EMPTY_REDUCE)
    amax = op.Reshape(op.ReduceMax(op.Abs(x), [-1], keepdims=1), kept, allowzero=1)
    has_nan = op.Cast(op.Reshape(op.ReduceMax(op.Cast(op.IsNaN(x), to=onnx.TensorProto.FLOAT),
                                              [-1], keepdims=1), kept, allowzero=1),
                      to=onnx.TensorProto.BOOL)
    amax = op.Where(has_nan, op.Constant(value_float=float("nan")), amax)
    # The scales: e8m0 2^ceil(log2(max(amax, 6 * 2^-126) / 6)); act_quant's
    # 2^ceil(log2(max(amax, 1e-4) / 448)); e4m3 e4m3(max(amax, 6 * 2^-9) / 6), saturating.
    # (NaN stays NaN through Where(Less) floors.)
    f8 = op.Constant(value_float=_E8M0_AMAX_FLOOR)
    t_fp4 = op.Where(op.Less(amax, f8), f8, amax) * op.Constant(value_float=1.0 / 6.0)
    f_fp8 = op.Constant(value_float=_FP8_AMAX_FLOOR)
    t_fp8 = op.Where(op.Less(amax, f_fp8), f_fp8, amax) * op.Constant(value_float=_FP8_MAX_INV)
    t = op.Where(is_fp8, t_fp8, t_fp4)
    p = op.Pow(op.Constant(value_float=2.0),
               op.Ceil(op.Div(op.Log(t), op.Constant(value_float=0.6931471805599453))))
    p = op.Where(op.Less(p, t), p * 2.0, p)
    half = p * 0.5
    s_pow2 = op.Where(op.GreaterOrEqual(half, t), half, p)
    f4 = op.Constant(value_float=_E4M3_AMAX_FLOOR)
    s_e4m3 = op.Cast(op.Cast(op.Div(op.Where(op.Less(amax, f4), f4, amax),
                                    op.Constant(value_float=6.0)),
                             to=onnx.TensorProto.FLOAT8E4M3FN, saturate=1),
                     to=onnx.TensorProto.FLOAT)
    s = op.Where(is_e4m3, s_e4m3, s_pow2)  # [..., blocks, 1]
    bad = op.Or(op.IsNaN(s), op.IsInf(s))  # the round trip is NaN throughout: codes 0

    bound = op.Where(is_fp8, op.Constant(value_float=448.0), op.Constant(value_float=6.0))
    v = op.Clip(op.Div(x, s), op.Neg(bound), bound)
    a = op.Abs(v)
    # e2m1 index: how many thresholds |v| passes (ties to the even code: .25, 1.25, 2.5 and 5
    # must be exceeded, .75, 1.75 and 3.5 reached)
    above = op.Greater(op.Unsqueeze(a, [-1]), op.Constant(value_floats=[0.25, 1.25, 2.5, 5.0]))
    reach = op.GreaterOrEqual(op.Unsqueeze(a, [-1]), op.Constant(value_floats=[0.75, 1.75, 3.5]))
    a_shape = op.Shape(a)  # the reductions' shapes (EMPTY_REDUCE)
    n_above = op.Reshape(op.ReduceSum(op.Cast(above, to=onnx.TensorProto.FLOAT), [-1],
                                      keepdims=0), a_shape, allowzero=1)
    n_reach = op.Reshape(op.ReduceSum(op.Cast(reach, to=onnx.TensorProto.FLOAT), [-1],
                                      keepdims=0), a_shape, allowzero=1)
    e2m1 = op.Cast(n_above + n_reach, to=onnx.TensorProto.INT64)
    zero = op.Constant(value_float=0.0)
    negative = op.Or(op.Less(v, zero), op.Less(op.Reciprocal(v), zero))  # -0 too
    code4 = e2m1 + op.Cast(negative, to=onnx.TensorProto.INT64) * op.Constant(value_int=8)

    binades = op.Constant(value_floats=_E4M3_BINADES)
    q8 = op.Cast(op.Cast(v, to=onnx.TensorProto.FLOAT8E4M3FN), to=onnx.TensorProto.FLOAT)
    a8 = op.Abs(q8)
    e8 = op.Reshape(op.ReduceSum(op.Cast(op.GreaterOrEqual(op.Unsqueeze(a8, [-1]), binades),
                                         to=onnx.TensorProto.FLOAT), [-1], keepdims=0),
                    a_shape, allowzero=1) - 6.0
    m8 = a8 * op.Pow(op.Constant(value_float=2.0), op.Constant(value_float=3.0) - e8)
    negative8 = op.Or(op.Less(q8, zero), op.Less(op.Reciprocal(q8), zero))
    code8 = (op.Cast(e8 * 8.0 + 48.0 + m8, to=onnx.TensorProto.INT64) +
             op.Cast(negative8, to=onnx.TensorProto.INT64) * op.Constant(value_int=128))
    code8 = op.Where(op.IsNaN(q8), op.Constant(value_int=127), code8)
    code = op.Where(bad, op.Constant(value_int=0), op.Where(is_fp8, code8, code4))

    per_byte = op.Where(is_fp8, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    # explicit sizes, not -1: a row count of 0 (no new rows) leaves -1 undefined
    pairs = op.Reshape(code, op.Concat(lead, op.Div(d, per_byte), per_byte, axis=0))
    weights = op.Slice(op.Constant(value_ints=[1, 16]), [0], per_byte)
    codes = op.Reshape(op.ReduceSum(pairs * weights, [-1], keepdims=0),
                       op.Shape(pairs, end=-1), allowzero=1)

    # Scale bytes: the e4m3 code of s (as above), or log2(s) + 127 (0xFF for NaN / inf).
    s1 = op.Where(bad, op.Constant(value_float=1.0), s)
    es = op.Reshape(op.ReduceSum(op.Cast(op.GreaterOrEqual(op.Unsqueeze(s1, [-1]), binades),
                                         to=onnx.TensorProto.FLOAT), [-1], keepdims=0),
                    op.Shape(s1), allowzero=1) - 6.0
    ms = s1 * op.Pow(op.Constant(value_float=2.0), op.Constant(value_float=3.0) - es)
    e4m3_byte = op.Cast(es * 8.0 + 48.0 + ms, to=onnx.TensorProto.INT64)
    e4m3_byte = op.Where(op.IsNaN(s), op.Constant(value_int=127), e4m3_byte)
    e8m0_byte = op.Cast(op.Round(op.Div(op.Log(s1), op.Constant(value_float=0.6931471805599453))),
                        to=onnx.TensorProto.INT64) + op.Constant(value_int=127)
    e8m0_byte = op.Where(bad, op.Constant(value_int=255), e8m0_byte)
    scale_bytes = op.Reshape(op.Where(is_e4m3, e4m3_byte, e8m0_byte),
                             op.Concat(lead, op.Div(d, block), axis=0))
    return op.Cast(op.Concat(codes, scale_bytes, axis=-1), to=onnx.TensorProto.UINT8)


@script(csa2onnx)
def UnpackQuantized(P, format: str, dim: int) -> FLOAT:
    # value(code) * scale in float32, the codes and scale bytes looked up in 256-entry tables.
    fmt = op.Constant(value_string=format)
    is_e4m3 = op.Equal(fmt, op.Constant(value_string="fp4_e4m3_16"))
    is_fp8 = op.Equal(fmt, op.Constant(value_string="fp8_e8m0_32"))
    block = op.Where(is_e4m3, op.Constant(value_ints=[16]), op.Constant(value_ints=[32]))
    per_byte = op.Where(is_fp8, op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
    d = op.Reshape(op.Constant(value_int=dim), [1])
    code_bytes = op.Div(d, per_byte)
    lead = op.Slice(op.Shape(P), [0], [-1])
    p = op.Cast(P, to=onnx.TensorProto.INT64)
    packed = op.Unsqueeze(op.Slice(p, [0], code_bytes, [-1]), [-1])  # [..., bytes, 1]
    scale_bytes = op.Slice(p, code_bytes, [9223372036854775807], [-1])
    # code j of a byte: (byte // 16^j) % 16 for fp4 (element 2i low, 2i+1 high); the byte
    # itself for fp8
    j = op.Range(op.Constant(value_int=0), op.Squeeze(per_byte, [0]), op.Constant(value_int=1))
    modulus = op.Where(is_fp8, op.Constant(value_int=256), op.Constant(value_int=16))
    codes = op.Mod(op.Div(packed, op.Pow(op.Constant(value_int=16), j)), modulus)
    codes = op.Reshape(codes, op.Concat(lead, d, axis=0))
    # The format picks its half of a table by an index offset: Where would lose the sign of
    # zero (onnxruntime's Where returns +0 for -0).
    codes = codes + op.Cast(is_fp8, to=onnx.TensorProto.INT64) * op.Constant(value_int=256)
    values = op.Gather(op.Constant(value_floats=_E2M1_VALUES + _E4M3_VALUES), codes)
    scale_bytes = scale_bytes + op.Cast(is_e4m3, to=onnx.TensorProto.INT64) * op.Constant(
        value_int=256)
    scales = op.Gather(op.Constant(value_floats=_E8M0_VALUES + _E4M3_VALUES), scale_bytes)
    y = op.Reshape(values, op.Concat(lead, op.Div(d, block), block, axis=0))
    return op.Reshape(y * op.Unsqueeze(scales, [-1]), op.Concat(lead, d, axis=0))


@script(csa2onnx)
def ApplyRope(X: FLOAT, Cos: FLOAT, Sin: FLOAT, rope_head_dim: int, inverse: int = 0) -> FLOAT:
    # graphs/rope.py's apply_rotary_emb before the op, node for node.
    rd = op.Reshape(op.Constant(value_int=rope_head_dim), [1])
    shape = op.Shape(X)
    nope = op.Slice(X, [0], op.Neg(rd), [-1])
    rope = op.Slice(X, op.Neg(rd), [9223372036854775807], [-1])
    pairs = op.Reshape(rope, op.Concat(op.Slice(shape, [0], [-1]), op.Div(rd, [2]), [2], axis=0))
    re = op.Squeeze(op.Slice(pairs, [0], [1], [-1]), [-1])
    im = op.Squeeze(op.Slice(pairs, [1], [2], [-1]), [-1])
    # [..., s, rd/2] -> [..., s, 1, rd/2] when X has a heads axis: one size-1 axis per
    # dimension of X beyond three.
    ones = op.Expand(op.Constant(value_ints=[1]), op.Sub(op.Shape(shape), [3]))
    rows_shape = op.Shape(Cos)
    rows_shape = op.Concat(op.Slice(rows_shape, [0], [-1]), ones,
                           op.Slice(rows_shape, [-1], [9223372036854775807]), axis=0)
    cos = op.Reshape(Cos, rows_shape)
    # Neg(Sin) when inverse, picked by index: Where would turn -0 into +0.
    sin = op.Gather(op.Concat(op.Unsqueeze(Sin, [0]), op.Unsqueeze(op.Neg(Sin), [0]), axis=0),
                    op.Constant(value_int=inverse), axis=0)
    sin = op.Reshape(sin, rows_shape)
    out_re = op.Sub(op.Mul(re, cos), op.Mul(im, sin))
    out_im = op.Add(op.Mul(re, sin), op.Mul(im, cos))
    rotated = op.Reshape(op.Concat(op.Unsqueeze(out_re, [-1]), op.Unsqueeze(out_im, [-1]),
                                   axis=-1), op.Shape(rope))
    rounded = op.Cast(op.Cast(rotated, to=onnx.TensorProto.BFLOAT16), to=onnx.TensorProto.FLOAT)
    return op.Concat(nope, rounded, axis=-1)


def fp4_function_proto() -> onnx.FunctionProto:
    """The Fp4QuantDequant function alone (see `portable_functions`)."""
    return Fp4QuantDequant.to_function_proto()


def portable_functions() -> list[onnx.FunctionProto]:
    """The functions to add to a model's `functions` for a library-free artifact."""
    return [f.to_function_proto() for f in (Fp4QuantDequant, TorchTopK, TorchLinear,
                                             TorchRMSNorm, SparseAttention, Fp8Linear,
                                             IndexerScore, WriteRows, PackQuantized,
                                             UnpackQuantized, ApplyRope, BlockMax,
                                             CandidateMask)]
