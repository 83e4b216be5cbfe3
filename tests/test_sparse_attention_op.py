"""SparseAttention (csa2onnx C++ op) against the bit-exact torch oracle
(tools/torch_reference.py `sparse_attn`), the goldens' attn_o, its portable standard-op body,
and its errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import custom_op_model, load_module
from onnx import TensorProto, helper

from csa2onnx.custom_ops import make_session

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "goldens"


def sa_model(scale: float, idx_type: int = TensorProto.INT64, functions: bool = False) -> bytes:
    node = helper.make_node("SparseAttention", ["Q", "KV", "S", "I"], ["O"], domain="csa2onnx",
                            softmax_scale=float(scale))
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [node], "sa", [vi("Q", TensorProto.FLOAT, ["b", "s", "h", "d"]),
                       vi("KV", TensorProto.FLOAT, ["b", "n", "d"]),
                       vi("S", TensorProto.FLOAT, ["h"]), vi("I", idx_type, ["b", "s", "k"])],
        [vi("O", TensorProto.FLOAT, ["b", "s", "h", "d"])])
    return custom_op_model(graph, portable=functions)


@functools.cache
def _session(scale: float, idx_type: int = TensorProto.INT64) -> ort.InferenceSession:
    return make_session(sa_model(scale, idx_type))


def run(q, kv, sink, idx, scale):
    it = TensorProto.INT32 if idx.dtype == np.int32 else TensorProto.INT64
    return _session(float(scale), it).run(None, {"Q": q, "KV": kv, "S": sink, "I": idx})[0]


@functools.cache
def _oracle_module():
    pytest.importorskip("torch", reason="the oracle is torch")
    return load_module(ROOT / "tools" / "torch_reference.py", "torch_reference")


def oracle(q, kv, sink, idx, scale) -> np.ndarray:
    ref = _oracle_module()  # skips the test where torch is missing
    import torch

    o = ref.sparse_attn(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(sink),
                        torch.from_numpy(idx.astype(np.int64)), scale)
    return o.float().numpy()


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _inputs(seed, b, s, h, d, n, k, minus_one=0.2):
    rng = np.random.default_rng(seed)
    q = _bf16(rng.standard_normal((b, s, h, d)) * 2)
    kv = _bf16(rng.standard_normal((b, n, d)))
    sink = rng.standard_normal(h).astype(np.float32)
    idx = rng.integers(0, n, (b, s, k))
    idx[rng.random((b, s, k)) < minus_one] = -1
    return q, kv, sink, idx


SHAPES = [  # b, s, h, d, n, k: h 1..3 and >= 4 take different summation orders
    (1, 4, 4, 128, 150, 100), (2, 3, 4, 128, 90, 64), (2, 2, 8, 512, 300, 200),
    (1, 3, 1, 128, 70, 130), (1, 3, 2, 64, 70, 65), (1, 2, 3, 128, 90, 1),
    (1, 2, 16, 300, 100, 70), (1, 2, 5, 200, 40, 129), (1, 1, 64, 512, 200, 192),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_oracle_bit_for_bit(shape) -> None:
    q, kv, sink, idx = _inputs(sum(shape), *shape)
    scale = shape[3] ** -0.5
    idx[0, 0] = -1  # a row with nothing: exactly 0
    got = run(q, kv, sink, idx, scale)
    want = oracle(q, kv, sink, idx, scale)
    assert not got[0, 0].any()
    # torch.exp (MKL VML) and expf differ in the last bit now and then: allow a rare bf16 ulp.
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.mean() > 0.999, same.mean()
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-30)


def test_int32_indices_and_k_zero() -> None:
    q, kv, sink, idx = _inputs(7, 2, 3, 4, 64, 50, 77)
    np.testing.assert_array_equal(run(q, kv, sink, idx.astype(np.int32), 0.125),
                                  run(q, kv, sink, idx, 0.125))
    empty = run(q, kv, sink, np.zeros((2, 3, 0), np.int64), 0.125)
    assert empty.shape == q.shape and not empty.any()
    none = run(q, kv, sink, np.full((2, 3, 70), -1, np.int64), 0.125)
    assert not none.any() and not np.signbit(none).any()


def _golden_layers():
    for case in ("case1_r2_r1", "case2_candidates", "case3_r4_r128"):
        meta = json.loads((GOLDENS / f"{case}.json").read_text())
        arrays = {}
        for fname in meta["npz_files"]:
            with np.load(GOLDENS / fname) as z:
                arrays.update({k: z[k] for k in z.files if "attn_" in k or "q_rope" in k})
        for key in sorted(k for k in arrays if k.endswith(".attn_o")):
            step, layer, _ = key.split(".")
            yield (case, key, arrays[f"{step}.{layer}.q_rope"], arrays[f"{step}.{layer}.attn_kv"],
                   arrays[f"weights.{layer}.attn_sink"],
                   arrays[f"{step}.{layer}.attn_topk_idxs"], arrays[key])


def test_goldens_attn_o() -> None:
    fractions, exact, total = [], 0, 0
    for case, key, q, kv, sink, idx, o in _golden_layers():
        got = run(q, kv, sink, idx, q.shape[-1] ** -0.5)
        same = got.view(np.uint32) == o.view(np.uint32)
        fractions.append(same.mean())
        exact += bool(same.all())
        total += 1
        assert same.mean() > 0.9999, (case, key, same.mean())
    print(f"attn_o: {exact}/{total} layers exact, bf16-identical min {min(fractions):.6f} "
          f"mean {np.mean(fractions):.8f}")
    assert exact >= total - 2


def test_unit_golden() -> None:
    with np.load(GOLDENS / "unit_kernels.npz") as z:
        q, kv, sink, idx, o = (z[f"sparse_attn.{k}"] for k in ("q", "kv", "attn_sink",
                                                                  "topk_idxs", "o"))
    np.testing.assert_array_equal(run(q, kv, sink, idx, q.shape[-1] ** -0.5), o)


def test_portable_body_is_close() -> None:
    q, kv, sink, idx = _inputs(3, 2, 3, 4, 128, 150, 130)
    idx[1, 2] = -1
    model = onnx.load_from_string(sa_model(128 ** -0.5, functions=True))
    onnx.checker.check_model(model)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = plain.run(None, {"Q": q, "KV": kv, "S": sink, "I": idx})[0]
    want = run(q, kv, sink, idx, 128 ** -0.5)
    assert (got == want).mean() > 0.99
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=1e-30)
    assert not got[1, 2].any()
    empty = plain.run(None, {"Q": q, "KV": kv, "S": sink, "I": np.zeros((2, 3, 0), np.int64)})
    assert not empty[0].any()


def test_errors_are_clear() -> None:
    q, kv, sink, idx = _inputs(5, 1, 2, 4, 64, 30, 10)
    for bad, where in ((30, r"\[0, 1, 3\] = 30"), (-2, r"\[0, 1, 3\] = -2")):
        wrong = idx.copy()
        wrong[0, 1, 3] = bad
        with pytest.raises(Exception, match=rf"SparseAttention: Idx{where} is out of range"):
            run(q, kv, sink, wrong, 0.125)
    with pytest.raises(Exception, match=r"SparseAttention: KV must be \[b, n, d\]"):
        run(q, kv[:, :, :32].copy(), sink, idx, 0.125)
    with pytest.raises(Exception, match=r"SparseAttention: Sink must be \[h\] = \[4\]"):
        run(q, kv, sink[:3].copy(), idx, 0.125)
    with pytest.raises(Exception, match=r"SparseAttention: Idx must be \[b, s, k\]"):
        run(q, kv, sink, idx[:, :1].copy(), 0.125)
    for scale in (0.0, -1.0):
        with pytest.raises(Exception, match="softmax_scale must be > 0"):
            make_session(sa_model(scale))
