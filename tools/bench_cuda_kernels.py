"""Time the CUDA Fp8Linear kernel on an NVIDIA GPU beside torch's bf16 F.linear on the same
GPU (a script, not a test; needs nvcc, a GPU and torch with CUDA).

    python tools/bench_cuda_kernels.py [--rows 1,4,1024] [--reps 20]

The kernel runs through tests/cuda/kernels_shim.cu (built as tests/test_cuda_kernels.py
builds it), on device-resident inputs; each time is the mean of `reps` launches after one
warm-up, by CUDA events, for the released model's five fp8 linears (tools/bench_ops.py's
FP8_SHAPES). Each shape's first rows are checked bit for bit against the NumPy definition
before they are timed. torch's F.linear multiplies bf16 X by bf16 W (2 bytes a weight,
against the kernel's 1 plus scales): the baseline a bf16 checkpoint would run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools")]
from bench_ops import FP8_SHAPES  # noqa: E402
from test_cuda_kernels import build_shim, fp8_linear_cuda  # noqa: E402
from test_fp8_linear import assert_same, values  # noqa: E402

from csa2onnx.custom_ops.reference import fp8_linear  # noqa: E402


def torch_ms(m: int, k: int, n: int, reps: int) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, w)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.nn.functional.linear(x, w)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,1024", help="M values, comma-separated")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    shim = build_shim(Path(tempfile.mkdtemp(prefix="cuda_shim_")))
    rng = np.random.default_rng(0)
    print(f"{'M':>5} {'K':>5} {'N':>6} {'Fp8Linear CUDA ms':>18} {'torch bf16 ms':>14} "
          f"{'x torch':>8}")
    for k, n in FP8_SHAPES:
        codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
        codes[np.isin(codes, (0x7F, 0xFF))] = 0x7E
        w_scale = np.exp2(rng.integers(-12, -4, (-(-n // 32), k // 32))).astype(np.float32)
        for m in map(int, args.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y, _ = fp8_linear_cuda(shim, x[:4], codes, w_scale)
            assert_same(y, fp8_linear(x[:4], values(codes), w_scale), f"M={m} K={k} N={n}")
            fp8_linear_cuda(shim, x, codes, w_scale)  # warm-up
            _, ms = fp8_linear_cuda(shim, x, codes, w_scale, reps=args.reps)
            base = torch_ms(m, k, n, args.reps)
            print(f"{m:>5} {k:>5} {n:>6} {ms:>18.3f} {base:>14.3f} {ms / base:>8.2f}")


if __name__ == "__main__":
    main()
