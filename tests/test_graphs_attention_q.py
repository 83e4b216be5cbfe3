"""QueryProjection and WindowKVProjection against qr, q_rope, window_kv_prequant and
window_kv of every case/step/layer (ratio-0 layers: plain RoPE; others: compress theta,
YaRN in case3)."""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import every_step_and_layer, golden

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops.ops import pack_quantized, unpack_quantized
from csa2onnx.graphs.attention_q import QueryProjection, WindowKVProjection
from csa2onnx.graphs.kv_cache import WINDOW_FORMAT
from csa2onnx.graphs.rope import (
    FreqsCis,
    RopeParams,
    freqs_cis,
    layer_rope_params,
    token_positions,
)
from csa2onnx.graphs.standalone import build_model

FLOAT, INT64 = ir.DataType.FLOAT, ir.DataType.INT64
OUTPUTS = ("qr", "q_rope", "window_kv_prequant", "window_kv")


def query_projection(case: str, layer: int, name: str = "attn") -> QueryProjection:
    g, a = golden(case), golden(case).model_args
    w = g.weights(layer)
    return QueryProjection(w["wq_a.weight"], w["q_norm.weight"], w["wq_b.weight"],
                           a["n_heads"], a["head_dim"], a["rope_head_dim"], a["norm_eps"],
                           layer_rope_params(a, a["compress_ratios"][layer]), name=name)


def window_kv_projection(case: str, layer: int, name: str = "window") -> WindowKVProjection:
    g, a = golden(case), golden(case).model_args
    w = g.weights(layer)
    rope = layer_rope_params(a, a["compress_ratios"][layer])
    return WindowKVProjection(w["wkv.weight"], w["kv_norm.weight"], a["head_dim"],
                              a["rope_head_dim"], a["norm_eps"], rope, name=name)


@functools.cache
def _session(case: str, layer: int) -> ort.InferenceSession:
    dim = golden(case).model_args["dim"]

    def body(op, x, start_pos):
        qr, q = query_projection(case, layer)(op, x, start_pos)
        kv = window_kv_projection(case, layer)(op, x, start_pos)
        # the layer's fp8 round trip: the rows packed for the ring, unpacked
        d = golden(case).model_args["head_dim"]
        kv_quant = unpack_quantized(op, pack_quantized(op, kv, WINDOW_FORMAT), WINDOW_FORMAT, d)
        return qr, q, kv, kv_quant

    model = build_model("attention_q", [("x", FLOAT, ["b", "s", dim]),
                                        ("start_pos", INT64, [1])], OUTPUTS, body)
    return make_session(model.SerializeToString())


PARAMS = every_step_and_layer()


@pytest.mark.parametrize(("case", "step", "start_pos", "layer"), PARAMS,
                         ids=[f"{c}-{s}-L{la}" for c, s, _, la in PARAMS])
def test_golden(golden_report, case: str, step: str, start_pos: int, layer: int) -> None:
    g = golden(case)
    feeds = {"x": g.step(step, layer, "x"), "start_pos": np.array([start_pos], np.int64)}
    for name, value in zip(OUTPUTS, _session(case, layer).run(None, feeds), strict=True):
        golden_report.check(case, "attention_q", f"{step}.L{layer}.{name}", value,
                            g.step(step, layer, name))


def test_layer_rope_params() -> None:
    a = golden("case3_r4_r128").model_args
    plain = layer_rope_params(a, a["compress_ratios"][0])
    yarn = layer_rope_params(a, a["compress_ratios"][3])
    assert (plain.base, plain.original_seq_len) == (a["rope_theta"], 0)
    assert (yarn.base, yarn.original_seq_len, yarn.factor) == (
        a["compress_rope_theta"], a["original_seq_len"], a["rope_factor"])


@pytest.mark.parametrize("portable", [False, True], ids=["RopeCosSin", "tables"])
def test_freqs_cis_rows_at_positions(portable: bool) -> None:
    """FreqsCis gives the freqs_cis rows at start_pos.. (a scalar start_pos works too): the
    RopeCosSin op, or in a portable graph a Gather from the tables."""
    params = RopeParams(rope_head_dim=8, max_seq_len=16, base=10000.0)

    def body(op, x, start_pos):
        return FreqsCis(params, name="rope")(op, token_positions(op, x, start_pos))

    model = build_model("rope_at", [("x", FLOAT, [1, "s", 2]), ("start_pos", INT64, [])],
                        ["cos", "sin"], body, portable=portable)
    ops = {node.op_type for node in model.graph.node}
    assert ("RopeCosSin" in ops) != portable and ("Gather" in ops) == portable
    tables = [t.name for t in model.graph.initializer if t.name.endswith((".cos", ".sin"))]
    assert tables == (["rope.cos", "rope.sin"] if portable else [])
    cos, sin = make_session(model.SerializeToString()).run(
        None, {"x": np.zeros((1, 3, 2), np.float32), "start_pos": np.array(5, np.int64)})
    table_cos, table_sin = freqs_cis(params)
    np.testing.assert_array_equal(cos.view(np.uint32), table_cos[5:8].view(np.uint32))
    np.testing.assert_array_equal(sin.view(np.uint32), table_sin[5:8].view(np.uint32))
    angles = np.arange(5, 8, dtype=np.float32)[:, None] * (
        1 / np.float32(10000.0) ** (np.arange(0, 8, 2, dtype=np.float32) / 8))
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-6)


def _weights(dim=16, rank=8, heads=2, hd=64):
    return (np.zeros((rank, dim)), np.ones(rank), np.zeros((heads * hd, rank)), heads, hd)


ROPE = RopeParams(rope_head_dim=16, max_seq_len=32, base=10000.0)


@pytest.mark.parametrize(("change", "message"), [
    (lambda w: (w[0], w[1], np.zeros((7, 8)), *w[3:]), "wq_b"),
    (lambda w: (w[0], np.ones(5), *w[2:]), "q_norm"),
    (lambda w: (np.zeros(8), *w[1:]), "wq_a"),
    (lambda w: (*w[:3], 0, w[4]), "n_heads"),
])
def test_query_projection_bad_input(change, message: str) -> None:
    wq_a, q_norm, wq_b, heads, hd = change(_weights())
    with pytest.raises(ValueError, match=message):
        QueryProjection(wq_a, q_norm, wq_b, heads, hd, 16, 1e-6, ROPE)


def test_rope_mismatch_raises() -> None:
    wq_a, q_norm, wq_b, heads, hd = _weights()
    with pytest.raises(ValueError, match="rope_head_dim"):
        QueryProjection(wq_a, q_norm, wq_b, heads, hd, 8, 1e-6, ROPE)
    with pytest.raises(ValueError, match="rope_head_dim"):
        WindowKVProjection(np.zeros((64, 16)), np.ones(64), 64, 32, 1e-6, ROPE)


@pytest.mark.parametrize(("wkv", "kv_norm", "head_dim", "message"), [
    (np.zeros((32, 16)), np.ones(64), 64, "wkv"),
    (np.zeros((64, 16)), np.ones(32), 64, "kv_norm"),
    (np.zeros((48, 16)), np.ones(48), 48, "fp8 block"),
])
def test_window_kv_projection_bad_input(wkv, kv_norm, head_dim: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowKVProjection(wkv, kv_norm, head_dim, 16, 1e-6, ROPE)
