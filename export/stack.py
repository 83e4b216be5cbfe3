"""Export a stack of attention layers (one layer is a stack of one) as a prefill model and a
decode model. Inputs: x.L{l} per layer (the blocks between attention layers are not part of
the export), start_pos (decode), past.* state, slot_in.* for slots written outside the
range. Outputs: out.L{l}, present.* state, slot_out.* for the slots the range writes (names
from export/graph_io.py and export/state_layout.py).
A cache's present.* output is its past.* input written in place (export/in_place.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript import GraphBuilder

from csa2onnx.custom_ops.constants import packed_row_bytes
from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION
from csa2onnx.custom_ops.ops import NUMERICS_KEY, PORTABLE_KEY, Numerics, check_numerics
from csa2onnx.custom_ops.portable import portable_functions
from csa2onnx.custom_ops.weight_layout import PANELS64, PackedWeight, packed_later
from csa2onnx.export.artifacts import manifest_for, write_manifest
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.graph_io import (
    START_POS,
    debug_output,
    layer_input,
    layer_output,
    slot_input,
    slot_output,
)
from csa2onnx.export.in_place import check_in_place_order, in_place_writes
from csa2onnx.export.layer import STATE_FIELDS, AttentionLayer, Debug, LayerState, Mode
from csa2onnx.export.plan import StackPlan, plan_layer
from csa2onnx.export.shared_weights import WEIGHTS_FILE, ContentDigests, SharedWeightsWriter
from csa2onnx.export.slots import Slots
from csa2onnx.export.weights import (
    LayerWeights,
    check_layer,
    expected_tensors,
    is_linear,
    linear_layout,
)
from csa2onnx.graphs.kv_cache import COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT
from csa2onnx.graphs.numerics import Fp8Weight
from csa2onnx.graphs.standalone import IR_VERSION, OPSET, check_parameter_names

# Per-layer intermediates a debug export also returns (as L{l}.{name}), named as the goldens.
DEBUG_OUTPUTS = ("qr", "q_rope", "window_kv", "latent", "index_score", "index_topk_idxs",
                 "candidates", "attn_topk_idxs", "attn_o")
EXTERNAL_DATA_BYTES = 256 << 20  # larger models keep their weights beside them

_DTYPES = {"float32": ir.DataType.FLOAT, "int64": ir.DataType.INT64, "uint8": ir.DataType.UINT8}


# A weight as the graphs take it: an array in its stored dtype, packed for TorchLinear (wo_a:
# one packed weight of o_groups groups; in a portable artifact its groups' plain rows), or
# fp8 values with their block scales.
GraphWeight = np.ndarray | PackedWeight | tuple[np.ndarray, ...] | Fp8Weight


@dataclass(frozen=True)
class StackWeights:
    """Every layer's weights as the graphs take them (graph_weights): prepared once per
    export, for a portable artifact (plain) or not (packed) and its numerics, and shared by
    both models."""

    portable: bool
    layers: dict[int, dict[str, GraphWeight]]
    numerics: Numerics = "exact"


def stack_weights(plan: StackPlan, weights: dict[int, LayerWeights], *,
                  portable: bool, numerics: Numerics = "exact") -> StackWeights:
    return StackWeights(portable, {p.layer: graph_weights(plan.config, p.layer,
                                                          weights[p.layer], portable=portable,
                                                          numerics=numerics)
                                   for p in plan.layers}, numerics)


def build_stack_model(plan: StackPlan, weights: dict[int, LayerWeights] | StackWeights,
                      mode: Mode, *, portable: bool = False, numerics: Numerics = "exact",
                      debug_outputs: bool = False,
                      progress: Callable[[str], None] | None = None,
                      digests: ContentDigests | None = None) -> ir.Model:
    """Trace the stack's `mode` call into an ONNX IR model (`weights`: checked or raw
    per-layer weights, or the ones stack_weights prepared for the same `portable`);
    `numerics`: "exact" or "fast" (custom_ops/ops.py); `digests`: the export's content
    digests, shared by its models (else the model's own)."""
    check_numerics(numerics, portable=portable)
    if not isinstance(weights, StackWeights):
        weights = stack_weights(plan, weights, portable=portable, numerics=numerics)
    elif (weights.portable, weights.numerics) != (portable, numerics):
        raise ValueError(f"weights prepared for portable={weights.portable}, numerics="
                         f"{weights.numerics} given to a portable={portable}, numerics="
                         f"{numerics} model")
    c = plan.config
    graph = ir.Graph([], [], nodes=[], name=f"csa2onnx_{mode}",
                     opset_imports={"": OPSET, DOMAIN: DOMAIN_VERSION})
    if portable:  # read by the op wrappers that spell a custom op out in standard ONNX
        graph.metadata_props[PORTABLE_KEY] = "true"
    if numerics != "exact":  # read by the wrappers of the ops that have a fast kernel
        graph.metadata_props[NUMERICS_KEY] = numerics
    builder = GraphBuilder(graph)
    op = builder.op
    seq = "seq" if mode == "prefill" else 1
    xs = {p.layer: builder.input(layer_input(p.layer), ir.DataType.FLOAT, ["batch", seq, c.dim])
          for p in plan.layers}
    start_pos = builder.input(START_POS, ir.DataType.INT64, [1])  # prefill: 0 or a chunk's

    layout = plan.state_layout()
    # Caches come in on both calls, written in place from row start_pos // r on: a new
    # sequence overwrites rows from 0. Rows past what a sequence wrote are read only by a
    # reader with a smaller ratio than the cache's (through the index_k slot, or a consumer
    # of a coarser kv source), and then hold what earlier sequences wrote (zeros if none),
    # as upstream's never-reset caches do. The window ring and the compressor's open group
    # are small: each call outputs new copies (a prefill at start_pos 0 ignores them).
    past = {t: builder.input(t.input_name, _DTYPES[t.dtype], t.graph_shape()) for t in layout}
    states = {p.layer: LayerState(**{STATE_FIELDS[t.role]: v for t, v in past.items()
                                     if t.layer == p.layer}) for p in plan.layers}
    publisher = layout.get(None, "index_k_publisher")
    # An owner's key cache is visible through the index_k slot before the owner runs in
    # this call (the reference's slot holds a reference to the cache tensor).
    slots = Slots(plan, publisher=past.get(publisher) if publisher else None,
                  index_k={o: states[o].index_k for o in plan.owners})
    for name in plan.external_slots():
        slots.external[name] = builder.input(slot_input(name), *_slot_type(plan, name, seq))

    outputs: list[tuple[str, ir.Value]] = []
    pos = start_pos
    for i, p in enumerate(plan.layers):
        if progress:
            progress(f"[{i + 1}/{len(plan.layers)}] {mode} layer {p.layer} ({p.role})")
        layer = AttentionLayer(plan, p, weights.layers[p.layer])

        def record(name: str, value: ir.Value, layer_id: int = p.layer) -> None:
            outputs.append((debug_output(layer_id, name), value))

        debug = Debug(record if debug_outputs else None)

        x = xs[p.layer]
        if p.kv_source:
            published = layer.compress(op, x, pos, states[p.layer], mode, debug,
                                       after=slots.reads_before_write(p.layer))
            slots.publish(op, p.layer, published)
            states[p.layer] = published.state
        result = layer(op, x, pos, states[p.layer], slots.reads(p), mode, debug)
        slots.publish_selection(p.layer, result)
        states[p.layer] = result.state
        outputs.append((layer_output(p.layer), result.out))
    for t in layout:
        value = (slots.publisher if t.layer is None
                 else getattr(states[t.layer], STATE_FIELDS[t.role]))
        outputs.append((t.output_name, value))
    last_topk = [slots.topk_idxs[p.layer] for p in plan.layers if p.layer in slots.topk_idxs]
    if last_topk:
        outputs.append((slot_output("topk_idxs"), last_topk[-1]))
    if slots.candidates is not None:
        outputs.append((slot_output("candidates"), slots.candidates))

    seen: set[int] = set()
    for name, value in outputs:
        # A value can leave the graph once; a second name (or an input) needs its own node.
        if id(value) in seen or value in graph.inputs or value.is_graph_output():
            value = op.Identity(value)
        seen.add(id(value))
        if value.type is None or value.shape is None:  # the ops' schemas type every value
            raise RuntimeError(f"graph output {name}: no type or rank was inferred")
        builder.add_output(value, name)
    check_parameter_names(graph)
    _share_identical_initializers(graph, digests or ContentDigests())
    model = ir.Model(graph, ir_version=IR_VERSION)
    _compute_once(model)
    # Every cache is written by WriteRows from its past input (the runtime binds both to
    # one buffer); a replaced tensor may be too (the window ring), onto a copy.
    unwritten = {t.output_name for t in layout.caches} - set(in_place_writes(graph))
    if unwritten:
        raise RuntimeError(f"caches not written in place by WriteRows: {sorted(unwritten)}")
    check_in_place_order(graph)
    return model


def graph_weights(config: AttentionConfig, layer: int, weights: LayerWeights, *,
                  portable: bool = False, numerics: Numerics = "exact"
                  ) -> dict[str, GraphWeight]:
    """A layer's checked weights as the graphs take them: in their stored dtypes (bf16
    stays bf16, never an f32 copy), fp8 linears as e4m3 values with their block scales,
    and, unless `portable`, TorchLinear's weights packed into the panels its kernel reads
    in place and fp8 ones marked for pairs16 (linear_layout; the one place an export lays
    them out; both are packed when written). wo_a is one grouped
    TorchLinear (a group per group of heads): packed as o_groups groups; a portable
    artifact spells the groups as TorchLinears of their own, each reading its own rows of
    wo_a as an initializer (graphs/output.py)."""
    checked = check_layer(config, layer, weights)
    scales = {name.removesuffix(".scale") for name in checked if name.endswith(".scale")}
    graph: dict[str, GraphWeight] = {
        k: v for k, v in checked.items()
        if not (k.endswith(".scale") or k.removesuffix(".weight") in scales)}
    specs = expected_tensors(config, plan_layer(config, layer))
    for base in scales:
        name = f"{base}.weight"
        graph[name] = Fp8Weight(np.asarray(checked[name]),
                                np.asarray(checked[f"{base}.scale"], np.float32),
                                linear_layout(specs[name], portable, numerics))
    for name, spec in specs.items():
        if not is_linear(name, spec) or isinstance(graph.get(name), Fp8Weight):
            continue
        w = checked[name]
        groups = config.o_groups if name == "wo_a.weight" else 1
        if linear_layout(spec, portable, numerics) == PANELS64:
            graph[name] = packed_later(w, groups)
        elif groups > 1:  # a portable artifact's: its groups' rows (views, no copy)
            r = config.o_lora_rank
            graph[name] = tuple(w[g * r:(g + 1) * r] for g in range(groups))
    return graph


def _slot_type(plan: StackPlan, name: str, seq: int | str) -> tuple[ir.DataType, list]:
    c = plan.config
    return {  # caches travel packed, as the state holds them
        "compress_kv": (ir.DataType.UINT8, ["batch", "compress_rows",
                                            packed_row_bytes(COMPRESSED_KV_FORMAT, c.head_dim)]),
        "index_k": (ir.DataType.UINT8, ["batch", "index_rows",
                                        packed_row_bytes(INDEX_KEY_FORMAT, c.index_head_dim)]),
        "topk_idxs": (ir.DataType.INT64, ["batch", seq, "topk"]),
        "candidates": (ir.DataType.BOOL, ["batch", seq, "candidate_width"]),
    }[name]


def _share_identical_initializers(graph: ir.Graph, digests: ContentDigests) -> None:
    """One initializer per distinct content: every module builds its own RoPE tables, and
    ratio-0 and compressed layers each share theirs across the stack."""
    first: dict[tuple, ir.Value] = {}
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        key = (tensor.dtype, tuple(tensor.shape), digests.digest(tensor))
        keep = first.setdefault(key, value)
        if keep is not value:
            ir.convenience.replace_all_uses_with(value, keep)
            del graph.initializers[name]


def _compute_once(model: ir.Model) -> None:
    """Identical nodes (op, inputs, attributes) computed once (onnx_ir's common-subexpression
    pass; initializers already shared): each module of a layer builds the call's positions
    and RoPE rows, as do the layers that share RoPE parameters, and every layer its window
    indices. A decode step of layers 0..2 at the released dims runs 171 nodes, not 278
    (prefill 313, not 401)."""
    ir.passes.common.CommonSubexpressionEliminationPass()(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)


def to_proto(model: ir.Model, plan: StackPlan, portable: bool,
             weights_file: str | None = None, numerics: Numerics = "exact") -> onnx.ModelProto:
    proto = ir.serde.serialize_model(model)
    if portable:  # the custom ops' standard-op bodies travel with the model
        proto.functions.extend(portable_functions())
    for key, value in manifest_for(plan, portable, weights_file, numerics).metadata().items():
        proto.metadata_props.add(key=key, value=value)
    return proto


def export_stack(plan: StackPlan, weights: dict[int, LayerWeights], folder: str | Path, *,
                 portable: bool = False, numerics: Numerics = "exact",
                 debug_outputs: bool = False,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write prefill.onnx, decode.onnx and manifest.json for `plan` into `folder`; a large
    stack's weights go to one file both models reference (export/shared_weights.py)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Each tensor is hashed once for both models, and the writer stores a large one's bytes
    # as it is hashed (a lazily packed weight is packed then, once); a model small enough to
    # hold its weights inline (and a folder that needs no weights file) drops the file.
    digests = ContentDigests()
    writer = SharedWeightsWriter(folder / WEIGHTS_FILE, digests)
    weights_file: str | None = None
    try:
        prepared = stack_weights(plan, weights, portable=portable, numerics=numerics)
        for mode in ("prefill", "decode"):
            model = build_stack_model(plan, prepared, mode, portable=portable,
                                      numerics=numerics, debug_outputs=debug_outputs,
                                      progress=progress,
                                      digests=digests)
            weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values())
            if weight_bytes > EXTERNAL_DATA_BYTES:
                # (protobuf cannot hold over 2 GiB); both modes then share the file
                weights_file = WEIGHTS_FILE
            if weights_file is not None:  # before serialising: the proto then holds no weights
                writer.externalize(model)
                writer.flush()
            proto = to_proto(model, plan, portable, weights_file, numerics)
            del model
            path = folder / f"{mode}.onnx"
            onnx.save_model(proto, str(path))
            del proto
            onnx.checker.check_model(str(path), full_check=True)
    finally:
        writer.close()
        if weights_file is None:
            (folder / WEIGHTS_FILE).unlink(missing_ok=True)
    write_manifest(folder, manifest_for(plan, portable, weights_file, numerics))
    return folder
