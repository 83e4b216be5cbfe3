"""Finding the custom-op library: a missing or stale build is a clear error naming the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from csa2onnx.custom_ops import library
from csa2onnx.custom_ops.build import LIBRARY_NAME, STAMP_NAME
from csa2onnx.custom_ops.library import check_onnxruntime


def test_missing_library_names_the_build_command(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(library, "_DEFAULT_BUILD", tmp_path)
    monkeypatch.delenv("CSA2ONNX_OPS_LIBRARY", raising=False)
    with pytest.raises(library.CustomOpLibraryError, match=r"python custom_ops/build\.py"):
        library.library_path()


def test_stale_library_is_refused(monkeypatch, tmp_path: Path) -> None:
    built = library.library_path()
    shutil.copy(built, tmp_path / LIBRARY_NAME)
    (tmp_path / STAMP_NAME).write_text("0" * 64 + "\n")  # built from other sources
    monkeypatch.setattr(library, "_DEFAULT_BUILD", tmp_path)
    monkeypatch.delenv("CSA2ONNX_OPS_LIBRARY", raising=False)
    with pytest.raises(library.CustomOpLibraryError, match="stale"):
        library.library_path()


def test_environment_override(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CSA2ONNX_OPS_LIBRARY", str(tmp_path / "nowhere.so"))
    with pytest.raises(library.CustomOpLibraryError, match=r"nowhere\.so"):
        library.library_path()


@pytest.mark.parametrize("version", ["1.29.0", "1.21.1", "0.9"])
def test_an_untested_older_onnxruntime_is_refused(version: str) -> None:
    with pytest.raises(RuntimeError, match=rf"onnxruntime {version} is older than .*1\.30"):
        check_onnxruntime(version)


@pytest.mark.parametrize("version", ["1.30.0", "1.31.1", "1.32.0", "1.33.0.dev20261201"])
def test_tested_and_newer_onnxruntime_versions_pass(version: str) -> None:
    check_onnxruntime(version)
