"""The custom ops' signatures for ONNX tooling: inputs, outputs, type constraints, attributes
and an output type-and-shape inference function each, registered as ONNX operator schemas
(domain csa2onnx, version 1) when `csa2onnx.custom_ops` is imported.

With them registered, `onnx.shape_inference.infer_shapes` and `onnx.checker` see every
custom-op output's type and shape, and onnxscript's GraphBuilder types a custom node's outputs
as it builds it (custom_ops/ops.py sets no type by hand). Saved models carry the inferred
types and shapes as value_info, which tools that do not import csa2onnx (Netron) show.
onnxruntime has its own copy of these rules, in C++ (custom_ops/src/shape_inference.cc, used
when a session loads a model); tests/test_shape_inference.py checks that the two agree.

A dimension is copied when it is known (a value or a symbolic name), computed when its
inputs are static, and left unknown otherwise; a rank is set whenever the input ranks it
follows from are known. Shapes the kernels reject are not diagnosed here: the kernels check
every shape when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx
import onnx.defs
from onnx import TensorProto, TensorShapeProto, TypeProto, numpy_helper
from onnx.shape_inference import InferenceContext

from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes
from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION

_Schema = onnx.defs.OpSchema
_Attr = _Schema.AttrType
_OPTIONAL = _Schema.FormalParameterOption.Optional

Dim = TensorShapeProto.Dimension
DimLike = Dim | int | None  # a known dim (value or name), a static size, or unknown (None)


@dataclass(frozen=True)
class Param:
    """An input or output: name, type (a constraint name or "tensor(...)"), optional."""

    name: str
    type_str: str
    optional: bool = False

    def formal(self) -> _Schema.FormalParameter:
        option = _OPTIONAL if self.optional else _Schema.FormalParameterOption.Single
        return _Schema.FormalParameter(self.name, self.type_str, param_option=option)


@dataclass(frozen=True)
class Attribute:
    """An attribute: required, optional without a default, or with one (`default`)."""

    name: str
    type: _Attr
    required: bool = False
    default: int | float | str | None = None

    def schema_attribute(self) -> _Schema.Attribute:
        if self.default is not None:
            return _Schema.Attribute(self.name, onnx.helper.make_attribute(self.name,
                                                                           self.default))
        return _Schema.Attribute(self.name, self.type, required=self.required)


@dataclass(frozen=True)
class OpSignature:
    """One custom op's schema and its output inference (`infer(ctx)`)."""

    name: str
    doc: str
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    infer: Callable[[InferenceContext], None]
    type_constraints: tuple[tuple[str, tuple[str, ...]], ...] = ()
    attributes: tuple[Attribute, ...] = field(default=())

    def schema(self) -> onnx.defs.OpSchema:
        schema = _Schema(self.name, DOMAIN, DOMAIN_VERSION, self.doc,
                         inputs=[p.formal() for p in self.inputs],
                         outputs=[p.formal() for p in self.outputs],
                         type_constraints=[(n, list(t), "") for n, t in self.type_constraints],
                         attributes=[a.schema_attribute() for a in self.attributes])
        schema.set_type_and_shape_inference_function(self.infer)
        return schema


# ---------------------------------------------------------------- inference helpers
def _input(ctx: InferenceContext, index: int) -> TypeProto | None:
    """Input `index`'s tensor type, or None when the node leaves it out or it is untyped."""
    if index >= ctx.get_num_inputs() or not ctx.has_input(index):
        return None
    t = ctx.get_input_type(index)
    return t if t is not None and t.HasField("tensor_type") else None


def _dims(t: TypeProto | None) -> list[Dim] | None:
    """The dims of a tensor type, or None when its rank is unknown."""
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return list(t.tensor_type.shape.dim)


def _static(dim: Dim) -> int | None:
    return dim.dim_value if dim.HasField("dim_value") else None


def _set(ctx: InferenceContext, index: int, elem_type: int, dims: Sequence[DimLike] | None) -> None:
    """Output `index` gets `elem_type` and, unless `dims` is None, that shape."""
    if index >= ctx.get_num_outputs() or not ctx.has_output(index):
        return
    t = TypeProto()
    t.tensor_type.elem_type = elem_type
    if dims is not None:
        shape = t.tensor_type.shape
        for d in dims:
            out = shape.dim.add()
            if isinstance(d, int):
                out.dim_value = d
            elif d is not None:
                out.CopyFrom(d)
    ctx.set_output_type(index, t)


def _int_attr(ctx: InferenceContext, name: str) -> int | None:
    a = ctx.get_attribute(name)
    return a.i if a is not None and a.type == onnx.AttributeProto.INT else None


def _str_attr(ctx: InferenceContext, name: str) -> str | None:
    a = ctx.get_attribute(name)
    return a.s.decode() if a is not None and a.type == onnx.AttributeProto.STRING else None


def _elem(t: TypeProto | None, default: int = TensorProto.FLOAT) -> int:
    return t.tensor_type.elem_type if t is not None and t.tensor_type.elem_type else default


def _last_replaced(dims: Sequence[DimLike] | None, last: DimLike) -> list[DimLike] | None:
    """dims[:-1] + [last] (rank >= 1), or None for an unknown rank or a scalar."""
    if not dims:
        return None
    return [*dims[:-1], last]


# ---------------------------------------------------------------- per op
def _infer_fp4(ctx: InferenceContext) -> None:
    x = _input(ctx, 0)
    dims = _dims(x)
    _set(ctx, 0, _elem(x), dims)
    block = _int_attr(ctx, "block_size")
    last = _static(dims[-1]) if dims else None
    blocks = last // block if last is not None and block and block > 0 else None
    _set(ctx, 1, TensorProto.FLOAT, _last_replaced(dims, blocks))


def _constant_int(ctx: InferenceContext, index: int) -> int | None:
    """A one-element int64 input's value when the graph holds it as a constant."""
    data = ctx.get_input_data(index)  # None unless the graph holds it
    if data is None or data.data_type != TensorProto.INT64:
        return None
    array = numpy_helper.to_array(data)
    return int(array.reshape(-1)[0]) if array.size == 1 else None


def _infer_topk(ctx: InferenceContext) -> None:
    x = _input(ctx, 0)
    dims = _last_replaced(_dims(x), _constant_int(ctx, 1))
    _set(ctx, 0, _elem(x), dims)
    _set(ctx, 1, TensorProto.INT64, dims)


def _infer_torch_linear(ctx: InferenceContext) -> None:
    """Y [..., G*N]: G = groups (default 1) times out_features (panels64), or W's first
    dimension (plain: W is [G*N, K])."""
    w_dims = _dims(_input(ctx, 1))
    if _str_attr(ctx, "weight_layout") == "panels64":
        n: DimLike = _int_attr(ctx, "out_features")
        groups = _int_attr(ctx, "groups")
        groups = 1 if groups is None else groups
        n = groups * n if n is not None and n >= 0 and groups >= 1 else None
    else:
        n = w_dims[0] if w_dims is not None and len(w_dims) == 2 else None
    _set(ctx, 0, TensorProto.FLOAT, _last_replaced(_dims(_input(ctx, 0)), n))


def _infer_fp8_linear(ctx: InferenceContext) -> None:
    """Y [..., N]: N = W's first dimension (plain), or 16 times it (pairs16: W [N/16, K/32,
    512]; known only as a size)."""
    w_dims = _dims(_input(ctx, 1))
    n: DimLike = None
    if _str_attr(ctx, "weight_layout") == "pairs16":
        groups = _static(w_dims[0]) if w_dims is not None and len(w_dims) == 3 else None
        n = None if groups is None else 16 * groups
    elif w_dims is not None and len(w_dims) == 2:
        n = w_dims[0]
    _set(ctx, 0, TensorProto.FLOAT, _last_replaced(_dims(_input(ctx, 0)), n))


def _infer_like_first(elem_type: int | None) -> Callable[[InferenceContext], None]:
    """Output 0 has input 0's shape, and its type (None) or `elem_type`."""
    def infer(ctx: InferenceContext) -> None:
        x = _input(ctx, 0)
        _set(ctx, 0, _elem(x) if elem_type is None else elem_type, _dims(x))
    return infer


def _infer_rope(ctx: InferenceContext) -> None:
    a = ctx.get_attribute("inverse_frequencies")
    count = len(a.floats) if a is not None and a.type == onnx.AttributeProto.FLOATS else None
    dims = _dims(_input(ctx, 0))
    out = None if dims is None else [*dims, count]
    _set(ctx, 0, TensorProto.FLOAT, out)
    _set(ctx, 1, TensorProto.FLOAT, out)


def _infer_pack(ctx: InferenceContext) -> None:
    dims = _dims(_input(ctx, 0))
    fmt = _str_attr(ctx, "format")
    d = _static(dims[-1]) if dims else None
    row_bytes = None
    if fmt in PACKED_FORMATS and d is not None and d % PACKED_FORMATS[fmt][0] == 0:
        row_bytes = packed_row_bytes(fmt, d)
    _set(ctx, 0, TensorProto.UINT8, _last_replaced(dims, row_bytes))


def _infer_indexer_score(ctx: InferenceContext) -> None:
    q = _dims(_input(ctx, 0))
    width = _constant_int(ctx, 3)
    _set(ctx, 0, TensorProto.FLOAT, None if q is None or len(q) != 4 else [q[0], q[1], width])


def _infer_indexer_topk(ctx: InferenceContext) -> None:
    """Indices [b, s, min(k, Width)]; BlockScores [b, s, ceil(Width / block_size)]."""
    q = _dims(_input(ctx, 0))
    width, k, block = _constant_int(ctx, 3), _int_attr(ctx, "k"), _int_attr(ctx, "block_size")
    rows = None if q is None or len(q) != 4 else [q[0], q[1]]
    kept = min(k, width) if k is not None and width is not None else None
    blocks = -(-width // block) if width is not None and block else None
    _set(ctx, 0, TensorProto.INT64, None if rows is None else [*rows, kept])
    _set(ctx, 1, TensorProto.FLOAT, None if rows is None else [*rows, blocks])


def _infer_candidate_mask(ctx: InferenceContext) -> None:
    _set(ctx, 0, TensorProto.BOOL, _last_replaced(_dims(_input(ctx, 0)), _constant_int(ctx, 2)))


def _infer_unpack(ctx: InferenceContext) -> None:
    _set(ctx, 0, TensorProto.FLOAT,
         _last_replaced(_dims(_input(ctx, 0)), _int_attr(ctx, "dim")))


def _infer_block_max(ctx: InferenceContext) -> None:
    dims = _dims(_input(ctx, 0))
    block, t = _int_attr(ctx, "block_size"), _static(dims[-1]) if dims else None
    blocks = -(-t // block) if t is not None and block is not None and block >= 1 else None
    _set(ctx, 0, TensorProto.FLOAT, _last_replaced(dims, blocks))


_FLOAT = "tensor(float)"
_FLOATS_16 = ("tensor(float)", "tensor(bfloat16)", "tensor(float16)")
_W_TYPES = ("tensor(float)", "tensor(bfloat16)")
_INT64 = "tensor(int64)"
_UINT8 = "tensor(uint8)"

# IndexerScore's inputs, IndexerTopK's too
_SCORING_INPUTS = (Param("Q", _FLOAT), Param("W", _FLOAT), Param("Keys", "TK"),
                   Param("Width", _INT64), Param("Lengths", _INT64, optional=True),
                   Param("Candidates", "tensor(bool)", optional=True))

SIGNATURES: tuple[OpSignature, ...] = (
    OpSignature(
        "Fp4QuantDequant", "fp4 (e2m1) round trip over blocks of the last axis (README).",
        (Param("X", "T"),), (Param("Y", "T"), Param("Scale", _FLOAT, optional=True)),
        _infer_fp4, (("T", _FLOATS_16),),
        (Attribute("block_size", _Attr.INT, required=True),
         Attribute("scale_format", _Attr.STRING, required=True))),
    OpSignature(
        "TorchTopK", "torch CPU's top-k along the last axis, its tie order included.",
        (Param("X", "T"), Param("K", _INT64)), (Param("Values", "T"), Param("Indices", _INT64)),
        _infer_topk, (("T", _FLOATS_16),),
        (Attribute("largest", _Attr.INT, default=1), Attribute("sorted", _Attr.INT, default=1))),
    OpSignature(
        "TorchLinear", "X @ W^T summed in torch CPU's order (per group of `groups`); W plain "
        "[G*N, K] or panels64.",
        (Param("X", _FLOAT), Param("W", "TW")), (Param("Y", _FLOAT),),
        _infer_torch_linear, (("TW", _W_TYPES),),
        (Attribute("weight_layout", _Attr.STRING, default="plain"),
         Attribute("out_features", _Attr.INT), Attribute("in_features", _Attr.INT),
         Attribute("round_output", _Attr.INT, default=0),
         Attribute("groups", _Attr.INT, default=1),
         Attribute("numerics", _Attr.STRING, default="exact"))),
    OpSignature(
        "Fp8Linear", "act_quant fused with the block-scaled e4m3 GEMM (reference.md); W plain "
        "[N, K] or pairs16.",
        (Param("X", _FLOAT), Param("W", "tensor(float8e4m3fn)"), Param("WScale", _FLOAT)),
        (Param("Y", _FLOAT),), _infer_fp8_linear,
        attributes=(Attribute("block_size", _Attr.INT, default=32),
                    Attribute("weight_layout", _Attr.STRING, default="plain"),
                    Attribute("numerics", _Attr.STRING, default="exact"),
                    Attribute("round_output", _Attr.INT, default=0))),
    OpSignature(
        "TorchRMSNorm", "W * (X * rsqrt(mean(X^2) + epsilon)), the mean in torch CPU's order.",
        (Param("X", _FLOAT), Param("W", "TW")), (Param("Y", _FLOAT),),
        _infer_like_first(TensorProto.FLOAT), (("TW", _W_TYPES),),
        (Attribute("epsilon", _Attr.FLOAT, required=True),
         Attribute("round_output", _Attr.INT, default=0))),
    OpSignature(
        "SparseAttention", "The reference's sparse_attn over the selected KV rows.",
        (Param("Q", _FLOAT), Param("KV", _FLOAT), Param("Sink", _FLOAT), Param("Idx", "TI"),
         Param("Compressed", _UINT8, optional=True)), (Param("O", _FLOAT),),
        _infer_like_first(TensorProto.FLOAT), (("TI", ("tensor(int64)", "tensor(int32)")),),
        (Attribute("softmax_scale", _Attr.FLOAT, required=True),
         Attribute("compressed_format", _Attr.STRING),
         Attribute("numerics", _Attr.STRING, default="exact"))),
    OpSignature(
        "IndexerScore", "The Indexer's scores bf16(sum_h bf16(relu(bf16(q.k)) * w)) of keys "
        "0..Width-1, in onnxruntime's orders for the standard ops; -inf, not computed, past a "
        "query's Lengths or where Candidates (given with Lengths; a value per block of "
        "candidate_block_size keys) is false.",
        _SCORING_INPUTS,
        (Param("Score", _FLOAT),), _infer_indexer_score, (("TK", (_FLOAT, _UINT8)),),
        (Attribute("keys_format", _Attr.STRING),
         Attribute("candidate_block_size", _Attr.INT, default=1))),
    OpSignature(
        "IndexerTopK", "IndexerScore's scores ranked as TorchTopK(k, largest, unsorted) ranks "
        "them (its indices), and optionally BlockMax(block_size) of them, without the [b, s, "
        "Width] scores.",
        _SCORING_INPUTS,
        (Param("Indices", _INT64), Param("BlockScores", _FLOAT, optional=True)),
        _infer_indexer_topk, (("TK", (_FLOAT, _UINT8)),),
        (Attribute("k", _Attr.INT, required=True), Attribute("block_size", _Attr.INT, default=0),
         Attribute("force_newest_block", _Attr.INT, default=0),
         Attribute("keys_format", _Attr.STRING),
         Attribute("candidate_block_size", _Attr.INT, default=1))),
    OpSignature(
        "CandidateMask", "select_candidate_blocks' mask: position t is true iff block "
        "t // block_size is among its row's Blocks with Keep true.",
        (Param("Blocks", _INT64), Param("Keep", "tensor(bool)"), Param("Width", _INT64)),
        (Param("Mask", "tensor(bool)"),), _infer_candidate_mask,
        attributes=(Attribute("block_size", _Attr.INT, required=True),)),
    OpSignature(
        "RopeCosSin", "cosf / sinf of f32(position) * f_i: freqs_cis rows, no table.",
        (Param("Positions", _INT64),), (Param("Cos", _FLOAT), Param("Sin", _FLOAT)),
        _infer_rope,
        attributes=(Attribute("inverse_frequencies", _Attr.FLOATS, required=True),
                    Attribute("max_positions", _Attr.INT, required=True))),
    OpSignature(
        "ApplyRope", "RoPE on the last rope_head_dim features (adjacent pairs), then bf16.",
        (Param("X", _FLOAT), Param("Cos", _FLOAT), Param("Sin", _FLOAT)), (Param("Y", _FLOAT),),
        _infer_like_first(TensorProto.FLOAT),
        attributes=(Attribute("rope_head_dim", _Attr.INT, required=True),
                    Attribute("inverse", _Attr.INT, default=0))),
    OpSignature(
        "WriteRows", "Cache with rows RowStart.. of its first entries replaced (in place).",
        (Param("Cache", "T"), Param("Rows", "T"), Param("RowStart", _INT64),
         Param("After", _INT64, optional=True)), (Param("CacheOut", "T"),),
        _infer_like_first(None), (("T", (_FLOAT, _UINT8)),)),
    OpSignature(
        "PackQuantized", "Rows quantised and packed: codes, then one scale byte per block.",
        (Param("X", _FLOAT),), (Param("P", _UINT8),), _infer_pack,
        attributes=(Attribute("format", _Attr.STRING, required=True),)),
    OpSignature(
        "UnpackQuantized", "Packed rows back to float32 values: value(code) * scale.",
        (Param("P", _UINT8),), (Param("Y", _FLOAT),), _infer_unpack,
        attributes=(Attribute("format", _Attr.STRING, required=True),
                    Attribute("dim", _Attr.INT, required=True))),
    OpSignature(
        "BlockMax", "The max of each block of block_size values on the last axis (the last "
        "block shorter): NaN where a block holds one, +0 above -0.",
        (Param("X", _FLOAT),), (Param("Y", _FLOAT),), _infer_block_max,
        attributes=(Attribute("block_size", _Attr.INT, required=True),)),
)

OP_NAMES: tuple[str, ...] = tuple(s.name for s in SIGNATURES)


def register_schemas(signatures: Sequence[OpSignature] = SIGNATURES) -> None:
    """Register the schemas with ONNX (once per process; a name already registered in the
    domain is left as it is)."""
    for signature in signatures:
        if not onnx.defs.has(signature.name, DOMAIN):
            onnx.defs.register_schema(signature.schema())
