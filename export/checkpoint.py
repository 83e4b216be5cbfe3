"""A Hugging Face model folder as the release lays it out: config.json, and either
model.safetensors.index.json naming the shard of every tensor, or one model.safetensors.

Only the attention tensors of the layers asked for are read (`layers.{l}.attn.{param}`,
optionally prefixed `model.`), memory-mapped in their stored dtypes; experts, embeddings and
other layers are never touched. Each layer's tensors are checked against the config's table
(weights.expected_tensors): a missing or unexpected attention tensor is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile
from csa2onnx.export.weights import LayerWeights, WeightsError, attention_name, check_layer

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(WeightsError):
    """A model folder that cannot be read as a checkpoint."""


@dataclass
class Checkpoint:
    """An opened model folder: its config, and where each attention tensor lives."""

    folder: Path
    config: AttentionConfig
    # layer -> param -> (tensor name in the file, shard path)
    attention: dict[int, dict[str, tuple[str, Path]]]
    _files: dict[Path, SafetensorsFile] = field(default_factory=dict, repr=False)

    def read_layer(self, layer: int) -> LayerWeights:
        """The layer's attention tensors, checked, in stored dtypes (scales as float32)."""
        if not 0 <= layer < self.config.n_layers:
            raise CheckpointError(f"{self.folder}: layer {layer} is outside "
                                  f"0..{self.config.n_layers - 1}")
        located = self.attention.get(layer, {})
        weights, sources = {}, {}
        for param, (name, path) in located.items():
            file = self._file(path)
            if name not in file.entries:
                raise CheckpointError(f"{INDEX} places {name} in {path.name}, which does not "
                                      "hold it")
            entry = file.entries[name]
            if entry.dtype not in DTYPES:
                raise CheckpointError(f"{path}: {name} has dtype {entry.dtype}; attention "
                                      f"tensors can be {', '.join(DTYPES)}")
            weights[param], sources[param] = file.tensor(name), path.name
        try:
            return check_layer(self.config, layer, weights, sources)
        except WeightsError as error:
            raise CheckpointError(f"{self.folder}: {error}") from None

    def read_layers(self, layers: Iterable[int]) -> dict[int, LayerWeights]:
        return {layer: self.read_layer(layer) for layer in layers}

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            self._files[path] = SafetensorsFile(path)
        return self._files[path]


def open_checkpoint(model_dir: str | Path, **overrides: Any) -> Checkpoint:
    """Read `model_dir`'s config.json (overrides as for AttentionConfig.load) and the
    index or single file's tensor names; no tensor data is read."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    if not (folder / CONFIG).is_file():
        raise CheckpointError(f"{folder}: no {CONFIG} (a Hugging Face model folder has one)")
    config = AttentionConfig.load(folder / CONFIG, **overrides)  # its errors name the file
    if (folder / INDEX).is_file():
        names = _index_names(folder)
    elif (folder / SINGLE).is_file():
        try:
            file = SafetensorsFile(folder / SINGLE)
        except SafetensorsError as error:
            raise CheckpointError(str(error)) from None
        names = dict.fromkeys(file.entries, folder / SINGLE)
    else:
        raise CheckpointError(f"{folder}: neither {INDEX} nor {SINGLE}")
    attention: dict[int, dict[str, tuple[str, Path]]] = {}
    for name, path in names.items():
        found = attention_name(name)
        if found:
            layer, param = found
            if param in attention.setdefault(layer, {}):
                raise CheckpointError(f"{folder}: layer {layer} {param} appears twice "
                                      f"({attention[layer][param][0]} and {name})")
            attention[layer][param] = (name, path)
    return Checkpoint(folder, config, attention)


def _index_names(folder: Path) -> dict[str, Path]:
    """Tensor name -> shard path from the index; every shard it names must exist."""
    path = folder / INDEX
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        names = {str(name): folder / str(shard) for name, shard in weight_map.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path}: not a safetensors index (needs a weight_map: "
                              f"{error!r})") from None
    missing = sorted({p.name for p in names.values() if not p.is_file()})
    if missing:
        raise CheckpointError(f"{path} names shard(s) that are not in {folder}: "
                              f"{', '.join(missing)}")
    return names
