"""How fast decode's linears stream their weights from memory: L TorchLinear nodes in one
graph (bf16 panels64 W [N, K] each, L*N*K*2 bytes in all), or L Fp8Linear nodes
(`--weights fp8`: e4m3 W, one byte a weight, and their block scales; by default in the
pairs16 layout an export writes, `--fp8-layout plain` for W [N, K] as a checkpoint holds
it), one X [M, K], timed per run; by default 800 MiB of weights either way (10
bf16 or 20 fp8 linears of 8192 x 5120), past this 2-core VM's 480 MiB L3 (10 fp8 linears
sit below it); GB/s = weight bytes / time, beside the
bench's read probe (a ReduceSum over as many bytes: what the memory gives these threads).
`tools/bench_ops.py` calls one linear again and again, so its weights sit in L3: this is
the number a decode step sees.

    python tools/bench_decode_stream.py [--rows 1,4] [--k 8192 --n 5120 --layers L]
        [--weights bf16|fp8] [--fp8-layout pairs16|plain]
        [--library A.so,B.so]   # builds, timed in turns (A/B; a build from before
                                # pairs16 reads fp8 W with --fp8-layout plain only)

Every round creates each library's session anew and times it in turn; the median is
printed. A session's weights sit in pages of their own, and two sessions kept for the whole
run measured up to 40% apart on one build depending on which was made first (a 2-core Xeon,
800 MiB each): fresh sessions average over placements, so an A/B compares the builds.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from csa2onnx.custom_ops import session_options
from csa2onnx.custom_ops.weight_layout import PAIRS16, PLAIN, pack_pairs16, pack_panels
from csa2onnx.export.bench import ReadProbe
from csa2onnx.export.synthetic import quantize_fp8


def stream_model(k: int, n: int, layers: int, rng: np.random.Generator,
                 weights: str = "bf16", fp8_layout: str = PAIRS16) -> bytes:
    """`layers` linears on one X, each with its own constant W: TorchLinear on panels64
    bf16, or Fp8Linear on e4m3 codes (in `fp8_layout`) and scales."""
    initializers, nodes, outputs = [], [], []
    for i in range(layers):
        if weights == "fp8":
            values, scales = quantize_fp8(rng.standard_normal((n, k), dtype=np.float32))
            codes, w_scale = values.view(np.uint8), scales.astype(np.float32)
            if fp8_layout == PAIRS16:
                codes = pack_pairs16(codes)
            initializers += [helper.make_tensor(f"W{i}", TensorProto.FLOAT8E4M3FN, codes.shape,
                                                codes.tobytes(), raw=True),
                             helper.make_tensor(f"S{i}", TensorProto.FLOAT, w_scale.shape,
                                                w_scale.tobytes(), raw=True)]
            nodes.append(helper.make_node("Fp8Linear", ["X", f"W{i}", f"S{i}"], [f"Y{i}"],
                                          domain="csa2onnx", weight_layout=fp8_layout))
        else:
            w = (rng.standard_normal((n, k)) * 0.02).astype(ml_dtypes.bfloat16)
            panels = pack_panels(w).panels
            initializers.append(helper.make_tensor(f"W{i}", TensorProto.BFLOAT16, panels.shape,
                                                   panels.view(np.uint16).tobytes(), raw=True))
            nodes.append(helper.make_node("TorchLinear", ["X", f"W{i}"], [f"Y{i}"],
                                          domain="csa2onnx", weight_layout="panels64",
                                          out_features=n, in_features=k))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "stream",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("csa2onnx", 1)],
                             ir_version=10).SerializeToString()


def session(model: bytes, threads: int, library: str | None) -> ort.InferenceSession:
    """A quiet session (no spinning: sessions in turns leave the cores to each other) on
    this checkout's library, or on the build `library` names."""
    options = session_options(threads, library)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4", help="rows of X (decode batch sizes)")
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--n", type=int, default=5120)
    parser.add_argument("--layers", type=int, default=None,
                        help="linears (default: 800 MiB of weights, 10 bf16 or 20 fp8)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="TorchLinear on bf16 weights or Fp8Linear on e4m3 ones")
    parser.add_argument("--fp8-layout", choices=(PAIRS16, PLAIN), default=PAIRS16,
                        help="the fp8 weights' layout (default: pairs16, as an export writes)")
    parser.add_argument("--library", default=None,
                        help="comma-separated custom-op library builds (default: this one)")
    args = parser.parse_args(argv)
    if args.weights == "fp8" and args.fp8_layout == PAIRS16 and args.n % 16:
        parser.error(f"--fp8-layout pairs16 needs --n a multiple of 16, got {args.n}")
    if args.layers is None:
        args.layers = 20 if args.weights == "fp8" else 10
    rng = np.random.default_rng(0)
    model = stream_model(args.k, args.n, args.layers, rng, args.weights, args.fp8_layout)
    weight_bytes = args.layers * args.n * args.k * (1 if args.weights == "fp8" else 2)
    libraries = args.library.split(",") if args.library else [None]
    probe = ReadProbe(args.threads)
    flat = np.ones((ReadProbe.ROWS, weight_bytes // 4 // ReadProbe.ROWS), np.float32)
    read = max(probe.bytes_per_s(flat) for _ in range(3))
    kind = f"fp8 ({args.fp8_layout})" if args.weights == "fp8" else args.weights
    print(f"{args.layers} linears of K {args.k} x N {args.n} {kind} "
          f"({weight_bytes / 2**20:.0f} "
          f"MiB), {args.threads} threads; read probe over as many bytes: {read / 1e9:.1f} GB/s")
    for m in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((m, args.k)).astype(ml_dtypes.bfloat16).astype(np.float32)
        times: dict[str | None, list[float]] = {lib: [] for lib in libraries}
        for _ in range(args.rounds):
            for lib in libraries:
                fresh = session(model, args.threads, lib)
                fresh.run(None, {"X": x})  # warm-up
                t0 = time.perf_counter()
                fresh.run(None, {"X": x})
                times[lib].append(time.perf_counter() - t0)
                del fresh
        for lib in libraries:
            median = float(np.median(times[lib]))
            print(f"rows {m}: {lib or 'this checkout'}: {median * 1e3:.2f} ms, "
                  f"{weight_bytes / median / 1e9:.1f} GB/s ({weight_bytes / median / read:.2f} "
                  "of the probe)")


if __name__ == "__main__":
    main()
