"""`csa2onnx`: export attention stacks to ONNX, run them, verify goldens, inspect artifacts."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

from csa2onnx.custom_ops.ops import NUMERICS
from csa2onnx.export.checkpoint import open_checkpoint
from csa2onnx.export.config import AttentionConfig, ConfigError
from csa2onnx.export.goldens import load_case
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime, RuntimeStateError, describe
from csa2onnx.export.stack import export_stack
from csa2onnx.export.weights import WeightsError, from_golden, from_safetensors

NUMERICS_HELP = ("exact (default): the reference's bits on every CPU; fast: the ops that have "
                 "a fast kernel sum in its own order (README, 'Exact or fast')")


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _layer_range(text: str | None, n_layers: int) -> tuple[int, int]:
    if not text:
        return 0, n_layers - 1
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if match is None:
        raise ValueError(f"--layers: expected FIRST-LAST or one layer number, got {text!r}")
    return int(match[1]), int(match[2] or match[1])


def cmd_export(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():  # before the weights are read
        raise ValueError(f"--out {args.out} is a file; give a folder (made if missing)")
    overrides = {k: v for k, v in (("max_seq_len", args.max_seq_len),
                                   ("max_batch_size", args.max_batch_size)) if v is not None}
    checkpoint = None
    if args.config.is_dir():  # a Hugging Face model folder: config and weights
        if args.weights:
            raise WeightsError(f"{args.config} is a model folder, which holds its weights; "
                               "drop --weights")
        checkpoint = open_checkpoint(args.config, **overrides)
        config = checkpoint.config
    else:
        config = AttentionConfig.load(args.config, **overrides)
    first, last = _layer_range(args.layers, config.n_layers)
    plan = plan_stack(config, first, last, index_keys=args.index_keys)
    layers = range(first, last + 1)
    if checkpoint is not None:
        weights = checkpoint.read_layers(layers)
    elif args.weights and args.weights[0].suffix == ".json":  # a golden case
        weights = from_golden(load_case(args.weights[0]).arrays, layers)
    elif args.weights:
        named = str(args.weights[0])
        if named in ("random-bf16", "random-fp8") and not args.weights[0].exists():
            raise WeightsError(f"--weights {named} is a bench option (csa2onnx bench "
                               f"--weights {named}); export reads safetensors files or a "
                               "golden case JSON")
        weights = from_safetensors(args.weights, layers)
    else:
        raise WeightsError("--weights is required with a config file (safetensors files or a "
                           "golden case JSON); a model folder brings its own")
    start = time.perf_counter()
    export_stack(plan, weights, args.out, portable=args.portable, numerics=args.numerics,
                 progress=_progress)
    print(f"exported layers {first}..{last} to {args.out} in {time.perf_counter() - start:.1f}s")
    return 0


_RUN_INPUT = re.compile(r"(prefill|decode(\d+))\.L(\d+)\.x")


def _run_steps(names: list[str], layers: list[int]) -> list[str]:
    """The steps of a `run` inputs file, prefill first, then decode0, decode1, ... in order.
    Every array must be STEP.L{layer}.x for one of the artifacts' layers, and every step
    must have all of them."""
    steps: dict[str, set[int]] = {}
    for name in names:
        match = _RUN_INPUT.fullmatch(name)
        if match is None:
            raise ValueError(f"inputs: array {name!r} is not named STEP.L{{layer}}.x (STEP "
                             "'prefill' or 'decode0', 'decode1', ...)")
        if int(match[3]) not in layers:
            raise ValueError(f"inputs: array {name!r} is for layer {match[3]}; the artifacts "
                             f"hold layers {layers}")
        steps.setdefault(match[1], set()).add(int(match[3]))
    if not steps:
        raise ValueError("inputs: no arrays (expected STEP.L{layer}.x, e.g. prefill.L0.x)")
    for step, present in steps.items():
        if missing := sorted(set(layers) - present):
            raise ValueError(f"inputs: step {step} has no array for layers {missing} "
                             f"({step}.L{missing[0]}.x, ...)")
    return sorted(steps, key=lambda s: -1 if s == "prefill" else int(s[6:]))


def cmd_run(args: argparse.Namespace) -> int:
    output = args.output  # np.savez adds .npz to a name without it
    output = output if output.suffix == ".npz" else output.with_name(output.name + ".npz")
    if not output.parent.is_dir():  # before the steps run, not after
        raise ValueError(f"--output {args.output}: no folder {output.parent}")
    runtime = AttentionRuntime(args.artifacts, provider=args.provider)
    with np.load(args.inputs) as z:
        steps = _run_steps(z.files, runtime.layers)
        outputs = {}
        for step in steps:
            xs = {layer: z[f"{step}.L{layer}.x"] for layer in runtime.layers}
            result = runtime.prefill(xs) if step == "prefill" else runtime.decode(xs)
            outputs.update({f"{step}.L{layer}.out": v for layer, v in result.out.items()})
    np.savez(output, **outputs)
    print(f"ran {len(steps)} steps; wrote {len(outputs)} arrays to {output}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from csa2onnx.export.verify import verify_case

    rule = None if args.rule == "auto" else args.rule.replace("-", "_")
    report = verify_case(args.golden, portable=args.portable, numerics=args.numerics,
                         index_keys=args.index_keys, provider=args.provider,
                         threads=args.threads, rule=rule, prefill_chunk=args.prefill_chunk,
                         progress=_progress if args.verbose else None)
    print(report.table())
    return 0 if report.ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from csa2onnx.export.bench import BenchOptions, run_bench, to_json, upstream_folder
    from csa2onnx.export.bench_matrix import run_matrix
    from csa2onnx.export.bench_sweep import run_sweep

    if args.upstream is not None and args.baseline is None:
        raise ValueError("--upstream names the baseline's folder: it needs --baseline upstream")
    if args.baseline == "upstream":
        upstream_folder(args.upstream)

    source = args.source
    config = AttentionConfig.load(source / "config.json" if source.is_dir() else source)
    # a model folder benchmarks its own weights; a config file random ones in its precision
    weights = args.weights or (str(source) if source.is_dir()
                               else f"random-{config.weight_format}")
    n_layers = config.n_layers
    lengths = args.max_seq_len or []
    contexts = args.context or []
    matrix = max(len(args.prefill), len(args.batch), len(args.threads), len(contexts),
                 len(args.numerics)) > 1
    if matrix and len(lengths) > 1:
        raise ValueError("bench takes several values of --prefill/--batch/--threads/--context "
                         "(a matrix) or of --max-seq-len (a sweep), not both")
    opts = BenchOptions(source=source, layers=_layer_range(args.layers, n_layers) if args.layers
                        else None, weights=weights, prefill=args.prefill[0],
                        context=None if matrix or not contexts else contexts[0],
                        decode=args.decode,
                        batch=args.batch[0], max_seq_len=lengths[0] if lengths else None,
                        threads=args.threads[0],
                        seed=args.seed, baseline=args.baseline, upstream=args.upstream,
                        state=args.state, share_weights=not args.separate_weights,
                        prefill_arena=args.prefill_arena, numerics=args.numerics[0],
                        zero_context=args.zero_context)
    live = sys.stderr.isatty() and not args.json

    def progress(stage: str) -> None:
        if live:
            print(f"\r\033[K  bench: {stage}", end="", file=sys.stderr, flush=True)

    def finished(summary: str) -> None:  # kept on screen (or in the log) at once
        print(("\r\033[K" if live else "") + f"  bench: {summary}", file=sys.stderr, flush=True)

    if matrix:
        table = run_matrix(opts, args.prefill, args.batch, args.threads, contexts, progress,
                           numerics=args.numerics, finished=finished)
        if live:
            print("\r\033[K", end="", file=sys.stderr)
        print(table.to_json() if args.json else table.table())
        return 0
    if len(lengths) > 1:
        sweep = run_sweep(opts, lengths, progress)
        if live:
            print("\r\033[K", end="", file=sys.stderr)
        print(sweep.to_json() if args.json else sweep.table())
        return 0
    result = run_bench(opts, progress)
    if live:
        print("\r\033[K", end="", file=sys.stderr)
    print(to_json(result) if args.json else result.table())
    return 0


def _lengths(text: str) -> list[int]:
    """One positive integer, or several separated by commas (a sweep or a matrix)."""
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers separated by commas, got {text!r}") from None
    if any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
    return lengths


def _numerics_list(text: str) -> list[str]:
    """exact, fast, or both separated by a comma (each scenario run both ways)."""
    names = text.split(",")
    if any(n not in NUMERICS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"numerics: {', '.join(NUMERICS)} or both, separated "
                                         f"by a comma, got {text!r}")
    return names


def cmd_inspect(args: argparse.Namespace) -> int:
    print(describe(args.artifacts))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="csa2onnx", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="model folder, or config + weights -> folder of .onnx "
                                      "artifacts")
    e.add_argument("config", type=Path, metavar="MODEL_DIR|CONFIG",
                   help="a Hugging Face model folder (config.json + safetensors), or a "
                        "config.json (ModelArgs or Hugging Face names) with --weights")
    e.add_argument("--weights", type=Path, nargs="+",
                   help="safetensors files, or a golden case JSON")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--layers", help="a range FIRST-LAST (default: all layers)")
    e.add_argument("--index-keys", choices=["shared", "own"], default="shared",
                   help="shared: the reference's one index_k slot (default); own: owners read "
                        "their own keys")
    e.add_argument("--portable", action="store_true",
                   help="standard ONNX only (no custom-op library; ties broken lowest-index)")
    e.add_argument("--numerics", choices=NUMERICS, default="exact", help=NUMERICS_HELP)
    e.add_argument("--max-seq-len", type=int)
    e.add_argument("--max-batch-size", type=int)
    e.set_defaults(fn=cmd_export)

    r = sub.add_parser("run", help="artifacts + inputs (.npz with STEP.L{l}.x) -> outputs")
    r.add_argument("artifacts", type=Path)
    r.add_argument("inputs", type=Path)
    r.add_argument("--output", type=Path, default=Path("outputs.npz"))
    r.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    r.set_defaults(fn=cmd_run)

    v = sub.add_parser("verify", help="export, run and compare a golden case")
    v.add_argument("golden", type=Path, help="a golden case's NAME.json")
    v.add_argument("--portable", action="store_true")
    v.add_argument("--numerics", choices=NUMERICS, default="exact",
                   help=NUMERICS_HELP + "; fast is judged by the cross-CPU rule, selections "
                        "exact except on rows the golden flags tie-decided")
    v.add_argument("--index-keys", choices=["shared", "own"],
                   help="default: from the case's behaviour_patch")
    v.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    v.add_argument("--threads", type=_non_negative, default=0,
                   help="intra-op threads (0: default)")
    v.add_argument("--rule", choices=["auto", "same-cpu", "cross-cpu"], default="auto",
                   help="comparison rule; auto: cross-cpu when the golden's `machine` is not "
                        "the class csa2onnx reproduces (README)")
    v.add_argument("--prefill-chunk", type=_positive, metavar="N",
                   help="run the prefill in chunks of N tokens (chunked prefill) and judge "
                        "it against the one-shot golden")
    v.add_argument("-v", "--verbose", action="store_true")
    v.set_defaults(fn=cmd_verify)

    b = sub.add_parser("bench", help="time layers at a config's dims (optionally beside "
                                     "upstream PyTorch)")
    b.add_argument("source", type=Path, help="a config.json or a Hugging Face model folder")
    b.add_argument("--layers", help="a range FIRST-LAST (default: all layers)")
    b.add_argument("--weights", help="random-bf16 | random-fp8 | a model folder (default: the "
                                     "folder's own weights, or random weights in the "
                                     "config's precision)")
    b.add_argument("--prefill", type=_lengths, default=[256],
                   help="prefill tokens, per call when --context is larger (default 256); "
                        "several separated by commas: a matrix of scenarios (README)")
    b.add_argument("--context", type=_lengths,
                   help="tokens before decoding, reached by chunked prefill in calls of "
                        "--prefill tokens (default: --prefill); in a matrix, extra decode "
                        "scenarios at these contexts")
    b.add_argument("--zero-context", action="store_true",
                   help="reach --context by one prefill and zero state up to it instead of "
                        "chunked prefill (as upstream's decode there): a decode step's cost "
                        "at long contexts without prefilling them")
    b.add_argument("--decode", type=_positive, default=16, help="decode steps (default 16)")
    b.add_argument("--batch", type=_lengths, default=[1], help="batch size(s)")
    b.add_argument("--max-seq-len", type=_lengths,
                   help="the config's max_seq_len, or several separated by commas: decode "
                        "steps at each taken in turn, to compare them")
    b.add_argument("--threads", type=_lengths, default=[2],
                   help="intra-op threads, both sides (several: a matrix)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--baseline", choices=["upstream"],
                   help="also run the upstream PyTorch reference on the same weights/inputs")
    b.add_argument("--upstream", type=Path, help="the upstream reference folder (default "
                                                 "../shared/reference or $CSA2ONNX_UPSTREAM)")
    b.add_argument("--state", choices=["grow", "full", "copy"], default="grow",
                   help="caches written in place and grown with the context (default), in "
                        "place at max_seq_len rows, or copied whole every call (for comparison)")
    b.add_argument("--separate-weights", action="store_true",
                   help="let each session load its own copy of the weights (for comparison)")
    b.add_argument("--numerics", type=_numerics_list, default=["exact"],
                   help="exact, fast, or both (exact,fast: each scenario run both ways, "
                        "upstream once, beside them)")
    b.add_argument("--prefill-arena", action="store_true",
                   help="keep onnxruntime's CPU arena in the prefill session: slightly faster "
                        "prefills whose activations stay resident (for comparison)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench)

    i = sub.add_parser("inspect", help="summarise an artifact folder")
    i.add_argument("artifacts", type=Path)
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, WeightsError, OSError, ValueError, RuntimeStateError) as error:
        print(f"csa2onnx {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
