"""Write a NEW golden case (NAME.json + NAME.npz, the format of goldens/FORMAT.md) computed by
the torch oracle in tools/torch_reference.py, so `csa2onnx verify` can run cases the shared
goldens do not cover: other seeds, prefill lengths, batch sizes and layer layouts.

    python tools/make_golden.py OUT_DIR --name mixed --seed 7 --batch 2 --prefill-len 45 \\
        --decode-steps 7 --layout mixed_b2
    python tools/make_golden.py OUT_DIR --name mine --layout '{"compress_ratios": [0, 4, 1],
        "kv_source_layers": [1, 2], "index_source_layers": [1, 2], "window_size": 16}'
    csa2onnx verify OUT_DIR/mixed.json

`--layout` is a preset name (LAYOUTS), a JSON object or @file.json of ModelArgs fields laid
over BASE_ARGS. These cases come from the oracle (bit-identical to the upstream goldens on
every shared case), not from the upstream code: the JSON says so in `generator`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference as ref

# The goldens' small dims; ModelArgs names.
BASE_ARGS: dict[str, Any] = {
    "dtype": "bf16", "max_batch_size": 4, "max_seq_len": 512, "dim": 256, "n_heads": 4,
    "head_dim": 128, "rope_head_dim": 32, "q_lora_rank": 128, "o_groups": 2,
    "o_lora_rank": 64, "norm_eps": 1e-20, "window_size": 32, "compress_ratios": [0, 2, 2, 1, 1, 0],
    "kv_source_layers": [1, 3], "index_source_layers": [1, 3], "compress_rope_theta": 40000.0,
    "rope_theta": 10000.0, "original_seq_len": 0, "rope_factor": 40, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16,
    "candidate_source_layer": -1, "candidate_topk_blocks": 0, "candidate_block_size": 0,
}

LAYOUTS: dict[str, dict[str, Any]] = {
    # ratio 4 owner first, a ratio-1 owner between, a non-owner ratio-4 index source reading
    # ratio-1 keys and a ratio-1 compressed cache; YaRN that bites (original_seq_len 32).
    "mixed_b2": {"compress_ratios": [4, 0, 1, 4, 4, 0], "kv_source_layers": [0, 2],
                 "index_source_layers": [0, 2, 3], "window_size": 16, "index_topk": 8,
                 "max_seq_len": 128, "compress_rope_theta": 80000.0, "original_seq_len": 32,
                 "rope_factor": 4},
    # Candidate blocks of 8 (2 kept) with two candidate users; topk 20 > 16 candidate
    # positions, so both users also take masked (-inf) reachable positions.
    "candidates_2users": {"compress_ratios": [0, 2, 2, 2, 2, 0], "kv_source_layers": [1],
                          "index_source_layers": [1, 3, 4], "candidate_source_layer": 1,
                          "candidate_topk_blocks": 2, "candidate_block_size": 8,
                          "window_size": 24, "index_topk": 20, "max_seq_len": 256},
    # For a prefill shorter than the ratio and the window: ratio-4 groups complete in decode.
    "short_prefill": {"compress_ratios": [0, 4, 4, 1, 1, 0], "kv_source_layers": [1, 3],
                      "index_source_layers": [1, 3], "window_size": 8, "index_topk": 1,
                      "max_seq_len": 64},
}


def model_args(layout: dict[str, Any] | str, batch: int = 1) -> dict[str, Any]:
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    args = {**BASE_ARGS, **layout}
    args["n_layers"] = len(args["compress_ratios"])
    args["max_batch_size"] = max(args["max_batch_size"], batch)
    cand = args["candidate_source_layer"]
    for role in ref.layer_roles(args):  # the mask is as wide as the source's scores
        if role.get("uses_candidates") and role["compress_ratio"] != args["compress_ratios"][cand]:
            raise ValueError(f"candidate user {role['layer']} has ratio {role['compress_ratio']}"
                             f", the candidate source {cand} {args['compress_ratios'][cand]}")
    return args


def random_weights(args: dict[str, Any], layer: int, gen: torch.Generator
                   ) -> dict[str, torch.Tensor]:
    """Scaled like the goldens: linears N(0,1)/sqrt(in), norms 1 + 0.1 N(0,1), sinks 0.5 N(0,1);
    bf16 values (the sink f32)."""
    weights = {}
    for name, shape in ref.parameter_shapes(args, layer).items():
        if name == "attn_sink":
            weights[name] = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).bfloat16().float()
        else:
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            weights[name] = w.bfloat16().float()
            base = name.removesuffix(".weight")
            if args.get("dtype") == "fp8" and base in ref.FP8_LINEARS:
                weights[name], weights[f"{base}.scale"] = quantize_fp8(weights[name])
    return weights


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one ue8m0 scale per [32, 32] block (pow2 ceil of amax / 448, as
    upstream's checkpoints are quantised), both as f32."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 32) * 32, -(-k // 32) * 32)
    padded[:n, :k] = w
    blocks = padded.unflatten(0, (-1, 32)).unflatten(-1, (-1, 32))  # [nb, 32, kb, 32]
    scale = ref.pow2_ceil(blocks.abs().amax(dim=(1, 3)).clamp(min=1e-4) * (1 / 448))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(ref.E4M3).float()
    return q.flatten(2, 3).flatten(0, 1)[:n, :k].contiguous(), scale


def make_case(folder: str | Path, name: str, *, seed: int = 0, batch: int = 1,
              prefill_len: int = 45, decode_steps: int = 6,
              layout: dict[str, Any] | str = "mixed_b2", dtype: str = "bf16",
              owner_reads_own_index_k: bool = False, description: str = "") -> Path:
    """Generate and write NAME.json + NAME.npz into `folder`; returns the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    args = model_args(layout, batch) | {"dtype": dtype}
    end = prefill_len + decode_steps
    if not (prefill_len > 0 and end <= args["max_seq_len"]):
        raise ValueError(f"positions 0..{end - 1} do not fit max_seq_len {args['max_seq_len']}")
    gen_weights = torch.Generator().manual_seed(seed)
    weights = {layer: random_weights(args, layer, gen_weights) for layer in range(args["n_layers"])}
    arrays = {f"weights.L{layer}.{k}": v.numpy() for layer, w in weights.items()
              for k, v in w.items()}
    arrays.update(ref.rope_tables(args))
    schedule = [{"step": "prefill", "start_pos": 0, "seqlen": prefill_len}] + [
        {"step": f"decode{i}", "start_pos": prefill_len + i, "seqlen": 1}
        for i in range(decode_steps)]

    stack = ref.Stack(args, weights, owner_reads_own_index_k)
    gen_inputs = torch.Generator().manual_seed(seed + 1)
    for entry in schedule:
        xs = {layer: torch.randn(batch, entry["seqlen"], args["dim"], generator=gen_inputs)
              .bfloat16() for layer in range(args["n_layers"])}
        _, step_arrays = stack.step(xs, entry["start_pos"])
        arrays.update({f"{entry['step']}.L{layer}.x": x.float().numpy() for layer, x in xs.items()})
        arrays.update({f"{entry['step']}.{k}": v for k, v in step_arrays.items()})
    last = schedule[-1]["step"]
    arrays.update({f"{last}.{k}": v for k, v in stack.final_state(batch, end).items()})

    npz = folder / f"{name}.npz"
    np.savez_compressed(npz, **arrays)
    roles = ref.layer_roles(args)
    meta = {
        "case": name,
        "description": description or (
            f"oracle-generated: ratios {tuple(args['compress_ratios'])}, kv sources "
            f"{tuple(args['kv_source_layers'])}, index sources "
            f"{tuple(args['index_source_layers'])}, candidate source "
            f"{args['candidate_source_layer']}, window {args['window_size']}, index_topk "
            f"{args['index_topk']}; prefill {prefill_len} then {decode_steps} decode steps, "
            f"batch {batch}"),
        "generator": "tools/make_golden.py via the torch oracle tools/torch_reference.py "
                     "(NOT the upstream model.py; the oracle is bit-identical to it on the "
                     "shared goldens)",
        "torch_version": torch.__version__, "numpy_version": np.__version__,
        "machine": ref.machine_info(),
        "seed_weights": seed, "seed_inputs": seed + 1, "topk_tiebreak": "torch_cpu",
        "batch": batch, "prefill_len": prefill_len, "decode_steps": decode_steps,
        "schedule": schedule, "model_args": args, "layer_roles": roles,
        "parameter_dtypes": {f"L{layer}.{k}": str(ref.parameter_dtype(
            k, roles[layer]["compress_ratio"], dtype == "fp8")).removeprefix("torch.")
            for layer, w in weights.items() for k in w},
        "rope_tables": {k: "[max_seq_len, rope_head_dim/2, (re, im)]"
                        for k in arrays if k.startswith("freqs_cis.")},
        "tie_sensitive_rows": {k: int(v.sum()) for k, v in arrays.items()
                               if k.endswith("_ambiguous") and v.any()},
        "overlay_of": None, "overlay_note": None,
        "behaviour_patch": "owner_reads_own_index_k" if owner_reads_own_index_k else None,
        "npz_files": {npz.name: npz.stat().st_size},
        "arrays": {k: {"shape": list(v.shape), "dtype": str(v.dtype), "file": npz.name}
                   for k, v in arrays.items()},
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def parse_layout(text: str) -> dict[str, Any] | str:
    if text in LAYOUTS:
        return text
    if text.startswith("@"):
        return json.loads(Path(text[1:]).read_text())
    return json.loads(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write NAME.json and NAME.npz into")
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill-len", type=int, default=45)
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--layout", default="mixed_b2",
                        help=f"preset ({', '.join(LAYOUTS)}), a JSON object, or @file.json")
    parser.add_argument("--owner-reads-own-index-k", action="store_true",
                        help="the _ownk behaviour patch: index-key owners read their own keys")
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                        help="fp8: the released checkpoint's e4m3 linears with block scales")
    opts = parser.parse_args(argv)
    path = make_case(opts.out, opts.name, seed=opts.seed, batch=opts.batch,
                     prefill_len=opts.prefill_len, decode_steps=opts.decode_steps,
                     layout=parse_layout(opts.layout), dtype=opts.dtype,
                     owner_reads_own_index_k=opts.owner_reads_own_index_k)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
