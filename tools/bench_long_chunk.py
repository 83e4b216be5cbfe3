"""A prefill chunk deep into a long context: its time and the memory it takes above the
runtime's resident set. `csa2onnx bench --zero-context` times decode steps there; this times
prefill chunks there (the calls a long prompt's chunked prefill makes at its end).

    python tools/bench_long_chunk.py [--context 1048064] [--chunk 256] [--chunks 2]
        [--layers 20-24] [--weights random-fp8] [--threads 2] [--profile]

One prefill of a few tokens, then `AttentionRuntime.skip_to(context)` (zero state up to it,
as `--zero-context` does), then `--chunks` prefill calls of `--chunk` tokens from there. For
each: seconds, and the peak resident memory above what the runtime held before the first
(VmHWM, reset once: a later chunk's peak includes what earlier ones left resident).
`--profile`: onnxruntime's per-op totals, by op and layer (an If's time includes the ops of
its branches). The outputs are no model's (random inputs, zero state), and are not checked.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from csa2onnx.export import bench
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import export_stack

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path,
                        default=ROOT / "export/configs/v41_flash_attention.json")
    parser.add_argument("--layers", default="20-24", help="FIRST-LAST")
    parser.add_argument("--weights", default="random-fp8", help="random-bf16 | random-fp8")
    parser.add_argument("--context", type=int, default=1048064, help="tokens before the chunks")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=1048576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    first, last = (int(v) for v in args.layers.split("-"))
    end = args.context + args.chunk * args.chunks
    if end > args.max_seq_len:
        parser.error(f"--context + --chunk * --chunks = {end} is past --max-seq-len "
                     f"{args.max_seq_len}")

    opts = bench.BenchOptions(source=args.config, layers=(first, last), weights=args.weights,
                              max_seq_len=args.max_seq_len, threads=args.threads)
    config = bench.bench_config(opts)
    plan = plan_stack(config, first, last)
    layers = [p.layer for p in plan.layers]
    machine = bench.machine_info()
    print(f"{machine['cpu']}, {args.threads} threads; onnxruntime {machine['onnxruntime']}; "
          f"layers {first}..{last}, {args.weights}, chunks of {args.chunk} from {args.context}")
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as folder:
        export_stack(plan, bench.bench_weights(opts, config, plan), Path(folder))
        rt = AttentionRuntime(folder, intra_op_num_threads=args.threads, spinning=False,
                              profile_prefix=Path(folder) / "profile" if args.profile else None)
        slots = bench.outside_slots(rt, config, 1)
        rt.prefill(bench.bench_inputs(rng, layers, 1, 16, config.dim), slots)
        rt.skip_to(args.context)
        bench.reset_peak_rss()
        base = bench.rss_mib()
        for _ in range(args.chunks):
            xs = bench.bench_inputs(rng, layers, 1, args.chunk, config.dim)
            start = time.perf_counter()
            rt.prefill(xs, slots, start_pos=rt.position)
            print(f"chunk of {args.chunk} at {rt.position - args.chunk}: "
                  f"{time.perf_counter() - start:.2f} s, peak "
                  f"{bench.peak_rss_mib() - base:.0f} MiB above the resident {base:.0f} MiB",
                  flush=True)
        del rt  # its sessions end: onnxruntime writes their profiles
        if args.profile:
            print_profile(sorted(Path(folder).glob("profile_prefill*.json")))


def print_profile(files: list[Path]) -> None:
    """Per (op, layer) kernel time over the prefill session's runs (the first, a few tokens,
    included), the largest first."""
    for path in files:
        totals: collections.Counter = collections.Counter()
        for event in json.loads(path.read_text()):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                layer = event["name"].split("/")[0]
                totals[(event["args"]["op_name"], layer)] += event["dur"]
        print(path.name)
        for (op, layer), microseconds in totals.most_common(14):
            print(f"  {op:24s} {layer:10s} {microseconds / 1e6:8.2f} s")


if __name__ == "__main__":
    main()
