"""The checkpoint side: the per-layer tensor table (shapes and stored dtypes), check_layer's
exact conversions, the safetensors reader/writer, Hugging Face model folders (sharded and
single-file, as tools/make_checkpoint.py writes them), `csa2onnx export MODEL_DIR`, and the
reader's memory: only the exported layers' attention tensors are ever paged in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from helpers import CASES, GOLDENS, golden

from csa2onnx.export.artifacts import read_manifest
from csa2onnx.export.checkpoint import INDEX, SINGLE, CheckpointError, open_checkpoint
from csa2onnx.export.cli import main
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.goldens import load_case
from csa2onnx.export.plan import plan_layer
from csa2onnx.export.safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors
from csa2onnx.export.weights import (
    BF16,
    E4M3,
    E8M0,
    F32,
    WeightsError,
    as_float32,
    check_layer,
    expected_tensors,
    from_golden,
    from_safetensors,
    linear_formats,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from make_checkpoint import make_checkpoint  # noqa: E402

from csa2onnx.export.synthetic import attention_tensors, quantize_fp8  # noqa: E402

CASE1 = GOLDENS / "case1_r2_r1.json"
RELEASED_HF = ROOT / "export" / "configs" / "v41_flash_attention.json"
FP8_CASE = Path(__file__).resolve().parents[1] / "goldens" / "case5_fp8.json"


def fp8_config() -> AttentionConfig:
    return replace(AttentionConfig.from_model_args(golden("case1_r2_r1").model_args),
                   weight_format="fp8")


# ------------------------------------------------------------------------------ the table
@pytest.mark.parametrize("path", [GOLDENS / f"{c}.json" for c in CASES] + [
    FP8_CASE])
def test_table_is_the_goldens_parameter_dtypes(path: Path) -> None:
    meta = json.loads(path.read_text())
    config = AttentionConfig.from_model_args(meta["model_args"])
    table = {f"L{layer}.{name}": spec.dtype.name for layer in range(config.n_layers)
             for name, spec in expected_tensors(config, plan_layer(config, layer)).items()}
    assert table == meta["parameter_dtypes"]


def test_fp8_table_shapes_and_formats() -> None:
    config = fp8_config()
    tensors = expected_tensors(config, plan_layer(config, 1))
    assert tensors["wq_b.weight"].shape == (512, 128) and tensors["wq_b.weight"].dtype == E4M3
    assert tensors["wq_b.scale"].shape == (16, 4) and tensors["wq_b.scale"].dtype == E8M0
    assert tensors["wq_b.scale"].loaded_dtype == F32
    assert tensors["indexer.weights_proj.weight"].dtype == BF16
    small = replace(config, n_heads=1, o_groups=1, q_lora_rank=40)  # partial scale blocks
    assert expected_tensors(small, plan_layer(small, 0))["wq_a.scale"].shape == (2, 8)
    portable = linear_formats(config, plan_layer(config, 3), portable=True)
    assert portable == {"wq_a": "fp8-e4m3/32x32-ue8m0", "wq_b": "fp8-e4m3/32x32-ue8m0",
                        "wkv": "fp8-e4m3/32x32-ue8m0", "wo_a": "bf16",
                        "wo_b": "fp8-e4m3/32x32-ue8m0", "compressor.wkv": "bf16",
                        "indexer.wq_b": "fp8-e4m3/32x32-ue8m0", "indexer.weights_proj": "bf16",
                        "indexer.wk": "bf16"}
    # TorchLinear's weights are stored in its kernel's panels, Fp8Linear's as k-pairs of 16
    # columns (exact numerics), except in portable artifacts
    layouts = {True: "pairs16", False: "panels64"}
    assert linear_formats(config, plan_layer(config, 3)) == {
        k: f"{v}/{layouts[v.startswith('fp8')]}" for k, v in portable.items()}
    assert linear_formats(config, plan_layer(config, 3), numerics="fast") == {
        k: v if v.startswith("fp8") else f"{v}/panels64" for k, v in portable.items()}
    odd = replace(config, q_lora_rank=40)  # wq_a's N: not a multiple of 16, so plain
    assert linear_formats(odd, plan_layer(odd, 3))["wq_a"] == "fp8-e4m3/32x32-ue8m0"


# ---------------------------------------------------------------------------- check_layer
def test_golden_bf16_weights_keep_stored_dtypes() -> None:
    g = golden("case1_r2_r1")
    config = AttentionConfig.from_model_args(g.model_args)
    raw = from_golden(g.arrays, [1])[1]
    checked = check_layer(config, 1, raw)
    assert checked["wq_a.weight"].dtype == BF16 and checked["attn_sink"].dtype == F32
    assert checked["compressor.wkv.weight"].dtype == F32
    for name, value in as_float32(checked).items():  # what the graphs get: as before
        assert value.dtype == F32 and np.array_equal(value, raw[name])


def test_golden_fp8_weights_convert_exactly() -> None:
    case = load_case(FP8_CASE)
    config = AttentionConfig.from_model_args(case.model_args)
    for layer in range(config.n_layers):
        raw = from_golden(case.arrays, [layer])[layer]
        checked = check_layer(config, layer, raw)
        assert checked["wq_a.weight"].dtype == E4M3 and checked["wq_a.scale"].dtype == F32
        assert checked["wo_a.weight"].dtype == BF16
        for name, value in as_float32(checked).items():
            assert np.array_equal(value, raw[name]), name


def bf16_layer0() -> dict[str, np.ndarray]:
    return dict(from_golden(golden("case1_r2_r1").arrays, [0])[0])


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: w.pop("wkv.weight"), r"layer 0: missing weights wkv\.weight"),
    (lambda w: w.update({"wkv.scale": np.ones((4, 8), np.float32)}),
     r"layer 0: unexpected weights wkv\.scale"),
    (lambda w: w.update({"wkv.weight": np.zeros((128, 255), np.float32)}),
     r"layer 0: wkv\.weight \(in shard-1\.safetensors\) has shape \(128, 255\), expected"),
    (lambda w: w.update({"wo_a.weight": w["wo_a.weight"] + np.float32(1e-5)}),
     r"layer 0: wo_a\.weight \(in shard-1\.safetensors\) holds float32 values that are not "
     r"exactly bfloat16"),
    (lambda w: w.update({"attn_sink": np.arange(4, dtype=np.int32)}),
     r"attn_sink .*has dtype int32, expected float32"),
])
def test_check_layer_errors_name_layer_tensor_and_file(change, message: str) -> None:
    weights = bf16_layer0()
    change(weights)
    config = AttentionConfig.from_model_args(golden("case1_r2_r1").model_args)
    with pytest.raises(WeightsError, match=message):
        check_layer(config, 0, weights, dict.fromkeys(weights, "shard-1.safetensors"))


def fp8_layer0(config: AttentionConfig) -> dict[str, np.ndarray]:
    return make_layer(config, 0)


def make_layer(config: AttentionConfig, layer: int) -> dict[str, np.ndarray]:
    return attention_tensors(config, layer, np.random.default_rng(0))


def test_check_layer_fp8_conversions() -> None:
    config = fp8_config()
    stored = fp8_layer0(config)
    checked = check_layer(config, 0, stored)
    assert checked["wq_a.weight"] is stored["wq_a.weight"]  # stored dtype: not copied
    scale_bytes = stored["wq_a.scale"].view(np.uint8).astype(np.int32)
    assert np.array_equal(checked["wq_a.scale"], np.ldexp(np.float32(1), scale_bytes - 127))
    # float32 arrays of the same values (the goldens' form) convert exactly
    as_f32 = check_layer(config, 0, as_float32(stored))
    for name in stored:
        assert np.array_equal(as_float32(as_f32)[name], as_float32(checked)[name])
    # bf16 weights in an fp8 config: scales missing
    bf16_config = replace(config, weight_format="bf16")
    with pytest.raises(WeightsError, match=r"missing weights .*wq_a\.scale"):
        check_layer(config, 0, check_layer(bf16_config, 0, make_layer(bf16_config, 0)))


@pytest.mark.parametrize(("name", "value", "message"), [
    ("wq_a.weight", lambda w: as_float32({"w": w})["w"] * np.float32(1.0625),
     r"wq_a\.weight holds float32 values that are not exactly float8_e4m3fn values; fp8"),
    ("wq_a.weight", lambda w: w.astype(np.float32).astype(BF16) * ml_dtypes.bfloat16(1.0625),
     r"not exactly float8_e4m3fn"),
    ("wq_a.scale", lambda s: np.full(s.shape, 0.75, np.float32),
     r"wq_a\.scale: scales must be positive powers of two"),
    ("wq_a.scale", lambda s: np.full(s.shape, -0.5, np.float32), r"powers of two"),
    ("wq_a.scale", lambda s: np.full(s.shape, 255, np.uint8).view(E8M0), r"NaN \(byte 0xff\)"),
    ("wq_a.scale", lambda s: s.view(np.uint8), r"has dtype uint8, expected ue8m0"),
])
def test_check_layer_fp8_errors(name: str, value, message: str) -> None:
    config = fp8_config()
    weights = fp8_layer0(config)
    weights[name] = value(weights[name])
    with pytest.raises(WeightsError, match=message):
        check_layer(config, 0, weights)


def test_e8m0_scales_convert_exactly() -> None:
    config = fp8_config()
    weights = fp8_layer0(config)
    shape = weights["wq_a.scale"].shape
    codes = np.resize(np.array([0, 1, 100, 126, 127, 128, 200, 254], np.uint8), shape)
    weights["wq_a.scale"] = codes.view(E8M0)
    scale = check_layer(config, 0, weights)["wq_a.scale"]
    assert np.array_equal(scale, np.ldexp(np.float64(1), codes.astype(np.int32) - 127))
    assert scale.dtype == F32 and scale.min() == np.float32(2.0 ** -127)


def test_quantize_fp8_blocks() -> None:
    w = np.random.default_rng(1).standard_normal((70, 40), np.float32)
    w[:32, :32] *= 1000  # one block with a large range
    q, s = quantize_fp8(w)
    assert q.dtype == E4M3 and s.dtype == E8M0 and s.shape == (3, 2)
    scale = np.repeat(np.repeat(s.astype(np.float32), 32, 0), 32, 1)[:70, :40]
    back = q.astype(np.float32) * scale
    assert np.abs(q.astype(np.float32)).max() <= 448
    assert np.allclose(back, w, rtol=2 ** -3, atol=scale.max() * 2 ** -9)


# -------------------------------------------------------------------- safetensors format
def test_safetensors_round_trip_is_lazy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(BF16),
               "b": rng.standard_normal(7).astype(np.float16),
               "c": rng.standard_normal((2, 2)).astype(np.float32),
               "d": rng.standard_normal((4, 33)).astype(E4M3),
               "e": np.arange(120, 126, dtype=np.uint8).view(E8M0),
               "empty": np.zeros((0, 4), np.float32)}
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    file = SafetensorsFile(path)
    assert file.metadata == {"format": "pt"} and list(file.entries) == list(tensors)
    for name, value in tensors.items():
        read = file.tensor(name)
        assert read.dtype == value.dtype and read.shape == value.shape
        assert np.array_equal(read.view(np.uint8), value.view(np.uint8))
        if value.size:
            assert not read.flags.writeable and not read.flags.owndata  # a view of the map


def test_safetensors_package_reads_our_files(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_safetensors(path, {"w": value, "h": value.astype(np.float16)})
    loaded = safetensors.load_file(str(path))
    assert np.array_equal(loaded["w"], value) and loaded["h"].dtype == np.float16


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[:5], r"not a safetensors file \(5 bytes"),
    (lambda b: (10 ** 6).to_bytes(8, "little") + b[8:], r"truncated or not safetensors"),
    (lambda b: b[:8] + b"!" + b[9:], r"header is not valid JSON"),
    (lambda b: b[:-3], r"truncated: w ends at byte"),
])
def test_damaged_safetensors_are_clear_errors(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": np.ones((4, 4), np.float32)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message):
        SafetensorsFile(path)


# ---------------------------------------------------------------------- model folders
@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(CASE1, tmp_path_factory.mktemp("fp8"), dtype="fp8", shards=3,
                           seed=5)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(CASE1, tmp_path_factory.mktemp("bf16"), dtype="bf16", shards=1,
                           prefix="model.", seed=6)


def test_sharded_fp8_folder(fp8_folder: Path) -> None:
    assert (fp8_folder / INDEX).is_file() and len(list(fp8_folder.glob("model-*"))) == 3
    checkpoint = open_checkpoint(fp8_folder, max_seq_len=256)
    config = checkpoint.config
    assert config.weight_format == "fp8" and config.max_seq_len == 256
    index = json.loads((fp8_folder / INDEX).read_text())["weight_map"]
    for layer in range(config.n_layers):
        weights = checkpoint.read_layer(layer)
        table = expected_tensors(config, plan_layer(config, layer))
        assert {k: v.dtype for k, v in weights.items()} == {
            k: s.loaded_dtype for k, s in table.items()}
        name = f"layers.{layer}.attn.wkv.weight"
        stored = SafetensorsFile(fp8_folder / index[name]).tensor(name)
        assert np.array_equal(weights["wkv.weight"].view(np.uint8), stored.view(np.uint8))


def test_single_file_folder_with_model_prefix(bf16_folder: Path) -> None:
    assert (bf16_folder / SINGLE).is_file() and not (bf16_folder / INDEX).exists()
    checkpoint = open_checkpoint(bf16_folder)
    assert checkpoint.config.weight_format == "bf16"
    weights = checkpoint.read_layers([1, 3])
    assert weights[1]["wq_a.weight"].dtype == BF16
    assert weights[3]["compressor.wkv.weight"].dtype == BF16  # ratio 1
    # the file-list path (config file + --weights) reads the same tensors
    listed = from_safetensors([bf16_folder / SINGLE], [1])[1]
    assert all(np.array_equal(listed[k], v) for k, v in weights[1].items())


def hand_folder(tmp_path: Path, tensors: dict[str, np.ndarray], name: str = SINGLE) -> Path:
    (tmp_path / "config.json").write_text(CASE1.read_text())  # bf16 ModelArgs
    write_safetensors(tmp_path / name, tensors)
    return tmp_path


def layer_tensors(layer: int) -> dict[str, np.ndarray]:
    config = AttentionConfig.load(CASE1)
    return {f"layers.{layer}.attn.{k}": v for k, v in make_layer(config, layer).items()}


def test_folder_errors(tmp_path: Path, fp8_folder: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(CASE1.read_text())
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors\.index\.json nor "
                                              r"model\.safetensors"):
        open_checkpoint(tmp_path)
    index = json.loads((fp8_folder / INDEX).read_text())
    index["weight_map"]["layers.9.ffn.w"] = "model-00009-of-00009.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names shard\(s\) that are not in .*"
                                              r"model-00001-of-00003.*model-00009-of-00009"):
        open_checkpoint(tmp_path)
    (tmp_path / INDEX).write_text("{}")
    with pytest.raises(CheckpointError, match=r"not a safetensors index"):
        open_checkpoint(tmp_path)


def test_truncated_shard_is_a_clear_error(tmp_path: Path, fp8_folder: Path) -> None:
    for path in fp8_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    shard = tmp_path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    checkpoint = open_checkpoint(tmp_path)  # names only: no shard is opened yet
    checkpoint.read_layer(0)  # shard 1: fine
    with pytest.raises(SafetensorsError, match=r"model-00002-of-00003.*truncated"):
        checkpoint.read_layer(2)


def test_missing_extra_and_mistyped_attention_tensors(tmp_path: Path) -> None:
    tensors = {**layer_tensors(0), **layer_tensors(1)}
    del tensors["layers.1.attn.kv_norm.weight"]
    tensors["layers.0.attn.extra.weight"] = np.ones(4, BF16)
    tensors["layers.2.attn.wq_a.weight"] = np.ones(4, np.int8)  # another layer: never read
    tensors["layers.1.ffn.experts.0.w1.weight"] = np.ones(4, np.int8)  # not attention
    checkpoint = open_checkpoint(hand_folder(tmp_path, tensors))
    with pytest.raises(CheckpointError, match=r"layer 1: missing weights kv_norm\.weight"):
        checkpoint.read_layer(1)
    with pytest.raises(CheckpointError, match=r"layer 0: unexpected weights extra\.weight"):
        checkpoint.read_layer(0)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: layers\.2\.attn\.wq_a\."
                                              r"weight has dtype I8"):
        checkpoint.read_layer(2)
    with pytest.raises(CheckpointError, match=r"layer 7 is outside 0\.\.5"):
        checkpoint.read_layer(7)


def test_wrong_shape_names_the_file(tmp_path: Path) -> None:
    tensors = layer_tensors(0)
    tensors["layers.0.attn.wkv.weight"] = np.ones((128, 64), BF16)
    checkpoint = open_checkpoint(hand_folder(tmp_path, tensors))
    with pytest.raises(CheckpointError, match=r"layer 0: wkv\.weight \(in model\.safetensors\) "
                                              r"has shape \(128, 64\)"):
        checkpoint.read_layer(0)


def test_fp8_config_over_bf16_tensors_is_an_error(tmp_path: Path) -> None:
    folder = hand_folder(tmp_path, layer_tensors(0))
    config = json.loads(CASE1.read_text())["model_args"]
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "fp8"}))
    with pytest.raises(CheckpointError, match=r"layer 0: missing weights .*wq_a\.scale.*"
                                              r"weight_format fp8"):
        open_checkpoint(folder).read_layer(0)


# ------------------------------------------------------------------------------- the CLI
def test_cli_exports_a_bf16_model_folder(bf16_folder: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "artifacts"
    assert main(["export", str(bf16_folder), "--out", str(out), "--layers", "3-3"]) == 0
    manifest = read_manifest(out)
    assert manifest.config["weight_format"] == "bf16"
    assert manifest.linear_formats == {"3": {
        name: "bf16/panels64" for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b",
                                           "compressor.wkv", "indexer.wq_b",
                                           "indexer.weights_proj", "indexer.wk")}}
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "linears: wq_a bf16/panels64, wq_b bf16/panels64" in capsys.readouterr().out


def test_cli_exports_an_fp8_model_folder(fp8_folder: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    """fp8 linears stay e4m3 in the artifact (1 byte a weight) beside their block scales."""
    out = tmp_path / "a"
    assert main(["export", str(fp8_folder), "--out", str(out), "--layers", "0"]) == 0
    model = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    fp8 = {i.name: i for i in model.graph.initializer
           if i.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    assert len(fp8) == 4, list(fp8)  # wq_a, wq_b, wkv, wo_b of a window-only layer
    assert all(len(i.dims) == 3 and i.dims[2] == 512 for i in fp8.values())  # pairs16
    nodes = [n for n in model.graph.node if n.op_type == "Fp8Linear"]
    assert len(nodes) == 4
    for n in nodes:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attributes.get("weight_layout") == b"pairs16", n.name
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "wq_a fp8-e4m3/32x32-ue8m0/pairs16" in capsys.readouterr().out
    assert main(["export", str(fp8_folder), "--weights", "w.safetensors", "--out",
                 str(tmp_path / "b")]) == 2
    assert "is a model folder, which holds its weights" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "c")]) == 2
    assert "no config.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------- memory
_MEASURE = """
import sys
import numpy as np
from csa2onnx.export.checkpoint import open_checkpoint
from csa2onnx.export.weights import as_float32

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

checkpoint = open_checkpoint(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the peak from here on
before = status("VmRSS:")
total = 0.0
for layer, weights in checkpoint.read_layers([1, 3]).items():
    total += sum(float(np.abs(v).sum()) for v in as_float32(weights).values())  # touch all
print(before, status("VmRSS:"), status("VmHWM:"), total)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc")
def test_reading_touches_only_attention_tensors(tmp_path: Path) -> None:
    filler_mib = 256
    folder = make_checkpoint(CASE1, tmp_path, layers=range(1, 4), dtype="fp8", shards=1,
                             filler_mib=filler_mib)
    size = (folder / SINGLE).stat().st_size
    assert size > 3 * filler_mib << 20  # each layer's tensors sit between large fillers
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], check=True,
                            capture_output=True, text=True, env={**os.environ})
    before, after, peak, _ = (float(v) for v in result.stdout.split())
    # the layers' attention tensors are ~2 MiB (f32 copies included); the file is 768 MiB
    assert after - before < 24 << 20, (before, after)
    assert peak - before < 24 << 20, (before, peak)



def test_narrower_floats_widen_exactly() -> None:
    g = golden("case1_r2_r1")
    config = AttentionConfig.from_model_args(g.model_args)
    weights = from_golden(g.arrays, [1])[1]
    weights["compressor.wkv.weight"] = weights["compressor.wkv.weight"].astype(BF16)  # f32 slot
    weights["wo_a.weight"] = weights["wo_a.weight"].astype(np.float64)  # bf16 slot
    checked = check_layer(config, 1, weights)
    assert checked["compressor.wkv.weight"].dtype == F32 and checked["wo_a.weight"].dtype == BF16


def test_index_placing_a_tensor_in_the_wrong_shard(tmp_path: Path, fp8_folder: Path) -> None:
    for path in fp8_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["layers.0.attn.wkv.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"places layers\.0\.attn\.wkv\.weight in "
                                              r"model-00003-of-00003\.safetensors, which does"):
        open_checkpoint(tmp_path).read_layer(0)


def test_cli_config_file_with_safetensors_still_works(bf16_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "artifacts"
    assert main(["export", str(CASE1), "--weights", str(bf16_folder / SINGLE), "--out",
                 str(out), "--layers", "0-1"]) == 0
    assert read_manifest(out).layers == [0, 1]


def test_make_checkpoint_command_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import make_checkpoint as tool

    small = {**json.loads(RELEASED_HF.read_text()), "hidden_size": 256,
             "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 32,
             "q_lora_rank": 128, "o_lora_rank": 64, "o_groups": 2, "index_n_heads": 4,
             "index_head_dim": 64, "max_position_embeddings": 4096}  # the release's layout
    source = tmp_path / "small.json"
    source.write_text(json.dumps(small))
    out = tmp_path / "model"
    assert tool.main([str(source), "--out", str(out), "--layers", "0-2", "--dtype", "bf16",
                      "--shards", "2", "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["hidden_size"] == 256
    checkpoint = open_checkpoint(out)
    assert checkpoint.config.weight_format == "bf16"
    assert len(set(json.loads((out / INDEX).read_text())["weight_map"].values())) == 2
    assert checkpoint.read_layer(2)["compressor.wgate.weight"].dtype == F32
    with pytest.raises(CheckpointError, match=r"layer 3: missing weights attn_sink"):
        checkpoint.read_layer(3)  # not written
