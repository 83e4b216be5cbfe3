"""The CUDA kernels themselves (Fp8Linear's and Fp4QuantDequant's) on an NVIDIA GPU, bit for
bit against the NumPy definitions (custom_ops/reference.py) and the unit goldens, without a
CUDA build of onnxruntime: tests/cuda/kernels_shim.cu calls the kernels' launchers from C,
built here with nvcc, each .cu with the flags custom_ops/CMakeLists.txt gives it.
tests/test_ops_cuda.py runs the same kernels inside onnxruntime's CUDA provider.

Skips without nvcc or an NVIDIA GPU, unless CSA2ONNX_REQUIRE_GPU=1 (then it fails)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import GOLDENS, ROOT, cast_pair, hard_values
from test_fp8_linear import (
    assert_same,
    defined_case,
    edge_case,
    nan_inf_case,
    random_case,
    values,
)

from csa2onnx.custom_ops.reference import fp4_round_trip, fp8_linear

SHIM = Path(__file__).resolve().parent / "cuda" / "kernels_shim.cu"
SRC = ROOT / "custom_ops" / "src"
# (source, nvcc flags beyond the common ones): as custom_ops/CMakeLists.txt compiles them
SOURCES = [(SHIM, []), (SRC / "fp8_linear_cuda.cu", ["--fmad=false"]), (SRC / "fp4_cuda.cu", [])]


def _why_not_runnable() -> str | None:
    if shutil.which("nvcc") is None:
        return "nvcc not found: needed to build tests/cuda/kernels_shim.cu"
    smi = shutil.which("nvidia-smi")
    listed = smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
    if not listed or "GPU" not in listed:
        return "no NVIDIA GPU (nvidia-smi -L lists none)"
    return None


REASON = _why_not_runnable()
if REASON and os.environ.get("CSA2ONNX_REQUIRE_GPU") == "1":
    raise RuntimeError(f"CSA2ONNX_REQUIRE_GPU=1 but the CUDA kernel tests cannot run: {REASON}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def build_shim(folder: Path) -> ctypes.CDLL:
    """Compile the shim and the two kernel files for this machine's GPU and load them."""
    from csa2onnx.custom_ops.build import find_ort_headers  # fp4_cuda.cu names Ort::BFloat16_t

    common = ["nvcc", "-O3", "-std=c++17", "-arch=native", "-Xcompiler", "-fPIC",
              f"-I{SRC}", f"-I{find_ort_headers()}"]
    objects = []
    for source, flags in SOURCES:
        objects.append(folder / (source.stem + ".o"))
        subprocess.run([*common, *flags, "-c", str(source), "-o", str(objects[-1])],
                       check=True, capture_output=True, text=True)
    library = folder / "libcsa_cuda_shim.so"
    subprocess.run(["nvcc", "-shared", "-arch=native", *map(str, objects), "-o", str(library)],
                   check=True, capture_output=True, text=True)
    shim = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    shim.csa_fp8_linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int,
                                    ctypes.c_int, ptr, ptr, i64]
    shim.csa_fp4_round_trip.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ctypes.c_int,
                                        ptr, i64]
    return shim


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = build_shim(tmp_path_factory.mktemp("cuda_shim"))
    assert lib.csa_cuda_device_count() > 0, "nvidia-smi lists a GPU but CUDA sees none"
    return lib


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def _call(fn, *args) -> None:
    err = ctypes.create_string_buffer(512)
    assert fn(*args, err, len(err)) == 0, err.value.decode()


def fp8_linear_cuda(shim: ctypes.CDLL, x: np.ndarray, codes: np.ndarray, w_scale: np.ndarray,
                    reps: int = 1, round_output: bool = False) -> tuple[np.ndarray, float]:
    """Y of the CUDA kernel (through bf16 with `round_output`), and the mean ms of one
    launch over `reps`."""
    x, codes = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(codes, np.uint8)
    w_scale = np.ascontiguousarray(w_scale, np.float32)
    (m, k), n = x.shape, codes.shape[0]
    assert codes.shape == (n, k) and w_scale.shape == (-(-n // 32), k // 32)
    y = np.empty((m, n), np.float32)
    ms = ctypes.c_float(0.0)
    _call(shim.csa_fp8_linear, *map(_address, (x, codes, w_scale, y)), m, n, k,
          int(round_output), reps, ctypes.addressof(ms))
    return y, ms.value


def fp4_cuda(shim: ctypes.CDLL, x: np.ndarray, block: int, fmt: str, bf16: bool,
             with_scales: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """(y as float32, scales) of the CUDA kernel; bf16: x (bf16-valued) goes in as bf16."""
    x = np.ascontiguousarray(x, np.float32)
    assert x.shape[-1] % block == 0
    nblocks = x.size // block
    data = (x.view(np.uint32) >> 16).astype(np.uint16) if bf16 else x
    out = np.empty_like(data)
    scales = np.empty((*x.shape[:-1], x.shape[-1] // block), np.float32) if with_scales else None
    _call(shim.csa_fp4_round_trip, int(bf16), _address(data), _address(out), _address(scales),
          nblocks, block, {"e8m0": 0, "e4m3": 1}[fmt])
    y = (out.astype(np.uint32) << 16).view(np.float32) if bf16 else out
    return y, scales


# ------------------------------------------------------------------------------ Fp8Linear
FP8_SHAPES = [  # (M, N, K): one block to 8192, N off the 256-column thread blocks and the
    (1, 40, 32), (2, 1000, 64), (4, 40, 256), (3, 7, 8192), (1, 1000, 1280),  # 32-row
    (5, 33, 96), (130, 65, 96), (11, 1, 64), (17, 257, 1056), (64, 512, 4096),  # scale
    (1, 5120, 8192),  # panels, K past the 32-block shared-memory chunk; released dims
]


@pytest.mark.parametrize(("m", "n", "k"), FP8_SHAPES)
def test_fp8_linear_matches_the_numpy_definition(shim, m: int, n: int, k: int) -> None:
    x, codes, w_scale, want = defined_case(m, n, k)
    assert_same(fp8_linear_cuda(shim, x, codes, w_scale)[0], want)


def test_fp8_linear_edge_inputs(shim) -> None:
    """Amax floor, e4m3 subnormals, saturation, huge spreads, signed zeros, near-max floats,
    a zero weight scale (test_fp8_linear's CPU case)."""
    x, codes, w_scale, want = edge_case()
    assert_same(fp8_linear_cuda(shim, x, codes, w_scale)[0], want)


def test_fp8_linear_nan_and_inf(shim) -> None:
    x, codes, w_scale, want = nan_inf_case()
    assert_same(fp8_linear_cuda(shim, x, codes, w_scale)[0], want)


def test_fp8_linear_round_output_is_the_cast_pair(shim) -> None:
    """round_output: onnxruntime's Cast pair of the unrounded Y, bit for bit (ort_cast.h's
    rule in the kernel's store), NaN and inf rows and a NaN column included."""
    for x, codes, w_scale, _ in (nan_inf_case(), defined_case(130, 65, 96)):
        unrounded = fp8_linear_cuda(shim, x, codes, w_scale)[0]
        rounded = fp8_linear_cuda(shim, x, codes, w_scale, round_output=True)[0]
        np.testing.assert_array_equal(rounded.view(np.uint32),
                                      cast_pair(unrounded).view(np.uint32))


def test_fp8_linear_rows_past_one_grid(shim) -> None:
    """More rows than the launch's 65535 grid rows: each grid row loops over several."""
    rng = np.random.default_rng(29)
    x, codes, w_scale = random_case(rng, 70_001, 33, 64)
    assert_same(fp8_linear_cuda(shim, x, codes, w_scale)[0], fp8_linear(x, values(codes), w_scale))


def test_fp8_linear_empty_shapes(shim) -> None:
    rng = np.random.default_rng(31)
    x, codes, w_scale = random_case(rng, 3, 40, 64)
    assert fp8_linear_cuda(shim, x[:0], codes, w_scale)[0].shape == (0, 40)
    assert fp8_linear_cuda(shim, x, codes[:0], w_scale[:0])[0].shape == (3, 0)


# ------------------------------------------------------------------------ Fp4QuantDequant
GOLDEN_TAGS = [("e8m0_b32.grid_ties", 32, "e8m0"), ("e8m0_b32.edge", 32, "e8m0"),
               ("e4m3_b16.grid_ties", 16, "e4m3"), ("e4m3_b16.edge", 16, "e4m3")]


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("tag", "block", "fmt"), GOLDEN_TAGS)
def test_fp4_matches_unit_goldens(shim, tag: str, block: int, fmt: str, bf16: bool) -> None:
    with np.load(GOLDENS / "unit_kernels.npz") as unit:
        x, want_y, want_scale = (unit[f"fp4.{tag}.{name}"] for name in
                                 ("input", "output", "scale"))
    y, scale = fp4_cuda(shim, x, block, fmt, bf16)
    np.testing.assert_array_equal(y.view(np.uint32), want_y.view(np.uint32))
    np.testing.assert_array_equal(scale, want_scale)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("block", "fmt"), [(32, "e8m0"), (16, "e4m3"), (128, "e8m0"),
                                            (1, "e4m3")])
def test_fp4_matches_the_numpy_definition(shim, block: int, fmt: str, bf16: bool) -> None:
    x = hard_values(np.random.default_rng(block), 2048, 512)  # every binade, NaN, +-inf
    want_y, want_scale = fp4_round_trip(x, block, fmt)
    y, scale = fp4_cuda(shim, x, block, fmt, bf16)
    assert_same(y, want_y)
    assert_same(scale, want_scale)
    assert np.isnan(want_y).any() and not np.isnan(want_y).all()
    y_only, none = fp4_cuda(shim, x, block, fmt, bf16, with_scales=False)
    assert none is None
    assert_same(y_only, want_y)
