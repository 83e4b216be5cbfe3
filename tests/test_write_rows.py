"""WriteRows: rows written at row_start, in place when the output is bound to the cache's
buffer, a copy otherwise; every shape checked; the portable function body agrees."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session
from csa2onnx.graphs.standalone import IR_VERSION

ELEMENT_TYPES = {np.float32: TensorProto.FLOAT, np.uint8: TensorProto.UINT8}


def write_rows_model(with_after: bool = False, functions: bool = False,
                     dtype: type = np.float32) -> bytes:
    inputs = ["C", "R", "S"] + (["A"] if with_after else [])
    node = helper.make_node("WriteRows", inputs, ["Y"], domain="csa2onnx")
    element = ELEMENT_TYPES[dtype]
    # Unranked, so that the kernel (not onnxruntime's input check) sees a wrong rank.
    infos = [helper.make_tensor_value_info("C", element, None),
             helper.make_tensor_value_info("R", element, None),
             helper.make_tensor_value_info("S", TensorProto.INT64, None)]
    if with_after:
        infos.append(helper.make_tensor_value_info("A", TensorProto.INT64, None))
    graph = helper.make_graph([node], "write_rows", infos, [
        helper.make_tensor_value_info("Y", element, None)])
    return custom_op_model(graph, portable=functions)


def random_array(rng: np.random.Generator, shape, dtype: type) -> np.ndarray:
    if dtype == np.uint8:  # packed rows: any byte
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.standard_normal(shape).astype(np.float32)


def expected(cache: np.ndarray, rows: np.ndarray, start: int) -> np.ndarray:
    want = cache.copy()
    want[:rows.shape[0], start:start + rows.shape[1]] = rows
    return want


def feeds(cache, rows, start) -> dict[str, np.ndarray]:
    return {"C": cache, "R": rows, "S": np.array([start], np.int64)}


CASES = [((2, 9, 4), (2, 3, 4), 2), ((2, 9, 4), (2, 0, 4), 9), ((3, 5, 2), (1, 2, 2), 3),
         ((1, 4, 8), (1, 4, 8), 0), ((1, 0, 3), (1, 0, 3), 0)]


DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.uint8], ids=["float", "uint8"])


@DTYPES
@pytest.mark.parametrize(("cache_shape", "rows_shape", "start"), CASES)
def test_copy_when_buffers_differ(cache_shape, rows_shape, start, dtype) -> None:
    rng = np.random.default_rng(0)
    cache = random_array(rng, cache_shape, dtype)
    rows = random_array(rng, rows_shape, dtype)
    before = cache.copy()
    (got,) = make_session(write_rows_model(dtype=dtype)).run(None, feeds(cache, rows, start))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected(before, rows, start))
    np.testing.assert_array_equal(cache, before)  # the input is left alone


@DTYPES
@pytest.mark.parametrize(("cache_shape", "rows_shape", "start"), CASES)
def test_in_place_when_bound_to_the_same_buffer(cache_shape, rows_shape, start, dtype) -> None:
    rng = np.random.default_rng(1)
    cache = random_array(rng, cache_shape, dtype)
    rows = random_array(rng, rows_shape, dtype)
    want = expected(cache, rows, start)
    session = make_session(write_rows_model(with_after=True, dtype=dtype))
    value = ort.OrtValue.ortvalue_from_numpy(cache)  # shares `cache`'s memory
    binding = session.io_binding()
    for name, array in feeds(cache, rows, start).items():
        if name != "C":
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_ortvalue_input("A", ort.OrtValue.ortvalue_from_numpy(np.zeros(2, np.int64)))
    binding.bind_ortvalue_input("C", value)
    binding.bind_ortvalue_output("Y", value)
    session.run_with_iobinding(binding)
    (out,) = binding.get_outputs()
    assert out.data_ptr() == value.data_ptr()
    np.testing.assert_array_equal(cache, want)  # written into the caller's buffer


@pytest.mark.parametrize(("cache_shape", "rows_shape", "start", "message"), [
    ((2, 9, 4), (2, 3, 4), -1, r"RowStart must be >= 0, got -1"),
    ((2, 9, 4), (2, 3, 4), 7, r"rows 7 \.\. 9 are past the cache's 9 rows"),
    ((2, 9, 4), (2, 10, 4), 0, r"rows 0 \.\. 9 are past the cache.s 9 rows"),
    ((2, 9, 4), (2, 3, 5), 0, r"differ in the last dimension"),
    ((2, 9, 4), (3, 3, 4), 0, r"has a larger batch than Cache \[2, 9, 4\]"),
    ((9, 4), (2, 3, 4), 0, r"Cache must have rank 3"),
    ((2, 9, 4), (3, 4), 0, r"Rows must have rank 3"),
])
def test_bad_shapes_are_invalid_arguments(cache_shape, rows_shape, start, message) -> None:
    session = make_session(write_rows_model())
    cache = np.zeros(cache_shape, np.float32)
    rows = np.ones(rows_shape, np.float32)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=f"WriteRows: .*{message}"):
        session.run(None, feeds(cache, rows, start))


def test_row_start_must_be_one_element() -> None:
    session = make_session(write_rows_model())
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match=r"WriteRows: RowStart must hold one element, got shape \[2\]"):
        session.run(None, {"C": np.zeros((1, 4, 2), np.float32),
                           "R": np.zeros((1, 1, 2), np.float32),
                           "S": np.array([0, 1], np.int64)})


def test_a_missing_required_input_is_refused() -> None:
    """A node that leaves out a required input fails when the session is created."""
    node = helper.make_node("WriteRows", ["C", "", "S"], ["Y"], domain="csa2onnx")
    graph = helper.make_graph([node], "w", [
        helper.make_tensor_value_info("C", TensorProto.FLOAT, ["B", "r", "d"]),
        helper.make_tensor_value_info("S", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "r", "d"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("csa2onnx", 1)],
                              ir_version=IR_VERSION)
    with pytest.raises(Exception, match="WriteRows: input 1 is required"):
        make_session(model.SerializeToString()).run(None, {
            "C": np.zeros((1, 2, 2), np.float32), "S": np.array([0], np.int64)})


@DTYPES
@pytest.mark.parametrize("with_after", [False, True])
@pytest.mark.parametrize(("cache_shape", "rows_shape", "start"), CASES)
def test_portable_body_agrees(cache_shape, rows_shape, start, with_after, dtype) -> None:
    """The standard-op function body (no library) gives the kernel's result."""
    rng = np.random.default_rng(2)
    cache = random_array(rng, cache_shape, dtype)
    rows = random_array(rng, rows_shape, dtype)
    session = ort.InferenceSession(write_rows_model(with_after, functions=True, dtype=dtype),
                                   providers=["CPUExecutionProvider"])
    inputs = feeds(cache, rows, start) | ({"A": np.zeros(1, np.int64)} if with_after else {})
    (got,) = session.run(None, inputs)
    np.testing.assert_array_equal(got, expected(cache, rows, start))


def test_packed_rows_written_in_place_unpack_as_written() -> None:
    """A packed cache (PackQuantized rows, uint8) written in place by WriteRows: the rows read
    back are the packed new rows, the others untouched (the NumPy write_rows definition)."""
    from csa2onnx.custom_ops.constants import packed_row_bytes
    from csa2onnx.custom_ops.reference import pack_quantized, write_rows

    rng = np.random.default_rng(3)
    width = packed_row_bytes("fp4_e4m3_16", 512)
    cache = rng.integers(0, 256, (2, 8, width), dtype=np.uint8)
    rows = pack_quantized(rng.standard_normal((1, 3, 512)).astype(np.float32), "fp4_e4m3_16")
    want = write_rows(cache, rows, 4)
    session = make_session(write_rows_model(dtype=np.uint8))
    value = ort.OrtValue.ortvalue_from_numpy(cache)
    binding = session.io_binding()
    binding.bind_ortvalue_input("C", value)
    binding.bind_ortvalue_input("R", ort.OrtValue.ortvalue_from_numpy(rows))
    binding.bind_ortvalue_input("S", ort.OrtValue.ortvalue_from_numpy(np.array([4], np.int64)))
    binding.bind_ortvalue_output("Y", value)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(cache, want)


def test_mixed_element_types_are_refused() -> None:
    node = helper.make_node("WriteRows", ["C", "R", "S"], ["Y"], domain="csa2onnx")
    graph = helper.make_graph([node], "w", [
        helper.make_tensor_value_info("C", TensorProto.UINT8, None),
        helper.make_tensor_value_info("R", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("S", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("Y", TensorProto.UINT8, None)])
    with pytest.raises(Exception, match="WriteRows"):
        make_session(custom_op_model(graph)).run(None, {
            "C": np.zeros((1, 2, 2), np.uint8), "R": np.zeros((1, 1, 2), np.float32),
            "S": np.array([0], np.int64)})
