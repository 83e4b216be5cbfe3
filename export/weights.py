"""Per-layer attention weights, named as the reference's `Attention.named_parameters()`
names them (`wq_a.weight`, `compressor.wkv.weight`, `indexer.wq_b.weight`, ...).

Sources: a golden case (`weights.L{l}.{param}`) or safetensors files with the reference's
checkpoint names (`layers.{l}.attn.{param}`), bf16 or f32 tensors. The safetensors format
(8-byte header length, JSON header, raw little-endian data) is read directly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import LayerPlan, plan_layer

LayerWeights = dict[str, np.ndarray]

_SAFETENSORS_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}


class WeightsError(ValueError):
    """Missing, unexpected or mis-shaped weights."""


def expected_shapes(config: AttentionConfig, plan: LayerPlan) -> dict[str, tuple[int, ...]]:
    """Every parameter a layer needs, with its shape ([out, in] for linears)."""
    c = config
    shapes = {
        "attn_sink": (c.n_heads,),
        "wq_a.weight": (c.q_lora_rank, c.dim),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.n_heads * c.head_dim, c.q_lora_rank),
        "wkv.weight": (c.head_dim, c.dim),
        "kv_norm.weight": (c.head_dim,),
        "wo_a.weight": (c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups),
        "wo_b.weight": (c.dim, c.o_groups * c.o_lora_rank),
    }
    if plan.kv_source:
        shapes["compressor.wkv.weight"] = (c.head_dim, c.dim)
        if plan.ratio > 1:  # ratio 1 is a plain projection: no gate
            shapes["compressor.wgate.weight"] = (c.head_dim, c.dim)
        shapes["compressor.norm.weight"] = (c.head_dim,)
    if plan.index_source:
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, c.dim)
        if plan.owns_index_k:
            shapes["indexer.wk.weight"] = (c.index_head_dim, c.head_dim)
            shapes["indexer.k_norm.weight"] = (c.index_head_dim,)
    return shapes


def check_layer(config: AttentionConfig, layer: int, weights: LayerWeights) -> LayerWeights:
    """The layer's weights as float32 arrays, after checking names and shapes."""
    expected = expected_shapes(config, plan_layer(config, layer))
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise WeightsError(f"layer {layer}: missing weights {', '.join(missing)}")
    checked = {}
    for name, shape in expected.items():
        value = np.asarray(weights[name])
        if value.shape != shape:
            raise WeightsError(f"layer {layer}: {name} has shape {value.shape}, "
                               f"expected {shape}")
        checked[name] = value.astype(np.float32)
    return checked


def from_golden(arrays: dict[str, np.ndarray], layers: Iterable[int]) -> dict[int, LayerWeights]:
    """Weights of `layers` from a golden case's arrays (`weights.L{l}.{param}`)."""
    result = {}
    for layer in layers:
        prefix = f"weights.L{layer}."
        result[layer] = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return result


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file, as float32 arrays."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise WeightsError(f"{path}: not a safetensors file (too short)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise WeightsError(f"{path}: header length {header_len} exceeds the file")
    header = json.loads(data[8:8 + header_len])
    body = memoryview(data)[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightsError(f"{path}: {name} has dtype {info['dtype']}; "
                               "bf16, f16 and f32 are supported (fp8 checkpoints are not yet)")
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=dtype).reshape(info["shape"])
        tensors[name] = array.astype(np.float32)
    return tensors


def from_safetensors(paths: Iterable[str | Path], layers: Iterable[int]) -> dict[int, LayerWeights]:
    """Weights of `layers` from checkpoint files named `layers.{l}.attn.{param}`."""
    wanted = set(layers)
    result: dict[int, LayerWeights] = {layer: {} for layer in wanted}
    for path in paths:
        for name, value in read_safetensors(path).items():
            parts = name.split(".", 3)
            if len(parts) == 4 and parts[0] == "layers" and parts[2] == "attn":
                layer = int(parts[1])
                if layer in wanted:
                    result[layer][parts[3]] = value
    return result
