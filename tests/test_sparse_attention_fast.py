"""SparseAttention numerics="fast" (custom_ops/src/sparse_attention_fast.h: vdpbf16ps on CPUs
with AVX512-BF16) against numerics="exact": every output within a tolerance derived from the
arithmetic, and few outputs different at all; deterministic for any thread count and head
split; the exact kernel, bit for bit, on every lower instruction-set path; NaN/inf, odd
shapes, a packed cache, the attribute's errors and the Python wrapper.

The tolerance (fast_tolerance): both kernels sum the same exact products (q and the rows are
bf16 values, so each product is exact in float32) in different orders, so each float32 logit
sum is within d * 2^-24 * sum|terms| of the true one (the worst-case bound of any summation
order), the scaled logit within one more rounding. Then, per entry, p = exp(logit - running
max) differs between the kernels by a relative r (both logits' and both maxima's deviations,
the subtraction and expf's rounding); bf16(p) is then identical unless p's interval
[p e^-r, p e^r] straddles a bf16 rounding boundary, where it may differ by one bf16 ulp
(2^-7 of p at most). The P @ V chains (about k + 2 * blocks terms, same products up to those
flips) differ by the reassociation bound again, the alphas and the denominator (a sum of the
unrounded p) by r and their roundings. The outputs, each rounded to bf16 from values that far
apart, are then at most that bound plus one bf16 ulp apart."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from helpers import build_cpp_driver, custom_op_model
from onnx import TensorProto, helper
from test_sparse_attention_op import _inputs

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.custom_ops.reference import pack_quantized, round_bf16, sparse_attention_rows

HAS_BF16 = "avx512bf16" in cpu_isas()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="the fast kernel needs AVX512-BF16; "
                                "elsewhere fast is the exact kernel (tested below)")
U = 2.0**-24  # float32 unit roundoff
ISA_VARIABLES = ("CSA_SPARSE_ATTENTION_ISA", "CSA2ONNX_ISA")


def fast_model(scale: float, numerics: str | None, packed_format: str | None = None) -> bytes:
    """One SparseAttention node (numerics=None: no attribute, i.e. exact)."""
    inputs = ["Q", "KV", "S", "I"] + (["C"] if packed_format else [])
    attrs: dict[str, object] = {"softmax_scale": float(scale)}
    attrs |= {"numerics": numerics} if numerics is not None else {}
    attrs |= {"compressed_format": packed_format} if packed_format else {}
    node = helper.make_node("SparseAttention", inputs, ["O"], domain="csa2onnx", **attrs)
    vi = helper.make_tensor_value_info
    infos = [vi("Q", TensorProto.FLOAT, ["b", "s", "h", "d"]),
             vi("KV", TensorProto.FLOAT, ["b", "n", "d"]), vi("S", TensorProto.FLOAT, ["h"]),
             vi("I", TensorProto.INT64, ["b", "s", "k"])]
    if packed_format:
        infos.append(vi("C", TensorProto.UINT8, None))
    graph = helper.make_graph([node], "sa_fast", infos,
                              [vi("O", TensorProto.FLOAT, ["b", "s", "h", "d"])])
    return custom_op_model(graph)


def session(monkeypatch, numerics: str | None, scale: float, threads: int = 1,
            isa: tuple[str, str] | None = None,
            packed_format: str | None = None) -> ort.InferenceSession:
    """A session; `isa` = (variable, value) forces a path (read when the kernel is made).
    None: the avx512bf16 path where the CPU has it, so that the fast kernel is what these
    tests see (unforced, a CPU with AMX runs the avx512 tiles instead: tested below)."""
    for variable in ISA_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if isa is None and HAS_BF16:
        isa = ("CSA_SPARSE_ATTENTION_ISA", "avx512bf16")
    if isa is not None:
        monkeypatch.setenv(*isa)
    try:
        return make_session(fast_model(scale, numerics, packed_format),
                            options=session_options(threads))
    finally:
        for variable in ISA_VARIABLES:
            monkeypatch.delenv(variable, raising=False)


def run(monkeypatch, numerics, q, kv, sink, idx, **kw) -> np.ndarray:
    feeds = {"Q": q, "KV": kv, "S": sink, "I": idx}
    return session(monkeypatch, numerics, q.shape[-1] ** -0.5, **kw).run(None, feeds)[0]


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def model_inputs(seed: int, b: int, s: int, h: int, d: int, n: int, k: int,
                 minus_one: float = 0.1):
    """As the model feeds the op: bf16 q and rows, -1 entries anywhere."""
    return _inputs(seed, b, s, h, d, n, k, minus_one)


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 values at |x| (8 significant bits; the smallest normal's below)."""
    e = np.floor(np.log2(np.maximum(np.abs(x.astype(np.float64)), 2.0**-126)))
    return np.exp2(e - 7)


def fast_tolerance(q, kv, sink, idx, scale: float) -> np.ndarray:
    """The bound on |fast - exact| before the final bf16 rounding (module docstring), in
    float64, per output [b, s, h, d]."""
    b, s, h, d = q.shape
    k = idx.shape[-1]
    blocks = -(-k // 64)
    q64 = q.astype(np.float64)
    valid = idx >= 0
    rows = kv.astype(np.float64)[np.arange(b)[:, None, None], np.where(valid, idx, 0)]
    logit = np.einsum("bshd,bskd->bshk", q64, rows) * scale
    spread = np.einsum("bshd,bskd->bshk", np.abs(q64), np.abs(rows)) * scale
    # Fast vs exact logit: two summation orders, each d * u * sum|terms| from the true sum,
    # a rounding each for the scale; vdpbf16ps flushes denormal products (2^-126 each).
    dlogit = 2 * d * U * spread + 2 * U * np.abs(logit) + 2 * d * 2.0**-126 * scale
    mask = valid[:, :, None, :]
    logit = np.where(mask, logit, -np.inf)
    dlogit = np.where(mask, dlogit, 0.0)
    # The running maximum at each block (from -1e30), as the online softmax keeps it.
    padded = np.full((b, s, h, blocks * 64), -np.inf)
    padded[..., :k] = logit
    block_max = np.maximum.accumulate(padded.reshape(b, s, h, blocks, 64).max(-1), axis=-1)
    running = np.maximum(np.repeat(block_max, 64, axis=-1)[..., :k], -1e30)
    dmax = dlogit.max(-1, keepdims=True)
    final = np.maximum(block_max[..., -1:], -1e30)
    # p = exp(logit - running max): relative difference r (logits, maxima, subtraction, expf)
    r = dlogit + dmax + 2 * U * (np.abs(np.where(mask, logit, 0)) + np.abs(running)) + 8 * U
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(mask, np.exp(logit - running), 0.0)
        lo = round_bf16(p * np.exp(-r)).astype(np.float64)
        hi = round_bf16(p * np.exp(r)).astype(np.float64)
    flip = (lo != hi) & mask
    # Weights of the plain softmax with the sink: p * alpha products / denominator.
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(mask, np.exp(logit - final), 0.0)
        denom = w.sum(-1, keepdims=True) + np.exp(sink.astype(np.float64)[:, None] - final)
    w = w / denom
    r_max = r.max(-1, keepdims=True)
    alphas = blocks * (2 * dmax + 8 * U)  # each block's alpha = exp(m_old - m_new)
    terms = k + 2 * blocks
    per_entry = w * (flip * 2.0**-7 + alphas + 2 * terms * U)
    weighted = np.einsum("bshk,bskd->bshd", per_entry, np.abs(rows))
    out = np.einsum("bshk,bskd->bshd", w, rows)
    den_rel = r_max + alphas + 2 * (64 + blocks) * U
    return (weighted + np.abs(out) * den_rel) * (1 + 1e-3)


def check_close(fast: np.ndarray, exact: np.ndarray, tol: np.ndarray) -> None:
    """Each output within tol plus one bf16 ulp of exact's (both are bf16 roundings)."""
    allowed = tol + bf16_ulp(np.maximum(np.abs(fast), np.abs(exact)))
    err = np.abs(fast.astype(np.float64) - exact.astype(np.float64))
    bad = ~(err <= allowed) & ~(np.isnan(fast) & np.isnan(exact))
    assert not bad.any(), (bad.mean(), np.argwhere(bad)[:5], err[bad][:5], allowed[bad][:5])


# b, s, h, d, n, k: the released dims (decode: heads split over tasks, index lists gathered
# once; prefill rows: KV converted once), h <= 3 (exact's other order), d and k off every
# vector width, a single entry.
SHAPES = [(4, 1, 64, 512, 700, 640), (1, 6, 64, 512, 300, 640), (1, 3, 5, 200, 90, 129),
          (2, 2, 3, 33, 50, 70), (1, 4, 1, 128, 70, 130), (1, 2, 16, 300, 100, 1),
          (1, 20, 8, 64, 40, 100)]
# Measured fraction of outputs differing from exact as bf16 on these inputs (AMD EPYC,
# Zen 4): at most 0.0025 per shape; asserted with margin.
MAX_DIFFERING = 0.01


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_is_within_the_derived_bound_and_rarely_differs(monkeypatch, shape) -> None:
    q, kv, sink, idx = model_inputs(sum(shape), *shape)
    idx[0, 0, :] = -1  # a row with nothing: exactly 0 in both
    exact = run(monkeypatch, None, q, kv, sink, idx)
    fast = run(monkeypatch, "fast", q, kv, sink, idx)
    assert not fast[0, 0].any() and not np.signbit(fast[0, 0]).any()
    check_close(fast, exact, fast_tolerance(q, kv, sink, idx, q.shape[-1] ** -0.5))
    differing = (bits(fast) != bits(exact)).mean()
    assert differing <= MAX_DIFFERING, differing


@needs_bf16
def test_fast_is_deterministic_for_any_thread_count_and_source(monkeypatch) -> None:
    """Same bits on repeated runs, 1 or 3 threads, heads split or not (decode vs prefill
    rows), KV converted once per call or per task, and read from a packed cache or from the
    concatenated float rows."""
    fmt = "fp4_e4m3_16"
    rng = np.random.default_rng(5)
    b, h, d, n_window, n_cache, k = 2, 64, 512, 128, 300, 640
    q = round_bf16(rng.standard_normal((b, 3, h, d)) * 2)
    kv = round_bf16(rng.standard_normal((b, n_window, d)))
    compressed = pack_quantized(round_bf16(rng.standard_normal((b, n_cache, d))), fmt)
    rows = sparse_attention_rows(kv, compressed, fmt)
    sink = rng.standard_normal(h).astype(np.float32)
    idx = np.concatenate([np.broadcast_to(np.arange(n_window), (b, 3, n_window)),
                          n_window + rng.integers(0, n_cache, (b, 3, k - n_window))], axis=-1)
    idx[rng.random(idx.shape) < 0.1] = -1
    want = run(monkeypatch, "fast", q, rows, sink, idx, threads=1)
    for threads in (1, 3):
        for s in (slice(0, 1), slice(0, 3)):  # decode-sized (heads split) and a few rows
            got = run(monkeypatch, "fast", q[:, s], rows, sink, idx[:, s], threads=threads)
            np.testing.assert_array_equal(bits(got), bits(want[:, s]))
            sess = session(monkeypatch, "fast", d**-0.5, threads, packed_format=fmt)
            got = sess.run(None, {"Q": q[:, s], "KV": kv, "S": sink, "I": idx[:, s],
                                  "C": compressed})[0]
            np.testing.assert_array_equal(bits(got), bits(want[:, s]))
    many = np.concatenate([idx] * 6, axis=1)  # 18 rows: KV read more than once, converted once
    got = run(monkeypatch, "fast", np.concatenate([q] * 6, axis=1), rows, sink, many, threads=2)
    np.testing.assert_array_equal(bits(got), bits(np.concatenate([want] * 6, axis=1)))


@needs_bf16
def test_fast_rounds_float_inputs_to_bf16(monkeypatch) -> None:
    """Arbitrary float q and rows: fast is the call on their bf16 roundings (RNE)."""
    rng = np.random.default_rng(9)
    q = (rng.standard_normal((1, 3, 16, 96)) * 2).astype(np.float32)
    kv = rng.standard_normal((1, 50, 96)).astype(np.float32)
    sink = rng.standard_normal(16).astype(np.float32)
    idx = rng.integers(-1, 50, (1, 3, 100))
    got = run(monkeypatch, "fast", q, kv, sink, idx)
    want = run(monkeypatch, "fast", round_bf16(q), round_bf16(kv), sink, idx)
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("h", [1, 64])
def test_nan_and_inf_where_exact_has_them(monkeypatch, h: int) -> None:
    q, kv, sink, idx = model_inputs(h, 1, 5, h, 64, 40, 100)
    q[0, 0, 0, 3] = np.nan  # one head's logits NaN: its outputs NaN
    kv[0, 7, 5] = np.inf  # an infinite value where row 7 is read
    idx[0, 1, 10] = 7
    q[0, 2] *= 3e18  # logits overflow to inf: the softmax gives NaN
    idx[0, 3, :] = -1
    idx[0, 3, 99] = 7  # only the infinite row
    sink[0] = np.inf  # sink dominates: head 0's outputs 0 (or NaN where exact has NaN)
    exact = run(monkeypatch, None, q, kv, sink, idx)
    fast = run(monkeypatch, "fast", q, kv, sink, idx)
    assert np.isnan(exact).any() and np.isinf(kv).any()
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(exact))
    np.testing.assert_array_equal(np.isinf(fast), np.isinf(exact))
    finite = np.isfinite(exact)
    np.testing.assert_array_equal(np.signbit(fast[finite] != 0), np.signbit(exact[finite] != 0))


@pytest.mark.parametrize("isa", [("CSA2ONNX_ISA", "avx512"), ("CSA2ONNX_ISA", "avx2"),
                                 ("CSA_SPARSE_ATTENTION_ISA", "avx512"),
                                 ("CSA_SPARSE_ATTENTION_ISA", "scalar"),
                                 ("CSA_SPARSE_ATTENTION_ISA", "reference"), None],
                         ids=lambda x: "=".join(x) if x else "default")
def test_fast_is_exact_without_avx512bf16(monkeypatch, isa) -> None:
    """Forced below AVX512-BF16 (or on a CPU without it), fast runs the exact kernel."""
    if isa is None and HAS_BF16:
        pytest.skip("this CPU has AVX512-BF16: session() forces its path, the fast kernel "
                    "(the AMX class's unforced default is tested below)")
    if isa is not None and isa[1] in ("avx512", "avx2") and isa[1] not in cpu_isas():
        pytest.skip(f"this CPU has no {isa[1]}")
    q, kv, sink, idx = model_inputs(3, 1, 3, 8, 100, 60, 130)
    want = run(monkeypatch, None, q, kv, sink, idx, isa=isa)
    got = run(monkeypatch, "fast", q, kv, sink, idx, isa=isa)
    np.testing.assert_array_equal(bits(got), bits(want))


@needs_bf16
def test_avx512bf16_forces_the_fast_kernel_only_where_fast(monkeypatch) -> None:
    q, kv, sink, idx = model_inputs(4, 1, 3, 16, 128, 60, 130)
    default = run(monkeypatch, "fast", q, kv, sink, idx)
    for variable in ISA_VARIABLES:
        forced = run(monkeypatch, "fast", q, kv, sink, idx, isa=(variable, "avx512bf16"))
        np.testing.assert_array_equal(bits(forced), bits(default))
    # An exact node forced there runs the exact vdpbf16ps tiles: the exact bits.
    exact = run(monkeypatch, None, q, kv, sink, idx, isa=("CSA_SPARSE_ATTENTION_ISA", "reference"))
    for variable in ISA_VARIABLES:
        forced = run(monkeypatch, None, q, kv, sink, idx, isa=(variable, "avx512bf16"))
        np.testing.assert_array_equal(bits(forced), bits(exact))


def test_numerics_attribute_errors(monkeypatch) -> None:
    with pytest.raises(Exception, match=r'attribute numerics must be "exact" or "fast", '
                                        r'got "fastest"'):
        session(monkeypatch, "fastest", 0.1)
    node = helper.make_node("SparseAttention", ["Q", "KV", "S", "I"], ["O"], domain="csa2onnx",
                            softmax_scale=0.1, numerics=1)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node], "sa", [vi("Q", TensorProto.FLOAT, None), vi("KV", TensorProto.FLOAT, None),
                       vi("S", TensorProto.FLOAT, None), vi("I", TensorProto.INT64, None)],
        [vi("O", TensorProto.FLOAT, None)])
    with pytest.raises(Exception, match=r"numerics"):
        make_session(custom_op_model(graph))
    q, kv, sink, idx = model_inputs(1, 1, 2, 4, 32, 10, 20)
    np.testing.assert_array_equal(bits(run(monkeypatch, "exact", q, kv, sink, idx)),
                                  bits(run(monkeypatch, None, q, kv, sink, idx)))


@pytest.mark.parametrize("portable", [False, True], ids=["kernel", "portable"])
def test_wrapper_emits_numerics_only_when_fast(portable: bool) -> None:
    import onnx_ir as ir

    from csa2onnx.custom_ops import ops
    from csa2onnx.graphs.standalone import build_model

    specs = [("q", ir.DataType.FLOAT, [1, 2, 4, 32]), ("kv", ir.DataType.FLOAT, [1, "n", 32]),
             ("sink", ir.DataType.FLOAT, [4]), ("idx", ir.DataType.INT64, [1, 2, "k"])]

    def attributes(numerics: str | None, graph: str | None = None) -> dict[str, object]:
        def body(op, *v):
            if graph is not None:  # as the exporter marks a graph built fast
                op.builder.root.graph.metadata_props[ops.NUMERICS_KEY] = graph
            return ops.sparse_attention(op, *v, 0.125, numerics=numerics)

        model = build_model("sa", specs, ["o"], body, portable=portable)
        node = next(n for n in model.graph.node if n.op_type == "SparseAttention")
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    assert "numerics" not in attributes("exact") and "numerics" not in attributes(None)
    with pytest.raises(ValueError, match=r"numerics must be one of \['exact', 'fast'\], "
                                         r"got 'turbo'"):
        attributes("turbo")
    if portable:
        with pytest.raises(ValueError, match="a portable graph runs standard ONNX ops only"):
            attributes("fast")
    else:
        assert attributes("fast")["numerics"] == b"fast"
        assert attributes(None, graph="fast")["numerics"] == b"fast"  # the graph's numerics
        assert "numerics" not in attributes("exact", graph="fast")


@needs_bf16
def test_vector_exp_is_std_exp_but_for_a_last_bit_now_and_then(tmp_path: Path) -> None:
    """The softmax's vectorised exp (tests/cpp/sparse_attention_fast_exp.cc) on 37 million
    floats in [-150, 100] and the special values: at most one ulp from std::exp, and that
    on 7.6e-5 of the arguments (all 2.2e9 of them checked once: the same fraction)."""
    driver = build_cpp_driver(Path(__file__).resolve().parent / "cpp" /
                              "sparse_attention_fast_exp.cc", tmp_path)
    out = subprocess.run([str(driver)], capture_output=True, text=True, timeout=300)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", out.stdout.splitlines()[-1])}
    assert out.returncode == 0 and counts["beyond"] == 0 and counts["specials"] == 0, out.stdout
    assert counts["values"] > 30_000_000 and counts["differ"] <= 2e-4 * counts["values"]


AMX = "amx_bf16" in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else "")


@pytest.mark.skipif(not AMX, reason="the AMX-class default needs a CPU with AMX-BF16")
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_an_amx_cpu_runs_the_avx512_tiles_unforced(monkeypatch, numerics: str) -> None:
    """Unforced, a CPU with AMX (vdpbf16ps on one port) takes the avx512 fmaf tiles for both
    numerics: the exact kernel's bits."""
    rng = np.random.default_rng(11)
    q = round_bf16(rng.standard_normal((2, 3, 16, 64)).astype(np.float32))
    kv = round_bf16(rng.standard_normal((2, 40, 64)).astype(np.float32))
    sink = rng.standard_normal(16).astype(np.float32)
    idx = rng.integers(-1, 40, (2, 3, 30))
    feeds = {"Q": q, "KV": kv, "S": sink, "I": idx}
    for variable in ISA_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    unforced = make_session(fast_model(64**-0.5, numerics), options=session_options(2))
    want = run(monkeypatch, "exact", q, kv, sink, idx, isa=("CSA_SPARSE_ATTENTION_ISA", "avx512"))
    np.testing.assert_array_equal(bits(unforced.run(None, feeds)[0]), bits(want))
