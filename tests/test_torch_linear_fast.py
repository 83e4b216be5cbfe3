"""TorchLinear numerics="fast": with bf16 W on a CPU with AMX-BF16, 16 rows or more sum on
AMX tiles (custom_ops/src/amx_bf16_tiles.h: TDPBF16PS, its own order); everywhere else the
exact kernel's bits. Checked against float64 with the reassociation bound, by how many
outputs differ from exact once rounded to bf16 (a dropped pair, a wrong tile, a stale
accumulator fails), across the tails (rows past a 32-row strip, k-pairs past a 16-pair
step, columns past a panel), both weight layouts, groups, rounding, and thread counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import custom_op_model
from onnx import TensorProto, helper
from test_torch_linear import Errors, bf16_round, bits, session_for
from test_torch_linear_groups import linear_attrs, run_grouped, w_tensor

from csa2onnx.custom_ops.library import cpu_isas, torch_linear_amx_calls

_FLAGS = (Path("/proc/cpuinfo").read_text().split("\n\n")[0]
          if Path("/proc/cpuinfo").is_file() else "")
AMX = all(f" {flag}" in _FLAGS for flag in ("amx_bf16", "amx_tile", "avx512_bf16"))
needs_amx = pytest.mark.skipif(not AMX, reason="the AMX tiles need a CPU with AMX-BF16 "
                               "(elsewhere numerics=fast TorchLinear is the exact kernel)")
AMX_MIN_ROWS = 16  # fewer rows stay on the exact kernel
U = 2.0 ** -24

# (rows, N, K, G): rows at and past the 16-row minimum and the 32-row strips (17, 33, 100
# past a 96-row task), k-pairs short of, at and past a 16-pair step (K 17, 31, 32, 33,
# 300), columns past a panel (70, 130), groups.
SHAPES = [(16, 64, 32, 1), (17, 70, 33, 1), (31, 64, 17, 1), (32, 128, 64, 1),
          (33, 130, 47, 1), (100, 200, 300, 1), (97, 65, 1024, 1), (40, 33, 77, 3),
          (48, 64, 96, 8)]


def model(w: np.ndarray, layout: str, groups: int, *, numerics: str, rounded: bool) -> bytes:
    """Y = TorchLinear(X, W) with a constant bf16 W, numerics as given."""
    n, k = w.shape[0] // groups, w.shape[1]
    attrs = linear_attrs(n, k, layout, groups, rounded)
    if numerics != "exact":
        attrs["numerics"] = numerics
    node = helper.make_node("TorchLinear", ["X", "W"], ["Y"], domain="csa2onnx", **attrs)
    graph = helper.make_graph([node], "linear",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [w_tensor("W", w, "bf16", layout, groups)])
    return custom_op_model(graph)


def case(rng: np.random.Generator, m: int, n: int, k: int, g: int):
    x = bf16_round(rng.standard_normal((m, g * k)).astype(np.float32))
    w = bf16_round(rng.standard_normal((g * n, k)).astype(np.float32))
    return x, w


def reference(x: np.ndarray, w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T per group in float64, sum |x||w| per output)."""
    m, k = x.shape[0], x.shape[1] // g
    xs = x.astype(np.float64).reshape(m, g, k)
    ws = w.astype(np.float64).reshape(g, -1, k)
    exact = np.einsum("mgk,gnk->mgn", xs, ws).reshape(m, -1)
    size = np.einsum("mgk,gnk->mgn", np.abs(xs), np.abs(ws)).reshape(m, -1)
    return exact, size


@needs_amx
@pytest.mark.parametrize("layout", ["plain", "panels64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amx_is_within_the_reassociation_bound(layout: str, shape: tuple) -> None:
    m, n, k, g = shape
    rng = np.random.default_rng(m * 1000 + k)
    x, w = case(rng, m, n, k, g)
    fast = session_for(model(w, layout, g, numerics="fast", rounded=False))
    exact = session_for(model(w, layout, g, numerics="exact", rounded=False))
    before = torch_linear_amx_calls()
    got = run_grouped(fast, x)
    assert torch_linear_amx_calls() > before, "a case for the AMX tiles did not run on them"
    want, size = reference(x, w, g)
    # any order of k - 1 rounded f32 additions of exact products (AMX may round less often)
    bound = (k - 1) * U / (1 - (k - 1) * U) * size
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / (bound + 1e-300))
    # rounded to bf16, fast and exact agree but for outputs near a rounding boundary
    ref = run_grouped(exact, x)
    differ = np.mean(bf16_round(got) != bf16_round(ref))
    assert differ < 0.02, differ


@needs_amx
def test_amx_rounds_its_output_like_the_exact_kernel() -> None:
    rng = np.random.default_rng(5)
    x, w = case(rng, 50, 96, 200, 1)
    plain = session_for(model(w, "panels64", 1, numerics="fast", rounded=False))
    rounded = session_for(model(w, "panels64", 1, numerics="fast", rounded=True))
    assert np.array_equal(bits(run_grouped(rounded, x)), bits(bf16_round(run_grouped(plain, x))))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_bits_do_not_depend_on_the_thread_count(threads: int) -> None:
    rng = np.random.default_rng(6)
    x, w = case(rng, 200, 300, 500, 1)
    one = session_for(model(w, "panels64", 1, numerics="fast", rounded=False), threads=1)
    other = session_for(model(w, "panels64", 1, numerics="fast", rounded=False),
                        threads=threads)
    assert np.array_equal(bits(run_grouped(one, x)), bits(run_grouped(other, x)))


def test_fast_is_the_exact_kernel_where_amx_does_not_run() -> None:
    """Fewer than 16 rows, X that is not bf16-exact, a forced instruction-set path, float W
    (not tested here: no fast kernel has f32 W), or a CPU without AMX: exact's bits."""
    rng = np.random.default_rng(7)
    x, w = case(rng, 40, 70, 100, 1)
    cases = [("few rows", x[:AMX_MIN_ROWS - 1], None),
             ("X not bf16-exact", x + np.float32(2.0 ** -20), None),
             ("forced path", x, "avx512" if "avx512" in cpu_isas() else "avx2")]
    if not AMX:
        cases.append(("no AMX on this CPU", x, None))
    for name, xv, isa in cases:
        fast = session_for(model(w, "plain", 1, numerics="fast", rounded=False), isa)
        exact = session_for(model(w, "plain", 1, numerics="exact", rounded=False), isa)
        before = torch_linear_amx_calls()
        got = run_grouped(fast, xv)
        assert torch_linear_amx_calls() == before, name
        assert np.array_equal(bits(got), bits(run_grouped(exact, xv))), name


def test_unknown_numerics_is_a_clear_error() -> None:
    w = np.ones((4, 8), np.float32)
    with pytest.raises(Errors, match='TorchLinear: attribute numerics must be "exact" or "fast", '
                                     'got "quick"'):
        session_for(model(w, "plain", 1, numerics="quick", rounded=False))


@needs_amx
def test_exact_prefill_on_an_amx_cpu_takes_the_fmaf_tiles_with_the_same_bits() -> None:
    """Exact, default path: from 24 rows the avx512 fmaf tiles (vdpbf16ps issues on one port
    on this CPU class); fewer rows, or the path forced to avx512bf16, keep vdpbf16ps. Every
    choice gives the reference's bits."""
    from test_torch_linear import dp_calls

    rng = np.random.default_rng(8)
    exact = model(case(rng, 1, 70, 300, 1)[1], "plain", 1, numerics="exact", rounded=False)
    default, forced, reference = (session_for(exact, isa)
                                  for isa in (None, "avx512bf16", "reference"))
    for m, dp_default in ((4, True), (23, True), (24, False), (100, False)):
        x = case(rng, m, 70, 300, 1)[0]
        before = dp_calls()
        got = run_grouped(default, x)
        assert dp_calls() - before == int(dp_default), m
        before = dp_calls()
        also = run_grouped(forced, x)
        assert dp_calls() - before == 1, m
        want = run_grouped(reference, x)
        assert np.array_equal(bits(got), bits(want)) and np.array_equal(bits(also), bits(want))
