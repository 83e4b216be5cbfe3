"""sparse_attn against the unit kernel golden, every case/step/layer's attn_o, a NumPy model
of the blockwise kernel on edge sizes, and a plain softmax (to show the rounding matters)."""

from __future__ import annotations

import functools
import json

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import CASES, GOLDENS, golden

from csa2onnx.custom_ops import make_session
from csa2onnx.export.goldens import compare
from csa2onnx.graphs.sparse_attn import BLOCK, sparse_attn
from csa2onnx.graphs.standalone import build_model

FLOAT, INT32 = ir.DataType.FLOAT, ir.DataType.INT32
HEADS, HEAD_DIM = 4, 128
SCALE = HEAD_DIM**-0.5


@functools.cache
def _session(heads: int = HEADS, head_dim: int = HEAD_DIM) -> ort.InferenceSession:
    model = build_model(
        "sparse_attn",
        [("q", FLOAT, ["b", "s", heads, head_dim]), ("kv", FLOAT, ["b", "n", head_dim]),
         ("attn_sink", FLOAT, [heads]), ("idx", INT32, ["b", "s", "k"])],
        ["o"], lambda op, q, kv, sink, idx: sparse_attn(op, q, kv, sink, idx, head_dim**-0.5))
    return make_session(model.SerializeToString())


def _run(q: np.ndarray, kv: np.ndarray, sink: np.ndarray, idx: np.ndarray) -> np.ndarray:
    feeds = {"q": q, "kv": kv, "attn_sink": sink, "idx": idx.astype(np.int32)}
    return _session(q.shape[2], q.shape[3]).run(None, feeds)[0]


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _rows(kv: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return kv[np.arange(kv.shape[0])[:, None, None], np.maximum(idx, 0)]  # [b, s, k, d]


def blockwise_reference(q, kv, sink, idx, scale):
    """The kernel as the spec states it: an online softmax, one block of 64 at a time."""
    rows = _rows(kv, idx)
    b, s, h, d = q.shape
    m = np.full((b, s, h), -1e30, np.float32)
    total = np.zeros((b, s, h), np.float32)
    acc = np.zeros((b, s, h, d), np.float32)
    for start in range(0, idx.shape[-1], BLOCK):
        blk, valid = rows[:, :, start:start + BLOCK], idx[:, :, start:start + BLOCK] >= 0
        logits = np.einsum("bshd,bskd->bshk", q, blk).astype(np.float32) * np.float32(scale)
        logits = np.where(valid[:, :, None], logits, -np.inf).astype(np.float32)
        m_new = np.maximum(m, logits.max(-1))
        p = np.exp(logits - m_new[..., None]).astype(np.float32)
        alpha = np.exp(m - m_new).astype(np.float32)
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + np.einsum("bshk,bskd->bshd", _bf16(p), blk)
        m = m_new
    with np.errstate(over="ignore"):  # an all -1 row: exp(sink + 1e30) = inf, o = 0
        return _bf16(acc / (total + np.exp(sink - m))[..., None])


def plain_softmax(q, kv, sink, idx, scale):
    """An exact (float64, unblocked, unrounded-p) softmax with the sink: what the kernel's
    bf16 probabilities depart from."""
    rows = _rows(kv, idx).astype(np.float64)
    logits = np.einsum("bshd,bskd->bshk", q.astype(np.float64), rows) * scale
    logits = np.where((idx >= 0)[:, :, None], logits, -np.inf)
    m = np.maximum(logits.max(-1, initial=-1e30), -1e30)
    p = np.exp(logits - m[..., None])
    with np.errstate(over="ignore"):
        denom = p.sum(-1) + np.exp(sink.astype(np.float64) - m)
    return (np.einsum("bshk,bskd->bshd", p, rows) / denom[..., None]).astype(np.float32)


def _unit() -> tuple[dict[str, np.ndarray], float]:
    with np.load(GOLDENS / "unit_kernels.npz") as z:
        arrays = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith("sparse_attn.")}
    meta = json.loads((GOLDENS / "unit_kernels.json").read_text())
    return arrays, meta["sparse_attn"]["softmax_scale"]


def test_unit_kernel_golden(golden_report) -> None:
    a, scale = _unit()
    assert scale == pytest.approx(SCALE)
    o = _run(a["q"], a["kv"], a["attn_sink"], a["topk_idxs"])
    result = golden_report.check("unit_kernels", "sparse_attn", "sparse_attn.o", o, a["o"])
    assert result.bit_identical == 1.0
    all_skipped = (a["topk_idxs"] < 0).all(-1)
    assert all_skipped.any() and (o[all_skipped] == 0).all()


def test_unit_plain_softmax_is_further_off() -> None:
    """The golden's own float64 plain softmax is ~0.0066 away; ours is bit-identical."""
    a, scale = _unit()
    o = _run(a["q"], a["kv"], a["attn_sink"], a["topk_idxs"])
    ours = compare(o, a["o"])
    plain = compare(plain_softmax(a["q"], a["kv"], a["attn_sink"], a["topk_idxs"], scale),
                    a["o"])
    assert plain.max_abs_err > 1e-3 and plain.bit_identical < 0.9
    assert ours.bit_identical > plain.bit_identical


def _steps(case: str) -> list[str]:
    return [s["step"] for s in json.loads((GOLDENS / f"{case}.json").read_text())["schedule"]]


GOLDEN_PARAMS = [(case, step, layer) for case in CASES for step in _steps(case)
                 for layer in range(6)]


@pytest.mark.parametrize(("case", "step", "layer"), GOLDEN_PARAMS,
                         ids=[f"{c}-{s}-L{la}" for c, s, la in GOLDEN_PARAMS])
def test_golden_attn_o(golden_report, case: str, step: str, layer: int) -> None:
    g = golden(case)
    o = _run(g.step(step, layer, "q_rope"), g.step(step, layer, "attn_kv"),
             g.weights(layer)["attn_sink"], g.step(step, layer, "attn_topk_idxs"))
    golden_report.check(case, "sparse_attn", f"{step}.L{layer}.attn_o", o,
                        g.step(step, layer, "attn_o"))


@pytest.mark.parametrize("case", CASES)
def test_blockwise_rounding_matters(case: str) -> None:
    """Across a case's prefill, the graph is (almost) bit-identical to the golden while a
    plain softmax matches only about two thirds of the bf16 outputs."""
    g = golden(case)
    for layer in range(6):
        args = [g.step("prefill", layer, n) for n in ("q_rope", "attn_kv")]
        args += [g.weights(layer)["attn_sink"], g.step("prefill", layer, "attn_topk_idxs")]
        expected = g.step("prefill", layer, "attn_o")
        ours = compare(_run(*args), expected)
        plain = compare(_bf16(plain_softmax(*args, SCALE)), expected)
        assert ours.bit_identical > 0.998, (layer, ours)
        assert plain.bit_identical < 0.8 and plain.max_abs_err > ours.max_abs_err, (layer, plain)


@pytest.mark.parametrize("k", [0, 1, 63, 64, 65, 130])
def test_edge_sizes_match_blockwise_model(k: int) -> None:
    """k not a multiple of 64 (padded tail), a single index, none at all; batch 2; partial
    and all -1 rows; repeated indices."""
    rng = np.random.default_rng(k)
    b, s, n = 2, 5, 90
    q = _bf16(rng.normal(size=(b, s, HEADS, HEAD_DIM)) * 2)
    kv = _bf16(rng.normal(size=(b, n, HEAD_DIM)))
    sink = _bf16(rng.normal(size=HEADS))
    idx = rng.integers(-1, n, size=(b, s, k))
    idx[:, 0] = -1  # all skipped
    idx[:, 1, : k // 2] = -1  # the first blocks skipped, the running max starts late
    idx[:, 2] = idx[:, 2, :1]  # one row repeated
    o = _run(q, kv, sink, idx)
    expected = blockwise_reference(q, kv, sink, idx, SCALE)
    assert compare(o, expected).ok
    assert (o[:, 0] == 0).all()


def test_empty_queries() -> None:
    q = np.zeros((1, 0, HEADS, HEAD_DIM), np.float32)
    o = _run(q, np.zeros((1, 3, HEAD_DIM), np.float32), np.zeros(HEADS, np.float32),
             np.zeros((1, 0, 7), np.int32))
    assert o.shape == (1, 0, HEADS, HEAD_DIM)


def test_bad_scale_raises() -> None:
    with pytest.raises(ValueError, match="softmax_scale"):
        build_model("bad", [("q", FLOAT, [1, 1, 1, 4]), ("kv", FLOAT, [1, 1, 4]),
                            ("sink", FLOAT, [1]), ("idx", INT32, [1, 1, 1])], ["o"],
                    lambda op, q, kv, sink, idx: sparse_attn(op, q, kv, sink, idx, 0.0))
