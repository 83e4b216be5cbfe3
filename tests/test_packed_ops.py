"""PackQuantized / UnpackQuantized: the packed bytes equal the NumPy definition
(custom_ops/reference.py `pack_quantized`) and UnpackQuantized(PackQuantized(x)) equals the
round trip the graph computes today bit for bit (Fp4QuantDequant for the fp4 formats, the
graph's act_quant for fp8), on random, edge and adversarial inputs, on every instruction-set
path and thread count; every code and scale byte unpacks as defined; errors are clear."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import build_cpp_driver, custom_op_model, run_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.custom_ops.reference import (
    fp4_round_trip,
    fp8_act_quant,
    pack_quantized,
    unpack_quantized,
)
from csa2onnx.graphs import quant
from csa2onnx.graphs.numerics import FLOAT
from csa2onnx.graphs.standalone import build_model

PATHS = [isa for isa in ("avx512", "avx2", "scalar") if isa in cpu_isas()]
FORMATS = list(PACKED_FORMATS)
# format -> (Fp4QuantDequant block, scale_format), None for act_quant
ROUND_TRIP = {"fp4_e4m3_16": (16, "e4m3"), "fp4_e8m0_32": (32, "e8m0"), "fp8_e8m0_32": None}
VARIABLES = ("CSA_PACK_QUANTIZED_ISA", "CSA_UNPACK_QUANTIZED_ISA", "CSA2ONNX_ISA")


def vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def pack_model(fmt: str, *, portable: bool = False) -> bytes:
    node = helper.make_node("PackQuantized", ["X"], ["P"], domain="csa2onnx", format=fmt)
    graph = helper.make_graph([node], "pack", [vi("X", TensorProto.FLOAT, None)],
                              [vi("P", TensorProto.UINT8, None)])
    return custom_op_model(graph, portable=portable)


def unpack_model(fmt: str, dim: int, *, portable: bool = False) -> bytes:
    node = helper.make_node("UnpackQuantized", ["P"], ["Y"], domain="csa2onnx", format=fmt,
                            dim=dim)
    graph = helper.make_graph([node], "unpack", [vi("P", TensorProto.UINT8, None)],
                              [vi("Y", TensorProto.FLOAT, None)])
    return custom_op_model(graph, portable=portable)


def session(monkeypatch, model: bytes, isa: str = "", threads: int = 1) -> ort.InferenceSession:
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if isa:
        monkeypatch.setenv("CSA2ONNX_ISA", isa)  # read when the session creates the kernel
    try:
        return make_session(model, options=session_options(threads))
    finally:
        monkeypatch.delenv("CSA2ONNX_ISA", raising=False)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def assert_same_values(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit, except that any NaN matches any NaN (payloads are not kept)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), (what, np.argwhere(np.isnan(got) != nan)[:5])
    diff = (bits(got) != bits(want)) & ~nan
    assert not diff.any(), (what, int(diff.sum()), np.argwhere(diff)[:5])


def today_round_trip(fmt: str, x: np.ndarray) -> np.ndarray:
    """What the graph computes today: the Fp4QuantDequant kernel, or graphs/quant act_quant."""
    if ROUND_TRIP[fmt] is not None:
        block, scale_format = ROUND_TRIP[fmt]
        node = helper.make_node("Fp4QuantDequant", ["X"], ["Y", "S"], domain="csa2onnx",
                                block_size=block, scale_format=scale_format)
        graph = helper.make_graph([node], "fp4", [vi("X", TensorProto.FLOAT, None)],
                                  [vi("Y", TensorProto.FLOAT, None),
                                   vi("S", TensorProto.FLOAT, None)])
        return make_session(custom_op_model(graph)).run(["Y"], {"X": x})[0]
    d = x.shape[-1]
    model = build_model("act_quant", [("x", FLOAT, ["n", d])], ["y"],
                        lambda op, v: quant.act_quant(op, v))
    return run_model(model, {"x": x.reshape(-1, d)})["y"].reshape(x.shape)


# ---------------------------------------------------------------- inputs
def block_of(fmt: str) -> int:
    return PACKED_FORMATS[fmt][0]


def adversarial_rows(fmt: str, rows: int, d: int, seed: int) -> np.ndarray:
    """Rows of every kind that decides a code or a scale: values over the whole float32
    range, whole blocks in every binade (subnormal e4m3 / e8m0 scales, the fp8 amax floor),
    exact ties of the value grid (e2m1 or e4m3 midpoints) at exact power-of-two scales,
    signed zeros, float subnormals, saturation and overflow near the float maximum, inf and
    NaN."""
    rng = np.random.default_rng(seed)
    block = block_of(fmt)
    fp8 = fmt.startswith("fp8")
    kinds = 8
    x = np.empty((rows, d), np.float32)
    for r in range(rows):
        kind = r % kinds
        if kind == 0:  # anything: element exponents over the whole range
            row = rng.standard_normal(d) * np.exp2(rng.integers(-149, 128, d).astype(float))
        elif kind == 1:  # whole blocks at one magnitude each, every binade
            row = rng.standard_normal(d) * np.exp2(
                np.repeat(rng.integers(-149, 127, d // block), block).astype(float))
        elif kind == 2:  # grid ties: block max sets an exact power-of-two scale
            grid = ([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0] if not fp8 else
                    np.concatenate([np.arange(1, 16) / 2.0**10 + 2.0**-10,  # e4m3 subnormal ties
                                    np.array([1.0625, 1.1875, 17.0, 19.0, 300.0, 432.0])]))
            top = 448.0 if fp8 else 6.0
            row = rng.choice(grid, d) * rng.choice([-1, 1], d)
            row.reshape(-1, block)[:, 0] = top
            row = row * np.exp2(np.repeat(rng.integers(-30, 30, d // block), block).astype(float))
        elif kind == 3:  # tiny: subnormal scales, the amax floors, float subnormals
            row = rng.standard_normal(d) * np.exp2(
                np.repeat(rng.integers(-149, -100, d // block), block).astype(float))
            row[: d // 4] = rng.standard_normal(d // 4) * 1e-5  # below the fp8 floor
            row[d // 4: d // 4 + block] = 6.0 * 2.0**-9 * rng.random(block)  # e4m3 floor
        elif kind == 4:  # signed zeros and ones
            row = rng.choice([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45], d)
        elif kind == 5:  # saturation and overflow near the float maximum
            row = rng.choice([3.4e38, -3.4e38, 3.0e38, 1.7e38, 2688.0, 2700.0, 448.0, 6.0], d)
            row = row * rng.random(d) ** 4
            row[::block] = rng.choice([3.4028235e38, -3.4028235e38, 3.3e38], d // block)
        elif kind == 6:  # inf and NaN in some blocks, the others ordinary
            row = rng.standard_normal(d)
            row[rng.integers(0, d, 3)] = np.inf
            row[rng.integers(0, d, 2)] = -np.inf
            row[rng.integers(0, d, 2)] = np.nan
        else:  # bf16 activations as the model feeds them
            row = rng.standard_normal(d) * rng.choice([1e-3, 1.0, 30.0])
        with np.errstate(over="ignore"):
            x[r] = row.astype(np.float32)
    return x


DIMS = {"fp4_e4m3_16": 512, "fp4_e8m0_32": 128, "fp8_e8m0_32": 512}


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_equals_definition_and_unpack_equals_todays_round_trip(monkeypatch, fmt) -> None:
    d = DIMS[fmt]
    x = adversarial_rows(fmt, 256, d, seed=len(fmt))
    want_p = pack_quantized(x, fmt)
    want_y = unpack_quantized(want_p, fmt, d)
    assert want_p.shape == (256, packed_row_bytes(fmt, d))
    today = today_round_trip(fmt, x)
    if ROUND_TRIP[fmt] is not None:
        assert_same_values(want_y, today, "definition vs Fp4QuantDequant")
        assert_same_values(want_y, fp4_round_trip(x, *ROUND_TRIP[fmt])[0], "vs fp4_round_trip")
    else:
        # The graph's act_quant (onnxruntime's ReduceMax skips NaN) makes only the NaN value
        # NaN where torch's amax makes the whole block NaN, as the definition and the pack do:
        # compare the blocks without a NaN to the graph, all of them to the definition.
        blocks_nan = np.isnan(x).reshape(256, -1, 32).any(-1, keepdims=True)
        clean = ~np.broadcast_to(blocks_nan, (256, d // 32, 32)).reshape(256, d)
        assert_same_values(want_y[clean], today[clean], "definition vs graph act_quant")
        assert_same_values(want_y, fp8_act_quant(x)[0], "definition vs fp8_act_quant")
    for isa in PATHS:
        pack = session(monkeypatch, pack_model(fmt), isa)
        unpack = session(monkeypatch, unpack_model(fmt, d), isa)
        (p,) = pack.run(None, {"X": x})
        np.testing.assert_array_equal(p, want_p, err_msg=f"{fmt} pack {isa}")
        (y,) = unpack.run(None, {"P": p})
        np.testing.assert_array_equal(bits(y), bits(want_y), err_msg=f"{fmt} unpack {isa}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_and_scale_byte_unpacks_as_defined(monkeypatch, fmt) -> None:
    """Random bytes (every code and every scale byte, including those pack never writes:
    e8m0 0 = 2^-127, NaN codes) unpack as the definition says, on every path."""
    d = DIMS[fmt]
    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, (2048, packed_row_bytes(fmt, d)), dtype=np.uint8)
    p[0, packed_row_bytes(fmt, d) - d // block_of(fmt):] = np.arange(d // block_of(fmt))
    want = unpack_quantized(p, fmt, d)
    assert np.isnan(want).any() and (want == 0).any()
    first = None
    for isa in PATHS:
        for threads in (1, 2):
            (y,) = session(monkeypatch, unpack_model(fmt, d), isa, threads).run(None, {"P": p})
            assert_same_values(y, want, f"{fmt} {isa} {threads}")
            assert (bits(y)[np.isnan(y)] == 0x7FC00000).all()  # the one NaN unpack writes
            first = y if first is None else first  # the paths agree on NaN bits too
            np.testing.assert_array_equal(bits(y), bits(first), err_msg=f"{fmt} {isa}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_million_values_every_path_and_thread_count(monkeypatch, fmt) -> None:
    """Large enough to run in parallel chunks: 1 and 3 threads, every path, same bytes."""
    d = DIMS[fmt]
    x = adversarial_rows(fmt, (1 << 20) // d, d, seed=99)
    want_p = pack_quantized(x, fmt)
    want_y = unpack_quantized(want_p, fmt, d)
    for isa in PATHS:
        for threads in (1, 3):
            (p,) = session(monkeypatch, pack_model(fmt), isa, threads).run(None, {"X": x})
            assert np.array_equal(p, want_p), (fmt, isa, threads)
            (y,) = session(monkeypatch, unpack_model(fmt, d), isa, threads).run(None, {"P": p})
            assert np.array_equal(bits(y), bits(want_y)), (fmt, isa, threads)
    assert_same_values(want_y, today_round_trip(fmt, x) if ROUND_TRIP[fmt] else
                       fp8_act_quant(x)[0], "round trip")


@pytest.mark.parametrize("fmt", FORMATS)
def test_higher_rank_and_empty_inputs(monkeypatch, fmt) -> None:
    block = block_of(fmt)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 2 * block)).astype(np.float32)
    (p,) = session(monkeypatch, pack_model(fmt)).run(None, {"X": x})
    assert p.shape == (2, 3, 4, packed_row_bytes(fmt, 2 * block))
    np.testing.assert_array_equal(p, pack_quantized(x, fmt))
    (y,) = session(monkeypatch, unpack_model(fmt, 2 * block)).run(None, {"P": p})
    np.testing.assert_array_equal(bits(y), bits(unpack_quantized(p, fmt, 2 * block)))
    (p,) = session(monkeypatch, pack_model(fmt)).run(None, {"X": np.zeros((3, 0, block),
                                                                          np.float32)})
    assert p.shape == (3, 0, packed_row_bytes(fmt, block)) and p.dtype == np.uint8
    (p,) = session(monkeypatch, pack_model(fmt)).run(None, {"X": np.zeros((3, 0), np.float32)})
    assert p.shape == (3, 0)
    (y,) = session(monkeypatch, unpack_model(fmt, block)).run(
        None, {"P": np.zeros((0, packed_row_bytes(fmt, block)), np.uint8)})
    assert y.shape == (0, block) and y.dtype == np.float32


def test_layouts_of_one_block() -> None:
    """The byte layout spelled out on hand-made blocks (README, packed_quant.h)."""
    x = np.zeros(16, np.float32)
    x[:4] = [6.0, -0.5, 1.25, -0.0]  # amax 6 -> e4m3 scale 1.0 (code 0x38)
    p = pack_quantized(x, "fp4_e4m3_16")
    assert p.tolist()[:2] == [0x7 | (0x9 << 4), 0x2 | (0x8 << 4)] and p[-1] == 0x38
    x = np.full(32, 3.0, np.float32)  # amax 3 -> e8m0 scale 2^ceil(log2 .5) = .5 (byte 126)
    p = pack_quantized(x, "fp4_e8m0_32")
    assert p[0] == 0x77 and p[-1] == 126 and len(p) == 17
    x = np.full(32, -448.0, np.float32)  # amax 448 -> scale 1 (byte 127), code 0xFE
    p = pack_quantized(x, "fp8_e8m0_32")
    assert (p[:32] == 0xFE).all() and p[32] == 127 and len(p) == 33


@pytest.mark.parametrize(("model", "x", "message"), [
    (lambda: pack_model("nvfp4"), np.ones((2, 32), np.float32), "unknown format \"nvfp4\""),
    (lambda: pack_model("fp4_e4m3_16"), np.ones((2, 24), np.float32),
     r"blocks of 16 values, which do not divide X's last dimension 24"),
    (lambda: pack_model("fp8_e8m0_32"), np.ones((2, 48), np.float32),
     r"blocks of 32 values, which do not divide X's last dimension 48"),
    (lambda: pack_model("fp8_e8m0_32"), np.array(1.0, np.float32), "at least one dimension"),
    (lambda: unpack_model("fp4_e4m3_16", 512), np.zeros((2, 287), np.uint8),
     r"P must be \[\.\.\., 288\] \(format fp4_e4m3_16, dim 512\), got \[2, 287\]"),
    (lambda: unpack_model("fp8_e8m0_32", 40), np.zeros((2, 41), np.uint8),
     r"dim 40 must be >= 0 and a multiple of 32"),
    (lambda: unpack_model("fp4_e8m0_32", -32), np.zeros((2, 41), np.uint8),
     r"dim -32 must be >= 0"),
])
def test_errors_name_the_problem(model, x, message) -> None:
    feed = "X" if x.dtype == np.float32 else "P"
    with pytest.raises((ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                        ort.capi.onnxruntime_pybind11_state.RuntimeException,
                        ort.capi.onnxruntime_pybind11_state.Fail), match=message):
        make_session(model()).run(None, {feed: x})


def test_missing_attributes_are_clear_errors() -> None:
    node = helper.make_node("UnpackQuantized", ["P"], ["Y"], domain="csa2onnx",
                            format="fp8_e8m0_32")
    graph = helper.make_graph([node], "u", [vi("P", TensorProto.UINT8, None)],
                              [vi("Y", TensorProto.FLOAT, None)])
    with pytest.raises(Exception, match="UnpackQuantized: attribute dim"):
        make_session(custom_op_model(graph))
    node = helper.make_node("PackQuantized", ["X"], ["P"], domain="csa2onnx")
    graph = helper.make_graph([node], "p", [vi("X", TensorProto.FLOAT, None)],
                              [vi("P", TensorProto.UINT8, None)])
    with pytest.raises(Exception, match="PackQuantized: attribute format"):
        make_session(custom_op_model(graph))


def test_row_bytes() -> None:
    assert packed_row_bytes("fp4_e4m3_16", 512) == 288  # 4.5 bits a value
    assert packed_row_bytes("fp4_e8m0_32", 128) == 68  # 4.25
    assert packed_row_bytes("fp8_e8m0_32", 512) == 528  # 8.25
    with pytest.raises(ValueError, match="not a multiple"):
        packed_row_bytes("fp4_e8m0_32", 48)
    with pytest.raises(ValueError, match="unknown packed format"):
        packed_row_bytes("fp6", 48)


DRIVER = Path(__file__).resolve().parent / "cpp" / "packed_rows.cc"


def test_building_blocks_over_the_float_range(tmp_path: Path) -> None:
    """tests/cpp/packed_rows.cc: the libm-free block scales and the e4m3 code rounding against
    the definitions over the float range, and every path's rows against the plain code."""
    exe = build_cpp_driver(DRIVER, tmp_path, "-ffp-contract=off")
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", run.stdout.splitlines()[-1])}
    assert run.returncode == 0 and counts["mismatches"] == 0, run.stdout[-3000:]
    assert counts["checked"] > 100_000_000


# ---------------------------------------------------------------- portable bodies
def portable_session(model: bytes) -> ort.InferenceSession:
    """onnxruntime without the library: the function bodies run."""
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_portable_bodies_equal_the_kernels(fmt) -> None:
    """The standard-op bodies give the packed bytes and the unpacked values of the kernels
    (NaN payloads aside) on the adversarial rows, and on every byte value."""
    d = DIMS[fmt]
    x = adversarial_rows(fmt, 128, d, seed=3)
    want_p = pack_quantized(x, fmt)
    (p,) = portable_session(pack_model(fmt, portable=True)).run(None, {"X": x})
    np.testing.assert_array_equal(p, want_p)
    unpack = portable_session(unpack_model(fmt, d, portable=True))
    (y,) = unpack.run(None, {"P": p})
    assert_same_values(y, unpack_quantized(p, fmt, d), "portable unpack")
    every = np.random.default_rng(4).integers(0, 256, (256, p.shape[-1]), dtype=np.uint8)
    (y,) = unpack.run(None, {"P": every})
    assert_same_values(y, unpack_quantized(every, fmt, d), "portable unpack, every byte")
    # no rows (a call that completes no group writes none)
    (p,) = portable_session(pack_model(fmt, portable=True)).run(
        None, {"X": np.zeros((0, d), np.float32)})
    assert p.shape == (0, want_p.shape[-1])
    (y,) = unpack.run(None, {"P": p})
    assert y.shape == (0, d)


def test_portable_bodies_pass_the_checker() -> None:
    nodes = [helper.make_node("PackQuantized", ["X"], ["P"], domain="csa2onnx", format=fmt)
             for fmt in ["fp8_e8m0_32"]]
    nodes.append(helper.make_node("UnpackQuantized", ["P"], ["Y"], domain="csa2onnx",
                                  format="fp8_e8m0_32", dim=64))
    graph = helper.make_graph(nodes, "packed", [vi("X", TensorProto.FLOAT, ["r", 64])],
                              [vi("Y", TensorProto.FLOAT, ["r", 64])])
    model = onnx.load_from_string(custom_op_model(graph, portable=True))
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("portable", [False, True], ids=["kernel", "portable"])
def test_wrappers_build_typed_nodes(portable: bool) -> None:
    """custom_ops/ops.py pack_quantized / unpack_quantized / write_rows on a packed cache:
    typed outputs, and the same bytes and values with or without the library."""
    import onnx_ir as ir

    from csa2onnx.custom_ops import ops
    from csa2onnx.custom_ops.portable import portable_functions

    fmt, d = "fp8_e8m0_32", 64
    width = packed_row_bytes(fmt, d)

    def body(op, x, cache, start):
        p = ops.pack_quantized(op, x, fmt)
        assert p.dtype == ir.DataType.UINT8 and list(p.shape) == [1, "n", width]
        y = ops.unpack_quantized(op, p, fmt, d)
        assert y.dtype == ir.DataType.FLOAT and list(y.shape) == [1, "n", d]
        written = ops.write_rows(op, cache, p, start)
        assert written.dtype == ir.DataType.UINT8
        return y, written

    model = build_model("packed", [("x", FLOAT, [1, "n", d]),
                                   ("cache", ir.DataType.UINT8, [1, "r", width]),
                                   ("start", ir.DataType.INT64, [1])], ["y", "cache_out"],
                        body, portable=portable)
    rng = np.random.default_rng(8)
    x = adversarial_rows(fmt, 6, d, seed=8)[None]
    cache = rng.integers(0, 256, (1, 10, width), dtype=np.uint8)
    feeds = {"x": x, "cache": cache, "start": np.array([3], np.int64)}
    if portable:  # build_model attached the function bodies
        assert {f.name for f in model.functions} == {f.name for f in portable_functions()}
        y, out = portable_session(model.SerializeToString()).run(None, feeds)
    else:
        y, out = make_session(model.SerializeToString()).run(None, feeds)
    p = pack_quantized(x, fmt)
    assert_same_values(y, unpack_quantized(p, fmt, d), "wrapper round trip")
    want = cache.copy()
    want[:, 3:9] = p
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="not a multiple"):
        build_model("bad", [("p", ir.DataType.UINT8, [1, 9])], ["y"],
                    lambda op, p: ops.unpack_quantized(op, p, fmt, 48))
