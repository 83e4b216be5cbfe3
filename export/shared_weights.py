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
import sys
from collections.abc import Callable, Hashable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from csa2onnx.custom_ops.weight_layout import Pairs16Later, PanelsLater

WEIGHTS_FILE = "weights.onnx.data"
ALIGNMENT = 4096  # page-aligned: mappable, and aligned for every element type
SIZE_THRESHOLD = 1024  # smaller initializers stay inside the model


class ContentDigests:
    """The sha256 of each tensor's bytes, computed once per export: the initializer sharing
    (export/stack.py) and the weights file (SharedWeightsWriter) both ask here, for both
    models. A tensor is known by its source, which both models' tensors of one weight share:
    the array memory an in-memory tensor wraps (a checkpoint view, or an array the export
    prepared), or a lazily packed weight's PackedWeight (PanelsLater). The sources are held
    until the export ends, so no memory is reused under a known key.

    `sink(digest, data)`, when set, sees each tensor's bytes the one time they are computed
    (the writer stores them then): a lazily packed weight is packed once per export."""

    def __init__(self) -> None:
        self._known: dict[Hashable, tuple[bytes, object]] = {}
        self.sink: Callable[[bytes, memoryview], None] | None = None

    def digest(self, tensor: ir.TensorProtocol) -> bytes:
        key, source = _source(tensor)
        known = self._known.get(key)
        if known is not None:
            return known[0]
        data = _raw_view(tensor)  # packs a lazily packed weight
        digest = hashlib.sha256(data).digest()
        if self.sink is not None:
            self.sink(digest, data)
        self._known[key] = (digest, source)
        return digest


def _source(tensor: ir.TensorProtocol) -> tuple[Hashable, object]:
    """A key for where the tensor's bytes come from, and the object to hold for it."""
    if isinstance(tensor, PanelsLater):
        plain = tensor.weight.plain
        return ("panels64", *_memory_key(plain)), tensor.weight
    if isinstance(tensor, Pairs16Later):
        return ("pairs16", *_memory_key(tensor.plain)), tensor.plain
    if isinstance(tensor, ir.Tensor) and isinstance(tensor.raw, np.ndarray):
        return ("array", *_memory_key(tensor.raw)), tensor.raw
    return ("tensor", id(tensor)), tensor


def _memory_key(array: np.ndarray) -> tuple:
    return (array.__array_interface__["data"][0], array.shape, array.strides, array.dtype)


class SharedWeightsWriter:
    """Moves models' initializers into one file, each distinct content once.

    Works on the IR model before it is serialised: each tensor's bytes go from its own
    buffer (a checkpoint tensor is a view of the shard's memory map) straight to the file,
    and the initializer becomes a reference to them. No serialised copy of the weights (a
    protobuf holding every raw_data) is ever made, so an export holds the weights at most
    once (the mapped pages) plus one model's graph.
    """

    def __init__(self, path: Path, digests: ContentDigests) -> None:
        """`digests`: the export's; the writer stores each large tensor's bytes as they are
        hashed (digests.sink), so that nothing is computed twice."""
        self.path = path
        self._file = path.open("wb")
        self._offsets: dict[bytes, int] = {}
        self._end = 0
        self.digests = digests
        digests.sink = self._store

    def flush(self) -> None:
        self._file.flush()  # before a checker or a session reads the file

    def close(self) -> None:
        self._file.close()

    def externalize(self, model: ir.Model) -> None:
        """Point the model's large initializers at the file (writing contents not yet in
        it); they become ir.ExternalTensor, which serialise as external-data entries."""
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if (tensor is None or isinstance(tensor, ir.ExternalTensor)
                    or tensor.nbytes < SIZE_THRESHOLD):
                continue
            key = self.digests.digest(tensor)  # stored now if first seen
            if key not in self._offsets:  # hashed before this writer existed
                self._store(key, _raw_view(tensor))
            value.const_value = ir.ExternalTensor(
                self.path.name, self._offsets[key], tensor.nbytes, tensor.dtype,
                shape=tensor.shape, name=value.name or tensor.name or "",
                base_dir=self.path.parent)

    def _store(self, key: bytes, data: memoryview) -> None:
        """Append a large tensor's bytes, page-aligned, unless the file holds them."""
        if key in self._offsets or len(data) < SIZE_THRESHOLD:
            return
        pad = -self._end % ALIGNMENT
        self._file.write(b"\0" * pad)
        self._offsets[key] = self._end + pad
        self._file.write(data)
        self._end += pad + len(data)


def _raw_view(tensor: ir.TensorProtocol) -> memoryview:
    """The tensor's ONNX raw_data bytes, without a copy where they already lie in memory (a
    whole-byte type held as a little-endian numpy array, as every weight here is; a lazily
    packed one is packed here, into the only copy)."""
    if (isinstance(tensor, (ir.Tensor, ir.LazyTensor)) and sys.byteorder == "little"
            and tensor.dtype.bitwidth % 8 == 0):
        array = tensor.numpy()
        if array.dtype.itemsize * 8 == tensor.dtype.bitwidth:
            return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return memoryview(tensor.tobytes())


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

    @property
    def bytes(self) -> np.ndarray:
        """The whole file as uint8 over the one mapping (read-only)."""
        return np.asarray(self._map)
