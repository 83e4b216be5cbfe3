"""New cases made by the UPSTREAM reference (../shared/reference) on this machine, verified
end to end: prefills shorter than the window (1, win-1, win) followed by decode steps
across two wraps of the ring, where the decode window row lists the filling ring oldest
first with -1 for the empty slots (reference.md, Attention.forward step 2); and a case whose
top-k torch ranks by its heap (k * 64 <= T), the branch IndexerTopK streams, no golden's."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from csa2onnx.export.cross_cpu import rule_for
from csa2onnx.export.goldens import load_case
from csa2onnx.export.verify import verify_case

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 8
PREFILLS = (1, WINDOW - 1, WINDOW)


def window_fill_spec(small: dict, prefill: int) -> dict:
    """Ratios (0,4,4,1,1,0) with window 8: decode steps up to position 2*win+3 cross two
    wraps; ratio-4 groups complete in decode."""
    return dict(
        name=f"window_fill_p{prefill}",
        description=f"window {WINDOW}, prefill {prefill} then decode across two ring wraps",
        args=dict(small, window_size=WINDOW, max_seq_len=64, index_topk=4,
                  compress_ratios=(0, 4, 4, 1, 1, 0), kv_source_layers=(1, 3),
                  index_source_layers=(1, 3)),
        batch=2, prefill=prefill, decode_steps=2 * WINDOW + 4 - prefill, seed=900 + prefill)


@pytest.fixture(scope="module")
def upstream_cases(tmp_path_factory: pytest.TempPathFactory,
                   upstream_tools: ModuleType) -> dict[int, Path]:
    make_goldens = upstream_tools.make_goldens_module()
    folder = tmp_path_factory.mktemp("upstream")
    for prefill in PREFILLS:
        make_goldens.run_case(window_fill_spec(make_goldens.SMALL, prefill), folder)
    return {p: folder / f"window_fill_p{p}.json" for p in PREFILLS}


@pytest.mark.parametrize("prefill", PREFILLS)
def test_decode_window_rows_are_upstreams(upstream_cases: dict[int, Path], prefill: int) -> None:
    case = load_case(upstream_cases[prefill])
    for entry in case.meta["schedule"][1:]:
        pos = entry["start_pos"]
        row = case.step(entry["step"], 0, "attn_topk_idxs")[0, 0]  # layer 0: window only
        oldest_first = [(pos + 1 + j) % WINDOW for j in range(WINDOW)]
        assert row.tolist() == [-1 if i > pos else i for i in oldest_first], entry


def live_rule(path: Path) -> str:
    """The rule for a case made here by live torch: the machine entry (cpuinfo) names the
    class, but a forced instruction set (ONEDNN_MAX_CPU_ISA) changes torch's sums without
    changing cpuinfo, so the torch probe has the last word."""
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_reference

    rule = rule_for(load_case(path).meta)
    return rule if torch_reference.torch_sums_like_goldens() else "cross_cpu"


@pytest.mark.parametrize("prefill", PREFILLS)
def test_exporter_verifies_upstream_case(upstream_cases: dict[int, Path], prefill: int) -> None:
    report = verify_case(upstream_cases[prefill], rule=live_rule(upstream_cases[prefill]))
    print(report.table())
    assert report.ok, report.table()
    assert any(r.array == "attn_topk_idxs" and r.step.startswith("decode") for r in report.rows)


@pytest.mark.parametrize("prefill", PREFILLS)
def test_oracle_reproduces_upstream_case(upstream_cases: dict[int, Path], prefill: int) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_reference

    path = upstream_cases[prefill]
    ok, _ = torch_reference.check_case(path.parent, path.stem, rule=live_rule(path))
    assert ok


def heap_spec(small: dict) -> dict:
    """index_topk 4 over up to 300 compressed positions (ratio 1): from 256 positions torch
    ranks a row by its heap (k * 64 <= T), the branch IndexerTopK streams. Layer 1 is also
    the candidate source (1 block of 2), so layer 3 has 2 finite scores a row and picks 2 of
    its -inf reachable positions (reference quirk 2): which ones, the heap's ties decide."""
    return dict(
        name="heap_topk", description="index_topk 4 over up to 300 positions: torch's heap",
        args=dict(small, index_topk=4, compress_ratios=(0, 1, 1, 1, 1, 0),
                  kv_source_layers=(1,), index_source_layers=(1, 3), candidate_source_layer=1,
                  candidate_topk_blocks=1, candidate_block_size=2),
        batch=1, prefill=300, decode_steps=2, seed=4242)


@pytest.fixture(scope="module")
def heap_case(tmp_path_factory: pytest.TempPathFactory, upstream_tools: ModuleType) -> Path:
    make_goldens = upstream_tools.make_goldens_module()
    folder = tmp_path_factory.mktemp("upstream_heap")
    make_goldens.run_case(heap_spec(make_goldens.SMALL), folder)
    return folder / "heap_topk.json"


@pytest.mark.parametrize("stream", ["always", "never"])
def test_heap_branch_selections_are_upstreams(heap_case: Path, stream: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Streamed into the heap tile by tile, or every score first: each selection and mask
    equals upstream's exactly (not only a valid top-k)."""
    monkeypatch.setenv("CSA_INDEXER_TOPK_STREAM", stream)  # read when a session is created
    report = verify_case(heap_case, rule=live_rule(heap_case))
    assert report.ok, report.table()
    picks = [r for r in report.rows
             if r.array in ("index_topk_idxs", "attn_topk_idxs", "candidates")]
    assert {r.array for r in picks} == {"index_topk_idxs", "attn_topk_idxs", "candidates"}
    assert all(r.result.exact for r in picks), report.table()
