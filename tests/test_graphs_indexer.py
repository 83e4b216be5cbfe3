"""Indexer against the goldens: every index-source layer of every case, prefill and every
decode step, reading the shared index_k slot as the reference does (FORMAT.md, reference
behaviour 1): the slot holds the key cache LAST published by any owner."""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import CASES, GOLDENS, golden, run_model

from csa2onnx.custom_ops.reference import unpack_quantized
from csa2onnx.export.goldens import GoldenCase, load_case
from csa2onnx.graphs.indexer import CandidateConfig, Indexer
from csa2onnx.graphs.kv_cache import INDEX_KEY_FORMAT
from csa2onnx.graphs.numerics import FLOAT, INT64
from csa2onnx.graphs.rope import layer_rope_params
from csa2onnx.graphs.standalone import build_model

COMPONENT = "indexer"
SELECT_OUTPUTS = ["topk_idxs", "score", "candidates", "candidate_positions", "q_rope_prequant",
                  "q_rope", "raw_indices"]


def _meta(case: str) -> dict:
    return json.loads((GOLDENS / f"{case}.json").read_text())


def _index_sources(owners_only: bool = False) -> list[tuple[str, int]]:
    pairs = []
    for case in CASES:
        for role in _meta(case)["layer_roles"]:
            if role["is_index_source"] and (role["indexer_owns_k"] or not owners_only):
                pairs.append((case, role["layer"]))
    return pairs


INDEX_SOURCES = _index_sources()
OWNERS = _index_sources(owners_only=True)
# every index source reading candidates a value a position (as the goldens record them); the
# candidate users again reading them a value a block (as a stack hands them on)
SELECTIONS = [(case, layer, False) for case, layer in INDEX_SOURCES] + [
    (case, role["layer"], True) for case in CASES for role in _meta(case)["layer_roles"]
    if role.get("uses_candidates")]


def _ids(pairs: list[tuple[str, int]]) -> list[str]:
    return [f"{case}-L{layer}" for case, layer in pairs]


def _indexer(g: GoldenCase, layer: int, candidate_block: int = 1) -> Indexer:
    args, w = g.model_args, g.weights(layer)
    role = g.meta["layer_roles"][layer]
    candidates = None
    if role["is_candidate_source"]:
        candidates = CandidateConfig(args["candidate_topk_blocks"], args["candidate_block_size"])
    owner = role["indexer_owns_k"]
    return Indexer(
        w["indexer.wq_b.weight"], w["indexer.weights_proj.weight"],
        w["indexer.wk.weight"] if owner else None, w["indexer.k_norm.weight"] if owner else None,
        index_n_heads=args["index_n_heads"], index_head_dim=args["index_head_dim"],
        index_topk=args["index_topk"], ratio=args["compress_ratios"][layer],
        rope=layer_rope_params(args, 1), norm_eps=args["norm_eps"],
        window_size=args["window_size"], candidates=candidates,
        uses_candidates=role["uses_candidates"], candidate_block_size=candidate_block)


@cache
def _select_model(case: str, layer: int, mode: str, portable: bool = False,
                  candidate_block: int = 1) -> onnx.ModelProto:
    """A candidate user reads candidates a value a position (candidate_block 1, as the goldens
    record them) or a value a block (the source's block size: what a stack hands it)."""
    g = golden(case)
    args = g.model_args
    role = g.meta["layer_roles"][layer]
    s = "s" if mode == "prefill" else 1
    inputs = [("x", FLOAT, ["b", s, args["dim"]]), ("qr", FLOAT, ["b", s, args["q_lora_rank"]]),
              ("index_k", FLOAT, ["b", "R", args["index_head_dim"]])]
    if mode == "decode":
        inputs.append(("start_pos", INT64, []))
    if role["uses_candidates"]:
        inputs.append(("candidates", ir.DataType.BOOL, ["b", s, "T"]))
    outputs = [n for n in SELECT_OUTPUTS
               if n not in ("candidates", "candidate_positions") or role["is_candidate_source"]]

    def body(op, x, qr, index_k, *rest):
        rest = list(rest)
        start_pos = rest.pop(0) if mode == "decode" else None
        candidates = rest.pop(0) if role["uses_candidates"] else None
        out = _indexer(g, layer, candidate_block).select(op, x, qr, index_k, start_pos=start_pos,
                                                         candidates=candidates, mode=mode)
        return [getattr(out, n) for n in outputs]

    return build_model(f"indexer_{mode}", inputs, outputs, body, portable=portable)


@cache
def _keys_model(case: str, layer: int) -> onnx.ModelProto:
    g = golden(case)
    return build_model("indexer_keys", [("latent", FLOAT, ["b", "n", g.model_args["head_dim"]]),
                                        ("positions", INT64, ["n"])], ["prequant", "rows"],
                       lambda op, lat, pos: list(_indexer(g, layer).keys(op, lat, pos)))


def _latent_positions(g: GoldenCase, step: str, layer: int, start_pos: int) -> np.ndarray:
    r = g.model_args["compress_ratios"][layer]
    n = g.step(step, layer, "latent").shape[1]
    first = 0 if step == "prefill" else start_pos + 1 - r
    return first + r * np.arange(n, dtype=np.int64)


@cache
def _slot_reads(case: str) -> dict[tuple[str, int], np.ndarray]:
    """The key cache each index source reads at each step. Layers run in stack order; an
    owner writes its golden index_k_rows and takes the slot only on a step where its
    compressor produced a latent; everyone reads whatever the slot holds then."""
    g = golden(case)
    args, roles = g.model_args, g.meta["layer_roles"]
    b = g.step("prefill", 0, "x").shape[0]
    caches = {role["layer"]: np.zeros((b, args["max_seq_len"] // role["compress_ratio"],
                                       args["index_head_dim"]), np.float32)
              for role in roles if role["is_index_source"] and role["indexer_owns_k"]}
    slot: int | None = None
    reads = {}
    for entry in g.meta["schedule"]:
        step = entry["step"]
        for role in roles:
            layer = role["layer"]
            if not role["is_index_source"]:
                continue
            if layer in caches and g.has(step, layer, "index_k_rows"):
                rows = g.step(step, layer, "index_k_rows")
                start = entry["start_pos"] // role["compress_ratio"]
                caches[layer][:, start:start + rows.shape[1]] = rows
                slot = layer
            assert slot is not None, f"{case} {step} L{layer} reads an unpublished slot"
            reads[(step, layer)] = caches[slot].copy()
    return reads


def _feeds(g: GoldenCase, entry: dict, layer: int, index_k: np.ndarray,
           candidate_block: int = 1) -> dict[str, np.ndarray]:
    step = entry["step"]
    feeds = {"x": g.step(step, layer, "x"), "qr": g.step(step, layer, "qr"), "index_k": index_k}
    if entry["start_pos"] > 0:
        feeds["start_pos"] = np.array(entry["start_pos"], np.int64)
    if g.meta["layer_roles"][layer]["uses_candidates"]:
        source = g.model_args["candidate_source_layer"]
        # a position takes its block's value: each block's first position holds it
        feeds["candidates"] = g.step(step, source, "candidates")[..., ::candidate_block]
    return feeds


def _mode(entry: dict) -> str:
    return "prefill" if entry["start_pos"] == 0 else "decode"


@pytest.mark.parametrize(("case", "layer", "by_block"), SELECTIONS,
                         ids=[f"{c}-L{la}" + ("-blocks" if b else "") for c, la, b in SELECTIONS])
def test_indexer_select(case: str, layer: int, by_block: bool, golden_report) -> None:
    g = golden(case)
    reads = _slot_reads(case)
    source = g.meta["layer_roles"][layer]["is_candidate_source"]
    block = g.model_args["candidate_block_size"] if by_block else 1
    for entry in g.meta["schedule"]:
        step = entry["step"]
        out = run_model(_select_model(case, layer, _mode(entry), candidate_block=block),
                        _feeds(g, entry, layer, reads[(step, layer)], block))
        name = f"{step}.L{layer}" + (".by_block" if by_block else "")
        golden_report.check(case, COMPONENT, f"{name}.index_q_rope_prequant",
                            out["q_rope_prequant"], g.step(step, layer, "index_q_rope_prequant"))
        golden_report.check(case, COMPONENT, f"{name}.index_q_rope_quant", out["q_rope"],
                            g.step(step, layer, "index_q_rope_quant"))
        golden_report.check(case, COMPONENT, f"{name}.index_score", out["score"],
                            g.step(step, layer, "index_score"))
        # Exact everywhere, the tie-ambiguous rows included (index_topk_ambiguous).
        golden_report.check(case, COMPONENT, f"{name}.index_topk_idxs", out["topk_idxs"],
                            g.step(step, layer, "index_topk_idxs"))
        golden_report.check(case, COMPONENT, f"{name}.index_topk_indices_raw(set)",
                            np.sort(out["raw_indices"], axis=-1),
                            np.sort(g.step(step, layer, "index_topk_indices_raw"), axis=-1))
        if source:
            cbs = g.model_args["candidate_block_size"]
            golden_report.check(case, COMPONENT, f"{name}.candidates",
                                out["candidate_positions"], g.step(step, layer, "candidates"))
            golden_report.check(case, COMPONENT, f"{name}.candidates(blocks)", out["candidates"],
                                g.step(step, layer, "candidates")[..., ::cbs])


@pytest.mark.parametrize(("case", "layer"), OWNERS, ids=_ids(OWNERS))
def test_indexer_keys(case: str, layer: int, golden_report) -> None:
    g = golden(case)
    published = 0
    for entry in g.meta["schedule"]:
        step = entry["step"]
        if not g.has(step, layer, "latent"):
            assert not g.has(step, layer, "index_k_rows"), f"{case} {step} L{layer}"
            continue
        out = run_model(_keys_model(case, layer), {
            "latent": g.step(step, layer, "latent"),
            "positions": _latent_positions(g, step, layer, entry["start_pos"])})
        rows = unpack_quantized(out["rows"], INDEX_KEY_FORMAT, g.model_args["index_head_dim"])
        golden_report.check(case, COMPONENT, f"{step}.L{layer}.index_k_rope_prequant",
                            out["prequant"], g.step(step, layer, "index_k_rope_prequant"))
        for name in ("index_k_rope_quant", "index_k_rows"):  # the packed rows, unpacked
            golden_report.check(case, COMPONENT, f"{step}.L{layer}.{name}", rows,
                                g.step(step, layer, name))
        published += 1
    assert published >= 2  # prefill and at least one decode step


@pytest.mark.parametrize("by_block", [False, True], ids=["positions", "blocks"])
def test_portable_topk_tie_rule_differs(by_block: bool) -> None:
    """Negative control: ONNX TopK's lowest-index ties (a portable model run without the
    library: TorchTopK's function body) must change the candidate user's selection somewhere
    in case2, and match the lowest_index overlay; the candidates read a value a position or
    a value a block (the portable graph expands the blocks with a Gather)."""
    case, layer = "case2_candidates", 3
    g = golden(case)
    low = load_case(GOLDENS / "case2_candidates_lowidx.json")
    assert low.meta["topk_tiebreak"] == "lowest_index"
    reads = _slot_reads(case)  # keys do not depend on tie order
    block = g.model_args["candidate_block_size"] if by_block else 1
    differs = 0
    for entry in g.meta["schedule"]:
        step = entry["step"]
        out = run_model(_select_model(case, layer, _mode(entry), portable=True,
                                      candidate_block=block),
                        _feeds(low, entry, layer, reads[(step, layer)], block), library=False)
        expected = low.step(step, layer, "index_topk_idxs")
        assert np.array_equal(out["topk_idxs"], expected), f"{step}: lowidx overlay mismatch"
        differs += int((out["topk_idxs"] != g.step(step, layer, "index_topk_idxs")).any())
    assert differs > 0, "the tie rule never mattered: the control proves nothing"


# ---- synthetic edges ----

def test_indexer_nothing_compressed_yet() -> None:
    """A prefill shorter than the ratio selects nothing: an empty [b, s, 0]; so does the
    candidate source's mask."""
    for case, layer, s in (("case3_r4_r128", 1, 5), ("case2_candidates", 1, 1)):
        g = golden(case)
        x = g.step("prefill", layer, "x")[:, :s]
        qr = g.step("prefill", layer, "qr")[:, :s]
        index_k = np.zeros((1, 4, g.model_args["index_head_dim"]), np.float32)
        out = run_model(_select_model(case, layer, "prefill"),
                        {"x": x, "qr": qr, "index_k": index_k})
        assert out["topk_idxs"].shape == (1, s, 0), case
        assert out["score"].shape == (1, s, 0), case
        if "candidates" in out:
            assert out["candidates"].shape == (1, s, 0), case
            assert out["candidate_positions"].shape == (1, s, 0), case


def test_indexer_rejects_bad_config() -> None:
    g = golden("case1_r2_r1")
    args, w = g.model_args, g.weights(1)
    ok = dict(index_n_heads=4, index_head_dim=64, index_topk=16, ratio=2,
              rope=layer_rope_params(args, 1), norm_eps=1e-20, window_size=32)
    wq_b, proj = w["indexer.wq_b.weight"], w["indexer.weights_proj.weight"]
    wk, k_norm = w["indexer.wk.weight"], w["indexer.k_norm.weight"]
    for bad, match in (({"index_topk": 0}, "index_topk"), ({"index_topk": -3}, "index_topk"),
                       ({"ratio": 0}, "ratio"), ({"index_n_heads": 8}, "wq_b"),
                       ({"window_size": 0}, "window_size")):
        with pytest.raises(ValueError, match=match):
            Indexer(wq_b, proj, wk, k_norm, **{**ok, **bad})
    with pytest.raises(ValueError, match="wk and k_norm"):
        Indexer(wq_b, proj, wk, None, **ok)
    with pytest.raises(ValueError, match="weights_proj"):
        Indexer(wq_b, proj[:3], **ok)
    with pytest.raises(ValueError, match="candidate"):
        Indexer(wq_b, proj, candidates=CandidateConfig(2, 4), uses_candidates=True, **ok)
    with pytest.raises(ValueError, match="candidate"):
        CandidateConfig(0, 4)
    with pytest.raises(ValueError, match="owner"):
        build_model("k", [("l", FLOAT, [1, 1, 128]), ("p", INT64, [1])], ["k"],
                    lambda op, lat, p: Indexer(wq_b, proj, **ok).keys(op, lat, p).rows)
    with pytest.raises(ValueError, match="candidates"):
        build_model("s", [("x", FLOAT, [1, 1, 256]), ("qr", FLOAT, [1, 1, 128]),
                          ("k", FLOAT, [1, 4, 64])], ["i"],
                    lambda op, x, qr, k: Indexer(wq_b, proj, uses_candidates=True, **ok)
                    .select(op, x, qr, k).topk_idxs)


