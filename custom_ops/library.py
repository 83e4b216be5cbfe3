"""Locate the built custom-op library and create onnxruntime sessions with it registered."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from csa2onnx.custom_ops.build import LIBRARY_NAME, built_from_current_sources

DOMAIN = "csa2onnx"
DOMAIN_VERSION = 1
BUILD_COMMAND = "python custom_ops/build.py"
# The oldest onnxruntime csa2onnx is tested with (1.30, a lent machine's; 1.31.1, the newest
# onnxruntime-gpu; 1.32): versions differ where it matters (1.30 and 1.31 return an empty
# tensor unreduced from a reduction, graphs/numerics.py reduce_axis), so older ones are refused.
MIN_ONNXRUNTIME = (1, 30)
_DEFAULT_BUILD = Path(__file__).resolve().parent / "build"


class CustomOpLibraryError(RuntimeError):
    """The custom-op library is missing or older than its sources."""


def library_path(check_stale: bool = True) -> Path:
    """Path of libcsa2onnx_ops.so: `CSA2ONNX_OPS_LIBRARY`, else custom_ops/build/.

    A build records the digest of its sources; a mismatch means the sources changed since,
    and running the old binary would silently test old code, so it is an error.
    """
    override = os.environ.get("CSA2ONNX_OPS_LIBRARY")
    path = Path(override) if override else _DEFAULT_BUILD / LIBRARY_NAME
    if not path.is_file():
        raise CustomOpLibraryError(
            f"custom-op library not found at {path}; build it with `{BUILD_COMMAND}` "
            "(or run the README's setup command)"
        )
    if check_stale and not override and not built_from_current_sources(path.parent):
        raise CustomOpLibraryError(
            f"custom-op library {path} is stale (its sources changed since it was built); "
            f"rebuild it with `{BUILD_COMMAND}`"
        )
    return path


def check_onnxruntime(version: str = ort.__version__) -> None:
    """Refuse an onnxruntime older than MIN_ONNXRUNTIME, naming both."""
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if release < MIN_ONNXRUNTIME:
        need = ".".join(map(str, MIN_ONNXRUNTIME))
        raise RuntimeError(f"onnxruntime {version} is older than {need}, the oldest csa2onnx is "
                           f"tested with; pip install 'onnxruntime>={need}'")


def session_options(intra_op_num_threads: int = 0,
                    library: str | os.PathLike[str] | None = None) -> ort.SessionOptions:
    """SessionOptions with the custom-op library registered: this checkout's, or the build
    `library` names (benchmarks time two builds in one process)."""
    check_onnxruntime()
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library_path() if library is None else library))
    if intra_op_num_threads:
        options.intra_op_num_threads = intra_op_num_threads
    return options


def make_session(
    model: bytes | str | os.PathLike[str],
    providers: Sequence[str] = ("CPUExecutionProvider",),
    options: ort.SessionOptions | None = None,
) -> ort.InferenceSession:
    """An InferenceSession over `model` (serialized bytes or a path) with the ops registered."""
    if options is None:
        options = session_options()  # checks the onnxruntime version too
    else:
        check_onnxruntime()
    source = model if isinstance(model, bytes) else os.fspath(model)
    return ort.InferenceSession(source, sess_options=options, providers=list(providers))


def libm_cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf/sinf of float32 `angles`, evaluated by the C library as torch.polar does."""
    angles = np.ascontiguousarray(angles, dtype=np.float32)
    cos, sin = np.empty_like(angles), np.empty_like(angles)
    fn = ctypes.CDLL(str(library_path())).csa2onnx_cos_sin
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn(angles.ctypes.data, angles.size, cos.ctypes.data, sin.ctypes.data)
    return cos, sin


def torch_linear_dp_calls() -> int:
    """How many TorchLinear calls in this process ran on the vdpbf16ps path (the tests check
    that a case meant for it did not fall back to the fmaf tiles)."""
    fn = ctypes.CDLL(str(library_path())).csa2onnx_torch_linear_dp_calls
    fn.restype = ctypes.c_uint64
    fn.argtypes = []
    return int(fn())


def torch_linear_amx_calls() -> int:
    """How many TorchLinear calls in this process ran on AMX tiles (numerics "fast" on a CPU
    with AMX-BF16)."""
    fn = ctypes.CDLL(str(library_path())).csa2onnx_torch_linear_amx_calls
    fn.restype = ctypes.c_uint64
    fn.argtypes = []
    return int(fn())


SPARSE_ATTENTION_PAIR_COUNTS = ("pairs", "pv_fmaf", "fmaf")


def sparse_attention_pair_counts() -> dict[str, int]:
    """SparseAttention's exact vdpbf16ps tiles in this process, in blocks of 64 indices:
    logits and P @ V on vdpbf16ps; logits only (some bf16(p) too small); neither (q or the
    rows not bf16 values, or too small)."""
    fn = ctypes.CDLL(str(library_path())).csa2onnx_sparse_attention_pair_counts
    fn.restype = None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64]
    out = (ctypes.c_uint64 * len(SPARSE_ATTENTION_PAIR_COUNTS))()
    fn(out, len(SPARSE_ATTENTION_PAIR_COUNTS))
    return dict(zip(SPARSE_ATTENTION_PAIR_COUNTS, (int(v) for v in out), strict=True))


def indexer_score_pair_counts() -> dict[str, int]:
    """IndexerScore's paths with exact shortcuts in this process, in key blocks per query row:
    the avx512bf16 path's on vdpbf16ps ("pairs", blocks of 8 rows) and on fma ("fmaf": the
    row or the block not fit for them); the integer paths' (packed keys: AVX2, blocks of 4
    rows; AVX512-VNNI and AMX-INT8, blocks of 8) on integer dots ("int8") and on fma
    ("int8_fmaf"); of the "int8" ones, those on AMX-INT8 tiles ("amx") and, of those, the
    ones summed as merged values ("amx_merged": every block of a head and of a key within
    2^3 of its smallest)."""
    names = ("pairs", "fmaf", "int8", "int8_fmaf", "amx", "amx_merged")
    fn = ctypes.CDLL(str(library_path())).csa2onnx_indexer_score_pair_counts
    fn.restype = None
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64]
    out = (ctypes.c_uint64 * len(names))()
    fn(out, len(names))
    return dict(zip(names, (int(v) for v in out), strict=True))


FP8_LINEAR_COUNTS = ("calls", "small_tasks", "lane_sums", "row_sums", "wide_sums",
                     "fast_calls", "fast_amx_calls", "fp16_tasks", "folded_calls",
                     "tile_wide_rows")


def fp8_linear_counts() -> dict[str, int]:
    """Fp8Linear's counts in this process (the tests check that a case built for one of the
    kernel's exact fallbacks took it): calls; tasks on the few-rows path; W blocks that are
    not int16, summed against every row; (row, K block, 16 columns) summed in two digits;
    (row, K block, column) summed in int64; calls the fast kernel (numerics "fast") summed,
    and those of them on AMX tiles; few-rows tasks that converted W by AVX512-FP16; calls on
    the tiles (more than 4 rows) whose WScale let the AVX-512 tiles fold 2^(t_x - 18) into
    xs * ws (fp8_linear_kernels.h scales_fold); (row, K block, 64 columns) the AVX-512 tiles
    summed in two digits themselves (a block of X that is not int16: no row patches there)."""
    fn = ctypes.CDLL(str(library_path())).csa2onnx_fp8_linear_counts
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64]
    out = (ctypes.c_uint64 * len(FP8_LINEAR_COUNTS))()
    fn(out, len(FP8_LINEAR_COUNTS))
    return dict(zip(FP8_LINEAR_COUNTS, (int(v) for v in out), strict=True))


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them in /proc/cpuinfo (empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_isas() -> list[str]:
    """The kernels' instruction-set paths this CPU runs ("avx512bf16", "avx512", "avx2",
    "scalar"): values for CSA2ONNX_ISA, which forces every kernel onto one (all give the same
    bits; "avx512bf16" is the vdpbf16ps path of TorchLinear, SparseAttention and IndexerScore,
    the other kernels' avx512 one)."""
    flags = cpu_flags()
    v3 = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"} <= flags
    v4 = v3 and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags
    bf16 = v4 and "avx512_bf16" in flags
    return ["avx512bf16"] * bf16 + ["avx512"] * v4 + ["avx2"] * v3 + ["scalar"]
