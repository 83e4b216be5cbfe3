"""The reference's arithmetic building blocks: bf16 rounding, Linear, RMSNorm.

Activations travel as float32 tensors holding bf16 values (onnxruntime's CPU provider has
almost no bf16 kernels); `round_bf16` is placed exactly where the reference rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder, nn

from csa2onnx.custom_ops.ops import fp8_linear, torch_linear, torch_rms_norm
from csa2onnx.custom_ops.ops import round_bf16 as round_bf16  # the graphs' one rounding helper
from csa2onnx.custom_ops.weight_layout import (
    PAIRS16,
    PLAIN,
    PackedWeight,
    Pairs16Later,
    PanelsLater,
)

FLOAT = ir.DataType.FLOAT
BFLOAT16 = ir.DataType.BFLOAT16
INT64 = ir.DataType.INT64


def weight(values: np.ndarray, dtype: ir.DataType) -> nn.Parameter:
    """A parameter stored as `dtype` (bf16 weights stay bf16 in the artifact)."""
    if dtype == BFLOAT16:  # stored bf16 arrays are taken as they are (no f32 detour)
        data = (np.ascontiguousarray(values) if values.dtype == ml_dtypes.bfloat16
                else np.asarray(values, np.float32).astype(ml_dtypes.bfloat16))
    else:
        data = np.ascontiguousarray(values, np.float32)
    return nn.Parameter(data.shape, data=ir.tensor(data))


def reduce_axis(op: OpBuilder, reduction: str, x: ir.Value, axis: int, *,
                keepdims: bool = False) -> ir.Value:
    """op.Reduce<reduction> of x over one axis, its output shape pinned by a Reshape:
    onnxruntime 1.30 and 1.31 (1.31 is the newest onnxruntime-gpu) return an empty x
    unreduced, and a call that completes no compressed group reduces empty tensors. The
    reduced axis itself must not be empty (an empty x then gives an empty output)."""
    y = getattr(op, f"Reduce{reduction}")(x, [axis], keepdims=int(keepdims))
    parts = [op.Shape(x, end=axis)] if axis != 0 else []
    if keepdims:
        parts.append(op.Constant(value_ints=[1]))
    if axis != -1:
        parts.append(op.Shape(x, start=axis + 1))
    return op.Reshape(y, op.Concat(*parts, axis=0), allowzero=1)


def as_float(op: OpBuilder, w: ir.Value) -> ir.Value:
    return w if w.dtype == FLOAT else op.Cast(w, to=FLOAT)


class Linear(nn.Module):
    """y = bf16(x @ W^T), float32 accumulation, one rounding (W: [out, in], bf16); `rounded`
    False leaves y in float32. W is an array, or a PackedWeight: stored in TorchLinear's
    panels64 layout, which the kernel reads in place (the exporter packs every weight so).
    `groups` G: G linears of one shape side by side (W [G*out, in], x [..., G*in] -> y
    [..., G*out]; a PackedWeight of G groups), one TorchLinear node."""

    def __init__(self, w: np.ndarray | PackedWeight, dtype: ir.DataType = BFLOAT16,
                 name: str | None = None, *, rounded: bool = True, groups: int = 1) -> None:
        super().__init__(name)
        if np.ndim(w) != 2:
            raise ValueError(f"Linear weight must be [out, in], got shape {np.shape(w)}")
        rows, self.in_features = np.shape(w)
        if groups < 1 or rows % groups:
            raise ValueError(f"Linear groups ({groups}) must be >= 1 and divide the weight's "
                             f"rows ({rows})")
        self.out_features, self.groups = rows // groups, groups  # a group's
        self.rounded = rounded
        self.packed = isinstance(w, PackedWeight)
        if isinstance(w, PackedWeight):
            if w.groups != groups:
                raise ValueError(f"a packed Linear weight of {w.groups} group(s) given for "
                                 f"{groups}")
            want = ml_dtypes.bfloat16 if dtype == BFLOAT16 else np.float32
            if w.dtype != want:
                raise ValueError(f"a packed Linear weight must be {np.dtype(want)}, got "
                                 f"{w.dtype}")
            data = ir.tensor(w.panels) if w.panels is not None else PanelsLater(w, dtype)
            self.weight = nn.Parameter(w.panels_shape, data=data)
        else:
            self.weight = weight(w, dtype)

    def forward(self, op: OpBuilder, x: ir.Value) -> ir.Value:
        panels = (self.out_features, self.in_features) if self.packed else None
        return torch_linear(op, x, self.weight, panels=panels, rounded=self.rounded,
                            groups=self.groups)


@dataclass(frozen=True)
class Fp8Weight:
    """A Linear weight as the released checkpoint stores it: e4m3 values [N, K] and one
    ue8m0 scale per [32, 32] block, [ceil(N/32), K/32] float32 powers of two. `layout`:
    how the graph stores the values (custom_ops/weight_layout.py: plain, or pairs16, laid
    out when the initializer's bytes are written)."""

    values: np.ndarray  # ml_dtypes.float8_e4m3fn
    scale: np.ndarray
    layout: str = PLAIN

    @property
    def shape(self) -> tuple[int, ...]:  # np.shape / np.ndim read these
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim


class Fp8Linear(nn.Module):
    """The fp8 linear of reference.md ("fp8 linears"): act_quant(x) fused with the
    block-scaled e4m3 GEMM, rounded once to bf16. The weights stay fp8 (1 byte each)."""

    def __init__(self, w: Fp8Weight, name: str | None = None) -> None:
        super().__init__(name)
        if w.values.dtype != ml_dtypes.float8_e4m3fn or w.values.ndim != 2:
            raise ValueError(f"an fp8 Linear weight must be float8_e4m3fn [out, in], got "
                             f"{w.values.dtype} {w.values.shape}")
        self.out_features, self.in_features = w.values.shape
        blocks = (-(-self.out_features // 32), -(-self.in_features // 32))
        if w.scale.shape != blocks:
            raise ValueError(f"an fp8 Linear scale must be {list(blocks)} for a weight "
                             f"{list(w.values.shape)}, got {list(w.scale.shape)}")
        if w.layout not in (PLAIN, PAIRS16):
            raise ValueError(f"an fp8 Linear weight's layout is {PLAIN} or {PAIRS16}, got "
                             f"{w.layout!r}")
        self.pairs16 = w.layout == PAIRS16
        data = Pairs16Later(w.values) if self.pairs16 else ir.tensor(w.values)
        self.weight = nn.Parameter(data.shape, data=data)
        self.scale = weight(w.scale, FLOAT)

    def forward(self, op: OpBuilder, x: ir.Value) -> ir.Value:
        return fp8_linear(op, x, self.weight, self.scale, rounded=True, pairs16=self.pairs16)


TorchWeight = np.ndarray | PackedWeight  # a TorchLinear weight, plain or packed
Weight = TorchWeight | Fp8Weight  # a Linear weight: bf16 values, or the checkpoint's fp8


def linear(w: Weight) -> Linear | Fp8Linear:
    """The reference's `linear()`: the weight's format picks the GEMM."""
    return Fp8Linear(w) if isinstance(w, Fp8Weight) else Linear(w)


class LinearF32(Linear):
    """F.linear on float32 input and float32 weights, no rounding (the ratio > 1 compressor)."""

    def __init__(self, w: np.ndarray | PackedWeight, name: str | None = None) -> None:
        super().__init__(w, FLOAT, name, rounded=False)


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
        return torch_rms_norm(op, x, self.weight, self.eps, rounded=True)


def round_bf16_np(x: np.ndarray) -> np.ndarray:
    """bf16(x) on the host (NumPy), for export-time constants and tests."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
