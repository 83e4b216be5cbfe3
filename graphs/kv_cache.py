"""Cache writes of the compressed layers (reference.md "Compressor", "Indexer", "Shared slots").

A kv source writes its new latents to its compressed-KV cache and an index-key owner its new
keys to its index-key cache, both at rows start_pos // r onwards; `n` new rows may be 0 (no
group completed). Which cache the shared `index_k` slot points to is the exporter's
business (export/layer.py: a publisher id carried between calls). Writes are in place
when the runtime binds a cache's past input and present output to one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops.ops import pack_quantized
from csa2onnx.custom_ops.ops import write_rows as custom_write_rows
from csa2onnx.graphs.rope import apply_rotary_emb

# What the state holds is quantised, so it is stored packed (custom_ops PackQuantized):
# the compressed-KV rows' fp4 with e4m3 scales per 16, the index keys' fp4 with e8m0 scales
# per 32, the window's act_quant fp8 (e4m3 with an e8m0 scale per 32). Unpacking gives the
# round trips' values exactly.
COMPRESSED_KV_FORMAT = "fp4_e4m3_16"
INDEX_KEY_FORMAT = "fp4_e8m0_32"
WINDOW_FORMAT = "fp8_e8m0_32"


def latent_to_cache_rows(op: OpBuilder, latent: ir.Value, cos_rows: ir.Value,
                         sin_rows: ir.Value, rope_head_dim: int) -> tuple[ir.Value, ir.Value]:
    """latent [b, n, hd] -> (after RoPE, its e4m3-scaled fp4 packed): the rows the
    compressed-KV cache stores. cos/sin rows are at the latents' group positions."""
    rotated = apply_rotary_emb(op, latent, cos_rows, sin_rows, rope_head_dim)
    return rotated, pack_quantized(op, rotated, COMPRESSED_KV_FORMAT)


def cache_row_start(op: OpBuilder, start_pos: ir.Value, ratio: int) -> ir.Value:
    """start_pos // ratio as int64 [1]: where a call's new rows go."""
    if ratio < 1:
        raise ValueError(f"cache ratio must be >= 1, got {ratio}")
    return op.Div(op.Reshape(start_pos, [1]), ratio)  # start_pos >= 0: truncation is floor


def write_rows(op: OpBuilder, cache: ir.Value, new_rows: ir.Value, row_start: ir.Value,
               after: Sequence[ir.Value] = ()) -> ir.Value:
    """cache [b, R, w] with rows row_start .. row_start+n-1 replaced by new_rows [b, n, w]
    (float32, or uint8 packed rows).

    One WriteRows node: n = 0 is a no-op, and the write is in place (O(n)) when the runtime
    binds the output to the cache's buffer. `row_start` is an int64 scalar or [1];
    row_start + n must not exceed R. `after`: values read from the old cache that must be
    computed before the write (see custom_ops.ops.write_rows).
    """
    return custom_write_rows(op, cache, new_rows, row_start, after)
