"""Constants the kernels and the Python side share, defined once here for Python; the C++
headers hold the same values and tests/test_kernel_constants.py reads them and checks."""

SPARSE_ATTENTION_BLOCK = 64  # the reference kernel's block of indices (sparse_attention.h kBlock)
# finite, so an all -1 row gives exp(sink + 1e30) = inf -> o = 0 (kRunningMaxInit)
SPARSE_ATTENTION_RUNNING_MAX_INIT = -1e30
FP8_BLOCK = 32  # act_quant and the fp8 linears' block (fp8_linear.h)
# IndexerScore's largest head dim: MLAS sums D <= 128 as one fma chain (indexer_score.h kMaxDim)
INDEXER_SCORE_MAX_DIM = 128
TORCH_LINEAR_PANEL = 64  # columns per panel of TorchLinear's packed W (torch_linear_op.cc kPanel)

# Packed state rows (custom_ops/src/packed_quant.h): format -> (block, codes per byte). A row
# of d values is d / codes_per_byte code bytes, then one scale byte per block.
PACKED_FORMATS = {
    "fp4_e4m3_16": (16, 2),  # compressed KV: fp4 e2m1, e4m3 scale per 16 (kFp4E4m3Block)
    "fp4_e8m0_32": (32, 2),  # index keys: fp4 e2m1, e8m0 scale per 32 (kFp4E8m0Block)
    "fp8_e8m0_32": (32, 1),  # window KV: act_quant's e4m3, e8m0 scale per 32 (kFp8E8m0Block)
}


def packed_row_bytes(fmt: str, d: int) -> int:
    """Bytes of one packed row of d values (d a multiple of the format's block)."""
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"unknown packed format {fmt!r} (expected one of "
                         f"{', '.join(PACKED_FORMATS)})")
    block, per_byte = PACKED_FORMATS[fmt]
    if d < 0 or d % block:
        raise ValueError(f"{fmt} packs blocks of {block} values: {d} is not a multiple")
    return d // per_byte + d // block
