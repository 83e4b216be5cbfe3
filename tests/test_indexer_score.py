"""IndexerScore against the standard ops it replaces (the Indexer's score before the op:
MatMul, Cast to bf16 and back, Relu, Mul, Cast, ReduceSum over heads, Cast), run by this
onnxruntime on one thread, bit for bit: on every instruction-set path and thread count, with
float keys and with the packed index-key cache read in place, on fp4-valued inputs and on
adversarial ones built to make the summation orders show (dots that are not exact in float32,
cancelling head sums, -0, the relu boundary, huge and tiny weights, NaN and inf keys), over
shapes that take each of onnxruntime's orders (one GEMM row, T == 1, b == 1 folded or not,
one query row), decode (s = 1) among them; with Candidates, -inf where they are false and
those keys never read, and -inf past each query's Lengths. Also: the portable function
body, and the errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.library import cpu_flags, cpu_isas, indexer_score_pair_counts
from csa2onnx.custom_ops.reference import pack_quantized, round_bf16, unpack_quantized

FORMAT = "fp4_e8m0_32"
PATHS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar", "reference")
         if isa in cpu_isas() or isa == "reference"]
if "amx_int8" in cpu_flags() and "avx512_vnni" in cpu_flags():
    PATHS.insert(0, "amx")  # IndexerScore's own name: the avx512 path on AMX-INT8 tiles
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
# The paths with integer dots on packed keys, and their blocks of key rows: AVX2's
# vpmaddubsw, AVX512-VNNI's vpdpbusd (the avx512 path, and the default on such a CPU without
# AMX) and AMX-INT8's TDPBSSD ("amx", the default on such a CPU; groups of two blocks).
INTEGER_PATHS = [pytest.param("avx2", 4, marks=pytest.mark.skipif(
                     "avx2" not in PATHS, reason="needs a CPU with AVX2")),
                 pytest.param("avx512", 8, marks=pytest.mark.skipif(
                     "avx512" not in PATHS or "avx512_vnni" not in cpu_flags(),
                     reason="needs a CPU with AVX512-VNNI")),
                 pytest.param("amx", 8, marks=pytest.mark.skipif(
                     "amx_int8" not in cpu_flags() or "avx512_vnni" not in cpu_flags(),
                     reason="needs a CPU with AMX-INT8"))]
_vi = helper.make_tensor_value_info


def standard_graph() -> bytes:
    """graphs/indexer.py's score as it was before IndexerScore (the op's portable body)."""
    def cast(x: str, y: str) -> list:
        return [helper.make_node("Cast", [x], [y + "_h"], to=TensorProto.BFLOAT16),
                helper.make_node("Cast", [y + "_h"], [y], to=TensorProto.FLOAT)]
    nodes = [helper.make_node("Slice", ["K", "zero", "T", "one"], ["ks"]),
             helper.make_node("Transpose", ["ks"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("Unsqueeze", ["kt", "one"], ["ku"]),
             helper.make_node("MatMul", ["Q", "ku"], ["dots0"]), *cast("dots0", "dots"),
             helper.make_node("Relu", ["dots"], ["r"]),
             helper.make_node("Unsqueeze", ["W", "minus_one"], ["wu"]),
             helper.make_node("Mul", ["r", "wu"], ["m0"]), *cast("m0", "m"),
             helper.make_node("ReduceSum", ["m", "two"], ["s0"], keepdims=0),
             *cast("s0", "S")]
    inits = [helper.make_tensor(n, TensorProto.INT64, [1], [v])
             for n, v in (("zero", 0), ("one", 1), ("two", 2), ("minus_one", -1))]
    graph = helper.make_graph(nodes, "score", float_inputs(), [_vi("S", TensorProto.FLOAT, None)],
                              inits)
    return custom_op_model(graph)


def float_inputs() -> list:
    # unranked: the kernel checks the shapes
    return [_vi(name, TensorProto.INT64 if name == "T" else TensorProto.FLOAT, None)
            for name in ("Q", "W", "K", "T")]


def op_model(packed: bool, *, portable: bool = False, fmt: str | None = FORMAT,
             masks: str = "", candidate_block: int | None = None) -> bytes:
    """masks: the optional inputs given, "L" (Lengths), "LC" (and Candidates), or "C"
    (Candidates with Lengths left out: an error); candidate_block: the attribute
    candidate_block_size (None: left out, a Candidates value a key)."""
    inputs = float_inputs()
    attrs: dict = {} if candidate_block is None else {"candidate_block_size": candidate_block}
    if packed:
        inputs[2] = _vi("K", TensorProto.UINT8, None)
        attrs |= {"keys_format": fmt} if fmt else {}
    names = ["Q", "W", "K", "T"]
    if masks:
        names.append("L" if "L" in masks else "")
        if "L" in masks:
            inputs.append(_vi("L", TensorProto.INT64, None))
    if "C" in masks:
        inputs.append(_vi("C", TensorProto.BOOL, None))
        names.append("C")
    node = helper.make_node("IndexerScore", names, ["S"], domain="csa2onnx", **attrs)
    graph = helper.make_graph([node], "indexer_score", inputs,
                              [_vi("S", TensorProto.FLOAT, ["b", "s", None])])
    return custom_op_model(graph, portable=portable)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def fp4_values(rng: np.random.Generator, shape: tuple[int, ...], exponents: tuple[int, int],
               zero_blocks: float = 0.0) -> np.ndarray:
    """fp4 e2m1 values with a power-of-two scale per block of 32 on the last axis (the
    values Fp4QuantDequant e8m0 and the packed index keys hold)."""
    codes = E2M1[rng.integers(0, 8, shape)] * rng.choice([-1.0, 1.0], shape)
    blocks = (*shape[:-1], shape[-1] // 32, 1)
    scales = np.exp2(rng.integers(*exponents, blocks)).astype(np.float32)
    scales[rng.random(blocks) < zero_blocks] = 0.0
    return (codes.reshape((*blocks[:-1], 32)) * scales).reshape(shape).astype(np.float32)


def case(seed: int, b: int, s: int, h: int, d: int, r: int, *, adversarial: bool):
    """q [b,s,H,D], w [b,s,H], key rows [b,R,D] as the packed cache holds them, packed."""
    rng = np.random.default_rng(seed)
    if adversarial:
        # Block scales 2^-40..2^40 apart: most dots are not exact in float32, so the order
        # shows; zero blocks make -0/+0 and exact-zero dots; weights mix huge, tiny (down to
        # bf16 subnormals) and equal-magnitude opposite signs (cancelling head sums).
        q = fp4_values(rng, (b, s, h, d), (-40, 41), zero_blocks=0.2)
        keys = fp4_values(rng, (b, r, d), (-40, 41), zero_blocks=0.2)
        w = np.exp2(rng.integers(-140, 120, (b, s, h))) * rng.choice([-1.0, 1.0], (b, s, h))
        w[rng.random((b, s, h)) < 0.3] = 1.5
        w[rng.random((b, s, h)) < 0.3] = -1.5
    else:
        q = fp4_values(rng, (b, s, h, d), (-6, 2))
        keys = fp4_values(rng, (b, r, d), (-6, 2))
        w = rng.standard_normal((b, s, h)) * 0.1
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, d)  # what the cache holds, exactly
    return q, round_bf16(w).astype(np.float32), keys, packed


_sessions: dict = {}


def expected(q, w, keys, t: int) -> np.ndarray:
    if "standard" not in _sessions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # onnxruntime's own orders move with its threads
        _sessions["standard"] = ort.InferenceSession(standard_graph(), options,
                                                     providers=["CPUExecutionProvider"])
    return _sessions["standard"].run(None, {"Q": q, "W": w, "K": keys,
                                            "T": np.array([t], np.int64)})[0]


def op_session(monkeypatch, packed: bool, isa: str, threads: int,
               masks: str = "", candidate_block: int | None = None) -> ort.InferenceSession:
    key = (packed, isa, threads, masks, candidate_block)
    if key not in _sessions:
        monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
        monkeypatch.setenv("CSA_INDEXER_SCORE_ISA", isa)  # read when the kernel is created
        try:
            _sessions[key] = make_session(op_model(packed, masks=masks,
                                                   candidate_block=candidate_block),
                                          options=session_options(threads))
        finally:
            monkeypatch.delenv("CSA_INDEXER_SCORE_ISA")
    return _sessions[key]


def check(monkeypatch, q, w, keys, packed, t: int, paths=PATHS, threads=(1, 2),
          lengths: np.ndarray | None = None, candidates: np.ndarray | None = None,
          candidate_block: int | None = None) -> None:
    """The op's bits are the standard ops' (-inf at keys past `lengths` and where
    `candidates` is false, where given; candidates come with lengths). candidate_block:
    the op reads the candidates a value per block of that many keys (they must be whole
    blocks), block b's value its first key's."""
    want = expected(q, w, keys, t)
    feeds, masks = {}, ""
    if lengths is not None:
        want = np.where(np.arange(t) >= lengths[:, None], np.float32(-np.inf), want)
        feeds, masks = {"L": lengths}, "L"
    if candidates is not None:
        want = np.where(candidates, want, np.float32(-np.inf))
        given = candidates[..., ::candidate_block or 1]
        assert (np.repeat(given, candidate_block or 1, axis=-1)[..., :t] == candidates).all()
        feeds, masks = feeds | {"C": given}, masks + "C"
    for isa in paths:
        for n in threads:
            for is_packed, k in ((False, keys), (True, packed)):
                got = op_session(monkeypatch, is_packed, isa, n, masks, candidate_block).run(
                    None, {"Q": q, "W": w, "K": k, "T": np.array([t], np.int64), **feeds})[0]
                assert got.shape == want.shape
                diff = np.flatnonzero(bits(got) != bits(want))
                assert diff.size == 0, (
                    f"{isa} threads={n} packed={is_packed} shape q{q.shape} T={t}: "
                    f"{diff.size} of {want.size} differ, first at {diff[0]}: "
                    f"{got.reshape(-1)[diff[0]]!r} vs {want.reshape(-1)[diff[0]]!r}")


# (b, s, H, D, R, T): released-like, odd heads, T around the 256-row tile, decode, b = 2,
# one GEMM row (H = 1 with b = 2 or s = 1), T = 1 (the lane-sum kernel) and T = 0.
SHAPES = [(1, 5, 32, 128, 300, 300), (1, 17, 4, 64, 600, 513), (2, 3, 7, 64, 70, 65),
          (1, 1, 32, 128, 700, 600), (2, 1, 64, 128, 40, 33), (1, 1, 5, 64, 10, 9),
          (1, 3, 1, 64, 20, 20), (2, 2, 1, 128, 19, 17), (1, 1, 1, 64, 30, 30),
          (1, 6, 3, 128, 5, 1), (2, 2, 5, 64, 3, 1), (1, 1, 33, 64, 2, 1), (1, 1, 1, 32, 4, 1),
          (1, 2, 6, 32, 8, 2), (2, 4, 2, 64, 4, 0)]


TILE_S = 64  # indexer_score.h kTileS: query rows per task
# Decode (s = 1) at b = 1 (heads summed in order) and b = 4 (in groups of 4), H = 32 and odd
# H (heads padded to the vector width: one head vector, a pair plus one: 33, 48 on AVX-512),
# D = 128 and small D, T past and short of the key blocks (8 / 4 rows) and the tasks' key
# tiles (64 rows); query rows around the tasks' blocks of TILE_S.
DECODE_SHAPES = [(1, 1, 32, 128, 3000, 2999), (4, 1, 32, 128, 1100, 1025),
                 (1, 1, 33, 128, 300, 129), (4, 1, 17, 64, 200, 190), (1, 1, 3, 32, 70, 67),
                 (4, 1, 3, 128, 10, 2), (1, 1, 17, 128, 520, 515), (1, 1, 48, 64, 65, 64),
                 (4, 1, 64, 128, 70, 63), (1, 1, 1, 64, 20, 20), (4, 1, 1, 32, 9, 9),
                 (1, 1, 32, 128, 8, 3), (2, 7, 5, 64, 100, 97), (1, TILE_S, 32, 128, 80, 71),
                 (1, TILE_S + 1, 5, 64, 100, 99), (2, 2 * TILE_S + 3, 32, 128, 300, 290)]


@pytest.mark.parametrize("shape", SHAPES + DECODE_SHAPES,
                         ids=lambda s: "b{}s{}H{}D{}R{}T{}".format(*s))
@pytest.mark.parametrize("adversarial", [False, True], ids=["fp4", "adversarial"])
def test_matches_standard_ops(monkeypatch, shape, adversarial):
    b, s, h, d, r, t = shape
    q, w, keys, packed = case(sum(shape) + adversarial, b, s, h, d, r, adversarial=adversarial)
    check(monkeypatch, q, w, keys, packed, t)


def candidate_mask(rng: np.random.Generator, b: int, s: int, t: int, kind: str,
                   block: int = 8) -> np.ndarray:
    """Candidates [b, s, t]: whole blocks of `block` keys (as select_candidate_blocks
    publishes them, a tenth of the blocks, each query row its own), single keys, none, or
    all."""
    if kind == "blocks":
        keep = rng.random((b, s, -(-t // block))) < 0.1
        keep[..., -1] = True  # the last, partial block: the tiles' tail
        return np.repeat(keep, block, axis=-1)[..., :t]
    if kind == "keys":
        return rng.random((b, s, t)) < 0.05
    return np.full((b, s, t), kind == "all")


def reach(rng: np.random.Generator, s: int, t: int, kind: str) -> np.ndarray:
    """Lengths [s]: a prefill's (q + 1) // 2 and the like, out of range ones, or all T."""
    if kind == "causal":
        return (np.arange(s, dtype=np.int64) + 1) * t // max(s, 1)
    if kind == "random":
        return rng.integers(-3, t + 4, s).astype(np.int64)  # past both ends too
    return np.full(s, t, np.int64)


MASK_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[4], SHAPES[6], SHAPES[9],
               *DECODE_SHAPES[:3], DECODE_SHAPES[13], DECODE_SHAPES[15]]


@pytest.mark.parametrize("kind", ["blocks", "keys", "none", "all", None])
@pytest.mark.parametrize("reachable", ["causal", "random", "all"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=lambda s: "b{}s{}H{}D{}R{}T{}".format(*s))
def test_lengths_and_candidates_mask_and_skip(monkeypatch, shape, reachable, kind):
    """With Lengths (a prefill's reachable keys) and Candidates (a later index source's
    level two) every key a row keeps scores the bits it has without them and every other
    key -inf, on every path and thread count, float and packed keys: over the tiles (blocks
    of keys no query row of a task keeps are skipped, blocks kept by some rows only), the
    one-GEMM-row and T == 1 shapes (row tasks), decode; Lengths past either end clamp."""
    b, s, h, d, r, t = shape
    q, w, keys, packed = case(sum(shape), b, s, h, d, r, adversarial=False)
    rng = np.random.default_rng(sum(shape))
    mask = None if kind is None else candidate_mask(rng, b, s, t, kind)
    check(monkeypatch, q, w, keys, packed, t, lengths=reach(rng, s, t, reachable),
          candidates=mask)


# Candidates a value a block (what a stack hands a later index source): blocks of 8 (the
# released config's), a power of two past the key blocks and tiles (128), and sizes that
# cross them (5, 24, 3: a division per key, not a shift)
@pytest.mark.parametrize("block", [8, 128, 5, 24, 3])
@pytest.mark.parametrize("reachable", ["causal", "random"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[9], DECODE_SHAPES[0],
                                   DECODE_SHAPES[1], DECODE_SHAPES[15]],
                         ids=lambda s: "b{}s{}H{}D{}R{}T{}".format(*s))
def test_candidates_by_block(monkeypatch, shape, reachable, block):
    b, s, h, d, r, t = shape
    q, w, keys, packed = case(sum(shape) + block, b, s, h, d, r, adversarial=False)
    rng = np.random.default_rng(sum(shape) + block)
    check(monkeypatch, q, w, keys, packed, t, lengths=reach(rng, s, t, reachable),
          candidates=candidate_mask(rng, b, s, t, "blocks", block), candidate_block=block)


def test_candidates_skip_keys_not_kept():
    """A key no query keeps is never read: NaN key rows outside the candidates leave every
    score finite (the dots would be NaN), on the tiles and on the definition's row tasks."""
    q, w, keys, packed = case(21, 1, 3, 32, 128, 300, adversarial=False)
    mask = np.zeros((1, 3, 300), bool)
    mask[..., 8:16] = mask[..., 200:208] = mask[..., 260:270] = True
    lengths = np.array([250, 300, 250], np.int64)  # rows 0 and 2 do not reach 260..269
    kept = mask & (np.arange(300) < lengths[:, None])
    packed[0, 16:200, 128 // 2] = 0xFF  # scale byte 0xFF: NaN values in every other row
    keys = unpack_quantized(packed, FORMAT, 128)
    for isa in PATHS:
        for is_packed, k in ((False, keys), (True, packed)):
            with pytest.MonkeyPatch.context() as mp:
                mp.delenv("CSA2ONNX_ISA", raising=False)
                mp.setenv("CSA_INDEXER_SCORE_ISA", isa)
                session = make_session(op_model(is_packed, masks="LC"),
                                       options=session_options(2))
            got = session.run(None, {"Q": q, "W": w, "K": k, "T": np.array([300], np.int64),
                                     "L": lengths, "C": mask})[0]
            assert np.isfinite(got[kept]).all(), (isa, is_packed)
            assert (got[~kept] == -np.inf).all(), (isa, is_packed)


def tie_case(s: int, b: int = 1) -> tuple:
    """Scores that sit on a bf16 tie unless a tiny part is summed in the right order.

    Key row 0's dot with every query and head: 32 products 2^-28 (block 0), then 1, then
    2^-8: summed in MLAS's order (an fma chain over d from 0) it is 1 + 2^-8 + 2^-23, which
    rounds up to bf16 1 + 2^-7; summed big terms first it is the tie 1 + 2^-8, which rounds
    to even (1).
    Key row 1 picks each head's dot 1, 2^-8, 0, 0, 2^-25 x 4 (w = 1): onnxruntime's head sum
    in groups of 4 (b*s >= 2) gives 1 + 2^-8 + 2^-23 (rounds up), the in-order sum (b*s == 1)
    loses each 2^-25 and rounds the tie to 1."""
    h, d = 8, 128
    q = np.zeros((b, s, h, d), np.float32)
    keys = np.zeros((b, 3, d), np.float32)
    q[..., :32] = keys[:, 0, :32] = 2.0 ** -14
    q[..., 32] = keys[:, 0, 32] = 1.0
    q[..., 64] = 2.0 ** -8
    keys[:, 0, 64] = 1.0
    keys[:, 1, 127] = 1.0
    q[..., 127] = np.array([1, 2 ** -8, 0, 0] + [2 ** -25] * 4, np.float32)
    return q, np.ones((b, s, h), np.float32), keys, pack_quantized(keys, FORMAT)


@pytest.mark.skipif("avx512bf16" not in PATHS, reason="needs a CPU with AVX512-BF16")
def test_avx512bf16_takes_vdpbf16ps_where_exact(monkeypatch):
    """The model's fp4 values run on vdpbf16ps (counted), the standard ops' bits; key blocks
    or query rows with values so small that a product could be denormal (flushed by
    vdpbf16ps), or so large that a sum could overflow, run the fma chains, the same bits."""
    q, w, keys, packed = case(5, 4, 1, 64, 128, 300, adversarial=False)
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, 300, paths=["avx512bf16"], threads=(2,))
    after = indexer_score_pair_counts()
    assert after["pairs"] - before["pairs"] >= 2 * 4 * 37 and after["fmaf"] == before["fmaf"]
    keys[1, 17] *= np.float32(2.0**-120)  # batch entry 1: one key row (so its block) tiny
    q[2, 0, 3, 9] = np.float32(2.0**-120)  # batch entry 2: a query row too small
    q[3, 0, 5] *= np.float32(2.0**124)  # batch entry 3: dots that overflow to inf
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, 128)
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, 300, paths=["avx512bf16"], threads=(1,))
    after = indexer_score_pair_counts()
    assert after["fmaf"] - before["fmaf"] == 2 * (1 + 38 + 38)  # float and packed keys


@pytest.mark.parametrize("path,block", INTEGER_PATHS)
def test_integer_dots_where_exact(monkeypatch, path, block):
    """With packed keys, the AVX2 path and the AVX512-VNNI one sum fp4-valued dots in
    integers where no partial sum of their fma chains can round (counted): the model's
    values, a dot at the largest
    exponent spread the path takes (blocks 2^5 .. 2^-4 apart: a query head's 2^3 .. 2^-2
    plus a key's 2^2 .. 2^-2), a dot that cancels to exactly +0, zero blocks; the standard
    ops' bits. A key with blocks 2^10 apart, a query row with a value that is not n * 2^u,
    and one whose dots could near overflow run the fma chains (counted), the same bits."""
    b, h, d, t = 4, 32, 128, 300
    rng = np.random.default_rng(21)
    q = fp4_values(rng, (b, 1, h, d), (-3, 1), zero_blocks=0.1)
    keys = fp4_values(rng, (b, t, d), (-2, 1), zero_blocks=0.1)
    odd = np.tile(np.float32([0.5, 1.5, 6.0, -1.5]), 24)  # e2m1 values, amax 6
    q[0, 0, 0] = np.concatenate([np.full(32, 6.0 * 2**4), odd * 2.0**-1])  # u 3, -2
    keys[0, 5] = np.concatenate([np.full(32, 6.0 * 2**3), odd[::-1] * 2.0**-1])  # u 2, -2
    q[0, 0, 1] = 0.0
    q[0, 0, 1, :32] = 1.5
    keys[0, 7, :32] = np.tile(np.float32([2.0, -2.0]), 16)  # head 1 . key 7 = +0
    w = round_bf16(rng.standard_normal((b, 1, h)) * 0.1).astype(np.float32)
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, d)
    blocks = b * -(-t // block)  # blocks of key rows, one query row per batch entry
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, t, paths=[path], threads=(1,))
    after = indexer_score_pair_counts()
    assert after["int8"] - before["int8"] == blocks and after["int8_fmaf"] == before["int8_fmaf"]
    keys[1, 17, :32] *= np.float32(2.0**8)  # batch entry 1: key 17's blocks >= 2^10 apart
    keys[1, 17, 32:] *= np.float32(2.0**-4)
    q[2, 0, 3, 9:11] = [1.25, 6.0]  # batch entry 2: 1.25 among values with amax 6
    q[3, 0, 5] *= np.float32(2.0**110)  # batch entry 3: dots near 2^110
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, d)
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, t, paths=[path], threads=(1,))
    after = indexer_score_pair_counts()
    per_row = blocks // b
    assert after["int8_fmaf"] - before["int8_fmaf"] == 1 + 2 * per_row
    assert after["int8"] - before["int8"] == blocks - 1 - 2 * per_row


@pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="needs a CPU with AVX512-VNNI")
def test_default_path_takes_vnni_integer_dots(monkeypatch):
    """Unforced, a CPU with AVX512-VNNI scores packed fp4 keys on vpdpbusd (faster than
    vdpbf16ps where both exist), blocks of 8 key rows counted, the standard ops' bits."""
    rng = np.random.default_rng(9)
    q = fp4_values(rng, (2, 1, 32, 128), (-3, 1))  # blocks within 2^3 (as released data are)
    keys = fp4_values(rng, (2, 100, 128), (-2, 1))
    w = round_bf16(rng.standard_normal((2, 1, 32)) * 0.1).astype(np.float32)
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, 128)
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    monkeypatch.delenv("CSA_INDEXER_SCORE_ISA", raising=False)
    session = make_session(op_model(True), options=session_options(1))
    before = indexer_score_pair_counts()
    got = session.run(None, {"Q": q, "W": w, "K": packed, "T": np.array([100], np.int64)})[0]
    after = indexer_score_pair_counts()
    assert after["int8"] - before["int8"] == 2 * -(-100 // 8)
    assert after["pairs"] == before["pairs"] and after["int8_fmaf"] == before["int8_fmaf"]
    assert (bits(got) == bits(expected(q, w, keys, 100))).all()


AMX = "amx_int8" in cpu_flags() and "avx512_vnni" in cpu_flags()


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX-INT8")
@pytest.mark.parametrize("h,d", [(32, 128), (24, 128), (16, 64), (20, 96), (33, 64), (16, 32)])
def test_amx_merged_values(monkeypatch, h, d):
    """On AMX-INT8 tiles, a query head whose blocks' units lie within 2^3 of its smallest
    and a key whose blocks do are summed as merged values (each block's n times 2^shift, one
    int32 sum over D; counted), the largest such values among them (a query's n = 15 and a
    key's 12, shifted by 3); a head and a key with blocks 2^4 apart are summed block by
    block (counted); tiles of 16 heads with H past 16 and not a multiple of 4, D of one to
    four blocks. The standard ops' bits either way."""
    b, s, t = 2, 3, 100
    rng = np.random.default_rng(31)
    q = fp4_values(rng, (b, s, h, d), (-3, 1))  # blocks within 2^3: merged
    keys = fp4_values(rng, (b, t, d), (-2, 2))
    pattern = np.float32([6.0, 3.0] * 16)
    # merged, the largest values: a query block of unit 2^2 holding n = 15 (7.5 * 2^3) beside
    # blocks of unit 2^-1 (n = 15 again); a key block of 6 * 2^3 (n = 12 at unit 2^3) beside
    # blocks at 2^0: shifted by 3, 120 and 96
    q[0, 0, 0] = np.tile(np.float32([7.5, -0.5]), d // 2)
    q[0, 0, 0, :32] = [7.5 * 2.0**3] + [0.5 * 2.0**3] * 31
    keys[0, 5] = np.tile(np.float32([6.0, -0.5]), d // 2)
    keys[0, 5, :32] = 6.0 * 2.0**3
    if d > 32:  # block by block: a head and a key with blocks 2^4 apart
        q[1, 1, 2] = pattern.repeat(d // 32) * np.float32(2.0**-2)  # unit 2^-3
        q[1, 1, 2, :32] = pattern * np.float32(2.0**2)  # unit 2^1
        keys[1, 40] = pattern.repeat(d // 32) * np.float32(2.0**-2)  # unit 2^-2
        keys[1, 40, :32] = 6.0 * 2.0**2  # unit 2^2
    w = round_bf16(rng.standard_normal((b, s, h)) * 0.1).astype(np.float32)
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, d)
    blocks = b * s * -(-t // 8)
    # not merged (D > 32): row (1, 1) whole, and key 40's group (blocks 4, 5) for batch 1's
    # two other rows
    unmerged = (-(-t // 8) + 2 * 2) if d > 32 else 0
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, t, paths=["amx"], threads=(1,))
    after = indexer_score_pair_counts()
    assert after["amx"] - before["amx"] == blocks  # packed keys only
    assert after["int8"] - before["int8"] == blocks and after["int8_fmaf"] == before["int8_fmaf"]
    assert after["amx_merged"] - before["amx_merged"] == blocks - unmerged


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX-INT8")
def test_default_path_takes_amx_from_two_query_rows(monkeypatch):
    """Unforced, a CPU with AMX-INT8 scores packed fp4 keys on its tiles from two query rows
    a batch entry (counted); one row (decode) stays on vpdpbusd; the standard ops' bits."""
    rng = np.random.default_rng(5)
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    monkeypatch.delenv("CSA_INDEXER_SCORE_ISA", raising=False)
    session = make_session(op_model(True), options=session_options(2))
    for s, on_amx in ((1, False), (2, True), (5, True)):
        q = fp4_values(rng, (2, s, 32, 128), (-3, 1))
        keys = fp4_values(rng, (2, 70, 128), (-2, 1))
        w = round_bf16(rng.standard_normal((2, s, 32)) * 0.1).astype(np.float32)
        packed = pack_quantized(keys, FORMAT)
        keys = unpack_quantized(packed, FORMAT, 128)
        before = indexer_score_pair_counts()
        got = session.run(None, {"Q": q, "W": w, "K": packed, "T": np.array([70], np.int64)})[0]
        after = indexer_score_pair_counts()
        blocks = 2 * s * -(-70 // 8)
        assert after["int8"] - before["int8"] == blocks
        assert after["amx"] - before["amx"] == (blocks if on_amx else 0)
        assert (bits(got) == bits(expected(q, w, keys, 70))).all()


@pytest.mark.parametrize("path,block", INTEGER_PATHS)
def test_integer_dots_refuse_a_value_finer_than_its_unit(monkeypatch, path, block):
    """A query block whose largest value sets the unit 2^100 and which also holds 2^-60: the
    value over the unit underflows to 0 in float32, so it is not n * 2^u; the row runs the
    fma chains (counted), and the dot it alone makes (2^-60 against a key's 1) stays."""
    b, h, d, t = 1, 8, 128, 16
    rng = np.random.default_rng(7)
    q = fp4_values(rng, (b, 1, h, d), (-2, 1))
    keys = fp4_values(rng, (b, t, d), (-2, 1))
    q[0, 0, 0] = 0.0
    q[0, 0, 0, :2] = [6.0 * 2.0**101, 2.0**-60]
    keys[0, 3, :32] = 0.0
    keys[0, 3, 1] = 1.0
    w = np.zeros((b, 1, h), np.float32)
    w[0, 0, 0] = 1.0
    packed = pack_quantized(keys, FORMAT)
    keys = unpack_quantized(packed, FORMAT, d)
    assert expected(q, w, keys, t)[0, 0, 3] == np.float32(2.0**-60)
    before = indexer_score_pair_counts()
    check(monkeypatch, q, w, keys, packed, t, paths=[path], threads=(1,))
    after = indexer_score_pair_counts()
    assert after["int8_fmaf"] - before["int8_fmaf"] == t // block
    assert after["int8"] == before["int8"]


def test_packed_keys_at_every_scale_byte(monkeypatch):
    """Packed keys whose e8m0 scale bytes sit at and past the ends of the range the
    avx512bf16 path turns into pairs straight from the codes (2..252: every value normal and
    finite): 0 and 1 (values down to float denormals), 253 and 254 (values that overflow to
    inf), 255 (NaN) and the edges themselves, each in a key row of its own among ordinary
    rows; the op on the packed rows gives the standard ops' bits on the floats they hold,
    on every path."""
    q, w, keys, packed = case(13, 2, 1, 32, 128, 200, adversarial=False)
    code_bytes = 128 // 2
    edges = [0, 1, 2, 3, 126, 127, 228, 229, 251, 252, 253, 254, 255]
    for i, byte in enumerate(edges):
        packed[i % 2, 9 * i + 1, code_bytes + i % 4] = byte  # one block of the row
    packed[1, 150, code_bytes:] = 252  # a whole row at the top edge, next to ordinary rows
    keys = unpack_quantized(packed, FORMAT, 128)
    assert np.isinf(keys).any() and np.isnan(keys).any()
    assert (np.abs(keys[keys != 0]) < 2.0**-126).any()  # float denormals
    check(monkeypatch, q, w, keys, packed, 200)


def test_orders_decide_ties(monkeypatch):
    """Inputs whose scores change with the dot's and the head sum's order: onnxruntime's
    results are the ones the orders above predict, and the op gives them on every path."""
    q, w, keys, packed = tie_case(2)
    assert (unpack_quantized(packed, FORMAT, 128) == keys).all()
    want = expected(q, w, keys, 3)
    assert (want[0, :, 0] == 8 * (1 + 2 ** -7)).all()  # the tiny block first: rounds up
    assert (want[0, :, 1] == 1 + 2 ** -7).all()  # heads in groups of 4: rounds up
    check(monkeypatch, q, w, keys, packed, 3)
    q1, w1, keys1, packed1 = tie_case(1)
    want1 = expected(q1, w1, keys1, 3)
    assert want1[0, 0, 1] == 1.0  # one query row: heads in order, the tie to even
    check(monkeypatch, q1, w1, keys1, packed1, 3)
    for b, s in ((4, 1), (1, TILE_S + 1)):  # decode at batch 4; two blocks of query rows
        qb, wb, keysb, packedb = tie_case(s, b)
        assert (expected(qb, wb, keysb, 3)[..., :2] == want[0, 0, :2]).all()  # groups of 4
        check(monkeypatch, qb, wb, keysb, packedb, 3)


@pytest.mark.parametrize("b,s,h", [(2, 3, 6), (1, 1, 6), (4, 1, 17), (2, TILE_S + 1, 6)],
                         ids=lambda v: str(v))
def test_relu_boundary_signed_zeros_and_nan_keys(monkeypatch, b, s, h):
    """Dots of exactly +0 and -0 (zero queries), tiny negative dots, weights of both signs
    (relu's +0 times a negative weight is -0), all-(-0) head sums, a NaN key block (scale
    byte 0xFF), a key block of infs and huge finite values (scale 2^127), an inf query head
    and an inf weight; decode shapes (s = 1), a few queries, two blocks of query rows."""
    d, r = 64, 40
    q, w, keys, packed = case(11 + s, b, s, h, d, r, adversarial=False)
    q[0, 0, :h // 2] = 0.0
    q[-1, -1, :h // 2, :32] = -0.0
    q[-1, -1, :h // 2, 32:] = 0.0
    w[0, :, :2] = -np.abs(w[0, :, :2])  # relu's zeros times negative weights: -0 terms
    q[b - 1, 0, h - 1, 40] = np.inf  # +-inf dots, NaN with the inf key block
    w[b - 1, 0, h - 1] = 1.0
    w[b - 1, 0, h // 2] = np.inf  # relu's zeros times inf: NaN
    keys[b - 1, 3] *= np.float32(2.0 ** -120)  # tiny dots: bf16 subnormals, relu boundary
    packed = pack_quantized(keys, FORMAT)
    packed[b - 1, 5, d // 2] = 0xFF  # block 0 of key row 5: NaN
    packed[0, 7, d // 2 + 1] = 0xFE  # block 1 of key row 7: values times 2^127, inf from 2
    keys = unpack_quantized(packed, FORMAT, d)
    assert np.isnan(keys[b - 1, 5, :32]).all() and np.isinf(keys[0, 7, 32:]).any()
    want = expected(q, w, keys, r)
    assert np.isnan(want).any() and np.isinf(want).any()
    check(monkeypatch, q, w, keys, packed, r)


def test_portable_body_is_the_standard_graph():
    """A portable artifact (no library: the function body inlined) gives the same bits."""
    q, w, keys, _ = case(3, 2, 5, 8, 64, 50, adversarial=True)
    session = ort.InferenceSession(op_model(False, portable=True),
                                   providers=["CPUExecutionProvider"])
    t = np.array([47], np.int64)
    got = session.run(None, {"Q": q, "W": w, "K": keys, "T": t})[0]
    assert (bits(got) == bits(expected(q, w, keys, 47))).all()


def run_op(model: bytes, feeds: dict) -> None:
    make_session(model, options=session_options(1)).run(None, feeds)


def test_errors_name_the_problem():
    q, w, keys, packed = case(1, 1, 2, 4, 64, 8, adversarial=False)
    t = np.array([8], np.int64)
    feeds = {"Q": q, "W": w, "K": keys, "T": t}
    cases = [
        (dict(feeds, T=np.array([9], np.int64)), "Width 9 must be in [0, R = 8]"),
        (dict(feeds, T=np.array([-1], np.int64)), "Width -1"),
        (dict(feeds, T=np.array([1, 2], np.int64)), "Width must hold one element"),
        (dict(feeds, W=w[:, :, :3]), "W must be [b, s, H] = [1, 2, 4]"),
        (dict(feeds, K=keys[:, :, :32]), "Keys must be [b, R, D] = [1, R, 64]"),
        (dict(feeds, Q=q[0]), "Q must be [b, s, H, D]"),
        (dict(feeds, Q=np.zeros((1, 2, 4, 256), np.float32), K=np.zeros((1, 8, 256), np.float32)),
         "D must be in [1, 128]"),
    ]
    for bad, message in cases:
        with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
            run_op(op_model(False), bad)
    packed_feeds = dict(feeds, K=packed)
    with pytest.raises(Exception, match=r"Keys must be \[b, R, row_bytes\] = \[1, R, 34\]"):
        run_op(op_model(True), dict(packed_feeds, K=packed[:, :, :30]))
    with pytest.raises(Exception, match="need the attribute keys_format"):
        run_op(op_model(True, fmt=None), packed_feeds)
    with pytest.raises(Exception, match="unknown keys_format \"fp4\""):
        run_op(op_model(True, fmt="fp4"), packed_feeds)
    with pytest.raises(Exception, match="do not divide D = 48"):
        run_op(op_model(True), dict(packed_feeds, Q=q[..., :48]))
    lengths = np.array([3, 8], np.int64)
    for shape in ((1, 2, 7), (1, 8), (2, 2, 8)):
        with pytest.raises(Exception, match=r"Candidates must be \[b, s, Width\] = \[1, 2, 8\]"):
            run_op(op_model(False, masks="LC"), dict(feeds, L=lengths, C=np.ones(shape, bool)))
    for shape in ((1,), (1, 2), (3,)):
        with pytest.raises(Exception, match=r"Lengths must be \[s\] = \[2\]"):
            run_op(op_model(False, masks="L"), dict(feeds, L=np.zeros(shape, np.int64)))
    with pytest.raises(Exception, match=r"Candidates \(input 5\) need Lengths \(input 4\)"):
        run_op(op_model(False, masks="C"), dict(feeds, C=np.ones((1, 2, 8), bool)))
    for shape in ((1, 2, 8), (1, 2, 2), (1, 2)):  # T = 8 in blocks of 3: 3 values a row
        with pytest.raises(Exception, match=r"Candidates must be \[b, s, ceil\(Width / "
                                            r"candidate_block_size 3\)\] = \[1, 2, 3\]"):
            run_op(op_model(False, masks="LC", candidate_block=3),
                   dict(feeds, L=lengths, C=np.ones(shape, bool)))
    for block in (0, -8):
        with pytest.raises(Exception, match=f"candidate_block_size must be >= 1.*got {block}"):
            run_op(op_model(False, masks="LC", candidate_block=block),
                   dict(feeds, L=lengths, C=np.ones((1, 2, 8), bool)))
