"""What the test modules share: the golden cases (loaded once), the (case, step, layer)
grid, sessions with the custom ops, and the report of golden comparisons (written to
build/golden_report.json for closing notes)."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from csa2onnx.custom_ops import make_session
from csa2onnx.export.goldens import Comparison, GoldenCase, compare, load_case

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "goldens"
REPORT = Path(__file__).resolve().parents[1] / "build" / "golden_report.json"
CASES = ("case1_r2_r1", "case2_candidates", "case3_r4_r128")

@functools.cache
def golden(name: str) -> GoldenCase:
    """A golden case by name, loaded once per test session."""
    return load_case(GOLDENS / f"{name}.json")


def every_step_and_layer(cases: tuple[str, ...] = CASES) -> list[tuple[str, str, int, int]]:
    """(case, step, start_pos, layer) for every scheduled step and layer of the cases."""
    params = []
    for case in cases:
        meta = json.loads((GOLDENS / f"{case}.json").read_text())
        params += [(case, st["step"], st["start_pos"], layer) for st in meta["schedule"]
                   for layer in range(len(meta["layer_roles"]))]
    return params


def run_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *,
              library: bool = True) -> dict[str, np.ndarray]:
    """Run a model on the CPU with the custom ops registered (`library=False`: without, as a
    portable artifact runs: its custom nodes as their function bodies); outputs by name."""
    data = model.SerializeToString()
    session = (make_session(data) if library
               else ort.InferenceSession(data, providers=["CPUExecutionProvider"]))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


class GoldenReport:
    """Collects (case, component, array) -> comparison rows across the test session."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def check(self, case: str, component: str, name: str, actual: np.ndarray,
              expected: np.ndarray, *, exact: bool = False) -> Comparison:
        result = compare(actual, expected, exact=exact)
        self.rows.append({"case": case, "component": component, "array": name,
                          "ok": result.ok, "exact": result.exact,
                          "bit_identical": result.bit_identical,
                          "max_abs_err": result.max_abs_err, "size": int(np.size(expected))})
        assert result.ok, f"{case} {component} {name}: {result.detail}"
        return result


def custom_op_model(graph: onnx.GraphProto, *, portable: bool = False) -> bytes:
    """A one-graph model importing ONNX 21 and the csa2onnx domain; `portable` attaches the
    custom ops' standard-op function bodies."""
    from csa2onnx.custom_ops.portable import portable_functions

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)])
    model.ir_version = 10
    if portable:
        model.functions.extend(portable_functions())
    return model.SerializeToString()


def build_cpp_driver(source: Path, folder: Path, *flags: str) -> Path:
    """Compile a C++ test driver against custom_ops/src with g++ (skip without g++)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip(f"g++ not found: needed to build {source.name}")
    exe = folder / source.stem
    subprocess.run([cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", *flags,
                    f"-I{ROOT / 'custom_ops' / 'src'}", str(source), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe
