"""One copy of the weights: both models reference one external-data file (each distinct
tensor once), and both sessions run on OrtValues over one mapping of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from helpers import golden

from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime, describe
from csa2onnx.export.shared_weights import ALIGNMENT, WEIGHTS_FILE
from csa2onnx.export.stack import export_stack
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
    for p in plan.layers:
        sizes = manifest.state_bytes[str(p.layer)]
        window = config.window_size * config.head_dim * 4
        if p.kv_source:
            rows = config.max_seq_len // p.ratio
            extra = rows * config.head_dim * 4 + (2 * p.ratio * config.head_dim * 4
                                                  if p.ratio > 1 else 0)
            if p.owns_index_k:
                extra += rows * config.index_head_dim * 4
            assert sizes["at_max_seq_len"] == window + extra
            assert sizes["per_1024_tokens"] > 0
        else:
            assert sizes == {"at_max_seq_len": window, "per_1024_tokens": 0, "fixed": window}
