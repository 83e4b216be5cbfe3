"""The upstream PyTorch reference (`../shared/reference/` beside the checkout, or the folder
in CSA2ONNX_UPSTREAM) as an oracle for tests and tools. Reference material: read by path at
test time, never copied into the project and never imported by the package.

    from upstream import load_upstream, reference_dir
    mod = load_upstream()           # a fresh upstream module (fresh shared slots, caches)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def reference_dir(path: str | Path | None = None) -> Path:
    """Where the upstream reference lives: `path`, else $CSA2ONNX_UPSTREAM, else
    ../shared/reference beside the checkout."""
    return Path(path or os.environ.get("CSA2ONNX_UPSTREAM") or ROOT.parent / "shared" / "reference")


def available(path: str | Path | None = None) -> bool:
    return (reference_dir(path) / "load.py").is_file()


def load_upstream(path: str | Path | None = None) -> ModuleType:
    """A fresh upstream `model` module running on the CPU kernels beside it (needs torch)."""
    folder = reference_dir(path)
    if not available(folder):
        raise FileNotFoundError(f"no upstream reference at {folder} (load.py missing); "
                                "set CSA2ONNX_UPSTREAM to its folder")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    import load

    return load.load_upstream()


def make_goldens_module(path: str | Path | None = None) -> ModuleType:
    """The reference's golden generator (`make_goldens.py`: run_case, CASES, SMALL)."""
    load_upstream(path)  # puts the folder on sys.path and checks it
    import make_goldens

    return make_goldens
