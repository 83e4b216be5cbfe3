"""Graph-side calls of the custom ops, for onnxscript's GraphBuilder (`op` is an OpBuilder).

onnxruntime cannot infer the output types of custom-domain nodes, so these wrappers set
them. `portable=True` emits only standard ONNX: the fp4 node keeps its name and gets the
standard-op function body from `portable.py` attached to the model, and top-k becomes
ONNX `TopK`, which breaks ties lowest-index-first instead of torch's way. `TorchLinear`
also has a standard-op body there (`MatMul`, exact up to the summation order).
"""

from __future__ import annotations

from typing import Literal

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION

ScaleFormat = Literal["e8m0", "e4m3"]


def _typed(value: ir.Value, dtype: ir.DataType, shape: ir.Shape | None = None) -> ir.Value:
    value.type = ir.TensorType(dtype)
    if shape is not None:
        value.shape = shape
    return value


def fp4_quant_dequant(op: OpBuilder, x: ir.Value, block_size: int,
                      scale_format: ScaleFormat) -> ir.Value:
    """fp4 (e2m1) round trip of float32 `x` over blocks of `block_size` on the last axis."""
    if block_size <= 0:
        raise ValueError(f"fp4 block_size must be > 0, got {block_size}")
    if scale_format not in ("e8m0", "e4m3"):
        raise ValueError(f"unknown fp4 scale_format {scale_format!r}")
    csa = op.builder.opset(DOMAIN, DOMAIN_VERSION)
    # Both outputs, though only Y is used: the standard-op function body of a portable
    # artifact declares two, and ONNX shape inference rejects a call naming fewer.
    y, scale = csa.Fp4QuantDequant(x, block_size=block_size, scale_format=scale_format,
                                   _outputs=2)
    _typed(scale, ir.DataType.FLOAT)
    return _typed(y, ir.DataType.FLOAT, x.shape)


def torch_topk(op: OpBuilder, x: ir.Value, k: ir.Value, *, largest: bool = True,
               sorted: bool = True, portable: bool = False) -> tuple[ir.Value, ir.Value]:
    """Top-k along the last axis with torch CPU's tie order: (values, int64 indices).

    `k` is an int64 tensor of shape [1]. With `portable`, ONNX TopK (ties to the lowest
    index) stands in: exact wherever no tie decides.
    """
    if portable:
        values, indices = op.TopK(x, k, axis=-1, largest=int(largest), sorted=1, _outputs=2)
    else:
        csa = op.builder.opset(DOMAIN, DOMAIN_VERSION)
        values, indices = csa.TorchTopK(x, k, largest=int(largest), sorted=int(sorted),
                                        _outputs=2)
    return _typed(values, ir.DataType.FLOAT), _typed(indices, ir.DataType.INT64)


def torch_linear(op: OpBuilder, x: ir.Value, w: ir.Value) -> ir.Value:
    """float32 x @ W^T (W: [N, K], bfloat16 or float32) summed in torch CPU's order.

    No rounding inside: round the result to bf16 where the reference does.
    """
    csa = op.builder.opset(DOMAIN, DOMAIN_VERSION)
    y = csa.TorchLinear(x, w)
    shape = None
    if x.shape is not None:  # x.shape[:-1] + [N]
        n = w.shape[0] if w.shape is not None and len(w.shape) == 2 else None
        shape = ir.Shape([*list(x.shape)[:-1], n])
    return _typed(y, ir.DataType.FLOAT, shape)


def torch_rms_norm(op: OpBuilder, x: ir.Value, w: ir.Value, eps: float) -> ir.Value:
    """w * (x * rsqrt(mean(x^2) + eps)) over the last axis in float32, the mean summed in
    torch CPU's order. No rounding inside: round to bf16 where the reference does."""
    if not eps > 0:
        raise ValueError(f"RMSNorm eps must be > 0, got {eps}")
    csa = op.builder.opset(DOMAIN, DOMAIN_VERSION)
    return _typed(csa.TorchRMSNorm(x, w, epsilon=float(eps)), ir.DataType.FLOAT, x.shape)


def sparse_attention(op: OpBuilder, q: ir.Value, kv: ir.Value, sink: ir.Value, idx: ir.Value,
                     scale: float) -> ir.Value:
    """The reference's sparse_attn (graphs/sparse_attn.py states the semantics): q
    [b,s,h,d], kv [b,n,d], sink [h], idx [b,s,k] (int64 or int32, -1 = nothing) -> bf16
    values in float32 [b,s,h,d], in torch CPU's arithmetic order, row by row."""
    if not scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {scale}")
    csa = op.builder.opset(DOMAIN, DOMAIN_VERSION)
    return _typed(csa.SparseAttention(q, kv, sink, idx, softmax_scale=float(scale)),
                  ir.DataType.FLOAT, q.shape)
