"""`csa2onnx bench` with several values of --prefill, --batch, --threads or --context: every
scenario in one run and one table, on one set of weights.

Scenarios: each prefill length with each batch and thread count (decoding right after it),
then each --context longer than every prefill length, reached by chunked prefill in calls of
the largest one, or with --zero-context by one such call and zero state (a decode step at a
long context). Each scenario is one `run_bench`: a fresh
export and session, and, with --baseline upstream, upstream's layers on the same weights and
inputs in the same process, run right after ours.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import product

from csa2onnx.export.bench import (
    BenchError,
    BenchOptions,
    BenchResult,
    bench_config,
    bench_weights,
    machine_info,
    run_bench,
    to_json,
)
from csa2onnx.export.plan import plan_stack


@dataclass(frozen=True)
class Scenario:
    threads: int
    batch: int
    prefill: int  # tokens per prefill call
    context: int  # tokens before decoding
    numerics: str = "exact"
    zeros: bool = False  # the context reached by one prefill and zero state (--zero-context)

    @property
    def how(self) -> str:
        """How the context was reached, if not by one prefill: ' (N calls)' or ' (zeros)'."""
        if self.context == self.prefill:
            return ""
        return " (zeros)" if self.zeros else f" ({-(-self.context // self.prefill)} calls)"

    @property
    def one_prefill(self) -> bool:
        """Whether its prefill is one call (upstream's, which the table compares)."""
        return self.context == self.prefill or self.zeros

    @property
    def label(self) -> str:
        chunked = self.how
        return f"{self.threads:>7}{self.batch:>6}{self.context:>8}{chunked:<13}{self.numerics:>9}"

    @property
    def exact(self) -> Scenario:
        """The same scenario in exact numerics (whose upstream run a fast row shares)."""
        return replace(self, numerics="exact")


def scenarios(prefills: list[int], batches: list[int], threads: list[int],
              contexts: list[int], numerics: list[str] | None = None,
              zeros: bool = False) -> list[Scenario]:
    longest = max(prefills)
    for c in contexts:
        if c <= longest:
            raise BenchError(f"a --context of a bench matrix must be longer than every "
                             f"--prefill (the largest is {longest}), got {c}")
    kinds = sorted(numerics or ["exact"], key=lambda n: n != "exact")  # exact first
    out = [Scenario(t, b, p, p, n) for t, b, p, n in product(threads, batches, prefills, kinds)]
    out += [Scenario(t, b, longest, c, n, zeros)
            for t, b, c, n in product(threads, batches, contexts, kinds)]
    return out


@dataclass
class MatrixResult:
    options: dict
    machine: dict
    rows: list[tuple[Scenario, BenchResult]]

    def table(self) -> str:
        first = self.rows[0][1]
        upstream = first.upstream is not None
        both = len({s.numerics for s, _ in self.rows}) > 1
        bandwidth: dict[int, list[float]] = {}
        for s, r in self.rows:
            bandwidth.setdefault(s.threads, []).extend(
                b / 1e9 for b in (r.ours.read_bandwidths or [r.read_bandwidth]))
        lines = [f"csa2onnx bench matrix: layers {first.layers[0]}..{first.layers[-1]}, "
                 f"{first.weight_format} weights ({first.weight_bytes / 2**20:.1f} MiB), "
                 f"{self.options['decode']} decode steps per scenario"
                 + (", upstream beside (same process, same weights and inputs)"
                    if upstream else ""),
                 f"machine: {self.machine['cpu']} ({', '.join(self.machine['isa'])}), "
                 f"{self.machine['cores']} cores; onnxruntime {self.machine['onnxruntime']}"
                 + (f", torch {self.machine['torch']}" if "torch" in self.machine else ""),
                 "read bandwidth, measured with each scenario (its limit uses its own; "
                 "large weights: read in place after each decode step): "
                 + ", ".join(f"{t} threads {min(bw):.1f}-{max(bw):.1f} GB/s"
                             for t, bw in sorted(bandwidth.items())),
                 "", f"{'threads':>7}{'batch':>6}{'context':>8}{'':<13}{'numerics':>9}"
                 f"{'prefill s':>10}" + (f"{'upstream':>10}{'x up':>7}" if upstream else "")
                 + (f"{'x exact':>8}" if both else "")
                 + f"{'decode ms':>10}" + (f"{'upstream':>10}{'x up':>7}" if upstream else "")
                 + (f"{'x exact':>8}" if both else "")
                 + f"{'limit ms':>9}{'x limit':>8}{'peak MiB':>9}"
                 + (f"{'upstream':>9}" if upstream else "")]
        exact = {s: r for s, r in self.rows if s.numerics == "exact"}
        for s, r in self.rows:
            o, u = r.ours, r.upstream
            base = exact.get(s.exact)

            def vs_exact(ours: float, theirs: float | None) -> str:
                if not both:
                    return ""
                return f"{ours / theirs:>8.2f}" if theirs else f"{'':>8}"

            line = s.label + f"{o.prefill_s:>10.3f}"
            if u is not None:  # upstream prefills one call (the first chunk) of a context
                line += (f"{u.prefill_s:>10.3f}{o.prefill_s / u.prefill_s:>7.2f}"
                         if s.one_prefill else f"{'':>10}{'':>7}")
            line += vs_exact(o.prefill_s, base.ours.prefill_s if base else None)
            decode = o.decode_median_ms
            line += f"{decode:>10.1f}"
            if u is not None:
                line += f"{u.decode_median_ms:>10.1f}{decode / u.decode_median_ms:>7.2f}"
            line += vs_exact(decode, base.ours.decode_median_ms if base else None)
            limit = r.weight_read_limit_ms
            line += f"{limit:>9.1f}{r.x_limit:>8.2f}{o.peak_rss_mib:>9.0f}"
            if u is not None:
                line += f"{u.peak_rss_mib:>9.0f}"
            lines.append(line)
        lines.append("x up: csa2onnx's time / upstream's (below 1: csa2onnx is faster); x limit: "
                     "decode time / (weight bytes / read bandwidth at that thread count), "
                     "the median over steps of each step against the read right after it "
                     "(limit ms: at the median bandwidth); "
                     "peak: the process's resident high-water mark during each side's run "
                     "(each holds the bench's copy of the weights"
                     + ("" if first.separate_peaks else "; not reset between sides here")
                     + "); "
                     "a chunked context's prefill s is all its calls (upstream's column then "
                     "blank: it prefills one call and decodes past it); (zeros): one prefill "
                     "call, then decode at the context with zero state between, both sides"
                     + ("; x exact: a fast row's time / the exact row's (upstream runs once "
                        "per scenario, beside both)" if both else ""))
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"options": self.options, "machine": self.machine,
                           "rows": [{"scenario": asdict(s), "result": json.loads(to_json(r))}
                                    for s, r in self.rows]}, indent=1)


def scenario_summary(s: Scenario, r: BenchResult) -> str:
    """One finished scenario in a line (printed as soon as it ends: a run cut short by a
    time limit still reports what it measured)."""
    o, u = r.ours, r.upstream

    def up(ours: float, theirs: float | None, digits: int) -> str:
        return f" (upstream {theirs:.{digits}f}, x up {ours / theirs:.2f})" if theirs else ""

    prefill_up = u.prefill_s if u is not None and s.one_prefill else None
    return (f"threads {s.threads}, batch {s.batch}, context {s.context}{s.how}, {s.numerics}: "
            f"prefill {o.prefill_s:.3f} s{up(o.prefill_s, prefill_up, 3)}, "
            f"decode {o.decode_median_ms:.1f} ms"
            f"{up(o.decode_median_ms, u.decode_median_ms if u else None, 1)}, "
            f"x limit {r.x_limit:.2f}, peak {o.peak_rss_mib:.0f} MiB")


def run_matrix(opts: BenchOptions, prefills: list[int], batches: list[int],
               threads: list[int], contexts: list[int],
               progress: Callable[[str], None] | None = None,
               numerics: list[str] | None = None,
               finished: Callable[[str], None] | None = None) -> MatrixResult:
    """Every scenario; `progress` hears each stage, `finished` each scenario's summary
    line as it ends."""
    say = progress or (lambda text: None)
    todo = scenarios(prefills, batches, threads, contexts, numerics, opts.zero_context)
    config = bench_config(opts)
    longest = max(s.context for s in todo)  # checked before any runs, not when it comes
    if longest + opts.decode > config.max_seq_len:
        raise BenchError(f"context {longest} + {opts.decode} decode steps is past "
                         f"max_seq_len {config.max_seq_len}")
    first, last = opts.layers or (0, config.n_layers - 1)
    say("weights")
    weights = bench_weights(opts, config, plan_stack(config, first, last))  # no batch in them
    rows = []
    machine = machine_info()
    for i, s in enumerate(todo):
        def step(text: str, i: int = i) -> None:
            say(f"scenario {i + 1}/{len(todo)}: {text}")

        shared = next((r for e, r in rows if e == s.exact), None)  # its exact row's upstream
        result = run_bench(replace(opts, threads=s.threads, batch=s.batch, prefill=s.prefill,
                                   context=s.context, numerics=s.numerics,
                                   baseline=None if shared else opts.baseline), step, weights)
        if shared is not None:
            result.upstream, result.agreement = shared.upstream, {}
        machine |= result.machine
        rows.append((s, result))
        if finished is not None:
            finished(f"scenario {i + 1}/{len(todo)}: {scenario_summary(s, result)}")
    return MatrixResult(options=asdict(opts) | {"source": str(opts.source),
                                                "upstream": str(opts.upstream),
                                                "prefills": prefills, "batches": batches,
                                                "threads": threads, "contexts": contexts,
                                                "numerics": numerics or ["exact"]},
                        machine=machine, rows=rows)
