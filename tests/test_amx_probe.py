"""tools/amx_probe.py's vdpbf16ps half: this CPU's vdpbf16ps sums pairs in the order the exact
TorchLinear defines (torch_linear.h's kOneDnnPairs, odd product first), the premise of the
kernels' vdpbf16ps paths, and the probe's models tell that order from the others (so the
AMX half, run by hand on an AMX CPU, can say which order TDPBF16PS follows)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, load_module

from csa2onnx.custom_ops.library import cpu_isas


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: needed to build the probe")
@pytest.mark.skipif("avx512bf16" not in cpu_isas(), reason="this CPU has no AVX512-BF16")
def test_vdpbf16ps_sums_in_the_defined_order(tmp_path: Path) -> None:
    exe = load_module(ROOT / "tools" / "amx_probe.py", "amx_probe").build(tmp_path)
    # the AMX half has run on no machine of this project yet: CI does not depend on it
    out = subprocess.run([str(exe), "30", "--no-amx"], capture_output=True, text=True,
                         check=True).stdout
    rows = re.findall(r"vdpbf16ps +odd_first (\d+)/(\d+) +even_first (\d+)/\d+ +pair_once (\d+)/"
                      r"\d+ +block_once (\d+)/\d+ +\(max (\d+) ulp", out)
    assert len(rows) == 3, out  # three kinds of data
    for odd, total, even, once, block, far in rows:
        assert int(odd) == int(total) == 30 * 256 and int(far) == 0
        # the other models differ on many sums: the comparison can tell orders apart
        assert max(int(even), int(once), int(block)) < 0.9 * int(total)
    assert "definition (odd_first) on every sum: yes" in out
