"""Build and run tools/amx_probe.cc: does AMX's TDPBF16PS (with some operand order) sum bf16
pairs in the order of csa2onnx's exact TorchLinear, and how fast is it beside vdpbf16ps?
The question that decides whether exact numerics can use AMX tiles (issue 10). A script,
not a test (tests/test_amx_probe.py runs its vdpbf16ps half):

    python tools/amx_probe.py [CASES]          # CASES test cases of 16 x 16 sums per data kind

On a CPU without AMX it checks vdpbf16ps against the definition only. Needs g++ 12 or newer.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("amx_probe.cc")


def build(folder: Path) -> Path:
    """The probe, compiled with g++ (the AMX and AVX512-BF16 code carries target attributes,
    so the program runs on any x86-64 CPU and reports what it has)."""
    cxx = shutil.which("g++")
    if cxx is None:
        raise RuntimeError("g++ not found: needed to build tools/amx_probe.cc")
    exe = folder / "amx_probe"
    subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
                    str(SOURCE), "-o", str(exe)], check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="?", type=int, default=200,
                        help="test cases per data kind (each 256 sums of 512 terms)")
    parser.add_argument("--no-amx", action="store_true", help="compare vdpbf16ps only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        exe = build(Path(folder))
        command = [str(exe), str(args.cases)] + (["--no-amx"] if args.no_amx else [])
        return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
