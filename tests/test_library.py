"""Finding the custom-op library: a missing or stale build is a clear error naming the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from csa2onnx.custom_ops import library, make_session
from csa2onnx.custom_ops.build import LIBRARY_NAME, STAMP_NAME
from csa2onnx.custom_ops.library import check_onnxruntime
from csa2onnx.graphs.standalone import IR_VERSION


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


@pytest.mark.parametrize("version", ["1.30.0", "1.31.0", "1.21.1", "0.9"])
def test_an_onnxruntime_that_leaves_empty_reductions_unreduced_is_refused(version: str) -> None:
    with pytest.raises(RuntimeError, match=rf"onnxruntime {version} is too old: .*1\.32"):
        check_onnxruntime(version)


@pytest.mark.parametrize("version", ["1.32.0", "1.32.1", "1.33.0.dev20261201", "2.0.0"])
def test_supported_onnxruntime_versions_pass(version: str) -> None:
    check_onnxruntime(version)


def test_empty_reductions_reduce_in_this_onnxruntime() -> None:
    """What the version floor stands for: ReduceSum over -1 of a [0, 8, 14] tensor is [0, 8]."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["X", "Axes"], ["Y"], keepdims=0)], "reduce",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [helper.make_tensor("Axes", TensorProto.INT64, [1], [-1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)],
                              ir_version=IR_VERSION)
    (y,) = make_session(model.SerializeToString()).run(None, {"X": np.zeros((0, 8, 14),
                                                                             np.float32)})
    assert y.shape == (0, 8)
