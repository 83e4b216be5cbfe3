"""`csa2onnx bench` at the goldens' small dims: it runs, measures and reports (its timings
are not asserted: speed is measured in benchmarks, not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import GOLDENS, ROOT, load_module

from csa2onnx.export import bench, stack
from csa2onnx.export.bench import BenchError, BenchOptions, read_bandwidth, run_bench
from csa2onnx.export.cli import main


def test_bench_reports_a_small_stack(capsys) -> None:
    opts = BenchOptions(source=GOLDENS / "case1_r2_r1.json", layers=(0, 3), prefill=12,
                        decode=3, threads=1)
    result = run_bench(opts)
    assert result.layers == [0, 1, 2, 3] and result.weight_format == "bf16"
    assert result.weight_bytes > 0 and result.state_bytes > 0
    assert len(result.ours.decode_ms) == 3 and result.ours.prefill_s > 0
    assert result.read_bandwidth > 1e8 and result.weight_read_limit_ms > 0
    table = result.table()
    for text in ("prefill s", "decode median ms", "decode weight-read limit", "peak RSS",
                 "memory over weights + state"):
        assert text in table


def test_bench_command_json(capsys, tmp_path: Path) -> None:
    assert main(["bench", str(GOLDENS / "case5_fp8.json"), "--layers", "0-1", "--prefill",
                 "8", "--decode", "2", "--threads", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["weight_format"] == "fp8" and data["layers"] == [0, 1]
    assert data["weight_read_limit_ms"] > 0 and data["ours"]["decode_median_ms"] > 0
    assert data["x_limit"] > 0


def test_read_bandwidth_is_measured() -> None:
    assert read_bandwidth(1, mib=64, repeat=2) > 1e8


def test_bench_reads_the_weights_in_place_between_decode_steps(monkeypatch) -> None:
    """Large weights are read where they lie after each step (here: any size, in a weights
    file), and each step is judged against its own moment's bandwidth."""
    monkeypatch.setattr(bench, "IN_PLACE_PROBE_BYTES", 1)
    monkeypatch.setattr(stack, "EXTERNAL_DATA_BYTES", 0)
    opts = BenchOptions(source=GOLDENS / "case1_r2_r1.json", layers=(0, 3), prefill=12,
                        decode=3, threads=1)
    result = run_bench(opts)
    o = result.ours
    assert len(o.read_bandwidths) == 3 and min(o.read_bandwidths) > 0
    assert result.read_bandwidth == sorted(o.read_bandwidths)[1]
    assert "reads of the weights between decode steps" in result.table()


def test_x_limit_takes_each_step_against_its_own_bandwidth() -> None:
    side = bench.SideResult(prefill_s=1.0, decode_ms=[10.0, 30.0, 20.0], peak_rss_mib=0.0,
                            read_bandwidths=[1e9, 0.5e9, 2e9])
    result = bench.BenchResult(options={}, machine={}, layers=[0], weight_format="bf16",
                               weight_bytes=10**7, state_bytes=0, export_s=0.0, ours=side,
                               read_bandwidth=1e9)
    # limits per step 10, 20 and 5 ms: ratios 1.0, 1.5 and 4.0
    assert result.x_limit == 1.5 and result.weight_read_limit_ms == 10.0
    side.read_bandwidths = []  # none measured between steps: the median against the limit
    assert result.x_limit == 2.0


def test_bench_reaches_a_context_by_chunked_prefill() -> None:
    opts = BenchOptions(source=GOLDENS / "case1_r2_r1.json", layers=(0, 3), prefill=8,
                        context=30, decode=2, threads=1)
    result = run_bench(opts)
    assert result.context == 30
    assert "context 30 by chunked prefill of 8" in result.table()
    assert len(result.ours.decode_ms) == 2 and result.ours.prefill_s > 0


def test_bench_reaches_a_context_by_zeros() -> None:
    """--zero-context: one prefill, then decode at the context past zero state (as upstream
    decodes there); the table says so, and the prefill is the one call."""
    opts = BenchOptions(source=GOLDENS / "case1_r2_r1.json", layers=(0, 3), prefill=8,
                        context=200, decode=2, threads=1, zero_context=True)
    result = run_bench(opts)
    table = result.table()
    assert "prefill 8, then decode at context 200 (zero state between)" in table
    assert "chunked" not in table and "--zero-context: both sides prefill 8 tokens" in table
    assert len(result.ours.decode_ms) == 2 and result.ours.prefill_s > 0


def test_bench_matrix_and_sweep_take_zero_context(capsys) -> None:
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--batch", "1,2", "--threads", "1", "--context", "100",
                 "--decode", "1", "--zero-context"]) == 0
    captured = capsys.readouterr()
    assert "100 (zeros)" in captured.out and "calls)" not in captured.out
    assert "batch 2, context 100 (zeros), exact: prefill " in captured.err
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--context", "100", "--decode", "1", "--threads", "1",
                 "--max-seq-len", "2048,8192", "--zero-context"]) == 0
    assert "context 100 (one prefill, then zero state)" in capsys.readouterr().out


def test_bench_rejects_a_context_below_the_prefill() -> None:
    with pytest.raises(BenchError, match="context >= prefill"):
        run_bench(BenchOptions(source=GOLDENS / "case1_r2_r1.json", layers=(0, 3), prefill=8,
                               context=4, decode=1, threads=1))


def test_bench_sweeps_max_seq_len(capsys) -> None:
    """Several max_seq_len: one runtime each, the same inputs, decode steps taken in turn."""
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--context", "16", "--decode", "3", "--threads", "1",
                 "--max-seq-len", "2048,8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lengths"] == [2048, 8192] and data["layers"] == [0, 1, 2, 3]
    assert all(len(steps) == 3 for steps in data["decode_ms"].values())
    # grown caches hold the same rows whatever max_seq_len is
    assert data["state_bytes"]["2048"] == data["state_bytes"]["8192"] > 0


@pytest.mark.parametrize("lengths, problem", [("64,64", "distinct"),
                                              ("16,256", "past max_seq_len 16")])
def test_bench_sweep_rejects_bad_lengths(lengths: str, problem: str, capsys) -> None:
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--decode", "9", "--threads", "1", "--max-seq-len", lengths]) == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("decode", ["0", "-1"])
def test_bench_rejects_fewer_than_one_decode_step(decode: str, capsys) -> None:
    with pytest.raises(SystemExit):  # -1 had run the whole bench with no decode step
        main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--decode", decode])
    assert f"--decode: must be >= 1, got {decode}" in capsys.readouterr().err


def test_bench_checks_the_upstream_baseline_before_running(tmp_path: Path, capsys) -> None:
    case = str(GOLDENS / "case1_r2_r1.json")
    # a missing reference folder had surfaced only after csa2onnx's own run
    assert main(["bench", case, "--baseline", "upstream", "--upstream", str(tmp_path)]) == 2
    assert f"no upstream reference at {tmp_path} (load.py missing)" in capsys.readouterr().err
    # --upstream alone had been ignored
    assert main(["bench", case, "--upstream", str(tmp_path)]) == 2
    assert "--upstream names the baseline's folder: it needs --baseline upstream" in (
        capsys.readouterr().err)


def test_bench_rejects_a_malformed_max_seq_len(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--max-seq-len", "8k"])
    assert "integers separated by commas" in capsys.readouterr().err


def test_bench_matrix_runs_every_scenario(capsys) -> None:
    """Several --prefill/--batch/--threads and a long --context: one row per scenario."""
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8,12", "--batch", "1,2", "--threads", "1", "--context", "30",
                 "--decode", "2"]) == 0
    captured = capsys.readouterr()
    table = captured.out
    rows = [line.split() for line in table.splitlines() if line[:7].strip() == "1"]
    assert [(int(r[1]), int(r[2])) for r in rows] == [(1, 8), (1, 12), (2, 8), (2, 12),
                                                       (1, 30), (2, 30)]
    assert "(3 calls)" in table and "1 threads" in table.splitlines()[2]
    assert "upstream" not in table.splitlines()[4]  # no baseline asked: no upstream columns
    # each scenario reported on stderr as it ends (a run cut short keeps what it measured)
    done = [line for line in captured.err.splitlines() if "bench: scenario" in line]
    assert [line.split(": ", 2)[1] for line in done] == [f"scenario {i}/6" for i in range(1, 7)]
    assert "batch 2, context 30 (3 calls), exact: prefill " in done[5]
    assert " ms, x limit " in done[0] and "upstream" not in done[0]


def test_bench_matrix_json_and_errors(capsys) -> None:
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--layers", "0-3", "--prefill",
                 "8", "--threads", "1,2", "--decode", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["scenario"]["threads"] for r in data["rows"]] == [1, 2]
    assert all(r["result"]["ours"]["decode_median_ms"] > 0 for r in data["rows"])
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--prefill", "8,16",
                 "--context", "12"]) == 2
    assert "longer than every --prefill (the largest is 16), got 12" in capsys.readouterr().err
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--batch", "1,2",
                 "--max-seq-len", "64,128"]) == 2
    assert "not both" in capsys.readouterr().err
    # a context past max_seq_len: an error before the first scenario runs, not at its own
    assert main(["bench", str(GOLDENS / "case1_r2_r1.json"), "--prefill", "8", "--batch",
                 "1,2", "--context", "64", "--max-seq-len", "66", "--decode", "3"]) == 2
    captured = capsys.readouterr()
    assert "context 64 + 3 decode steps is past max_seq_len 66" in captured.err
    assert "scenario 1/" not in captured.err


def test_decode_side_by_side_times_both_formats_in_turns(capsys, tmp_path: Path) -> None:
    """tools/decode_side_by_side.py: both exports prefilled, their decode steps alternated,
    one row per batch with a ratio."""
    tool = load_module(ROOT / "tools" / "decode_side_by_side.py", "decode_side_by_side")
    times = tool.side_by_side(GOLDENS / "case5_fp8.json", (0, 1), 2, 8, 3, 1, "exact",
                              tmp_path / "a")
    assert sorted(times) == ["bf16", "fp8"] and all(len(t) == 3 for t in times.values())
    assert tool.main([str(GOLDENS / "case5_fp8.json"), "--layers", "0-1", "--batch", "1,2",
                      "--prefill", "8", "--steps", "2", "--threads", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [1, 2] and all(float(r[-1]) > 0 for r in rows)
    with pytest.raises(SystemExit, match="past max_seq_len"):
        tool.side_by_side(GOLDENS / "case5_fp8.json", (0, 1), 1, 10**6, 2, 1, "exact",
                          tmp_path / "b")


def test_decode_stream_tool_times_each_row_count(capsys) -> None:
    """tools/bench_decode_stream.py at a tiny size: one line per row count, GB/s and the
    fraction of the read probe."""
    tool = load_module(ROOT / "tools" / "bench_decode_stream.py", "bench_decode_stream")
    tool.main(["--layers", "2", "--k", "96", "--n", "70", "--rounds", "2", "--rows", "1,3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 linears of K 96 x N 70 bf16")
    assert [line.split(":")[0] for line in lines[1:]] == ["rows 1", "rows 3"]
    assert all("GB/s" in line and "of the probe" in line for line in lines[1:])


def test_long_chunk_tool_times_chunks_past_zeroed_context(capsys) -> None:
    """tools/bench_long_chunk.py at the goldens' dims: a line per chunk at its position (the
    context reached by zeros), its time and peak, and the prefill session's profile by op and
    layer; a context the chunks would run past max_seq_len is refused."""
    tool = load_module(ROOT / "tools" / "bench_long_chunk.py", "bench_long_chunk")
    args = ["--config", str(GOLDENS / "case2_candidates.json"), "--layers", "0-4",
            "--weights", "random-bf16", "--chunk", "8", "--chunks", "2", "--max-seq-len", "256"]
    tool.main([*args, "--context", "100", "--profile"])
    out = capsys.readouterr().out
    assert "chunk of 8 at 100:" in out and "chunk of 8 at 108:" in out
    assert "MiB above the resident" in out
    assert "IndexerTopK" in out and "layer3" in out  # the candidate user's, by layer
    with pytest.raises(SystemExit):
        tool.main([*args, "--context", "250"])
    assert "past --max-seq-len 256" in capsys.readouterr().err


def test_decode_stream_tool_default_reads_as_many_bytes_for_fp8(monkeypatch, capsys) -> None:
    """Without --layers the tool streams 800 MiB of weights for either precision (twice as
    many fp8 linears: ten would fit a 480 MiB L3); the model build is stubbed out, so only the
    default is checked."""
    tool = load_module(ROOT / "tools" / "bench_decode_stream.py", "bench_decode_stream")
    seen: list[int] = []
    layouts: list[str] = []

    def stop(k: int, n: int, layers: int, rng, weights: str = "bf16",
             fp8_layout: str = "") -> bytes:
        seen.append(layers * n * k * (1 if weights == "fp8" else 2))
        layouts.append(fp8_layout)
        raise SystemExit(0)

    monkeypatch.setattr(tool, "stream_model", stop)
    for weights in ("bf16", "fp8"):
        with pytest.raises(SystemExit):
            tool.main(["--weights", weights])
    assert seen == [800 * 2**20, 800 * 2**20]
    assert layouts == ["pairs16", "pairs16"]  # the fp8 layout an export writes


def test_decode_stream_fp8_layouts_compute_the_same() -> None:
    """The tool's fp8 model in either layout: the same outputs (the kernel reads both)."""
    import onnxruntime as ort

    from csa2onnx.custom_ops import session_options

    tool = load_module(ROOT / "tools" / "bench_decode_stream.py", "bench_decode_stream")
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    outputs = []
    for layout in ("plain", "pairs16"):
        model = tool.stream_model(64, 48, 2, np.random.default_rng(0), "fp8", layout)
        session = ort.InferenceSession(model, session_options(1),
                                       providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"X": x}))
    for plain, pairs16 in zip(*outputs, strict=True):
        assert plain.shape == (2, 48) and np.array_equal(plain, pairs16)


def test_decode_stream_tool_times_fp8_weights(capsys) -> None:
    """The same tool on Fp8Linear nodes (`--weights fp8`: e4m3 codes, one byte a weight)."""
    tool = load_module(ROOT / "tools" / "bench_decode_stream.py", "bench_decode_stream")
    for n, layout in ((80, "pairs16"), (70, "plain")):
        tool.main(["--weights", "fp8", "--layers", "2", "--k", "96", "--n", str(n), "--rounds",
                   "2", "--rows", "1,4", "--fp8-layout", layout])
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"2 linears of K 96 x N {n} fp8 ({layout}) (0 MiB)")
        assert [line.split(":")[0] for line in lines[1:]] == ["rows 1", "rows 4"]
        assert all("GB/s" in line and "of the probe" in line for line in lines[1:])
    with pytest.raises(SystemExit):  # argparse's error: N must be a multiple of 16
        tool.main(["--weights", "fp8", "--n", "70"])
    assert "--fp8-layout pairs16 needs --n a multiple of 16" in capsys.readouterr().err


def test_bench_ops_candidate_models_score_alike() -> None:
    """tools/bench_ops.py's level-two pair (the op given Lengths and Candidates, and every
    score then a Where) runs and gives the same bits, so its timings compare like with like."""
    from csa2onnx.custom_ops import make_session, session_options
    from csa2onnx.custom_ops.reference import pack_quantized

    pytest.importorskip("torch", reason="tools/bench_ops.py imports torch (its baselines)")
    tool = load_module(ROOT / "tools" / "bench_ops.py", "bench_ops")
    given, where = (make_session(m, options=session_options(1))
                    for m in tool.indexer_candidate_models(64))
    rng = np.random.default_rng(0)
    s, t = 3, 40
    feeds = {"Q": rng.standard_normal((1, s, 4, 64)).astype(np.float32),
             "W": rng.standard_normal((1, s, 4)).astype(np.float32),
             "K": pack_quantized(rng.standard_normal((1, t, 64)).astype(np.float32),
                                 "fp4_e8m0_32"),
             "T": np.array([t], np.int64), "L": np.full(s, t, np.int64),
             "C": rng.random((1, s, t)) < 0.3}
    a, b = given.run(None, feeds)[0], where.run(None, feeds)[0]
    assert np.isinf(a).any() and np.isfinite(a).any()
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("t", [600, 40000], ids=["nth_element", "heap"])
def test_bench_ops_topk_models_select_alike(t: int) -> None:
    """tools/bench_ops.py's IndexerTopK pair (the op, and IndexerScore, TorchTopK, BlockMax and
    the forcing Where) gives the same indices and block scores, in both of torch's branches."""
    from csa2onnx.custom_ops import make_session, session_options
    from csa2onnx.custom_ops.reference import pack_quantized

    pytest.importorskip("torch", reason="tools/bench_ops.py imports torch (its baselines)")
    tool = load_module(ROOT / "tools" / "bench_ops.py", "bench_ops")
    fused, composed = (make_session(m, options=session_options(2))
                       for m in tool.indexer_topk_models(64))
    rng = np.random.default_rng(1)
    s = 3
    feeds = {"Q": rng.standard_normal((1, s, 4, 64)).astype(np.float32),
             "W": rng.standard_normal((1, s, 4)).astype(np.float32),
             "K": pack_quantized(rng.standard_normal((1, t, 64)).astype(np.float32),
                                 "fp4_e8m0_32"),
             "T": np.array([t], np.int64)}
    (i, b), (j, c) = fused.run(None, feeds), composed.run(None, feeds)
    assert i.shape == (1, s, min(t, tool.INDEX_TOPK)) and np.isinf(b).any()
    np.testing.assert_array_equal(i, j)
    np.testing.assert_array_equal(b.view(np.uint32), c.view(np.uint32))
