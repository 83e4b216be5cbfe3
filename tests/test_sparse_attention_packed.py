"""SparseAttention reading a packed compressed cache (its optional 5th input `Compressed`,
attribute compressed_format): bit for bit the call on the concatenated float rows
Concat(KV, UnpackQuantized(Compressed)) (custom_ops/reference.py `sparse_attention_rows`), on
every instruction-set path (the tiled kernel's, and the per-row definition's) and thread
count, for every packed format; indices bounds-checked against KV's rows plus the cache's;
errors name the problem. (tests/cpp/sparse_attention_tiles.cc checks the same on the float32
quotients before the final bf16 rounding.)"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper
from test_sparse_attention_op import sa_model

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.constants import PACKED_FORMATS
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.custom_ops.reference import pack_quantized, round_bf16, sparse_attention_rows

PATHS = [isa for isa in ("avx512", "avx2", "scalar", "reference")
         if isa in cpu_isas() or isa == "reference"]


def packed_model(scale: float, fmt: str | None, idx_type: int = TensorProto.INT64,
                 with_input: bool = True) -> bytes:
    inputs = ["Q", "KV", "S", "I"] + (["C"] if with_input else [])
    attrs = {"softmax_scale": float(scale)} | ({"compressed_format": fmt} if fmt else {})
    node = helper.make_node("SparseAttention", inputs, ["O"], domain="csa2onnx", **attrs)
    vi = helper.make_tensor_value_info
    infos = [vi("Q", TensorProto.FLOAT, ["b", "s", "h", "d"]),
             vi("KV", TensorProto.FLOAT, ["b", "n", "d"]), vi("S", TensorProto.FLOAT, ["h"]),
             vi("I", idx_type, ["b", "s", "k"])]
    if with_input:
        infos.append(vi("C", TensorProto.UINT8, None))  # unranked: the kernel checks it
    graph = helper.make_graph([node], "sa_packed", infos,
                              [vi("O", TensorProto.FLOAT, ["b", "s", "h", "d"])])
    return custom_op_model(graph)


def session(monkeypatch, model: bytes, isa: str, threads: int) -> ort.InferenceSession:
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    monkeypatch.setenv("CSA_SPARSE_ATTENTION_ISA", isa)  # read when the kernel is created
    try:
        return make_session(model, options=session_options(threads))
    finally:
        monkeypatch.delenv("CSA_SPARSE_ATTENTION_ISA")


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def inputs(seed: int, b: int, s: int, h: int, d: int, n_window: int, n_cache: int, k: int,
           fmt: str, minus_one: float = 0.15):
    """bf16 q and window rows as the layer feeds them; the cache packed from bf16 latents;
    per query the window's rows first, then compressed rows (offset by n_window)."""
    rng = np.random.default_rng(seed)
    q = round_bf16(rng.standard_normal((b, s, h, d)) * 2)
    kv = round_bf16(rng.standard_normal((b, n_window, d)))
    latents = round_bf16(rng.standard_normal((b, n_cache, d)) *
                         np.exp2(rng.integers(-3, 3, (b, n_cache, 1))))
    compressed = pack_quantized(latents, fmt)
    sink = rng.standard_normal(h).astype(np.float32)
    window = min(n_window, k)
    idx = np.concatenate([np.broadcast_to(np.arange(window), (b, s, window)),
                          n_window + rng.integers(0, max(n_cache, 1), (b, s, k - window))],
                         axis=-1)
    if n_cache == 0:
        idx[..., window:] = -1
    idx[rng.random((b, s, k)) < minus_one] = -1
    return q, kv, sink, idx.astype(np.int64), compressed


def compare(monkeypatch, q, kv, sink, idx, compressed, fmt, paths=None, threads=(1, 2)) -> None:
    """The packed call on every path and thread count against the float call on the
    concatenated rows (the per-row definition), bit for bit."""
    scale = q.shape[-1] ** -0.5
    it = TensorProto.INT32 if idx.dtype == np.int32 else TensorProto.INT64
    rows = sparse_attention_rows(kv, compressed, fmt)
    want = session(monkeypatch, sa_model(scale, it), "reference", 1).run(
        None, {"Q": q, "KV": rows, "S": sink, "I": idx})[0]
    feeds = {"Q": q, "KV": kv, "S": sink, "I": idx, "C": compressed}
    for isa in paths or PATHS:
        for t in threads:
            got = session(monkeypatch, packed_model(scale, fmt, it), isa, t).run(None, feeds)[0]
            diff = bits(got) != bits(want)
            assert not diff.any(), (fmt, isa, t, q.shape, diff.mean(), np.argwhere(diff)[:5])


@pytest.mark.parametrize("fmt", list(PACKED_FORMATS))
@pytest.mark.parametrize("h", [1, 3, 4, 64])
def test_packed_cache_equals_concatenated_rows(monkeypatch, fmt: str, h: int) -> None:
    d = 128 if h < 64 else 256
    q, kv, sink, idx, c = inputs(h + len(fmt), 2, 3, h, d, 40, 120, 200, fmt)
    idx[0, 0] = -1  # a row with nothing
    idx[1, 2, 64:128] = -1  # a whole block skipped
    idx[1, 1, 70:100] = idx[1, 1, 75]  # duplicates of a packed row
    compare(monkeypatch, q, kv, sink, idx, c, fmt)
    compare(monkeypatch, q, kv, sink, idx.astype(np.int32), c, fmt, paths=PATHS[:1],
            threads=(2,))


def test_released_dims_decode_and_prefill(monkeypatch) -> None:
    """h = 64, d = 512, window 128 + 512 compressed rows of fp4_e4m3_16 (the compressed-KV
    cache): decode (b = 1 and 4, heads split over tasks) and a few prefill rows."""
    for b in (1, 4):
        q, kv, sink, idx, c = inputs(11 + b, b, 1, 64, 512, 128, 700, 640, "fp4_e4m3_16", 0.02)
        compare(monkeypatch, q, kv, sink, idx, c, "fp4_e4m3_16", threads=(1, 3))
    q, kv, sink, idx, c = inputs(12, 1, 5, 64, 512, 128, 900, 640, "fp4_e4m3_16", 0.0)
    compare(monkeypatch, q, kv, sink, idx, c, "fp4_e4m3_16", paths=PATHS[:1], threads=(2,))


def test_long_decode_lists_unpack_on_the_gather(monkeypatch) -> None:
    """A decode index list past the once-per-call buffer's limit (2^22 floats): the split
    tasks unpack on their gathers instead, same bits."""
    q, kv, sink, idx, c = inputs(14, 1, 1, 32, 512, 128, 9000, 8300, "fp4_e4m3_16", 0.01)
    compare(monkeypatch, q, kv, sink, idx, c, "fp4_e4m3_16", paths=PATHS[:1], threads=(2,))


def test_prefill_rows_unpack_on_the_gather(monkeypatch) -> None:
    """16 query rows or more: one task per row with all its heads, which unpacks its packed
    rows on the gather (fewer rows split the heads over tasks and unpack once per call)."""
    for fmt in PACKED_FORMATS:
        q, kv, sink, idx, c = inputs(13, 1, 17, 64, 128, 60, 100, 130, fmt)
        compare(monkeypatch, q, kv, sink, idx, c, fmt, paths=PATHS,
                threads=(1, 2))


def test_edge_layouts(monkeypatch) -> None:
    """No window rows (every index packed); no cache rows (the format set, Compressed empty);
    only window rows selected though a cache is given; NaN blocks in the cache."""
    fmt = "fp8_e8m0_32"
    q, kv, sink, idx, c = inputs(3, 1, 2, 4, 64, 0, 90, 100, fmt)
    compare(monkeypatch, q, kv, sink, idx, c, fmt)
    q, kv, sink, idx, c = inputs(4, 1, 2, 4, 64, 30, 0, 60, fmt)
    assert c.shape == (1, 0, 66)
    compare(monkeypatch, q, kv, sink, idx, c, fmt)
    q, kv, sink, idx, c = inputs(5, 1, 2, 4, 64, 30, 50, 20, fmt)
    compare(monkeypatch, q, kv, sink, idx, c, fmt)
    q, kv, sink, idx, c = inputs(6, 1, 2, 4, 64, 30, 50, 80, fmt)
    c[0, 3, -2] = 0xFF  # a NaN scale: that row's block is NaN, so are outputs reading it
    idx[0, 0, -1] = 30 + 3
    compare(monkeypatch, q, kv, sink, idx, c, fmt)


def test_without_compressed_the_op_is_unchanged(monkeypatch) -> None:
    """A format but no Compressed input: the plain float call (no packed rows)."""
    q, kv, sink, idx, _ = inputs(8, 1, 2, 8, 64, 50, 0, 40, "fp4_e4m3_16")
    want = make_session(sa_model(0.125)).run(None, {"Q": q, "KV": kv, "S": sink, "I": idx})[0]
    got = make_session(packed_model(0.125, "fp4_e4m3_16", with_input=False)).run(
        None, {"Q": q, "KV": kv, "S": sink, "I": idx})[0]
    np.testing.assert_array_equal(bits(got), bits(want))


ERRORS = ort.capi.onnxruntime_pybind11_state.InvalidArgument


def test_indices_are_checked_against_window_plus_cache() -> None:
    q, kv, sink, idx, c = inputs(9, 1, 1, 4, 64, 10, 20, 30, "fp4_e8m0_32")
    s = make_session(packed_model(0.125, "fp4_e8m0_32"))
    idx[0, 0, 5] = 30
    with pytest.raises(ERRORS, match=r"Idx\[0, 0, 5\] = 30 is out of range: indices must be -1 "
                                     r"or in \[0, 30\) \(KV's 10 rows, then 20 rows of Compr"):
        s.run(None, {"Q": q, "KV": kv, "S": sink, "I": idx, "C": c})
    idx[0, 0, 5] = 29  # the last packed row is fine
    s.run(None, {"Q": q, "KV": kv, "S": sink, "I": idx, "C": c})


@pytest.mark.parametrize(("fmt", "shape", "message"), [
    ("fp4_e4m3_16", (1, 20, 35), r"Compressed must be \[b, n_cache, row_bytes\] = \[1, n_cache, "
                                 r"36\] \(fp4_e4m3_16 rows of d = 64\), got \[1, 20, 35\]"),
    ("fp4_e4m3_16", (2, 20, 36), r"Compressed must be \[b, n_cache, row_bytes\] = \[1,"),
    ("fp4_e4m3_16", (20, 36), r"Compressed must be"),
    (None, (1, 20, 36), r"input Compressed needs the attribute compressed_format"),
])
def test_bad_compressed_inputs_are_clear_errors(fmt, shape, message) -> None:
    q, kv, sink, idx, _ = inputs(10, 1, 1, 4, 64, 10, 0, 10, "fp4_e4m3_16")
    s = make_session(packed_model(0.125, fmt))
    with pytest.raises(ERRORS, match=f"SparseAttention: {message}"):
        s.run(None, {"Q": q, "KV": kv, "S": sink, "I": idx, "C": np.zeros(shape, np.uint8)})


def test_format_and_dimension_errors() -> None:
    with pytest.raises(Exception, match=r"unknown compressed_format \"fp4\""):
        make_session(packed_model(0.125, "fp4"))
    q, kv, sink, idx, _ = inputs(10, 1, 1, 4, 48, 10, 0, 10, "fp4_e4m3_16")
    s = make_session(packed_model(0.125, "fp8_e8m0_32"))
    with pytest.raises(ERRORS, match=r"compressed_format fp8_e8m0_32 packs blocks of 32 values, "
                                     r"which do not divide d = 48"):
        s.run(None, {"Q": q, "KV": kv, "S": sink, "I": idx,
                     "C": np.zeros((1, 4, 50), np.uint8)})


# ---------------------------------------------------------------- the graph-side wrapper
@pytest.mark.parametrize("portable", [False, True], ids=["kernel", "portable"])
def test_wrapper_with_a_packed_cache(portable: bool) -> None:
    """custom_ops/ops.py sparse_attention(compressed=...): the 5-input node, or in a portable
    graph Concat(kv, UnpackQuantized) into the 4-input body, which runs without the library;
    either equals the same wrapper on the concatenated float rows bit for bit."""
    import onnx_ir as ir

    from csa2onnx.custom_ops import ops
    from csa2onnx.graphs.standalone import build_model

    fmt, d = "fp4_e4m3_16", 64
    q, kv, sink, idx, c = inputs(21, 1, 2, 4, d, 16, 40, 50, fmt)
    specs = [("q", ir.DataType.FLOAT, [1, 2, 4, d]), ("kv", ir.DataType.FLOAT, [1, "n", d]),
             ("sink", ir.DataType.FLOAT, [4]), ("idx", ir.DataType.INT64, [1, 2, "k"])]
    packed = build_model("sa", [*specs, ("c", ir.DataType.UINT8, [1, "m", 36])], ["o"],
                         lambda op, *v: ops.sparse_attention(op, *v[:4], 0.125, v[4], fmt),
                         portable=portable)
    plain = build_model("sa", specs, ["o"], lambda op, *v: ops.sparse_attention(op, *v, 0.125),
                        portable=portable)
    nodes = [n.op_type for n in packed.graph.node]
    assert ("UnpackQuantized" in nodes) == portable and "SparseAttention" in nodes
    if portable:  # build_model attached the function bodies
        run = lambda m, f: ort.InferenceSession(  # noqa: E731
            m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)[0]
    else:
        run = lambda m, f: make_session(m.SerializeToString()).run(None, f)[0]  # noqa: E731
    got = run(packed, {"q": q, "kv": kv, "sink": sink, "idx": idx, "c": c})
    want = run(plain, {"q": q, "kv": sparse_attention_rows(kv, c, fmt), "sink": sink,
                       "idx": idx})
    np.testing.assert_array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="unknown packed format"):
        build_model("sa", [*specs, ("c", ir.DataType.UINT8, [1, "m", 36])], ["o"],
                    lambda op, *v: ops.sparse_attention(op, *v[:4], 0.125, v[4], "fp4"))
