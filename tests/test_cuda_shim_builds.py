"""The CUDA test shim (tests/cuda/kernels_shim.cu) compiles wherever nvcc is, GPU or not: it
calls the kernels' launchers, so a launcher whose signature changes breaks it here, not
only on the device machine (tests/test_cuda_kernels.py builds and runs it there)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

SHIM = Path(__file__).resolve().parent / "cuda" / "kernels_shim.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_shim_compiles_against_the_launchers(tmp_path: Path) -> None:
    from csa2onnx.custom_ops.build import find_ort_headers

    done = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", "-Xcompiler", "-fPIC",
                           f"-I{ROOT / 'custom_ops' / 'src'}", f"-I{find_ort_headers()}", "-c",
                           str(SHIM), "-o", str(tmp_path / "shim.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
