"""What an artifact folder holds besides the models: the manifest (config, layers, roles,
state layout, custom-op domain), written as manifest.json and as each model's
metadata_props."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION
from csa2onnx.export.plan import StackPlan
from csa2onnx.export.state_layout import StateLayout
from csa2onnx.export.weights import linear_formats

MANIFEST = "manifest.json"


def package_version() -> str:
    try:
        return version("csa2onnx")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class Manifest:
    config: dict[str, Any]
    layers: list[int]
    index_keys: str
    portable: bool
    roles: list[dict[str, Any]]
    state: list[dict[str, Any]]  # the StateLayout (export/state_layout.py), as JSON
    external_slots: list[str]
    # layer (as a string, JSON's key type) -> linear -> weight format as stored (dtype, and
    # /panels64 where TorchLinear reads it in place), from config + plan + portable
    linear_formats: dict[str, dict[str, str]] = field(default_factory=dict)
    # layer -> {"at_max_seq_len", "per_1024_tokens", "fixed"}: state bytes at batch 1
    state_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # the one external-data file both models' large weights live in (None: inside them)
    weights_file: str | None = None
    # "exact" (the reference's bits) or "fast" (custom_ops/ops.py); older manifests: exact
    numerics: str = "exact"
    csa2onnx_version: str = field(default_factory=package_version)
    custom_op_domain: str = DOMAIN
    custom_op_version: int = DOMAIN_VERSION

    @property
    def state_layout(self) -> StateLayout:
        return StateLayout.from_json(self.state)

    @property
    def dim(self) -> int:
        return int(self.config["dim"])

    @property
    def max_seq_len(self) -> int:
        return int(self.config["max_seq_len"])

    @property
    def max_batch_size(self) -> int:
        return int(self.config["max_batch_size"])

    def metadata(self) -> dict[str, str]:
        """The manifest as ONNX metadata_props (string values)."""
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in asdict(self).items()}


def manifest_for(plan: StackPlan, portable: bool, weights_file: str | None = None,
                 numerics: str = "exact") -> Manifest:
    return Manifest(
        config=plan.config.to_dict(),
        layers=[p.layer for p in plan.layers],
        index_keys=plan.index_keys,
        portable=portable,
        roles=[{"layer": p.layer, "ratio": p.ratio, "role": p.role} for p in plan.layers],
        state=plan.state_layout().to_json(),
        external_slots=list(plan.external_slots()),
        linear_formats={str(p.layer): linear_formats(plan.config, p, portable=portable,
                                                     numerics=numerics)
                        for p in plan.layers},
        state_bytes=state_bytes_per_layer(plan),
        weights_file=weights_file,
        numerics=numerics,
    )


def state_bytes_per_layer(plan: StackPlan) -> dict[str, dict[str, int]]:
    """Per layer (batch 1): the state at max_seq_len, what 1024 more tokens of context add
    (the caches' rows; a runtime growing by doubling holds up to twice that), and the part
    that does not grow (window ring, compressor state)."""
    layout = plan.state_layout()
    fixed = layout.bytes_per_layer(context=0)
    at_1024 = layout.bytes_per_layer(context=1024)
    at_max = layout.bytes_per_layer()
    return {str(layer): {"at_max_seq_len": at_max[layer],
                         "per_1024_tokens": at_1024[layer] - fixed[layer],
                         "fixed": fixed[layer]} for layer in at_max}


def write_manifest(folder: Path, manifest: Manifest) -> None:
    (folder / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1) + "\n")


def read_manifest(folder: str | Path) -> Manifest:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a csa2onnx artifact folder "
                                "(create one with `csa2onnx export`)")
    return Manifest(**json.loads(path.read_text()))
