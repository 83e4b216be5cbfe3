"""Write a synthetic Hugging Face model folder laid out like the released checkpoint, at any
config's dims: config.json, shards model-0000i-of-0000n.safetensors with
model.safetensors.index.json (or one model.safetensors for --shards 1), seeded random
attention weights `layers.{l}.attn.{param}` in their stored dtypes (export/weights.py's
table), and large non-attention filler (experts) around them in the same shards.

    python tools/make_checkpoint.py export/configs/v41_flash_attention.json --out /tmp/ckpt \\
        --layers 0-3 --dtype fp8 --shards 3 --filler-mib 64
    csa2onnx export /tmp/ckpt --out /tmp/artifacts --layers 0-3

fp8 weights are random values cast to e4m3 with one ue8m0 scale per [32, 32] block (the
scale written as F8_E8M0 exponent bytes), as upstream quantises its weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from csa2onnx.export.checkpoint import INDEX, SINGLE
from csa2onnx.export.config import FP8_BLOCK_SIZE, FP8_SCALE_FMT, AttentionConfig
from csa2onnx.export.safetensors_io import write_safetensors
from csa2onnx.export.synthetic import attention_tensors
from csa2onnx.export.weights import BF16, E4M3

FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE],
                    "scale_fmt": FP8_SCALE_FMT, "expert_dtype": "fp4"}


def filler(mib: int) -> np.ndarray:
    # zeros are never paged in until written out: the generator stays small too
    return np.zeros((max(mib, 1) * 1024, 1024), E4M3) if mib else np.zeros((32, 32), E4M3)


def write_config(source: Path, out: Path, dtype: str | None) -> AttentionConfig:
    """config.json in the source's naming, its precision set to `dtype` (default: as is)."""
    data: dict[str, Any] = json.loads(source.read_text())
    data = data.get("model_args", data)  # a golden case: its ModelArgs
    dtype = dtype or AttentionConfig.load(source).weight_format
    if "hidden_size" in data or "text_config" in data:
        data.pop("quantization_config", None)
        data.get("text_config", {}).pop("quantization_config", None)
        if dtype == "fp8":
            data["quantization_config"] = FP8_QUANTIZATION
    else:
        data["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(data, indent=1) + "\n")
    return AttentionConfig.load(out / "config.json")


def make_checkpoint(config_path: str | Path, out: str | Path, *, layers: range | None = None,
                    seed: int = 0, dtype: str | None = None, shards: int = 2,
                    filler_mib: int = 0, prefix: str = "") -> Path:
    """Write the folder; returns it. `prefix` (e.g. "model.") goes before every name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = write_config(Path(config_path), out, dtype)
    layers = range(config.n_layers) if layers is None else layers
    shards = max(1, min(shards, len(layers)))
    contents: list[dict[str, np.ndarray]] = [{} for _ in range(shards)]
    rng = np.random.default_rng(seed)
    contents[0][f"{prefix}embed.weight"] = rng.standard_normal((64, config.dim),
                                                                np.float32).astype(BF16)
    for i, layer in enumerate(layers):
        shard = contents[i * shards // len(layers)]
        base = f"{prefix}layers.{layer}"
        # the attention tensors sit between the experts' large tensors, as in the release
        shard[f"{base}.ffn.experts.0.w1.weight"] = filler(filler_mib)
        shard[f"{base}.attn_norm.weight"] = np.ones(config.dim, BF16)
        for name, value in attention_tensors(config, layer, rng).items():
            shard[f"{base}.attn.{name}"] = value
        shard[f"{base}.ffn.experts.0.w2.weight"] = np.zeros((config.dim, 16), np.int8)
        shard[f"{base}.ffn.experts.0.w2.scale"] = np.full((config.dim, 1), 127, np.uint8)
    contents[-1][f"{prefix}norm.weight"] = np.ones(config.dim, BF16)
    contents[-1][f"{prefix}head.weight"] = np.zeros((64, config.dim), BF16)
    if shards == 1:
        write_safetensors(out / SINGLE, contents[0], {"format": "pt"})
        return out
    weight_map, total = {}, 0
    for i, tensors in enumerate(contents):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / name, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return out


def _layer_range(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", type=Path, help="config.json (HF or ModelArgs names) or a golden "
                                             "case JSON")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=_layer_range, help="FIRST-LAST (default: every layer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["fp8", "bf16"],
                   help="the linears' precision (default: the config's)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--filler-mib", type=int, default=0,
                   help="MiB of expert filler per layer (default: a token 1 KiB)")
    args = p.parse_args(argv)
    out = make_checkpoint(args.config, args.out, layers=args.layers, seed=args.seed,
                          dtype=args.dtype, shards=args.shards, filler_mib=args.filler_mib)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
