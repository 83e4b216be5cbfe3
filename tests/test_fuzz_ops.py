"""The custom ops under AddressSanitizer + UBSan (tools/fuzz_ops.py): ~1,500 random cases of
every custom op (Fp4QuantDequant, TorchTopK, Fp8Linear with W constant or fed,
SparseAttention with packed caches and indices in and out of range, WriteRows,
PackQuantized, UnpackQuantized, TorchLinear plain and panels64 with groups, IndexerScore with
float and packed keys, ApplyRope, RopeCosSin, TorchRMSNorm), on every forced instruction-set
path this CPU has, valid and invalid, must give no crash, sanitizer report, wrong shape or
wrong value (SparseAttention, TorchLinear, IndexerScore and ApplyRope against their own
definition paths; the others against NumPy definitions, the C library's cosf/sinf, or, for
TorchRMSNorm, a float64 evaluation to 1e-5).

The sanitizer build (custom_ops/build-asan, -O1) takes ~95 s the first time on 2 cores (AVX2
AMD EPYC); the cases ~60 s. Cases run in a subprocess with the sanitizer runtimes preloaded,
so a report kills that process, not pytest.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT, load_module

from csa2onnx.custom_ops.build import STAMP_NAME

TOOL = ROOT / "tools" / "fuzz_ops.py"


def load_tool() -> ModuleType:
    return load_module(TOOL, "fuzz_ops", register=True)


@pytest.fixture(scope="module")
def asan_library() -> Path:
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found: needed to build the sanitizer library")
    fuzz_ops = load_tool()
    if fuzz_ops.sanitizer_runtimes() is None:
        pytest.skip("g++ has no libasan.so/libubsan.so (install the compiler's sanitizer "
                    "runtimes, e.g. Debian's libasan8 and libubsan1)")
    return fuzz_ops.build_asan_library()


def run_tool(*args: str, timeout: float) -> tuple[int, str, dict[str, int]]:
    run = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    output = run.stdout + run.stderr
    summary = re.search(r"cases=(\d+) findings=(\d+)", run.stdout)
    assert summary, output[-4000:]
    return run.returncode, output, {"cases": int(summary[1]), "findings": int(summary[2])}


def test_a_stale_sanitizer_library_is_refused(tmp_path: Path) -> None:
    # A library built before the kernels changed would fuzz the old kernels and pass.
    fuzz_ops = load_tool()
    if fuzz_ops.sanitizer_runtimes() is None:
        pytest.skip("g++ has no libasan.so/libubsan.so")
    library = tmp_path / fuzz_ops.LIBRARY_NAME
    library.write_bytes(b"__asan_report __ubsan_handle")  # looks instrumented
    for stamp in ("0" * 64, None):  # another build's digest, and none at all
        if stamp is None:
            (tmp_path / STAMP_NAME).unlink()
        else:
            (tmp_path / STAMP_NAME).write_text(stamp + "\n")
        run = subprocess.run([sys.executable, str(TOOL), "--library", str(library)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2 and "is stale" in run.stderr, run.stdout + run.stderr


def test_sanitizer_reports_are_caught(asan_library: Path) -> None:
    # Without this, "0 findings" could just mean the sanitizer never ran.
    rc, output, counts = run_tool("--self-test", "--library", str(asan_library), timeout=120)
    assert counts == {"cases": 1, "findings": 1}, output[-4000:]
    assert "heap-buffer-overflow" in output and rc == 1, output[-4000:]


def test_fuzz_cases_find_nothing(asan_library: Path) -> None:
    rc, output, counts = run_tool("--cases", "1500", "--seed", "2026", "--omit-inputs", "--library",
                                  str(asan_library), timeout=600)
    assert counts["findings"] == 0, f"{counts['findings']} findings:\n" + output[-6000:]
    assert counts["cases"] == 1500 and rc == 0, output[-4000:]
    outcomes = re.search(r"outcomes: (\{.*\})", output)
    assert outcomes, output[-4000:]
    # every op ran cases that passed and cases that it refused
    for op in ("fp4", "topk", "fp8", "sa", "write", "pack", "unpack", "linear", "indexer",
               "rope", "cossin", "rmsnorm"):
        assert f"'{op}:ok'" in outcomes[1] and f"'{op}:error'" in outcomes[1], outcomes[1]
