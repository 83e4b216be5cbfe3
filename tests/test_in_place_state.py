"""In-place state: caches are one buffer bound as past input and present output, written
by WriteRows; reads of a cache's old contents are ordered before its write; capacity grows
with the context; a new sequence reuses the caches without zero-filling them."""

from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import ROOT, golden

import csa2onnx.export.layer as layer_module
import csa2onnx.export.stack as stack_module
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.goldens import GoldenCase, compare, load_case
from csa2onnx.export.in_place import check_in_place_order
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.runtime import AttentionRuntime
from csa2onnx.export.stack import build_stack_model, export_stack
from csa2onnx.export.weights import from_golden

CASE = "case1_r2_r1"  # decode steps where layer 1 reads layer 3's keys through the slot


def _plan_and_weights(case: str = CASE):
    g = golden(case)
    config = AttentionConfig.from_model_args(g.model_args)
    n = len(g.meta["layer_roles"])
    return g, plan_stack(config), from_golden(g.arrays, range(n)), n


def _without_ordering_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    real = layer_module.write_rows
    monkeypatch.setattr(layer_module, "write_rows",
                        lambda op, cache, rows, start, after=(): real(op, cache, rows, start))


def test_every_read_of_an_old_cache_is_ordered_before_its_write(monkeypatch) -> None:
    """Layer 1 reads layer 3's index keys through the slot (as they were after the last
    call) before layer 3 writes them: without the edge the export refuses the graph."""
    _, plan, weights, _ = _plan_and_weights()
    for mode in ("prefill", "decode"):
        build_stack_model(plan, weights, mode)  # checked: passes
    _without_ordering_edges(monkeypatch)
    with pytest.raises(ValueError, match=r"past\.L3\.index_k is written in place, but 1 "
                                         r"node\(s\) reading its old contents are not ordered"):
        build_stack_model(plan, weights, "decode")


def _writes_first(path: Path) -> None:
    """Reorder the model's nodes so that every WriteRows runs as early as its inputs allow
    (onnxruntime follows the node order among independent nodes): the order an unlucky
    scheduler could pick."""
    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}

    def reads(node: onnx.NodeProto) -> list[str]:
        names = list(node.input)
        for attr in node.attribute:
            for g in [attr.g] if attr.HasField("g") else list(attr.graphs):
                for inner in g.node:
                    names += reads(inner)
        return names

    first: set[int] = set()
    stack = [i for i, n in enumerate(nodes) if n.op_type == "WriteRows"]
    while stack:
        i = stack.pop()
        if i not in first:
            first.add(i)
            stack += [producer[name] for name in reads(nodes[i]) if name in producer]
    order = sorted(first) + [i for i in range(len(nodes)) if i not in first]
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    onnx.save(model, str(path))


def _outputs_match(case: GoldenCase, folder: Path) -> bool:
    n = len(case.meta["layer_roles"])
    runtime = AttentionRuntime(folder)
    ok = True
    for entry in case.meta["schedule"]:
        xs = {layer: case.step(entry["step"], layer, "x") for layer in range(n)}
        out = (runtime.prefill if entry["start_pos"] == 0 else runtime.decode)(xs).out
        ok &= all(compare(out[layer], case.step(entry["step"], layer, "out")).ok
                  for layer in range(n))
    return ok


# Layer 2 (ratio 2, index source, not an owner) reads the slot while it points to owner 3
# (ratio 4) from an earlier call, on calls where owner 3 completes a group and owner 0
# (ratio 8) does not: its end_pos // 2 rows include the row owner 3 writes later in the
# same call, which it must see as it was (zero) before that write.
ORDER_LAYOUT = {"compress_ratios": [8, 2, 2, 4], "kv_source_layers": [0, 1, 3],
                "index_source_layers": [0, 2, 3], "window_size": 8, "index_topk": 8,
                "max_seq_len": 128}


@pytest.fixture(scope="module")
def order_case(tmp_path_factory: pytest.TempPathFactory) -> GoldenCase:
    pytest.importorskip("torch", reason="the oracle (tools/torch_reference.py) needs torch")
    sys.path.insert(0, str(ROOT / "tools"))
    import make_golden

    folder = tmp_path_factory.mktemp("order_case")
    return load_case(make_golden.make_case(folder, "order", seed=21, prefill_len=19,
                                           decode_steps=10, layout=ORDER_LAYOUT))


def test_the_edges_hold_under_an_adverse_node_order(order_case: GoldenCase, tmp_path: Path,
                                                    monkeypatch) -> None:
    """With every write scheduled as early as its inputs allow, the outputs still match the
    oracle (upstream's order: the read sees the old row); without the ordering edges the
    same schedule lets owner 3's write run before layer 2's read, and they do not."""
    plan = plan_stack(AttentionConfig.from_model_args(order_case.model_args))
    weights = from_golden(order_case.arrays, range(4))
    export_stack(plan, weights, tmp_path / "edges")
    for mode in ("prefill", "decode"):
        _writes_first(tmp_path / "edges" / f"{mode}.onnx")
    assert _outputs_match(order_case, tmp_path / "edges")

    _without_ordering_edges(monkeypatch)
    monkeypatch.setattr(stack_module, "check_in_place_order", lambda graph: None)
    export_stack(plan, weights, tmp_path / "no_edges")
    for mode in ("prefill", "decode"):
        _writes_first(tmp_path / "no_edges" / f"{mode}.onnx")
    assert not _outputs_match(order_case, tmp_path / "no_edges")


def test_check_accepts_graphs_without_in_place_writes() -> None:
    import onnx_ir as ir

    check_in_place_order(ir.Graph([], [], nodes=[]))


def test_a_second_sequence_reads_what_upstream_reads(upstream_module, tmp_path: Path) -> None:
    """Caches are not zeroed by a new prefill. Upstream's are never reset either, and its
    layer 2 (ratio 2) reads end_pos // 2 rows of owner 0's (ratio 8) keys through the slot,
    rows the second, shorter sequence has not written: they still hold the first
    sequence's keys. csa2onnx keeps its caches, so it reads the same rows; a fresh runtime
    (zero caches: what csa2onnx's prefill used to do) does not match."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import make_golden
    from make_goldens import build, init_weights

    # 256 positions: owner 0 then holds 32 rows, all layer 2 reads (upstream fails past it).
    args = make_golden.model_args({**ORDER_LAYOUT, "max_seq_len": 256})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layers = build(upstream_module, upstream_module.ModelArgs(**args))
        init_weights(layers, 5)
        arrays = {f"weights.L{i}.{name}": p.detach().float().numpy()
                  for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
        plan = plan_stack(AttentionConfig.from_model_args(args))
        export_stack(plan, from_golden(arrays, range(4)), tmp_path)
        gen = torch.Generator().manual_seed(6)
        sequences = [(40, 2), (19, 10)]  # (prefill, decode steps); the second is shorter
        steps = [(start, n) for prefill, decodes in sequences
                 for start, n in [(0, prefill)] + [(prefill + i, 1) for i in range(decodes)]]
        xs = [[torch.randn(1, n, args["dim"], generator=gen).bfloat16() for _ in layers]
              for _, n in steps]
        with torch.inference_mode():
            want = [[layer(x[i], start).float().numpy() for i, layer in enumerate(layers)]
                    for (start, _), x in zip(steps, xs, strict=True)]
    finally:
        torch.set_default_dtype(previous)

    def run(runtime: AttentionRuntime, indices: range) -> list[bool]:
        ok = []
        for k in indices:
            feed = {i: xs[k][i].float().numpy() for i in range(4)}
            out = (runtime.prefill if steps[k][0] == 0 else runtime.decode)(feed).out
            ok += [compare(out[i], want[k][i]).ok for i in range(4)]
        return ok

    kept = AttentionRuntime(tmp_path)
    assert all(run(kept, range(len(steps))))
    fresh = AttentionRuntime(tmp_path)  # zero caches for the second sequence
    assert not all(run(fresh, range(1 + sequences[0][1], len(steps))))


def test_capacity_grows_by_doubling_with_identical_outputs(tmp_path: Path,
                                                           monkeypatch) -> None:
    """Caches start small and double (rows copied) as the context grows, never past
    max_seq_len // r; every output is bit-identical to caches allocated at full size."""
    import csa2onnx.export.runtime as runtime_module

    g, plan, weights, n = _plan_and_weights()
    export_stack(plan, weights, tmp_path)
    monkeypatch.setattr(runtime_module, "MIN_CACHE_ROWS", 4)
    growing, full = AttentionRuntime(tmp_path), AttentionRuntime(tmp_path, grow_caches=False)
    max_rows = {t.name: t.rows for t in plan.state_layout().caches}
    seen: dict[str, set[int]] = {name: set() for name in max_rows}
    for entry in g.meta["schedule"]:
        xs = {layer: g.step(entry["step"], layer, "x") for layer in range(n)}
        call = "prefill" if entry["start_pos"] == 0 else "decode"
        a, b = getattr(growing, call)(xs).out, getattr(full, call)(xs).out
        for layer in range(n):
            np.testing.assert_array_equal(a[layer], b[layer])
        end = entry["start_pos"] + entry["seqlen"]
        for name, rows in growing.cache_rows().items():
            spec = growing.caches[name]
            assert spec.rows_for(end) <= rows <= max_rows[name]
            seen[name].add(rows)
    assert full.cache_rows() == max_rows
    assert growing.state_bytes() < full.state_bytes()
    assert any(len(sizes) > 1 for sizes in seen.values())  # the schedule made some grow
    for name, sizes in seen.items():  # each growth at least doubles (or reaches the end)
        ordered = sorted(sizes)
        assert all(b >= 2 * a or b == max_rows[name] for a, b in pairwise(ordered))
    for name in max_rows:  # the rows both hold agree
        rows = growing.cache_rows()[name]
        np.testing.assert_array_equal(growing.state_array(name),
                                      full.state_array(name)[:, :rows])


def test_state_that_does_not_fit_is_a_clear_error(tmp_path: Path) -> None:
    """Caches made whole at max_seq_len rows (grow_caches=False) ask for more memory than
    exists: an error naming the cache and its size, not numpy's MemoryError (2^50 tokens:
    past a 47-bit address space) or ValueError (2^62: past numpy's largest array), whatever
    the overcommit setting."""
    from dataclasses import replace

    from csa2onnx.export.runtime import RuntimeStateError

    g = golden(CASE)
    for max_seq_len in (2**50, 2**62):
        config = replace(AttentionConfig.from_model_args(g.model_args), max_seq_len=max_seq_len)
        plan = plan_stack(config)
        folder = tmp_path / str(max_seq_len)
        export_stack(plan, from_golden(g.arrays, range(plan.layers[-1].layer + 1)), folder)
        runtime = AttentionRuntime(folder, grow_caches=False)
        xs = {p.layer: g.step("prefill", p.layer, "x") for p in plan.layers}
        with pytest.raises(RuntimeStateError, match=r"state L\d+\.\w+: 1 x \d+ rows of \d+ \w+ "
                                                    r"\([\d.]+ GiB\) do not fit in memory; "
                                                    r"caches made whole at max_seq_len rows"):
            runtime.prefill(xs)


def test_skip_to_goes_on_past_zero_state(tmp_path: Path, monkeypatch) -> None:
    """skip_to (bench --zero-context): after a prefill the sequence goes on at a later
    position, the caches grown to hold its rows, those past the prefill zero; a decode step
    then runs there without growing them. It goes forward only, after a prefill, before
    max_seq_len."""
    import csa2onnx.export.runtime as runtime_module
    from csa2onnx.export.runtime import RuntimeStateError

    g, plan, weights, n = _plan_and_weights()
    export_stack(plan, weights, tmp_path)
    monkeypatch.setattr(runtime_module, "MIN_CACHE_ROWS", 4)  # caches that grow here
    runtime = AttentionRuntime(tmp_path)
    xs = {layer: g.step("prefill", layer, "x") for layer in range(n)}
    with pytest.raises(RuntimeStateError, match="skip_to needs a prefill first"):
        runtime.skip_to(10)
    runtime.prefill(xs)
    prefilled = runtime.position
    before = {name: runtime.state_array(name) for name in runtime.caches}
    target = runtime.manifest.max_seq_len - 2
    runtime.skip_to(np.int64(target))  # any integer type
    assert runtime.position == target and type(runtime.position) is int
    for name, rows in runtime.cache_rows().items():
        spec = runtime.caches[name]
        assert rows >= spec.rows_for(target)
        held = runtime.state_array(name)
        old = before[name].shape[1]
        np.testing.assert_array_equal(held[:, :old], before[name])  # the prefill's rows kept
        assert not held[:, max(old, spec.rows_for(prefilled)):].any()  # the rest zero
    step = {layer: g.step("decode0", layer, "x") for layer in range(n)}
    capacity = runtime.cache_rows()
    out = runtime.decode(step).out
    assert runtime.cache_rows() == capacity  # the step after finds its rows: no growth copy
    assert all(np.isfinite(out[layer]).all() for layer in range(n))
    assert runtime.position == target + 1
    for bad, message in [(target, "goes forward only"), (runtime.manifest.max_seq_len,
                                                          "past max_seq_len"),
                         (target + 0.5, "takes an integer position"),
                         (True, "takes an integer position")]:
        with pytest.raises(RuntimeStateError, match=message):
            runtime.skip_to(bad)
