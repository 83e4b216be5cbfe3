"""RopeCosSin: the freqs_cis rows computed per call are the tables' rows bit for bit (every
position up to 1M at the released dims, against the C-library tables and torch's
precompute_freqs_cis), and a model no longer grows with max_seq_len."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import CASES, ROOT, custom_op_model, golden
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.plan import plan_stack
from csa2onnx.export.stack import build_stack_model
from csa2onnx.export.weights import from_golden
from csa2onnx.graphs.rope import (
    RopeParams,
    freqs_cis,
    inverse_frequencies,
    layer_rope_params,
)

RELEASED = AttentionConfig.load(ROOT / "export" / "configs" / "v41_flash_attention.json")
M = 1 << 20  # the released max_seq_len


def released_params(ratio: int) -> RopeParams:
    return layer_rope_params(RELEASED.to_dict(), ratio)


def op_model(freqs: object = None, max_positions: object = 16, **extra: object) -> bytes:
    attrs = {k: v for k, v in (("inverse_frequencies", freqs),
                               ("max_positions", max_positions)) if v is not None}
    node = helper.make_node("RopeCosSin", ["positions"], ["cos", "sin"], domain="csa2onnx",
                            **attrs, **extra)
    graph = helper.make_graph(
        [node], "rope_cos_sin", [helper.make_tensor_value_info("positions", TensorProto.INT64,
                                                               None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")])
    return custom_op_model(graph)


def cos_sin(p: RopeParams, positions: np.ndarray, threads: int = 0
            ) -> tuple[np.ndarray, np.ndarray]:
    freqs = [float(f) for f in inverse_frequencies(p)]
    session = make_session(op_model(freqs, p.max_seq_len), options=session_options(threads))
    cos, sin = session.run(None, {"positions": positions})
    return cos, sin


def assert_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("ratio", [0, 4], ids=["rope_theta", "compress_yarn"])
def test_every_position_to_1m_equals_the_tables(ratio: int) -> None:
    """All 1,048,576 rows of the released dims' tables (2 x 32M values), both RoPEs."""
    p = released_params(ratio)
    assert p.max_seq_len == M
    cos, sin = cos_sin(p, np.arange(M, dtype=np.int64))
    table_cos, table_sin = freqs_cis(p)
    assert_bits(cos, table_cos)
    assert_bits(sin, table_sin)


@pytest.mark.parametrize("case", CASES)
def test_the_goldens_tables_row_by_row(case: str) -> None:
    """The goldens' freqs_cis arrays (made by upstream torch) from the op, every row."""
    g = golden(case)
    for table, ratio in (("window", 0), ("compress", 4)):
        p = layer_rope_params(g.model_args, ratio)
        cos, sin = cos_sin(p, np.arange(p.max_seq_len, dtype=np.int64))
        assert_bits(np.stack([cos, sin], axis=-1), g.arrays[f"freqs_cis.{table}"])


@pytest.mark.parametrize("ratio", [0, 4], ids=["rope_theta", "compress_yarn"])
def test_equals_upstream_freqs_cis_to_1m(ratio: int, upstream_module) -> None:
    """upstream precompute_freqs_cis (torch.outer + torch.polar) at the released dims."""
    import torch

    p = released_params(ratio)
    want = torch.view_as_real(upstream_module.precompute_freqs_cis(
        p.rope_head_dim, p.max_seq_len, p.original_seq_len, p.base, p.factor, p.beta_fast,
        p.beta_slow)).numpy()
    cos, sin = cos_sin(p, np.arange(M, dtype=np.int64))
    assert_bits(cos, want[..., 0])
    assert_bits(sin, want[..., 1])


def test_any_positions_shape_order_and_thread_count() -> None:
    """[b, s] and scalar positions, out of order and repeated; 1 and 4 threads."""
    p = released_params(4)
    rng = np.random.default_rng(0)
    positions = rng.integers(0, M, size=(3, 40_000), dtype=np.int64)
    positions[0, :5] = [M - 1, 0, M - 1, 7, 0]
    rows = np.unique(positions)
    table_cos, table_sin = cos_sin(p, rows, threads=1)
    where = np.searchsorted(rows, positions)
    for threads in (1, 4):
        cos, sin = cos_sin(p, positions, threads)
        assert_bits(cos, table_cos[where])
        assert_bits(sin, table_sin[where])
    cos, sin = cos_sin(p, np.array(M - 1, np.int64))
    assert cos.shape == (32,)
    assert_bits(cos, table_cos[-1])
    cos, sin = cos_sin(p, np.zeros((2, 0), np.int64))
    assert cos.shape == sin.shape == (2, 0, 32)


@pytest.mark.parametrize("position", [-1, 16, 1 << 40])
def test_positions_past_the_table_are_errors(position: int) -> None:
    session = make_session(op_model([1.0, 0.5], 16))
    with pytest.raises(Exception, match=rf"RopeCosSin: position {position} \(element 1 of "
                                        r"\[2\]\) is outside 0\.\.15 \(max_positions\)"):
        session.run(None, {"positions": np.array([3, position], np.int64)})


@pytest.mark.parametrize(("freqs", "max_positions", "message"), [
    (None, 16, r"attribute inverse_frequencies \(floats\) is required"),
    ([], 16, "inverse_frequencies must hold at least one value"),
    ([1.0, float("nan")], 16, r"inverse_frequencies\[1\] is not finite"),
    ([1.0, float("inf")], 16, r"inverse_frequencies\[1\] is not finite"),
    ([1.0], None, r"attribute max_positions \(an int\) is required"),
    ([1.0], 0, "max_positions must be > 0, got 0"),
])
def test_bad_attributes_are_clear_errors(freqs, max_positions, message: str) -> None:
    if freqs == []:  # helper.make_node cannot spell an empty float list
        model = onnx.load_from_string(op_model([1.0], max_positions))
        del model.graph.node[0].attribute[0].floats[:]
        data = model.SerializeToString()
    else:
        data = op_model(freqs, max_positions)
    with pytest.raises(Exception, match=f"RopeCosSin: {message}"):
        make_session(data)


def test_model_size_does_not_grow_with_max_seq_len() -> None:
    """A stack's initializers are the same at max_seq_len 8K and 1M (no table); a portable
    export keeps the tables (ONNX Cos/Sin are not the C library's), one pair per RoPE."""
    g = golden("case3_r4_r128")
    weights = from_golden(g.arrays, range(len(g.model_args["compress_ratios"])))

    def initializers(max_seq_len: int, portable: bool) -> dict[str, int]:
        plan = plan_stack(AttentionConfig.from_model_args(g.model_args, max_seq_len=max_seq_len))
        model = build_stack_model(plan, weights, "decode", portable=portable)
        return {name: value.const_value.nbytes
                for name, value in model.graph.initializers.items()}

    lean = initializers(8192, False)
    assert lean == initializers(M, False)
    assert not any(name.endswith((".cos", ".sin")) for name in lean)
    portable = initializers(8192, True)
    tables = {n: size for n, size in portable.items() if n.endswith((".cos", ".sin"))}
    assert len(tables) == 4  # cos and sin of rope_theta and of compress_rope_theta + YaRN
    assert set(tables.values()) == {8192 * g.model_args["rope_head_dim"] // 2 * 4}
