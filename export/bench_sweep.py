"""`csa2onnx bench --max-seq-len A,B,...`: does a decode step cost more at a larger
max_seq_len? The same layers, weights and inputs are exported once per max_seq_len, every
runtime is prefilled alike, and the decode steps are taken in turn (step i of every runtime
before step i+1 of any), so the load of a shared machine falls on all of them alike and the
ratios stay meaningful where absolute times do not.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from csa2onnx.export.bench import (
    BenchError,
    BenchOptions,
    SideResult,
    bench_config,
    bench_inputs,
    bench_weights,
    machine_info,
    outside_slots,
    read_bandwidth,
)
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import export_stack


@dataclass
class SweepResult:
    options: dict[str, Any]
    machine: dict[str, Any]
    layers: list[int]
    weight_format: str
    weight_bytes: int
    lengths: list[int]
    decode_ms: dict[int, list[float]]  # max_seq_len -> its decode steps, interleaved
    state_bytes: dict[int, int]  # max_seq_len -> bytes held after the decode steps
    read_bandwidth: float

    def steps(self, length: int) -> SideResult:
        """One length's decode steps, with bench's median and p90."""
        return SideResult(prefill_s=0.0, decode_ms=self.decode_ms[length], peak_rss_mib=0.0)

    def median(self, length: int) -> float:
        return self.steps(length).decode_median_ms

    def table(self) -> str:
        o = self.options
        context = o["context"] or o["prefill"]
        base = self.lengths[0]
        limit = self.weight_bytes / self.read_bandwidth * 1e3
        lines = [f"csa2onnx bench, decode vs max_seq_len: layers {self.layers[0]}.."
                 f"{self.layers[-1]}, {self.weight_format} weights, batch {o['batch']}, "
                 f"context {context}"
                 + (" (one prefill, then zero state)" if o.get("zero_context") and
                    context > o["prefill"] else "")
                 + f", {o['decode']} decode steps per max_seq_len taken in "
                 f"turn, {o['threads']} threads",
                 f"machine: {self.machine['cpu']} ({', '.join(self.machine['isa'])}); "
                 f"onnxruntime {self.machine['onnxruntime']}",
                 f"weights {self.weight_bytes / 2**20:.1f} MiB; weight-read limit {limit:.1f} "
                 f"ms ({self.read_bandwidth / 1e9:.1f} GB/s read bandwidth)", "",
                 f"{'max_seq_len':>12}{'median ms':>11}{'min ms':>9}{'p90 ms':>9}"
                 f"{'x ' + str(base):>12}{'state MiB':>11}"]
        for length in self.lengths:
            side = self.steps(length)
            lines.append(f"{length:>12}{side.decode_median_ms:>11.1f}{min(side.decode_ms):>9.1f}"
                         f"{side.decode_p90_ms:>9.1f}"
                         f"{self.median(length) / self.median(base):>12.2f}"
                         f"{self.state_bytes[length] / 2**20:>11.2f}")
        return "\n".join(lines)

    def to_json(self) -> str:
        data = asdict(self) | {"median_ms": {n: self.median(n) for n in self.lengths}}
        return json.dumps(data, indent=1)


def run_sweep(opts: BenchOptions, lengths: list[int],
              progress: Callable[[str], None] | None = None) -> SweepResult:
    if len(set(lengths)) != len(lengths) or len(lengths) < 2:
        raise BenchError(f"a max_seq_len sweep needs two or more distinct lengths, got {lengths}")
    if opts.baseline:
        raise BenchError("a max_seq_len sweep times csa2onnx only; drop --baseline")
    say = progress or (lambda text: None)
    configs = {n: bench_config(replace(opts, max_seq_len=n)) for n in lengths}
    config = configs[lengths[0]]
    first, last = opts.layers or (0, config.n_layers - 1)
    context = opts.context or opts.prefill
    if context + opts.decode > min(lengths):
        raise BenchError(f"context {context} + {opts.decode} decode steps is past "
                         f"max_seq_len {min(lengths)}")
    plans = {n: plan_stack(configs[n], first, last) for n in lengths}
    layers = [p.layer for p in plans[lengths[0]].layers]
    say("weights")
    weights = bench_weights(opts, config, plans[lengths[0]])  # max_seq_len sizes no weight
    weight_bytes = sum(a.nbytes for w in weights.values() for a in w.values())
    with tempfile.TemporaryDirectory(prefix="csa2onnx-sweep-") as tmp:
        runtimes, slots = {}, {}
        for n in lengths:
            say(f"export max_seq_len {n}")
            folder = Path(tmp) / str(n)
            export_stack(plans[n], weights, folder)
            runtimes[n] = AttentionRuntime(folder, intra_op_num_threads=opts.threads,
                                           spinning=False, grow_caches=opts.state == "grow",
                                           in_place=opts.state != "copy")
            slots[n] = outside_slots(runtimes[n], configs[n], opts.batch)
        rng = np.random.default_rng(opts.seed + 1)
        for n in lengths:  # warm-up, not timed: the timed prefill starts a new sequence
            runtimes[n].prefill(bench_inputs(rng, layers, opts.batch, min(16, opts.prefill),
                                             config.dim), slots[n])
            runtimes[n].decode(bench_inputs(rng, layers, opts.batch, 1, config.dim), slots[n])
        rng = np.random.default_rng(opts.seed + 2)
        for start in range(0, opts.prefill if opts.zero_context else context, opts.prefill):
            say(f"prefill {start}/{context}")
            xs = bench_inputs(rng, layers, opts.batch, min(opts.prefill, context - start),
                              config.dim)
            for n in lengths:
                runtimes[n].prefill(xs, slots[n], start_pos=start)
        if opts.zero_context:  # the rest of the context: zero state (bench --zero-context)
            for n in lengths:
                runtimes[n].skip_to(context)
        decode_ms: dict[int, list[float]] = {n: [] for n in lengths}
        for step in range(opts.decode):
            say(f"decode {step + 1}/{opts.decode}")
            xs = bench_inputs(rng, layers, opts.batch, 1, config.dim)
            for n in lengths:
                t0 = time.perf_counter()
                runtimes[n].decode(xs, slots[n])
                decode_ms[n].append((time.perf_counter() - t0) * 1e3)
        state_bytes = {n: runtimes[n].state_bytes() for n in lengths}
        del runtimes
    return SweepResult(options=asdict(opts) | {"source": str(opts.source),
                                               "upstream": str(opts.upstream)},
                       machine=machine_info(), layers=layers,
                       weight_format=config.weight_format, weight_bytes=weight_bytes,
                       lengths=lengths, decode_ms=decode_ms, state_bytes=state_bytes,
                       read_bandwidth=read_bandwidth(opts.threads))
