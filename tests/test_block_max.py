"""BlockMax (select_candidate_blocks' block scores, read in place) against its NumPy
definition (custom_ops/reference.py block_max) bit for bit: random rows, a last block shorter
than block_size, block_size 1 and past T (up to INT64_MAX), T = 0 and no rows, ranks 1 to 4,
+-0, +-inf and NaN (a block holding one scores NaN, as torch's amax), on 1 and 2 threads (a
decode row of many blocks is split between them); the portable body (Pad, ReduceMax,
IsNaN); the errors; and the graph's block scores against the reference's torch amax."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.library import cpu_isas
from csa2onnx.custom_ops.reference import block_max

# The kernel's paths (CSA_BLOCK_MAX_ISA): avx512 takes blocks of 8 two to a vector.
PATHS = [isa for isa in ("avx512", "scalar") if isa in cpu_isas()]

_vi = helper.make_tensor_value_info


def model(block_size: int | None, rank: int = 3, *, portable: bool = False) -> bytes:
    attrs = {} if block_size is None else {"block_size": block_size}
    node = helper.make_node("BlockMax", ["X"], ["Y"], domain="csa2onnx", **attrs)
    graph = helper.make_graph([node], "block_max",
                              [_vi("X", TensorProto.FLOAT, [None] * rank)],
                              [_vi("Y", TensorProto.FLOAT, [None] * rank)])
    return custom_op_model(graph, portable=portable)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def special_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Scores as the indexer makes them (bf16 values, -inf where unreachable), with +-0,
    +inf, NaN, and ties between blocks."""
    x = rng.standard_normal(shape).astype(np.float32)
    pick = rng.random(shape)
    x[pick < 0.10] = -np.inf
    x[(pick >= 0.10) & (pick < 0.15)] = 0.0
    x[(pick >= 0.15) & (pick < 0.20)] = -0.0
    x[(pick >= 0.20) & (pick < 0.21)] = np.inf
    x[(pick >= 0.21) & (pick < 0.22)] = np.nan
    x[(pick >= 0.22) & (pick < 0.23)] = np.float32(-np.nan)
    x[(pick >= 0.23) & (pick < 0.30)] = 1.5
    return x


SHAPES = [((1, 1, 1048), 8), ((1, 3, 1047), 8), ((2, 5, 33), 4), ((1, 2, 7), 8), ((3, 9), 1),
          ((4,), 3), ((2, 2, 3, 21), 5), ((1, 1, 0), 8), ((0, 4, 16), 8), ((1, 2, 5), 16),
          ((1, 1, 300001), 8), ((1, 64, 4099), 8), ((2, 3, 10), 2**63 - 1)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape,block", SHAPES, ids=lambda v: str(v))
def test_matches_definition(monkeypatch, shape, block, path):
    rng = np.random.default_rng(sum(shape) + block)
    x = special_values(rng, shape)
    want = block_max(x, block)
    assert want.shape == (*shape[:-1], -(-shape[-1] // block))
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    monkeypatch.setenv("CSA_BLOCK_MAX_ISA", path)  # read when the session creates the kernel
    for threads in (1, 2):
        got = make_session(model(block, len(shape)),
                           options=session_options(threads)).run(None, {"X": x})[0]
        assert got.shape == want.shape
        diff = np.flatnonzero(bits(got) != bits(want))
        assert diff.size == 0, (path, threads, diff.size, got.reshape(-1)[diff[0]],
                                want.reshape(-1)[diff[0]])


def test_definition_semantics():
    """The definition itself: NaN anywhere in a block wins, +0 above -0, -inf pads."""
    x = np.array([[np.nan, 5.0, -0.0, 0.0, -0.0, -0.0, 1.0, -np.inf, -1.0]], np.float32)
    y = block_max(x, 2)
    assert bits(y[0, :1]) == np.uint32(0x7FC00000)
    assert bits(y[0, 1:3]).tolist() == [0x00000000, 0x80000000]  # +0; -0 alone stays -0
    assert y[0, 3] == 1.0 and y[0, 4] == -1.0  # the last block is one value


def test_portable_body():
    """The standard-op body: the kernel's bits, zeros' signs aside where a block holds both."""
    rng = np.random.default_rng(3)
    for shape, block in SHAPES[:9]:
        x = special_values(rng, shape)
        want = block_max(x, block)
        session = ort.InferenceSession(model(block, len(shape), portable=True),
                                       providers=["CPUExecutionProvider"])
        got = session.run(None, {"X": x})[0]
        same = (bits(got) == bits(want)) | ((got == 0) & (want == 0))
        assert got.shape == want.shape and same.all(), (shape, block)


def test_errors_name_the_problem():
    x = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(Exception, match="block_size must be >= 1, got 0"):
        make_session(model(0), options=session_options(1)).run(None, {"X": x})
    with pytest.raises(Exception, match=r"attribute block_size \(an int\) is required"):
        make_session(model(None), options=session_options(1)).run(None, {"X": x})
    with pytest.raises(Exception, match="X must have rank >= 1"):
        make_session(model(8, 0), options=session_options(1)).run(
            None, {"X": np.array(1.0, np.float32)})


def test_matches_torch_amax():
    """The graph's block scores are the reference's (F.pad with -inf, then amax): NaN
    blocks included; zeros compared by value (torch's amax keeps either sign)."""
    torch = pytest.importorskip("torch", reason="torch is the reference's framework")
    rng = np.random.default_rng(5)
    x = special_values(rng, (2, 3, 1003))
    ref = torch.nn.functional.pad(torch.from_numpy(x), (0, -1003 % 8), value=-torch.inf)
    ref = ref.unflatten(-1, (-1, 8)).amax(dim=-1).numpy()
    got = make_session(model(8), options=session_options(2)).run(None, {"X": x})[0]
    assert (np.isnan(got) == np.isnan(ref)).all()
    finite = ~np.isnan(ref)
    assert (got[finite] == ref[finite]).all()
