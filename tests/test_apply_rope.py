"""ApplyRope against the standard ops it replaces (graphs/rope.py's apply_rotary_emb before
the op: Slices, Mul, Sub, Add, Concat, Cast to bf16 and back), run by this onnxruntime, bit
for bit: on every instruction-set path and thread count, X of rank 3 and 4, cos/sin rows
[s, rd/2] and per batch [b, s, rd/2], inverse 0 and 1, rd == d and rd < d, one token, one
head, and edge values (NaN with signs and payloads, +-inf, -0, values on bf16 rounding ties,
values that round up to inf). Also: in place (X an intermediate the runtime may reuse), the
portable function body, a NumPy definition, and the errors.

One documented difference: where BOTH operands of a Mul or of the Add are NaN, onnxruntime
returns either NaN (by the element's place in its vector loop) and the op the first
operand's; there only "NaN" is compared (`ambiguous`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.graphs.rope import RopeParams, freqs_cis

PATHS = [isa for isa in ("avx512", "avx2", "scalar") if isa in cpu_isas()]
BIG = 2**62
_vi = helper.make_tensor_value_info
_node = helper.make_node


def _ints(name: str, values: list[int]) -> TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def standard_graph(rd: int, inverse: bool) -> bytes:
    """graphs/rope.py's apply_rotary_emb as it was before ApplyRope, node for node."""
    nodes = [
        _node("Shape", ["X"], ["shape"]),
        _node("Slice", ["X", "zero", "minus_rd", "minus_one"], ["nope"]),
        _node("Slice", ["X", "minus_rd", "big", "minus_one"], ["rope"]),
        _node("Slice", ["shape", "zero", "minus_one"], ["lead"]),
        _node("Concat", ["lead", "half_two"], ["pairs_shape"], axis=0),
        _node("Reshape", ["rope", "pairs_shape"], ["pairs"]),
        _node("Slice", ["pairs", "zero", "one", "minus_one"], ["re1"]),
        _node("Squeeze", ["re1", "minus_one"], ["re"]),
        _node("Slice", ["pairs", "one", "two", "minus_one"], ["im1"]),
        _node("Squeeze", ["im1", "minus_one"], ["im"]),
        # _broadcast_over_heads: one size-1 axis per dimension of X beyond three
        _node("Shape", ["shape"], ["rank"]),
        _node("Sub", ["rank", "three"], ["extra"]),
        _node("ConstantOfShape", ["extra"], ["ones"],
              value=helper.make_tensor("v", TensorProto.INT64, [1], [1])),
    ]
    for name in ("Cos", "Sin"):
        nodes += [_node("Shape", [name], [name + "_shape"]),
                  _node("Slice", [name + "_shape", "zero", "minus_one"], [name + "_lead"]),
                  _node("Slice", [name + "_shape", "minus_one", "big"], [name + "_last"]),
                  _node("Concat", [name + "_lead", "ones", name + "_last"], [name + "_to"],
                        axis=0),
                  _node("Reshape", [name, name + "_to"], [name.lower()])]
    sin = "sin"
    if inverse:
        nodes.append(_node("Neg", ["sin"], ["neg_sin"]))
        sin = "neg_sin"
    nodes += [
        _node("Mul", ["re", "cos"], ["re_c"]), _node("Mul", ["im", sin], ["im_s"]),
        _node("Sub", ["re_c", "im_s"], ["out_re"]),
        _node("Mul", ["re", sin], ["re_s"]), _node("Mul", ["im", "cos"], ["im_c"]),
        _node("Add", ["re_s", "im_c"], ["out_im"]),
        _node("Unsqueeze", ["out_re", "minus_one"], ["out_re1"]),
        _node("Unsqueeze", ["out_im", "minus_one"], ["out_im1"]),
        _node("Concat", ["out_re1", "out_im1"], ["rotated0"], axis=-1),
        _node("Shape", ["rope"], ["rope_shape"]),
        _node("Reshape", ["rotated0", "rope_shape"], ["rotated"]),
        _node("Cast", ["rotated"], ["rotated_h"], to=TensorProto.BFLOAT16),
        _node("Cast", ["rotated_h"], ["rounded"], to=TensorProto.FLOAT),
        _node("Concat", ["nope", "rounded"], ["Y"], axis=-1),
    ]
    inits = [_ints("zero", [0]), _ints("one", [1]), _ints("two", [2]), _ints("three", [3]),
             _ints("minus_one", [-1]), _ints("minus_rd", [-rd]), _ints("big", [BIG]),
             _ints("half_two", [rd // 2, 2])]
    graph = helper.make_graph(nodes, "rope", inputs(), [_vi("Y", TensorProto.FLOAT, None)], inits)
    return custom_op_model(graph)


def inputs(x_type: int = TensorProto.FLOAT) -> list:
    return [_vi(name, x_type if name == "X" else TensorProto.FLOAT, None)  # unranked
            for name in ("X", "Cos", "Sin")]


def op_model(rd: object, inverse: object = 0, *, portable: bool = False,
             in_place_rank: int | None = None, x_type: int = TensorProto.FLOAT) -> bytes:
    """One ApplyRope node. `in_place_rank`: X (of that rank, symbolic dims) goes through
    Neg(Neg(X)) (exact: Neg flips only the sign bit) into ApplyRope, whose output goes
    through Neg again: the runtime gives Y X's buffer (it reuses a buffer only between
    intermediates of statically equal shapes), so the kernel runs in place."""
    attrs = {k: v for k, v in (("rope_head_dim", rd), ("inverse", inverse)) if v is not None}
    graph_inputs = inputs(x_type)
    if in_place_rank is None:
        nodes = [_node("ApplyRope", ["X", "Cos", "Sin"], ["Y"], domain="csa2onnx", **attrs)]
    else:
        graph_inputs[0] = _vi("X", x_type, ["b", "s", "h", "d"][-in_place_rank:])
        nodes = [_node("Neg", ["X"], ["nx"]), _node("Neg", ["nx"], ["xx"]),
                 _node("ApplyRope", ["xx", "Cos", "Sin"], ["r"], domain="csa2onnx", **attrs),
                 _node("Neg", ["r"], ["nr"]), _node("Neg", ["nr"], ["Y"])]
    graph = helper.make_graph(nodes, "apply_rope", graph_inputs,
                              [_vi("Y", TensorProto.FLOAT, None)])
    return custom_op_model(graph, portable=portable)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def from_bits(u: np.ndarray) -> np.ndarray:
    return np.asarray(u, np.uint32).view(np.float32)


EDGE_BITS = [
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FD0FFFF,  # NaN: signs, payloads
    0x7F800000, 0xFF800000, 0x80000000, 0x00000000,  # +-inf, -0, +0
    0x3F808000, 0x3F818000, 0xBF808000, 0x00018000,  # bf16 ties (even down, odd up, subnormal)
    0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF,  # round up to +-inf, and just below
    0x00000001, 0x807FFFFF,  # subnormals
]


def case(seed: int, shape: tuple[int, ...], rd: int, per_batch: bool, *,
         edges: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X and the RoPE rows (the released base, random positions, position 0 included:
    cos 1, sin 0, where X's values reach the rounding as they are)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))).astype(np.float32)
    if edges:
        mask = rng.random(shape) < 0.3
        x[mask] = from_bits(rng.choice(np.array(EDGE_BITS, np.uint32), int(mask.sum())))
    cos_table, sin_table = freqs_cis(RopeParams(rope_head_dim=rd, max_seq_len=4096,
                                                base=10000.0))
    b, s = shape[0], shape[1]
    positions = rng.integers(0, 4096, (b, s) if per_batch else (s,))
    positions.reshape(-1)[0] = 0
    return x, cos_table[positions], sin_table[positions]


_sessions: dict = {}


def standard(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rd: int, inverse: bool):
    key = ("standard", rd, inverse)
    if key not in _sessions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        _sessions[key] = ort.InferenceSession(standard_graph(rd, inverse), options,
                                              providers=["CPUExecutionProvider"])
    return _sessions[key].run(None, {"X": x, "Cos": cos, "Sin": sin})[0]


def op_session(monkeypatch, rd: int, inverse: bool, isa: str, threads: int,
               in_place_rank: int | None = None) -> ort.InferenceSession:
    key = (rd, inverse, isa, threads, in_place_rank)
    if key not in _sessions:
        monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
        monkeypatch.setenv("CSA_APPLY_ROPE_ISA", isa)  # read when the kernel is created
        try:
            _sessions[key] = make_session(
                op_model(rd, int(inverse), in_place_rank=in_place_rank),
                options=session_options(threads))
        finally:
            monkeypatch.delenv("CSA_APPLY_ROPE_ISA")
    return _sessions[key]


def ambiguous(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rd: int,
              inverse: bool) -> np.ndarray:
    """Where onnxruntime's own NaN sign is not defined: a Mul or the Add of two NaNs."""
    def rows(t: np.ndarray) -> np.ndarray:  # [(b,) s, rd/2] -> X's rank, broadcast
        t = t.reshape((-1, x.shape[1]) + (1,) * (x.ndim - 3) + (rd // 2,))
        return np.broadcast_to(t, (*x.shape[:-1], rd // 2))
    c, s = rows(cos), rows(sin) * (-1 if inverse else 1)
    re, im = x[..., -rd::2], x[..., -rd + 1::2]
    with np.errstate(all="ignore"):
        both_re = (np.isnan(re) & np.isnan(c)) | (np.isnan(im) & np.isnan(s))
        both_im = ((np.isnan(re) & np.isnan(s)) | (np.isnan(im) & np.isnan(c))
                   | (np.isnan(re * s) & np.isnan(im * c)))
    out = np.zeros(x.shape, bool)
    out[..., -rd::2], out[..., -rd + 1::2] = both_re, both_im
    return out


def assert_same(got: np.ndarray, want: np.ndarray, skip: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    diff = np.flatnonzero((bits(got) != bits(want)) & ~skip.reshape(got.shape))
    assert diff.size == 0, (f"{what}: {diff.size} of {want.size} differ, first at {diff[0]}: "
                            f"{bits(got).reshape(-1)[diff[0]]:#010x} vs "
                            f"{bits(want).reshape(-1)[diff[0]]:#010x}")
    assert (np.isnan(got) == np.isnan(want)).all(), what


def check(monkeypatch, x, cos, sin, rd: int, inverse: bool, paths=PATHS,
          threads=(1, 2), in_place=(False, True)) -> None:
    want = standard(x, cos, sin, rd, inverse)
    skip = ambiguous(x, cos, sin, rd, inverse)
    first = None
    for isa in paths:
        for n in threads:
            for inplace in in_place:
                got = op_session(monkeypatch, rd, inverse, isa, n,
                                 x.ndim if inplace else None).run(
                    None, {"X": x, "Cos": cos, "Sin": sin})[0]
                what = (f"{isa} threads={n} in_place={inplace} x{x.shape} cos{cos.shape} "
                        f"rd={rd} inverse={inverse}")
                assert_same(got, want, skip, what)
                # the op's own NaNs, where onnxruntime's are not defined, alike everywhere
                first = got if first is None else first
                assert (bits(got) == bits(first)).all(), what


# (shape of X, rope_head_dim): the released q and o (d 512, rd 64, scaled down in s), rd == d,
# rank 3 (kv, index keys), one token, one head, odd sizes; one large enough for two threads.
SHAPES = [((1, 7, 4, 512), 64), ((2, 3, 5, 64), 64), ((1, 1, 64, 512), 64), ((2, 5, 1, 72), 8),
          ((1, 9, 512), 64), ((3, 1, 64), 64), ((2, 4, 130), 2), ((1, 70, 8, 512), 64),
          ((1, 3, 2, 300), 258)]


@pytest.mark.parametrize("shape,rd", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("per_batch", [False, True], ids=["rows", "per_batch"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_matches_standard_ops(monkeypatch, shape, rd, per_batch, inverse):
    for edges in (False, True):
        x, cos, sin = case(sum(shape) + rd + 7 * edges, shape, rd, per_batch, edges=edges)
        check(monkeypatch, x, cos, sin, rd, inverse)


def test_nan_cos_sin_and_zero_rows(monkeypatch):
    """NaN and -0 in the rows too (RopeCosSin never gives them; the op still follows the
    standard ops), and cos/sin of one batch entry broadcast over b ([1, s, rd/2])."""
    x, cos, sin = case(5, (2, 6, 3, 16), 16, True, edges=True)
    rng = np.random.default_rng(1)
    for t in (cos, sin):
        t[rng.random(t.shape) < 0.2] = np.nan
        t[rng.random(t.shape) < 0.2] = -0.0
    for inverse in (False, True):
        check(monkeypatch, x, cos, sin, 16, inverse, threads=(1,))
        check(monkeypatch, x, cos[:1], sin[:1], 16, inverse, threads=(1,))


def test_two_nans_give_the_first(monkeypatch):
    """Where both operands of the Add (or a Mul) are NaN, the first one's sign: re's."""
    x = from_bits(np.array([[[0x7FC00001, 0xFFC00002, 0xFFC00003, 0x7FC00004]]], np.uint32))
    cos = np.array([[0.5, 0.5]], np.float32)
    for sin_value in (0.25, np.nan):
        sin = np.array([[sin_value, -np.float32(sin_value)]], np.float32)
        for inverse in (False, True):
            for isa in PATHS:
                got = op_session(monkeypatch, 4, inverse, isa, 1).run(
                    None, {"X": x, "Cos": cos, "Sin": sin})[0]
                assert list(bits(got).reshape(-1)) == [0x7FC00000, 0x7FC00000,
                                                      0xFFC00000, 0xFFC00000], (isa, inverse)


def test_numpy_definition(monkeypatch):
    """The definition in NumPy (finite values): each product, the difference and the sum
    rounded in float32, then bf16 (nearest even)."""
    x, cos, sin = case(3, (2, 5, 3, 96), 32, False, edges=False)
    for inverse in (False, True):
        s = -sin if inverse else sin
        re, im = x[..., -32::2], x[..., -31::2]
        c, s = cos[None, :, None, :], s[None, :, None, :]
        want = x.copy()
        want[..., -32::2] = re * c - im * s
        want[..., -31::2] = re * s + im * c
        want[..., -32:] = want[..., -32:].astype(ml_dtypes.bfloat16).astype(np.float32)
        got = op_session(monkeypatch, 32, inverse, PATHS[0], 1).run(
            None, {"X": x, "Cos": cos, "Sin": sin})[0]
        assert (bits(got) == bits(want)).all()


def test_portable_body_is_the_standard_graph():
    """A portable artifact (no library: the function body inlined) gives the same bits."""
    for shape, rd, per_batch in (((2, 5, 3, 96), 32, True), ((1, 4, 64), 64, False)):
        x, cos, sin = case(11, shape, rd, per_batch, edges=True)
        for inverse in (0, 1):
            session = ort.InferenceSession(op_model(rd, inverse, portable=True),
                                           providers=["CPUExecutionProvider"])
            got = session.run(None, {"X": x, "Cos": cos, "Sin": sin})[0]
            want = standard(x, cos, sin, rd, bool(inverse))
            assert_same(got, want, ambiguous(x, cos, sin, rd, bool(inverse)), "portable")


def run_op(model: bytes, feeds: dict) -> None:
    make_session(model, options=session_options(1)).run(None, feeds)


def test_errors_name_the_problem():
    x, cos, sin = case(1, (1, 3, 2, 16), 8, False, edges=False)
    feeds = {"X": x, "Cos": cos, "Sin": sin}
    cases = [
        (dict(feeds, X=x[0, 0]), "X must be [b, s, d] or [b, s, h, d], got [2, 16]"),
        (dict(feeds, X=x[None]), "X must be [b, s, d] or [b, s, h, d], got [1, 1, 3, 2, 16]"),
        (dict(feeds, Cos=cos[:2]), "Cos [2, 4] and Sin [3, 4] must have the same shape"),
        (dict(feeds, Cos=cos[:2], Sin=sin[:2]),
         "Cos and Sin must be [s, rope_head_dim/2] = [3, 4] or [b, s, rope_head_dim/2] = "
         "[1, 3, 4], got [2, 4]"),
        (dict(feeds, Cos=cos[:, :2], Sin=sin[:, :2]), "got [3, 2]"),
        (dict(feeds, Cos=np.stack([cos] * 2), Sin=np.stack([sin] * 2)), "got [2, 3, 4]"),
        (dict(feeds, X=x[..., :6]), "rope_head_dim 8 exceeds X's last dimension 6"),
    ]
    for bad, message in cases:
        with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
            run_op(op_model(8), bad)
    for rd, message in ((7, "rope_head_dim must be even and >= 2 .* got 7"),
                        (0, "rope_head_dim must be even and >= 2 .* got 0"),
                        (None, r"attribute rope_head_dim \(an int\) is required")):
        with pytest.raises(Exception, match=message):
            run_op(op_model(rd), feeds)
    with pytest.raises(Exception, match="inverse must be 0 or 1, got 2"):
        run_op(op_model(8, 2), feeds)
    with pytest.raises(Exception, match="ApplyRope"):  # float32 only: no kernel for double
        run_op(op_model(8, x_type=TensorProto.DOUBLE), dict(feeds, X=x.astype(np.float64)))
