"""CandidateMask against its NumPy definition (custom_ops/reference.py) and its portable body
(the standard ops graphs/candidates.py used before it), on 1 and 2 threads: widths past and
short of whole blocks, a block wider than the width, no picks, nothing kept, rank 1 to 4;
and the errors (out-of-range and repeated blocks, shapes, block_size)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.reference import candidate_mask

_vi = helper.make_tensor_value_info


def model(block: int, *, portable: bool = False) -> bytes:
    node = helper.make_node("CandidateMask", ["B", "K", "T"], ["M"], domain="csa2onnx",
                            block_size=block)
    graph = helper.make_graph([node], "mask", [_vi("B", TensorProto.INT64, None),
                                               _vi("K", TensorProto.BOOL, None),
                                               _vi("T", TensorProto.INT64, None)],
                              [_vi("M", TensorProto.BOOL, None)])
    return custom_op_model(graph, portable=portable)


def picks(rng: np.random.Generator, rows: tuple[int, ...], n: int, k: int,
          kept: float) -> tuple[np.ndarray, np.ndarray]:
    """k distinct blocks of n per row (as top-k picks them), each kept with chance `kept`."""
    blocks = np.argsort(rng.random((*rows, n)), axis=-1)[..., :k].astype(np.int64)
    return blocks, rng.random(blocks.shape) < kept


# (rows, width, block, k, kept)
CASES = [((1, 5), 300, 8, 10, 0.7), ((2, 3), 301, 8, 38, 0.5), ((4,), 17, 24, 1, 1.0),
         ((1, 2, 3), 64, 1, 64, 0.3), ((3,), 50, 7, 0, 0.5), ((2, 2), 40, 8, 5, 0.0),
         ((), 33, 4, 9, 0.6), ((1, 300), 4096, 8, 64, 0.9), ((1, 1), 0, 8, 0, 1.0)]


@pytest.mark.parametrize("rows,width,block,k,kept", CASES, ids=str)
def test_mask_is_the_definition_and_the_body(rows, width, block, k, kept):
    rng = np.random.default_rng(width + k)
    blocks, keep = picks(rng, rows, -(-width // block), k, kept)
    feeds = {"B": blocks, "K": keep, "T": np.array([width], np.int64)}
    want = candidate_mask(blocks, keep, width, block)
    assert want.shape == (*rows, width)
    for threads in (1, 2):
        got = make_session(model(block), options=session_options(threads)).run(None, feeds)[0]
        assert got.dtype == bool and got.shape == want.shape
        assert (got == want).all(), threads
    body = ort.InferenceSession(model(block, portable=True), providers=["CPUExecutionProvider"])
    assert (body.run(None, feeds)[0] == want).all()


def test_errors_name_the_problem():
    blocks = np.array([[0, 3, 1]], np.int64)
    keep = np.ones((1, 3), bool)
    feeds = {"B": blocks, "K": keep, "T": np.array([30], np.int64)}

    def run(block: int, **bad) -> None:
        make_session(model(block), options=session_options(1)).run(None, feeds | bad)

    run(8)  # the valid call
    for bad, message in (
            ({"B": np.array([[0, 4, 1]], np.int64)},
             r"Blocks\[0, 1\] = 4 is not a block of Width 30 \(blocks of 8: \[0, 4\)\)"),
            ({"B": np.array([[0, -1, 1]], np.int64)}, r"Blocks\[0, 1\] = -1"),
            ({"B": np.array([[0, 3, 0]], np.int64)}, "block 0 appears twice in row 0"),
            ({"K": np.ones((1, 2), bool)}, r"Keep must have Blocks' shape \[1, 3\]"),
            ({"T": np.array([30, 1], np.int64)}, "Width must hold one element"),
            ({"T": np.array([-1], np.int64)}, "Width must be >= 0"),
            ({"B": np.array(2, np.int64), "K": np.array(True)}, "Blocks must have rank >= 1")):
        with pytest.raises(Exception, match=message):
            run(8, **bad)
    with pytest.raises(Exception, match="block_size must be >= 1, got 0"):
        run(0)
