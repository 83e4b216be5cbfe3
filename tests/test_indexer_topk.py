"""IndexerTopK against the three ops it fuses, IndexerScore -> TorchTopK(min(k, T), largest,
unsorted) -> indices, and BlockMax(block_size) -> block scores, bit for bit: on every
instruction-set path and thread count, float and packed keys, with Lengths and Candidates;
both ways the op ranks (scores streamed tile by tile into each row's heap, and every row's
scores made first), where torch ranks by its heap (k * 64 <= T) and by nth_element (k * 64 >
T); fp4 inputs whose bf16 scores tie a lot, and masks that tie at -inf. Also: the default's
choice at a size past the materialised budget, the portable spelling, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper
from test_indexer_score import FORMAT, PATHS, case, op_session

from csa2onnx.custom_ops import make_session, session_options

_vi = helper.make_tensor_value_info
STREAM = "CSA_INDEXER_TOPK_STREAM"  # the kernel's test setting: "always" / "never"


def inputs(packed: bool, masks: str) -> tuple[list, list[str]]:
    vis = [_vi("Q", TensorProto.FLOAT, None), _vi("W", TensorProto.FLOAT, None),
           _vi("K", TensorProto.UINT8 if packed else TensorProto.FLOAT, None),
           _vi("T", TensorProto.INT64, None)]
    names = ["Q", "W", "K", "T"]
    if masks:
        names.append("L")
        vis.append(_vi("L", TensorProto.INT64, None))
    if "C" in masks:
        names.append("C")
        vis.append(_vi("C", TensorProto.BOOL, None))
    return vis, names


def fused_model(packed: bool, k: int, block: int, masks: str = "", *, portable: bool = False,
                outputs: int | None = None, force: bool = False,
                candidate_block: int = 1) -> bytes:
    vis, names = inputs(packed, masks)
    attrs = {"k": k, **({"block_size": block} if block else {}),
             **({"keys_format": FORMAT} if packed else {}),
             **({"force_newest_block": 1} if force else {}),
             **({"candidate_block_size": candidate_block} if candidate_block != 1 else {})}
    outs = ["I", "B"][:outputs or (2 if block else 1)]
    node = helper.make_node("IndexerTopK", names, outs, domain="csa2onnx", **attrs)
    graph = helper.make_graph([node], "indexer_topk", vis,
                              [_vi(n, TensorProto.INT64 if n == "I" else TensorProto.FLOAT, None)
                               for n in outs])
    return custom_op_model(graph, portable=portable)


def composed_model(packed: bool, k: int, block: int, masks: str = "") -> bytes:
    vis, names = inputs(packed, masks)
    attrs = {"keys_format": FORMAT} if packed else {}
    nodes = [helper.make_node("IndexerScore", names, ["S"], domain="csa2onnx", **attrs),
             helper.make_node("Min", ["T", "k"], ["kk"]),
             helper.make_node("TorchTopK", ["S", "kk"], ["V", "I"], domain="csa2onnx",
                              largest=1, sorted=0)]
    outs = [_vi("I", TensorProto.INT64, None)]
    if block:
        nodes.append(helper.make_node("BlockMax", ["S"], ["B"], domain="csa2onnx",
                                      block_size=block))
        outs.append(_vi("B", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "composed", vis, outs,
                              [helper.make_tensor("k", TensorProto.INT64, [1], [k])])
    return custom_op_model(graph)


_sessions: dict = {}


def session(monkeypatch, model: bytes, key: tuple, isa: str | None, threads: int,
            stream: str | None = None):
    if key not in _sessions:
        monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
        with monkeypatch.context() as mp:
            if isa is not None:
                mp.setenv("CSA_INDEXER_SCORE_ISA", isa)  # both read when a kernel is created
            if stream is not None:
                mp.setenv(STREAM, stream)
            _sessions[key] = make_session(model, options=session_options(threads))
    return _sessions[key]


def forced(block_scores: np.ndarray, reach: np.ndarray, block: int) -> np.ndarray:
    """select_candidate_blocks' +inf at the block of each row's last reachable key."""
    out = block_scores.copy()
    newest = np.where(reach > 0, (reach - 1) // block, -1)  # [s]
    hit = np.arange(out.shape[-1]) == newest[:, None]
    out[:, hit] = np.inf
    return out


def check(monkeypatch, q, w, keys, packed, t: int, k: int, block: int, *,
          lengths=None, candidates=None, paths=PATHS, threads=(1, 2),
          streams=("always", "never"), force: bool = False, candidate_block: int = 1) -> None:
    """candidate_block: the fused op reads the candidates (whole blocks) a value a block."""
    masks = ("L" if lengths is not None else "") + ("C" if candidates is not None else "")
    feeds = {"Q": q, "W": w, "T": np.array([t], np.int64)}
    fused_feeds = {}
    if lengths is not None:
        feeds["L"] = lengths
    if candidates is not None:
        feeds["C"] = candidates
        fused_feeds["C"] = candidates[..., ::candidate_block]
        assert (np.repeat(fused_feeds["C"], candidate_block, -1)[..., :t] == candidates).all()
    for is_packed, kv in ((False, keys), (True, packed)):
        if is_packed and np.isnan(keys).any():
            continue  # the packed cache holds no NaN
        want_model = composed_model(is_packed, k, block, masks)
        want = session(monkeypatch, want_model, ("composed", is_packed, k, block, masks),
                       "reference", 1).run(None, feeds | {"K": kv})
        if force:
            reach = lengths if lengths is not None else np.full(q.shape[1], t, np.int64)
            want[1] = forced(want[1], reach, block)
        for isa in paths:
            for n in threads:
                for stream in streams:
                    got = session(monkeypatch, fused_model(is_packed, k, block, masks,
                                                           force=force,
                                                           candidate_block=candidate_block),
                                  ("fused", is_packed, k, block, masks, isa, n, stream, force,
                                   candidate_block),
                                  isa, n, stream).run(None, feeds | fused_feeds | {"K": kv})
                    where = f"{isa} threads={n} {stream} packed={is_packed} q{q.shape} T={t} k={k}"
                    assert got[0].shape == want[0].shape, where
                    assert (got[0] == want[0]).all(), (
                        f"{where}: {int((got[0] != want[0]).sum())} indices differ")
                    if block:
                        assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all(), where


def tie_case(seed: int, b: int, s: int, h: int, r: int):
    """fp4 queries and keys of few distinct magnitudes: their bf16 scores tie a lot."""
    q, w, keys, packed = case(seed, b, s, h, 64, r, adversarial=False)
    return q, np.round(w * 4) / 4, keys, packed


# (b, s, H, R, T, k, block): k * 64 <= T (the heap) and > T (nth_element); T past and short
# of the 64-key tiles, blocks across tile edges (block 24, 7); s across the streamed tasks'
# rows (16..64) and over 64 query rows; b = 2; k = 1 and k = T.
SHAPES = [(1, 5, 8, 300, 300, 4, 8), (1, 3, 4, 700, 643, 10, 24), (2, 3, 5, 200, 190, 2, 7),
          (1, 70, 4, 300, 257, 4, 8), (1, 17, 3, 130, 129, 1, 0), (2, 1, 8, 600, 513, 8, 8),
          (1, 4, 8, 100, 90, 90, 8), (1, 4, 8, 100, 90, 30, 0), (1, 2, 6, 70, 65, 200, 3),
          (1, 2, 4, 10, 0, 4, 8), (1, 130, 2, 140, 130, 2, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_is_the_three_ops(monkeypatch, shape):
    b, s, h, r, t, k, block = shape
    q, w, keys, packed = tie_case(sum(shape), b, s, h, r)
    check(monkeypatch, q, w, keys, packed, t, k, block)


@pytest.mark.parametrize(("masks", "candidate_block"), [("L", 1), ("LC", 1), ("LC", 8), ("LC", 5)])
def test_masks_tie_at_minus_inf(monkeypatch, masks, candidate_block):
    """A prefill's Lengths (rows with fewer reachable keys than k take -inf ones, in torch's
    order) and a level-two index source's Candidates (blocks of 8 or 5), a value a key or a
    value a block (candidate_block_size)."""
    b, s, h, r, t, k = 1, 40, 4, 400, 390, 6
    q, w, keys, packed = tie_case(7, b, s, h, r)
    rng = np.random.default_rng(8)
    lengths = np.minimum(np.arange(s, dtype=np.int64) * 10, t)
    candidates = None
    if "C" in masks:
        size = 8 if candidate_block == 1 else candidate_block
        blocks = rng.random((b, s, -(-t // size))) < 0.2
        candidates = np.repeat(blocks, size, axis=2)[:, :, :t]
    check(monkeypatch, q, w, keys, packed, t, k, 8, lengths=lengths, candidates=candidates,
          threads=(2,), candidate_block=candidate_block)


@pytest.mark.parametrize("masks", ["", "L", "LC"])
def test_newest_block_forced(monkeypatch, masks):
    """force_newest_block: +inf at the block of each row's last reachable key (Lengths - 1,
    or Width - 1), none where Lengths <= 0 or past the blocks (as the graph's Where)."""
    b, s, h, r, t, k = 1, 12, 4, 300, 290, 3
    q, w, keys, packed = tie_case(9, b, s, h, r)
    lengths = candidates = None
    if masks:
        lengths = np.array([0, -3, 1, 8, 9, 100, 289, 290, 291, 400, 17, 5], np.int64)
    if "C" in masks:
        rng = np.random.default_rng(10)
        candidates = np.repeat(rng.random((b, s, (t + 7) // 8)) < 0.3, 8, axis=2)[:, :, :t]
    for block in (8, 7):
        check(monkeypatch, q, w, keys, packed, t, k, block, lengths=lengths,
              candidates=candidates, threads=(2,), force=True,
              candidate_block=8 if candidates is not None and block == 8 else 1)


def test_adversarial_values_and_nan_keys(monkeypatch):
    """Scores over 2^80 of range, -0 and NaN (float keys holding NaN: NaN scores, which torch
    ranks above everything and BlockMax carries to the block)."""
    b, s, h, r, t, k = 1, 20, 4, 300, 290, 3
    q, w, keys, packed = case(21, b, s, h, 64, r, adversarial=True)
    keys[0, [5, 77, 200, 201]] = np.nan
    for block in (8, 24):
        check(monkeypatch, q, w, keys, packed, t, k, block, threads=(2,))


def test_default_streams_a_long_chunk(monkeypatch):
    """Unset, a call past the materialised budget (2^24 scores) streams: 65 rows of 262144
    keys, the same indices as the three ops (on the default path)."""
    b, s, h, t, k = 1, 65, 2, 262144, 512
    q, w, _, packed = case(11, b, s, h, 32, t, adversarial=False)
    feeds = {"Q": q, "W": w, "K": packed, "T": np.array([t], np.int64)}
    want = session(monkeypatch, composed_model(True, k, 8), ("composed-long",), None, 2).run(
        None, feeds)
    got = session(monkeypatch, fused_model(True, k, 8), ("fused-long",), None, 2).run(None, feeds)
    assert (got[0] == want[0]).all()
    assert (got[1].view(np.uint32) == want[1].view(np.uint32)).all()


def test_portable_spelling_is_the_three_ops() -> None:
    """A portable graph writes IndexerTopK as IndexerScore, TorchTopK and BlockMax
    (custom_ops/ops.py indexer_topk)."""
    import onnx_ir as ir

    from csa2onnx.custom_ops import ops
    from csa2onnx.graphs.standalone import build_model

    def fn(op, q, w, keys, width):
        return ops.indexer_topk(op, q, w, keys, width, 4, block_size=8)

    f, i64 = ir.DataType.FLOAT, ir.DataType.INT64
    specs = [("q", f, [1, 2, 4, 64]), ("w", f, [1, 2, 4]), ("k", f, [1, 30, 64]),
             ("t", i64, [1])]
    for portable, want in ((False, ["IndexerTopK"]),
                           (True, ["IndexerScore", "TorchTopK", "BlockMax"])):
        model = build_model("m", specs, ["i", "b"], fn, portable=portable)
        assert [n.op_type for n in model.graph.node if n.domain == "csa2onnx"] == want


def run(model: bytes, feeds: dict) -> None:
    make_session(model, options=session_options(1)).run(None, feeds)


def test_errors_name_the_problem(monkeypatch):
    q, w, keys, _ = case(1, 1, 2, 4, 64, 8, adversarial=False)
    feeds = {"Q": q, "W": w, "K": keys, "T": np.array([8], np.int64)}
    with pytest.raises(Exception, match=r"IndexerTopK: Width 9 must be in \[0, R = 8\]"):
        run(fused_model(False, 2, 0), dict(feeds, T=np.array([9], np.int64)))
    with pytest.raises(Exception, match=r"IndexerTopK: W must be \[b, s, H\]"):
        run(fused_model(False, 2, 0), dict(feeds, W=w[:, :, :3]))
    with pytest.raises(Exception, match="k must be >= 1, got 0"):
        run(fused_model(False, 0, 0), feeds)
    with pytest.raises(Exception, match=r"block_size must be >= 1 \(or 0: no \w+\), got -2"):
        run(fused_model(False, 2, -2, outputs=1), feeds)
    with pytest.raises(Exception, match="block_size 8 asks for the output BlockScores"):
        run(fused_model(False, 2, 8, outputs=1), feeds)
    with pytest.raises(Exception, match="the output BlockScores needs block_size >= 1"):
        run(fused_model(False, 2, 0, outputs=2), feeds)
    with pytest.raises(Exception, match="force_newest_block needs block_size >= 1"):
        run(fused_model(False, 2, 0, force=True), feeds)
    monkeypatch.setenv(STREAM, "sometimes")
    with pytest.raises(Exception, match=f'{STREAM} must be "always" or "never", got "sometimes"'):
        run(fused_model(False, 2, 0), feeds)


def test_the_scores_op_still_agrees(monkeypatch):
    """The shared scoring (TaskTile's output and stride) left IndexerScore as it was."""
    q, w, keys, packed = tie_case(5, 1, 3, 4, 200)
    want = op_session(monkeypatch, False, "reference", 1).run(
        None, {"Q": q, "W": w, "K": keys, "T": np.array([190], np.int64)})[0]
    for isa in PATHS:
        got = op_session(monkeypatch, True, isa, 2).run(
            None, {"Q": q, "W": w, "K": packed, "T": np.array([190], np.int64)})[0]
        assert (got.view(np.uint32) == want.view(np.uint32)).all(), isa
