"""SparseAttention's tiled kernel (every instruction-set path, any thread count) against the
per-row definition it replaced (CSA_SPARSE_ATTENTION_ISA=reference), bit for bit, on random
and adversarial inputs: through the op (bf16 outputs), and through a C++ driver
(tests/cpp/sparse_attention_tiles.cc) on the float32 quotients before that rounding."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from helpers import build_cpp_driver
from onnx import TensorProto
from test_sparse_attention_op import sa_model

from csa2onnx.custom_ops import make_session, session_options
from csa2onnx.custom_ops.library import cpu_isas, sparse_attention_pair_counts

PATHS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar") if isa in cpu_isas()]


def _session(monkeypatch, isa: str, scale: float, idx_type: int, threads: int = 0,
             variable: str = "CSA_SPARSE_ATTENTION_ISA") -> ort.InferenceSession:
    monkeypatch.delenv("CSA_SPARSE_ATTENTION_ISA", raising=False)
    monkeypatch.delenv("CSA2ONNX_ISA", raising=False)
    monkeypatch.setenv(variable, isa)  # read when the session creates the kernel
    try:
        return make_session(sa_model(scale, idx_type), options=session_options(threads))
    finally:
        monkeypatch.delenv(variable)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def _compare(monkeypatch, q, kv, sink, idx, scale, paths=None, threads=(1, 2)) -> None:
    it = TensorProto.INT32 if idx.dtype == np.int32 else TensorProto.INT64
    feeds = {"Q": q, "KV": kv, "S": sink, "I": idx}
    want = _session(monkeypatch, "reference", scale, it, 1).run(None, feeds)[0]
    for isa in paths or PATHS:
        for t in threads:
            got = _session(monkeypatch, isa, scale, it, t).run(None, feeds)[0]
            diff = _bits(got) != _bits(want)
            assert not diff.any(), (isa, t, q.shape, idx.shape, diff.mean(),
                                    np.argwhere(diff)[:5])


def _random(seed, b, s, h, d, n, k, minus_one=0.2, q_scale=2.0, idx_dtype=np.int64):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((b, s, h, d)) * q_scale).astype(np.float32)
    kv = rng.standard_normal((b, n, d)).astype(np.float32)
    sink = rng.standard_normal(h).astype(np.float32)
    idx = rng.integers(0, n, (b, s, k))
    idx[rng.random((b, s, k)) < minus_one] = -1
    return q, kv, sink, idx.astype(idx_dtype)


@pytest.mark.parametrize("h", [1, 3, 4, 64])
@pytest.mark.parametrize("d", [8, 128, 512])
def test_random_matches_reference(monkeypatch, h: int, d: int) -> None:
    b, s, n, k = (2, 3, 300, 200) if h * d <= 8192 else (1, 2, 300, 200)
    q, kv, sink, idx = _random(h * 1000 + d, b, s, h, d, n, k)
    idx[0, 0] = -1  # a row with nothing
    idx[-1, -1, 64:128] = -1  # a whole block skipped mid-row
    idx[-1, 0, 10:40] = idx[-1, 0, 5]  # duplicates
    _compare(monkeypatch, q, kv, sink, idx, d**-0.5)
    _compare(monkeypatch, q, kv, sink, idx.astype(np.int32), d**-0.5, paths=PATHS[:1],
             threads=(2,))


@pytest.mark.parametrize(("h", "d", "k"), [
    (1, 7, 70), (2, 13, 65), (3, 9, 1), (5, 200, 129), (16, 300, 70), (20, 8, 3),
    (6, 33, 64), (128, 64, 130), (48, 40, 63), (7, 1, 90), (64, 512, 0), (4, 24, 2048),
])
def test_odd_shapes_match_reference(monkeypatch, h: int, d: int, k: int) -> None:
    """Odd d (padded columns), h not a multiple of any tile (padded heads), k past, below and
    at multiples of 64, k = 0, a long index list."""
    q, kv, sink, idx = _random(h + d + k, 1, 3, h, d, 100, k, minus_one=0.3)
    _compare(monkeypatch, q, kv, sink, idx, 0.37)


@pytest.mark.parametrize("h", [1, 3, 4, 64])
def test_adversarial_inputs_match_reference(monkeypatch, h: int) -> None:
    d, n, k = 128, 60, 192
    rng = np.random.default_rng(h)
    q, kv, sink, idx = _random(h, 1, 8, h, d, n, k)
    q[0, 0] *= 40.0  # large logits: exp underflows to 0 for all but the maximum
    q[0, 1] = 0.0  # every logit 0: ties everywhere
    kv[0, 1] = kv[0, 0]  # identical rows: tied logits from different indices
    idx[0, 2] = rng.choice([0, 1], k)
    q[0, 3] *= 3e18  # extreme: logits overflow to inf, the softmax gives NaN (same NaN bits)
    idx[0, 4] = -1
    idx[0, 4, -1] = 7  # only the last entry of the last block
    idx[0, 5, ::64] = -1  # the first entry of each block missing
    kv[0, 2] = np.float32(1e-38)  # denormal products
    idx[0, 6, :64] = 2
    sink[:] = np.float32(80.0) if h > 1 else np.float32(-80.0)  # sink dominates / vanishes
    q[0, 7] = rng.choice([-1e4, 1e4], (h, d)).astype(np.float32)
    _compare(monkeypatch, q, kv, sink, idx, d**-0.5)


def test_released_dims_decode_and_prefill(monkeypatch) -> None:
    """h = 64, d = 512, k = 640 (window 128 + 512 compressed): decode (b = 4, one row each,
    heads split over tasks) and a few prefill rows."""
    q, kv, sink, idx = _random(11, 4, 1, 64, 512, 700, 640, minus_one=0.05)
    idx[:, :, 128 + 300:] = -1  # fewer compressed rows than the list holds
    _compare(monkeypatch, q, kv, sink, idx, 512**-0.5, paths=PATHS[:2], threads=(1, 3))
    q, kv, sink, idx = _random(12, 1, 5, 64, 512, 900, 640, minus_one=0.0)
    _compare(monkeypatch, q, kv, sink, idx, 512**-0.5, paths=PATHS[:1], threads=(2,))


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.skipif("avx512bf16" not in PATHS, reason="needs a CPU with AVX512-BF16")
def test_bf16_inputs_take_the_vdpbf16ps_tiles(monkeypatch) -> None:
    """The model's inputs (bf16 q and rows) on the avx512bf16 path: logits and P @ V on
    vdpbf16ps (counted), the definition's bits. Values so small that a product could be
    denormal (flushed by vdpbf16ps) send blocks to the fmaf tiles: a tiny q value all of its
    task's blocks, a tiny row value its block, a steep softmax (tiny p) the block's P @ V;
    still the same bits."""
    q, kv, sink, idx = _random(21, 4, 1, 64, 512, 700, 640, minus_one=0.05)
    q, kv = _bf16(q), _bf16(kv)
    before = sparse_attention_pair_counts()
    _compare(monkeypatch, q, kv, sink, idx, 512**-0.5, paths=["avx512bf16"], threads=(1, 2))
    after = sparse_attention_pair_counts()
    assert after["pairs"] - before["pairs"] >= 2 * 4 * 10  # both runs, 4 rows x 10 blocks
    assert after["fmaf"] == before["fmaf"] and after["pv_fmaf"] == before["pv_fmaf"]
    q[1, 0, 5, 7] = np.float32(2.0**-120)  # row 1: a q value too small, its task on fmaf
    kv[2, idx[2, 0, 70]] = np.float32(2.0**-100)  # row 2: one row too small, its block
    q[3, 0] = _bf16(q[3, 0] * 60.0)  # row 3: a steep softmax, p far below 2^-56 in places
    before = sparse_attention_pair_counts()
    _compare(monkeypatch, q, kv, sink, idx, 512**-0.5, paths=["avx512bf16"], threads=(2,))
    after = sparse_attention_pair_counts()
    assert after["fmaf"] - before["fmaf"] >= 10 + 1
    assert after["pv_fmaf"] > before["pv_fmaf"]


def test_global_variable_forces_the_path(monkeypatch) -> None:
    q, kv, sink, idx = _random(3, 1, 2, 8, 64, 50, 100)
    feeds = {"Q": q, "KV": kv, "S": sink, "I": idx}
    want = _session(monkeypatch, "reference", 0.125, TensorProto.INT64).run(None, feeds)[0]
    for isa in PATHS:
        got = _session(monkeypatch, isa, 0.125, TensorProto.INT64,
                       variable="CSA2ONNX_ISA").run(None, feeds)[0]
        np.testing.assert_array_equal(_bits(got), _bits(want))
    with pytest.raises(Exception, match=r"expected avx512, avx2, scalar, reference or avx512bf16"):
        _session(monkeypatch, "sse9", 0.125, TensorProto.INT64)


# ------------------------------------------------ float32 quotients (tests/cpp driver)
DRIVER = Path(__file__).resolve().parent / "cpp" / "sparse_attention_tiles.cc"


@pytest.fixture(scope="module")
def tiles_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cpp_driver(DRIVER, tmp_path_factory.mktemp("sparse_tiles"),
                            "-ffp-contract=off")


@pytest.mark.parametrize("seed", [7, 2024])
def test_unrounded_quotients_match_definition(tiles_driver: Path, seed: int) -> None:
    """Before the final bf16 rounding (which hides most last-bit differences) every path's
    acc / denom equals the definition's bit for bit, whole rows and groups of 16 heads."""
    run = subprocess.run([str(tiles_driver), str(seed)], capture_output=True, text=True,
                         timeout=600)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", run.stdout.splitlines()[-1])}
    assert run.returncode == 0 and counts["mismatches"] == 0, run.stdout[-3000:]
    assert counts["cases"] > 400 and counts["values"] > 5_000_000
    assert f"path {PATHS[0]}" in run.stdout  # the widest path this CPU has was compared
    if "avx512bf16" in PATHS:  # the vdpbf16ps tiles and both of their fallbacks ran
        pairs = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", run.stdout.splitlines()[-2])}
        assert pairs["pairs"] > 100 and pairs["pv_fmaf"] > 0 and pairs["fmaf"] > 0, pairs


def glibc_with_expf_2_28() -> bool:
    """Whether this process's C library is glibc 2.28 or later (its expf: libm_expf.h)."""
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 28)


@pytest.mark.skipif("avx512" not in cpu_isas(), reason="needs a CPU with AVX-512")
@pytest.mark.skipif(not glibc_with_expf_2_28(), reason="needs glibc 2.28 or later (its expf)")
def test_softmax_exp_is_std_exp_bit_for_bit(tmp_path: Path) -> None:
    """The exact softmax's exp on AVX-512 (libm_expf.h: glibc's expf, 8 values a step) against
    std::exp on every 13th float bit pattern (330 million, NaNs and infinities included; all
    2^32 give the same, 47 s) in runs of every length 1..8: the same bits everywhere, and the
    library's own check accepts this libm (so the kernels take that path here; with another
    libm they keep std::exp)."""
    driver = build_cpp_driver(Path(__file__).resolve().parent / "cpp" / "libm_expf.cc", tmp_path)
    out = subprocess.run([str(driver), "13"], capture_output=True, text=True, timeout=300)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", out.stdout.splitlines()[-1])}
    assert out.returncode == 0, out.stdout
    assert counts == {"values": 330_382_100, "differ": 0, "self_check": 1}, out.stdout
