"""The csa2onnx onnxruntime custom-op library (domain `csa2onnx`, version 1).

C++ kernels in `libcsa2onnx_ops.so` (README "The custom ops"):

- `Fp4QuantDequant`: the fp4 (e2m1) round trip over blocks of the last axis.
- `TorchTopK`: top-k along the last axis with torch CPU's tie order.
- `TorchLinear`: X·Wᵀ summed in torch CPU's order (W plain or in the kernel's panels; `groups`:
  several linears of one shape side by side in one node).
- `Fp8Linear`: act_quant fused with the block-scaled e4m3 GEMM of the fp8 checkpoint.
- `TorchRMSNorm`: RMSNorm with the mean summed in torch CPU's order.
- `SparseAttention`: the reference's sparse_attn, optionally over a packed cache.
- `IndexerScore`: the Indexer's scores, optionally over the packed index-key cache.
- `IndexerTopK`: IndexerScore ranked as TorchTopK (and BlockMax of it), without the scores.
- `RopeCosSin`: RoPE's freqs_cis rows at given positions, no table.
- `ApplyRope`: apply_rotary_emb on the last rope_head_dim features, then bf16 (in place
  when the runtime allows).
- `WriteRows`: cache rows written in place when the runtime binds the cache's buffer.
- `PackQuantized` / `UnpackQuantized`: state rows quantised and packed, and back.
- `BlockMax`: the max of each block of the last axis (candidate blocks' scores), in place.
- `CandidateMask`: the candidate source's mask from the blocks it picked, written once.

`library_path()` finds the build and `make_session()` creates sessions with it registered.
Importing this package registers the ops' ONNX schemas (`schemas.py`: types, attributes,
output shape inference) for onnx's shape inference and checker.
"""

from csa2onnx.custom_ops.library import (
    DOMAIN,
    DOMAIN_VERSION,
    CustomOpLibraryError,
    library_path,
    make_session,
    session_options,
)
from csa2onnx.custom_ops.schemas import OP_NAMES, register_schemas

register_schemas()

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "OP_NAMES",
    "CustomOpLibraryError",
    "library_path",
    "make_session",
    "register_schemas",
    "session_options",
]
