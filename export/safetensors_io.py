"""The safetensors file format, read lazily and written plainly.

A file is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {...}}` and the raw
little-endian data (offsets relative to the end of the header). Reading parses only the
header; a tensor is a read-only view into a memory map of the file, so only the pages of the
tensors used are ever read. (The `safetensors` package's numpy API cannot return fp8 or e8m0
tensors, and copies each tensor it returns.)
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# The dtypes an attention tensor can be stored in.
DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
# What the writer also handles (non-attention tensors in synthetic checkpoints).
_NAMES = {dtype: name for name, dtype in
          {**DTYPES, "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8)}.items()}
MAX_HEADER_BYTES = 100 << 20  # the format's own limit


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor that cannot be read."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # the safetensors name (BF16, F8_E4M3, ...)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One .safetensors file: its header on opening, tensors memory-mapped on request."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise SafetensorsError(f"{self.path}: not a safetensors file "
                                           f"({size} bytes, shorter than the header length)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    raise SafetensorsError(f"{self.path}: truncated or not safetensors (header "
                                           f"of {header_len} bytes, file of {size})")
                raw = f.read(header_len)
        except OSError as error:
            raise SafetensorsError(f"{self.path}: cannot read ({error.strerror})") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise SafetensorsError(f"{self.path}: header is not valid JSON ({error})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        body = 8 + header_len
        self.entries = {name: self._entry(name, info, body, size)
                        for name, info in header.items()}

    def _entry(self, name: str, info: Any, body: int, size: int) -> TensorEntry:
        try:
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{self.path}: malformed header entry for {name}: "
                                   f"{info!r}") from None
        if not 0 <= start <= end or min(shape, default=0) < 0:
            raise SafetensorsError(f"{self.path}: {name} has invalid offsets {[start, end]} "
                                   f"or shape {list(shape)}")
        if body + end > size:
            raise SafetensorsError(f"{self.path}: truncated: {name} ends at byte {body + end}, "
                                   f"the file has {size}")
        if dtype in DTYPES and end - start != DTYPES[dtype].itemsize * int(np.prod(shape)):
            raise SafetensorsError(f"{self.path}: {name} has {end - start} bytes for "
                                   f"{dtype}{list(shape)}")
        return TensorEntry(name, dtype, shape, body + start, end - start)

    def tensor(self, name: str) -> np.ndarray:
        """`name` in its stored dtype, a read-only view of the file (nothing is copied)."""
        entry = self.entries[name]
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise SafetensorsError(f"{self.path}: {name} has dtype {entry.dtype}; supported: "
                                   f"{', '.join(DTYPES)}")
        if entry.nbytes == 0:
            return np.zeros(entry.shape, dtype)
        if self._map is None:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(self._map, np.uint8, entry.nbytes, entry.offset)
        return data.view(dtype).reshape(entry.shape)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (in this order) as a safetensors file."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    arrays = {}
    for name, value in tensors.items():
        array = np.ascontiguousarray(value)
        if array.dtype not in _NAMES:
            raise SafetensorsError(f"{name}: cannot write dtype {array.dtype}")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays[name] = array
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in arrays.values():
            f.write(array.reshape(-1).view(np.uint8).data)
