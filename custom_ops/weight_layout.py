"""TorchLinear's packed weight layout, "panels64": W [N, K] stored the way the kernel reads it
(custom_ops/src/torch_linear_op.cc), so that a session uses the initializer in place and the
process holds no second copy of it.

The columns (outputs) go in panels of 64, zero-padded past N:
- bfloat16: [ceil(N/64), ceil(K/2), 64, 2]; element [p, i, c, h] is W[64p + c, 2i + h] (the
  k-pairs vdpbf16ps multiplies), and for an odd K the last pair's second half is zero;
- float32: [ceil(N/64), K, 64]; element [p, k, c] is W[64p + c, k].
A TorchLinear node reading such a W has weight_layout="panels64", out_features=N and
in_features=K; the default layout, "plain", is W itself.

A grouped W (TorchLinear's `groups` G: G linears of one shape [N, K], plain [G*N, K]) holds
each group's panels in turn, [G*ceil(N/64), ...]: group g's are panels g*ceil(N/64) on, its
own padding after its N columns.

Fp8Linear's layout "pairs16" (custom_ops/src/fp8_linear_kernels.h says why): an e4m3 W
[N, K], N a multiple of 16, as [N/16, K/32, 512]: each group of 16 columns' K block one
run of 512 codes, code (16g + 4l + c, 32kb + 2(2z + h) + kp) at [g, kb, 64z + 16l + 8h +
2c + kp], i.e. the axes (g, l, c) x (kb, z, h, kp) of W reordered to (g, kb, z, l, h, c, kp).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from csa2onnx.custom_ops.constants import FP8_BLOCK, TORCH_LINEAR_PANEL

PLAIN = "plain"
PANELS64 = "panels64"
PAIRS16 = "pairs16"
PAIRS16_COLUMNS = 16  # columns of a pairs16 group
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def panels_shape(out_features: int, in_features: int, dtype: np.dtype,
                 groups: int = 1) -> tuple[int, ...]:
    """The shape of a panels64 W of `groups` groups of N = out_features, K = in_features."""
    panels = groups * -(-out_features // TORCH_LINEAR_PANEL)
    if np.dtype(dtype) == BF16:
        return (panels, -(-in_features // 2), TORCH_LINEAR_PANEL, 2)
    if np.dtype(dtype) == F32:
        return (panels, in_features, TORCH_LINEAR_PANEL)
    raise ValueError(f"TorchLinear weights are bfloat16 or float32, got {np.dtype(dtype)}")


@dataclass(frozen=True)
class PackedWeight:
    """A TorchLinear weight [out_features, in_features] in the panels64 layout, or `groups`
    of them (a group's N and K; plain [G*N, K]). `shape` and `ndim` are the plain weight's
    ([G*N, K]), as np.shape / np.ndim read them.

    `panels` is the packed array, or None for a weight packed on demand from `plain`
    (`packed_later`): an export then packs each weight while writing it and never holds
    the packed copies of all of them at once."""

    panels: np.ndarray | None
    out_features: int
    in_features: int
    plain: np.ndarray | None = None
    groups: int = 1

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"a PackedWeight has groups >= 1, got {self.groups}")
        if self.panels is None:
            if self.plain is None or self.plain.shape != self.shape:
                raise ValueError("a PackedWeight packed on demand needs its plain weight "
                                 f"{list(self.shape)}")
            panels_shape(self.out_features, self.in_features, self.plain.dtype)  # dtype check
            return
        want = self.panels_shape_of(self.panels.dtype)
        if self.panels.shape != want:
            raise ValueError(f"a panels64 weight {list(self.shape)} in {self.groups} group(s) "
                             f"({self.panels.dtype}) has shape {list(want)}, got "
                             f"{list(self.panels.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.groups * self.out_features, self.in_features)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> np.dtype:
        return (self.plain if self.panels is None else self.panels).dtype

    @property
    def panels_shape(self) -> tuple[int, ...]:
        return self.panels_shape_of(self.dtype)

    def panels_shape_of(self, dtype: np.dtype) -> tuple[int, ...]:
        return panels_shape(self.out_features, self.in_features, dtype, self.groups)

    def packed(self) -> np.ndarray:
        """The panels (packed now when packed on demand; the caller holds the only copy)."""
        if self.panels is not None:
            return self.panels
        return pack_panels(self.plain, self.groups).panels


def _group_rows(w: np.ndarray, groups: int) -> int:
    """N of W [G*N, K] in `groups` groups (W checked)."""
    if w.ndim != 2:
        raise ValueError(f"a TorchLinear weight is [N, K], got shape {list(w.shape)}")
    if groups < 1 or w.shape[0] % groups:
        raise ValueError(f"groups ({groups}) must be >= 1 and divide the weight's rows "
                         f"({w.shape[0]})")
    return w.shape[0] // groups


def packed_later(w: np.ndarray, groups: int = 1) -> PackedWeight:
    """W [N, K] (or `groups` of them, [G*N, K]) as a PackedWeight that packs when its panels
    are asked for."""
    w = np.asarray(w)
    return PackedWeight(None, _group_rows(w, groups), w.shape[1], plain=w, groups=groups)


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


def pack_panels(w: np.ndarray, groups: int = 1) -> PackedWeight:
    """W [N, K] (bfloat16 or float32), or `groups` of them ([G*N, K]), in the panels64
    layout: one new array, filled a panel at a time (no other full-size temporary)."""
    w = np.asarray(w)
    n, k = _group_rows(w, groups), w.shape[1]
    out = np.zeros(panels_shape(n, k, w.dtype, groups), w.dtype)
    per_group = out.shape[0] // groups
    even = k - k % 2
    for p in range(out.shape[0]):
        g, q = divmod(p, per_group)  # group g's panel q
        block = w[g * n + q * TORCH_LINEAR_PANEL:g * n + min(n, (q + 1) * TORCH_LINEAR_PANEL)]
        cols = block.shape[0]  # [cols, K]
        if w.dtype == BF16:
            out[p, :even // 2, :cols] = block[:, :even].reshape(cols, even // 2, 2).transpose(
                1, 0, 2)
            if k % 2:
                out[p, k // 2, :cols, 0] = block[:, k - 1]
        else:
            out[p, :, :cols] = block.T
    return PackedWeight(out, n, k, groups=groups)


def unpack_panels(packed: PackedWeight) -> np.ndarray:
    """The plain W [G*N, K] of a panels64 weight (for tests and tools)."""
    n, k, groups = packed.out_features, packed.in_features, packed.groups
    p = packed.packed()
    if p.size == 0:
        return np.zeros((groups * n, k), p.dtype)
    rows = p.shape[0] * TORCH_LINEAR_PANEL  # every group's columns, padding included
    if p.dtype == BF16:
        cols = p.transpose(0, 2, 1, 3).reshape(rows, 2 * p.shape[1])
    else:
        cols = p.transpose(0, 2, 1).reshape(rows, k)
    return np.ascontiguousarray(cols.reshape(groups, rows // groups, -1)[:, :n, :k]
                                .reshape(groups * n, k))


def pairs16_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape of an e4m3 W [N, K] in the pairs16 layout (N a multiple of 16, K of 32)."""
    if out_features % PAIRS16_COLUMNS or in_features % FP8_BLOCK:
        raise ValueError(f"a pairs16 weight needs N a multiple of {PAIRS16_COLUMNS} and K of "
                         f"{FP8_BLOCK}, got [{out_features}, {in_features}]")
    return (out_features // PAIRS16_COLUMNS, in_features // FP8_BLOCK, 512)


def pack_pairs16(w: np.ndarray) -> np.ndarray:
    """W [N, K] (any dtype; the artifact's is float8_e4m3fn) in the pairs16 layout: one new
    array."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"an fp8 weight is [N, K], got shape {list(w.shape)}")
    g, kb, run = pairs16_shape(*w.shape)
    axes = w.reshape(g, 4, 4, kb, 8, 2, 2)  # (g, l, c, kb, z, h, kp)
    return np.ascontiguousarray(axes.transpose(0, 3, 4, 1, 5, 2, 6)).reshape(g, kb, run)


def unpack_pairs16(p: np.ndarray) -> np.ndarray:
    """The plain W [N, K] of a pairs16 weight (for tests and tools)."""
    p = np.asarray(p)
    if p.ndim != 3 or p.shape[2] != 512:
        raise ValueError(f"a pairs16 weight is [N/16, K/32, 512], got shape {list(p.shape)}")
    g, kb = p.shape[:2]
    axes = p.reshape(g, kb, 8, 4, 2, 4, 2)  # (g, kb, z, l, h, c, kp)
    return np.ascontiguousarray(axes.transpose(0, 3, 5, 1, 2, 4, 6)).reshape(
        g * PAIRS16_COLUMNS, kb * FP8_BLOCK)


class Pairs16Later(ir.LazyTensor):
    """An e4m3 weight laid out as pairs16 when its bytes are asked for (an export never
    holds the permuted copies of all weights at once). `plain` is its source [N, K], which
    export/shared_weights.py's ContentDigests knows it by."""

    __slots__ = ("plain",)

    def __init__(self, plain: np.ndarray) -> None:
        super().__init__(lambda: ir.tensor(pack_pairs16(plain)), dtype=ir.DataType.FLOAT8E4M3FN,
                         shape=ir.Shape(pairs16_shape(*plain.shape)))
        self.plain = plain
