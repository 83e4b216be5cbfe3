"""Per-layer attention weights, named as the reference's `Attention.named_parameters()`
names them (`wq_a.weight`, `compressor.wkv.weight`, `indexer.wq_b.weight`, ...), and the one
table of what each layer holds: every tensor's shape and stored dtype for the config's
precision (`expected_tensors`), and how an artifact stores each linear (`linear_layout`).

Sources: a golden case (`weights.L{l}.{param}`, float32 arrays holding the stored values),
safetensors files with the reference's checkpoint names (`layers.{l}.attn.{param}`), or a
Hugging Face model folder (export/checkpoint.py). `check_layer` brings any of them to the
stored dtypes, exactly or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from csa2onnx.custom_ops.weight_layout import PAIRS16, PAIRS16_COLUMNS, PANELS64, PLAIN
from csa2onnx.export.config import FP8_BLOCK_SIZE, FP8_SCALE_FMT, AttentionConfig
from csa2onnx.export.plan import LayerPlan, plan_layer
from csa2onnx.export.safetensors_io import SafetensorsFile

LayerWeights = dict[str, np.ndarray]

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

# The linears upstream builds with the default dtype: fp8 in an fp8 config.
FP8_LINEARS = ("wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b")
FP8_FORMAT = f"fp8-e4m3/{FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE}-{FP8_SCALE_FMT}"


class WeightsError(ValueError):
    """Missing, unexpected, mis-shaped or mis-typed weights."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the checkpoint stores it. check_layer hands it on in `dtype`, except
    e8m0 scales, which it hands on as their float32 values (exact powers of two)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def loaded_dtype(self) -> np.dtype:
        return F32 if self.dtype == E8M0 else self.dtype


def expected_tensors(config: AttentionConfig, plan: LayerPlan) -> dict[str, TensorSpec]:
    """Every tensor a layer holds, with its shape ([out, in] for linears) and stored dtype:
    upstream's parameter dtypes (goldens' `parameter_dtypes`) for config.weight_format."""
    c = config
    tensors: dict[str, TensorSpec] = {}

    def linear(name: str, out_features: int, in_features: int, dtype: np.dtype = BF16) -> None:
        if name in FP8_LINEARS and c.weight_format == "fp8":
            tensors[f"{name}.weight"] = TensorSpec((out_features, in_features), E4M3)
            tensors[f"{name}.scale"] = TensorSpec((-(-out_features // FP8_BLOCK_SIZE),
                                                   -(-in_features // FP8_BLOCK_SIZE)), E8M0)
        else:
            tensors[f"{name}.weight"] = TensorSpec((out_features, in_features), dtype)

    def norm(name: str, size: int) -> None:
        tensors[f"{name}.weight"] = TensorSpec((size,), BF16)

    tensors["attn_sink"] = TensorSpec((c.n_heads,), F32)
    linear("wq_a", c.q_lora_rank, c.dim)
    norm("q_norm", c.q_lora_rank)
    linear("wq_b", c.n_heads * c.head_dim, c.q_lora_rank)
    linear("wkv", c.head_dim, c.dim)
    norm("kv_norm", c.head_dim)
    linear("wo_a", c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups)
    linear("wo_b", c.dim, c.o_groups * c.o_lora_rank)
    if plan.kv_source:
        # ratio 1 is a plain bf16 projection; ratio > 1 keeps f32 weights and a gate
        compressor = F32 if plan.ratio > 1 else BF16
        linear("compressor.wkv", c.head_dim, c.dim, compressor)
        if plan.ratio > 1:
            linear("compressor.wgate", c.head_dim, c.dim, F32)
        norm("compressor.norm", c.head_dim)
    if plan.index_source:
        linear("indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        linear("indexer.weights_proj", c.index_n_heads, c.dim)
        if plan.owns_index_k:
            linear("indexer.wk", c.index_head_dim, c.head_dim)
            norm("indexer.k_norm", c.index_head_dim)
    return tensors


def expected_shapes(config: AttentionConfig, plan: LayerPlan) -> dict[str, tuple[int, ...]]:
    """Every tensor a layer holds, with its shape ([out, in] for linears)."""
    return {name: spec.shape for name, spec in expected_tensors(config, plan).items()}


def is_linear(name: str, spec: TensorSpec) -> bool:
    return name.endswith(".weight") and len(spec.shape) == 2


def linear_layout(spec: TensorSpec, portable: bool, numerics: str = "exact") -> str:
    """How an artifact stores a linear's weight (custom_ops/weight_layout.py), each read in
    place by its kernel: TorchLinear's (bf16, f32) in panels (`panels64`); Fp8Linear's as
    k-pairs of 16 columns (`pairs16`, where N is a multiple of 16: its few-rows kernel
    then reads lanes over columns with no transpose) under exact numerics (numerics "fast"
    reads plain fp8 W). A portable artifact's are plain [N, K] (its bodies are MatMuls)."""
    if portable:
        return PLAIN
    if spec.dtype == E4M3:
        exact = numerics == "exact" and spec.shape[0] % PAIRS16_COLUMNS == 0
        return PAIRS16 if exact else PLAIN
    return PANELS64


def linear_formats(config: AttentionConfig, plan: LayerPlan, *, portable: bool = False,
                   numerics: str = "exact") -> dict[str, str]:
    """Each linear's weight format as the artifact stores it (`fp8-e4m3/32x32-ue8m0/pairs16`,
    `bf16/panels64`, `f32/panels64`; `fp8-e4m3/32x32-ue8m0`, `bf16`, `f32` when plain), for
    manifests."""
    tensors = expected_tensors(config, plan)
    names = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": FP8_FORMAT}
    formats = {}
    for name, spec in tensors.items():
        if is_linear(name, spec):
            layout = linear_layout(spec, portable, numerics)
            formats[name.removesuffix(".weight")] = names[spec.dtype.name] + (
                "" if layout == PLAIN else f"/{layout}")
    return formats


def check_layer(config: AttentionConfig, layer: int, weights: Mapping[str, np.ndarray],
                sources: Mapping[str, str] | None = None) -> LayerWeights:
    """The layer's weights in their stored dtypes (scales as float32 powers of two), after
    checking names, shapes and that any conversion is exact. Arrays already in the stored
    dtype pass through uncopied (a memory-mapped checkpoint tensor stays mapped).
    `sources` names where each tensor came from (a file), for error messages."""
    expected = expected_tensors(config, plan_layer(config, layer))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise WeightsError(f"layer {layer}: missing weights {', '.join(missing)} "
                           f"(weight_format {config.weight_format})")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise WeightsError(f"layer {layer}: unexpected weights {', '.join(extra)} "
                           f"(weight_format {config.weight_format})")
    checked = {}
    for name, spec in expected.items():
        where = f"layer {layer}: {name}" + (f" (in {sources[name]})"
                                            if sources and name in sources else "")
        value = weights[name]
        if value.shape != spec.shape:
            raise WeightsError(f"{where} has shape {tuple(value.shape)}, expected {spec.shape}")
        checked[name] = _to_stored(value, spec, where, config.weight_format)
    return checked


def _to_stored(value: np.ndarray, spec: TensorSpec, where: str, weight_format: str
               ) -> np.ndarray:
    """`value` in spec.loaded_dtype, converting only where every value is kept exactly."""
    source = value.dtype
    if spec.dtype == E8M0:
        if source == E8M0:
            if (value.view(np.uint8) == 0xFF).any():
                raise WeightsError(f"{where}: a ue8m0 scale is NaN (byte 0xff)")
            return value.astype(F32)  # 2^(byte - 127), exact in float32 (2^-127 included)
        if not _is_float(source):
            raise WeightsError(f"{where} has dtype {source}, expected ue8m0 scales")
        scales = np.asarray(value, F32)
        mantissa, _ = np.frexp(scales)
        if not (np.isfinite(scales).all() and (mantissa == 0.5).all()
                and np.array_equal(scales.astype(E8M0).astype(F32), scales)):
            raise WeightsError(f"{where}: scales must be positive powers of two in ue8m0 range")
        return scales
    if source == spec.dtype:
        return value
    if not _is_float(source):
        raise WeightsError(f"{where} has dtype {source}, expected {spec.dtype}")
    converted = np.asarray(value).astype(spec.dtype)
    back = converted.astype(source)
    if not np.array_equal(back, value, equal_nan=True):
        hint = (f"fp8 weights need an fp8 config (weight_format is {weight_format})"
                if source == E4M3 or spec.dtype == E4M3 else "")
        raise WeightsError(f"{where} holds {source} values that are not exactly "
                           f"{spec.dtype} values" + (f"; {hint}" if hint else ""))
    return converted


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype in (BF16, E4M3)  # ml_dtypes' kinds are "V"


def as_float32(weights: Mapping[str, np.ndarray]) -> LayerWeights:
    """float32 copies of checked weights (bf16, e4m3 and scales convert exactly), for graph
    code that takes float32 arrays."""
    return {name: np.asarray(value, F32) for name, value in weights.items()}


def from_golden(arrays: dict[str, np.ndarray], layers: Iterable[int]) -> dict[int, LayerWeights]:
    """Weights of `layers` from a golden case's arrays (`weights.L{l}.{param}`)."""
    result = {}
    for layer in layers:
        prefix = f"weights.L{layer}."
        result[layer] = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return result


def attention_name(name: str) -> tuple[int, str] | None:
    """(layer, param) of a checkpoint name `[model.]layers.{l}.attn.{param}`, else None."""
    parts = name.removeprefix("model.").split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2] == "attn" and parts[1].isdigit():
        return int(parts[1]), parts[3]
    return None


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file in their stored dtypes, memory-mapped."""
    file = SafetensorsFile(path)
    return {name: file.tensor(name) for name in file.entries}


def from_safetensors(paths: Iterable[str | Path], layers: Iterable[int]) -> dict[int, LayerWeights]:
    """Weights of `layers` from checkpoint files named `[model.]layers.{l}.attn.{param}`,
    memory-mapped in their stored dtypes; no other tensor is read."""
    wanted = set(layers)
    result: dict[int, LayerWeights] = {layer: {} for layer in wanted}
    for path in paths:
        file = SafetensorsFile(path)
        for name in file.entries:
            found = attention_name(name)
            if found and found[0] in wanted:
                result[found[0]][found[1]] = file.tensor(name)
    return result
