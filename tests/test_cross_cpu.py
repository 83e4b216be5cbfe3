"""The cross-CPU comparison rule (export/cross_cpu.py): it accepts what torch does to the
reference on another CPU class, and still fails real bugs (negative controls)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from csa2onnx.export.cross_cpu import REFERENCE_CLASS, cpu_class, envelope, rule_for
from csa2onnx.export.goldens import compare, load_case
from csa2onnx.export.verify import verify_case

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "goldens"


def test_cpu_class_of_machine_entries() -> None:
    assert cpu_class(None) == REFERENCE_CLASS  # FORMAT.md: no `machine`, the EPYC
    epyc = {"cpu": "AMD EPYC", "isa": ["avx2", "avx512f", "avx512_bf16"]}
    xeon = {"cpu": "Intel Xeon", "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    assert rule_for({"machine": epyc}) == "same_cpu"
    assert rule_for({"machine": xeon}) == "cross_cpu"
    assert rule_for({"machine": {"isa": ["avx2"]}}) == "cross_cpu"
    assert rule_for({"machine": dict(xeon, summation_class="reference")}) == "same_cpu"
    assert rule_for({"machine": dict(epyc, summation_class="other")}) == "cross_cpu"
    assert rule_for(load_case(GOLDENS / "case5_fp8.json").meta) == "cross_cpu"  # made on AMX


def test_envelopes() -> None:
    g = np.array([[448.0] + [1.0] * 31, [0.0] * 32], np.float32) / 64
    assert np.allclose(envelope("window_kv", g)[0], 7.0 / 8)  # fp8: 2^-3 of the block max (7)
    assert np.all(envelope("window_kv", g)[1] == 0)  # an all-zero block may not move
    k = np.array([[6.0, 1.0] * 8], np.float32)
    assert np.allclose(envelope("compress_kv_cache_after", k), 2.0)  # the 4 -> 6 fp4 step
    qr = np.array([1.0, -0.5, 0.0], np.float32)
    assert np.allclose(envelope("qr", qr), [2**-5 + 2**-6, 2**-6 + 2**-6, 2**-6])
    assert compare(qr + np.float32(2**-7), qr, name="qr", rule="cross_cpu").ok
    assert not compare(qr + np.float32(2**-4), qr, name="qr", rule="cross_cpu").ok
    assert not compare(qr + np.float32(2**-7), qr, name="qr").ok  # same-CPU tolerance
    # attention and layer outputs average quantised KV rows: one step moves them in proportion
    assert np.allclose(envelope("out", qr), [2**-5 + 2**-3, 2**-6 + 2**-3, 2**-3])


# ---------------------------------------------------------------- negative controls
def _fp4_ties_away(tr: ModuleType) -> Callable:
    def e2m1(v):
        code = (v.abs().unsqueeze(-1) >= tr.E2M1_MID).sum(-1)
        return tr.torch.copysign(tr.E2M1_GRID[code], v)
    return e2m1


FAULTS: dict[str, tuple[str, Callable[[ModuleType], Callable]]] = {
    "p_not_rounded_to_bf16": ("sparse_attn",
                              lambda tr: functools.partial(tr.sparse_attn, round_p=False)),
    "fp4_ties_away_from_even": ("e2m1_rne", _fp4_ties_away),
    "missing_act_quant": ("act_quant", lambda tr: lambda x, block=32: x),
}


@pytest.fixture(scope="module")
def oracle() -> ModuleType:
    pytest.importorskip("torch", reason="the oracle (tools/torch_reference.py) needs torch")
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_reference

    return torch_reference


@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_negative_controls_fail_the_rule(oracle: ModuleType, fault: str | None,
                                         monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The oracle with one deliberate bug against the shared case1 under the cross-CPU
    rule: every fault fails it; the oracle without a fault passes it."""
    case = load_case(GOLDENS / "case1_r2_r1.json")
    if fault is not None:
        name, make = FAULTS[fault]
        monkeypatch.setattr(oracle, name, make(oracle))
    ok, _ = oracle.compare_arrays(oracle.run_case(case.meta, case.arrays), case.arrays,
                                  f"case1+{fault}", rule="cross_cpu")
    report = capsys.readouterr().out
    print(report)
    assert ok == (fault is None), report
    if fault == "p_not_rounded_to_bf16":  # within every envelope: the count rule catches it
        assert "count rule" in report and "outside tolerance" not in report


def test_lowidx_overlay_fails_the_rule_in_default_mode() -> None:
    report = verify_case(GOLDENS / "case2_candidates_lowidx.json", rule="cross_cpu")
    assert not report.ok
    assert {r.array for r in report.rows if not r.result.ok} >= {"index_topk_idxs"}


# ---------------------------------------------------------------- another CPU class
def test_rule_accepts_upstream_on_another_class(tmp_path: Path,
                                                upstream_tools: ModuleType) -> None:
    """Upstream re-made with torch's bf16 GEMM on oneDNN's AVX2 path (the order of
    AVX2-only CPUs; AMX sums in yet another) differs from the shared case1 in last bits, and
    csa2onnx verifies it under the cross-CPU rule; the torch probe sees the other class."""
    script = ("import sys; sys.path[:0] = sys.argv[1:3]; import make_goldens as m, "
              "torch_reference as t; spec = next(c for c in m.CASES if c['name'] == "
              "'case1_r2_r1'); m.run_case(spec, __import__('pathlib').Path(sys.argv[3])); "
              "print('probe', t.torch_sums_like_goldens())")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    done = subprocess.run([sys.executable, "-c", script, str(upstream_tools.reference_dir()),
                           str(ROOT / "tools"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "probe False" in done.stdout
    remade, shared = load_case(tmp_path / "case1_r2_r1.json"), load_case(
        GOLDENS / "case1_r2_r1.json")
    differing = [k for k, v in shared.arrays.items()
                 if v.dtype.kind == "f" and k in remade.arrays
                 and not np.array_equal(v, remade.arrays[k], equal_nan=True)]
    assert differing, "forcing AVX2 changed nothing: the test would prove nothing"
    for key in ("index_topk_idxs", "attn_topk_idxs"):
        assert not [k for k in differing if k.endswith(key)]
    report = verify_case(tmp_path / "case1_r2_r1.json", rule="cross_cpu")
    print(f"{len(differing)} float arrays differ from the shared case1\n{report.table()}")
    assert report.ok, report.table()


# ---------------------------------------------------------------- csa2onnx on every CPU
def _run_schedule(folder: Path, case, isa: str | None,
                  monkeypatch: pytest.MonkeyPatch) -> dict[str, np.ndarray]:
    from csa2onnx.export.runtime import AttentionRuntime

    if isa is not None:  # read by every kernel when the session creates it
        monkeypatch.setenv("CSA2ONNX_ISA", isa)
    runtime = AttentionRuntime(folder)
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    outputs = {}
    for entry in case.meta["schedule"]:
        xs = {layer: case.step(entry["step"], layer, "x") for layer in runtime.layers}
        result = runtime.prefill(xs) if entry["start_pos"] == 0 else runtime.decode(xs)
        outputs.update({f"{entry['step']}.out.L{k}": v for k, v in result.out.items()})
        outputs.update({f"{entry['step']}.{k}": v for k, v in result.extra.items()})
    return outputs


def test_outputs_identical_on_every_instruction_set(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """csa2onnx's answer does not depend on the CPU: case3 (ratios 4 and 128, YaRN) through
    the whole schedule with every kernel forced onto the AVX2 and the scalar paths gives
    the default (AVX-512 here) outputs bit for bit. This is the check that stands in for
    CPU classes this machine is not."""
    from csa2onnx.custom_ops.library import cpu_isas
    from csa2onnx.export.config import AttentionConfig
    from csa2onnx.export.plan import plan_stack
    from csa2onnx.export.stack import export_stack
    from csa2onnx.export.weights import from_golden

    case = load_case(GOLDENS / "case3_r4_r128.json")
    config = AttentionConfig.from_model_args(case.model_args)
    export_stack(plan_stack(config), from_golden(case.arrays, range(config.n_layers)), tmp_path,
                 debug_outputs=True)
    default = _run_schedule(tmp_path, case, None, monkeypatch)
    for isa in cpu_isas():
        forced = _run_schedule(tmp_path, case, isa, monkeypatch)
        assert forced.keys() == default.keys()
        for key, value in default.items():
            assert np.array_equal(forced[key].view(np.uint8), value.view(np.uint8)), (isa, key)
    monkeypatch.setenv("CSA2ONNX_ISA", "sse9")  # the variable is read: a bad value is an error
    with pytest.raises(Exception, match=r'CSA2ONNX_ISA="sse9" \(expected avx512, avx2'):
        _run_schedule(tmp_path, case, None, monkeypatch)
