"""Shared fixtures: the golden comparison report and the upstream reference (helpers.py
holds the plain helpers the test modules import)."""

from __future__ import annotations

import fcntl
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
        # each pytest-xdist worker merges its rows in turn
        with open(REPORT.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The slowest file (the sanitizer build, then its fuzz cases) first: under pytest-xdist
    # (`make test`) one worker takes it while the others share the rest, instead of it
    # running alone at the end.
    items.sort(key=lambda item: item.path.name != "test_fuzz_ops.py")
