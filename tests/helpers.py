"""What the test modules share: the golden cases (loaded once), the (case, step, layer)
grid, sessions with the custom ops, and the report of golden comparisons (written to
build/golden_report.json for closing notes)."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from csa2onnx.custom_ops import make_session
from csa2onnx.export.goldens import Comparison, GoldenCase, compare, load_case
from csa2onnx.graphs.standalone import IR_VERSION

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
                                                    helper.make_opsetid("csa2onnx", 1)],
                              ir_version=IR_VERSION)
    if portable:
        model.functions.extend(portable_functions())
    return model.SerializeToString()


def load_module(path: Path, name: str, register: bool = False) -> ModuleType:
    """A script (tools/, the upstream reference) imported from its path; `register` puts
    it in sys.modules first (dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def cast_pair(y: np.ndarray) -> np.ndarray:
    """onnxruntime's Cast float -> bfloat16 -> float of y, run by onnxruntime itself (what a
    kernel's round_output must equal bit for bit)."""
    nodes = [helper.make_node("Cast", ["Y"], ["B"], to=onnx.TensorProto.BFLOAT16),
             helper.make_node("Cast", ["B"], ["Z"], to=onnx.TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "casts",
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Z", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)],
                              ir_version=IR_VERSION)
    return ort.InferenceSession(model.SerializeToString()).run(None, {"Y": y})[0]


def bf16_values(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def hard_values(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Every binade, subnormals, grid midpoints, zeros, NaN and +-inf, bf16-valued."""
    n = rows * cols
    wide = rng.standard_normal(n) * np.exp2(rng.integers(-149, 127, n).astype(np.float64))
    ties = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0], n) * np.exp2(
        rng.integers(-10, 10, n).astype(np.float64)) * rng.choice([-1, 1], n)
    with np.errstate(over="ignore"):
        x = np.where(rng.random(n) < 0.3, ties, wide).astype(np.float32).reshape(rows, cols)
    # whole blocks at one magnitude, so block scales cover every binade too
    x[::3] = (rng.standard_normal((len(x[::3]), cols)) *
              np.exp2(rng.integers(-140, 126, (len(x[::3]), 1)).astype(np.float64)))
    x[5, 7], x[9, 70], x[11, 3] = np.nan, np.inf, -np.inf  # whole blocks go NaN
    return bf16_values(x)
