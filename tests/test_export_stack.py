"""The compiler end to end: whole stacks and single layers exported, run in onnxruntime with
state chained between steps, and compared with every golden step and layer."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from helpers import GOLDENS, golden
from onnx import helper

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops.reference import pack_quantized
from csa2onnx.custom_ops.weight_layout import pack_panels, panels_shape
from csa2onnx.export.artifacts import read_manifest
from csa2onnx.export.cli import main as cli
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.goldens import compare
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime, RuntimeStateError, describe
from csa2onnx.export.stack import export_stack
from csa2onnx.export.verify import verify_case
from csa2onnx.export.weights import check_layer, from_golden

VERIFIED = ["case1_r2_r1", "case1_r2_r1_ownk", "case2_candidates", "case3_r4_r128",
            "case3_r4_r128_ownk"]


@pytest.mark.parametrize("case", VERIFIED)
def test_verify_passes_on_every_shared_case(case: str, golden_report) -> None:
    report = verify_case(GOLDENS / f"{case}.json")
    for row in report.rows:
        golden_report.rows.append({
            "case": case, "component": "stack", "array": f"{row.step}.L{row.layer}.{row.array}",
            "ok": row.result.ok, "exact": row.result.exact,
            "bit_identical": row.result.bit_identical, "max_abs_err": row.result.max_abs_err,
            "size": 0})
    assert report.ok, report.table()
    compared = {row.array for row in report.rows}
    assert {"out", "attn_topk_idxs", "attn_o", "index_topk_idxs"} <= compared


def test_tie_rule_decides_the_lowest_index_overlay() -> None:
    """The overlay breaks ties lowest-index-first (ONNX TopK's rule): the portable export
    reproduces its selections, the default (torch's rule) must not."""
    path = GOLDENS / "case2_candidates_lowidx.json"
    portable = verify_case(path, portable=True)
    default = verify_case(path)
    assert portable.ok, portable.table()
    assert not default.ok
    assert any(not r.result.ok for r in default.rows if r.array == "index_topk_idxs")


@pytest.fixture(scope="module")
def case1_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = golden("case1_r2_r1")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    folder = tmp_path_factory.mktemp("case1")
    export_stack(plan, from_golden(g.arrays, range(6)), folder)
    return folder


def run_schedule(folder: Path, threads: int, steps: int = 4) -> list[dict[int, np.ndarray]]:
    g = golden("case1_r2_r1")
    runtime = AttentionRuntime(folder, intra_op_num_threads=threads)
    outs = []
    for entry in g.meta["schedule"][:steps]:
        xs = {layer: g.step(entry["step"], layer, "x") for layer in range(6)}
        outs.append((runtime.prefill if entry["start_pos"] == 0 else runtime.decode)(xs).out)
    return outs


def test_one_and_two_threads_give_identical_outputs(case1_artifacts: Path) -> None:
    for a, b in zip(run_schedule(case1_artifacts, 1), run_schedule(case1_artifacts, 2),
                    strict=True):
        for layer in a:
            np.testing.assert_array_equal(a[layer], b[layer])


def test_batch_rows_are_independent(case1_artifacts: Path) -> None:
    """Two different sequences in one batch give each sequence's batch-1 result."""
    g = golden("case1_r2_r1")
    xs = {layer: g.step("prefill", layer, "x") for layer in range(6)}
    other = {layer: x[:, ::-1].copy() for layer, x in xs.items()}
    single = AttentionRuntime(case1_artifacts).prefill(xs).out
    pair = AttentionRuntime(case1_artifacts).prefill(
        {layer: np.concatenate([other[layer], xs[layer]]) for layer in xs}).out
    for layer in single:
        np.testing.assert_array_equal(pair[layer][1:], single[layer])


def test_runtime_rejects_calls_that_do_not_fit(case1_artifacts: Path) -> None:
    g = golden("case1_r2_r1")
    for threads in (-1, 1.5, True):  # -1 had been handed to onnxruntime; True is an int
        with pytest.raises(ValueError, match=r"intra_op_num_threads must be an int >= 0"):
            AttentionRuntime(case1_artifacts, intra_op_num_threads=threads)  # type: ignore[arg-type]
    runtime = AttentionRuntime(case1_artifacts)
    step = {layer: g.step("decode0", layer, "x") for layer in range(6)}
    with pytest.raises(RuntimeStateError, match="decode called before any prefill"):
        runtime.decode(step)
    too_big = {layer: np.zeros((5, 3, 256), np.float32) for layer in range(6)}
    with pytest.raises(RuntimeStateError, match="larger than max_batch_size 4"):
        runtime.prefill(too_big)
    too_long = {layer: np.zeros((1, 513, 256), np.float32) for layer in range(6)}
    with pytest.raises(RuntimeStateError, match="past max_seq_len 512"):
        runtime.prefill(too_long)
    with pytest.raises(ValueError, match=r"\[batch, seqlen, 256\]"):
        runtime.prefill({layer: np.zeros((1, 3, 128), np.float32) for layer in range(6)})
    with pytest.raises(ValueError, match="this stack has"):
        runtime.prefill({0: np.zeros((1, 3, 256), np.float32)})
    runtime.prefill({layer: np.zeros((1, 511, 256), np.float32) for layer in range(6)})
    runtime.decode({layer: np.zeros((1, 1, 256), np.float32) for layer in range(6)})
    with pytest.raises(RuntimeStateError, match="position 512 is past max_seq_len 512"):
        runtime.decode({layer: np.zeros((1, 1, 256), np.float32) for layer in range(6)})
    with pytest.raises(RuntimeStateError, match="differs from the prefill's batch"):
        runtime.decode({layer: np.zeros((2, 1, 256), np.float32) for layer in range(6)})


def test_artifacts_are_checked_named_and_described(case1_artifacts: Path) -> None:
    model = onnx.load(str(case1_artifacts / "decode.onnx"))
    onnx.checker.check_model(model, full_check=True)
    meta = {p.key: p.value for p in model.metadata_props}
    assert {"config", "state", "layers", "custom_op_domain", "csa2onnx_version"} <= set(meta)
    names = [n.name for n in model.graph.node]
    assert any(n.startswith("layer1/indexer/") for n in names)
    assert any(n.startswith("layer3/compressor/") for n in names)
    inputs = {i.name for i in model.graph.input}
    assert {"start_pos", "past.L1.index_k", "past.index_k_publisher", "x.L5"} <= inputs
    outputs = {o.name for o in model.graph.output}
    assert {"out.L0", "present.L1.compressor.kv_state", "present.L3.compress_kv"} <= outputs


def test_single_layer_export_takes_slots_as_inputs(tmp_path: Path) -> None:
    """case2 layer 3 alone (an index source using candidates): the compressed KV, the
    candidates and the index keys come in as slot inputs, filled here from the golden."""
    g = golden("case2_candidates")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args), 3, 3)
    export_stack(plan, from_golden(g.arrays, [3]), tmp_path)
    session = make_session(str(tmp_path / "prefill.onnx"))
    kv = g.step("prefill", 3, "attn_kv")[:, 77:]  # the compressed rows sparse_attn read
    block = g.model_args["candidate_block_size"]
    summary = describe(tmp_path)  # `inspect` names the slots a user must hand in
    assert "candidates: bool['batch', 'seq', 'candidate_width'] (the candidate source's kept " \
           f"blocks, a value a block of {block} compressed positions)" in summary
    assert "compress_kv: uint8" in summary and "index_k: uint8" in summary
    x = g.step("prefill", 3, "x")
    feeds = {
        "x.L3": x,
        "start_pos": np.zeros(1, np.int64),  # a first prefill ignores the ring it is given
        "past.L3.window_kv": np.zeros((x.shape[0], g.model_args["window_size"],
                                       g.model_args["head_dim"] * 33 // 32), np.uint8),
        "slot_in.compress_kv": pack_quantized(kv, "fp4_e4m3_16"),  # caches travel packed
        # the candidates travel a value a block (the golden records them a value a position)
        "slot_in.candidates": g.step("prefill", 1, "candidates")[..., ::block],
        "slot_in.index_k": pack_quantized(g.step("prefill", 1, "index_k_rows"), "fp4_e8m0_32"),
    }
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds),
                   strict=True))
    positions = dict(feeds, **{"slot_in.candidates": g.step("prefill", 1, "candidates")})
    with pytest.raises(Exception, match=r"Candidates must be \[b, s, ceil\(Width / "
                                        rf"candidate_block_size {block}\)\]"):
        session.run(None, positions)
    assert compare(out["out.L3"], g.step("prefill", 3, "out")).ok
    want = g.step("prefill", 3, "index_topk_idxs")
    np.testing.assert_array_equal(out["slot_out.topk_idxs"], want)


def test_cli_export_inspect_run_and_verify(tmp_path: Path, capsys) -> None:
    case = GOLDENS / "case3_r4_r128.json"
    out = tmp_path / "artifacts"
    assert cli(["export", str(case), "--weights", str(case), "--out", str(out),
                "--layers", "0-4"]) == 0
    assert cli(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "L1: ratio 128, kv source, index source, index-key owner" in text
    g = golden("case3_r4_r128")
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **{f"{s}.L{layer}.x": g.step(s, layer, "x") for s in ("prefill", "decode0")
                        for layer in range(5)})
    assert cli(["run", str(out), str(inputs), "--output", str(tmp_path / "o.npz")]) == 0
    with np.load(tmp_path / "o.npz") as z:
        assert compare(z["decode0.L2.out"], g.step("decode0", 2, "out")).ok
    capsys.readouterr()
    # np.savez adds .npz: the message names the file written; a missing folder fails first
    assert cli(["run", str(out), str(inputs), "--output", str(tmp_path / "o2")]) == 0
    assert f"to {tmp_path / 'o2.npz'}" in capsys.readouterr().out
    assert cli(["run", str(out), str(inputs), "--output", str(tmp_path / "no" / "o.npz")]) == 2
    assert f"no folder {tmp_path / 'no'}" in capsys.readouterr().err
    x = g.step("prefill", 0, "x")
    for arrays, message in [  # bad inputs files: one line naming the problem, exit 2
            ({"x.L0": x}, "array 'x.L0' is not named STEP.L{layer}.x"),
            ({f"prefill.L{layer}.x": x for layer in range(4)},
             r"step prefill has no array for layers \[4\]"),
            ({f"prefill.L{layer}.x": x for layer in range(6)},
             r"'prefill.L5.x' is for layer 5; the artifacts hold layers \[0, 1, 2, 3, 4\]"),
            ({}, "no arrays"),
            ({f"decode0.L{layer}.x": x[:, :1] for layer in range(5)},
             "decode called before any prefill")]:
        np.savez(tmp_path / "bad.npz", **arrays)
        assert cli(["run", str(out), str(tmp_path / "bad.npz"), "--output",
                    str(tmp_path / "bad_out.npz")]) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "bad_out.npz").exists()
    assert cli(["export", str(case), "--weights", str(case), "--out", str(tmp_path / "sub"),
                "--layers", "2-2"]) == 0
    with pytest.raises(RuntimeStateError, match="pass compress_kv, topk_idxs"):
        AttentionRuntime(tmp_path / "sub").prefill({2: g.step("prefill", 2, "x")})
    assert cli(["export", str(case), "--out", str(out)]) == 2  # no weights: a clear error
    assert "--weights is required" in capsys.readouterr().err
    assert cli(["export", str(case), "--weights", "random-fp8", "--out", str(out)]) == 2
    assert "random-fp8 is a bench option" in capsys.readouterr().err
    for option, message in [(["--layers", "2-"], "--layers: expected FIRST-LAST"),
                            (["--layers", "x"], "--layers: expected FIRST-LAST"),
                            (["--layers", "3-1"], "layers: range 3..1 is empty"),
                            (["--max-seq-len", "0"], "max_seq_len: must be > 0, got 0"),
                            (["--max-batch-size", "0"], "max_batch_size: must be > 0, got 0")]:
        assert cli(["export", str(case), "--weights", str(case), "--out",
                    str(tmp_path / "bad"), *option]) == 2, option
        assert message in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")  # found before the weights are read
    assert cli(["export", str(case), "--weights", str(case), "--out",
                str(tmp_path / "a_file")]) == 2
    assert f"--out {tmp_path / 'a_file'} is a file; give a folder" in capsys.readouterr().err
    for threads, message in [("-2", "must be >= 0, got -2"), ("x", "expected an integer, got 'x'")]:
        with pytest.raises(SystemExit):  # argparse's usage error
            cli(["verify", str(case), "--threads", threads])
        assert f"--threads: {message}" in capsys.readouterr().err


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A minimal safetensors writer (bf16 for bf16-valued weights, f32 otherwise)."""
    import json
    import struct

    import ml_dtypes

    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        f32_only = name.endswith(("attn_sink", "compressor.wkv.weight", "compressor.wgate.weight"))
        data = (value.astype(np.float32) if f32_only else value.astype(ml_dtypes.bfloat16))
        raw = data.tobytes()
        header[name] = {"dtype": "F32" if f32_only else "BF16", "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def test_safetensors_weights_export_the_same_model(tmp_path: Path) -> None:
    g = golden("case3_r4_r128")
    tensors = {f"layers.{layer}.attn.{name}": value for layer in range(6)
               for name, value in g.weights(layer).items()}
    _write_safetensors(tmp_path / "model.safetensors", tensors)
    case = str(GOLDENS / "case3_r4_r128.json")
    assert cli(["export", case, "--weights", str(tmp_path / "model.safetensors"),
                "--out", str(tmp_path / "st")]) == 0
    assert cli(["export", case, "--weights", case, "--out", str(tmp_path / "golden")]) == 0
    a = onnx.load(str(tmp_path / "st" / "prefill.onnx"))
    b = onnx.load(str(tmp_path / "golden" / "prefill.onnx"))
    assert {i.name: i.raw_data for i in a.graph.initializer} == {
        i.name: i.raw_data for i in b.graph.initializer}


def test_large_models_keep_weights_as_external_data(tmp_path: Path, monkeypatch) -> None:
    import csa2onnx.export.stack as stack

    monkeypatch.setattr(stack, "EXTERNAL_DATA_BYTES", 1)
    g = golden("case1_r2_r1")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args), 0, 1)
    export_stack(plan, from_golden(g.arrays, [0, 1]), tmp_path)
    data, graph = tmp_path / "weights.onnx.data", tmp_path / "prefill.onnx"  # both share it
    assert data.stat().st_size > graph.stat().st_size
    runtime = AttentionRuntime(tmp_path)
    # Layer 3 (outside) also owns index keys; layer 1 publishes its own before reading here.
    no_keys = {"index_k": np.zeros((1, 0, 34), np.uint8)}  # no packed rows (64 values: 34 B)
    xs = {layer: g.step("prefill", layer, "x") for layer in (0, 1)}
    # a slot of another type or rank, or one the sub-stack does not read: named (onnxruntime's
    # own error had named neither)
    with pytest.raises(ValueError, match=r"slot index_k: expected tensor\(uint8\) of rank 3 "
                                         r"\['batch', '\w+', 34\], got tensor\(float\) \[1, 34\]"):
        runtime.prefill(xs, slots={"index_k": np.zeros((1, 34), np.float32)})
    with pytest.raises(ValueError, match="slots compress_kv: this sub-stack does not read them "
                                         r"\(it reads index_k\)"):
        runtime.prefill(xs, slots={**no_keys, "compress_kv": np.zeros((1, 0, 72), np.uint8)})
    out = runtime.prefill(xs, slots=no_keys).out
    assert compare(out[1], g.step("prefill", 1, "out")).ok


@pytest.mark.parametrize("portable", [False, True])
def test_torch_linear_weights_are_stored_packed_except_in_portable(tmp_path: Path,
                                                                   portable: bool) -> None:
    """Every TorchLinear reads its weight in the kernel's panels64 layout, stored packed once
    in the artifact (wo_a as one weight of o_groups groups, one grouped node: no Split, no
    Concat), and nothing else holds it; a portable artifact keeps the plain [N, K] its
    MatMul body reads (wo_a's groups each their own). The manifest says which."""
    g = golden("case3_r4_r128")
    config = AttentionConfig.from_model_args(g.model_args)
    plan = plan_stack(config)
    weights = from_golden(g.arrays, range(6))
    export_stack(plan, weights, tmp_path, portable=portable)
    expected = set()  # the bytes of every TorchLinear weight as the artifact should hold it
    for layer in range(6):
        checked = check_layer(config, layer, weights[layer])
        for name, w in checked.items():
            if not name.endswith(".weight") or w.ndim != 2:
                continue
            groups = config.o_groups if name == "wo_a.weight" else 1
            if portable:
                expected |= {np.ascontiguousarray(p).tobytes() for p in np.split(w, groups)}
            else:
                expected.add(pack_panels(w, groups).panels.tobytes())
    for mode in ("prefill", "decode"):
        model = onnx.load(str(tmp_path / f"{mode}.onnx"))
        initializers = {t.name: t for t in model.graph.initializer}
        stored = set()
        linears = [n for n in model.graph.node if n.op_type == "TorchLinear"]
        for node in linears:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            w = initializers[node.input[1]]  # an initializer itself: no Slice, no Cast
            dtype = ml_dtypes.bfloat16 if w.data_type == onnx.TensorProto.BFLOAT16 else np.float32
            if portable:
                assert attrs == {} and len(w.dims) == 2
            else:
                assert attrs.keys() - {"round_output", "groups"} == {
                    "weight_layout", "out_features", "in_features"}
                assert attrs.get("round_output", 1) == 1  # present only to round (bf16)
                assert attrs["weight_layout"] == b"panels64"
                groups = attrs.get("groups", 1)
                assert groups == 1 or (groups, attrs["out_features"]) == (
                    config.o_groups, config.o_lora_rank)  # wo_a
                assert tuple(w.dims) == panels_shape(attrs["out_features"],
                                                     attrs["in_features"], np.dtype(dtype),
                                                     groups)
            stored.add(w.raw_data)
        assert stored == expected, mode
        others = {t.raw_data for t in model.graph.initializer
                  if t.name not in {n.input[1] for n in linears}}
        assert not others & expected  # no second copy of a weight in another layout
        if not portable:  # o's groups read and the result's written by the one wo_a node
            assert not [n.name for n in model.graph.node if "/output/" in n.name
                        and n.op_type in ("Split", "Concat")], mode
    formats = read_manifest(tmp_path).linear_formats["1"]
    assert formats["wq_a"] == ("bf16" if portable else "bf16/panels64")
    assert formats["compressor.wkv"] == ("f32" if portable else "f32/panels64")
