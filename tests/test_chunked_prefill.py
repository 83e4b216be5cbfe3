"""Chunked prefill: a prefill that continues a sequence (start_pos > 0, many tokens),
judged against the one-shot golden prefill (`verify --prefill-chunk`), and its runtime
contract."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import CASES, GOLDENS, golden

from csa2onnx.export.chunked_prefill import as_positions, valid_topk
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime, RuntimeStateError
from csa2onnx.export.stack import export_stack
from csa2onnx.export.verify import verify_case
from csa2onnx.export.weights import from_golden

CHUNKED = [(case, n) for case in CASES if "lowidx" not in case for n in (1, 7, 64)]


@pytest.mark.parametrize(("case", "chunk"), CHUNKED, ids=[f"{c}-{n}" for c, n in CHUNKED])
def test_verify_prefill_in_chunks(case: str, chunk: int) -> None:
    report = verify_case(GOLDENS / f"{case}.json", prefill_chunk=chunk)
    assert report.ok, report.table()
    assert report.rule == "cross_cpu"


def test_lowidx_case_in_chunks_portable() -> None:
    """The lowest-index tie case runs portable (ONNX TopK ties), chunked too."""
    report = verify_case(GOLDENS / "case2_candidates_lowidx.json", portable=True,
                         prefill_chunk=7)
    assert report.ok, report.table()


def test_a_bad_chunked_prefill_fails_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: chunks whose selections are shifted by one position fail."""
    import csa2onnx.export.chunked_prefill as chunked

    real = chunked.as_positions
    monkeypatch.setattr(chunked, "as_positions",
                        lambda idx, offset: real(idx, offset - 1))
    report = verify_case(GOLDENS / "case1_r2_r1.json", prefill_chunk=7)
    assert not report.ok
    assert any(not r.result.ok for r in report.rows if r.array == "index_topk_idxs")


def test_as_positions_and_valid_topk() -> None:
    idx = np.array([[[-1, 12, 10]]], np.int32)
    np.testing.assert_array_equal(as_positions(idx, 10), [[[0, 2, -1]]])
    score = np.array([3.0, 1.0, 1.0, -np.inf])
    assert valid_topk(np.array([0, 1]), score, 2)
    assert valid_topk(np.array([0, 2]), score, 2)  # the tie goes either way
    assert not valid_topk(np.array([1, 2]), score, 2)  # misses the largest
    assert not valid_topk(np.array([0, 1, 2]), score, 2)  # too many
    assert valid_topk(np.array([0, 1, 2, -1]), score, 4)  # the -inf one left out (-1)
    assert not valid_topk(np.array([0, 0]), score, 2)


def test_runtime_chunk_contract(tmp_path: Path) -> None:
    g = golden("case1_r2_r1")
    config = AttentionConfig.from_model_args(g.model_args)
    export_stack(plan_stack(config), from_golden(g.arrays, range(config.n_layers)), tmp_path)
    runtime = AttentionRuntime(tmp_path)
    xs = {layer: g.step("prefill", layer, "x") for layer in runtime.layers}
    first = {layer: x[:, :10] for layer, x in xs.items()}
    with pytest.raises(RuntimeStateError, match="run one at start_pos 0 first"):
        runtime.prefill(first, start_pos=10)
    runtime.prefill(first)
    rest = {layer: x[:, 10:] for layer, x in xs.items()}
    with pytest.raises(RuntimeStateError, match="not the sequence's next position 10"):
        runtime.prefill(rest, start_pos=9)
    with pytest.raises(RuntimeStateError, match="batch 2 differs"):
        runtime.prefill({k: np.concatenate([v, v]) for k, v in rest.items()}, start_pos=10)
    with pytest.raises(RuntimeStateError, match="past max_seq_len"):
        runtime.prefill({k: np.zeros((1, config.max_seq_len, config.dim), np.float32)
                         for k in xs}, start_pos=10)
    runtime.prefill(rest, start_pos=10)
    assert runtime.position == xs[runtime.layers[0]].shape[1]
    runtime.decode({layer: g.step("decode0", layer, "x") for layer in runtime.layers})
