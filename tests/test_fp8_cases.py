"""The released checkpoint's precision end to end: fp8 linears (e4m3 weights with ue8m0
[32, 32] block scales, act_quant on their inputs) through export, onnxruntime and verify,
against case5_fp8 (made by upstream on an AMX CPU), against new fp8 cases made here by
upstream (other layouts, candidates, batch > 1, ratios 4 and 128) and by the oracle."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from csa2onnx.export.cross_cpu import rule_for
from csa2onnx.export.goldens import load_case
from csa2onnx.export.verify import EXACT, verify_case

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "goldens"


@pytest.fixture(scope="module")
def oracle() -> ModuleType:
    pytest.importorskip("torch", reason="the oracle (tools/torch_reference.py) needs torch")
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_reference

    return torch_reference


def live_rule(oracle: ModuleType, path: Path) -> str:
    """A case made here by live torch: its machine entry, unless the torch probe says torch
    was forced onto another class (ONEDNN_MAX_CPU_ISA does not change cpuinfo)."""
    rule = rule_for(load_case(path).meta)
    return rule if oracle.torch_sums_like_goldens() else "cross_cpu"


def test_case5_fp8_verifies_under_the_cross_cpu_rule() -> None:
    report = verify_case(GOLDENS / "case5_fp8.json")
    print(report.table())
    assert report.rule == "cross_cpu"  # made on an Intel Xeon with AMX
    assert report.ok, report.table()
    selections = [r for r in report.rows if r.array in EXACT]
    assert selections and all(r.result.exact for r in selections)
    assert report.moved().worst() < 0.01


def test_oracle_reproduces_case5_fp8(oracle: ModuleType) -> None:
    ok, stats = oracle.check_case(GOLDENS, "case5_fp8", rule="cross_cpu")
    assert ok and stats["index_topk_idxs"][0] > 0


UPSTREAM_FP8 = {
    # candidate source 1 (blocks of 4, 2 kept), layer 3 re-indexes inside them; batch 2
    "fp8_candidates_b2": dict(
        compress_ratios=(0, 2, 2, 2, 2, 0), kv_source_layers=(1,), index_source_layers=(1, 3),
        candidate_source_layer=1, candidate_topk_blocks=2, candidate_block_size=4),
    # ratios 128 and 4 with YaRN; both groups complete during decode
    "fp8_r4_r128": dict(
        max_seq_len=512, window_size=32, index_topk=16, compress_ratios=(0, 128, 128, 4, 4, 0),
        kv_source_layers=(1, 3), index_source_layers=(1, 3), compress_rope_theta=160000.0,
        original_seq_len=65536, rope_factor=16),
}
PREFILL = {"fp8_candidates_b2": 45, "fp8_r4_r128": 254}


@pytest.fixture(scope="module")
def upstream_fp8_cases(tmp_path_factory: pytest.TempPathFactory,
                       upstream_tools: ModuleType) -> dict[str, Path]:
    make_goldens = upstream_tools.make_goldens_module()
    folder = tmp_path_factory.mktemp("upstream_fp8")
    for seed, (name, layout) in enumerate(UPSTREAM_FP8.items()):
        spec = dict(name=name, description=f"fp8 {name}", batch=2 if "b2" in name else 1,
                    args=dict(make_goldens.SMALL, dtype="fp8", **layout),
                    prefill=PREFILL[name], decode_steps=6, seed=8100 + seed)
        make_goldens.run_case(spec, folder)
    return {name: folder / f"{name}.json" for name in UPSTREAM_FP8}


@pytest.mark.parametrize("name", UPSTREAM_FP8)
def test_exporter_verifies_upstream_fp8_case(upstream_fp8_cases: dict[str, Path],
                                             oracle: ModuleType, name: str) -> None:
    path = upstream_fp8_cases[name]
    assert load_case(path).model_args["dtype"] == "fp8"
    report = verify_case(path, rule=live_rule(oracle, path))
    print(report.table())
    assert report.ok, report.table()


@pytest.mark.parametrize("name", UPSTREAM_FP8)
def test_oracle_reproduces_upstream_fp8_case(upstream_fp8_cases: dict[str, Path],
                                             oracle: ModuleType, name: str) -> None:
    path = upstream_fp8_cases[name]
    ok, stats = oracle.check_case(path.parent, path.stem, rule=live_rule(oracle, path))
    assert ok
    if oracle.torch_sums_like_goldens():  # same class: the oracle is upstream, bit for bit
        assert all(identical == size for _, size, identical in stats.values()), stats


def test_exporter_verifies_oracle_fp8_case(oracle: ModuleType, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import make_golden

    path = make_golden.make_case(tmp_path, "oracle_fp8_mixed_b2", seed=21, batch=2,
                                 prefill_len=45, decode_steps=7, layout="mixed_b2",
                                 dtype="fp8")
    report = verify_case(path)  # the rule from the case's probed `machine`
    print(report.table())
    assert report.ok, report.table()
