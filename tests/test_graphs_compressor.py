"""Compressor and compressed-KV cache writes against the goldens: every kv-source layer of
every case, prefill and every decode step (decode states chained through our own graph)."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import CASES, GOLDENS, golden, run_model

from csa2onnx.custom_ops.constants import packed_row_bytes
from csa2onnx.custom_ops.reference import unpack_quantized
from csa2onnx.export.goldens import compare
from csa2onnx.graphs.compressor import Compressor
from csa2onnx.graphs.kv_cache import (
    COMPRESSED_KV_FORMAT,
    cache_row_start,
    latent_to_cache_rows,
    write_rows,
)
from csa2onnx.graphs.numerics import FLOAT, INT64
from csa2onnx.graphs.rope import freqs_cis, layer_rope_params, rope_at
from csa2onnx.graphs.standalone import build_model

COMPONENT = "compressor"
UINT8 = ir.DataType.UINT8


def _kv_sources() -> list[tuple[str, int]]:
    pairs = []
    for case in CASES:
        args = json.loads((GOLDENS / f"{case}.json").read_text())["model_args"]
        pairs += [(case, layer) for layer in args["kv_source_layers"]]
    return pairs


KV_SOURCES = _kv_sources()
IDS = [f"{case}-L{layer}" for case, layer in KV_SOURCES]


def _compressor(case: str, layer: int) -> Compressor:
    g = golden(case)
    w, args = g.weights(layer), g.model_args
    return Compressor(w["compressor.wkv.weight"], w.get("compressor.wgate.weight"),
                      w["compressor.norm.weight"], ratio=args["compress_ratios"][layer],
                      head_dim=args["head_dim"], norm_eps=args["norm_eps"])


@cache
def _prefill_model(case: str, layer: int) -> onnx.ModelProto:
    args = golden(case).model_args
    stateful = args["compress_ratios"][layer] > 1
    outputs = ["latent", "positions"] + (["kv_state", "score_state"] if stateful else [])
    return build_model(
        "compressor_prefill", [("x", FLOAT, ["b", "s", args["dim"]])], outputs,
        lambda op, x: [v for v in _compressor(case, layer)(op, x, mode="prefill")
                       if v is not None])


@cache
def _decode_model(case: str, layer: int) -> onnx.ModelProto:
    args = golden(case).model_args
    r, hd = args["compress_ratios"][layer], args["head_dim"]
    x = ("x", FLOAT, ["b", 1, args["dim"]])
    start = ("start_pos", INT64, [])
    if r == 1:
        return build_model("compressor_decode", [x, start], ["latent", "positions"],
                           lambda op, x, p: list(_compressor(case, layer)(
                               op, x, start_pos=p, mode="decode"))[:2])
    state = [("kv_state", FLOAT, ["b", r, hd]), ("score_state", FLOAT, ["b", r, hd])]
    return build_model("compressor_decode", [x, *state, start],
                       ["latent", "positions", "kv_state_out", "score_state_out"],
                       lambda op, x, kv, sc, p: list(_compressor(case, layer)(
                           op, x, kv, sc, p, mode="decode")))


@cache
def _chunk_model(case: str, layer: int) -> onnx.ModelProto:
    args = golden(case).model_args
    r, hd = args["compress_ratios"][layer], args["head_dim"]
    x = ("x", FLOAT, ["b", "s", args["dim"]])
    start = ("start_pos", INT64, [1])
    if r == 1:
        return build_model("compressor_chunk", [x, start], ["latent", "positions"],
                           lambda op, x, p: list(_compressor(case, layer)(
                               op, x, start_pos=p, mode="prefill"))[:2])
    state = [("kv_state", FLOAT, ["b", r, hd]), ("score_state", FLOAT, ["b", r, hd])]
    return build_model("compressor_chunk", [x, *state, start],
                       ["latent", "positions", "kv_state_out", "score_state_out"],
                       lambda op, x, kv, sc, p: list(_compressor(case, layer)(
                           op, x, kv, sc, p, mode="prefill")))


def _schedule(case: str) -> list[dict]:
    return golden(case).meta["schedule"]


@pytest.mark.parametrize(("case", "layer"), KV_SOURCES, ids=IDS)
def test_compressor_prefill(case: str, layer: int, golden_report) -> None:
    g = golden(case)
    r = g.model_args["compress_ratios"][layer]
    out = run_model(_prefill_model(case, layer), {"x": g.step("prefill", layer, "x")})
    expected = g.step("prefill", layer, "latent")
    golden_report.check(case, COMPONENT, f"prefill.L{layer}.latent", out["latent"], expected)
    golden_report.check(case, COMPONENT, f"prefill.L{layer}.latent_positions",
                        out["positions"], np.arange(expected.shape[1], dtype=np.int64) * r)
    if r > 1:
        for state in ("kv", "score"):
            golden_report.check(case, COMPONENT, f"prefill.L{layer}.compressor_{state}_state_after",
                                out[f"{state}_state"],
                                g.step("prefill", layer, f"compressor_{state}_state_after"))


@pytest.mark.parametrize(("case", "layer"), KV_SOURCES, ids=IDS)
def test_compressor_decode_chain(case: str, layer: int, golden_report) -> None:
    """Every decode step from the golden prefill state on, state carried by our graph."""
    g = golden(case)
    r, hd = g.model_args["compress_ratios"][layer], g.model_args["head_dim"]
    state = {}
    if r > 1:
        state = {f"{k}_state": g.step("prefill", layer, f"compressor_{k}_state_after")
                 for k in ("kv", "score")}
    for entry in _schedule(case)[1:]:
        step, pos = entry["step"], entry["start_pos"]
        x = g.step(step, layer, "x")
        out = run_model(_decode_model(case, layer),
                        {"x": x, "start_pos": np.array(pos, np.int64), **state})
        if r > 1:
            state = {"kv_state": out["kv_state_out"], "score_state": out["score_state_out"]}
        if g.has(step, layer, "latent"):
            golden_report.check(case, COMPONENT, f"{step}.L{layer}.latent", out["latent"],
                                g.step(step, layer, "latent"))
            golden_report.check(case, COMPONENT, f"{step}.L{layer}.latent_positions",
                                out["positions"], np.array([pos + 1 - r], np.int64))
        else:  # no group completed: an empty latent, not a missing one
            assert (pos + 1) % r != 0, f"{case} {step} L{layer}: golden lacks a latent"
            assert out["latent"].shape == (x.shape[0], 0, hd), f"{case} {step} L{layer}"
            assert out["positions"].shape == (0,), f"{case} {step} L{layer}"


@cache
def _cache_rows_model(case: str) -> onnx.ModelProto:
    args = golden(case).model_args
    cos, sin = freqs_cis(layer_rope_params(args, 1))

    def body(op, latent, positions):
        tables = [op.builder.initializer(ir.tensor(t), name=n)
                  for t, n in ((cos, "freqs_cos"), (sin, "freqs_sin"))]
        c, s = rope_at(op, *tables, positions)
        return list(latent_to_cache_rows(op, latent, c, s, args["rope_head_dim"]))

    return build_model("latent_to_cache_rows",
                       [("latent", FLOAT, ["b", "n", args["head_dim"]]),
                        ("positions", INT64, ["n"])], ["prequant", "packed"], body)


@cache
def _write_model(ratio: int, row_bytes: int) -> onnx.ModelProto:
    def body(op, cache_in, rows, start_pos):
        row_start = cache_row_start(op, start_pos, ratio)
        return write_rows(op, cache_in, rows, row_start), row_start

    return build_model("write_rows", [("cache", UINT8, ["b", "R", row_bytes]),
                                      ("rows", UINT8, ["b", "n", row_bytes]),
                                      ("start_pos", INT64, [])],
                       ["cache_out", "row_start"], body)


@pytest.mark.parametrize(("case", "layer"), KV_SOURCES, ids=IDS)
def test_compressed_kv_cache(case: str, layer: int, golden_report) -> None:
    """RoPE + e4m3 fp4 of the golden latents, packed, written step by step into an empty
    cache (decode steps without a latent write 0 rows) and compared (unpacked) at the end."""
    g = golden(case)
    args = g.model_args
    r, hd = args["compress_ratios"][layer], args["head_dim"]
    b = g.step("prefill", layer, "x").shape[0]
    width = packed_row_bytes(COMPRESSED_KV_FORMAT, hd)
    kv_cache = np.zeros((b, args["max_seq_len"] // r, width), np.uint8)
    for entry in _schedule(case):
        step, pos = entry["step"], entry["start_pos"]
        rows = np.zeros((b, 0, width), np.uint8)
        if g.has(step, layer, "latent"):
            latent = g.step(step, layer, "latent")
            first = 0 if step == "prefill" else pos + 1 - r
            positions = first + r * np.arange(latent.shape[1], dtype=np.int64)
            out = run_model(_cache_rows_model(case), {"latent": latent, "positions": positions})
            quant = unpack_quantized(out["packed"], COMPRESSED_KV_FORMAT, hd)
            golden_report.check(case, "kv_cache", f"{step}.L{layer}.latent_rope_prequant",
                                out["prequant"], g.step(step, layer, "latent_rope_prequant"))
            for name in ("latent_rope_quant", "compress_kv_rows"):
                golden_report.check(case, "kv_cache", f"{step}.L{layer}.{name}", quant,
                                    g.step(step, layer, name))
            rows = out["packed"]
        written = run_model(_write_model(r, width), {"cache": kv_cache, "rows": rows,
                                                     "start_pos": np.array(pos, np.int64)})
        kv_cache = written["cache_out"]
        assert kv_cache.shape == (b, args["max_seq_len"] // r, width)
        if g.has(step, layer, "compress_kv_row_start"):
            golden_report.check(case, "kv_cache", f"{step}.L{layer}.compress_kv_row_start",
                                written["row_start"],
                                g.step(step, layer, "compress_kv_row_start").reshape(1))
        if g.has(step, layer, "compress_kv_cache_after"):
            end_pos = pos + entry["seqlen"]
            golden_report.check(case, "kv_cache", f"{step}.L{layer}.compress_kv_cache_after",
                                unpack_quantized(kv_cache[:, :end_pos // r],
                                                 COMPRESSED_KV_FORMAT, hd),
                                g.step(step, layer, "compress_kv_cache_after"))
    assert any(g.has(e["step"], layer, "compress_kv_cache_after") for e in _schedule(case))


# ---- synthetic edges: no golden, but the shapes and the state must still be right ----

def _tiny_compressor(ratio: int, dim: int = 8, hd: int = 4) -> Compressor:
    rng = np.random.default_rng(0)
    wkv = rng.standard_normal((hd, dim)).astype(np.float32)
    wgate = None if ratio == 1 else rng.standard_normal((hd, dim)).astype(np.float32)
    return Compressor(wkv, wgate, np.ones(hd, np.float32), ratio=ratio, head_dim=hd,
                      norm_eps=1e-6)


@pytest.mark.parametrize("seqlen", [0, 3, 4, 5])
def test_compressor_prefill_short(seqlen: int) -> None:
    """s < r gives zero latents and parks every token in the state; s = 0 is empty."""
    ratio, dim, hd = 4, 8, 4
    model = build_model("c", [("x", FLOAT, ["b", "s", dim])],
                        ["latent", "positions", "kv", "score"],
                        lambda op, x: list(_tiny_compressor(ratio)(op, x, mode="prefill")))
    x = np.random.default_rng(1).standard_normal((2, seqlen, dim)).astype(np.float32)
    out = run_model(model, {"x": x})
    n, rem = seqlen // ratio, seqlen % ratio
    assert out["latent"].shape == (2, n, hd)
    assert out["positions"].tolist() == [ratio * j for j in range(n)]
    assert out["kv"].shape == out["score"].shape == (2, ratio, hd)
    assert np.all(out["kv"][:, rem:] == 0) and np.all(np.isneginf(out["score"][:, rem:]))
    assert np.all(np.isfinite(out["score"][:, :rem]))


def test_compressor_rejects_bad_config() -> None:
    w = np.zeros((4, 8), np.float32)
    norm = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="ratio"):
        Compressor(w, w, norm, ratio=0, head_dim=4, norm_eps=1e-6)
    with pytest.raises(ValueError, match="ratio"):
        Compressor(w, w, norm, ratio=-2, head_dim=4, norm_eps=1e-6)
    with pytest.raises(ValueError, match="wgate"):
        Compressor(w, None, norm, ratio=2, head_dim=4, norm_eps=1e-6)
    with pytest.raises(ValueError, match="wgate"):
        Compressor(w, w, norm, ratio=1, head_dim=4, norm_eps=1e-6)
    with pytest.raises(ValueError, match="wkv"):
        Compressor(w, w, norm, ratio=2, head_dim=5, norm_eps=1e-6)
    with pytest.raises(ValueError, match="norm"):
        Compressor(w, w, np.ones(3, np.float32), ratio=2, head_dim=4, norm_eps=1e-6)


def test_write_rows_empty_and_middle() -> None:
    model = build_model("w", [("cache", FLOAT, ["b", "R", 2]), ("rows", FLOAT, ["b", "n", 2]),
                              ("start", INT64, [])], ["out"],
                        lambda op, c, r, s: write_rows(op, c, r, s))
    base = np.arange(12, dtype=np.float32).reshape(1, 6, 2)
    same = run_model(model, {"cache": base, "rows": np.zeros((1, 0, 2), np.float32),
                             "start": np.array(3, np.int64)})["out"]
    assert np.array_equal(same, base)
    new = -np.ones((1, 2, 2), np.float32)
    out = run_model(model, {"cache": base, "rows": new, "start": np.array(2, np.int64)})["out"]
    expected = base.copy()
    expected[:, 2:4] = -1
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize(("case", "layer"), KV_SOURCES, ids=IDS)
def test_compressor_chunked_prefill(case: str, layer: int, chunk: int) -> None:
    """A prefill in chunks, the open group carried in the state: the golden one-shot
    prefill's latent positions exactly, and its latents and leftover state under the
    cross-CPU rule: torch's F.linear (TorchLinear) sums a row in an order that depends on
    the number of rows, so a few elements move by a bf16 step."""
    g = golden(case)
    r, hd = g.model_args["compress_ratios"][layer], g.model_args["head_dim"]
    x = g.step("prefill", layer, "x")
    b = x.shape[0]
    state = {"kv_state": np.full((b, r, hd), 7.0, np.float32),  # ignored at start_pos 0
             "score_state": np.full((b, r, hd), 3.0, np.float32)} if r > 1 else {}
    latents, positions = [], []
    for start in range(0, x.shape[1], chunk):
        out = run_model(_chunk_model(case, layer), {
            "x": x[:, start:start + chunk], "start_pos": np.array([start], np.int64), **state})
        latents.append(out["latent"])
        positions.append(out["positions"])
        if r > 1:
            state = {"kv_state": out["kv_state_out"], "score_state": out["score_state_out"]}
    want_latent = g.step("prefill", layer, "latent")
    np.testing.assert_array_equal(np.concatenate(positions),
                                  np.arange(want_latent.shape[1], dtype=np.int64) * r)
    got = {"latent": np.concatenate(latents, axis=1)}
    if r > 1:
        got.update({f"compressor_{k}_state_after": state[f"{k}_state"] for k in ("kv", "score")})
    for name, value in got.items():
        result = compare(value, g.step("prefill", layer, name), name=name, rule="cross_cpu")
        assert result.ok and result.moved <= result.size / 8, (name, result)
