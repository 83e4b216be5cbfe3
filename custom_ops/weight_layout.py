"""TorchLinear's packed weight layout, "panels64": W [N, K] stored the way the kernel reads it
(custom_ops/src/torch_linear_op.cc), so that a session uses the initializer in place and the
process holds no second copy of it.

The columns (outputs) go in panels of 64, zero-padded past N:
- bfloat16: [ceil(N/64), ceil(K/2), 64, 2]; element [p, i, c, h] is W[64p + c, 2i + h] (the
  k-pairs vdpbf16ps multiplies), and for an odd K the last pair's second half is zero;
- float32: [ceil(N/64), K, 64]; element [p, k, c] is W[64p + c, k].
A TorchLinear node reading such a W has weight_layout="panels64", out_features=N and
in_features=K; the default layout, "plain", is W itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from csa2onnx.custom_ops.constants import TORCH_LINEAR_PANEL

PLAIN = "plain"
PANELS64 = "panels64"
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def panels_shape(out_features: int, in_features: int, dtype: np.dtype) -> tuple[int, ...]:
    """The shape of a panels64 W for N = out_features, K = in_features."""
    panels = -(-out_features // TORCH_LINEAR_PANEL)
    if np.dtype(dtype) == BF16:
        return (panels, -(-in_features // 2), TORCH_LINEAR_PANEL, 2)
    if np.dtype(dtype) == F32:
        return (panels, in_features, TORCH_LINEAR_PANEL)
    raise ValueError(f"TorchLinear weights are bfloat16 or float32, got {np.dtype(dtype)}")


@dataclass(frozen=True)
class PackedWeight:
    """A TorchLinear weight [out_features, in_features] in the panels64 layout. `shape` and
    `ndim` are the weight's own ([N, K]), as np.shape / np.ndim read them.

    `panels` is the packed array, or None for a weight packed on demand from `plain`
    (`packed_later`): an export then packs each weight while writing it and never holds
    the packed copies of all of them at once."""

    panels: np.ndarray | None
    out_features: int
    in_features: int
    plain: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.panels is None:
            if self.plain is None or self.plain.shape != (self.out_features, self.in_features):
                raise ValueError("a PackedWeight packed on demand needs its plain weight "
                                 f"[{self.out_features}, {self.in_features}]")
            panels_shape(self.out_features, self.in_features, self.plain.dtype)  # dtype check
            return
        want = panels_shape(self.out_features, self.in_features, self.panels.dtype)
        if self.panels.shape != want:
            raise ValueError(f"a panels64 weight [{self.out_features}, {self.in_features}] "
                             f"({self.panels.dtype}) has shape {list(want)}, got "
                             f"{list(self.panels.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> np.dtype:
        return (self.plain if self.panels is None else self.panels).dtype

    @property
    def panels_shape(self) -> tuple[int, ...]:
        return panels_shape(self.out_features, self.in_features, self.dtype)

    def packed(self) -> np.ndarray:
        """The panels (packed now when packed on demand; the caller holds the only copy)."""
        return self.panels if self.panels is not None else pack_panels(self.plain).panels


def packed_later(w: np.ndarray) -> PackedWeight:
    """W [N, K] as a PackedWeight that packs when its panels are asked for."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"a TorchLinear weight is [N, K], got shape {list(w.shape)}")
    return PackedWeight(None, w.shape[0], w.shape[1], plain=w)


class PanelsLater(ir.LazyTensor):
    """A panels64 weight packed when its bytes are asked for (an export never holds the
    packed copies of all weights at once). `weight` is its source: each model an export
    builds wraps it anew, and export/shared_weights.py's ContentDigests knows them for one
    tensor by it (so that it is packed and hashed once per export)."""

    __slots__ = ("weight",)

    def __init__(self, weight: PackedWeight, dtype: ir.DataType) -> None:
        super().__init__(lambda: ir.tensor(weight.packed()), dtype=dtype,
                         shape=ir.Shape(weight.panels_shape))
        self.weight = weight


def pack_panels(w: np.ndarray) -> PackedWeight:
    """W [N, K] (bfloat16 or float32) in the panels64 layout: one new array, filled a panel
    at a time (no other full-size temporary)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"a TorchLinear weight is [N, K], got shape {list(w.shape)}")
    n, k = w.shape
    out = np.zeros(panels_shape(n, k, w.dtype), w.dtype)
    even = k - k % 2
    for p in range(out.shape[0]):
        block = w[p * TORCH_LINEAR_PANEL:(p + 1) * TORCH_LINEAR_PANEL]  # [cols, K]
        cols = block.shape[0]
        if w.dtype == BF16:
            out[p, :even // 2, :cols] = block[:, :even].reshape(cols, even // 2, 2).transpose(
                1, 0, 2)
            if k % 2:
                out[p, k // 2, :cols, 0] = block[:, k - 1]
        else:
            out[p, :, :cols] = block.T
    return PackedWeight(out, n, k)


def unpack_panels(packed: PackedWeight) -> np.ndarray:
    """The plain W [N, K] of a panels64 weight (for tests and tools)."""
    n, k = packed.shape
    p = packed.packed()
    rows = p.shape[0] * TORCH_LINEAR_PANEL
    if p.dtype == BF16:
        cols = p.transpose(0, 2, 1, 3).reshape(rows, 2 * p.shape[1])
    else:
        cols = p.transpose(0, 2, 1).reshape(rows, k)
    return np.ascontiguousarray(cols[:n, :k])
