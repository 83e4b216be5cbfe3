"""`csa2onnx bench`: time a stack of attention layers at any config's dims, and optionally
the same layers, weights and inputs in the upstream PyTorch reference side by side.

csa2onnx runs first and is measured completely (its sessions never spin: the option
`session.intra_op.allow_spinning` is off), then torch is loaded and timed, so neither
side's idle threads take a core while the other is timed. Upstream is reference material:
it is loaded from its folder by path (`--upstream`, default ../shared/reference beside the
checkout or $CSA2ONNX_UPSTREAM) only when `--baseline upstream` asks for it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort

from csa2onnx.custom_ops.constants import packed_row_bytes
from csa2onnx.export.checkpoint import open_checkpoint
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import StackPlan, plan_stack
from csa2onnx.export.runtime import AttentionRuntime, page_returner
from csa2onnx.export.stack import export_stack
from csa2onnx.export.synthetic import attention_tensors
from csa2onnx.export.weights import LayerWeights
from csa2onnx.graphs.kv_cache import INDEX_KEY_FORMAT
from csa2onnx.graphs.standalone import IR_VERSION

ROOT = Path(__file__).resolve().parents[1]


class BenchError(ValueError):
    """A benchmark that cannot run as asked."""


@dataclass
class BenchOptions:
    source: Path  # a config file or a Hugging Face model folder
    layers: tuple[int, int] | None = None
    weights: str = "random-bf16"  # random-bf16 | random-fp8 | a model folder
    prefill: int = 256  # tokens per prefill call (a chunk, when context is larger)
    context: int | None = None  # tokens before decoding (default: prefill), by chunked prefill
    decode: int = 16
    batch: int = 1
    max_seq_len: int | None = None
    threads: int = 2
    seed: int = 0
    baseline: str | None = None  # "upstream"
    upstream: Path | None = None
    state: str = "grow"  # grow | full (in place, max_seq_len rows) | copy (no in-place binding)
    share_weights: bool = True
    prefill_arena: bool = False  # keep onnxruntime's CPU arena in the prefill session
    numerics: str = "exact"  # exact | fast: the export's (custom_ops/ops.py)
    # reach the context by one prefill and zeros (AttentionRuntime.skip_to), as upstream does
    zero_context: bool = False


@dataclass
class SideResult:
    """One implementation's timings (seconds) and memory."""

    prefill_s: float
    decode_ms: list[float]
    peak_rss_mib: float  # the process's high-water mark during this side (reset before it)
    held_mib: float = 0.0  # resident memory this side added (setup to end of its run)
    loaded_mib: float = 0.0  # resident memory its setup added (sessions / layers built)
    setup_s: float = 0.0  # csa2onnx: session creation; upstream: building the layers
    # bytes/s read from the weights where they lie, right after each decode step (csa2onnx,
    # large weights only): the host's bandwidth moves by half within a run, so each step is
    # judged against the bandwidth of its own moment
    read_bandwidths: list[float] = field(default_factory=list)

    @property
    def decode_median_ms(self) -> float:
        return statistics.median(self.decode_ms) if self.decode_ms else float("nan")

    @property
    def decode_p90_ms(self) -> float:
        if not self.decode_ms:
            return float("nan")
        ordered = sorted(self.decode_ms)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


@dataclass
class BenchResult:
    options: dict[str, Any]
    machine: dict[str, Any]
    layers: list[int]
    weight_format: str
    weight_bytes: int
    state_bytes: int
    export_s: float
    ours: SideResult
    read_bandwidth: float = 0.0  # bytes/s this machine reads at the bench's thread count
    # (the median of ours.read_bandwidths when measured between steps)
    upstream: SideResult | None = None
    agreement: dict[str, float] = field(default_factory=dict)
    separate_peaks: bool = False  # each side's peak RSS is its own (reset before it)

    @property
    def context(self) -> int:
        return self.options["context"] or self.options["prefill"]

    @property
    def weight_read_limit_ms(self) -> float:
        """The least a decode step can take: every weight read once from memory."""
        return self.weight_bytes / self.read_bandwidth * 1e3 if self.read_bandwidth else 0.0

    @property
    def x_limit(self) -> float:
        """csa2onnx's decode time over the weight-read limit: the median over steps of each
        step against the bandwidth measured right after it, where that was measured."""
        o = self.ours
        if o.read_bandwidths and len(o.read_bandwidths) == len(o.decode_ms):
            return statistics.median(ms * 1e-3 * bw / self.weight_bytes
                                     for ms, bw in zip(o.decode_ms, o.read_bandwidths,
                                                          strict=True))
        limit = self.weight_read_limit_ms
        return o.decode_median_ms / limit if limit else float("nan")

    def table(self) -> str:
        o, u = self.ours, self.upstream
        zeros = self.options.get("zero_context", False) and self.context > self.options["prefill"]
        chunked = self.context > self.options["prefill"] and not zeros
        tokens = self.context * self.options["batch"]
        prefill = (f"context {self.context} by chunked prefill of {self.options['prefill']}"
                   if chunked else f"prefill {self.options['prefill']}")
        if zeros:
            prefill += f", then decode at context {self.context} (zero state between)"
            tokens = self.options["prefill"] * self.options["batch"]
        lines = [f"csa2onnx bench: layers {self.layers[0]}..{self.layers[-1]}, "
                 f"{self.weight_format} weights, batch {self.options['batch']}, "
                 f"{prefill}, {self.options['decode']} decode steps, "
                 f"max_seq_len {self.options['max_seq_len']}, {self.options['threads']} threads, "
                 f"{self.options.get('numerics', 'exact')} numerics",
                 f"machine: {self.machine['cpu']} ({', '.join(self.machine['isa'])}); "
                 f"onnxruntime {self.machine['onnxruntime']}"
                 + (f", torch {self.machine['torch']}" if "torch" in self.machine else ""),
                 f"weights {self.weight_bytes / 2**20:.1f} MiB, state "
                 f"{self.state_bytes / 2**20:.1f} MiB ({self.options['state']} caches), "
                 f"export {self.export_s:.1f} s, "
                 f"session creation {o.setup_s:.1f} s",
                 "",
                 f"{'':<24}{'csa2onnx':>12}" + (f"{'upstream':>12}{'ratio':>8}" if u else "")]

        def row(name: str, ours: float, theirs: float | None, fmt: str,
                higher_is_better: bool = False) -> str:
            text = f"{name:<24}{ours:>12{fmt}}"
            if theirs is not None:
                ratio = ours / theirs if higher_is_better else theirs / ours
                text += f"{theirs:>12{fmt}}{ratio:>8.2f}"
            return text

        same_prefill = u is not None and not chunked  # (zero_context: both one prefill)
        lines.append(row("prefill s" + (" (all chunks)" if chunked else ""), o.prefill_s,
                         u.prefill_s if same_prefill else None, ".3f"))
        lines.append(row("prefill tokens/s", tokens / o.prefill_s,
                         tokens / u.prefill_s if same_prefill else None, ".1f",
                         higher_is_better=True))
        lines.append(row("decode median ms", o.decode_median_ms,
                         u.decode_median_ms if u else None, ".1f"))
        lines.append(row("decode p90 ms", o.decode_p90_ms, u.decode_p90_ms if u else None,
                         ".1f"))
        if self.read_bandwidth:
            between = (f", the median of reads of the weights between decode steps "
                       f"({min(o.read_bandwidths) / 1e9:.1f}-"
                       f"{max(o.read_bandwidths) / 1e9:.1f} GB/s)" if o.read_bandwidths else "")
            lines.append(f"{'decode weight-read limit':<24}{self.weight_read_limit_ms:>12.1f}"
                         f"  ms (weights / {self.read_bandwidth / 1e9:.1f} GB/s read bandwidth, "
                         f"{self.options['threads']} threads{between}); csa2onnx's steps are "
                         f"{self.x_limit:.2f}x it (median over steps, each against its own "
                         "moment's bandwidth where measured)")
        lines.append(row("memory loaded MiB", o.loaded_mib, u.loaded_mib if u else None,
                         ".0f"))
        lines.append(row("memory held MiB", o.held_mib, u.held_mib if u else None, ".0f"))
        lines.append(row("peak RSS MiB", o.peak_rss_mib, u.peak_rss_mib if u else None, ".0f"))
        held = (self.weight_bytes + self.state_bytes) / 2**20
        lines.append(f"csa2onnx's memory over weights + state ({held:.0f} MiB): loaded "
                     f"{o.loaded_mib / held:.2f}x, held after its run {o.held_mib / held:.2f}x")
        if u and chunked:
            lines.append(f"upstream cannot prefill in chunks: its prefill ({u.prefill_s:.3f} s) "
                         f"is {self.options['prefill']} tokens at once, and it decodes at "
                         f"start_pos {self.context} with its caches past that zero (a decode "
                         "step's cost does not depend on what they hold)")
        if zeros:
            lines.append(f"--zero-context: both sides prefill {self.options['prefill']} tokens "
                         f"and decode at start_pos {self.context} with the state past the "
                         "prefill zero: a decode step's cost at that context, outputs not "
                         "compared")
        if u:
            lines.append("ratio > 1: csa2onnx is faster (or smaller). memory held: resident "
                         "memory a side added from its setup to the end of its run; peak RSS "
                         + ("is the process's high-water mark during each side (both hold "
                            "the bench's copy of the weights)" if self.separate_peaks else
                            "is the process's (upstream's includes csa2onnx's run before it)"))
        if self.agreement:
            lines.append("out agreement with upstream (bf16-identical fraction, max |diff|): "
                         + ", ".join(f"{k} {v:.4g}" for k, v in self.agreement.items()))
        return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    flags, model = set(), platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and not flags:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    # the cores this process may run on (taskset, a container's cpuset), not the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "isa": [f for f in wanted if f in flags], "cores": cores,
            "onnxruntime": ort.__version__, "python": platform.python_version()}


class ReadProbe:
    """Times reads of memory with `threads` onnxruntime threads: one ReduceSum over a
    float32 [64, n] array (one output per row: the rows spread over the threads)."""

    ROWS = 64

    def __init__(self, threads: int) -> None:
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=0)], "bandwidth",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [self.ROWS, None])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [self.ROWS])],
            [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)],
                                  ir_version=IR_VERSION)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model.SerializeToString(), options,
                                            providers=["CPUExecutionProvider"])

    def bytes_per_s(self, x: np.ndarray) -> float:
        t0 = time.perf_counter()
        self.session.run(None, {"X": x})
        return x.nbytes / (time.perf_counter() - t0)


def read_bandwidth(threads: int, mib: int = 512, repeat: int = 5) -> float:
    """Bytes per second this machine reads from memory with `threads` onnxruntime threads:
    the best of `repeat` reads of `mib` MiB of float32, larger than any cache."""
    probe = ReadProbe(threads)
    x = np.ones((ReadProbe.ROWS, mib * 2**20 // 4 // ReadProbe.ROWS), np.float32)
    probe.bytes_per_s(x)
    return max(probe.bytes_per_s(x) for _ in range(repeat))


# Weights at least this large are read in place between decode steps to measure the
# bandwidth (8x a large L3: a read of them comes from memory); smaller ones by a separate
# buffer after the run.
IN_PLACE_PROBE_BYTES = 256 * 2**20


def weights_as_floats(runtime: AttentionRuntime) -> np.ndarray | None:
    """The runtime's mapped weights file as float32 [64, n] (its bytes as they lie, only
    read), or None when it has none or is too small to be read from memory."""
    if runtime.weights is None or runtime.weights.nbytes < IN_PLACE_PROBE_BYTES:
        return None
    raw = runtime.weights.bytes
    row = raw.size // (4 * ReadProbe.ROWS) * 4
    return raw[:row * ReadProbe.ROWS].view(np.float32).reshape(ReadProbe.ROWS, -1)


def reset_peak_rss() -> bool:
    """Starts a new high-water mark (Linux: clear_refs 5 resets VmHWM), so that each side's
    peak is its own; False where the system does not allow it (peaks then accumulate).
    What earlier runs freed is handed back first (garbage, then glibc's free pages), or a
    side's peak would include the memory the process kept from the one before."""
    gc.collect()
    page_returner()()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """The process's resident high-water mark since the last reset_peak_rss (VmHWM), MiB."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """Resident memory now (VmRSS), MiB."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_config(opts: BenchOptions) -> AttentionConfig:
    """The config: the source's, its precision from --weights (a folder: the checkpoint's)."""
    overrides: dict[str, Any] = {"max_batch_size": opts.batch}
    if opts.max_seq_len:
        overrides["max_seq_len"] = opts.max_seq_len
    if opts.weights in ("random-bf16", "random-fp8"):
        overrides["weight_format"] = opts.weights.removeprefix("random-")
        source = opts.source / "config.json" if opts.source.is_dir() else opts.source
        return AttentionConfig.load(source, **overrides)
    return open_checkpoint(Path(opts.weights), **overrides).config


def bench_weights(opts: BenchOptions, config: AttentionConfig,
             plan: StackPlan) -> dict[int, LayerWeights]:
    layers = [p.layer for p in plan.layers]
    if opts.weights in ("random-bf16", "random-fp8"):
        rng = np.random.default_rng(opts.seed)
        return {layer: attention_tensors(config, layer, rng) for layer in layers}
    return open_checkpoint(Path(opts.weights)).read_layers(layers)


def bench_inputs(rng: np.random.Generator, layers: list[int], batch: int, seqlen: int,
            dim: int) -> dict[int, np.ndarray]:
    return {layer: rng.standard_normal((batch, seqlen, dim), np.float32)
            .astype(ml_dtypes.bfloat16).astype(np.float32) for layer in layers}


def outside_slots(runtime: AttentionRuntime, config: AttentionConfig,
                  batch: int) -> dict[str, np.ndarray] | None:
    """The slots a layer range reads from layers outside it: only `index_k` may be, empty."""
    first, last = runtime.manifest.layers[0], runtime.manifest.layers[-1]
    if set(runtime.manifest.external_slots) - {"index_k"}:
        raise BenchError(f"layers {first}..{last} read slots "
                         f"{runtime.manifest.external_slots} from layers outside the "
                         "range; include their sources")
    if not runtime.manifest.external_slots:
        return None
    # The index_k slot of an upstream stack can hold a later owner's keys; a range that
    # reads it from outside gets it empty: its own owner publishes before reading, and
    # the slot then points at that owner (as upstream's layers alone run).
    row_bytes = packed_row_bytes(INDEX_KEY_FORMAT, config.index_head_dim)
    return {"index_k": np.zeros((batch, 0, row_bytes), np.uint8)}


def run_bench(opts: BenchOptions, progress: Callable[[str], None] | None = None,
              weights: dict[int, LayerWeights] | None = None) -> BenchResult:
    """One benchmark; `weights` (the layers' tensors, as bench_weights gives them) lets a
    caller that runs several reuse one set."""
    config = bench_config(opts)
    first, last = opts.layers or (0, config.n_layers - 1)
    plan = plan_stack(config, first, last)
    context = opts.context or opts.prefill
    if opts.prefill < 1 or context < opts.prefill:
        raise BenchError(f"prefill must be >= 1 and context >= prefill, got prefill "
                         f"{opts.prefill}, context {context}")
    if context + opts.decode > config.max_seq_len:
        raise BenchError(f"context {context} + {opts.decode} decode steps is past "
                         f"max_seq_len {config.max_seq_len}")
    layers = [p.layer for p in plan.layers]
    say = progress or (lambda text: None)
    if weights is None:
        say("weights")
        weights = bench_weights(opts, config, plan)
    weight_bytes = sum(a.nbytes for w in weights.values() for a in w.values())
    with tempfile.TemporaryDirectory(prefix="csa2onnx-bench-") as tmp:
        say("export")
        t0 = time.perf_counter()
        export_stack(plan, weights, Path(tmp), numerics=opts.numerics)
        export_s = time.perf_counter() - t0
        say("sessions")
        peaks_reset = reset_peak_rss()
        rss_before = rss_mib()
        t0 = time.perf_counter()
        if opts.state not in ("grow", "full", "copy"):
            raise BenchError(f"state must be grow, full or copy, got {opts.state!r}")
        runtime = AttentionRuntime(tmp, intra_op_num_threads=opts.threads, spinning=False,
                                   grow_caches=opts.state == "grow",
                                   in_place=opts.state != "copy",
                                   share_weights=opts.share_weights,
                                   prefill_arena=opts.prefill_arena)
        setup_s = time.perf_counter() - t0
        loaded_mib = rss_mib() - rss_before
        slots = outside_slots(runtime, config, opts.batch)
        in_place = weights_as_floats(runtime)
        probe = (ReadProbe(opts.threads), in_place) if in_place is not None else None
        ours, out_ours = _run_csa2onnx(runtime, opts, layers, config.dim, say, slots, probe)
        ours.setup_s, ours.held_mib = setup_s, rss_mib() - rss_before
        ours.loaded_mib = loaded_mib
        state_bytes = runtime.state_bytes()
        del runtime
    machine = machine_info()
    result = BenchResult(options=asdict(opts) | {"source": str(opts.source),
                                                  "upstream": str(opts.upstream),
                                                  "max_seq_len": config.max_seq_len},
                         machine=machine, layers=layers, weight_format=config.weight_format,
                         weight_bytes=weight_bytes, state_bytes=state_bytes,
                         export_s=export_s, ours=ours,
                         read_bandwidth=(statistics.median(ours.read_bandwidths)
                                         if ours.read_bandwidths
                                         else read_bandwidth(opts.threads)),
                         separate_peaks=peaks_reset)
    if opts.baseline == "upstream":
        say("upstream")
        result.upstream, out_theirs, torch_version = _run_upstream(opts, config, layers,
                                                                   weights, say)
        machine["torch"] = torch_version
        for key, ours_out in out_ours.items():
            a = ours_out.astype(ml_dtypes.bfloat16).view(np.uint16)
            b = out_theirs[key].astype(ml_dtypes.bfloat16).view(np.uint16)
            result.agreement[f"{key} identical"] = float((a == b).mean())
            result.agreement[f"{key} max|d|"] = float(np.abs(ours_out - out_theirs[key]).max())
    return result


def _run_csa2onnx(runtime: AttentionRuntime, opts: BenchOptions, layers: list[int], dim: int,
                  say: Callable[[str], None], slots: dict[str, np.ndarray] | None = None,
                  probe: tuple[ReadProbe, np.ndarray] | None = None
                  ) -> tuple[SideResult, dict[str, np.ndarray]]:
    """Prefill and decode steps timed; `probe` (a ReadProbe and the weights as they lie)
    reads the weights once after each decode step, untimed by the step."""
    rng = np.random.default_rng(opts.seed + 1)
    warm = min(16, opts.prefill)
    # warm-up, not timed
    runtime.prefill(bench_inputs(rng, layers, opts.batch, warm, dim), slots)
    runtime.decode(bench_inputs(rng, layers, opts.batch, 1, dim), slots)
    rng = np.random.default_rng(opts.seed + 2)  # the timed inputs, as upstream gets them
    context = opts.context or opts.prefill
    prefill_s, outputs = 0.0, {}
    # zero_context: one prefill, then the positions up to the context left zero state
    for start in range(0, opts.prefill if opts.zero_context else context, opts.prefill):
        xs = bench_inputs(rng, layers, opts.batch, min(opts.prefill, context - start), dim)
        say(f"prefill {start}/{context}" if context > opts.prefill else "prefill")
        t0 = time.perf_counter()
        out = runtime.prefill(xs, slots, start_pos=start).out
        prefill_s += time.perf_counter() - t0
        if start == 0:  # the call upstream makes too
            outputs = {f"prefill.L{k}": v for k, v in out.items()}
    if opts.zero_context:
        runtime.skip_to(context)
    decode_ms, bandwidths = [], []
    for step in range(opts.decode):
        xs = bench_inputs(rng, layers, opts.batch, 1, dim)
        say(f"decode {step + 1}/{opts.decode}")
        t0 = time.perf_counter()
        out = runtime.decode(xs, slots).out
        decode_ms.append((time.perf_counter() - t0) * 1e3)
        if probe is not None:
            bandwidths.append(probe[0].bytes_per_s(probe[1]))
    if context == opts.prefill:  # upstream decodes at another context otherwise
        outputs.update({f"last decode.L{k}": v for k, v in out.items()})
    return SideResult(prefill_s, decode_ms, peak_rss_mib(),
                      read_bandwidths=bandwidths), outputs


def upstream_folder(path: Path | None) -> Path:
    """The upstream reference's folder, checked (its load.py, and torch to run it): the
    command line asks before the minutes of csa2onnx's side, not after them."""
    folder = Path(path or os.environ.get("CSA2ONNX_UPSTREAM") or ROOT.parent / "shared"
                  / "reference")
    if not (folder / "load.py").is_file():
        raise BenchError(f"--baseline upstream: no upstream reference at {folder} (load.py "
                         "missing); pass --upstream DIR")
    if importlib.util.find_spec("torch") is None:
        raise BenchError("--baseline upstream needs torch (pip install torch==2.13.0), which "
                         "is not installed")
    return folder


def load_upstream(path: Path | None) -> ModuleType:
    """The upstream model module, loaded from its folder (reference material: never part of
    the package; only the benchmark's baseline)."""
    folder = upstream_folder(path)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    try:
        import load  # the reference folder's own loader
    except ImportError as e:
        raise BenchError(f"--baseline upstream needs torch: {e}") from None
    return load.load_upstream()


def _torch_tensor(array: np.ndarray):
    import torch

    kinds = {ml_dtypes.bfloat16: (np.int16, torch.bfloat16),
             ml_dtypes.float8_e4m3fn: (np.uint8, torch.float8_e4m3fn),
             ml_dtypes.float8_e8m0fnu: (np.uint8, torch.float8_e8m0fnu)}
    for dtype, (raw, target) in kinds.items():
        if array.dtype == dtype:
            return torch.from_numpy(np.ascontiguousarray(array).view(raw)).view(target)
    return torch.from_numpy(np.ascontiguousarray(array, np.float32))


def _run_upstream(opts: BenchOptions, config: AttentionConfig, layers: list[int],
                  weights: dict[int, LayerWeights], say: Callable[[str], None]
                  ) -> tuple[SideResult, dict[str, np.ndarray], str]:
    reset_peak_rss()
    rss_before = rss_mib()
    mod = load_upstream(opts.upstream)
    import torch

    torch.set_num_threads(opts.threads)
    args = {k: v for k, v in config.to_dict().items()
            if k in mod.ModelArgs.__dataclass_fields__}
    args["dtype"] = config.weight_format
    model_args = mod.ModelArgs(**args)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        t0 = time.perf_counter()
        mod.world_size, mod.rank = 1, 0
        mod.default_dtype = torch.float8_e4m3fn if args["dtype"] == "fp8" else torch.bfloat16
        attention = {}
        with torch.no_grad():
            for layer in layers:
                a = mod.Attention(layer, model_args).eval()
                for name, p in a.named_parameters():
                    p.copy_(_torch_tensor(weights[layer][name]).to(p.dtype))
                attention[layer] = a
        setup_s = time.perf_counter() - t0
        loaded_mib = rss_mib() - rss_before

        def step(xs: dict[int, np.ndarray], start_pos: int) -> dict[int, np.ndarray]:
            return {layer: attention[layer](torch.from_numpy(xs[layer]).to(torch.bfloat16),
                                            start_pos).float().numpy() for layer in layers}

        with torch.inference_mode():
            rng = np.random.default_rng(opts.seed + 1)
            warm = min(16, opts.prefill)
            step(bench_inputs(rng, layers, opts.batch, warm, config.dim), 0)
            step(bench_inputs(rng, layers, opts.batch, 1, config.dim), warm)
            rng = np.random.default_rng(opts.seed + 2)
            xs = bench_inputs(rng, layers, opts.batch, opts.prefill, config.dim)
            say("upstream prefill")
            t0 = time.perf_counter()
            out = step(xs, 0)
            prefill_s = time.perf_counter() - t0
            outputs = {f"prefill.L{k}": v for k, v in out.items()}
            decode_ms = []
            context = opts.context or opts.prefill  # past the prefill: caches hold zeros
            for i in range(opts.decode):
                xs = bench_inputs(rng, layers, opts.batch, 1, config.dim)
                say(f"upstream decode {i + 1}/{opts.decode}")
                t0 = time.perf_counter()
                out = step(xs, context + i)
                decode_ms.append((time.perf_counter() - t0) * 1e3)
            if context == opts.prefill:
                outputs.update({f"last decode.L{k}": v for k, v in out.items()})
    finally:
        torch.set_default_dtype(previous)
        # Each load is a fresh module in sys.modules whose globals (shared_attn's slots)
        # keep its caches alive: drop it, or every later run holds this one's memory.
        sys.modules.pop(mod.__name__, None)
    side = SideResult(prefill_s, decode_ms, peak_rss_mib(), rss_mib() - rss_before, setup_s,
                      loaded_mib)
    return side, outputs, torch.__version__


def to_json(result: BenchResult) -> str:
    data = asdict(result)
    for side in ("ours", "upstream"):
        if data[side]:
            value = getattr(result, side)
            data[side] |= {"decode_median_ms": value.decode_median_ms,
                           "decode_p90_ms": value.decode_p90_ms}
    data["weight_read_limit_ms"] = result.weight_read_limit_ms
    data["x_limit"] = result.x_limit
    return json.dumps(data, indent=1)
