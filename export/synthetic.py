"""Seeded random attention weights at any config's dims, in their stored dtypes (bf16, or
the released checkpoint's fp8 e4m3 with ue8m0 [32, 32] block scales): for benchmarks and
synthetic checkpoints (tools/make_checkpoint.py)."""

from __future__ import annotations

import numpy as np

from csa2onnx.export.config import FP8_BLOCK_SIZE, AttentionConfig
from csa2onnx.export.plan import plan_layer
from csa2onnx.export.weights import E4M3, E8M0, expected_tensors

E4M3_MAX = 448.0


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 values and ue8m0 scales (one per [32, 32] block, the smallest power of two
    that keeps the block's amax within e4m3's 448) with w ~= values * scale."""
    b = FP8_BLOCK_SIZE
    n, k = w.shape
    nb, kb = -(-n // b), -(-k // b)
    padded = np.zeros((nb * b, kb * b), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(nb, b, kb, b)
    amax = np.maximum(np.abs(blocks).max(axis=(1, 3)), np.float32(2.0 ** -100))
    exponent = np.ceil(np.log2(amax / np.float32(E4M3_MAX))).astype(np.int32)
    scale = np.ldexp(np.float32(1), exponent).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(nb * b, kb * b)[:n, :k]
    return q.astype(E4M3), (exponent + 127).astype(np.uint8).view(E8M0)


def attention_tensors(config: AttentionConfig, layer: int, rng: np.random.Generator
                      ) -> dict[str, np.ndarray]:
    """Seeded random weights of one layer, by param name, in their stored dtypes."""
    out: dict[str, np.ndarray] = {}
    for name, spec in expected_tensors(config, plan_layer(config, layer)).items():
        if spec.dtype == E8M0:
            continue  # written with its weight
        if name.endswith("norm.weight"):
            value = 1 + np.float32(0.05) * rng.standard_normal(spec.shape, np.float32)
        elif len(spec.shape) == 2:
            value = rng.standard_normal(spec.shape, np.float32) / np.sqrt(spec.shape[1])
        else:
            value = rng.standard_normal(spec.shape, np.float32)
        if spec.dtype == E4M3:
            out[name], out[name.replace(".weight", ".scale")] = quantize_fp8(value)
        else:
            out[name] = value.astype(spec.dtype)
    return out
