"""Benchmark the custom-op kernels against NumPy and torch (a script, not a test).

    python tools/bench_ops.py [--repeat 5] [--min-time 1.0] [--only linear|fp4|topk]
        [--linear-m 1 256 1024] [--linear-layers wq_a ...] [--threads 2]
        [--baseline-library OLD.so]

TorchLinear (bf16 weights, the released model's projections, X bf16-valued): GFLOP/s of the
kernel's default path (vdpbf16ps where the CPU has AVX512_BF16), of its fmaf tiles
(CSA_TORCH_LINEAR_ISA=avx512, the path every CPU without AVX512_BF16 takes), of an older
build of the library if --baseline-library names one, and of torch's F.linear on bf16
tensors; every implementation's output is checked against the default path's (bit for bit;
torch's bf16 result against the kernel's rounded to bf16, where torch sums like the goldens'
CPU). The implementations are timed in turns, round after round, in one process (a shared
machine's load then hits them alike), and each time is the median over the rounds.

    python tools/bench_ops.py --only fp8 [--fp8-rows 1,4,256,1024] [--threads 2]
        [--fp8-weights checkpoint|uniform] [--fp8-x normal|outliers]
        [--fp8-shapes 5120x1280,...]                                  # Fp8Linear only

    python tools/bench_ops.py --only sparse [--threads 2] [--sparse-decode]  # SparseAttention
    python tools/bench_ops.py --only packed                         # Pack/UnpackQuantized only
    python tools/bench_ops.py --only indexer [--indexer-baseline-max-gib 6]   # IndexerScore
    python tools/bench_ops.py --only rope                                    # ApplyRope

--baseline-library OLD.so also times that build's Fp8Linear (exact, same weights and X) and
IndexerScore in the same turns as this one's, checking their outputs bit for bit: an A/B of
a kernel change in one process (the IndexerScore section then leaves the standard ops out).

Fp4QuantDequant: values/s of the onnxruntime kernel, the NumPy definition
(custom_ops/reference.py) and a compact torch version of the same round trip, on a float32
[4096, 4096] input, both scale formats. TorchTopK: rows/s of the kernel and torch.topk (CPU).
SparseAttention: FLOP/s (4*b*s*h*k*d) at the released model's dims (h = 64, d = 512, k = window
128 + up to 512 compressed rows; decode b = 1 and 4, prefill s = 256..4096) of the tiled
kernel, the per-row kernel it replaced (the op's `reference` path, same bits) and the
reference's vectorised torch sparse_attn (einsum per block of 64; read from --sparse-torch,
by default ../shared/reference/kernel_cpu.py beside the checkout, left out when absent);
the three run interleaved, so that a load shared with other processes hits them alike.
Beside them "fast kernel", the op with numerics="fast" (vdpbf16ps where the CPU has
AVX512-BF16, else the same exact kernel), so that the cost of exactness shows: its speed-up
column below 1 is fast's time over exact's, and a note gives the fraction of its outputs
that differ from exact's.
Each implementation's outputs are checked equal to the kernel's first, so the timings compare
the same work. Decode shapes (b*s <= 4) read a window of 128 float rows and a compressed cache
of 2048 fp4_e4m3_16 rows (fp4 values in the float KV), and add two ways a layer can feed them:
"Concat + kernel" (today's layer: Concat(window rows, float cache) then the kernel, the
O(context) copy per step included) and "packed cache" (the kernel reading the window rows and
the packed cache, input Compressed; no copy). With CSA2ONNX_OPS_LIBRARY naming an older build
that lacks the packed input, those rows are left out. onnxruntime runs with
intra_op_num_threads = torch.get_num_threads(); NumPy is single-threaded here (no BLAS in these
paths). Times are the median of the repeats; session creation is excluded, output allocation
included everywhere.

PackQuantized / UnpackQuantized (--only packed): values/s on [4096, d] rows of each format
(d = 512, 128 for the index keys) against today's round trip (the Fp4QuantDequant kernel, or
the graph's act_quant), which the packed pair replaces, and the NumPy definitions.

IndexerScore (--only indexer): milliseconds per call at the released indexer's dims (H = 32,
D = 128) for decode (s = 1; b = 1, and b = 4 at T = 8192) and a 1024-token prefill chunk
(b = 1), T = 8192 and 32768 keys of the packed index-key cache (fp4_e8m0_32, read in place),
against what the layer ran before the op: UnpackQuantized(Slice(cache)) and the standard ops
(MatMul, Casts, Relu, Mul, ReduceSum), which materialise [b, s, H, T] float32 several times;
the baseline is left out where one such intermediate would pass --indexer-baseline-max-gib
(default 1.5). Outputs checked bit for bit; the two run interleaved; "scores/s" counts b*s*T
outputs. Then "IndexerScore candidates": a later index source's level two (T = 64K..1M
keys, 2048 candidate blocks of 8 per query row, as released), the op given Candidates against
every score and a Where (the layer before the op took them). Then "IndexerTopK": the candidate
source's selection at 1M keys (k = 512, block scores of 8 with the newest block forced), a
decode row and a 256-token prefill chunk, against IndexerScore, TorchTopK, BlockMax and the
forcing Where (the layer before the op), outputs checked equal; peak memory is not measured
here (the chunk's composed ops hold a [256, 1M] float32 intermediate, 1 GiB).

ApplyRope (--only rope): milliseconds per call on the released q and o ([1, s, 64, 512], rd 64;
s = 1, 256, 1024) against the standard ops it replaced, which are its portable body
(custom_ops/portable.py, inlined by a session without the library). X is a graph input
here, so the kernel copies the unchanged features too; inside a layer q and o are
intermediates and it runs in place. Outputs checked bit for bit; the two run interleaved.

Fp8Linear: milliseconds per call against the bf16 TorchLinear on the same [N, K] (the same
values: e4m3 is exact in bf16), both with W a constant initializer, at the released
model's fp8 linear shapes (or --fp8-shapes) and M rows, intra_op_num_threads = --threads
(default 2), timed in turns; the weights are quantised as a checkpoint holds them (or, with
--fp8-weights uniform, every code equally likely: Fp8Linear's worst case), X normal bf16
values (or, with --fp8-x outliers, as LLM activations are: 1/64 of the features 40 times as
large, which leaves more of act_quant's blocks spanning more binades than int16 holds, each
then summed in two digits against every column); the ratio is
Fp8Linear's time over TorchLinear's, and the W columns give the bytes of weights each call
reads. Exact Fp8Linear reads W in the layout an export writes (pairs16 where N is a
multiple of 16; a --baseline-library build reads it plain). The "fast" column is Fp8Linear
with numerics="fast" (the same terms in vdpbf16ps
order, custom_ops/src/fp8_linear_fast.cc; the exact kernel where the CPU lacks its
instructions), its ratio beside: what exactness costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from csa2onnx.custom_ops import make_session, session_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream

from csa2onnx.custom_ops.constants import PACKED_FORMATS
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.custom_ops.reference import (
    fp4_round_trip,
    fp8_linear,
    pack_quantized,
    round_bf16,
    unpack_quantized,
)
from csa2onnx.custom_ops.weight_layout import PAIRS16, PLAIN, pack_pairs16
from csa2onnx.graphs.standalone import IR_VERSION

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("csa2onnx", 1)]

# The released model's bf16 projections, (name, K, N).
LINEAR_SHAPES = [("wq_a", 5120, 1280), ("wq_b", 1280, 32768), ("wkv", 5120, 512),
                 ("wo_b", 8192, 5120), ("wo_a group", 4096, 1024), ("indexer wq_b", 1280, 4096)]


# ---------------------------------------------------------------- torch fp4 round trip
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def torch_fp4_round_trip(x: torch.Tensor, block: int,
                         scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4_act_quant(x, block, inplace=True) in plain torch ops: (bf16-valued y, scales)."""
    blocks = x.view(*x.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if scale_format == "e8m0":
        t = amax.clamp_min(6.0 * 2.0**-126) * (1.0 / 6.0)
        mantissa, exponent = torch.frexp(t)  # exact 2^ceil(log2 t), as the kernel computes it
        scale = torch.where(mantissa == 0.5, t, torch.ldexp(torch.ones_like(t), exponent))
    else:  # e4m3fn: torch's cast does not saturate, so clamp at 448 first
        scale = (amax.clamp_min(6.0 * 2.0**-9) / 6.0).clamp_max(448.0)
        scale = scale.to(torch.float8_e4m3fn).float()
    a = (blocks / scale).clamp(-6.0, 6.0)
    m = a.abs()
    # e2m1 with ties to the even code: midpoints .25 1.25 2.5 5 round down, .75 1.75 3.5 up.
    code = ((m > 0.25).to(torch.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) +
            (m >= 3.5) + (m > 5.0))
    q = torch.copysign(E2M1_GRID[code.long()], a)
    y = (q * scale).to(torch.bfloat16).float()
    return y.view(x.shape), scale.squeeze(-1)


# ---------------------------------------------------------------- models and timing
def fp4_model(block: int, scale_format: str) -> bytes:
    node = helper.make_node("Fp4QuantDequant", ["X"], ["Y", "Scale"], domain="csa2onnx",
                            block_size=block, scale_format=scale_format)
    graph = helper.make_graph(
        [node], "fp4", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "c"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "c"]),
         helper.make_tensor_value_info("Scale", TensorProto.FLOAT, ["r", "b"])])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def topk_model() -> bytes:
    node = helper.make_node("TorchTopK", ["X", "K"], ["Values", "Indices"], domain="csa2onnx",
                            largest=1, sorted=1)
    graph = helper.make_graph(
        [node], "topk", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
                         helper.make_tensor_value_info("K", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("Values", TensorProto.FLOAT, ["r", "k"]),
         helper.make_tensor_value_info("Indices", TensorProto.INT64, ["r", "k"])])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


FP8_SHAPES = [(5120, 1280), (1280, 32768), (5120, 512), (8192, 5120), (1280, 4096)]  # (K, N)


def fp8_linear_model(codes: np.ndarray, w_scale: np.ndarray, numerics: str = "exact",
                     layout: str = PLAIN) -> bytes:
    """Y = Fp8Linear(X, W, WScale), W ([N, K] codes) stored in `layout` (plain or pairs16)."""
    n, k = codes.shape
    attributes = {"numerics": numerics} if numerics != "exact" else {}
    if layout == PAIRS16:
        codes = pack_pairs16(codes)
        attributes["weight_layout"] = PAIRS16
    node = helper.make_node("Fp8Linear", ["X", "W", "WScale"], ["Y"], domain="csa2onnx",
                            **attributes)
    graph = helper.make_graph(
        [node], "fp8", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
        [helper.make_tensor("W", TensorProto.FLOAT8E4M3FN, codes.shape, codes.tobytes(),
                            raw=True),
         numpy_helper.from_array(w_scale, "WScale")])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def bf16_linear_model(w: np.ndarray) -> bytes:
    n, k = w.shape
    bits = (np.ascontiguousarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx")
    graph = helper.make_graph(
        [node], "bf16", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
        [helper.make_tensor("W", TensorProto.BFLOAT16, [n, k], bits.tobytes(), raw=True)])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def checkpoint_fp8_weights(rng: np.random.Generator, n: int, k: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 codes [N, K] and ue8m0 scales as a checkpoint holds them: normal weights, one
    power-of-two scale per 32x32 block mapping the block's largest value into (224, 448]."""
    nb, kb = -(-n // 32), k // 32
    w = rng.standard_normal((nb * 32, k), dtype=np.float32)
    blocks = w.reshape(nb, 32, kb, 32)
    amax = np.abs(blocks).max(axis=(1, 3))
    w_scale = np.exp2(np.ceil(np.log2(amax / 448.0))).astype(np.float32)
    q = (blocks / w_scale[:, None, :, None]).reshape(nb * 32, k)[:n]
    codes = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, w_scale


def uniform_fp8_weights(rng: np.random.Generator, n: int, k: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Every finite e4m3 code equally likely (a worst case: most blocks span more binades
    than int16 holds, so Fp8Linear sums them in its wide fallback)."""
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN weights
    w_scale = np.exp2(rng.integers(-12, -4, (-(-n // 32), k // 32))).astype(np.float32)
    return codes, w_scale


def fp8_activations(rng: np.random.Generator, m: int, k: int, kind: str) -> np.ndarray:
    """X [m, k] as bf16 values: normal ("normal"), or with 1/64 of the features (the same
    for every row) 40 times as large ("outliers"), as LLM activations have."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "outliers":
        x[:, rng.choice(k, max(1, k // 64), replace=False)] *= 40.0
    return round_bf16(x)


def bench_fp8_linear(rows: list[int], rounds: int, min_time: float, threads: int = 2,
                     weights: str = "checkpoint", shapes: list[tuple[int, int]] | None = None,
                     baseline: str | None = None, baseline_layout: str = "exported",
                     activations: str = "normal") -> None:
    """Fp8Linear vs the bf16 TorchLinear on the same [N, K] and values, timed in turns
    (interleaved_times); printed as a table of medians and best rounds. With `baseline` (an
    older build of the library) its exact Fp8Linear is timed in the same turns, on W in the
    layout this build runs ("exported") or plain W ("plain": builds from before pairs16), its
    output checked bit for bit, and a line per row gives this build's time over its."""
    rng = np.random.default_rng(1)
    options = quiet(session_options(threads))
    make_weights = checkpoint_fp8_weights if weights == "checkpoint" else uniform_fp8_weights
    print(f"Fp8Linear vs bf16 TorchLinear, intra_op_num_threads={threads}, {os.cpu_count()} "
          f"CPUs, W constant ({weights} weights), X {activations}; ms per call, median (best) "
          f"of {rounds} interleaved rounds")
    print(f"{'K':>5} {'N':>6} {'M':>5} {'Fp8Linear':>19} {'fast':>19} {'TorchLinear':>19} "
          f"{'ratio':>12} {'fast ratio':>12} {'W fp8':>9} {'W bf16':>9}")
    for k, n in shapes or FP8_SHAPES:
        codes, w_scale = make_weights(rng, n, k)
        w = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        # exact: the layout an export writes (export/weights.py linear_layout)
        layout = PAIRS16 if n % 16 == 0 else PLAIN
        fp8 = make_session(fp8_linear_model(codes, w_scale, layout=layout), options=options)
        fast = make_session(fp8_linear_model(codes, w_scale, "fast"), options=options)
        bf16 = make_session(bf16_linear_model(w), options=options)
        base_layout = layout if baseline_layout == "exported" else PLAIN
        base = (op_session(fp8_linear_model(codes, w_scale, layout=base_layout), threads,
                           library=baseline, spinning=False) if baseline else None)
        for m in rows:
            x = fp8_activations(rng, m, k, activations)
            # spot check against the NumPy definition where it is quick
            if m <= 4 and n * k <= 1 << 23 and not same_bits(fp8.run(None, {"X": x})[0],
                                                             fp8_linear(x, w, w_scale)):
                print(f"warning: Fp8Linear differs from the definition at M={m} K={k} N={n}",
                      file=sys.stderr)
            fns = {"fp8": lambda s=fp8, f={"X": x}: s.run(None, f),
                   "fast": lambda s=fast, f={"X": x}: s.run(None, f),
                   "bf16": lambda s=bf16, f={"X": x}: s.run(None, f)}
            if base is not None:
                if not same_bits(base.run(None, {"X": x})[0], fp8.run(None, {"X": x})[0]):
                    print(f"warning: Fp8Linear differs from the baseline build at M={m} K={k} "
                          f"N={n}", file=sys.stderr)
                fns["base"] = lambda s=base, f={"X": x}: s.run(None, f)
            times = interleaved_times(fns, rounds, min_time)
            (med8, best8), (medf, bestf) = times["fp8"], times["fast"]
            med16, best16 = times["bf16"]
            print(f"{k:>5} {n:>6} {m:>5} {med8 * 1e3:9.3f} ({best8 * 1e3:7.3f}) "
                  f"{medf * 1e3:9.3f} ({bestf * 1e3:7.3f}) "
                  f"{med16 * 1e3:9.3f} ({best16 * 1e3:7.3f}) {med8 / med16:5.2f} "
                  f"({best8 / best16:4.2f}) {medf / med16:5.2f} ({bestf / best16:4.2f}) "
                  f"{n * k / 2**20:7.1f}MB {2 * n * k / 2**20:7.1f}MB", flush=True)
            if base is not None:
                medb, bestb = times["base"]
                print(f"{'':>18} baseline build {medb * 1e3:9.3f} ({bestb * 1e3:7.3f}) ms: this "
                      f"build / baseline {med8 / medb:5.3f} ({best8 / bestb:5.3f})", flush=True)


def linear_model(w_bits: np.ndarray, numerics: str = "exact") -> bytes:
    """Y = TorchLinear(X, W) with W a constant bf16 initializer ([N, K] bf16 bits)."""
    w = helper.make_tensor("W", TensorProto.BFLOAT16, w_bits.shape, w_bits.tobytes(), raw=True)
    attributes = {"numerics": numerics} if numerics != "exact" else {}
    node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx", **attributes)
    graph = helper.make_graph(
        [node], "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["m", "k"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", "n"])], [w])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def quiet(options: ort.SessionOptions) -> ort.SessionOptions:
    """`options` with idle intra-op threads not spinning, as `csa2onnx bench` runs its
    sessions: sessions timed in turns then leave the cores to each other."""
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def op_session(model: bytes, threads: int, isa: str | None = None, library: str | None = None,
               arena: bool = True, spinning: bool = True) -> ort.InferenceSession:
    """A session on `model` (any op's); `isa` forces TorchLinear's path (read when the kernel
    is made), `library` registers another build of the custom-op library instead of this one
    (--baseline-library), `arena` False turns onnxruntime's CPU arena off, `spinning` False
    is quiet()."""
    options = session_options(threads, library)
    options.enable_cpu_mem_arena = arena
    if not spinning:
        quiet(options)
    old = os.environ.pop("CSA_TORCH_LINEAR_ISA", None)
    if isa is not None:
        os.environ["CSA_TORCH_LINEAR_ISA"] = isa
    try:
        return make_session(model, options=options)
    finally:
        os.environ.pop("CSA_TORCH_LINEAR_ISA", None)
        if old is not None:
            os.environ["CSA_TORCH_LINEAR_ISA"] = old


# A pause before each function's turn: the intra-op threads of the one timed before it
# (onnxruntime's pools spin after a run, torch's OpenMP threads too) stop spinning first.
# Without it, whatever ran second took their cores: on a 2-core AMD EPYC (AVX2 only) the
# same TorchLinear kernel in two sessions timed 1.2-1.6x apart, the later one slower.
SETTLE_SECONDS = 0.2


def interleaved_times(fns: dict[str, Callable[[], Any]], rounds: int,
                      min_time: float) -> dict[str, tuple[float, float]]:
    """(median, best) seconds per call of each function, timed in turns: every round calls
    each function `calls` times (enough for about min_time / rounds seconds of the first
    one). The best round is what the code does when the machine's other load leaves it
    alone; the median, what it did."""
    for fn in fns.values():
        fn()  # warm-up
    first = next(iter(fns.values()))
    t0 = time.perf_counter()
    first()
    calls = max(1, int(min_time / rounds / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(SETTLE_SECONDS)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def bench_linear(ms: list[int], threads: int, rounds: int, min_time: float,
                 baseline: str | None, layers: list[str] | None = None) -> None:
    """TorchLinear bf16 at the released model's shapes; prints one table."""
    import torch_reference  # tools/: whether torch here sums like the goldens' CPU

    exact_torch = torch_reference.torch_sums_like_goldens()
    rng = np.random.default_rng(1)
    print(f"TorchLinear, bf16 W, X bf16-valued; onnxruntime intra_op_num_threads={threads}, "
          f"torch.set_num_threads({threads}); {os.cpu_count()} CPUs; median of {rounds} "
          f"interleaved rounds; GFLOP/s = 2*M*N*K / time")
    print(f"{'layer':<13} {'K':>5} {'N':>6} {'M':>5} {'implementation':<26} {'median':>11} "
          f"{'GFLOP/s':>8} {'speed-up':>9}   {'best':>11} {'GFLOP/s':>8} {'speed-up':>9}")
    print(f"{'':<69}(speed-up: of the default path over this implementation)")
    for name, k, n in LINEAR_SHAPES:
        if layers is not None and name not in layers:
            continue
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        w_bf16 = torch.from_numpy(w).bfloat16()
        w_bits = w_bf16.view(torch.int16).numpy().view(np.uint16)
        model = linear_model(w_bits)
        sessions = {"kernel (default path)": op_session(model, threads)}
        if "avx512bf16" in cpu_isas():  # the default there is vdpbf16ps; elsewhere it IS the tiles
            sessions["kernel avx512 fmaf tiles"] = op_session(model, threads, "avx512")
        if baseline:
            sessions["kernel, baseline build"] = op_session(model, threads, None, baseline)
        fast = op_session(linear_model(w_bits, "fast"), threads)  # AMX tiles where present
        for m in ms:
            x_bf16 = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
            x = x_bf16.float().numpy()
            fns: dict[str, Callable[[], Any]] = {
                impl: (lambda s=s_, feed=x: s.run(["Y"], {"X": feed}))
                for impl, s_ in sessions.items()}
            fns["kernel numerics=fast"] = lambda s=fast, feed=x: s.run(["Y"], {"X": feed})
            fns["torch F.linear bf16"] = (
                lambda xb=x_bf16, wb=w_bf16: torch.nn.functional.linear(xb, wb))
            want = sessions["kernel (default path)"].run(["Y"], {"X": x})[0]
            for impl, s_ in sessions.items():
                if not same_bits(s_.run(["Y"], {"X": x})[0], want):
                    print(f"warning: {impl} differs from the default path", file=sys.stderr)
            differ = float(np.mean(fast.run(["Y"], {"X": x})[0] != want))
            print(f"note: {name} M={m}: numerics=fast differs from exact in {differ:.1%} of the "
                  "outputs", file=sys.stderr)
            got_torch = torch.nn.functional.linear(x_bf16, w_bf16).float().numpy()
            rounded = torch.from_numpy(want).bfloat16().float().numpy()
            if exact_torch and not same_bits(got_torch, rounded):
                print(f"warning: torch differs from the kernel ({name}, M={m})", file=sys.stderr)
            times = interleaved_times(fns, rounds, min_time)
            flops = 2.0 * m * n * k
            default = times["kernel (default path)"]
            for impl, (median, best) in times.items():
                cells = []
                for seconds, reference in ((median, default[0]), (best, default[1])):
                    ratio = "" if impl == "kernel (default path)" else (
                        f"x{seconds / reference:.2f}")
                    cells.append(f"{seconds * 1e3:8.3f} ms {flops / seconds / 1e9:8.1f} "
                                 f"{ratio:>9}")
                print(f"{name:<13} {k:>5} {n:>6} {m:>5} {impl:<26} {cells[0]}   {cells[1]}",
                      flush=True)


def sparse_attention_model(scale: float, numerics: str = "exact") -> bytes:
    fast = {"numerics": numerics} if numerics != "exact" else {}
    node = helper.make_node("SparseAttention", ["Q", "KV", "S", "I"], ["O"], domain="csa2onnx",
                            softmax_scale=scale, **fast)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node], "sa", [vi("Q", TensorProto.FLOAT, ["b", "s", "h", "d"]),
                       vi("KV", TensorProto.FLOAT, ["b", "n", "d"]),
                       vi("S", TensorProto.FLOAT, ["h"]),
                       vi("I", TensorProto.INT64, ["b", "s", "k"])],
        [vi("O", TensorProto.FLOAT, ["b", "s", "h", "d"])])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def sparse_attention_session(isa: str, scale: float, threads: int,
                             numerics: str = "exact") -> ort.InferenceSession:
    """A session whose kernel takes `isa` (the variable is read when the kernel is created)."""
    saved = os.environ.get("CSA_SPARSE_ATTENTION_ISA")
    os.environ["CSA_SPARSE_ATTENTION_ISA"] = isa
    try:
        return make_session(sparse_attention_model(scale, numerics),
                            options=session_options(threads))
    finally:
        if saved is None:
            del os.environ["CSA_SPARSE_ATTENTION_ISA"]
        else:
            os.environ["CSA_SPARSE_ATTENTION_ISA"] = saved


def load_torch_sparse_attn(path: str) -> Callable[..., torch.Tensor] | None:
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("bench_kernel_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sparse_attn


def sparse_attention_inputs(rng: np.random.Generator, b: int, s: int, h: int, d: int,
                            k: int) -> dict[str, np.ndarray]:
    """bf16-valued q and kv (as the model feeds them); per query a window of 128 consecutive
    rows, then compressed rows drawn from the rest of a cache of n = 2048 + 128 rows."""
    n = 2048 + 128
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((b, s, h, d)).astype(bf16).astype(np.float32)
    kv = rng.standard_normal((b, n, d)).astype(bf16).astype(np.float32)
    sink = rng.standard_normal(h).astype(np.float32)
    window = min(k, 128)
    start = rng.integers(0, n - window, (b, s, 1))
    idx = np.concatenate([start + np.arange(window),
                          rng.integers(0, n, (b, s, k - window))], axis=-1).astype(np.int64)
    return {"Q": q, "KV": kv, "S": sink, "I": idx}


DECODE_WINDOW, DECODE_CACHE, CACHE_FORMAT = 128, 2048, "fp4_e4m3_16"


def sparse_decode_inputs(rng: np.random.Generator, b: int, s: int, h: int, d: int,
                         k: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Decode as a layer runs it: the window's 128 float rows, then a compressed cache of 2048
    fp4_e4m3_16 rows; per query the window rows, then compressed rows (offset by 128).
    Returns the float feeds (KV = window rows, then the cache's values), the window rows and
    the packed cache."""
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((b, s, h, d)).astype(bf16).astype(np.float32)
    window = rng.standard_normal((b, DECODE_WINDOW, d)).astype(bf16).astype(np.float32)
    latents = rng.standard_normal((b, DECODE_CACHE, d)).astype(bf16).astype(np.float32)
    packed = pack_quantized(latents, CACHE_FORMAT)
    kv = np.concatenate([window, unpack_quantized(packed, CACHE_FORMAT, d)], axis=1)
    sink = rng.standard_normal(h).astype(np.float32)
    idx = np.concatenate([np.broadcast_to(np.arange(DECODE_WINDOW), (b, s, DECODE_WINDOW)),
                          DECODE_WINDOW + rng.integers(0, DECODE_CACHE,
                                                       (b, s, k - DECODE_WINDOW))],
                         axis=-1).astype(np.int64)
    return {"Q": q, "KV": kv, "S": sink, "I": idx}, window, packed


def sparse_layer_session(scale: float, threads: int, packed: bool) -> ort.InferenceSession:
    """The kernel as a decode layer feeds it: Concat(window rows, float cache) then the kernel
    (packed=False), or the window rows and the packed cache (packed=True)."""
    vi = helper.make_tensor_value_info
    if packed:
        nodes = [helper.make_node("SparseAttention", ["Q", "W", "S", "I", "C"], ["O"],
                                  domain="csa2onnx", softmax_scale=scale,
                                  compressed_format=CACHE_FORMAT)]
        cache = vi("C", TensorProto.UINT8, ["b", "m", "r"])
    else:
        nodes = [helper.make_node("Concat", ["W", "C"], ["KV"], axis=1),
                 helper.make_node("SparseAttention", ["Q", "KV", "S", "I"], ["O"],
                                  domain="csa2onnx", softmax_scale=scale)]
        cache = vi("C", TensorProto.FLOAT, ["b", "m", "d"])
    graph = helper.make_graph(
        nodes, "layer", [vi("Q", TensorProto.FLOAT, ["b", "s", "h", "d"]),
                         vi("W", TensorProto.FLOAT, ["b", "w", "d"]),
                         vi("S", TensorProto.FLOAT, ["h"]),
                         vi("I", TensorProto.INT64, ["b", "s", "k"]), cache],
        [vi("O", TensorProto.FLOAT, ["b", "s", "h", "d"])])
    model = helper.make_model(graph, opset_imports=OPSETS,
                              ir_version=IR_VERSION).SerializeToString()
    return make_session(model, options=session_options(threads))


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds per call of each function, the calls taking turns (after one warm-up
    call each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


SPARSE_SHAPES = [  # b, s, h, d, k
    (1, 1, 64, 512, 640), (4, 1, 64, 512, 640), (1, 256, 64, 512, 384),
    (1, 1024, 64, 512, 640), (1, 4096, 64, 512, 640),
]


Row = tuple[str, str, str, float, float, str]


def bench_sparse_attention(args: argparse.Namespace, threads: int,
                           rng: np.random.Generator) -> list[Row]:
    torch_sparse_attn = load_torch_sparse_attn(args.sparse_torch)
    if torch_sparse_attn is None:
        print("note: no torch sparse_attn to compare with (--sparse-torch)", file=sys.stderr)
    rows = []
    for b, s, h, d, k in SPARSE_SHAPES:
        decode = b * s <= 4
        if args.sparse_decode and not decode:
            continue
        if decode:
            feeds, window, packed = sparse_decode_inputs(rng, b, s, h, d, k)
        else:
            feeds = sparse_attention_inputs(rng, b, s, h, d, k)
        scale = d**-0.5
        new = sparse_attention_session("", scale, threads)  # the widest path this CPU has
        old = sparse_attention_session("reference", scale, threads)
        o_new, o_old = new.run(None, feeds)[0], old.run(None, feeds)[0]
        if not same_bits(o_new, o_old):
            print(f"warning: SparseAttention {(b, s, h, d, k)}: tiled != per-row", file=sys.stderr)
        fns: dict[str, Callable[[], Any]] = {
            "onnxruntime kernel": lambda f=feeds, x=new: x.run(None, f),
            "old per-row kernel": lambda f=feeds, x=old: x.run(None, f),
        }
        try:  # numerics="fast" (an older library has no such attribute)
            fast = sparse_attention_session("", scale, threads, "fast")
            differing = np.mean(fast.run(None, feeds)[0].view(np.uint32) != o_new.view(np.uint32))
            print(f"note: SparseAttention {(b, s, h, d, k)}: numerics=fast differs from exact in "
                  f"{differing:.4%} of the outputs", file=sys.stderr)
            fns["fast kernel"] = lambda f=feeds, x=fast: x.run(None, f)
        except Exception as e:
            print(f"note: numerics=fast left out: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        if decode:
            base = {"Q": feeds["Q"], "W": window, "S": feeds["S"], "I": feeds["I"]}
            layer_feeds = {"Concat + kernel": base | {"C": feeds["KV"][:, DECODE_WINDOW:]},
                           "packed cache": base | {"C": packed}}
            for impl, lf in layer_feeds.items():
                try:
                    sess = sparse_layer_session(scale, threads, impl == "packed cache")
                    out = sess.run(None, lf)[0]
                except Exception as e:  # an older library without the packed input
                    print(f"note: {impl} left out: {str(e).splitlines()[0][:120]}",
                          file=sys.stderr)
                    continue
                if not same_bits(out, o_new):
                    print(f"warning: SparseAttention {impl} != the kernel", file=sys.stderr)
                fns[impl] = lambda f=lf, x=sess: x.run(None, f)
        if torch_sparse_attn is not None:
            tq, tkv, tsink, tidx = (torch.from_numpy(feeds[n]) for n in ("Q", "KV", "S", "I"))
            fns["torch einsum"] = lambda a=(tq, tkv, tsink, tidx), sc=scale: torch_sparse_attn(
                *a, sc)
        # Decode calls take milliseconds and a shared machine preempts a thread now and then
        # (a parallel call then waits for it): many calls; prefill calls take seconds.
        repeat = args.repeat * 20 if b * s <= 4 else max(2, args.repeat * 256 // (b * s))
        flops = 4 * b * s * h * k * d
        for impl, seconds in interleaved_medians(fns, repeat).items():
            rows.append(("SparseAttention", f"b{b} s{s} h{h} d{d} k{k}", impl, seconds,
                         flops / seconds, "FLOP/s"))
    return rows


def packed_model(kind: str, fmt: str, d: int) -> bytes:
    """PackQuantized (X float -> P uint8) or UnpackQuantized (P -> Y float) alone."""
    vi = helper.make_tensor_value_info
    if kind == "pack":
        node = helper.make_node("PackQuantized", ["X"], ["P"], domain="csa2onnx", format=fmt)
        io = (vi("X", TensorProto.FLOAT, ["r", d]), vi("P", TensorProto.UINT8, ["r", "w"]))
    else:
        node = helper.make_node("UnpackQuantized", ["P"], ["X"], domain="csa2onnx", format=fmt,
                                dim=d)
        io = (vi("P", TensorProto.UINT8, ["r", "w"]), vi("X", TensorProto.FLOAT, ["r", d]))
    graph = helper.make_graph([node], kind, [io[0]], [io[1]])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def act_quant_model(d: int) -> bytes:
    from csa2onnx.graphs import quant
    from csa2onnx.graphs.numerics import FLOAT
    from csa2onnx.graphs.standalone import build_model

    return build_model("act_quant", [("x", FLOAT, ["n", d])], ["y"],
                       lambda op, x: quant.act_quant(op, x)).SerializeToString()


def bench_packed(args: argparse.Namespace, options: ort.SessionOptions,
                 rng: np.random.Generator) -> list[Row]:
    """PackQuantized and UnpackQuantized against today's round trip and the NumPy definitions."""
    dims = {"fp4_e4m3_16": 512, "fp4_e8m0_32": 128, "fp8_e8m0_32": 512}
    rows = []
    for fmt, d in dims.items():
        x = (rng.standard_normal((4096, d)) * np.exp2(rng.integers(-8, 8, (4096, 1)))).astype(
            np.float32)
        rows += bench_packed_format(args, options, fmt, x)
    return rows


def bench_packed_format(args: argparse.Namespace, options: ort.SessionOptions, fmt: str,
                        x: np.ndarray) -> list[Row]:
    d = x.shape[-1]
    pack = make_session(packed_model("pack", fmt, d), options=options)
    unpack = make_session(packed_model("unpack", fmt, d), options=options)
    (p,) = pack.run(None, {"X": x})
    (y,) = unpack.run(None, {"P": p})
    if fmt.startswith("fp8"):
        today = make_session(act_quant_model(d), options=options)
        today_feeds = {"x": x}
    else:
        block = PACKED_FORMATS[fmt][0]
        today = make_session(fp4_model(block, "e4m3" if "e4m3" in fmt else "e8m0"),
                             options=options)
        today_feeds = {"X": x}
    if not (np.array_equal(p, pack_quantized(x, fmt)) and
            same_bits(y, today.run(None, today_feeds)[0])):
        print(f"warning: {fmt}: packed rows differ from the definition", file=sys.stderr)
    impls = {
        "onnxruntime kernel": median_time(lambda: pack.run(None, {"X": x}), args.repeat,
                                          args.min_time),
        "unpack kernel": median_time(lambda: unpack.run(None, {"P": p}), args.repeat,
                                     args.min_time),
        "today's round trip": median_time(lambda: today.run(None, today_feeds), args.repeat,
                                          args.min_time),
        "numpy pack": median_time(lambda: pack_quantized(x, fmt), 2, args.min_time),
        "numpy unpack": median_time(lambda: unpack_quantized(p, fmt, d), 2, args.min_time),
    }
    return [(f"PackQuantized {fmt}", f"[4096, {d}]", impl, seconds, x.size / seconds,
             "values/s") for impl, seconds in impls.items()]


INDEXER_SHAPES = [(1, 1, 8192), (4, 1, 8192), (1, 1, 32768), (1, 1024, 8192),
                  (1, 1024, 32768)]  # b, s, T (H 32, D 128)
# A later index source's level two at long contexts (ratio 1: T = context): the released
# candidate_topk_blocks 2048 of candidate_block_size 8 per query row.
CANDIDATE_SHAPES = [(1, 1, 65536), (1, 1, 262144), (1, 1, 1048576), (1, 64, 65536)]
TOPK_SHAPES = [(1, 1, 1048576), (1, 256, 1048576)]  # the candidate source, layer 20 at 1M
INDEX_TOPK = 512
CANDIDATE_BLOCKS, CANDIDATE_BLOCK_SIZE = 2048, 8


def indexer_inputs(d: int) -> list:
    vi = helper.make_tensor_value_info
    return [vi("Q", TensorProto.FLOAT, ["b", "s", "h", d]),
            vi("W", TensorProto.FLOAT, ["b", "s", "h"]),
            vi("K", TensorProto.UINT8, ["b", "r", "w"]), vi("T", TensorProto.INT64, [1])]


def indexer_candidate_models(d: int) -> tuple[bytes, bytes]:
    """IndexerScore given the Candidates (and Lengths, which they come with: every key
    reachable, as in decode), and every score then a Where (the layer before the op took
    Candidates)."""
    vi = helper.make_tensor_value_info
    inputs = [*indexer_inputs(d), vi("L", TensorProto.INT64, ["s"]),
              vi("C", TensorProto.BOOL, ["b", "s", "t"])]
    out = [vi("S", TensorProto.FLOAT, ["b", "s", "t"])]
    given = [helper.make_node("IndexerScore", ["Q", "W", "K", "T", "L", "C"], ["S"],
                              domain="csa2onnx", keys_format="fp4_e8m0_32")]
    where = [helper.make_node("IndexerScore", ["Q", "W", "K", "T"], ["all"], domain="csa2onnx",
                              keys_format="fp4_e8m0_32"),
             helper.make_node("Where", ["C", "all", "minus_inf"], ["S"])]
    inits = [helper.make_tensor("minus_inf", TensorProto.FLOAT, [], [-np.inf])]
    return tuple(helper.make_model(helper.make_graph(nodes, "indexer", inputs, out, inits),
                                   opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()
                 for nodes in (given, where))


def indexer_topk_models(d: int) -> tuple[bytes, bytes]:
    """IndexerTopK as the candidate source runs it, and the ops it replaced: IndexerScore,
    TorchTopK (largest, unsorted), BlockMax and the Where forcing the newest block (every
    key reachable: the newest is block (T - 1) // 8)."""
    vi = helper.make_tensor_value_info
    inputs = indexer_inputs(d)
    out = [vi("I", TensorProto.INT64, ["b", "s", "k"]), vi("B", TensorProto.FLOAT, None)]
    fused = [helper.make_node("IndexerTopK", ["Q", "W", "K", "T"], ["I", "B"], domain="csa2onnx",
                              keys_format="fp4_e8m0_32", k=INDEX_TOPK,
                              block_size=CANDIDATE_BLOCK_SIZE, force_newest_block=1)]
    composed = [
        helper.make_node("IndexerScore", ["Q", "W", "K", "T"], ["S"], domain="csa2onnx",
                         keys_format="fp4_e8m0_32"),
        helper.make_node("Min", ["T", "k"], ["kk"]),
        helper.make_node("TorchTopK", ["S", "kk"], ["V", "I"], domain="csa2onnx", largest=1,
                         sorted=0),
        helper.make_node("BlockMax", ["S"], ["maxes"], domain="csa2onnx",
                         block_size=CANDIDATE_BLOCK_SIZE),
        helper.make_node("Shape", ["maxes"], ["shape"], start=2),
        helper.make_node("Squeeze", ["shape"], ["nb"]),
        helper.make_node("Range", ["zero", "nb", "one"], ["ids"]),
        helper.make_node("Sub", ["T", "one1"], ["last"]),
        helper.make_node("Div", ["last", "eight"], ["newest"]),
        helper.make_node("Equal", ["ids", "newest"], ["hit"]),
        helper.make_node("Where", ["hit", "inf", "maxes"], ["B"])]
    inits = [helper.make_tensor("k", TensorProto.INT64, [1], [INDEX_TOPK]),
             helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("one", TensorProto.INT64, [], [1]),
             helper.make_tensor("one1", TensorProto.INT64, [1], [1]),
             helper.make_tensor("eight", TensorProto.INT64, [1], [CANDIDATE_BLOCK_SIZE]),
             helper.make_tensor("inf", TensorProto.FLOAT, [], [np.inf])]
    return tuple(helper.make_model(helper.make_graph(nodes, "indexer_topk", inputs, out, given),
                                   opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()
                 for nodes, given in ((fused, []), (composed, inits)))


def indexer_models(d: int) -> tuple[bytes, bytes]:
    """IndexerScore over the packed cache, and the layer's standard ops before it."""
    vi = helper.make_tensor_value_info
    inputs = indexer_inputs(d)
    out = [vi("S", TensorProto.FLOAT, ["b", "s", "t"])]
    op = helper.make_node("IndexerScore", ["Q", "W", "K", "T"], ["S"], domain="csa2onnx",
                          keys_format="fp4_e8m0_32")

    def bf16(x: str, y: str) -> list:
        return [helper.make_node("Cast", [x], [y + "_h"], to=TensorProto.BFLOAT16),
                helper.make_node("Cast", [y + "_h"], [y], to=TensorProto.FLOAT)]
    standard = [
        helper.make_node("Slice", ["K", "zero", "T", "one"], ["kp"]),
        helper.make_node("UnpackQuantized", ["kp"], ["ks"], domain="csa2onnx",
                         format="fp4_e8m0_32", dim=d),
        helper.make_node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("Unsqueeze", ["kt", "one"], ["ku"]),
        helper.make_node("MatMul", ["Q", "ku"], ["d0"]), *bf16("d0", "dots"),
        helper.make_node("Relu", ["dots"], ["r"]),
        helper.make_node("Unsqueeze", ["W", "minus_one"], ["wu"]),
        helper.make_node("Mul", ["r", "wu"], ["m0"]), *bf16("m0", "m"),
        helper.make_node("ReduceSum", ["m", "two"], ["s0"], keepdims=0), *bf16("s0", "S")]
    inits = [helper.make_tensor(n, TensorProto.INT64, [1], [v])
             for n, v in (("zero", 0), ("one", 1), ("two", 2), ("minus_one", -1))]
    return tuple(helper.make_model(helper.make_graph(nodes, "indexer", inputs, out, inits),
                                   opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()
                 for nodes in ([op], standard))


def scores_rows(op: str, b: int, s: int, t: int, fns: dict, repeat: int) -> list[Row]:
    """The rows of one indexer shape: each implementation's median, in scores a second."""
    return [(op, f"b={b} s={s} T={t}", impl, seconds, b * s * t / seconds, "scores/s")
            for impl, seconds in interleaved_medians(fns, repeat).items()]


def indexer_call(rng: np.random.Generator, b: int, s: int, t: int, h: int,
                 d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp4 queries [b, s, H, D], head weights [b, s, H], a packed key cache of T rows."""
    q = fp4_round_trip(rng.standard_normal((b, s, h, d)).astype(np.float32), 32, "e8m0")[0]
    w = (rng.standard_normal((b, s, h)) * 0.02).astype(np.float32)
    cache = pack_quantized(rng.standard_normal((b, t, d)).astype(np.float32), "fp4_e8m0_32")
    return q, w, cache


def bench_indexer_score(args: argparse.Namespace, threads: int,
                        rng: np.random.Generator) -> list[Row]:
    h, d = 32, 128
    options = quiet(session_options(threads))
    options.enable_cpu_mem_arena = False  # as the runtime's prefill session
    fused, standard = (make_session(m, options=options) for m in indexer_models(d))
    base = (op_session(indexer_models(d)[0], threads, library=args.baseline_library,
                           arena=False, spinning=False) if args.baseline_library else None)
    rows = []
    for b, s, t in INDEXER_SHAPES:
        q, w, cache = indexer_call(rng, b, s, t, h, d)
        feeds = {"Q": q, "W": w, "K": cache, "T": np.array([t], np.int64)}
        fns = {"onnxruntime kernel": lambda f=feeds: fused.run(None, f)}
        if base is not None:
            if not same_bits(base.run(None, feeds)[0], fused.run(None, feeds)[0]):
                print(f"warning: IndexerScore b={b} s={s} T={t} differs from the baseline build",
                      file=sys.stderr)
            fns["kernel, baseline build"] = lambda f=feeds: base.run(None, f)
        # with a baseline build, the two builds only: the standard ops' large intermediates
        # would leave the call after them a cold cache (in turns, always the same one)
        if base is None and b * s * h * t * 4 <= args.indexer_baseline_max_gib * 2**30:
            fns["standard ops"] = lambda f=feeds: standard.run(None, f)
            if not same_bits(fused.run(None, feeds)[0], standard.run(None, feeds)[0]):
                print(f"warning: IndexerScore b={b} s={s} T={t} differs from the standard ops",
                      file=sys.stderr)
        # decode calls take a millisecond or less: many calls (as SparseAttention's)
        repeat = args.repeat * 20 if s == 1 else args.repeat
        rows += scores_rows("IndexerScore H32 D128", b, s, t, fns, repeat)
    given, where = (make_session(m, options=options) for m in indexer_candidate_models(d))
    for b, s, t in CANDIDATE_SHAPES:
        q, w, cache = indexer_call(rng, b, s, t, h, d)
        blocks = t // CANDIDATE_BLOCK_SIZE
        keep = np.zeros((b * s, blocks), bool)
        for row in keep:
            row[rng.choice(blocks, min(CANDIDATE_BLOCKS, blocks), replace=False)] = True
        cand = np.repeat(keep, CANDIDATE_BLOCK_SIZE, axis=-1).reshape(b, s, t)
        feeds = {"Q": q, "W": w, "K": cache, "T": np.array([t], np.int64),
                 "L": np.full(s, t, np.int64), "C": cand}
        if not same_bits(given.run(None, feeds)[0], where.run(None, feeds)[0]):
            print(f"warning: IndexerScore with Candidates b={b} s={s} T={t} differs from "
                  "every score and a Where", file=sys.stderr)
        fns = {"onnxruntime kernel": lambda f=feeds: given.run(None, f),
               "every score, Where": lambda f=feeds: where.run(None, f)}
        repeat = args.repeat * 5 if s == 1 else args.repeat
        rows += scores_rows("IndexerScore candidates", b, s, t, fns, repeat)
    fused, composed = (make_session(m, options=options) for m in indexer_topk_models(d))
    for b, s, t in TOPK_SHAPES:
        q, w, cache = indexer_call(rng, b, s, t, h, d)
        feeds = {"Q": q, "W": w, "K": cache, "T": np.array([t], np.int64)}
        got, want = fused.run(None, feeds), composed.run(None, feeds)
        if not (np.array_equal(got[0], want[0]) and same_bits(got[1], want[1])):
            print(f"warning: IndexerTopK b={b} s={s} T={t} differs from the ops it replaced",
                  file=sys.stderr)
        fns = {"onnxruntime kernel": lambda f=feeds: fused.run(None, f),
               "IndexerScore, TorchTopK, BlockMax": lambda f=feeds: composed.run(None, f)}
        repeat = args.repeat * 5 if s == 1 else args.repeat
        rows += scores_rows("IndexerTopK k512 blocks8", b, s, t, fns, repeat)
    return rows


ROPE_SEQUENCES = (1, 256, 1024)  # q and o: [1, s, 64, 512], rd 64


def rope_model(inverse: int) -> bytes:
    """One ApplyRope node, with the portable bodies (run as the standard ops without the
    library)."""
    from csa2onnx.custom_ops.portable import portable_functions

    vi = helper.make_tensor_value_info
    inputs = [vi("X", TensorProto.FLOAT, [1, "s", 64, 512]),
              vi("Cos", TensorProto.FLOAT, ["s", 32]), vi("Sin", TensorProto.FLOAT, ["s", 32])]
    node = helper.make_node("ApplyRope", ["X", "Cos", "Sin"], ["Y"], domain="csa2onnx",
                            rope_head_dim=64, inverse=inverse)
    graph = helper.make_graph([node], "rope", inputs,
                              [vi("Y", TensorProto.FLOAT, [1, "s", 64, 512])])
    model = helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION)
    model.functions.extend(portable_functions())
    return model.SerializeToString()


def bench_apply_rope(args: argparse.Namespace, threads: int,
                     rng: np.random.Generator) -> list[Row]:
    standard_options = ort.SessionOptions()
    standard_options.intra_op_num_threads = threads
    rows = []
    for inverse, name in ((0, "q"), (1, "o")):
        model = rope_model(inverse)
        fused = make_session(model, options=session_options(threads))
        standard = ort.InferenceSession(model, standard_options,
                                        providers=["CPUExecutionProvider"])
        for s in ROPE_SEQUENCES:
            angles = rng.uniform(0, 100, (s, 32)).astype(np.float32)
            feeds = {"X": rng.standard_normal((1, s, 64, 512)).astype(np.float32),
                     "Cos": np.cos(angles), "Sin": np.sin(angles)}
            if not same_bits(fused.run(None, feeds)[0], standard.run(None, feeds)[0]):
                print(f"warning: ApplyRope s={s} differs from the standard ops", file=sys.stderr)
            fns = {"onnxruntime kernel": lambda f=feeds, k=fused: k.run(None, f),
                   "standard ops": lambda f=feeds, k=standard: k.run(None, f)}
            for impl, seconds in interleaved_medians(fns, args.repeat).items():
                rows.append((f"ApplyRope {name} h64 d512 rd64", f"s={s}", impl, seconds,
                             s * 64 * 512 / seconds, "values/s"))
    return rows


def median_time(fn: Callable[[], Any], repeat: int, min_time: float) -> float:
    """Median seconds per call, after one warm-up call; at least `repeat` calls and
    `min_time` seconds in all."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def rate(per_second: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if per_second >= scale:
            return f"{per_second / scale:8.2f} {unit}"
    return f"{per_second:8.2f}  "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--only", choices=["linear", "fp8", "fp4", "topk", "sparse", "packed",
                                           "indexer", "rope"],
                        action="append",
                        help="run only these sections (repeatable; default: all)")
    parser.add_argument("--linear-m", type=int, nargs="+", default=[1, 256, 1024],
                        help="TorchLinear row counts (M)")
    parser.add_argument("--linear-layers", nargs="+", default=None,
                        choices=[name for name, _, _ in LINEAR_SHAPES], metavar="LAYER",
                        help="TorchLinear layers to time (default: all of "
                             f"{', '.join(name for name, _, _ in LINEAR_SHAPES)})")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for onnxruntime and torch (default: torch's count)")
    parser.add_argument("--baseline-library", default=None,
                        help="an older libcsa2onnx_ops.so to time TorchLinear, Fp8Linear "
                             "(exact) and IndexerScore against, its outputs checked bit for bit")
    parser.add_argument("--baseline-fp8-layout", choices=("exported", "plain"), default="exported",
                        help="W's layout for the baseline build's Fp8Linear: the one this build "
                             "runs (default), or plain for builds from before weight_layout")
    parser.add_argument("--sparse-torch", default=str(upstream.reference_dir() / "kernel_cpu.py"),
                        help="a file defining the reference's torch sparse_attn (default: the "
                             "upstream reference's kernel_cpu.py)")
    parser.add_argument("--sparse-decode", action="store_true",
                        help="SparseAttention: the decode shapes only (b*s <= 4)")
    parser.add_argument("--fp8-rows", default="1,4,256,1024",
                        help="comma-separated M for the Fp8Linear section")
    parser.add_argument("--fp8-weights", choices=["checkpoint", "uniform"], default="checkpoint",
                        help="Fp8Linear's weights: quantised normal values as a checkpoint holds "
                             "them, or every e4m3 code equally likely (a worst case)")
    parser.add_argument("--fp8-x", choices=["normal", "outliers"], default="normal",
                        help="Fp8Linear's X: normal values, or 1/64 of the features 40 times as "
                             "large (as LLM activations)")
    parser.add_argument("--fp8-shapes", default=None,
                        help="comma-separated KxN shapes for the Fp8Linear section (default: "
                             "the released model's fp8 linears)")
    parser.add_argument("--indexer-baseline-max-gib", type=float, default=1.5,
                        help="IndexerScore: time the standard ops only where one [s, H, T] "
                             "float32 intermediate fits in this many GiB")
    args = parser.parse_args(argv)
    sections = set(args.only or ["linear", "fp8", "fp4", "topk", "sparse", "packed", "indexer",
                                 "rope"])
    if "fp8" in sections:
        shapes = None
        if args.fp8_shapes:
            shapes = [(int(k), int(n)) for k, n in
                      (shape.split("x") for shape in args.fp8_shapes.split(","))]
        bench_fp8_linear([int(r) for r in args.fp8_rows.split(",")], args.repeat, args.min_time,
                         args.threads or 2, args.fp8_weights, shapes, args.baseline_library,
                         args.baseline_fp8_layout, args.fp8_x)
        print()

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if "linear" in sections:
        bench_linear(args.linear_m, threads, args.repeat, args.min_time, args.baseline_library,
                     args.linear_layers)
        print()
    if not sections & {"fp4", "topk", "sparse", "packed", "indexer", "rope"}:
        return 0
    options = session_options(threads)
    rng = np.random.default_rng(0)
    rows: list[tuple[str, str, str, float, float, str]] = []

    if "fp4" in sections:  # Fp4QuantDequant: normals over several binades, as activations are
        x = (rng.standard_normal((4096, 4096)) *
             np.exp2(rng.integers(-8, 8, (4096, 1)))).astype(np.float32)
        xt = torch.from_numpy(x)
        for block, fmt in ((32, "e8m0"), (16, "e4m3")):
            session = make_session(fp4_model(block, fmt), options=options)
            y, scale = session.run(None, {"X": x})
            ref_y, ref_scale = fp4_round_trip(x, block, fmt)
            t_y, t_scale = torch_fp4_round_trip(xt, block, fmt)
            for name, (oy, os_) in (("numpy", (ref_y, ref_scale)),
                                    ("torch", (t_y.numpy(), t_scale.numpy()))):
                if not (same_bits(oy, y) and same_bits(os_, scale)):
                    print(f"warning: {name} fp4 {fmt} differs from the kernel", file=sys.stderr)
            label = f"Fp4QuantDequant {fmt} b{block}"
            kernel = median_time(lambda s=session: s.run(None, {"X": x}), args.repeat,
                                 args.min_time)
            impls = {
                "onnxruntime kernel": kernel,
                "numpy reference": median_time(lambda b=block, f=fmt: fp4_round_trip(x, b, f),
                                               max(args.repeat // 2, 2), args.min_time),
                "torch ops": median_time(lambda b=block, f=fmt: torch_fp4_round_trip(xt, b, f),
                                         args.repeat, args.min_time),
            }
            for impl, seconds in impls.items():
                rows.append((label, "[4096, 4096]", impl, seconds, x.size / seconds,
                             "values/s"))

    if "topk" in sections:  # TorchTopK: plain float32 normals
        session = make_session(topk_model(), options=options)
        for n_rows, n, k in ((1024, 4096, 512), (1, 1 << 20, 512)):
            s = rng.standard_normal((n_rows, n)).astype(np.float32)
            st = torch.from_numpy(s)
            feeds = {"X": s, "K": np.array([k], np.int64)}
            values, indices = session.run(None, feeds)
            want_v, want_i = torch.topk(st, k, dim=-1, largest=True, sorted=True)
            if not (np.array_equal(indices, want_i.numpy()) and same_bits(values, want_v.numpy())):
                print("warning: TorchTopK differs from torch.topk", file=sys.stderr)
            shape = f"[{n_rows}, {n}] k={k}"
            impls = {
                "onnxruntime kernel": median_time(lambda f=feeds: session.run(None, f), args.repeat,
                                                  args.min_time),
                "torch.topk": median_time(lambda t=st, kk=k: torch.topk(t, kk, dim=-1), args.repeat,
                                          args.min_time),
            }
            for impl, seconds in impls.items():
                rows.append(("TorchTopK f32", shape, impl, seconds, n_rows / seconds, "rows/s"))

    if "sparse" in sections:
        rows += bench_sparse_attention(args, threads, rng)

    if "packed" in sections:
        rows += bench_packed(args, options, rng)

    if "indexer" in sections:
        rows += bench_indexer_score(args, threads, rng)

    if "rope" in sections:
        rows += bench_apply_rope(args, threads, rng)

    print(f"threads: onnxruntime intra_op_num_threads={threads} = torch threads, "
          f"numpy single-threaded; {os.cpu_count()} CPUs; onnxruntime {ort.__version__}, "
          f"torch {torch.__version__}, numpy {np.__version__}")
    print(f"{'op':<28} {'shape':<26} {'implementation':<20} {'median':>11} "
          f"{'throughput':>18}   kernel speed-up")
    kernel_rate: dict[tuple[str, str], float] = {}
    for op, shape, impl, seconds, per_s, unit in rows:
        if impl == "onnxruntime kernel":
            kernel_rate[op, shape] = per_s
            ratio = ""
        else:
            ratio = f"x{kernel_rate[op, shape] / per_s:7.2f}"
        print(f"{op:<28} {shape:<26} {impl:<20} {seconds * 1e3:9.2f} ms "
              f"{rate(per_s)}{unit:<9} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
