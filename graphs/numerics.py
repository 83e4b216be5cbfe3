"""The reference's arithmetic building blocks: bf16 rounding, Linear, RMSNorm.

Activations travel as float32 tensors holding bf16 values (onnxruntime's CPU provider has
almost no bf16 kernels); `round_bf16` is placed exactly where the reference rounds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.ops import torch_linear, torch_rms_norm

FLOAT = ir.DataType.FLOAT
BFLOAT16 = ir.DataType.BFLOAT16
INT64 = ir.DataType.INT64


def round_bf16(op: OpBuilder, x: ir.Value) -> ir.Value:
    """bf16(x): round to bfloat16 (nearest even) and back to float32."""
    return op.Cast(op.Cast(x, to=BFLOAT16), to=FLOAT)


def weight(values: np.ndarray, dtype: ir.DataType) -> nn.Parameter:
    """A parameter stored as `dtype` (bf16 weights stay bf16 in the artifact)."""
    if dtype == BFLOAT16:
        data = np.asarray(values, np.float32).astype(ml_dtypes.bfloat16)
    else:
        data = np.asarray(values, np.float32)
    return nn.Parameter(data.shape, data=ir.tensor(data))


def as_float(op: OpBuilder, w: ir.Value) -> ir.Value:
    return w if w.dtype == FLOAT else op.Cast(w, to=FLOAT)


class Linear(nn.Module):
    """y = bf16(x @ W^T), float32 accumulation, one rounding (W: [out, in], bf16)."""

    def __init__(self, w: np.ndarray, dtype: ir.DataType = BFLOAT16,
                 name: str | None = None) -> None:
        super().__init__(name)
        if np.ndim(w) != 2:
            raise ValueError(f"Linear weight must be [out, in], got shape {np.shape(w)}")
        self.out_features, self.in_features = np.shape(w)
        self.weight = weight(w, dtype)

    def forward(self, op: OpBuilder, x: ir.Value) -> ir.Value:
        return round_bf16(op, torch_linear(op, x, self.weight))


class LinearF32(Linear):
    """F.linear on float32 input and float32 weights, no rounding (the ratio > 1 compressor)."""

    def __init__(self, w: np.ndarray, name: str | None = None) -> None:
        super().__init__(w, FLOAT, name)

    def forward(self, op: OpBuilder, x: ir.Value) -> ir.Value:
        return torch_linear(op, x, self.weight)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w in float32, then rounded to bf16 (the input's dtype)."""

    def __init__(self, w: np.ndarray, eps: float, name: str | None = None) -> None:
        super().__init__(name)
        if np.ndim(w) != 1:
            raise ValueError(f"RMSNorm weight must be 1-D, got shape {np.shape(w)}")
        self.dim = int(np.shape(w)[0])
        self.eps = float(eps)
        self.weight = weight(w, BFLOAT16)

    def forward(self, op: OpBuilder, x: ir.Value) -> ir.Value:
        return round_bf16(op, torch_rms_norm(op, x, self.weight, self.eps))


def round_bf16_np(x: np.ndarray) -> np.ndarray:
    """bf16(x) on the host (NumPy), for export-time constants and tests."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
