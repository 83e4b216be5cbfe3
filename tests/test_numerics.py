"""`--numerics exact|fast`: chosen at export, recorded in the manifest and the graphs, judged by
verify's cross-CPU rule, benchmarked beside exact. (The fast kernels themselves: the ops'
own test files.)"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from helpers import GOLDENS

from csa2onnx.custom_ops.ops import NUMERICS_KEY, check_numerics
from csa2onnx.export.artifacts import read_manifest
from csa2onnx.export.cli import main
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.goldens import load_case
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import describe
from csa2onnx.export.stack import export_stack
from csa2onnx.export.verify import verify_case
from csa2onnx.export.weights import from_golden

# The ops that have a fast kernel: a fast graph marks each of their nodes, and only those.
FAST_OPS = {"Fp8Linear", "SparseAttention", "TorchLinear"}


def test_numerics_are_checked() -> None:
    assert check_numerics("exact") == "exact" and check_numerics("fast") == "fast"
    with pytest.raises(ValueError, match=r"numerics must be one of .*'exact', 'fast'.*'quick'"):
        check_numerics("quick")
    with pytest.raises(ValueError, match="portable graph runs standard ONNX ops only"):
        check_numerics("fast", portable=True)


def _export(case: str, folder: Path, **options) -> Path:
    golden = load_case(GOLDENS / f"{case}.json")
    config = AttentionConfig.from_model_args(golden.model_args)
    plan = plan_stack(config)
    return export_stack(plan, from_golden(golden.arrays, range(config.n_layers)), folder,
                        **options)


def _numerics_attributes(path: Path) -> dict[str, set[str]]:
    """op type -> the numerics attribute values its nodes carry ("" where none)."""
    model = onnx.load(str(path), load_external_data=False)
    found: dict[str, set[str]] = {}
    for node in model.graph.node:
        value = next((a.s.decode() for a in node.attribute if a.name == "numerics"), "")
        found.setdefault(node.op_type, set()).add(value)
    return found


@pytest.mark.parametrize("case", ["case3_r4_r128", "case5_fp8"])
def test_fast_is_recorded_and_marks_only_the_fast_ops(case: str, tmp_path: Path) -> None:
    exact = _export(case, tmp_path / "exact")
    fast = _export(case, tmp_path / "fast", numerics="fast")
    assert read_manifest(exact).numerics == "exact" and read_manifest(fast).numerics == "fast"
    assert "numerics: fast" in describe(fast)
    for mode in ("prefill", "decode"):
        meta = {p.key: p.value
                for p in onnx.load(str(fast / f"{mode}.onnx"),
                                   load_external_data=False).metadata_props}
        assert meta["numerics"] == "fast"
        graph = onnx.load(str(fast / f"{mode}.onnx"), load_external_data=False).graph
        assert {p.key: p.value for p in graph.metadata_props}.get(NUMERICS_KEY) == "fast"
        assert all(v == {""} for v in _numerics_attributes(exact / f"{mode}.onnx").values())
        attrs = _numerics_attributes(fast / f"{mode}.onnx")
        for op_type, values in attrs.items():
            assert values == ({"fast"} if op_type in FAST_OPS else {""}), op_type
        assert FAST_OPS & attrs.keys()


def test_export_rejects_fast_portable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="numerics must be 'exact'"):
        _export("case1_r2_r1", tmp_path, numerics="fast", portable=True)


def test_cli_numerics_errors(capsys) -> None:
    with pytest.raises(SystemExit):  # argparse's own error
        main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--numerics", "fast,slow"])
    assert "numerics: exact, fast or both" in capsys.readouterr().err
    assert main(["verify", str(GOLDENS / "case1_r2_r1.json"), "--numerics", "fast",
                 "--portable"]) == 2
    assert "numerics must be 'exact'" in capsys.readouterr().err


def test_bench_matrix_runs_fast_beside_exact(capsys) -> None:
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--threads", "1", "--numerics", "fast,exact", "--decode", "2"]) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line[:7].strip() == "1"]
    assert [r[3] for r in rows] == ["exact", "fast"]  # exact first, whatever the order asked
    assert "x exact" in table and "upstream runs once per scenario" in table


@pytest.mark.parametrize("case", ["case1_r2_r1", "case2_candidates", "case3_r4_r128",
                                  "case5_fp8"])
def test_fast_passes_verify_by_the_cross_cpu_rule(case: str) -> None:
    """Fast kernels sum in their own order: every golden still passes the cross-CPU rule
    (selections exact but for tie-decided rows, which must be a valid top-k)."""
    report = verify_case(GOLDENS / f"{case}.json", numerics="fast")
    assert report.rule == "cross_cpu" and report.numerics == "fast"
    assert report.ok, report.table()
    assert "fast numerics" in report.table()
