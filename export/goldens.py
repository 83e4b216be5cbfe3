"""Golden cases in the shared format (goldens/FORMAT.md): loading and comparison."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from csa2onnx.export.cross_cpu import Rule, envelope

RTOL = 1.6e-2
ATOL_FRACTION = 1e-3  # atol = ATOL_FRACTION * max|golden|


@dataclass
class GoldenCase:
    name: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def model_args(self) -> dict[str, Any]:
        return self.meta["model_args"]

    def step(self, step: str, layer: int, name: str) -> np.ndarray:
        return self.arrays[f"{step}.L{layer}.{name}"]

    def has(self, step: str, layer: int, name: str) -> bool:
        return f"{step}.L{layer}.{name}" in self.arrays

    def weights(self, layer: int) -> dict[str, np.ndarray]:
        prefix = f"weights.L{layer}."
        return {k[len(prefix):]: v for k, v in self.arrays.items() if k.startswith(prefix)}


class GoldenError(ValueError):
    """A file that is not a readable golden case (FORMAT.md)."""


def load_case(path: str | Path) -> GoldenCase:
    """Load NAME.json (a path to it) and its npz files; overlays load their base first."""
    path = Path(path)
    if not path.is_file():
        raise GoldenError(f"{path}: no such golden case file")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(f"{path}: not JSON ({e})") from None
    missing = [key for key in ("npz_files", "model_args", "schedule")
               if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise GoldenError(f"{path}: not a golden case (no {', '.join(missing)}; "
                          "see goldens/FORMAT.md)")
    arrays: dict[str, np.ndarray] = {}
    if meta.get("overlay_of"):
        arrays.update(load_case(path.with_name(f"{meta['overlay_of']}.json")).arrays)
    for fname in meta["npz_files"]:
        npz = path.parent / fname
        if not npz.is_file():
            raise GoldenError(f"{path}: its array file {fname} is missing")
        try:
            with np.load(npz) as z:
                arrays.update({k: z[k] for k in z.files})
        except (OSError, ValueError) as e:
            raise GoldenError(f"{npz}: unreadable ({e})") from None
    listed = meta.get("arrays", {})
    absent = sorted(set(listed) - set(arrays))
    if absent:
        raise GoldenError(f"{path}: {len(absent)} arrays listed in the JSON are missing from "
                          f"its npz files (first: {absent[0]})")
    return GoldenCase(meta.get("case", path.stem), meta, arrays)


@dataclass(frozen=True)
class Comparison:
    """How an output compares with its golden."""

    ok: bool
    exact: bool
    max_abs_err: float
    bit_identical: float  # fraction of elements equal as bf16 (as values, for ints/bools)
    detail: str = ""
    moved: int = 0  # elements that differ as bf16 (as values, for ints/bools)
    size: int = 0


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def compare(actual: np.ndarray, golden: np.ndarray, *, exact: bool = False,
            name: str = "", rule: Rule = "same_cpu") -> Comparison:
    """Integer/bool arrays and `exact=True` must be equal. Floats, same CPU class: within
    rtol=1.6e-2, atol=1e-3*max|golden|; golden from another class: within the cross-CPU
    envelope of array `name` (export/cross_cpu.py; the count rule is the caller's, over a
    whole case). inf and NaN must match where they stand."""
    actual = np.asarray(actual)
    golden = np.asarray(golden)
    if actual.shape != golden.shape:
        return Comparison(False, False, float("inf"), 0.0,
                          f"shape {actual.shape} != golden {golden.shape}", golden.size,
                          golden.size)
    if golden.size == 0:
        return Comparison(True, True, 0.0, 1.0)
    if exact or golden.dtype.kind in "biu":
        equal = actual == golden
        if golden.dtype.kind == "f":
            equal |= np.isnan(actual) & np.isnan(golden)
        moved = int((~equal).sum())
        detail = "" if not moved else f"{moved} of {equal.size} differ"
        return Comparison(not moved, not moved, 0.0 if not moved else float("inf"),
                          float(equal.mean()), detail, moved, golden.size)
    a = np.asarray(actual, np.float64)
    g = np.asarray(golden, np.float64)
    finite = np.isfinite(g)
    specials_match = bool(np.array_equal(a[~finite], g[~finite], equal_nan=True))
    err = np.abs(a[finite] - g[finite])
    if rule == "cross_cpu":
        allowed = envelope(name, g)[finite]
    else:
        scale = float(np.abs(g[finite]).max()) if finite.any() else 0.0
        allowed = ATOL_FRACTION * scale + RTOL * np.abs(g[finite])
    within = err <= allowed
    same_bits = _bf16_bits(actual) == _bf16_bits(golden)
    max_err = float(err.max()) if err.size else 0.0
    ok = specials_match and bool(within.all())
    detail = "" if ok else (f"{int((~within).sum())} elements outside tolerance"
                            if specials_match else "inf/NaN positions differ")
    return Comparison(ok, bool((a == g).all()), max_err, float(same_bits.mean()), detail,
                      int((~same_bits).sum()), golden.size)
