"""One copy of the weights: both models reference one external-data file (each distinct
tensor once), and both sessions run on OrtValues over one mapping of it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from helpers import golden

from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime, describe
from csa2onnx.export.shared_weights import ALIGNMENT, WEIGHTS_FILE
from csa2onnx.export.stack import export_stack
from csa2onnx.export.synthetic import attention_tensors
from csa2onnx.export.weights import from_golden


def _mappings(path: Path) -> int:
    return sum(line.rstrip().endswith(str(path.resolve()))
               for line in Path("/proc/self/maps").read_text().splitlines())


def test_both_models_and_sessions_share_one_copy(tmp_path: Path, monkeypatch) -> None:
    import csa2onnx.export.stack as stack

    monkeypatch.setattr(stack, "EXTERNAL_DATA_BYTES", 1)
    g = golden("case1_r2_r1")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    export_stack(plan, from_golden(g.arrays, range(6)), tmp_path)
    assert not list(tmp_path.glob("*.onnx.onnx.data")) and not list(
        tmp_path.glob("prefill.onnx.data"))
    locations = {}
    for mode in ("prefill", "decode"):
        model = onnx.load(str(tmp_path / f"{mode}.onnx"), load_external_data=False)
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                fields = {e.key: e.value for e in t.external_data}
                assert fields["location"] == WEIGHTS_FILE
                assert int(fields["offset"]) % ALIGNMENT == 0
                locations.setdefault(t.name, set()).add(fields["offset"])
    assert locations and all(len(offsets) == 1 for offsets in locations.values())
    shared = AttentionRuntime(tmp_path)
    assert shared.weights is not None
    # The runtime's one mapping of the file: onnxruntime does not load it again.
    assert _mappings(tmp_path / WEIGHTS_FILE) == 1
    separate = AttentionRuntime(tmp_path, share_weights=False)  # each session loads its own
    assert _mappings(tmp_path / WEIGHTS_FILE) > 2
    for entry in g.meta["schedule"][:3]:
        xs = {layer: g.step(entry["step"], layer, "x") for layer in range(6)}
        call = "prefill" if entry["start_pos"] == 0 else "decode"
        a, b = getattr(shared, call)(xs).out, getattr(separate, call)(xs).out
        for layer in range(6):
            np.testing.assert_array_equal(a[layer], b[layer])
    text = describe(tmp_path)
    assert f"weights: {WEIGHTS_FILE}, shared by both models" in text
    assert "state bytes per layer" in text and "KiB / 1024 tokens" in text


def test_manifest_state_bytes(tmp_path: Path) -> None:
    g = golden("case3_r4_r128")
    config = AttentionConfig.from_model_args(g.model_args)
    plan = plan_stack(config)
    export_stack(plan, from_golden(g.arrays, range(6)), tmp_path)
    manifest = AttentionRuntime(tmp_path).manifest
    assert manifest.weights_file is None  # small: the weights stay inside the models
    assert manifest.state_layout == plan.state_layout()
    hd, ihd = config.head_dim, config.index_head_dim
    for p in plan.layers:
        sizes = manifest.state_bytes[str(p.layer)]
        window = config.window_size * (hd + hd // 32)  # packed: e4m3 codes + e8m0 per 32
        if p.kv_source:
            rows = config.max_seq_len // p.ratio
            # e2m1 codes two a byte + an e4m3 scale per 16; the open group is float32
            extra = rows * (hd // 2 + hd // 16) + (2 * p.ratio * hd * 4 if p.ratio > 1 else 0)
            if p.owns_index_k:
                extra += rows * (ihd // 2 + ihd // 32)  # e2m1 + an e8m0 scale per 32
            assert sizes["at_max_seq_len"] == window + extra
            assert sizes["per_1024_tokens"] > 0
        else:
            assert sizes == {"at_max_seq_len": window, "per_1024_tokens": 0, "fixed": window}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_loaded_stack_holds_its_weights_once(tmp_path: Path, monkeypatch) -> None:
    """Loading adds the weights once (the one mapping both sessions read, TorchLinear's in
    place) and little else, and a prefill's activations do not stay (the prefill session
    has no arena): ~80 MiB of weights, where a kernel copy per session would add 2x that."""
    import csa2onnx.export.stack as stack

    monkeypatch.setattr(stack, "EXTERNAL_DATA_BYTES", 1)
    base = AttentionConfig.from_model_args(golden("case1_r2_r1").model_args)
    config = replace(base, dim=2048, q_lora_rank=1024, n_heads=16, o_groups=4,
                     o_lora_rank=512)
    plan = plan_stack(config, 0, 3)
    rng = np.random.default_rng(0)
    weights = {p.layer: attention_tensors(config, p.layer, rng) for p in plan.layers}
    weight_mib = sum(a.nbytes for w in weights.values() for a in w.values()) / 2**20
    assert weight_mib > 70
    export_stack(plan, weights, tmp_path)
    del weights
    slack = 40  # two sessions' graphs, kernels and onnxruntime's own bookkeeping
    before = _rss_mib()
    runtime = AttentionRuntime(tmp_path, intra_op_num_threads=1)
    assert not runtime.sessions["prefill"].get_session_options().enable_cpu_mem_arena
    assert runtime.sessions["decode"].get_session_options().enable_cpu_mem_arena
    loaded = _rss_mib() - before
    assert loaded < 1.15 * weight_mib + slack, (loaded, weight_mib)
    xs = {p.layer: rng.standard_normal((1, 128, 2048), np.float32) for p in plan.layers}
    runtime.prefill(xs)
    for _ in range(4):
        runtime.decode({layer: x[:, :1] for layer, x in xs.items()})
    held = _rss_mib() - before
    state_mib = runtime.state_bytes() / 2**20
    assert held < 1.15 * (weight_mib + state_mib) + slack, (held, weight_mib, state_mib)


def test_an_export_packs_each_weight_once_and_hashes_each_tensor_once(
        tmp_path: Path, monkeypatch) -> None:
    """Both models' initializer sharing and the weights file ask one ContentDigests: a lazily
    packed TorchLinear weight is packed once per export (it was packed for each hash and each
    write, 4 times), and no tensor is hashed by each model and each step (then 2 hashes per
    initializer per model)."""
    import collections
    import hashlib

    import csa2onnx.custom_ops.weight_layout as layout
    import csa2onnx.export.stack as stack

    monkeypatch.setattr(stack, "EXTERNAL_DATA_BYTES", 1)
    packs: collections.Counter = collections.Counter()
    pack_panels = layout.pack_panels

    def counting_pack(w: np.ndarray, groups: int = 1):
        packs[(w.__array_interface__["data"][0], w.shape)] += 1
        return pack_panels(w, groups)

    hashes = collections.Counter()
    sha1, sha256 = hashlib.sha1, hashlib.sha256

    def counting(name: str, real):
        def digest(*args):
            hashes[name] += 1
            return real(*args)
        return digest

    monkeypatch.setattr(layout, "pack_panels", counting_pack)
    monkeypatch.setattr(hashlib, "sha1", counting("sha1", sha1))
    monkeypatch.setattr(hashlib, "sha256", counting("sha256", sha256))
    g = golden("case3_r4_r128")
    plan = plan_stack(AttentionConfig.from_model_args(g.model_args))
    export_stack(plan, from_golden(g.arrays, range(6)), tmp_path)
    assert packs and set(packs.values()) == {1}, packs
    saved = sum(len(onnx.load(str(tmp_path / f"{m}.onnx"), load_external_data=False)
                    .graph.initializer) for m in ("prefill", "decode"))
    assert sum(hashes.values()) <= saved, (hashes, saved)
