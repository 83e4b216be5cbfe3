"""Graph-side calls of the custom ops, for onnxscript's GraphBuilder (`op` is an OpBuilder).

The outputs' types and shapes come from the ops' registered schemas (custom_ops/schemas.py),
which the builder applies to every node it adds: nothing here sets them by hand.

One mechanism makes a graph portable (PORTABLE_KEY in its metadata: standard ONNX only): the
custom nodes stay as they are, and a `--portable` artifact carries a standard-op ONNX
function body for each (custom_ops/portable.py), which onnxruntime inlines when the library is
not registered (where it is, the kernels run). The wrappers below build the same nodes either
way, with two exceptions that a function body cannot express:

- `RopeCosSin` has no body (ONNX Cos/Sin are not the C library's cosf/sinf): a portable graph
  keeps the RoPE tables as initializers and gathers from them (graphs/rope.py `FreqsCis`).
- `SparseAttention` over a packed cache becomes Concat(kv, UnpackQuantized(cache)) and the
  4-input node: a function body cannot leave out an optional input it uses (onnxruntime
  rejects the inlined node), so the body takes float rows only.
- `IndexerScore` over the packed index-key cache becomes UnpackQuantized(Slice(cache)) and
  the float-key node, for the same reason.

TorchLinear's panels64 weights are not for portable graphs either (its body is a MatMul of a
plain [N, K] W); that is an error here, not a different node. A grouped TorchLinear (`groups`
G > 1) has no standard-op body: a portable graph spells it as G nodes on Splits of x and W,
concatenated (`torch_linear`).

Numerics (NUMERICS_KEY in the graph's metadata): "exact" (the default) reproduces the
reference's bits; "fast" lets the ops that have a fast kernel sum in their own order (an
attribute numerics="fast" on those nodes only; an exact graph's nodes carry no such
attribute). A portable graph is exact-or-runtime-order by construction: never fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes
from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION

ScaleFormat = Literal["e8m0", "e4m3"]
# custom_ops/src/packed_quant.h: compressed KV, index keys, window KV
PackedFormat = Literal["fp4_e4m3_16", "fp4_e8m0_32", "fp8_e8m0_32"]

PORTABLE_KEY = "csa2onnx.portable"  # graph metadata: emit standard ONNX only
NUMERICS_KEY = "csa2onnx.numerics"  # graph metadata: "fast" where the graph is built fast
Numerics = Literal["exact", "fast"]
NUMERICS: tuple[Numerics, ...] = ("exact", "fast")


def round_bf16(op: OpBuilder, x: ir.Value) -> ir.Value:
    """bf16(x): round to bfloat16 (nearest even) and back to float32, as two Casts."""
    return op.Cast(op.Cast(x, to=ir.DataType.BFLOAT16), to=ir.DataType.FLOAT)


def is_portable(op: OpBuilder) -> bool:
    """Whether the graph being built is a portable (library-free) artifact."""
    return op.builder.root.graph.metadata_props.get(PORTABLE_KEY) == "true"


def check_numerics(numerics: str, *, portable: bool = False) -> Numerics:
    """`numerics` if it is one csa2onnx knows (and a portable graph can have), else an error."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {list(NUMERICS)}, got {numerics!r}")
    if portable and numerics != "exact":
        raise ValueError("a portable graph runs standard ONNX ops only: numerics must be "
                         f"'exact', got {numerics!r}")
    return numerics  # type: ignore[return-value]


def graph_numerics(op: OpBuilder) -> Numerics:
    """The numerics of the graph being built ("exact" unless its metadata says "fast")."""
    return check_numerics(op.builder.root.graph.metadata_props.get(NUMERICS_KEY, "exact"))


def _numerics_attribute(op: OpBuilder, numerics: str | None) -> dict[str, str]:
    """The node attribute for `numerics` (None: the graph's); none at all when exact."""
    numerics = graph_numerics(op) if numerics is None else check_numerics(
        numerics, portable=is_portable(op))
    return {"numerics": numerics} if numerics == "fast" else {}


def _csa(op: OpBuilder) -> Any:
    """The custom-op domain's opset on the graph `op` builds."""
    return op.builder.opset(DOMAIN, DOMAIN_VERSION)


def fp4_quant_dequant(op: OpBuilder, x: ir.Value, block_size: int,
                      scale_format: ScaleFormat) -> ir.Value:
    """fp4 (e2m1) round trip of float32 `x` over blocks of `block_size` on the last axis."""
    if block_size <= 0:
        raise ValueError(f"fp4 block_size must be > 0, got {block_size}")
    if scale_format not in ("e8m0", "e4m3"):
        raise ValueError(f"unknown fp4 scale_format {scale_format!r}")
    # Both outputs, though only Y is used: the standard-op function body of a portable
    # artifact declares two, and ONNX shape inference rejects a call naming fewer.
    y, _scale = _csa(op).Fp4QuantDequant(x, block_size=block_size, scale_format=scale_format,
                                         _outputs=2)
    return y


def torch_topk(op: OpBuilder, x: ir.Value, k: ir.Value, *, largest: bool = True,
               sorted: bool = True) -> tuple[ir.Value, ir.Value]:
    """Top-k along the last axis with torch CPU's tie order: (values, int64 indices).

    `k` is an int64 tensor of shape [1]. A portable artifact runs ONNX TopK instead (the
    op's function body: ties to the lowest index, always sorted), exact wherever no tie
    decides."""
    values, indices = _csa(op).TorchTopK(x, k, largest=int(largest), sorted=int(sorted),
                                         _outputs=2)
    return values, indices


def block_max(op: OpBuilder, x: ir.Value, block_size: int) -> ir.Value:
    """The max of each block of `block_size` values on x's last axis, the last block shorter
    ([..., T] -> [..., ceil(T / block_size)]): NaN where a block holds a NaN (as torch's
    amax), +0 above -0. Reads x in place: no -inf padded copy."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return _csa(op).BlockMax(x, block_size=block_size)


def candidate_mask(op: OpBuilder, blocks: ir.Value, keep: ir.Value, width: ir.Value,
                   block_size: int) -> ir.Value:
    """bool [..., width]: position t is true iff block t // block_size is among its row's
    `blocks` (int64 [..., k], distinct) with `keep` (bool [..., k]) true: the picks' marks
    scattered into zeros, each position inheriting its block's, written once."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return _csa(op).CandidateMask(blocks, keep, width, block_size=block_size)


def split_groups(op: OpBuilder, x: ir.Value, groups: int, axis: int = -1) -> list[ir.Value]:
    """x's `groups` equal slices along `axis`."""
    return list(op.Split(x, axis=axis, num_outputs=groups, _outputs=groups))


def _with_rounding(op: OpBuilder, name: str, inputs: Sequence[ir.Value],
                   attributes: dict[str, int | str | float], rounded: bool) -> ir.Value:
    """The csa2onnx node `name`, its output through bfloat16 when `rounded`: fused by the
    kernel (attribute round_output), or as the Cast pair in a portable graph, whose
    standard-op bodies have no such attribute."""
    portable = is_portable(op)
    if rounded and not portable:
        attributes = attributes | {"round_output": 1}
    y = getattr(_csa(op), name)(*inputs, **attributes)
    return round_bf16(op, y) if rounded and portable else y


def torch_linear(op: OpBuilder, x: ir.Value, w: ir.Value, *,
                 panels: tuple[int, int] | None = None, rounded: bool = False,
                 groups: int = 1, numerics: Numerics | None = None) -> ir.Value:
    """float32 x @ W^T (W: [N, K], bfloat16 or float32) summed in torch CPU's order.

    `groups` G: G linears of one shape in one node, x [..., G*K] and W [G*N, K] -> y
    [..., G*N], group g = x[..., gK:(g+1)K] @ W[gN:(g+1)N]^T into y[..., gN:(g+1)N], each
    the TorchLinear of its own (the kernel reads x's groups and writes y's in place).
    `panels=(N, K)` (a group's): W is stored in the kernel's panels64 layout
    (custom_ops/weight_layout.py), which the kernel reads in place; not in a portable graph,
    whose MatMul body reads a plain W. `rounded`: y through bfloat16 as a Cast pair would
    (the kernel fuses it; a portable graph gets the Casts).

    `numerics` (None: the graph's) "fast": with bf16 W on a CPU with AMX-BF16, 16 rows or
    more sum on AMX tiles (TDPBF16PS, its own order); elsewhere the exact kernel. The node
    gets the attribute only then, so exact graphs do not change.
    """
    if groups < 1:
        raise ValueError(f"TorchLinear groups must be >= 1, got {groups}")
    if is_portable(op):
        if panels is not None:
            raise ValueError("a portable graph takes plain [N, K] TorchLinear weights (its "
                             "standard-op body is a MatMul), not panels64 ones")
        if groups == 1:
            y = _csa(op).TorchLinear(x, w)
        else:  # no grouped body: a node per group (its Split of W folds into a copy)
            parts = zip(split_groups(op, x, groups), split_groups(op, w, groups, axis=0),
                        strict=True)
            y = op.Concat(*[_csa(op).TorchLinear(xg, wg) for xg, wg in parts], axis=-1)
        return round_bf16(op, y) if rounded else y
    attributes: dict[str, int | str | float] = dict(_numerics_attribute(op, numerics))
    if groups != 1:
        attributes["groups"] = groups
    if panels is not None:
        n, k = panels
        attributes |= {"weight_layout": "panels64", "out_features": n, "in_features": k}
    return _with_rounding(op, "TorchLinear", (x, w), attributes, rounded)


def fp8_linear(op: OpBuilder, x: ir.Value, w: ir.Value, w_scale: ir.Value, *,
               numerics: Numerics | None = None, rounded: bool = False,
               pairs16: bool = False) -> ir.Value:
    """The released checkpoint's fp8 linear: act_quant(x) (e4m3, power-of-two scale per 32
    inputs) fused with the block-scaled GEMM against W [N, K] float8e4m3fn and WScale
    [ceil(N/32), K/32] float32 (custom_ops/reference.py `fp8_linear`). float32 result
    [..., N]; `rounded`: y through bfloat16 as a Cast pair would (the kernel fuses it; a
    portable graph gets the Casts).

    `numerics` (None: the graph's) "fast": the same terms summed in another order
    (vdpbf16ps on a CPU with AVX512-BF16, VBMI and GFNI, the exact kernel elsewhere); the
    node gets the attribute only then, so exact graphs do not change.

    `pairs16`: W is stored as [N/16, K/32, 512] (custom_ops/weight_layout.py), which the
    kernel reads in place; not in a portable graph, whose body reads a plain W."""
    attributes: dict[str, int | str | float] = dict(_numerics_attribute(op, numerics))
    if pairs16:
        if is_portable(op):
            raise ValueError("a portable graph takes plain [N, K] Fp8Linear weights (its "
                             "standard-op body reads W so), not pairs16 ones")
        attributes["weight_layout"] = "pairs16"
    return _with_rounding(op, "Fp8Linear", (x, w, w_scale), attributes, rounded)


def rope_cos_sin(op: OpBuilder, positions: ir.Value, inverse_frequencies: Sequence[float],
                 max_positions: int) -> tuple[ir.Value, ir.Value]:
    """(cos, sin) float32 [..., len(f)] of the angles f32(positions) * f_i (int64 positions
    [...], each in [0, max_positions)), through the C library's cosf/sinf as torch.polar
    computes freqs_cis: the rows of the reference's tables, with no table in the model."""
    freqs = [float(f) for f in inverse_frequencies]
    if not freqs:
        raise ValueError("RopeCosSin needs at least one inverse frequency")
    if max_positions <= 0:
        raise ValueError(f"RopeCosSin max_positions must be > 0, got {max_positions}")
    cos, sin = _csa(op).RopeCosSin(positions, inverse_frequencies=freqs,
                                   max_positions=int(max_positions), _outputs=2)
    return cos, sin


def apply_rope(op: OpBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value, rope_head_dim: int,
               inverse: bool = False) -> ir.Value:
    """The reference's apply_rotary_emb on the last `rope_head_dim` features of x ([b, s, d]
    or [b, s, h, d]; adjacent pairs as complex numbers, conjugate rotation when `inverse`),
    the rotated features rounded to bf16 (custom_ops/src/apply_rope_op.cc). cos/sin are
    [s, rd/2] rows at the tokens' positions, or [b, s, rd/2] for per-batch positions."""
    if rope_head_dim <= 0 or rope_head_dim % 2:
        raise ValueError(f"rope_head_dim must be even and > 0, got {rope_head_dim}")
    return _csa(op).ApplyRope(x, cos, sin, rope_head_dim=int(rope_head_dim),
                              inverse=int(inverse))


def torch_rms_norm(op: OpBuilder, x: ir.Value, w: ir.Value, eps: float, *,
                   rounded: bool = False) -> ir.Value:
    """w * (x * rsqrt(mean(x^2) + eps)) over the last axis in float32, the mean summed in
    torch CPU's order (custom_ops/src/torch_rms_norm.h; the portable body spells out the
    same order, bit for bit). `rounded`: y through bfloat16 as a Cast pair would (the
    kernel fuses it; a portable graph gets the Casts)."""
    if not eps > 0:
        raise ValueError(f"RMSNorm eps must be > 0, got {eps}")
    return _with_rounding(op, "TorchRMSNorm", (x, w), {"epsilon": float(eps)}, rounded)


def sparse_attention(op: OpBuilder, q: ir.Value, kv: ir.Value, sink: ir.Value, idx: ir.Value,
                     scale: float, compressed: ir.Value | None = None,
                     compressed_format: PackedFormat | None = None,
                     head_dim: int | None = None,
                     numerics: Numerics | None = None) -> ir.Value:
    """The reference's sparse_attn (graphs/sparse_attn.py states the semantics): q
    [b,s,h,d], kv [b,n,d], sink [h], idx [b,s,k] (int64 or int32, -1 = nothing) -> bf16
    values in float32 [b,s,h,d], in torch CPU's arithmetic order, row by row.

    `compressed`: a packed cache [b, n_cache, row_bytes] (uint8, `compressed_format`):
    index i >= n reads its row i - n, unpacked on the kernel's gather; the result is the
    call on Concat(kv, unpack(compressed)) bit for bit, without that copy. In a portable
    graph it is that Concat (the head dim must then be static): the op's function body
    cannot take the optional packed input (see the module docstring).

    `numerics` (None: the graph's): "fast" runs, on CPUs with AVX512-BF16, the products on
    vdpbf16ps, q and the rows rounded to bf16 (exact for the model's values) and summed in
    another order: most outputs equal exact's, the rest a bf16 ulp or a few apart
    (custom_ops/src/sparse_attention_fast.h); other CPUs run the exact kernel. Not in a
    portable graph (ValueError)."""
    if not scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {scale}")
    attrs = _numerics_attribute(op, numerics)
    if compressed is None:
        return _csa(op).SparseAttention(q, kv, sink, idx, softmax_scale=float(scale), **attrs)
    _check_packed_format(compressed_format)
    if is_portable(op):
        d = head_dim or _static_last_dim(kv) or _static_last_dim(q)
        if d is None:
            raise ValueError("a portable SparseAttention over a packed cache needs the head "
                             "dim: pass head_dim, or give kv or q a static last dimension")
        rows = op.Concat(kv, unpack_quantized(op, compressed, compressed_format, d), axis=1)
        return _csa(op).SparseAttention(q, rows, sink, idx, softmax_scale=float(scale))
    return _csa(op).SparseAttention(q, kv, sink, idx, compressed, softmax_scale=float(scale),
                                    compressed_format=compressed_format, **attrs)


def indexer_score(op: OpBuilder, q: ir.Value, w: ir.Value, keys: ir.Value, width: ir.Value,
                  keys_format: PackedFormat | None = None, head_dim: int | None = None,
                  candidates: ir.Value | None = None,
                  lengths: ir.Value | None = None, candidate_block_size: int = 1) -> ir.Value:
    """The Indexer's scores (custom_ops/src/indexer_score.h): q [b,s,H,D] (D <= 128), w
    [b,s,H], the first `width` (int64 [1]) rows of keys -> float32 [b, s, width] =
    bf16(sum_h bf16(relu(bf16(q[b,s,h] . k[b,t])) * w[b,s,h])), bit for bit the standard ops
    it replaces as onnxruntime runs them, with no [b, s, H, T] intermediate.

    `keys` is float [b, R, D], or with `keys_format` the packed cache [b, R, row_bytes]
    (uint8), read in place. In a portable graph packed keys become UnpackQuantized(Slice)
    (the head dim must then be known): the op's function body takes float rows only.
    `candidates` (bool [b, s, ceil(width / candidate_block_size)]: a value per block of
    keys): the score of key t is -inf where value t // candidate_block_size is false, and the
    op computes no dot there; `lengths` (int64 [s]): query q's keys from lengths[q] on too (a
    portable graph computes every score, then Wheres)."""
    if keys_format is not None:
        _check_packed_format(keys_format)
    _check_candidate_block(candidate_block_size)
    if is_portable(op):
        if keys_format is not None:
            d = head_dim or _static_last_dim(q)
            if d is None:
                raise ValueError("a portable IndexerScore over packed keys needs the head dim: "
                                 "pass head_dim, or give q a static last dimension")
            keys = unpack_quantized(op, op.Slice(keys, [0], width, [1]), keys_format, d)
        if candidates is not None:
            candidates = candidates_per_key(op, candidates, width, candidate_block_size)
        return mask_scores(op, _csa(op).IndexerScore(q, w, keys, width), width, candidates,
                           lengths)
    if candidates is not None and lengths is None:  # the op takes Candidates after Lengths
        lengths = op.Expand(width, op.Slice(op.Shape(q), [1], [2]))  # every key reachable
    inputs = [q, w, keys, width, lengths, candidates]
    while inputs[-1] is None:  # optional inputs left out at the end
        inputs.pop()
    attributes: dict[str, Any] = {}
    if keys_format is not None:
        attributes["keys_format"] = keys_format
    if candidates is not None and candidate_block_size != 1:
        attributes["candidate_block_size"] = candidate_block_size
    return _csa(op).IndexerScore(*inputs, **attributes)


def indexer_topk(op: OpBuilder, q: ir.Value, w: ir.Value, keys: ir.Value, width: ir.Value, k: int,
                 keys_format: PackedFormat | None = None, head_dim: int | None = None,
                 candidates: ir.Value | None = None, lengths: ir.Value | None = None,
                 block_size: int = 0, force_newest_block: bool = False,
                 candidate_block_size: int = 1) -> tuple[ir.Value, ir.Value | None]:
    """`indexer_score`'s scores (same inputs) ranked as torch_topk(score, min(k, width),
    largest, unsorted) ranks them: its int64 indices [b, s, min(k, width)], in its order; and
    with `block_size` the scores' block_max [b, s, ceil(width / block_size)]; never the
    [b, s, width] scores (a long prefill chunk's are a GiB). force_newest_block: the block
    scores as select_candidate_blocks ranks them, +inf at the block of each query's last
    reachable key (`newest_block_forced`). A portable graph spells it as those ops."""
    if k <= 0:
        raise ValueError(f"top-k k must be > 0, got {k}")
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0 (0: no block scores), got {block_size}")
    if force_newest_block and not block_size:
        raise ValueError("force_newest_block needs block_size >= 1 (it sets a block score)")
    _check_candidate_block(candidate_block_size)
    if is_portable(op):
        score = indexer_score(op, q, w, keys, width, keys_format, head_dim, candidates, lengths,
                              candidate_block_size)
        _, indices = torch_topk(op, score, op.Min(width, op.Constant(value_ints=[k])),
                                largest=True, sorted=False)
        if not block_size:
            return indices, None
        block_scores = block_max(op, score, block_size)
        if force_newest_block:
            block_scores = newest_block_forced(op, block_scores, width if lengths is None
                                               else lengths, block_size)
        return indices, block_scores
    if keys_format is not None:
        _check_packed_format(keys_format)
    if candidates is not None and lengths is None:  # the op takes Candidates after Lengths
        lengths = op.Expand(width, op.Slice(op.Shape(q), [1], [2]))  # every key reachable
    inputs = [q, w, keys, width, lengths, candidates]
    while inputs[-1] is None:  # optional inputs left out at the end
        inputs.pop()
    attributes: dict[str, Any] = {"k": k}
    if block_size:
        attributes["block_size"] = block_size
    if force_newest_block:
        attributes["force_newest_block"] = 1
    if keys_format is not None:
        attributes["keys_format"] = keys_format
    if candidates is not None and candidate_block_size != 1:
        attributes["candidate_block_size"] = candidate_block_size
    if not block_size:
        return _csa(op).IndexerTopK(*inputs, **attributes), None
    indices, block_scores = _csa(op).IndexerTopK(*inputs, **attributes, _outputs=2)
    return indices, block_scores


def newest_block_forced(op: OpBuilder, block_scores: ir.Value, reach: ir.Value,
                        block_size: int) -> ir.Value:
    """block_scores [b, s, nb] with +inf at block (reach - 1) // block_size of each query
    (reach int64 broadcastable to [b, s]: its reachable keys), none where reach <= 0:
    select_candidate_blocks forces the block of the newest reachable position in (floor
    division, so reach 0 gives -1 and forces nothing; ONNX Div truncates)."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    reach = op.Unsqueeze(reach, [-1])
    newest = op.Where(op.Greater(reach, zero), op.Div(op.Sub(reach, one), block_size),
                      op.Constant(value_int=-1))
    n_blocks = op.Squeeze(op.Slice(op.Shape(block_scores), [2], [3]), [0])
    block_ids = op.Range(zero, n_blocks, one)
    return op.Where(op.Equal(block_ids, newest), op.Constant(value_float=float("inf")),
                    block_scores)


def candidates_per_key(op: OpBuilder, candidates: ir.Value, width: ir.Value,
                       candidate_block_size: int) -> ir.Value:
    """Candidates of blocks [..., ceil(width / candidate_block_size)] as a value a key
    [..., width]: key t takes its block's, t // candidate_block_size."""
    if candidate_block_size == 1:
        return candidates
    keys = op.Range(op.Constant(value_int=0), op.Squeeze(width, [0]), op.Constant(value_int=1))
    return op.Gather(candidates, op.Div(keys, op.Constant(value_int=candidate_block_size)),
                     axis=-1)


def mask_scores(op: OpBuilder, score: ir.Value, width: ir.Value, candidates: ir.Value | None,
                lengths: ir.Value | None) -> ir.Value:
    """score [b, s, width] with -inf where `candidates` is false and at keys t >= lengths[q]
    (IndexerScore's masks, as standard ops after every score)."""
    minus_inf = op.Constant(value_float=float("-inf"))
    if lengths is not None:
        keys = op.Range(op.Constant(value_int=0), op.Squeeze(width, [0]),
                        op.Constant(value_int=1))
        score = op.Where(op.GreaterOrEqual(keys, op.Unsqueeze(lengths, [-1])), minus_inf, score)
    if candidates is not None:
        score = op.Where(candidates, score, minus_inf)
    return score


def _check_candidate_block(candidate_block_size: int) -> None:
    if candidate_block_size < 1:
        raise ValueError("candidate_block_size must be >= 1 (keys a candidates value stands "
                         f"for), got {candidate_block_size}")


def _check_packed_format(fmt: str | None) -> None:
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"unknown packed format {fmt!r} (expected one of "
                         f"{', '.join(PACKED_FORMATS)})")


def _static_last_dim(value: ir.Value) -> int | None:
    if value.shape is None or len(value.shape) == 0:
        return None
    last = value.shape[-1]
    return last if isinstance(last, int) else None


def pack_quantized(op: OpBuilder, x: ir.Value, fmt: PackedFormat) -> ir.Value:
    """x float32 [..., d] -> its packed rows, uint8 [..., row_bytes(fmt, d)]: quantised as
    the graph's round trips do (Fp4QuantDequant for the fp4 formats, act_quant for fp8),
    codes then block scales (custom_ops/src/packed_quant.h)."""
    _check_packed_format(fmt)
    return _csa(op).PackQuantized(x, format=fmt)


def unpack_quantized(op: OpBuilder, p: ir.Value, fmt: PackedFormat, dim: int) -> ir.Value:
    """Packed rows uint8 [..., row_bytes(fmt, dim)] -> float32 [..., dim]: value(code) *
    scale, bit for bit the round trip's values."""
    _check_packed_format(fmt)
    packed_row_bytes(fmt, dim)  # dim must be a multiple of the block
    return _csa(op).UnpackQuantized(p, format=fmt, dim=int(dim))


def write_rows(op: OpBuilder, cache: ir.Value, rows: ir.Value, row_start: ir.Value,
               after: Sequence[ir.Value] = ()) -> ir.Value:
    """cache [B, R, d] with rows row_start .. row_start+n-1 of its first b entries replaced
    by rows [b, n, d] (float32, or uint8 packed rows; row_start int64 [1]). In place when the
    runtime binds the output to the cache's buffer (custom_ops/src/write_rows_op.cc).

    `after`: values computed from the OLD cache contents. The write waits for them (an
    ordering edge through the op's ignored `After` input): onnxruntime runs nodes that do
    not depend on each other in any order, and an in-place write would change what an
    unordered reader sees."""
    if cache.dtype not in (None, ir.DataType.FLOAT, ir.DataType.UINT8):
        raise ValueError(f"WriteRows caches are float32 or uint8 (packed rows), got "
                         f"{cache.dtype}")
    inputs = [cache, rows, op.Reshape(row_start, [1])]
    if after:  # Shape is O(1) and still needs its input computed: a cheap dependency
        shapes = [op.Shape(v) for v in after]
        inputs.append(shapes[0] if len(shapes) == 1 else op.Concat(*shapes, axis=0))
    return _csa(op).WriteRows(*inputs)
