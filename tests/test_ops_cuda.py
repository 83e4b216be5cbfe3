"""The custom ops in CUDA sessions (needs an NVIDIA GPU and onnxruntime-gpu; see
tools/gpu_op_tests.sh): Fp4QuantDequant's CUDA kernel bit-exact against the CPU kernel and the
unit goldens, float32 and bfloat16, plain runs and IOBinding on the device; TorchTopK (a CPU
kernel) inside a CUDA session, behind a CUDA Fp4QuantDequant, giving the CPU results;
Fp8Linear's CUDA kernel bit-exact against its CPU kernel.

Skips without a CUDA execution provider or without CUDA kernels in the library, unless
CSA2ONNX_REQUIRE_GPU=1 (set by tools/gpu_op_tests.sh), which turns those skips into failures.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from helpers import bf16_values, hard_values
from onnx import TensorProto, helper

from csa2onnx.custom_ops import CustomOpLibraryError, library_path, make_session, session_options
from csa2onnx.custom_ops.weight_layout import pack_pairs16
from csa2onnx.graphs.standalone import IR_VERSION

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
GOLDEN_TAGS = [("e8m0_b32.grid_ties", 32, "e8m0"), ("e8m0_b32.edge", 32, "e8m0"),
               ("e4m3_b16.grid_ties", 16, "e4m3"), ("e4m3_b16.edge", 16, "e4m3")]
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("csa2onnx", 1)]


def _why_not_runnable() -> str | None:
    if hasattr(ort, "preload_dlls"):  # CUDA/cuDNN from the nvidia-* wheels, if installed
        with contextlib.suppress(Exception):  # missing DLLs show up as a missing provider
            ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"no CUDAExecutionProvider in onnxruntime {ort.__version__} "
                f"({ort.get_available_providers()}); install onnxruntime-gpu on a machine "
                "with an NVIDIA GPU (tools/gpu_op_tests.sh)")
    try:
        data = library_path().read_bytes()
    except CustomOpLibraryError as e:
        return str(e)
    if b".nv_fatbin" not in data:  # the section nvcc's device code lives in
        return ("the custom-op library has no CUDA kernels; build it with "
                "`python custom_ops/build.py --cuda ON` (needs nvcc)")
    return None


REASON = _why_not_runnable()
if REASON and os.environ.get("CSA2ONNX_REQUIRE_GPU") == "1":
    raise RuntimeError(f"CSA2ONNX_REQUIRE_GPU=1 but the CUDA tests cannot run: {REASON}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def fp4_model(block: int, fmt: str, dtype: int = TensorProto.FLOAT) -> bytes:
    nodes = [helper.make_node("Fp4QuantDequant", ["X"], ["Y", "Scale"], domain="csa2onnx",
                              block_size=block, scale_format=fmt)]
    if dtype != TensorProto.FLOAT:  # numpy has no bfloat16: read Y as float
        nodes[0].output[0] = "Y_raw"
        nodes.append(helper.make_node("Cast", ["Y_raw"], ["Y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes, "fp4", [helper.make_tensor_value_info("X", dtype, ["r", "c"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["r", "c"]),
         helper.make_tensor_value_info("Scale", TensorProto.FLOAT, ["r", "b"])])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


def cuda_only_session(model: bytes) -> ort.InferenceSession:
    """A CUDA session that fails to build if any node would fall back to the CPU, so the
    CUDA kernel is what runs (a library without it would silently test the CPU kernel)."""
    options = session_options()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = make_session(model, providers=CUDA, options=options)
    assert session.get_providers()[0] == "CUDAExecutionProvider", session.get_providers()
    return session


def feed(x: np.ndarray, dtype: int) -> ort.OrtValue:
    if dtype == TensorProto.BFLOAT16:  # raw bits; x is bf16-valued float32
        bits = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x, np.float32))


def run(session: ort.InferenceSession, x: np.ndarray, dtype: int) -> tuple[np.ndarray, ...]:
    y, scale = session.run_with_ort_values(["Y", "Scale"], {"X": feed(x, dtype)})
    return y.numpy(), scale.numpy()


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit-equal, NaN matching NaN: the payload of a NaN made by 0*inf or inf/inf is the
    hardware's default NaN, which differs between x86 and CUDA."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return got.shape == want.shape and bool(np.all(
        (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))))


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.BFLOAT16],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("tag", "block", "fmt"), GOLDEN_TAGS)
def test_cuda_kernel_matches_unit_goldens(tag: str, block: int, fmt: str, dtype: int) -> None:
    with np.load(GOLDENS / "unit_kernels.npz") as unit:
        x, want_y, want_scale = (unit[f"fp4.{tag}.{name}"] for name in
                                 ("input", "output", "scale"))
    assert not (x.view(np.uint32) & 0xFFFF).any()  # bf16-valued: the bf16 run sees the same x
    y, scale = run(cuda_only_session(fp4_model(block, fmt, dtype)), x, dtype)
    np.testing.assert_array_equal(y.view(np.uint32), want_y.view(np.uint32))
    np.testing.assert_array_equal(scale, want_scale)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.BFLOAT16],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("block", "fmt"), [(32, "e8m0"), (16, "e4m3"), (128, "e8m0"),
                                            (1, "e4m3")])
def test_cuda_kernel_matches_cpu_kernel(block: int, fmt: str, dtype: int) -> None:
    x = hard_values(np.random.default_rng(block), 2048, 512)  # 1M values, 4K+ CUDA blocks
    model = fp4_model(block, fmt, dtype)
    cpu_y, cpu_scale = run(make_session(model), x, dtype)
    cuda_y, cuda_scale = run(cuda_only_session(model), x, dtype)
    differ = int((~np.isclose(cuda_y, cpu_y, rtol=0, atol=0, equal_nan=True)).sum())
    assert same(cuda_y, cpu_y), f"{differ} values differ"
    assert same(cuda_scale, cpu_scale)
    assert np.isnan(cpu_y).any() and not np.isnan(cpu_y).all()  # the NaN blocks were exercised


def test_cuda_kernel_with_iobinding_on_the_device() -> None:
    x = hard_values(np.random.default_rng(1), 256, 1024)
    model = fp4_model(32, "e8m0")
    cpu_y, cpu_scale = run(make_session(model), x, TensorProto.FLOAT)
    session = cuda_only_session(model)
    binding = session.io_binding()
    binding.bind_ortvalue_input("X", ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    binding.bind_output("Y", "cuda", 0)
    binding.bind_output("Scale", "cuda", 0)
    for _ in range(2):  # a second run reuses the bound device buffers
        session.run_with_iobinding(binding)
        assert all(v.device_name().lower() == "cuda" for v in binding.get_outputs())
        y, scale = binding.copy_outputs_to_cpu()
        assert same(y, cpu_y) and same(scale, cpu_scale)


def test_empty_input_on_cuda() -> None:
    y, scale = run(cuda_only_session(fp4_model(16, "e4m3")), np.zeros((0, 64), np.float32),
                   TensorProto.FLOAT)
    assert y.shape == (0, 64) and scale.shape == (0, 4)


def test_torch_topk_runs_on_the_cpu_inside_a_cuda_session() -> None:
    # X -> Fp4QuantDequant (CUDA) -> TorchTopK (CPU only): onnxruntime copies Y to the host.
    nodes = [helper.make_node("Fp4QuantDequant", ["X"], ["Q"], domain="csa2onnx",
                              block_size=32, scale_format="e8m0"),
             helper.make_node("TorchTopK", ["Q", "K"], ["Values", "Indices"],
                              domain="csa2onnx", largest=1, sorted=1)]
    graph = helper.make_graph(
        nodes, "fp4_topk",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["r", "n"]),
         helper.make_tensor_value_info("K", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("Values", TensorProto.FLOAT, ["r", "k"]),
         helper.make_tensor_value_info("Indices", TensorProto.INT64, ["r", "k"])])
    model = helper.make_model(graph, opset_imports=OPSETS,
                              ir_version=IR_VERSION).SerializeToString()
    rng = np.random.default_rng(4)
    x = bf16_values(rng.standard_normal((64, 4096)))  # fp4 output ties heavily: ties decide
    cuda = make_session(model, providers=CUDA)
    assert cuda.get_providers()[0] == "CUDAExecutionProvider"
    cpu = make_session(model)
    for k in (1, 64, 512, 4096):  # both sides of torch's k*64 <= n switch
        feeds = {"X": x, "K": np.array([k], np.int64)}
        got_v, got_i = cuda.run(None, feeds)
        want_v, want_i = cpu.run(None, feeds)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_v.view(np.uint32), want_v.view(np.uint32))


def fp8_linear_model(round_output: int = 0, layout: str = "plain") -> bytes:
    attributes: dict = {"round_output": 1} if round_output else {}
    if layout != "plain":
        attributes["weight_layout"] = layout
    node = helper.make_node("Fp8Linear", ["X", "W", "WScale"], ["Y"], domain="csa2onnx",
                            **attributes)
    graph = helper.make_graph(
        [node], "fp8",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("W", TensorProto.FLOAT8E4M3FN, None),
         helper.make_tensor_value_info("WScale", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=IR_VERSION).SerializeToString()


@pytest.mark.parametrize("round_output", [0, 1])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 32), (3, 1000, 1280), (70, 300, 2048),
                                           (2, 33, 0), (0, 5, 64)])
def test_fp8_linear_cuda_kernel_matches_cpu_kernel(m: int, n: int, k: int,
                                                   round_output: int) -> None:
    """Every bit (NaN for NaN), NaN rows and columns and every e4m3 code included; with
    round_output, through bf16 as the Cast pair (both kernels)."""
    rng = np.random.default_rng(m * 7 + n + k)
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-20, 20, (m, 1)))).astype(np.float32)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    if m > 2 and k:
        x[1, 0], x[2, k - 1] = np.nan, np.inf
        codes[5, 3] = 0x7F
    w_scale = np.exp2(rng.integers(-20, 4, (-(-n // 32), k // 32))).astype(np.float32)
    feeds = {"X": ort.OrtValue.ortvalue_from_numpy(x),
             "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(codes,
                                                                  TensorProto.FLOAT8E4M3FN),
             "WScale": ort.OrtValue.ortvalue_from_numpy(w_scale)}
    model = fp8_linear_model(round_output)
    cpu = make_session(model).run_with_ort_values(["Y"], feeds)[0].numpy()
    cuda = cuda_only_session(model).run_with_ort_values(["Y"], feeds)[0].numpy()
    assert same(cuda, cpu)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 32), (3, 1008, 1280), (70, 304, 2048)])
def test_fp8_linear_cuda_kernel_reads_pairs16(m: int, n: int, k: int) -> None:
    """A pairs16 W (custom_ops/weight_layout.py, as an export writes it) on CUDA: the CPU
    kernel's bits on the plain W."""
    rng = np.random.default_rng(m * 11 + n + k)
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-20, 20, (m, 1)))).astype(np.float32)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[n - 1, k - 1] = 0x7F
    w_scale = np.exp2(rng.integers(-20, 4, (-(-n // 32), k // 32))).astype(np.float32)

    def feeds(w: np.ndarray) -> dict:
        return {"X": ort.OrtValue.ortvalue_from_numpy(x),
                "W": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(w), TensorProto.FLOAT8E4M3FN),
                "WScale": ort.OrtValue.ortvalue_from_numpy(w_scale)}
    cpu = make_session(fp8_linear_model()).run_with_ort_values(["Y"], feeds(codes))[0].numpy()
    cuda = cuda_only_session(fp8_linear_model(layout="pairs16")).run_with_ort_values(
        ["Y"], feeds(pack_pairs16(codes)))[0].numpy()
    assert same(cuda, cpu)
