"""An export's peak memory is the exported weights' bytes plus a bounded margin, whatever else
the shards hold: checkpoint tensors stay views of the memory map, initializers stream to the
weights file before the model is serialised (no protobuf copy of the weights), and no RoPE
table is built. Measured in a fresh process (its VmHWM), so nothing else in the test session
counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_checkpoint import make_checkpoint  # noqa: E402

from csa2onnx.export.shared_weights import WEIGHTS_FILE  # noqa: E402

RELEASED_HF = ROOT / "export" / "configs" / "v41_flash_attention.json"
MIB = 1 << 20
# What an export may hold beside the weights: one model's graph, the protobuf of it, the
# checker's copy of the graph (measured: ~10 MiB at the released dims, two layers).
MARGIN = 128 * MIB
FILLER_MIB = 128  # per layer: experts between the attention tensors, never to be read

# Runs `csa2onnx export` in this process and prints its resident set before (everything
# imported) and its peak (VmHWM) after, in bytes.
MEASURE = """
import json, sys
from csa2onnx.export.cli import main

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(key + " not in /proc/self/status")

before = status("VmRSS")
code = main(["export", *sys.argv[1:]])
print(json.dumps({"code": code, "before": before, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def released_fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 1 (window-only) and 2 (kv and index source, key owner) at the released dims
    and max_seq_len (1M), fp8, in two shards with expert filler around them."""
    return make_checkpoint(RELEASED_HF, tmp_path_factory.mktemp("released"),
                           layers=range(1, 3), dtype="fp8", shards=2, filler_mib=FILLER_MIB)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_export_peak_memory_is_the_weights_plus_a_margin(released_fp8_folder: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "artifacts"
    run = subprocess.run([sys.executable, "-c", MEASURE, str(released_fp8_folder), "--out",
                          str(out), "--layers", "1-2"],
                         capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["code"] == 0
    weights = (out / WEIGHTS_FILE).stat().st_size
    assert weights > 2 * MARGIN  # large enough that a second copy could not hide
    grown = measured["peak"] - measured["before"]
    assert grown < weights + MARGIN, (
        f"export peak grew by {grown / MIB:.0f} MiB for {weights / MIB:.0f} MiB of weights "
        f"(allowed: weights + {MARGIN / MIB:.0f} MiB)")
