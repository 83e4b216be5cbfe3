"""OutputProjection (inverse RoPE + grouped wo_a + wo_b) against `out` of every
case/step/layer given the golden attn_o, and one layer of case1 run end to end through
QueryProjection, WindowKVProjection, the window, sparse_attn and OutputProjection."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import every_step_and_layer, golden
from test_graphs_attention_q import query_projection, window_kv_projection

from csa2onnx.custom_ops import make_session
from csa2onnx.custom_ops.ops import pack_quantized, unpack_quantized
from csa2onnx.custom_ops.weight_layout import packed_later
from csa2onnx.graphs.kv_cache import WINDOW_FORMAT
from csa2onnx.graphs.numerics import INT64 as INT64_T
from csa2onnx.graphs.output import OutputProjection
from csa2onnx.graphs.rope import RopeParams, layer_rope_params
from csa2onnx.graphs.sparse_attn import sparse_attn
from csa2onnx.graphs.standalone import build_model
from csa2onnx.graphs.window import window_decode, window_prefill

FLOAT, INT32, INT64 = ir.DataType.FLOAT, ir.DataType.INT32, ir.DataType.INT64


def output_projection(case: str, layer: int) -> OutputProjection:
    g, a = golden(case), golden(case).model_args
    w = g.weights(layer)
    return OutputProjection(w["wo_a.weight"], w["wo_b.weight"], a["n_heads"], a["head_dim"],
                            a["o_groups"], a["o_lora_rank"], a["rope_head_dim"],
                            layer_rope_params(a, a["compress_ratios"][layer]), name="output")


@functools.cache
def _session(case: str, layer: int) -> ort.InferenceSession:
    a = golden(case).model_args
    model = build_model(
        "output", [("o", FLOAT, ["b", "s", a["n_heads"], a["head_dim"]]),
                   ("start_pos", INT64, [1])],
        ["out"], lambda op, o, start_pos: output_projection(case, layer)(op, o, start_pos))
    return make_session(model.SerializeToString())


PARAMS = every_step_and_layer()


@pytest.mark.parametrize(("case", "step", "start_pos", "layer"), PARAMS,
                         ids=[f"{c}-{s}-L{la}" for c, s, _, la in PARAMS])
def test_golden_out(golden_report, case: str, step: str, start_pos: int, layer: int) -> None:
    g = golden(case)
    feeds = {"o": g.step(step, layer, "attn_o"), "start_pos": np.array([start_pos], np.int64)}
    (out,) = _session(case, layer).run(None, feeds)
    golden_report.check(case, "output", f"{step}.L{layer}.out", out, g.step(step, layer, "out"))


ROPE = RopeParams(rope_head_dim=16, max_seq_len=32, base=10000.0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"wo_a": np.zeros((2 * 8, 32))}, "wo_a"),
    ({"wo_b": np.zeros((16, 15))}, "wo_b"),
    ({"o_groups": 3}, "divisible"),
    ({"o_lora_rank": 0}, "> 0"),
    ({"rope_head_dim": 8}, "rope_head_dim"),
])
def test_bad_input_raises(kwargs: dict, message: str) -> None:
    args = {"wo_a": np.zeros((2 * 8, 64)), "wo_b": np.zeros((16, 16)), "n_heads": 2,
            "head_dim": 64, "o_groups": 2, "o_lora_rank": 8, "rope_head_dim": 16,
            "rope": ROPE} | kwargs
    with pytest.raises(ValueError, match=message):
        OutputProjection(**args)


@pytest.mark.parametrize("case", ["case1_r2_r1", "case3_r4_r128"])
def test_one_grouped_wo_a_gives_the_per_group_graphs_bits(case: str) -> None:
    """wo_a as ONE grouped TorchLinear (packed as the exporter stores it, or plain) gives the
    bits of the graph it replaced, OutputProjection given wo_a's groups: o's groups split
    off, a TorchLinear per group, Concat and a Cast pair. In a portable graph (no library)
    the plain grouped weight is spelled per group, the same bits as the groups' own
    initializers (a portable export's)."""
    g, a = golden(case), golden(case).model_args
    layer, groups = 0, a["o_groups"]
    w = g.weights(layer)
    wo_a = np.asarray(w["wo_a.weight"]).astype(ml_dtypes.bfloat16)
    forms = {"packed": packed_later(wo_a, groups), "plain": wo_a,
             "per_group": tuple(np.split(wo_a, groups))}
    inputs = [("o", FLOAT, ["b", "s", a["n_heads"], a["head_dim"]]), ("start_pos", INT64, [1])]

    def model(form: str, portable: bool) -> bytes:
        projection = OutputProjection(
            forms[form], w["wo_b.weight"], a["n_heads"], a["head_dim"], groups,
            a["o_lora_rank"], a["rope_head_dim"],
            layer_rope_params(a, a["compress_ratios"][layer]), name="output")
        return build_model("output", inputs, ["out"], projection,
                           portable=portable).SerializeToString()

    sessions = {form: make_session(model(form, False)) for form in forms}
    portable = {form: ort.InferenceSession(model(form, True))
                for form in ("plain", "per_group")}
    steps = [(s, p) for _, s, p, la in every_step_and_layer((case,)) if la == layer]
    assert len(steps) > 1  # the prefill and decode steps
    for step, start_pos in steps:
        feeds = {"o": g.step(step, layer, "attn_o"), "start_pos": np.array([start_pos], np.int64)}
        out = {form: s.run(None, feeds)[0].view(np.uint32) for form, s in sessions.items()}
        np.testing.assert_array_equal(out["packed"], out["per_group"], err_msg=step)
        np.testing.assert_array_equal(out["plain"], out["per_group"], err_msg=step)
        plain, per_group = (portable[f].run(None, feeds)[0].view(np.uint32)
                            for f in ("plain", "per_group"))
        np.testing.assert_array_equal(plain, per_group, err_msg=f"{step} portable")


# --- the components composed: one layer of case1, prefill then every decode step ---------

COMPOSE_CASE, COMPOSE_LAYER = "case1_r2_r1", 1


def _attention(op, x, start_pos, window_kv_rows, window_idx, compressed_kv, compressed_idx):
    """Steps 1, 3-5 of Attention.forward around a window (rows, idx), with the compressed
    rows and (already offset) indices taken from the golden."""
    g, a = golden(COMPOSE_CASE), golden(COMPOSE_CASE).model_args
    _, q = query_projection(COMPOSE_CASE, COMPOSE_LAYER)(op, x, start_pos)
    kv = op.Concat(window_kv_rows, compressed_kv, axis=1)
    idx = op.Concat(window_idx, op.Cast(compressed_idx, to=INT64_T), axis=-1)
    sink = op.builder.initializer(ir.tensor(g.weights(COMPOSE_LAYER)["attn_sink"]),
                                  name="attn_sink")
    o = sparse_attn(op, q, kv, sink, idx, a["head_dim"] ** -0.5)
    return output_projection(COMPOSE_CASE, COMPOSE_LAYER)(op, o, start_pos)


@functools.cache
def _composed(decode: bool) -> ort.InferenceSession:
    a = golden(COMPOSE_CASE).model_args
    win, hd = a["window_size"], a["head_dim"]
    inputs = [("x", FLOAT, ["b", "s", a["dim"]]), ("start_pos", INT64, [1]),
              ("compressed_kv", FLOAT, ["b", "n", hd]), ("compressed_idx", INT32, ["b", "s", "k"])]

    def window_kv(op, x, start_pos):  # the fp8 round trip, as the layer does it
        kv = window_kv_projection(COMPOSE_CASE, COMPOSE_LAYER)(op, x, start_pos)
        return unpack_quantized(op, pack_quantized(op, kv, WINDOW_FORMAT), WINDOW_FORMAT, hd)

    def prefill(op, x, start_pos, ckv, cidx):
        kv = window_kv(op, x, start_pos)
        idx, ring = window_prefill(op, kv, win)
        return _attention(op, x, start_pos, kv, idx, ckv, cidx), ring

    def step(op, x, start_pos, ckv, cidx, ring):
        kv = window_kv(op, x, start_pos)
        idx, ring = window_decode(op, kv, ring, start_pos, win)
        return _attention(op, x, start_pos, ring, idx, ckv, cidx), ring

    if decode:
        model = build_model("attention_decode", [*inputs, ("ring", FLOAT, ["b", win, hd])],
                            ["out", "ring_out"], step)
    else:
        model = build_model("attention_prefill", inputs, ["out", "ring_out"], prefill)
    return make_session(model.SerializeToString())


def test_components_compose(golden_report) -> None:
    g = golden(COMPOSE_CASE)
    win = g.model_args["window_size"]
    ring = None
    for st in g.meta["schedule"]:
        step, start_pos = st["step"], st["start_pos"]
        s = st["seqlen"]
        window_rows = s if ring is None else win  # prefill: all s rows; decode: the ring
        feeds = {"x": g.step(step, COMPOSE_LAYER, "x"),
                 "start_pos": np.array([start_pos], np.int64),
                 "compressed_kv": g.step(step, COMPOSE_LAYER, "attn_kv")[:, window_rows:],
                 "compressed_idx": g.step(step, COMPOSE_LAYER, "attn_topk_idxs")[
                     ..., min(window_rows, win):]}
        if ring is not None:
            feeds["ring"] = ring
        out, ring = _composed(ring is not None).run(None, feeds)
        golden_report.check(COMPOSE_CASE, "attention_composed",
                            f"{step}.L{COMPOSE_LAYER}.out", out,
                            g.step(step, COMPOSE_LAYER, "out"))
