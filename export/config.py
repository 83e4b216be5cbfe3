"""The attention configuration, read from the reference's ModelArgs names, an upstream
inference config.json, or a Hugging Face config.json, and validated before anything is built.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot describe a DeepSeek-V4.1 attention stack."""


# ModelArgs fields that do not concern attention (MoE, vision, MTP, ...): accepted, ignored.
_MODEL_ARGS_IGNORED = frozenset({
    "temperature", "expert_dtype", "vocab_size", "moe_inter_dim", "n_mtp_layers",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "gate_temp",
    "norm_topk_prob", "route_scale", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_pad_id", "engram_compressed_vocab_size",
    "vision_n_layers", "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
    "vision_rope_theta", "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels",
    "vision_max_wh_ratio", "image_token_id", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_n_activated_experts", "n_dense_layers", "n_expert_groups", "n_limited_groups",
    "scale_fmt", "first_k_dense_replace", "q_lora", "kv_lora_rank",
})

# Hugging Face text_config names -> ModelArgs names.
_HF_NAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank", "o_groups": "o_groups", "rms_norm_eps": "norm_eps",
    "max_position_embeddings": "max_seq_len", "rope_theta": "rope_theta",
    "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "max_batch_size": "max_batch_size",
}
_HF_ROPE_SCALING = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                    "original_max_position_embeddings": "original_seq_len"}
# Hugging Face fields with no bearing on attention: accepted, ignored.
_HF_IGNORED = frozenset({
    "num_key_value_heads", "architectures",
    "model_type", "transformers_version", "vocab_size", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "initializer_range", "hidden_act",
    "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
    "topk_method", "n_group", "topk_group", "first_k_dense_replace", "num_nextn_predict_layers",
    "use_cache", "attention_bias", "attention_dropout", "auto_map", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "ep_size", "moe_layer_freq", "rope_type",
})

# The one fp8 weight layout the release uses (and upstream's kernels implement): e4m3 weights
# with one power-of-two (ue8m0) scale per [32, 32] block.
WeightFormat = Literal["bf16", "fp8"]
FP8_BLOCK_SIZE = 32
FP8_SCALE_FMT = "ue8m0"
# Upstream's ModelArgs.dtype default: a ModelArgs dict without `dtype` is the released fp8 model.
MODEL_ARGS_DEFAULT_DTYPE = "fp8"


@dataclass(frozen=True)
class AttentionConfig:
    """The attention-relevant ModelArgs fields (names as in the reference)."""

    dim: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    n_layers: int = -1  # -1: len(compress_ratios)
    norm_eps: float = 1e-6
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    original_seq_len: int = 0
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    max_seq_len: int = 4096
    max_batch_size: int = 1
    # Storage of the linears upstream builds with the default dtype (wq_a, wq_b, wkv, wo_b,
    # indexer.wq_b): ModelArgs.dtype, or a Hugging Face quantization_config.
    weight_format: WeightFormat = MODEL_ARGS_DEFAULT_DTYPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        object.__setattr__(self, "kv_source_layers", tuple(int(i) for i in self.kv_source_layers))
        object.__setattr__(self, "index_source_layers",
                           tuple(int(i) for i in self.index_source_layers))
        if self.n_layers == -1:
            object.__setattr__(self, "n_layers", len(self.compress_ratios))
        self.validate()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_model_args(cls, args: dict[str, Any], **overrides: Any) -> AttentionConfig:
        """From the reference's ModelArgs names (goldens' model_args, inference config.json).

        `dtype` ("bf16" | "fp8") sets weight_format; without it the config is upstream's
        ModelArgs default, fp8 (the released checkpoint's precision)."""
        known = {f.name for f in fields(cls)} - {"weight_format"}
        unknown = sorted(set(args) - known - _MODEL_ARGS_IGNORED - {"dtype"})
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        values = {k: v for k, v in args.items() if k in known}
        values["weight_format"] = _model_args_dtype(args.get("dtype", MODEL_ARGS_DEFAULT_DTYPE))
        return cls._build({**values, **overrides})

    @classmethod
    def from_hf(cls, config: dict[str, Any], **overrides: Any) -> AttentionConfig:
        """From a Hugging Face config.json (its text_config when nested). The fp8 linears
        come from `quantization_config` (beside or inside text_config); without one they are
        bf16. `dtype` / `torch_dtype`, the other tensors' dtype, must be bfloat16."""
        outer = config
        config = config.get("text_config", config)
        values: dict[str, Any] = {}
        unknown = []
        quantization = config.get("quantization_config", outer.get("quantization_config"))
        values["weight_format"] = _hf_weight_format(quantization)
        for key, value in config.items():
            if key.startswith("_") or key in _HF_IGNORED or key == "quantization_config":
                continue
            if key in ("dtype", "torch_dtype"):
                _hf_torch_dtype(key, value)
            elif key == "rope_scaling":
                values.update(_hf_rope_scaling(value))
            elif key in _HF_NAMES:
                values[_HF_NAMES[key]] = value
            else:
                unknown.append(key)
        if unknown:
            raise ConfigError(f"unknown Hugging Face config field(s): {', '.join(sorted(unknown))}")
        return cls._build({**values, **overrides})

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> AttentionConfig:
        """A config.json of either naming, or a golden case's JSON (its model_args); every
        error names the file."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config is a JSON object, got a {type(data).__name__}")
        try:
            if "model_args" in data:
                return cls.from_model_args(data["model_args"], **overrides)
            if "text_config" in data or "hidden_size" in data:
                return cls.from_hf(data, **overrides)
            return cls.from_model_args(data, **overrides)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None

    @classmethod
    def _build(cls, values: dict[str, Any]) -> AttentionConfig:
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ConfigError(f"missing config field(s): {', '.join(missing)}")
        n_layers = int(values.get("n_layers", -1))
        ratios = list(values["compress_ratios"])
        if n_layers != -1 and len(ratios) < n_layers:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for n_layers={n_layers}")
        if n_layers != -1:  # trailing entries belong to MTP layers
            values["compress_ratios"] = ratios[:n_layers]
        try:
            return cls(**values)
        except TypeError as error:
            raise ConfigError(str(error)) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(condition: bool, field_name: str, message: str) -> None:
            if not condition:
                raise ConfigError(f"{field_name}: {message}")

        def need_size(field_name: str) -> None:  # a size: an int64 attribute and shape
            value = int(getattr(self, field_name))
            need(value > 0, field_name, f"must be > 0, got {value}")
            need(value < 2**63, field_name, f"must fit in int64, got {value}")

        need(self.weight_format in ("bf16", "fp8"), "weight_format",
             f"must be 'bf16' or 'fp8', got {self.weight_format!r}")
        for name in ("dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "window_size", "n_layers", "max_seq_len", "max_batch_size"):
            need_size(name)
        need(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim,
             "rope_head_dim", f"must be even and <= head_dim ({self.head_dim}), "
             f"got {self.rope_head_dim}")
        need(self.head_dim % 32 == 0, "head_dim",
             f"must be a multiple of 32 (fp8 blocks; fp4 latent blocks of 16), got {self.head_dim}")
        need(self.n_heads * self.head_dim % self.o_groups == 0, "o_groups",
             f"{self.o_groups} does not divide n_heads * head_dim = {self.n_heads * self.head_dim}")
        need(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        need(len(self.compress_ratios) == self.n_layers, "compress_ratios",
             f"has {len(self.compress_ratios)} entries for n_layers={self.n_layers}")
        for layer, ratio in enumerate(self.compress_ratios):
            need(ratio >= 0, "compress_ratios", f"layer {layer} has ratio {ratio} < 0")
            need(ratio <= self.max_seq_len, "compress_ratios",
                 f"layer {layer} ratio {ratio} exceeds max_seq_len {self.max_seq_len}")
        compressed = [i for i, r in enumerate(self.compress_ratios) if r > 0]
        for name in ("kv_source_layers", "index_source_layers"):
            layers = getattr(self, name)
            need(len(set(layers)) == len(layers), name, f"repeats a layer: {list(layers)}")
            for layer in layers:
                need(0 <= layer < self.n_layers, name,
                     f"layer {layer} is out of range 0..{self.n_layers - 1}")
                need(self.compress_ratios[layer] > 0, name,
                     f"layer {layer} has compress ratio 0 (window-only)")
        if compressed:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                need_size(name)
            need(self.index_head_dim % 32 == 0, "index_head_dim",
                 f"must be a multiple of 32 (fp4 blocks), got {self.index_head_dim}")
            need(self.rope_head_dim <= self.index_head_dim, "index_head_dim",
                 f"must be >= rope_head_dim ({self.rope_head_dim})")
            need(self.original_seq_len >= 0, "original_seq_len", "must be >= 0")
            need(self.rope_factor > 0, "rope_factor", f"must be > 0, got {self.rope_factor}")
        for layer in compressed:
            kv_before = [s for s in self.kv_source_layers if s <= layer]
            need(bool(kv_before), "kv_source_layers",
                 f"compressed layer {layer} has no kv source at or before it")
            idx_before = [s for s in self.index_source_layers if s <= layer]
            need(bool(idx_before), "index_source_layers",
                 f"compressed layer {layer} has no index source at or before it")
        owners = [s for s in self.index_source_layers if s in self.kv_source_layers]
        for layer in self.index_source_layers:
            need(any(o <= layer for o in owners), "index_source_layers",
                 f"index source {layer} has no index-key owner (kv and index source) at or "
                 "before it")
        if self.candidate_source_layer != -1:
            c = self.candidate_source_layer
            need(c in self.index_source_layers, "candidate_source_layer",
                 f"layer {c} is not an index source")
            need(self.candidate_topk_blocks > 0, "candidate_topk_blocks",
                 f"must be > 0 with a candidate source, got {self.candidate_topk_blocks}")
            need(self.candidate_block_size > 0, "candidate_block_size",
                 f"must be > 0 with a candidate source, got {self.candidate_block_size}")
            for layer in (i for i in self.index_source_layers if i > c):
                need(self.compress_ratios[layer] == self.compress_ratios[c], "compress_ratios",
                     f"index source {layer} selects inside candidate source {c}'s candidates, "
                     f"which are as wide as its scores: it needs its compress ratio "
                     f"{self.compress_ratios[c]}, got {self.compress_ratios[layer]}")


def _hf_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any]:
    if not scaling:
        return {}
    values = {}
    for key, value in scaling.items():
        if key in _HF_ROPE_SCALING:
            values[_HF_ROPE_SCALING[key]] = value
        elif key not in ("rope_type", "type", "mscale", "mscale_all_dim"):
            raise ConfigError(f"unknown rope_scaling field: {key}")
    return values


def _model_args_dtype(dtype: Any) -> WeightFormat:
    if dtype not in ("bf16", "fp8"):
        raise ConfigError(f"dtype: must be 'bf16' or 'fp8' (the linears' storage), got {dtype!r}")
    return dtype


def _hf_torch_dtype(key: str, value: Any) -> None:
    # The unquantised tensors' dtype; the fp8 linears are described by quantization_config.
    if value not in ("bfloat16", "torch.bfloat16"):
        raise ConfigError(f"{key}: must be 'bfloat16' (the reference's dtype), got {value!r}")


def _hf_weight_format(quantization: dict[str, Any] | None) -> WeightFormat:
    """quantization_config -> weight_format: only the released layout is accepted."""
    if quantization is None:
        return "bf16"
    if not isinstance(quantization, dict):
        raise ConfigError(f"quantization_config: must be an object, got {quantization!r}")
    expected = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE],
                "scale_fmt": FP8_SCALE_FMT}
    for key, want in expected.items():
        if key not in quantization:
            raise ConfigError(f"quantization_config.{key}: missing (expected {want!r})")
        got = quantization[key]
        if (list(got) if isinstance(got, (list, tuple)) else got) != want:
            raise ConfigError(f"quantization_config.{key}: only {want!r} is supported, "
                              f"got {got!r}")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError("quantization_config.activation_scheme: only 'dynamic' is supported "
                          f"(activations are quantised per call), got "
                          f"{quantization['activation_scheme']!r}")
    # expert_dtype concerns the experts, which are not exported.
    unknown = sorted(set(quantization) - set(expected) - {"activation_scheme", "expert_dtype"})
    if unknown:
        raise ConfigError(f"quantization_config: unknown field(s) {', '.join(unknown)}")
    return "fp8"
