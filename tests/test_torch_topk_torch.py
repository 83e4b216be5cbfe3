"""torch_topk.h against torch.topk itself (CPU), ties, order and NaN bits included.

The header is reached through tests/cpp/topk_shim.cc, which calls csa::torch_topk_rows,
the function the onnxruntime kernel runs, so these results carry over to the op.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="compares against torch.topk; torch not installed")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "custom_ops" / "src"
SHIM = ROOT / "tests" / "cpp" / "topk_shim.cc"
GOLDENS = ROOT / "goldens"

# Shim format code, numpy storage of the raw bits, the signed twin torch can take
# (torch.from_numpy has no uint16), and the torch dtype the bits are viewed as.
FORMATS = {
    "float32": (0, np.uint32, np.int32, torch.float32),
    "bfloat16": (1, np.uint16, np.int16, torch.bfloat16),
    "float16": (2, np.uint16, np.int16, torch.float16),
}


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found: needed to build the ctypes shim around torch_topk.h")
    lib_path = tmp_path_factory.mktemp("topk_shim") / "libtopk_shim.so"
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           f"-I{SRC}", str(SHIM), "-o", str(lib_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(lib_path))
    i64 = ctypes.c_int64
    lib.topk_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, i64, i64, i64, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.topk_rows.restype = ctypes.c_int
    return lib


def shim_topk(lib: ctypes.CDLL, fmt: str, bits: np.ndarray, k: int, largest: bool,
              is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of each row of `bits` ([rows, n], raw element bits): (value bits, indices)."""
    code, storage, _, _ = FORMATS[fmt]
    bits = np.ascontiguousarray(bits, dtype=storage)
    rows, n = bits.shape
    values = np.zeros((rows, k), dtype=storage)
    indices = np.zeros((rows, k), dtype=np.int64)
    rc = lib.topk_rows(code, bits.ctypes.data, rows, n, k, int(largest), int(is_sorted),
                       values.ctypes.data, indices.ctypes.data)
    assert rc == 0
    return values, indices


def torch_topk(fmt: str, bits: np.ndarray, k: int, largest: bool,
               is_sorted: bool) -> tuple[np.ndarray, np.ndarray]:
    _, storage, signed, dtype = FORMATS[fmt]
    x = torch.from_numpy(np.ascontiguousarray(bits, dtype=storage).view(signed)).view(dtype)
    values, indices = torch.topk(x, k, dim=-1, largest=largest, sorted=is_sorted)
    signed_torch = torch.int32 if signed is np.int32 else torch.int16
    return values.view(signed_torch).numpy().view(storage), indices.numpy()


# ---------------------------------------------------------------- row generators
# Values are float32 holding bf16 values (as the model's scores do), so bf16 and f32 rows
# share generators; ties are the point.

def _bf16(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def _f32(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


SMALL = np.array([-2, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3], dtype=np.float32)
# NaNs of both signs and several payloads, infinities, signed zeros, a bf16 subnormal.
SPECIAL = np.concatenate([
    _f32(0x7FC00000, 0xFFC00000, 0x7F810000, 0xFFFF0000, 0x7FA00000),
    np.array([np.inf, -np.inf, 0.0, -0.0, 1, -1, 2], dtype=np.float32),
    _f32(0x00010000, 0x80010000),
])


def row_kind(kind: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    n = shape[1]
    if kind == "normals":
        return _bf16(rng.standard_normal(shape))
    if kind == "repeats":
        return rng.choice(SMALL, shape)
    if kind == "mostly_neginf":
        p = rng.choice([0.5, 0.9, 0.99, 1.0])
        rest = np.where(rng.random(shape) < 0.5, rng.choice(SMALL, shape),
                        _bf16(rng.standard_normal(shape)))
        return np.where(rng.random(shape) < p, np.float32(-np.inf), rest).astype(np.float32)
    if kind == "all_equal":
        c = rng.choice(np.array([-np.inf, 0, 1, np.nan, np.inf], dtype=np.float32))
        return np.full(shape, c, dtype=np.float32)
    if kind == "nan_inf":
        return np.where(rng.random(shape) < 0.7, rng.choice(SPECIAL, shape),
                        rng.choice(SMALL, shape)).astype(np.float32)
    if kind == "zeros":
        return rng.choice(np.concatenate([SPECIAL[7:9], SPECIAL[-2:]]), shape)
    if kind == "runs":  # ascending / descending / organ-pipe with repeats: quicksort traps
        j = np.arange(n)
        t = [j, n - j, np.minimum(j, n - j)][rng.integers(3)] // rng.integers(1, 9)
        return _bf16(np.broadcast_to(t, shape).astype(np.float32))
    assert kind == "general"  # plain f32, essentially no ties
    return rng.standard_normal(shape).astype(np.float32)


KINDS = ["normals", "repeats", "mostly_neginf", "all_equal", "nan_inf", "zeros", "runs", "general"]
F16_POOL = np.array([0x0000, 0x8000, 0x3C00, 0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01,
                     0x0001, 0x8001, 0x4000, 0x3800, 0x7BFF], dtype=np.uint16)


def make_bits(fmt: str, kind: str, rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Raw element bits. float16 rows are half the time the shared kinds cast to half, else
    (and always for "general") half-specific patterns: NaN payloads, subnormals, random bits."""
    if fmt == "float16" and kind != "general" and rng.random() < 0.5:
        return row_kind(kind, rng, shape).astype(np.float16).view(np.uint16)
    if fmt == "float16":
        pooled = rng.choice(F16_POOL, shape)
        random_bits = rng.integers(0, 1 << 16, shape, dtype=np.uint32).astype(np.uint16)
        p = rng.choice([0.0, 0.5, 0.9, 1.0])
        return np.where(rng.random(shape) < p, pooled, random_bits)
    x = row_kind(kind, rng, shape).view(np.uint32)
    return x if fmt == "float32" else (x >> 16).astype(np.uint16)


@dataclass
class Batch:
    fmt: str
    kind: str
    bits: np.ndarray  # [rows, n]
    k: int
    largest: bool
    is_sorted: bool


def batches(fmt: str, seed: int) -> Iterator[Batch]:
    rng = np.random.default_rng(seed)
    sizes = list(range(1, 81)) + sorted(rng.integers(81, 4097, 110).tolist())
    sizes += [8192, 16384, 65536, 70000]
    kinds = KINDS if fmt != "bfloat16" else KINDS[:-1]
    for n in sizes:
        ks = {0, 1, n, max(n - 1, 0), n // 64, min(n // 64 + 1, n), int(rng.integers(0, n + 1)),
              int(rng.integers(0, n // 64 + 1))}
        rows = int(np.clip(12_000 // n, 1, 16))
        for k in sorted(ks):
            for _ in range(2):
                kind = str(rng.choice(kinds))
                yield Batch(fmt, kind, make_bits(fmt, kind, rng, (rows, n)), k,
                            bool(rng.random() < 0.7), bool(rng.random() < 0.5))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_matches_torch_topk(shim: ctypes.CDLL, fmt: str) -> None:
    rows = partial_sort_rows = nth_element_rows = mismatched_rows = 0
    samples: list[str] = []
    for b in batches(fmt, seed=list(FORMATS).index(fmt) + 11):
        got_v, got_i = shim_topk(shim, fmt, b.bits, b.k, b.largest, b.is_sorted)
        want_v, want_i = torch_topk(fmt, b.bits, b.k, b.largest, b.is_sorted)
        n_rows, n = b.bits.shape
        rows += n_rows
        if b.k > 0:
            if b.k * 64 <= n:
                partial_sort_rows += n_rows
            else:
                nth_element_rows += n_rows
        # Value BITS must match: catches NaN payload/sign and -0 vs +0, not just order.
        bad = np.flatnonzero(~((got_i == want_i).all(axis=1) & (got_v == want_v).all(axis=1)))
        mismatched_rows += len(bad)
        samples += [f"{b.kind} n={n} k={b.k} largest={b.largest} sorted={b.is_sorted} row={r}: "
                    f"got {got_i[r][:8]} want {want_i[r][:8]}" for r in bad[:2]]
    assert mismatched_rows == 0, f"{mismatched_rows} of {rows} rows differ:\n" + "\n".join(
        samples[:20])
    assert rows > 20_000
    assert partial_sort_rows > 4_000 and nth_element_rows > 10_000


def _golden_cases() -> list[dict]:
    meta = GOLDENS / "unit_kernels.json"
    assert meta.exists(), f"missing {meta}: the repository's goldens/ folder is incomplete"
    return json.loads(meta.read_text())["topk"]["cases"]


def test_reproduces_goldens(shim: ctypes.CDLL) -> None:
    cases = _golden_cases()
    assert cases, "no topk cases in unit_kernels.json"
    with np.load(GOLDENS / "unit_kernels.npz") as z:
        arrays = {name: z[name] for name in z.files if name.startswith("topk.")}
    failures = []
    compared = 0
    for case in cases:
        tag, k = case["tag"], int(case["k"])
        x = arrays[f"topk.{tag}.input"].astype(np.float32)  # [n] or [rows, n]
        assert x.shape[-1] == case["n"]
        fmt = case["dtype"]
        bits = x.reshape(-1, x.shape[-1]).view(np.uint32)
        if fmt == "bfloat16":
            assert not (bits & 0xFFFF).any(), f"{tag}: input is not bf16-valued"
            bits = (bits >> 16).astype(np.uint16)
        # Some cases (e.g. indexer_prefill) record only the unsorted call the model makes.
        orders = [o for o in ("sorted", "unsorted") if f"topk.{tag}.{o}.indices" in arrays]
        assert "unsorted" in orders, tag
        for order in orders:
            got_v, got_i = shim_topk(shim, fmt, bits, k, True, order == "sorted")
            if fmt == "bfloat16":
                got_v = (got_v.astype(np.uint32) << 16).view(np.float32)
            got_v = got_v.view(np.float32).reshape(*x.shape[:-1], k)
            got_i = got_i.reshape(*x.shape[:-1], k)
            want_v = arrays[f"topk.{tag}.{order}.values"]
            want_i = arrays[f"topk.{tag}.{order}.indices"]
            # NaN-aware, and -0 must stay -0.
            same_v = np.array_equal(got_v, want_v, equal_nan=True) and np.array_equal(
                np.signbit(got_v) | np.isnan(got_v), np.signbit(want_v) | np.isnan(want_v))
            if not (same_v and np.array_equal(got_i, want_i)):
                failures.append(f"{tag} {order}: got {got_i.tolist()} want {want_i.tolist()}")
            if order == "unsorted":  # what the Indexer then does with them
                then_sorted = arrays[f"topk.{tag}.unsorted.indices_then_sorted"]
                assert np.array_equal(np.sort(got_i, axis=-1), then_sorted), tag
            compared += 1
    assert not failures, "\n".join(failures)
    assert len(cases) >= 100 and compared >= 2 * len(cases) - 1
