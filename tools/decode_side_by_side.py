"""Decode steps of the same stack with fp8 and with bf16 weights, side by side (a script,
not a test).

    python tools/decode_side_by_side.py CONFIG [--layers 0-2] [--batch 1,4] [--prefill 1024]
        [--steps 20] [--threads 2] [--numerics exact]

`csa2onnx bench` runs one weight format per run, and on a shared host the memory bandwidth
can move by 2-4x between runs, which is as large as the difference being asked about. Here
one process exports both (random weights of each format, the same config), prefills both,
then runs their decode steps in turns, fp8 then bf16, so a load shared with other processes
hits them alike; each time is the median over the steps (the first two of each are warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from csa2onnx.export.bench import (
    BenchOptions,
    bench_config,
    bench_inputs,
    bench_weights,
    machine_info,
    outside_slots,
)
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import export_stack

FORMATS = ("fp8", "bf16")
WARM_STEPS = 2


def side_by_side(source: Path, layers: tuple[int, int], batch: int, prefill: int, steps: int,
                 threads: int, numerics: str, folder: Path) -> dict[str, list[float]]:
    """Decode step times (ms) per weight format, steps taken in turns after one prefill each."""
    rng = np.random.default_rng(0)
    runs = {}
    for fmt in FORMATS:
        opts = BenchOptions(source=source, layers=layers, weights=f"random-{fmt}", batch=batch,
                            prefill=prefill, decode=steps, threads=threads, numerics=numerics)
        config = bench_config(opts)
        plan = plan_stack(config, *layers)
        if prefill + steps + WARM_STEPS > config.max_seq_len:
            raise SystemExit(f"prefill {prefill} + {steps + WARM_STEPS} steps is past "
                             f"max_seq_len {config.max_seq_len}")
        out = folder / fmt
        export_stack(plan, bench_weights(opts, config, plan), out, numerics=numerics)
        runtime = AttentionRuntime(out, intra_op_num_threads=threads, spinning=False)
        slots = outside_slots(runtime, config, batch)
        ids = [p.layer for p in plan.layers]
        runtime.prefill(bench_inputs(rng, ids, batch, prefill, config.dim), slots)
        runs[fmt] = (runtime, slots, ids, config.dim)
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for step in range(steps + WARM_STEPS):
        for fmt, (runtime, slots, ids, dim) in runs.items():
            xs = bench_inputs(rng, ids, batch, 1, dim)
            t0 = time.perf_counter()
            runtime.decode(xs, slots)
            if step >= WARM_STEPS:
                times[fmt].append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a config.json")
    parser.add_argument("--layers", default="0-2", help="a range FIRST-LAST")
    parser.add_argument("--batch", default="1,4", help="batch sizes, separated by commas")
    parser.add_argument("--prefill", type=int, default=1024, help="tokens before decoding")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per format")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument("--numerics", choices=["exact", "fast"], default="exact")
    args = parser.parse_args(argv)
    first, _, last = args.layers.partition("-")
    layers = (int(first), int(last or first))
    machine = machine_info()
    print(f"decode side by side: {args.source.name}, layers {layers[0]}..{layers[1]}, "
          f"{args.numerics} numerics, {args.threads} threads, after a {args.prefill}-token "
          f"prefill, {args.steps} steps each in turns; {machine['cpu']} "
          f"({', '.join(machine['isa'])}), {machine['cores']} cores, onnxruntime "
          f"{machine['onnxruntime']}")
    print(f"{'batch':>5} {'fp8 ms':>14} {'bf16 ms':>14} {'fp8 / bf16':>10}   (median (min))")
    for batch in (int(b) for b in args.batch.split(",")):
        with tempfile.TemporaryDirectory(prefix="csa2onnx-side-") as tmp:
            times = side_by_side(args.source, layers, batch, args.prefill, args.steps,
                                 args.threads, args.numerics, Path(tmp))
        med = {fmt: statistics.median(t) for fmt, t in times.items()}
        cells = [f"{med[f]:7.1f} ({min(times[f]):5.1f})" for f in FORMATS]
        print(f"{batch:>5} {cells[0]:>14} {cells[1]:>14} {med['fp8'] / med['bf16']:>10.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
