"""The activation quantisers: fp8 act_quant (block 32, power-of-two scales) and the two
fp4 round trips (through the Fp4QuantDequant custom op)."""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops import constants
from csa2onnx.custom_ops.constants import PACKED_FORMATS
from csa2onnx.custom_ops.ops import fp4_quant_dequant, pack_quantized, unpack_quantized
from csa2onnx.graphs.numerics import FLOAT, reduce_axis, round_bf16

FP8_BLOCK = constants.FP8_BLOCK
FP8_MAX = 448.0
FP4_INDEX_BLOCK = 32  # indexer q and k: e8m0 scales
FP4_LATENT_BLOCK = 16  # compressed-KV latent: e4m3 scales


def pow2_ceil(op: OpBuilder, t: ir.Value) -> ir.Value:
    """Exactly 2^ceil(log2 t) for t > 0.

    A float log2 rounds 2^k * (1 + 2^-23) down to k, so the estimate can be off by one
    either way; one correction in each direction makes it exact.
    """
    p = op.Pow(2.0, op.Ceil(op.Div(op.Log(t), 0.6931471805599453)))
    p = op.Where(op.Less(p, t), op.Mul(p, 2.0), p)
    half = op.Mul(p, 0.5)
    return op.Where(op.GreaterOrEqual(half, t), half, p)


def _blocks(op: OpBuilder, x: ir.Value, block: int) -> ir.Value:
    """View x [..., d] as [..., d / block, block]."""
    lead = op.Slice(op.Shape(x), [0], [-1])
    return op.Reshape(x, op.Concat(lead, [-1, block], axis=0))


def act_quant(op: OpBuilder, x: ir.Value, block: int = FP8_BLOCK) -> ir.Value:
    """fp8 round trip: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(x / s)),
    result bf16(q * s)."""
    blocks = _blocks(op, x, block)
    amax = op.Max(reduce_axis(op, "Max", op.Abs(blocks), -1, keepdims=True), 1e-4)
    scale = pow2_ceil(op, op.Mul(amax, 1.0 / FP8_MAX))
    q = op.Clip(op.Div(blocks, scale), -FP8_MAX, FP8_MAX)
    q = op.Cast(op.Cast(q, to=ir.DataType.FLOAT8E4M3FN), to=FLOAT)
    return op.Reshape(round_bf16(op, op.Mul(q, scale)), op.Shape(x))


def fp4_e8m0(op: OpBuilder, x: ir.Value, block: int = FP4_INDEX_BLOCK,
             width: int | None = None) -> ir.Value:
    """fp4_act_quant(x, 32, inplace=True): e8m0 block scales (indexer q and k)."""
    return _fp4(op, x, block, "e8m0", width)


def fp4_e4m3(op: OpBuilder, x: ir.Value, block: int = FP4_LATENT_BLOCK,
             width: int | None = None) -> ir.Value:
    """fp4_act_quant(x, 16, inplace=True, scale_dtype=e4m3): the compressed-KV latent."""
    return _fp4(op, x, block, "e4m3", width)


def _fp4(op: OpBuilder, x: ir.Value, block: int, scale_format: str,
         width: int | None) -> ir.Value:
    """The round trip. Given x's last dimension (`width`, or a static shape) at a packed
    format's block, as Unpack(Pack(x)): the same bits in ~20x less time than
    Fp4QuantDequant (custom_ops/src/packed_quant.h)."""
    fmt = f"fp4_{scale_format}_{block}"
    if width is None and x.shape is not None and len(x.shape):
        width = x.shape[-1] if isinstance(x.shape[-1], int) else None
    if fmt not in PACKED_FORMATS or width is None:
        return fp4_quant_dequant(op, x, block, scale_format)
    return unpack_quantized(op, pack_quantized(op, x, fmt), fmt, width)
