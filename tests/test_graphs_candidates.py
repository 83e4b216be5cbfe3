"""select_candidate_blocks against the goldens: the candidate source's own index_score in,
block scores, block top-k (values and indices exact, in torch's order) and mask out."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import onnx
import pytest
from helpers import CASES, GOLDENS, golden, run_model

from csa2onnx.custom_ops.ops import candidates_per_key
from csa2onnx.graphs.candidates import select_candidate_blocks
from csa2onnx.graphs.numerics import FLOAT, INT64
from csa2onnx.graphs.standalone import build_model

COMPONENT = "candidates"
OUTPUTS = ["candidates", "kept", "block_scores", "topk_values", "topk_indices"]
ARRAYS = {"candidates": "candidates", "block_scores": "cand_block_scores",
          "topk_values": "cand_block_topk_values", "topk_indices": "cand_block_topk_indices"}


def _sources() -> list[tuple[str, int]]:
    found = []
    for case in CASES:
        args = json.loads((GOLDENS / f"{case}.json").read_text())["model_args"]
        if args["candidate_source_layer"] >= 0:
            found.append((case, args["candidate_source_layer"]))
    return found


@cache
def _model(topk_blocks: int, block_size: int) -> onnx.ModelProto:
    """The kept blocks (what later indexers read) and the reference's mask of positions
    made from them (what the goldens hold), beside the intermediates."""
    def select(op, x, lens):
        blocks = select_candidate_blocks(op, x, lens, topk_blocks, block_size)
        width = op.Slice(op.Shape(x), [2], [3])
        return [candidates_per_key(op, blocks.kept, width, block_size), *blocks]
    return build_model(
        "select_candidate_blocks",
        [("logits", FLOAT, ["b", "s", "T"]), ("compress_lens", INT64, ["s"])], OUTPUTS, select)


def _compress_lens(start_pos: int, seqlen: int, ratio: int) -> np.ndarray:
    if start_pos == 0:
        return (np.arange(seqlen, dtype=np.int64) + 1) // ratio
    return np.array([(start_pos + seqlen) // ratio], np.int64)


@pytest.mark.parametrize(("case", "layer"), _sources(),
                         ids=[f"{c}-L{layer}" for c, layer in _sources()])
def test_select_candidate_blocks(case: str, layer: int, golden_report) -> None:
    g = golden(case)
    args = g.model_args
    model = _model(args["candidate_topk_blocks"], args["candidate_block_size"])
    for entry in g.meta["schedule"]:
        step = entry["step"]
        lens = _compress_lens(entry["start_pos"], entry["seqlen"], args["compress_ratios"][layer])
        out = run_model(model, {"logits": g.step(step, layer, "index_score"),
                                "compress_lens": lens})
        for key, name in ARRAYS.items():
            golden_report.check(case, COMPONENT, f"{step}.L{layer}.{name}", out[key],
                                g.step(step, layer, name), exact=True)


def test_select_candidate_blocks_edges() -> None:
    """T = 0 (nothing compressed yet), fewer blocks than topk_blocks, a ragged last block,
    and rows with nothing reachable (all -inf, compress_lens 0) keep nothing."""
    model = _model(3, 4)
    empty = run_model(model, {"logits": np.zeros((2, 3, 0), np.float32),
                              "compress_lens": np.zeros(3, np.int64)})
    assert empty["candidates"].shape == (2, 3, 0)
    assert empty["kept"].shape == (2, 3, 0)
    assert empty["topk_indices"].shape == (2, 3, 0)

    logits = np.full((1, 2, 6), -np.inf, np.float32)
    logits[0, 1, :5] = [0.5, 0.25, 1.0, -1.0, 2.0]
    out = run_model(model, {"logits": logits, "compress_lens": np.array([0, 5], np.int64)})
    assert out["block_scores"].shape == (1, 2, 2)
    assert not out["candidates"][0, 0].any()
    # Block 1 holds the newest reachable position 4 and is forced in; block 0 by its max.
    assert out["candidates"][0, 1].tolist() == [True] * 6
    assert out["kept"].tolist() == [[[False, False], [True, True]]]  # a value a block
    assert np.isposinf(out["block_scores"][0, 1, 1])


def test_select_candidate_blocks_rejects_bad_sizes() -> None:
    for topk_blocks, block_size in ((0, 4), (2, 0), (-1, 4)):
        with pytest.raises(ValueError, match="candidate"):
            build_model("bad", [("x", FLOAT, [1, 1, 4]), ("l", INT64, [1])], ["c"],
                        lambda op, x, lens, t=topk_blocks, bs=block_size:
                        select_candidate_blocks(op, x, lens, t, bs).kept)
