"""The csa2onnx onnxruntime custom-op library (domain `csa2onnx`, version 1).

`Fp4QuantDequant`, `TorchTopK`, `TorchLinear`, `TorchRMSNorm`, `SparseAttention` and
`Fp8Linear` (act_quant fused with the block-scaled e4m3 GEMM of the fp8 checkpoint) and
`WriteRows` (cache rows written in place when the runtime binds the cache's buffer) and
`RopeCosSin` (RoPE's freqs_cis rows at given positions, no table) run as C++ kernels from
`libcsa2onnx_ops.so`;
`library_path()` finds the build and `make_session()` creates sessions with it registered.
"""

from csa2onnx.custom_ops.library import (
    DOMAIN,
    DOMAIN_VERSION,
    CustomOpLibraryError,
    library_path,
    make_session,
    session_options,
)

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "CustomOpLibraryError",
    "library_path",
    "make_session",
    "session_options",
]
