"""Shared fixtures: the golden comparison report and the upstream reference (helpers.py
holds the plain helpers the test modules import)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from helpers import REPORT, ROOT, GoldenReport


@pytest.fixture(scope="session")
def golden_report() -> Iterator[GoldenReport]:
    report = GoldenReport()
    yield report
    if report.rows:
        REPORT.parent.mkdir(exist_ok=True)
        previous = json.loads(REPORT.read_text()) if REPORT.is_file() else []
        keys = {(r["case"], r["component"], r["array"]) for r in report.rows}
        kept = [r for r in previous if (r["case"], r["component"], r["array"]) not in keys]
        REPORT.write_text(json.dumps(kept + report.rows, indent=1))


@pytest.fixture(scope="session")
def upstream_tools() -> ModuleType:
    """tools/upstream.py, after checking that torch and the upstream reference are here."""
    pytest.importorskip("torch", reason="the upstream reference needs torch")
    sys.path.insert(0, str(ROOT / "tools"))
    import upstream

    if not upstream.available():
        pytest.skip(f"the upstream reference is absent ({upstream.reference_dir()}; "
                    "set CSA2ONNX_UPSTREAM)")
    return upstream


@pytest.fixture
def upstream_module(upstream_tools: ModuleType) -> ModuleType:
    """A fresh upstream model module (../shared/reference, CPU kernels)."""
    return upstream_tools.load_upstream()
