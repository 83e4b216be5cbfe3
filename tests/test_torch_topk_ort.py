"""TorchTopK through onnxruntime (the registered kernel, not the header shim) against
torch.topk: tie-heavy rows over both of torch's branches, float32 and bfloat16, every
attribute combination, K as a scalar and as [1], ranks 1-3, empty inputs, thread-count
independence, and clear errors for bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.graphs.standalone import IR_VERSION

torch = pytest.importorskip("torch", reason="compares against torch.topk; torch not installed")

DTYPES = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16}


def topk_model(x_type: int = TensorProto.FLOAT, k_type: int = TensorProto.INT64,
               **attributes: object) -> bytes:
    """X and K of unknown rank, so one session takes every rank and both K shapes (and lets
    bad ranks through to the kernel, whose own checks are under test)."""
    nodes = [helper.make_node("TorchTopK", ["X", "K"], ["Values", "Indices"],
                              domain="csa2onnx", **attributes)]
    values_type = x_type
    if x_type == TensorProto.BFLOAT16:  # numpy has no bfloat16: read Values as float32
        nodes[0].output[0] = "Values_raw"
        nodes.append(helper.make_node("Cast", ["Values_raw"], ["Values"], to=TensorProto.FLOAT))
        values_type = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "topk",
        [helper.make_tensor_value_info("X", x_type, None),
         helper.make_tensor_value_info("K", k_type, None)],
        [helper.make_tensor_value_info("Values", values_type, None),
         helper.make_tensor_value_info("Indices", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)],
                              ir_version=IR_VERSION)
    return model.SerializeToString()


def quiet_options(threads: int = 0) -> ort.SessionOptions:
    options = session_options(threads)
    options.log_severity_level = 4  # expected errors would otherwise print red log lines
    return options


def run_topk(session: ort.InferenceSession, dtype: str, x: np.ndarray,
             k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Feeds float32 `x` (bf16-valued for bfloat16) as `dtype`; (Values as f32 bits, Indices)."""
    if dtype == "bfloat16":
        bits = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        feed = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16)
    else:
        feed = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, np.float32))
    values, indices = session.run_with_ort_values(
        ["Values", "Indices"], {"X": feed, "K": ort.OrtValue.ortvalue_from_numpy(k)})
    return values.numpy().view(np.uint32), indices.numpy()


def torch_reference(dtype: str, x: np.ndarray, k: int, largest: bool,
                    is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    if dtype == "bfloat16":
        t = t.to(torch.bfloat16)  # exact: x is bf16-valued
    values, indices = torch.topk(t, k, dim=-1, largest=largest, sorted=is_sorted)
    return values.float().numpy().view(np.uint32), indices.numpy()


# ---------------------------------------------------------------- tie-heavy rows
SMALL = np.array([-2, -1, -0.5, -0.0, 0, 0.5, 1, 1.5, 2, 3], dtype=np.float32)
SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1, -1, 2**-130, -(2**-130)],
                   dtype=np.float32)


def _bf16(x: np.ndarray) -> np.ndarray:
    """Truncate to bf16 values, so float32 and bfloat16 rows are the same numbers."""
    return (np.asarray(x, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def tie_heavy(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    shape = (rows, n)
    kind = rng.integers(6)
    if kind == 0:
        x = rng.choice(SMALL, shape)
    elif kind == 1:  # mostly -inf, as masked scores are
        p = rng.choice([0.5, 0.9, 1.0])
        x = np.where(rng.random(shape) < p, np.float32(-np.inf), rng.choice(SMALL, shape))
    elif kind == 2:
        x = np.where(rng.random(shape) < 0.5, rng.choice(SPECIAL, shape), rng.choice(SMALL, shape))
    elif kind == 3:  # few distinct values at every scale: coarse bf16 rounding
        x = np.round(rng.standard_normal(shape) * 4) / 4
    elif kind == 4:  # sorted runs with repeats: quicksort's bad cases
        j = np.arange(n)
        x = np.broadcast_to([j, n - j, np.minimum(j, n - j)][rng.integers(3)] // 3, shape)
    else:
        x = rng.standard_normal(shape)
    return _bf16(np.asarray(x, np.float32))


@dataclass
class Case:
    x: np.ndarray  # any rank >= 1
    k: int
    largest: bool
    is_sorted: bool


def cases(rng: np.random.Generator) -> Iterator[Case]:
    sizes = [1, 2, 3, 5, 8, 16, 17, 31, 63, 64, 65, 100, 128, 129, 255, 500, 1000, 2048, 4096,
             5000, 9000]
    for n in sizes:
        ks = sorted({0, 1, n, max(n - 1, 0), n // 64, min(n // 64 + 1, n),
                     int(rng.integers(0, n + 1))})
        rows = int(np.clip(30000 // n, 1, 24))
        for k in ks:
            for largest in (True, False):
                for is_sorted in (True, False):
                    rank = int(rng.integers(1, 4))
                    x = tie_heavy(rng, 1 if rank == 1 else rows, n)
                    if rank == 1:
                        x = x[0]
                    elif rank == 3:
                        x = x.reshape(1, rows, n) if rows % 2 else x.reshape(2, rows // 2, n)
                    yield Case(x, k, largest, is_sorted)


@pytest.fixture(scope="module")
def sessions() -> dict[tuple[str, bool, bool], ort.InferenceSession]:
    return {(dtype, largest, is_sorted): make_session(
                topk_model(onnx_type, largest=int(largest), sorted=int(is_sorted)),
                options=quiet_options())
            for dtype, onnx_type in DTYPES.items()
            for largest in (True, False) for is_sorted in (True, False)}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_torch_on_tie_heavy_rows(sessions: dict, dtype: str) -> None:
    rng = np.random.default_rng(list(DTYPES).index(dtype) + 21)
    rows = partial_sort_rows = nth_element_rows = 0
    ranks: set[int] = set()
    failures: list[str] = []
    for i, case in enumerate(cases(rng)):
        # K alternates between a scalar and a [1] tensor; both are accepted.
        k = np.array(case.k, np.int64) if i % 2 else np.array([case.k], np.int64)
        got_v, got_i = run_topk(sessions[dtype, case.largest, case.is_sorted], dtype, case.x, k)
        want_v, want_i = torch_reference(dtype, case.x, case.k, case.largest, case.is_sorted)
        assert got_i.shape == want_i.shape == (*case.x.shape[:-1], case.k)
        # Value bits, so -0 vs +0 and NaN sign/payload count as differences.
        if not (np.array_equal(got_i, want_i) and np.array_equal(got_v, want_v)):
            failures.append(f"shape={case.x.shape} k={case.k} largest={case.largest} "
                            f"sorted={case.is_sorted}")
        n_rows = case.x.size // max(case.x.shape[-1], 1)
        rows += n_rows
        ranks.add(case.x.ndim)
        if case.k > 0:
            if case.k * 64 <= case.x.shape[-1]:
                partial_sort_rows += n_rows
            else:
                nth_element_rows += n_rows
    assert not failures, f"{len(failures)} cases differ from torch.topk:\n" + "\n".join(
        failures[:20])
    assert rows > 2_000 and partial_sort_rows > 300 and nth_element_rows > 1_000
    assert ranks == {1, 2, 3}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("shape", "k"), [
    ((300, 4096), 16),    # k*64 <= n: partial_sort; 16 rows per task, 19 tasks
    ((300, 4096), 1000),  # nth_element + sort
    ((5000, 64), 8),      # 1024 rows per task
    ((3, 70000), 2000),   # one row per task
    ((2, 40, 512), 100),  # rank 3
])
def test_threads_do_not_change_results(dtype: str, shape: tuple[int, ...], k: int) -> None:
    rng = np.random.default_rng(sum(shape) + k)
    x = tie_heavy(rng, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
    feeds_k = np.array([k], np.int64)
    results = []
    for threads in (1, 2):
        for largest, is_sorted in ((True, True), (False, False)):
            session = make_session(topk_model(DTYPES[dtype], largest=int(largest),
                                              sorted=int(is_sorted)),
                                   options=quiet_options(threads))
            results.append(run_topk(session, dtype, x, feeds_k))
    for (v1, i1), (v2, i2) in ((results[0], results[2]), (results[1], results[3])):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(v1, v2)
    want_v, want_i = torch_reference(dtype, x, k, True, True)
    np.testing.assert_array_equal(results[0][1], want_i)
    np.testing.assert_array_equal(results[0][0], want_v)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("shape", "k", "out_shape"), [
    ((0, 8), 3, (0, 3)),
    ((2, 0, 8), 8, (2, 0, 8)),
    ((3, 0), 0, (3, 0)),
    ((0,), 0, (0,)),
    ((4, 7), 0, (4, 0)),
    ((7,), 7, (7,)),
])
def test_empty_inputs_and_k_edges(sessions: dict, dtype: str, shape: tuple[int, ...], k: int,
                                  out_shape: tuple[int, ...]) -> None:
    x = tie_heavy(np.random.default_rng(1), 1, int(np.prod(shape))).reshape(shape)
    values, indices = run_topk(sessions[dtype, True, True], dtype, x, np.array(k, np.int64))
    assert values.shape == indices.shape == out_shape
    if x.size and k:
        want_v, want_i = torch_reference(dtype, x, k, True, True)
        np.testing.assert_array_equal(indices, want_i)
        np.testing.assert_array_equal(values, want_v)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(("x", "k", "message"), [
    (np.ones((2, 4), np.float32), np.array(5, np.int64),
     r"K = 5 exceeds the last dimension of X, 4"),
    (np.ones((2, 4), np.float32), np.array([-1], np.int64), r"K must be >= 0, got -1"),
    (np.ones((2, 4), np.float32), np.array([1, 2], np.int64),
     r"K must be a scalar or have shape \[1\], got shape \[2\]"),
    (np.ones((2, 4), np.float32), np.zeros((0,), np.int64), r"K must be a scalar or have shape"),
    (np.array(1.0, np.float32), np.array(1, np.int64), r"X must have rank >= 1"),
])
def test_bad_inputs_are_clear_errors(x: np.ndarray, k: np.ndarray, message: str) -> None:
    session = make_session(topk_model(), options=quiet_options())
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
        session.run(None, {"X": x, "K": k})


# Run in a fresh interpreter: a process whose first C++ exception comes from the library
# is where an unwinding fault shows (it aborted before; see custom_ops/CMakeLists.txt's link
# options), and an abort there fails this test instead of killing pytest.
SESSION_SCRIPT = """
import sys
from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.graphs.standalone import IR_VERSION
options = session_options()
options.log_severity_level = 4
try:
    make_session(open(sys.argv[1], "rb").read(), options=options)
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("created")
"""


@pytest.mark.parametrize(("model", "message"), [
    (topk_model(x_type=TensorProto.DOUBLE), r"InvalidGraph: .*tensor\(double\).*TorchTopK"),
    (topk_model(k_type=TensorProto.INT32), r"InvalidGraph: .*tensor\(int32\).*TorchTopK"),
    (topk_model(largest=2), r"RuntimeException: .*TorchTopK: attribute largest must be 0 or 1, "
                            r"got 2"),
    (topk_model(sorted="yes"), r"RuntimeException: .*TorchTopK: attribute sorted must be an int"),
    (topk_model(largest=-1), r"RuntimeException: .*TorchTopK: attribute largest must be 0 or 1, "
                             r"got -1"),
], ids=["float64_X", "int32_K", "largest_2", "sorted_yes", "largest_-1"])
def test_bad_types_and_attributes_are_clear_errors(model: bytes, message: str,
                                                   tmp_path: Path) -> None:
    # Type and attribute errors surface when the session is created (before any run).
    path = tmp_path / "model.onnx"
    path.write_bytes(model)
    run = subprocess.run([sys.executable, "-c", SESSION_SCRIPT, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, (f"session creation crashed (exit status {run.returncode}) "
                                 f"instead of raising:\n{run.stderr[-2000:]}")
    assert re.search(message, run.stdout), run.stdout + run.stderr[-2000:]
