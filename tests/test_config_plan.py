"""Configuration loading/validation and the layer plan, on the goldens' layouts and on the
released V4.1-Flash layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import CASES, GOLDENS, golden

from csa2onnx.export.config import AttentionConfig, ConfigError
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.state_layout import StateLayout

RELEASED = Path(__file__).resolve().parents[1] / "export" / "configs" / "v41_flash_attention.json"


def released() -> AttentionConfig:
    return AttentionConfig.load(RELEASED)


def test_released_layout_plan() -> None:
    config = released()
    assert config.n_layers == 40 and config.dim == 5120 and config.rope_factor == 16
    assert config.original_seq_len == 65536 and config.window_size == 128
    plan = plan_stack(config)
    assert plan.owners == (2, 8, 14, 20)
    roles = {p.layer: p for p in plan.layers}
    assert [p.layer for p in plan.layers if not p.compressed] == [0, 1]
    assert roles[20].candidate_source and roles[20].owns_index_k and roles[20].ratio == 1
    assert [p.layer for p in plan.layers if p.uses_candidates] == [24, 28, 32, 36]
    assert all(roles[i].kv_from == 20 for i in range(20, 40))
    assert roles[13].kv_from == 8 and roles[13].topk_from == 8
    assert roles[25].topk_from == 24 and roles[39].topk_from == 36
    assert plan.external_slots() == ()
    layout = plan.state_layout()
    assert layout.get(2, "compressor.kv_state").shape() == ["batch", 2, 512]
    assert layout.get(20, "compressor.kv_state") is None  # ratio 1: no partial group
    assert layout.get(8, "index_k").width == 128  # values; stored packed: 64 + 4 bytes a row
    assert layout.get(8, "index_k").shape() == ["batch", 1048576 // 2, 68]
    assert layout.get(8, "index_k").in_place  # read at ratio 1 by layer 20 (the slot)
    assert layout.get(8, "index_k").read_ratio == 1
    assert layout.get(None, "index_k_publisher").dtype == "int64"
    assert layout.get(24, "index_k") is None and layout.get(3, "compress_kv") is None
    assert layout["L8.compress_kv"].input_name == "past.L8.compress_kv"
    assert StateLayout.from_json(layout.to_json()) == layout  # the manifest round trip


def test_hf_nested_text_config_and_overrides() -> None:
    data = json.loads(RELEASED.read_text())
    config = AttentionConfig.from_hf({"text_config": data}, max_seq_len=8192, max_batch_size=2)
    assert config.max_seq_len == 8192 and config.max_batch_size == 2
    assert config.compress_ratios == released().compress_ratios


@pytest.mark.parametrize("case", CASES)
def test_golden_roles_match_the_plan(case: str) -> None:
    g = golden(case)
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    for role in g.meta["layer_roles"]:
        p = plan.layer(role["layer"])
        assert p.ratio == role["compress_ratio"]
        assert p.kv_source == role["is_kv_source"]
        assert p.index_source == role["is_index_source"]
        assert p.owns_index_k == role.get("indexer_owns_k", False)
        assert p.candidate_source == role.get("is_candidate_source", False)
        assert p.uses_candidates == role.get("uses_candidates", False)


def test_single_layer_ranges_expose_external_slots() -> None:
    config = AttentionConfig.from_model_args(golden("case2_candidates").model_args)
    assert plan_stack(config, 1, 1).external_slots() == ()
    assert plan_stack(config, 3, 3).external_slots() == ("compress_kv", "candidates", "index_k")
    assert plan_stack(config, 2, 4).external_slots() == ("compress_kv", "topk_idxs",
                                                         "candidates", "index_k")


def base() -> AttentionConfig:
    return AttentionConfig.from_model_args(golden("case1_r2_r1").model_args)


@pytest.mark.parametrize(("change", "message"), [
    ({"kv_source_layers": (0,)}, "kv_source_layers: layer 0 has compress ratio 0"),
    ({"kv_source_layers": (1, 9)}, "kv_source_layers: layer 9 is out of range"),
    ({"kv_source_layers": (3,)}, "compressed layer 1 has no kv source"),
    ({"index_source_layers": (3,)}, "compressed layer 1 has no index source"),
    ({"candidate_source_layer": 2}, "candidate_source_layer: layer 2 is not an index source"),
    ({"candidate_source_layer": 1}, "candidate_topk_blocks: must be > 0"),
    # upstream masks layer 3's scores (ratio 1) with layer 1's candidates (ratio 2): shapes
    # that do not broadcast; a mask of blocks could even match and be silently wrong
    ({"candidate_source_layer": 1, "candidate_topk_blocks": 2, "candidate_block_size": 4},
     "compress_ratios: index source 3 selects inside candidate source 1's candidates"),
    ({"compress_ratios": (0, 2, 2, 1, -1, 0)}, "ratio -1 < 0"),
    ({"compress_ratios": (0, 2, 2, 1)}, "compress_ratios: has 4 entries for n_layers=6"),
    ({"o_groups": 3}, "o_groups: 3 does not divide"),
    ({"head_dim": 120}, "head_dim: must be a multiple of 32"),
    ({"rope_head_dim": 31}, "rope_head_dim: must be even"),
    ({"index_topk": 0}, "index_topk: must be > 0"),
    ({"index_head_dim": 48}, "index_head_dim: must be a multiple of 32"),
    ({"window_size": 0}, "window_size: must be > 0"),
    ({"max_seq_len": 2**63}, "max_seq_len: must fit in int64"),  # had failed in the exporter
    ({"index_topk": 2**63}, "index_topk: must fit in int64"),
])
def test_invalid_configs_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(base(), **change)


@pytest.mark.parametrize(("text", "message"), [
    ("{bad", r"not valid JSON \(Expecting property name"),  # had been json's bare message
    ("[1, 2]", "a config is a JSON object, got a list"),
    ('{"dim": 8}', "missing config field"),  # field errors name the file too (once)
])
def test_config_file_errors_name_the_file_once(tmp_path: Path, text: str, message: str) -> None:
    from csa2onnx.export.checkpoint import open_checkpoint

    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}: {message}") as error:
        AttentionConfig.load(path)
    assert str(error.value).count(str(path)) == 1
    with pytest.raises(ConfigError) as error:  # a model folder's config: named once, not twice
        open_checkpoint(tmp_path)
    assert str(error.value).count(str(path)) == 1


def test_unknown_fields_are_errors() -> None:
    args = dict(golden("case1_r2_r1").model_args)
    with pytest.raises(ConfigError, match=r"unknown config field.*compress_ratio_typo"):
        AttentionConfig.from_model_args({**args, "compress_ratio_typo": 1})
    with pytest.raises(ConfigError, match=r"unknown Hugging Face config field.*hiden_size"):
        AttentionConfig.from_hf({**json.loads(RELEASED.read_text()), "hiden_size": 1})
    with pytest.raises(ConfigError, match=r"missing config field.*dim"):
        AttentionConfig.from_model_args({k: v for k, v in args.items() if k != "dim"})


def test_layer_range_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"outside 0\.\.5"):
        plan_stack(base(), 2, 6)
    with pytest.raises(ConfigError, match=r"range 3\.\.1 is empty"):
        plan_stack(base(), 3, 1)


def test_golden_json_loads_as_config() -> None:
    config = AttentionConfig.load(GOLDENS / "case3_r4_r128.json")
    assert config.compress_ratios == (0, 128, 128, 4, 4, 0) and config.original_seq_len == 65536


# ------------------------------------------------------------------- weight precision
FP8_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def released_hf() -> dict:
    return json.loads(RELEASED.read_text())


def test_released_config_is_fp8() -> None:
    assert released().weight_format == "fp8"


@pytest.mark.parametrize(("dtype", "expected"), [("bf16", "bf16"), ("fp8", "fp8"),
                                                 (None, "fp8")])
def test_model_args_dtype(dtype: str | None, expected: str) -> None:
    args = {k: v for k, v in golden("case1_r2_r1").model_args.items() if k != "dtype"}
    if dtype is not None:
        args["dtype"] = dtype
    # without dtype: upstream's ModelArgs default, the released fp8 checkpoint
    assert AttentionConfig.from_model_args(args).weight_format == expected


@pytest.mark.parametrize("dtype", ["fp4", "bfloat16", None])
def test_model_args_other_dtypes_are_errors(dtype: object) -> None:
    args = {**golden("case1_r2_r1").model_args, "dtype": dtype}
    with pytest.raises(ConfigError, match=r"^dtype: must be 'bf16' or 'fp8'"):
        AttentionConfig.from_model_args(args)


def test_golden_cases_keep_their_precision() -> None:
    assert base().weight_format == "bf16"
    assert AttentionConfig.load(GOLDENS / "case3_r4_r128.json").weight_format == "bf16"
    assert AttentionConfig.load(GOLDENS / "case5_fp8.json").weight_format == "fp8"


@pytest.mark.parametrize(("fields", "expected"), [
    ({"quantization_config": FP8_QUANT}, "fp8"),
    ({"quantization_config": FP8_QUANT, "dtype": "bfloat16"}, "fp8"),
    ({"quantization_config": FP8_QUANT, "torch_dtype": "bfloat16"}, "fp8"),
    ({"quantization_config": {k: v for k, v in FP8_QUANT.items()
                              if k not in ("activation_scheme", "expert_dtype")}}, "fp8"),
    ({"quantization_config": {**FP8_QUANT, "weight_block_size": (32, 32)}}, "fp8"),
    ({}, "bf16"),
    ({"dtype": "bfloat16"}, "bf16"),
    ({"torch_dtype": "bfloat16"}, "bf16"),
])
def test_hf_precision(fields: dict, expected: str) -> None:
    data = {k: v for k, v in released_hf().items()
            if k not in ("quantization_config", "dtype")}
    assert AttentionConfig.from_hf({**data, **fields}).weight_format == expected
    # a nested text_config; quantization_config may sit beside it (multimodal layout)
    nested = {"text_config": data, **fields}
    assert AttentionConfig.from_hf(nested).weight_format == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"quant_method": "fp4"}, "quantization_config.quant_method: only 'fp8'"),
    ({"quant_method": None}, "quantization_config.quant_method"),
    ({"weight_block_size": [128, 128]}, "quantization_config.weight_block_size: only"),
    ({"weight_block_size": [32]}, "quantization_config.weight_block_size"),
    ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt: only 'ue8m0'"),
    ({"activation_scheme": "static"}, "quantization_config.activation_scheme: only 'dynamic'"),
    ({"fmt": "e4m3"}, r"quantization_config: unknown field\(s\) fmt"),
])
def test_hf_quantization_errors_name_the_field(fields: dict, message: str) -> None:
    data = {**released_hf(), "quantization_config": {**FP8_QUANT, **fields}}
    with pytest.raises(ConfigError, match=message):
        AttentionConfig.from_hf(data)


def test_hf_quantization_config_missing_fields_and_other_dtypes() -> None:
    missing = {k: v for k, v in FP8_QUANT.items() if k != "scale_fmt"}
    with pytest.raises(ConfigError, match=r"quantization_config.scale_fmt: missing"):
        AttentionConfig.from_hf({**released_hf(), "quantization_config": missing})
    with pytest.raises(ConfigError, match=r"quantization_config: must be an object"):
        AttentionConfig.from_hf({**released_hf(), "quantization_config": "fp8"})
    for key in ("dtype", "torch_dtype"):
        with pytest.raises(ConfigError, match=rf"^{key}: must be 'bfloat16'"):
            AttentionConfig.from_hf({**released_hf(), key: "float16"})


def test_weight_format_override_and_validation() -> None:
    assert AttentionConfig.load(RELEASED, weight_format="bf16").weight_format == "bf16"
    with pytest.raises(ConfigError, match=r"weight_format: must be 'bf16' or 'fp8'"):
        replace(base(), weight_format="fp4")
