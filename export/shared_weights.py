"""One copy of the weights per artifact folder and per process.

Export: the prefill and decode models hold the same weights; a large stack keeps them in
ONE external-data file (`weights.onnx.data`, each distinct tensor once, page-aligned) that
both models reference. Run time: the file is memory-mapped once and every external
initializer becomes an OrtValue over the mapping, handed to BOTH sessions
(SessionOptions.add_initializer: onnxruntime uses the caller's buffer as is), so the
process holds one copy (the page cache's), not one per session.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import set_external_data

WEIGHTS_FILE = "weights.onnx.data"
ALIGNMENT = 4096  # page-aligned: mappable, and aligned for every element type
SIZE_THRESHOLD = 1024  # smaller initializers stay inside the model


class SharedWeightsWriter:
    """Moves models' initializers into one file, each distinct content once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("wb")
        self._offsets: dict[bytes, int] = {}
        self._end = 0

    def flush(self) -> None:
        self._file.flush()  # before a checker or a session reads the file

    def close(self) -> None:
        self._file.close()

    def externalize(self, proto: onnx.ModelProto) -> None:
        """Point proto's large initializers at the file (writing contents not yet in it)."""
        for tensor in proto.graph.initializer:
            if (tensor.data_location == onnx.TensorProto.EXTERNAL
                    or len(tensor.raw_data) < SIZE_THRESHOLD):
                continue
            data = tensor.raw_data
            key = hashlib.sha256(data).digest()
            if key not in self._offsets:
                pad = -self._end % ALIGNMENT
                self._file.write(b"\0" * pad)
                self._offsets[key] = self._end + pad
                self._file.write(data)
                self._end += pad + len(data)
            set_external_data(tensor, self.path.name, offset=self._offsets[key],
                              length=len(data))
            tensor.ClearField("raw_data")


def _external_field(tensor: onnx.TensorProto, key: str) -> str | None:
    for entry in tensor.external_data:
        if entry.key == key:
            return entry.value
    return None


class SharedWeights:
    """OrtValues over one memory mapping of a folder's weights file, shared by sessions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._values: dict[tuple, ort.OrtValue] = {}

    def initializers(self, model: onnx.ModelProto) -> dict[str, ort.OrtValue]:
        """The model's initializers stored in this file, by name (model loaded without its
        external data)."""
        found = {}
        for tensor in model.graph.initializer:
            if (tensor.data_location != onnx.TensorProto.EXTERNAL
                    or _external_field(tensor, "location") != self.path.name):
                continue
            offset = int(_external_field(tensor, "offset") or 0)
            length = int(_external_field(tensor, "length") or 0)
            key = (offset, length, tensor.data_type, tuple(tensor.dims))
            if key not in self._values:
                itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
                if offset + length > self._map.size or length != itemsize * int(
                        np.prod(tensor.dims, dtype=np.int64)):
                    raise ValueError(f"{self.path}: initializer {tensor.name!r} "
                                     f"(offset {offset}, length {length}) does not fit")
                raw = self._map[offset:offset + length].view(f"u{itemsize}")
                self._values[key] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    raw.reshape(tuple(tensor.dims)), tensor.data_type)
            found[tensor.name] = self._values[key]
        return found

    @property
    def nbytes(self) -> int:
        return int(self._map.size)
