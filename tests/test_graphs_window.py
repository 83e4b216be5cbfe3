"""Window indices and the ring buffer against the goldens' attn_topk_idxs / attn_kv window
parts and window_kv_cache_after, plus small hand-checked layouts."""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import CASES, GOLDENS, golden

from csa2onnx.custom_ops import make_session
from csa2onnx.graphs.standalone import build_model
from csa2onnx.graphs.window import window_chunk, window_decode, window_prefill

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64


@functools.cache
def _prefill(window_size: int, head_dim: int) -> ort.InferenceSession:
    model = build_model("window_prefill", [("kv", FLOAT, ["b", "s", head_dim])],
                        ["idx", "ring"], lambda op, kv: window_prefill(op, kv, window_size))
    return make_session(model.SerializeToString())


@functools.cache
def _decode(window_size: int, head_dim: int) -> ort.InferenceSession:
    model = build_model(
        "window_decode",
        [("kv", FLOAT, ["b", 1, head_dim]), ("ring", FLOAT, ["b", window_size, head_dim]),
         ("start_pos", INT64, [1])],
        ["idx", "ring_out"],
        lambda op, kv, ring, pos: window_decode(op, kv, ring, pos, window_size))
    return make_session(model.SerializeToString())


@functools.cache
def _chunk(window_size: int, head_dim: int) -> ort.InferenceSession:
    model = build_model(
        "window_chunk",
        [("kv", FLOAT, ["b", "s", head_dim]), ("ring", FLOAT, ["b", window_size, head_dim]),
         ("start_pos", INT64, [1])],
        ["idx", "rows", "ring_out"],
        lambda op, kv, ring, pos: window_chunk(op, kv, ring, pos, window_size))
    return make_session(model.SerializeToString())


def run_prefill(kv: np.ndarray, window_size: int) -> tuple[np.ndarray, np.ndarray]:
    idx, ring = _prefill(window_size, kv.shape[-1]).run(None, {"kv": kv})
    return idx, ring


def run_decode(kv: np.ndarray, ring: np.ndarray, start_pos: int,
               window_size: int) -> tuple[np.ndarray, np.ndarray]:
    feeds = {"kv": kv, "ring": ring, "start_pos": np.array([start_pos], np.int64)}
    idx, ring_out = _decode(window_size, kv.shape[-1]).run(None, feeds)
    return idx, ring_out


def seeded_ring(kv: np.ndarray, window_size: int) -> np.ndarray:
    """The reference's ring after a prefill: the last min(s, win) rows at slots p % win."""
    b, s, d = kv.shape
    ring = np.zeros((b, window_size, d), kv.dtype)
    for p in range(max(0, s - window_size), s):
        ring[:, p % window_size] = kv[:, p]
    return ring


def _schedule(case: str) -> list[dict]:
    return json.loads((GOLDENS / f"{case}.json").read_text())["schedule"]


CASE_LAYERS = [(case, layer) for case in CASES for layer in range(6)]
STEP_PARAMS = [(case, st["step"], st["start_pos"], layer) for case in CASES
               for st in _schedule(case)[1:] for layer in range(6)]


@pytest.mark.parametrize(("case", "layer"), CASE_LAYERS,
                         ids=[f"{c}-prefill-L{la}" for c, la in CASE_LAYERS])
def test_prefill(golden_report, case: str, layer: int) -> None:
    g = golden(case)
    win = g.model_args["window_size"]
    kv = g.step("prefill", layer, "window_kv")
    idx, ring = run_prefill(kv, win)
    width = min(kv.shape[1], win)
    golden_report.check(case, "window", f"prefill.L{layer}.attn_topk_idxs[:win]", idx,
                        g.step("prefill", layer, "attn_topk_idxs")[..., :width])
    golden_report.check(case, "window", f"prefill.L{layer}.attn_kv[:s]", kv,
                        g.step("prefill", layer, "attn_kv")[:, :kv.shape[1]], exact=True)
    np.testing.assert_array_equal(ring, seeded_ring(kv, win))
    # The first decode step reads this ring with one slot overwritten.
    first = _schedule(case)[1]
    after = g.step(first["step"], layer, "attn_kv")[:, :win]
    kept = np.arange(win) != first["start_pos"] % win
    np.testing.assert_array_equal(ring[:, kept], after[:, kept])


@pytest.mark.parametrize(("case", "step", "start_pos", "layer"), STEP_PARAMS,
                         ids=[f"{c}-{s}-L{la}" for c, s, _, la in STEP_PARAMS])
def test_decode_step(golden_report, case: str, step: str, start_pos: int, layer: int) -> None:
    """Each decode step from the golden ring before it (the previous step's attn_kv window,
    or the prefill's seeded ring)."""
    g = golden(case)
    win = g.model_args["window_size"]
    schedule = _schedule(case)
    previous = schedule[[s["step"] for s in schedule].index(step) - 1]["step"]
    ring = (seeded_ring(g.step("prefill", layer, "window_kv"), win) if previous == "prefill"
            else g.step(previous, layer, "attn_kv")[:, :win])
    idx, ring_out = run_decode(g.step(step, layer, "window_kv"), ring, start_pos, win)
    golden_report.check(case, "window", f"{step}.L{layer}.attn_topk_idxs[:win]", idx,
                        g.step(step, layer, "attn_topk_idxs")[..., :win])
    golden_report.check(case, "window", f"{step}.L{layer}.attn_kv[:win]", ring_out,
                        g.step(step, layer, "attn_kv")[:, :win], exact=True)


@pytest.mark.parametrize(("case", "layer"), CASE_LAYERS,
                         ids=[f"{c}-L{la}" for c, la in CASE_LAYERS])
def test_chained_ring_reaches_cache_after(golden_report, case: str, layer: int) -> None:
    """The graph's own rings, prefill through the last step, end at window_kv_cache_after."""
    g = golden(case)
    win = g.model_args["window_size"]
    schedule = _schedule(case)
    _, ring = run_prefill(g.step("prefill", layer, "window_kv"), win)
    for st in schedule[1:]:
        _, ring = run_decode(g.step(st["step"], layer, "window_kv"), ring, st["start_pos"], win)
    last = schedule[-1]["step"]
    golden_report.check(case, "window", f"{last}.L{layer}.window_kv_cache_after", ring,
                        g.step(last, layer, "window_kv_cache_after"), exact=True)


@pytest.mark.parametrize("seqlen", [0, 1, 3, 4, 6, 9])
def test_prefill_layout(seqlen: int) -> None:
    win = 4
    kv = np.arange(2 * seqlen * 2, dtype=np.float32).reshape(2, seqlen, 2)
    idx, ring = run_prefill(kv, win)
    t = np.arange(seqlen)[:, None]
    rows = np.maximum(t - win + 1, 0) + np.arange(min(seqlen, win))
    expected = np.where(rows > t, -1, rows)
    assert idx.shape == (2, seqlen, min(seqlen, win))
    np.testing.assert_array_equal(idx, np.broadcast_to(expected, idx.shape))
    np.testing.assert_array_equal(ring, seeded_ring(kv, win))


@pytest.mark.parametrize(("start_pos", "row"), [
    (1, [-1, -1, 0, 1]),  # ring still filling: oldest first, slots past start_pos are -1
    (2, [-1, 0, 1, 2]),
    (3, [0, 1, 2, 3]),
    (4, [1, 2, 3, 0]),  # oldest first
    (6, [3, 0, 1, 2]),
    (9, [2, 3, 0, 1]),
])
def test_decode_layout(start_pos: int, row: list[int]) -> None:
    win = 4
    ring = np.arange(2 * win * 2, dtype=np.float32).reshape(2, win, 2)
    kv = np.full((2, 1, 2), -7.0, np.float32)
    idx, ring_out = run_decode(kv, ring, start_pos, win)
    np.testing.assert_array_equal(idx, np.broadcast_to(row, (2, 1, win)))
    expected = ring.copy()
    expected[:, start_pos % win] = -7.0
    np.testing.assert_array_equal(ring_out, expected)


@pytest.mark.parametrize("window_size", [0, -3, 2.0])
def test_bad_window_size_raises(window_size) -> None:
    with pytest.raises(ValueError, match="window_size"):
        build_model("bad", [("kv", FLOAT, [1, 2, 4])], ["idx", "ring"],
                    lambda op, kv: window_prefill(op, kv, window_size))
    with pytest.raises(ValueError, match="window_size"):
        build_model("bad", [("kv", FLOAT, [1, 1, 4]), ("ring", FLOAT, [1, 2, 4]),
                            ("pos", INT64, [1])], ["idx", "ring"],
                    lambda op, kv, ring, pos: window_decode(op, kv, ring, pos, window_size))


def test_decode_rows_match_upstream(upstream_module) -> None:
    """Every start_pos across two wraps of the ring, against upstream's get_window_topk_idxs."""
    upstream = upstream_module
    for win in (4, 7, 8):
        for start_pos in range(1, 2 * win + 3):
            ring = np.zeros((1, win, 2), np.float32)
            idx, _ = run_decode(np.zeros((1, 1, 2), np.float32), ring, start_pos, win)
            want = upstream.get_window_topk_idxs(win, 1, 1, start_pos).numpy()
            np.testing.assert_array_equal(idx, want, err_msg=f"win {win} start_pos {start_pos}")


@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
@pytest.mark.parametrize("window_size", [4, 8])
def test_chunked_prefill_reads_the_one_shot_positions(chunk: int, window_size: int) -> None:
    """Chunks of a prefill: every query reads the one-shot prefill's positions in its
    order (then -1), each chunk's ring is the one-shot ring of the tokens so far, and a
    first chunk (start_pos 0) is window_prefill exactly."""
    rng = np.random.default_rng(chunk * 10 + window_size)
    b, total, d = 2, 21, 3
    kv = rng.standard_normal((b, total, d)).astype(np.float32)
    one_idx, _ = run_prefill(kv, window_size)
    ring = rng.standard_normal((b, window_size, d)).astype(np.float32)  # garbage at P=0
    for start in range(0, total, chunk):
        part = kv[:, start:start + chunk]
        feeds = {"kv": part, "ring": ring, "start_pos": np.array([start], np.int64)}
        idx, rows, ring = _chunk(window_size, d).run(None, feeds)
        assert idx.shape[2] == min(start + part.shape[1], window_size)
        if start == 0:
            want_idx, want_ring = run_prefill(part, window_size)
            np.testing.assert_array_equal(idx, want_idx)
            np.testing.assert_array_equal(rows, part)
            np.testing.assert_array_equal(ring, want_ring)
        for t in range(part.shape[1]):
            got = [rows[:, i] for i in idx[0, t] if i >= 0]
            want = [kv[:, i] for i in one_idx[0, start + t] if i >= 0]
            assert len(got) == len(want) == min(window_size, start + t + 1)
            np.testing.assert_array_equal(np.stack(got), np.stack(want))
            assert (idx[:, t] == idx[:1, t]).all()  # the same for every batch entry
        np.testing.assert_array_equal(ring, seeded_ring(kv[:, :start + part.shape[1]],
                                                        window_size))
