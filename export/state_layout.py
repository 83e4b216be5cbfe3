"""The state layout: every tensor a stack carries between calls, typed, in one place.

One `StateTensor` per (layer, role) says what the tensor holds, how its values are stored,
its shape, and which call reads and writes it. The plan builds the layout
(`StackPlan.state_layout()`); the graphs' inputs and outputs, the manifest, the runtime's
buffers, `inspect` and the state-bytes report are all derived from it, and nothing parses a
state name: names are made here and only here.

Both calls read and write every tensor (a prefill may continue a sequence; one at
start_pos 0 ignores what it reads, except that caches are never reset, as upstream's
buffers are not). Two kinds of access:
- `in_place` caches (compressed KV, index keys) come into every call as `past.*` and leave
  as `present.*` written in place (custom_ops WriteRows; the runtime binds both to one
  buffer). Their rows axis is dynamic: the runtime holds the rows the context needs.
- `replaced` tensors (window ring, the compressor's partial group, the index_k publisher)
  are small; each call that carries them returns a new copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal, get_args

from csa2onnx.custom_ops.constants import packed_row_bytes
from csa2onnx.graphs.kv_cache import COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT, WINDOW_FORMAT

StateRole = Literal["window_kv", "compressor.kv_state", "compressor.score_state",
                    "compress_kv", "index_k", "index_k_publisher"]
Access = Literal["in_place", "replaced"]


@dataclass(frozen=True)
class Storage:
    """How one row of `width` values is stored: element type and elements per row. A
    packed storage (custom_ops PackQuantized's formats) holds the codes then the block
    scales of a row as bytes; unpacking gives the round trip's values exactly."""

    name: str
    dtype: Literal["float32", "int64", "uint8"]
    itemsize: int
    what: str
    packed: bool = False

    def row_elements(self, width: int) -> int:
        return packed_row_bytes(self.name, width) if self.packed else width


STORAGES = {s.name: s for s in (
    Storage("f32", "float32", 4, "float32"),
    Storage("int64", "int64", 8, "int64"),
    Storage("fp8_e8m0_32", "uint8", 1, "e4m3 codes + an e8m0 scale per 32 (8.25 bits a value)",
            packed=True),
    Storage("fp4_e4m3_16", "uint8", 1, "e2m1 codes + an e4m3 scale per 16 (4.5 bits a value)",
            packed=True),
    Storage("fp4_e8m0_32", "uint8", 1, "e2m1 codes + an e8m0 scale per 32 (4.25 bits a value)",
            packed=True),
)}

# How each role is stored. The caches and the window hold quantised values (reference.md:
# the latent's fp4 with e4m3 scales, the index keys' fp4 with e8m0 scales, the window's
# act_quant fp8), so they are kept packed; the compressor's open group is float32.
ROLE_STORAGE: dict[str, str] = {
    "window_kv": WINDOW_FORMAT, "compressor.kv_state": "f32", "compressor.score_state": "f32",
    "compress_kv": COMPRESSED_KV_FORMAT, "index_k": INDEX_KEY_FORMAT,
    "index_k_publisher": "int64"}


@dataclass(frozen=True)
class StateTensor:
    """One tensor carried between calls.

    `rows` is the second dimension at max_seq_len for a cache (in_place), else fixed;
    `width` is the number of VALUES per row (a packed storage holds fewer elements).
    A cache read by a layer of ratio r at context end_pos needs end_pos // r rows:
    `read_ratio` is the smallest ratio any reader slices it with."""

    role: StateRole
    layer: int | None  # None: the stack's own (the index_k publisher)
    rows: int
    width: int
    access: Access
    description: str
    read_ratio: int = 0

    def __post_init__(self) -> None:
        if self.role not in get_args(StateRole):
            raise ValueError(f"unknown state role {self.role!r}")
        if (self.access == "in_place") != (self.read_ratio > 0):
            raise ValueError(f"{self.name}: in-place caches and only they have a read_ratio")

    @property
    def name(self) -> str:
        return self.role if self.layer is None else f"L{self.layer}.{self.role}"

    @property
    def input_name(self) -> str:
        return f"past.{self.name}"

    @property
    def output_name(self) -> str:
        return f"present.{self.name}"

    @property
    def storage(self) -> str:
        return ROLE_STORAGE[self.role]

    @property
    def packed(self) -> bool:
        return STORAGES[self.storage].packed

    @property
    def dtype(self) -> str:
        return STORAGES[self.storage].dtype

    @property
    def in_place(self) -> bool:
        return self.access == "in_place"

    @property
    def row_elements(self) -> int:
        return STORAGES[self.storage].row_elements(self.width)

    def rows_for(self, end_pos: int) -> int:
        """Rows a call with context end_pos may write or read (slices clamp at `rows`)."""
        return min(self.rows, end_pos // self.read_ratio) if self.in_place else self.rows

    def shape(self, batch: int | str = "batch") -> list[int | str]:
        """The stored shape at max_seq_len (the publisher is one int64, no batch)."""
        if self.layer is None:
            return [self.row_elements]
        return [batch, self.rows, self.row_elements]

    def graph_shape(self) -> list[int | str]:
        """The graphs' shape: a cache's rows are a named dynamic dimension."""
        shape = self.shape()
        if self.in_place:
            shape[1] = f"{self.name}.rows"
        return shape

    def nbytes(self, batch: int = 1, context: int | None = None) -> int:
        """Bytes held at `context` tokens (a cache: rows_for(context); default: all rows)."""
        rows = self.rows if context is None else self.rows_for(context)
        count = self.row_elements if self.layer is None else batch * rows * self.row_elements
        return count * STORAGES[self.storage].itemsize

    def to_json(self) -> dict:
        return {**asdict(self), "name": self.name, "storage": self.storage,
                "dtype": self.dtype, "shape": self.shape()}

    @classmethod
    def from_json(cls, entry: dict) -> StateTensor:
        fields = {k: entry[k] for k in cls.__dataclass_fields__}
        return cls(**fields)


@dataclass(frozen=True)
class StateLayout:
    """A stack's state, in a fixed order (the graphs' input and output order)."""

    tensors: tuple[StateTensor, ...]

    def __iter__(self) -> Iterator[StateTensor]:
        return iter(self.tensors)

    def get(self, layer: int | None, role: StateRole) -> StateTensor | None:
        return next((t for t in self.tensors if t.layer == layer and t.role == role), None)

    def __getitem__(self, name: str) -> StateTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no state tensor {name!r}")

    @property
    def caches(self) -> tuple[StateTensor, ...]:
        return tuple(t for t in self.tensors if t.in_place)

    def bytes_per_layer(self, batch: int = 1, context: int | None = None) -> dict[int, int]:
        """Bytes per layer at `context` tokens (default max_seq_len); the publisher, the
        stack's own, is left out."""
        sizes: dict[int, int] = {}
        for t in self.tensors:
            if t.layer is not None:
                sizes[t.layer] = sizes.get(t.layer, 0) + t.nbytes(batch, context)
        return sizes

    def to_json(self) -> list[dict]:
        return [t.to_json() for t in self.tensors]

    @classmethod
    def from_json(cls, entries: list[dict]) -> StateLayout:
        return cls(tuple(StateTensor.from_json(e) for e in entries))
