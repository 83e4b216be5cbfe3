"""torch_topk.h's libstdc++ replicas against libstdc++ itself (tests/cpp/topk_vs_stl.cc)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import build_cpp_driver

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "cpp" / "topk_vs_stl.cc"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cpp_driver(DRIVER, tmp_path_factory.mktemp("topk_vs_stl"))


@pytest.mark.parametrize("seed", [1234, 99])
def test_replicas_match_libstdcxx(driver: Path, seed: int) -> None:
    run = subprocess.run([str(driver), str(seed)], capture_output=True, text=True, timeout=300)
    counts = dict(re.findall(r"(\w+)=(\d+)", run.stdout.splitlines()[-1]))
    counts = {k: int(v) for k, v in counts.items()}
    assert counts["row_mismatches"] == 0, run.stdout
    assert counts["algo_mismatches"] == 0, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
    assert counts["rows"] > 20_000
    # Both of torch's branches must be well covered, not just present.
    assert counts["partial_sort_rows"] > 2_000
    assert counts["nth_element_rows"] > 2_000
    assert counts["algo_checks"] > 20_000
