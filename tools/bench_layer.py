"""Benchmark one attention layer at DeepSeek-V4.1-Flash dims: csa2onnx vs the torch oracle
(a script, not a test).

    python tools/bench_layer.py [--prefill 256 1024] [--decode-steps 16]

Per case (layer range, max_seq_len), in one process: random bf16-valued weights (std 0.02;
norm weights 1 + 0.02 noise; attn_sink and the ratio > 1 compressor wkv/wgate f32), exported
with csa2onnx.export.stack.export_stack and run by AttentionRuntime (CPU, custom ops), and the
same layers, weights and inputs run by tools/torch_reference.py (bf16 tensors on the CPU).
Schedule: a prefill of P tokens, then `--decode-steps` decode steps; reported: the prefill
time, the median decode-step time, and the ratio oracle/csa2onnx (> 1: csa2onnx is faster).
The outputs are compared (max |diff| and the fraction of bf16-identical `out` elements) on
the prefill and on the last decode step, so the timings compare the same work. Each case
first runs an untimed warm-up (a 64-token prefill and 2 decode steps) on both sides.

Cases: L0 (window only), L2 (ratio 2, kv source + index-key owner), L2..3 (L3 is a ratio-2
consumer of L2's cache and selection, so it runs with its source; the oracle's per-layer time
for L3 is shown too), and L2 at a long max_seq_len (csa2onnx's decode graph copies whole
caches each step, so its decode time grows with max_seq_len).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import torch

from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import StackPlan, plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import export_stack
from csa2onnx.export.weights import expected_shapes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "export" / "configs" / "v41_flash_attention.json"
THREADS = 2
WARMUP_P = 64


def load_oracle() -> ModuleType:
    spec = importlib.util.spec_from_file_location("torch_reference",
                                                  ROOT / "tools" / "torch_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_reference"] = module
    spec.loader.exec_module(module)
    return module


tr = load_oracle()


def bf16_values(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def make_weights(plan: StackPlan, seed: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out: dict[int, dict[str, np.ndarray]] = {}
    for p in plan.layers:
        layer: dict[str, np.ndarray] = {}
        for name, shape in expected_shapes(plan.config, p).items():
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            if name.endswith("norm.weight"):
                w += np.float32(1.0)
            if tr.parameter_dtype(name, p.ratio) == torch.bfloat16:
                w = bf16_values(w)
            layer[name] = w
        out[p.layer] = layer
    return out


def oracle_weights(plan: StackPlan, weights: dict[int, dict[str, np.ndarray]]
                   ) -> dict[int, dict[str, torch.Tensor]]:
    return {p.layer: {name: torch.from_numpy(w).to(tr.parameter_dtype(name, p.ratio))
                      for name, w in weights[p.layer].items()} for p in plan.layers}


class Oracle:
    """The torch oracle's layers for a range, sharing one SharedAttentionRuntime."""

    def __init__(self, args: dict[str, Any], plan: StackPlan,
                 weights: dict[int, dict[str, torch.Tensor]]) -> None:
        shared = tr.SharedAttentionRuntime()
        self.layers = [tr.Attention(args, p.layer, weights[p.layer], shared)
                       for p in plan.layers]

    @torch.inference_mode()
    def step(self, xs: dict[int, np.ndarray], start_pos: int
             ) -> tuple[dict[int, np.ndarray], dict[int, float]]:
        outs, times = {}, {}
        for layer in self.layers:
            x = torch.from_numpy(xs[layer.layer]).to(torch.bfloat16)
            t0 = time.perf_counter()
            o = layer.forward(x, start_pos, lambda name, value: None)
            times[layer.layer] = time.perf_counter() - t0
            outs[layer.layer] = o.float().numpy()
        return outs, times


def agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max |diff|, fraction of elements identical after rounding both to bf16)."""
    a, b = bf16_values(ours), bf16_values(theirs)
    return float(np.abs(a - b).max()), float((a.view(np.uint32) == b.view(np.uint32)).mean())


@dataclass
class Row:
    case: str
    max_seq_len: int
    prefill: int
    ort_prefill: float
    ref_prefill: float
    ort_decode: float
    ref_decode: float
    ref_layer_prefill: dict[int, float] = field(default_factory=dict)
    ref_layer_decode: dict[int, float] = field(default_factory=dict)
    agree_prefill: dict[int, tuple[float, float]] = field(default_factory=dict)
    agree_decode: dict[int, tuple[float, float]] = field(default_factory=dict)


def run_schedule(runtime: AttentionRuntime, oracle: Oracle, plan: StackPlan, p_len: int,
                 steps: int, seed: int, slots: dict[str, np.ndarray]) -> tuple[Row, ...]:
    rng = np.random.default_rng(seed)
    dim = plan.config.dim

    def inputs(s: int) -> dict[int, np.ndarray]:
        return {p.layer: bf16_values(rng.standard_normal((1, s, dim), dtype=np.float32))
                for p in plan.layers}

    xs = inputs(p_len)
    t0 = time.perf_counter()
    ours = runtime.prefill(xs, slots).out
    ort_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs, ref_layer_prefill = oracle.step(xs, 0)
    ref_prefill = time.perf_counter() - t0
    agree_prefill = {k: agreement(ours[k], theirs[k]) for k in ours}
    ort_times: list[float] = []
    ref_times: list[float] = []
    ref_layer_all: dict[int, list[float]] = {p.layer: [] for p in plan.layers}
    for step in range(steps):
        xs = inputs(1)
        t0 = time.perf_counter()
        ours = runtime.decode(xs, slots).out
        ort_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        theirs, per_layer = oracle.step(xs, p_len + step)
        ref_times.append(time.perf_counter() - t0)
        for k, v in per_layer.items():
            ref_layer_all[k].append(v)
    agree_decode = {k: agreement(ours[k], theirs[k]) for k in ours}
    return (Row("", 0, p_len, ort_prefill, ref_prefill, statistics.median(ort_times),
                statistics.median(ref_times), ref_layer_prefill,
                {k: statistics.median(v) for k, v in ref_layer_all.items()},
                agree_prefill, agree_decode),)


def bench_case(name: str, first: int, last: int, max_seq_len: int, prefills: list[int],
               steps: int, seed: int) -> list[Row]:
    # bf16 linears: the released config says fp8, which the graphs do not take yet
    config = AttentionConfig.load(CONFIG, max_seq_len=max_seq_len, max_batch_size=1,
                                  weight_format="bf16")
    plan = plan_stack(config, first, last)
    args = config.to_dict()
    t0 = time.perf_counter()
    weights = make_weights(plan, seed)
    ref_weights = oracle_weights(plan, weights)
    t_weights = time.perf_counter() - t0
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench_layer_") as tmp:
        t0 = time.perf_counter()
        folder = export_stack(plan, weights, tmp)
        t_export = time.perf_counter() - t0
        del weights
        t0 = time.perf_counter()
        runtime = AttentionRuntime(folder, intra_op_num_threads=THREADS)
        t_load = time.perf_counter() - t0
        slots: dict[str, np.ndarray] = {}
        for slot in runtime.manifest.external_slots:
            if slot != "index_k":
                raise SystemExit(f"{name}: external slot {slot!r} not supported here")
            slots[slot] = np.zeros((1, 0, config.index_head_dim), np.float32)
        print(f"[{name} @ {max_seq_len}] weights {t_weights:.1f}s, export {t_export:.1f}s, "
              f"session load {t_load:.1f}s, external slots {list(slots)}", flush=True)
        run_schedule(runtime, Oracle(args, plan, ref_weights), plan, WARMUP_P, 2, seed + 1,
                     slots)  # warm-up
        for i, p_len in enumerate(prefills):
            t0 = time.perf_counter()
            (row,) = run_schedule(runtime, Oracle(args, plan, ref_weights), plan, p_len, steps,
                                  seed + 2 + i, slots)
            row.case, row.max_seq_len = name, max_seq_len
            rows.append(row)
            print(f"  P={p_len}: {time.perf_counter() - t0:.1f}s", flush=True)
        del runtime
    return rows


def print_table(rows: list[Row]) -> None:
    head = (f"{'case':<7}{'max_len':>8}{'P':>6} | {'prefill s':>9}{'ours s':>8}{'ratio':>7} | "
            f"{'decode ms':>9}{'ours ms':>8}{'ratio':>7} | "
            "out last step: max|d|, bf16-same")
    print("\n(prefill/decode: oracle time; ours: csa2onnx; ratio = oracle / csa2onnx, "
          "> 1 means csa2onnx is faster; decode = median step)")
    print(head)
    print("-" * len(head))
    for r in rows:
        agree = "; ".join(f"L{k} {d:.2g}, {f:.4%}" for k, (d, f) in r.agree_decode.items())
        print(f"{r.case:<7}{r.max_seq_len:>8}{r.prefill:>6} | {r.ref_prefill:>9.3f}"
              f"{r.ort_prefill:>8.3f}{r.ref_prefill / r.ort_prefill:>7.2f} | "
              f"{r.ref_decode * 1e3:>9.1f}{r.ort_decode * 1e3:>8.1f}"
              f"{r.ref_decode / r.ort_decode:>7.2f} | {agree}")
    print("\nprefill out agreement (max|d|, bf16-same) and the oracle's per-layer times:")
    for r in rows:
        agree = "; ".join(f"L{k} {d:.2g}, {f:.4%}" for k, (d, f) in r.agree_prefill.items())
        layers = ", ".join(f"L{k} {r.ref_layer_prefill[k]:.3f}s / "
                           f"{r.ref_layer_decode[k] * 1e3:.1f}ms" for k in r.ref_layer_prefill)
        print(f"  {r.case:<6} {r.max_seq_len:>6} P={r.prefill:<5} {agree} | oracle {layers}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--long-seq-len", type=int, default=65536,
                        help="a second max_seq_len for L2 (first prefill length only)")
    parser.add_argument("--cases", nargs="+", default=["L0", "L2", "L2..3", "L2-long"],
                        choices=["L0", "L2", "L2..3", "L2-long"])
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    start = time.perf_counter()
    ranges = {"L0": (0, 0), "L2": (2, 2), "L2..3": (2, 3), "L2-long": (2, 2)}
    rows: list[Row] = []
    for case in opts.cases:
        first, last = ranges[case]
        long = case == "L2-long"
        rows += bench_case(case, first, last, opts.long_seq_len if long else opts.max_seq_len,
                           opts.prefill[:1] if long else opts.prefill, opts.decode_steps,
                           opts.seed)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - start:.0f}s (torch {torch.__version__}, "
          f"{THREADS} threads both sides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
