"""Numerics, RoPE tables and the fp8 quantiser against the goldens."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import CASES, GOLDENS, golden, run_model

from csa2onnx.custom_ops.reference import fp8_act_quant, pow2_ceil
from csa2onnx.graphs import numerics, quant, rope
from csa2onnx.graphs.numerics import FLOAT
from csa2onnx.graphs.standalone import build_model

UNIT = np.load(GOLDENS / "unit_kernels.npz")


def rope_params(model_args: dict, compressed: bool) -> rope.RopeParams:
    if not compressed:  # ratio-0 layers: rope_theta, no YaRN
        return rope.RopeParams(model_args["rope_head_dim"], model_args["max_seq_len"],
                               model_args["rope_theta"])
    return rope.RopeParams(model_args["rope_head_dim"], model_args["max_seq_len"],
                           model_args["compress_rope_theta"], model_args["original_seq_len"],
                           model_args["rope_factor"], model_args["beta_fast"],
                           model_args["beta_slow"])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("table", ["window", "compress"])
def test_freqs_cis_tables_are_bit_exact(case: str, table: str, golden_report) -> None:
    g = golden(case)
    cos, sin = rope.freqs_cis(rope_params(g.model_args, table == "compress"))
    want = g.arrays[f"freqs_cis.{table}"]
    got = np.stack([cos, sin], axis=-1)
    golden_report.check(case, "rope", f"freqs_cis.{table}", got, want, exact=True)


def test_yarn_changes_the_frequencies() -> None:
    plain = rope.inverse_frequencies(rope.RopeParams(32, 16, 160000.0))
    yarn = rope.inverse_frequencies(rope.RopeParams(32, 16, 160000.0, 65536, 16.0, 32, 1))
    assert plain[0] == yarn[0] and yarn[-1] == pytest.approx(plain[-1] / 16)


def test_bad_rope_params_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="rope_head_dim must be even"):
        rope.RopeParams(31, 16, 10000.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        rope.RopeParams(32, 0, 10000.0)


@pytest.mark.parametrize("tag", ["ties", "edge"])
def test_act_quant_matches_unit_goldens_bit_for_bit(tag: str) -> None:
    x = UNIT[f"fp8.ue8m0_b32.{tag}.input"]
    model = build_model("act_quant", [("x", FLOAT, ["n", 32])], ["y"],
                        lambda op, x: quant.act_quant(op, x))
    y = run_model(model, {"x": x})["y"]
    want = UNIT[f"fp8.ue8m0_b32.{tag}.output"]
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
    ref, scale = fp8_act_quant(x)
    np.testing.assert_array_equal(ref.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(scale, UNIT[f"fp8.ue8m0_b32.{tag}.scale"])


def test_pow2_ceil_is_exact_next_to_powers_of_two() -> None:
    k = np.arange(-126, 127, dtype=np.float64)
    p = np.exp2(k).astype(np.float32)
    t = np.concatenate([p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0))])
    want = pow2_ceil(t)
    model = build_model("pow2_ceil", [("t", FLOAT, ["n"])], ["p"],
                        lambda op, t: quant.pow2_ceil(op, t))
    np.testing.assert_array_equal(run_model(model, {"t": t})["p"], want)
    assert (want[: len(p)] == p).all() and (want[len(p): 2 * len(p) - 1] == 2 * p[:-1]).all()


def test_linear_and_rmsnorm_round_once_to_bf16() -> None:
    rng = np.random.default_rng(0)
    w = numerics.round_bf16_np(rng.standard_normal((8, 16)).astype(np.float32))
    norm_w = numerics.round_bf16_np(rng.random(8).astype(np.float32) + 0.5)
    x = numerics.round_bf16_np(rng.standard_normal((2, 3, 16)).astype(np.float32))

    def body(op, x):
        y = numerics.Linear(w, name="wq_a")(op, x)
        return y, numerics.RMSNorm(norm_w, 1e-6, name="q_norm")(op, y)

    out = run_model(build_model("lin", [("x", FLOAT, ["b", "s", 16])], ["y", "n"], body),
                    {"x": x})
    y = numerics.round_bf16_np(x @ w.T)
    np.testing.assert_array_equal(out["y"], y)
    n = numerics.round_bf16_np(norm_w * (y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6)))
    np.testing.assert_allclose(out["n"], n, rtol=8e-3)


def test_duplicate_parameter_names_are_caught() -> None:
    w = np.ones((4, 4), np.float32)

    def body(op, x):
        return numerics.Linear(w)(op, numerics.Linear(2 * w)(op, x))

    with pytest.raises(ValueError, match="two parameters are named 'weight'"):
        build_model("dup", [("x", FLOAT, [1, 4])], ["y"], body)


def test_bad_weights_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        numerics.Linear(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        numerics.RMSNorm(np.zeros((2, 2), np.float32), 1e-6)


REDUCTIONS = [("Sum", -1, False), ("Max", -1, True), ("Sum", -2, False), ("Sum", 2, False),
              ("Max", 0, True)]
SHAPES_WITH_EMPTY = [(2, 3, 4, 5), (2, 0, 4, 5), (0, 3, 4, 5), (2, 3, 4, 0)]


@pytest.mark.parametrize(("reduction", "axis", "keepdims", "shape"), [
    (*r, shape) for r in REDUCTIONS for shape in SHAPES_WITH_EMPTY
    if shape[r[1]] != 0])  # the reduced axis is never empty (reduce_axis's contract)
def test_reduce_axis_gives_numpy_shapes_on_empty_tensors(reduction: str, axis: int,
                                                          keepdims: bool, shape: tuple) -> None:
    """Also where onnxruntime (1.30, 1.31) returns an empty input unreduced."""
    model = build_model("reduce", [("x", FLOAT, ["a", "b", "c", "d"])], ["y"],
                        lambda op, x: numerics.reduce_axis(op, reduction, x, axis,
                                                           keepdims=keepdims))
    x = np.random.default_rng(0).integers(-8, 8, shape).astype(np.float32)  # exact sums
    want = (np.sum if reduction == "Sum" else np.max)(x, axis=axis, keepdims=keepdims)
    got = run_model(model, {"x": x})["y"]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
