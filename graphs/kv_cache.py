"""Cache writes of the compressed layers (reference.md "Compressor", "Indexer", "Shared slots").

A kv source writes its new latents to its compressed-KV cache and an index-key owner its new
keys to its index-key cache, both at rows start_pos // r onwards; `n` new rows may be 0 (no
group completed). Which cache the shared `index_k` slot points to is the exporter's
business (export/layer.py: a publisher id carried between calls).
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.graphs.quant import fp4_e4m3
from csa2onnx.graphs.rope import apply_rotary_emb


def latent_to_cache_rows(op: OpBuilder, latent: ir.Value, cos_rows: ir.Value,
                         sin_rows: ir.Value, rope_head_dim: int) -> tuple[ir.Value, ir.Value]:
    """latent [b, n, hd] -> (after RoPE, after the e4m3-scaled fp4 round trip): the rows the
    compressed-KV cache stores. cos/sin rows are at the latents' group positions."""
    rotated = apply_rotary_emb(op, latent, cos_rows, sin_rows, rope_head_dim)
    return rotated, fp4_e4m3(op, rotated)


def cache_row_start(op: OpBuilder, start_pos: ir.Value, ratio: int) -> ir.Value:
    """start_pos // ratio as int64 [1]: where a call's new rows go."""
    if ratio < 1:
        raise ValueError(f"cache ratio must be >= 1, got {ratio}")
    return op.Div(op.Reshape(start_pos, [1]), ratio)  # start_pos >= 0: truncation is floor


def write_rows(op: OpBuilder, cache: ir.Value, new_rows: ir.Value,
               row_start: ir.Value) -> ir.Value:
    """cache [b, R, d] with rows row_start .. row_start+n-1 replaced by new_rows [b, n, d].

    Built from slices and one Concat, so n = 0 is a no-op and needs no special case.
    `row_start` is an int64 scalar or [1]; row_start + n must not exceed R.
    """
    start = op.Reshape(row_start, [1])
    end = op.Add(start, op.Slice(op.Shape(new_rows), [1], [2]))
    head = op.Slice(cache, [0], start, [1])
    tail = op.Slice(cache, end, [2**62], [1])
    return op.Concat(head, new_rows, tail, axis=1)
