"""The runtime: loads exported prefill/decode artifacts and owns the state between calls.

State stays in OrtValues bound through IOBinding. A cache (compressed KV, index keys) is
ONE buffer bound as both its past.* input and its present.* output, which the graph's
WriteRows nodes update in place: a call writes only its new rows, so its cost does not
depend on the cache's size. Caches are allocated zeroed (as the reference's fresh module)
and kept across sequences; their capacity grows with the context by doubling (copying
the rows on growth) up to max_seq_len // r rows, so memory follows the context, not
max_seq_len. The small state (window ring, compressor's partial group) is a new output
each call that becomes the next call's input.

Memory: the weights are one mapping of the artifact's weights file that both sessions
read in place (TorchLinear's are stored in its kernel's panels). The prefill session runs
without onnxruntime's CPU arena: an arena would keep a prefill's activations (they grow
with the prompt: ~250 MiB at 256 tokens, ~1.9 GiB at 1024 for three released-size layers)
resident for as long as the runtime lives; without it they go back to the allocator after
each call, for a few percent of prefill time. Decode (small activations, latency per token)
keeps the arena.
"""

from __future__ import annotations

import ctypes
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from csa2onnx.custom_ops import session_options
from csa2onnx.custom_ops.library import check_onnxruntime
from csa2onnx.custom_ops.reference import unpack_quantized
from csa2onnx.export.artifacts import Manifest, read_manifest
from csa2onnx.export.graph_io import START_POS, layer_input, layer_output, slot_input
from csa2onnx.export.shared_weights import SharedWeights
from csa2onnx.export.state_layout import STORAGES

_ELEMENT_BYTES = {"tensor(float)": 4, "tensor(int64)": 8, "tensor(int32)": 4,
                  "tensor(bool)": 1, "tensor(bfloat16)": 2, "tensor(float16)": 2,
                  "tensor(uint8)": 1, "tensor(float8e4m3fn)": 1}


class RuntimeStateError(RuntimeError):
    """A call that does not fit the state (decode before prefill, batch, positions)."""


@dataclass
class StepOutputs:
    """One call's per-layer outputs (`out`), and any extra outputs by name."""

    out: dict[int, np.ndarray]
    extra: dict[str, np.ndarray]


MIN_CACHE_ROWS = 256  # a cache's first capacity (or all its rows, if fewer)


def page_returner() -> Callable[[], None]:
    """glibc keeps the pages a prefill's activations were freed from (about 0.6 GiB after a
    1024-token prefill of three released layers) until something else reuses them;
    malloc_trim hands them back to the system. A no-op where the C library is not glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class AttentionRuntime:
    """Runs a stack's prefill and decode artifacts, holding its state."""

    def __init__(self, folder: str | Path, provider: str = "cpu",
                 intra_op_num_threads: int = 0, spinning: bool = True,
                 grow_caches: bool = True, in_place: bool = True,
                 share_weights: bool = True, prefill_arena: bool = False,
                 profile_prefix: str | Path | None = None) -> None:
        """`spinning=False` keeps idle intra-op threads from spinning between calls (for
        benchmarks beside another framework). For comparisons: `grow_caches=False`
        allocates every cache at max_seq_len // r rows up front instead of growing it with
        the context; `in_place=False` gives each call new cache outputs (WriteRows then
        copies the whole cache, as before in-place state); `share_weights=False` lets each
        session load its own copy of the weights; `prefill_arena=True` gives the prefill
        session onnxruntime's CPU arena (slightly faster prefills, whose activations then
        stay resident). `profile_prefix`: each session writes onnxruntime's profile (every
        node's time, each run) to a JSON file named from it, when the session ends."""
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder)
        self.grow_caches = grow_caches
        # A portable artifact runs WriteRows as its standard-op function body, which
        # onnxruntime inlines, dropping the unused ordering input: copy there instead.
        self.in_place = in_place and not self.manifest.portable
        self.share_weights = share_weights
        self.prefill_arena = prefill_arena
        self.profile_prefix = profile_prefix
        self.layout = self.manifest.state_layout
        self.caches = {t.name: t for t in self.layout.caches}
        providers = ["CPUExecutionProvider"]
        if provider == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise RuntimeStateError("CUDAExecutionProvider is not available in this "
                                        "onnxruntime build (install onnxruntime-gpu)")
            providers.insert(0, "CUDAExecutionProvider")
        elif provider != "cpu":
            raise ValueError(f"provider must be 'cpu' or 'cuda', got {provider!r}")
        if (isinstance(intra_op_num_threads, bool) or not isinstance(intra_op_num_threads, int)
                or intra_op_num_threads < 0):
            raise ValueError("intra_op_num_threads must be an int >= 0 (0: onnxruntime's "
                             f"default), got {intra_op_num_threads!r}")
        self.device = "cuda" if provider == "cuda" else "cpu"
        # One mapping of the weights file, its tensors handed to both sessions.
        self.weights = (SharedWeights(self.folder / self.manifest.weights_file)
                        if self.manifest.weights_file else None)
        self.sessions = {mode: self._session(mode, providers, intra_op_num_threads, spinning)
                         for mode in ("prefill", "decode")}
        self._declared_inputs = {i.name: (i.type, i.shape)
                                 for i in self.sessions["decode"].get_inputs()}
        self.state: dict[str, ort.OrtValue] = {}
        self._host: dict[str, np.ndarray] = {}  # CPU caches: the arrays their OrtValues share
        self.position = 0  # tokens seen so far (next start_pos)
        self.batch = 0
        self.started = False  # whether a prefill has run (decode needs one)
        self._return_freed_pages = page_returner()

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    # ---------------------------------------------------------------- calls
    def prefill(self, xs: dict[int, np.ndarray], slots: dict[str, np.ndarray] | None = None,
                *, start_pos: int = 0) -> StepOutputs:
        """Start a sequence (start_pos 0), or continue it with more prompt tokens
        (chunked prefill: start_pos = the tokens seen so far). xs[layer] is [batch, seqlen,
        dim]; `slots` fills the slots a sub-stack reads from layers outside it
        (manifest.external_slots)."""
        batch, seqlen = self._check_inputs(xs)
        if start_pos != 0:
            if not self.started:
                raise RuntimeStateError(f"a prefill at start_pos {start_pos} continues a "
                                        "sequence: run one at start_pos 0 first")
            if start_pos != self.position:
                raise RuntimeStateError(f"start_pos {start_pos} is not the sequence's next "
                                        f"position {self.position}")
            if batch != self.batch:
                raise RuntimeStateError(f"prefill batch {batch} differs from the "
                                        f"sequence's batch {self.batch}")
        if start_pos + seqlen > self.manifest.max_seq_len:
            raise RuntimeStateError(f"prefill of {seqlen} tokens at start_pos {start_pos} is "
                                    f"past max_seq_len {self.manifest.max_seq_len}")
        if batch > self.manifest.max_batch_size:
            raise RuntimeStateError(f"batch {batch} is larger than max_batch_size "
                                    f"{self.manifest.max_batch_size}")
        feeds = self._feeds(xs, slots)
        self._ensure_caches(batch, start_pos + seqlen)
        if start_pos == 0:
            self._fresh_sequence(batch)
        feeds[START_POS] = self._ortvalue(np.array([start_pos], np.int64))
        for t in self.layout:
            feeds[t.input_name] = self.state[t.name]
        result = self._run("prefill", feeds)
        if not self.prefill_arena:
            self._return_freed_pages()
        self.batch, self.position, self.started = batch, start_pos + seqlen, True
        return result

    def decode(self, xs: dict[int, np.ndarray],
               slots: dict[str, np.ndarray] | None = None) -> StepOutputs:
        """One more token: xs[layer] is [batch, 1, dim]."""
        if not self.started:
            raise RuntimeStateError("decode called before any prefill")
        batch, seqlen = self._check_inputs(xs)
        if seqlen != 1:
            raise RuntimeStateError(f"decode takes one token per call, got seqlen {seqlen}")
        if batch != self.batch:
            raise RuntimeStateError(f"decode batch {batch} differs from the prefill's "
                                    f"batch {self.batch}")
        if self.position >= self.manifest.max_seq_len:
            raise RuntimeStateError(f"position {self.position} is past max_seq_len "
                                    f"{self.manifest.max_seq_len}")
        feeds = self._feeds(xs, slots)
        self._ensure_caches(batch, self.position + 1)
        feeds[START_POS] = self._ortvalue(np.array([self.position], np.int64))
        for t in self.layout:
            feeds[t.input_name] = self.state[t.name]
        result = self._run("decode", feeds)
        self.position += 1
        return result

    def skip_to(self, position: int) -> None:
        """For benchmarks at long contexts: go on at `position` as if the tokens between had
        left zero state (the caches grow to hold their rows, which stay zero, as upstream's
        fresh caches; the window and compressor state stay as they are). What a decode step
        then costs is what it costs at that context; what it outputs is no model's. The
        caches double on the way, as a sequence growing to `position` would have them, so
        the next decode step finds the capacity it would find there (not a growth copy)."""
        if not self.started:
            raise RuntimeStateError("skip_to needs a prefill first")
        if isinstance(position, bool) or not isinstance(position, numbers.Integral):
            raise RuntimeStateError(f"skip_to takes an integer position, got {position!r}")
        position = int(position)
        if position < self.position:
            raise RuntimeStateError(f"skip_to goes forward only: position {position!r} is "
                                    f"before the sequence's next position {self.position}")
        if position >= self.manifest.max_seq_len:
            raise RuntimeStateError(f"position {position} is past max_seq_len "
                                    f"{self.manifest.max_seq_len}")
        end = max(self.position, 1)
        while end < position + 1:  # through the sizes a growing sequence passes
            end = min(2 * end, position + 1)
            self._ensure_caches(self.batch, end)
        self.position = position

    def state_bytes(self) -> int:
        """Bytes of the state held between calls."""
        return sum(int(np.prod(v.shape())) * _ELEMENT_BYTES[v.data_type()]
                   for v in self.state.values())

    def state_array(self, name: str) -> np.ndarray:
        """A state tensor's values (a cache: the rows it holds now; packed storage
        unpacked, exactly the values the graphs compute with)."""
        t = self.layout[name]
        array = np.array(self.state[name].numpy())
        return unpack_quantized(array, t.storage, t.width) if t.packed else array

    def cache_rows(self) -> dict[str, int]:
        """The rows each cache holds now (its capacity)."""
        return {name: self.state[name].shape()[1] for name in self.caches if name in self.state}

    def _session(self, mode: str, providers: list[str], threads: int,
                 spinning: bool) -> ort.InferenceSession:
        if self.manifest.portable:  # standard ONNX only: no custom-op library needed
            check_onnxruntime()  # the version floor holds without the library too
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
        else:
            options = session_options(threads)
        # onnxruntime warns that the If branches reading the index_k slot keep an implicit
        # input's name when it renames values; harmless, and noise for a user.
        options.log_severity_level = 3
        if not spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if mode == "prefill" and not self.prefill_arena:
            options.enable_cpu_mem_arena = False  # activations freed after each call
        if self.profile_prefix is not None:
            options.enable_profiling = True
            options.profile_file_prefix = f"{self.profile_prefix}_{mode}"
        path = self.folder / f"{mode}.onnx"
        if self.weights is not None and self.device == "cpu" and self.share_weights:
            # onnxruntime uses these buffers as they are (no copy) and never loads them
            # from the file itself: the sessions' weights are the one mapping.
            model = onnx.load(str(path), load_external_data=False)
            for name, value in self.weights.initializers(model).items():
                options.add_initializer(name, value)
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)

    # --------------------------------------------------------------- caches
    def _ensure_caches(self, batch: int, end_pos: int) -> None:
        """Every cache holds `batch` entries and the rows a call ending at end_pos reads:
        grown by doubling (old rows copied, new ones zero, as never written upstream)."""
        for spec in self.caches.values():
            value = self.state.get(spec.name)
            old_batch, old_rows = (value.shape()[0], value.shape()[1]) if value else (0, 0)
            need = spec.rows_for(end_pos)
            if value is not None and old_batch == batch and old_rows >= need:
                continue
            if not self.grow_caches:
                rows = spec.rows
            elif value is None or old_batch != batch:
                rows = min(spec.rows, max(need, old_rows, MIN_CACHE_ROWS))
            else:
                rows = min(spec.rows, max(need, 2 * old_rows))
            try:
                array = np.zeros((batch, rows, spec.row_elements), np.dtype(spec.dtype))
            except (MemoryError, ValueError):  # ValueError: past numpy's largest array
                size = batch * rows * spec.row_elements * np.dtype(spec.dtype).itemsize
                raise RuntimeStateError(
                    f"state {spec.name}: {batch} x {rows} rows of {spec.row_elements} "
                    f"{spec.dtype} ({size / 2**30:.1f} GiB) do not fit in memory"
                    + ("" if self.grow_caches else "; caches made whole at max_seq_len "
                       "rows (grow_caches=False) need it up front")) from None
            if value is not None:  # a batch change keeps the entries both have
                keep_b, keep_r = min(batch, old_batch), min(rows, old_rows)
                old = self._host.get(spec.name)
                old = old if old is not None else value.numpy()
                array[:keep_b, :keep_r] = old[:keep_b, :keep_r]
            self._set_cache(spec.name, array)

    def _set_cache(self, name: str, array: np.ndarray) -> None:
        if self.device == "cpu":  # the OrtValue shares the array's memory: keep it alive
            self._host[name] = array
            self.state[name] = ort.OrtValue.ortvalue_from_numpy(array)
        else:
            self.state[name] = ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    # -------------------------------------------------------------- helpers
    def _feeds(self, xs: dict[int, np.ndarray],
               slots: dict[str, np.ndarray] | None) -> dict[str, ort.OrtValue]:
        slots = slots or {}
        missing = sorted(set(self.manifest.external_slots) - set(slots))
        if missing:
            raise RuntimeStateError(f"this sub-stack reads slots written outside it: pass "
                                    f"{', '.join(missing)} (see manifest external_slots)")
        extra = sorted(set(slots) - set(self.manifest.external_slots))
        if extra:
            raise ValueError(f"slots {', '.join(extra)}: this sub-stack does not read them (it "
                             f"reads {', '.join(self.manifest.external_slots) or 'none'})")
        feeds = {layer_input(layer): self._ortvalue(x) for layer, x in xs.items()}
        for name, value in slots.items():
            feeds[slot_input(name)] = self._ortvalue(value)
            self._check_slot(name, feeds[slot_input(name)])
        return feeds

    def _check_slot(self, name: str, value: ort.OrtValue) -> None:
        """A slot array of the type and rank the graph declares (onnxruntime's own error
        does not name the slot)."""
        want_type, want_shape = self._declared_inputs[slot_input(name)]
        got_type, got_shape = value.data_type(), value.shape()
        if got_type != want_type or len(got_shape) != len(want_shape):
            raise ValueError(f"slot {name}: expected {want_type} of rank {len(want_shape)} "
                             f"{want_shape}, got {got_type} {got_shape}")

    def _check_inputs(self, xs: dict[int, np.ndarray]) -> tuple[int, int]:
        if sorted(xs) != self.layers:
            raise ValueError(f"inputs for layers {sorted(xs)}; this stack has {self.layers}")
        shapes = {np.shape(x) for x in xs.values()}
        if len(shapes) != 1:
            raise ValueError(f"all layer inputs must share one shape, got {sorted(shapes)}")
        (shape,) = shapes
        if len(shape) != 3 or shape[2] != self.manifest.dim:
            raise ValueError(f"layer inputs must be [batch, seqlen, {self.manifest.dim}], "
                             f"got {list(shape)}")
        return int(shape[0]), int(shape[1])

    def _ortvalue(self, array: np.ndarray) -> ort.OrtValue:
        array = np.asarray(array)
        dtype = (array.dtype if array.dtype in (np.uint8, np.bool_)
                 else np.int64 if array.dtype.kind in "iu" else np.float32)
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array, dtype=dtype),
                                                self.device, 0)

    def _fresh_sequence(self, batch: int) -> None:
        """A prefill at start_pos 0 reads the window ring and the open group but ignores
        them: give it zeros of its batch. Caches and the index_k publisher carry over (the
        reference's module buffers and its SharedAttentionRuntime are never reset)."""
        for t in self.layout:
            if t.in_place:
                continue
            if t.role == "index_k_publisher":
                if t.name not in self.state:  # no owner has published yet
                    self.state[t.name] = self._ortvalue(np.full([1], -1, np.int64))
                continue
            self.state[t.name] = self._ortvalue(np.zeros(t.shape(batch), np.dtype(t.dtype)))

    def _run(self, mode: str, feeds: dict[str, ort.OrtValue]) -> StepOutputs:
        session = self.sessions[mode]
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, value)
        names = [o.name for o in session.get_outputs()]
        state_out = {t.output_name: t for t in self.layout}
        in_place = {name for name, t in state_out.items() if t.in_place and self.in_place}
        for name in names:
            if name in in_place:  # the past input's own buffer: WriteRows writes into it
                binding.bind_ortvalue_output(name, feeds[state_out[name].input_name])
            else:
                binding.bind_output(name, self.device)
        session.run_with_iobinding(binding)
        values = dict(zip(names, binding.get_outputs(), strict=True))
        self.state.update({state_out[name].name: v for name, v in values.items()
                           if name in state_out and name not in in_place})
        if not self.in_place:
            self._host.clear()  # the caches are onnxruntime's outputs now
        layer_of = {layer_output(layer): layer for layer in self.layers}
        out = {layer_of[name]: v.numpy() for name, v in values.items() if name in layer_of}
        extra = {name: v.numpy() for name, v in values.items()
                 if name not in layer_of and name not in state_out}
        return StepOutputs(out, extra)


def model_metadata(path: str | Path) -> dict[str, str]:
    """metadata_props of an artifact, without loading its weights."""
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def _slot_meaning(name: str, manifest: Manifest) -> str:
    return {"compress_kv": "the kv source's packed compressed-KV cache",
            "index_k": "the key cache the index_k slot points to, packed",
            "topk_idxs": "the last index source's selection",
            "candidates": "the candidate source's kept blocks, a value a block of "
                          f"{manifest.config['candidate_block_size']} compressed positions"}[name]


def describe(folder: str | Path) -> str:
    """A short human summary of an artifact folder (used by `csa2onnx inspect`)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    lines = [f"csa2onnx artifacts in {folder}", f"  layers: {list(manifest.layers)}",
             f"  index_keys: {manifest.index_keys}, portable: {manifest.portable}, "
             f"numerics: {manifest.numerics}"]
    for role in manifest.roles:
        lines.append(f"  L{role['layer']}: ratio {role['ratio']}, {role['role']}")
        formats = manifest.linear_formats.get(str(role["layer"]))
        if formats:  # manifests from before linear_formats have none
            lines.append("    linears: " + ", ".join(f"{k} {v}" for k, v in formats.items()))
    lines.append("  state (caches written in place, grown with the context up to the shape "
                 "shown, which is at max_seq_len):")
    for t in manifest.state_layout:
        how = " in place" if t.in_place else ""
        lines.append(f"    {t.name}: {t.dtype}{t.shape()}{how}, {STORAGES[t.storage].what} "
                     f"({t.description})")
    if manifest.state_bytes:  # manifests from before state_bytes have none
        lines.append(f"  state bytes per layer, batch 1 (at max_seq_len {manifest.max_seq_len}; "
                     "per 1024 tokens of context, before doubling's slack; fixed):")
        for layer, sizes in manifest.state_bytes.items():
            lines.append(f"    L{layer}: {sizes['at_max_seq_len'] / 2**20:.2f} MiB; "
                         f"{sizes['per_1024_tokens'] / 2**10:.0f} KiB / 1024 tokens; "
                         f"{sizes['fixed'] / 2**10:.0f} KiB fixed")
    models = {mode: onnx.load(str(folder / f"{mode}.onnx"), load_external_data=False)
              for mode in ("prefill", "decode")}
    if manifest.external_slots:
        lines.append("  slots read from layers outside the range (inputs slot_in.*, from an "
                     "earlier range's slot_out.*):")
        inputs = {i.name: i.type.tensor_type for i in models["prefill"].graph.input}
        for name in manifest.external_slots:
            t = inputs[slot_input(name)]
            dims = [d.dim_param or d.dim_value for d in t.shape.dim]
            lines.append(f"    {name}: {onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)}{dims}"
                         f" ({_slot_meaning(name, manifest)})")
    if manifest.weights_file:
        lines.append(f"  weights: {manifest.weights_file}, shared by both models "
                     f"({(folder / manifest.weights_file).stat().st_size / 2**20:.1f} MiB)")
    for mode, model in models.items():
        path = folder / f"{mode}.onnx"
        ops: dict[str, int] = {}
        for node in model.graph.node:
            key = f"{node.domain + '.' if node.domain else ''}{node.op_type}"
            ops[key] = ops.get(key, 0) + 1
        size = path.stat().st_size
        top = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:8])
        lines.append(f"  {mode}.onnx: {size / 2**20:.1f} MiB, {len(model.graph.node)} nodes "
                     f"({top})")
    return "\n".join(lines)
