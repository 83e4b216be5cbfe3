"""Verify a golden case end to end: export its layers, run its schedule through onnxruntime
with the state chained between steps, and compare every step and layer with the golden."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from csa2onnx.custom_ops.ops import Numerics, check_numerics
from csa2onnx.export.chunked_prefill import as_positions, run_chunked_prefill, valid_topk
from csa2onnx.export.config import AttentionConfig
from csa2onnx.export.cross_cpu import MovedCounts, Rule, cpu_class, rule_for, step_group
from csa2onnx.export.goldens import Comparison, GoldenCase, compare, load_case
from csa2onnx.export.plan import IndexKeys, StackPlan, plan_stack
from csa2onnx.export.runtime import AttentionRuntime, StepOutputs
from csa2onnx.export.stack import DEBUG_OUTPUTS, export_stack
from csa2onnx.export.weights import from_golden

# Arrays compared exactly (selections and masks); everything else at bf16 tolerance.
EXACT = ("index_topk_idxs", "attn_topk_idxs", "candidates")
# State (StateLayout roles) compared with the golden caches after the last step.
FINAL_STATE = {"window_kv_cache_after": "window_kv", "compress_kv_cache_after": "compress_kv"}


@dataclass
class Row:
    step: str
    layer: int
    array: str
    result: Comparison
    group: str = ""  # the cross-CPU count rule's group: prefill / decode / state


@dataclass
class VerifyReport:
    case: str
    index_keys: str
    portable: bool
    rule: Rule = "same_cpu"
    numerics: str = "exact"
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def moved(self) -> MovedCounts:
        counts = MovedCounts()
        for r in self.rows:
            counts.add(r.array, r.group or step_group(r.step), r.result.moved, r.result.size)
        return counts

    @property
    def ok(self) -> bool:
        rows_ok = bool(self.rows) and all(r.result.ok for r in self.rows)
        return rows_ok and (self.rule == "same_cpu" or not self.moved().violations())

    def table(self) -> str:
        """One line per array name: checks passed, worst error, min/mean bit-identical."""
        rule = ("same CPU class: rtol 1.6e-2, atol 1e-3 max" if self.rule == "same_cpu"
                else "cross-CPU rule (README)")
        lines = [f"{self.case}  (index_keys={self.index_keys}, "
                 f"{'portable' if self.portable else 'custom ops'}"
                 f"{', fast numerics' if self.numerics == 'fast' else ''}; {rule})",
                 f"  {'array':<24}{'checks':>8}{'passed':>8}{'exact':>8}"
                 f"{'max|err|':>11}{'bf16-identical min/mean':>26}"]
        by_array: dict[str, list[Row]] = {}
        for row in self.rows:
            by_array.setdefault(row.array, []).append(row)
        for name, rows in by_array.items():
            bits = [r.result.bit_identical for r in rows]
            err = max(r.result.max_abs_err for r in rows)
            lines.append(f"  {name:<24}{len(rows):>8}{sum(r.result.ok for r in rows):>8}"
                         f"{sum(r.result.exact for r in rows):>8}{err:>11.3g}"
                         f"{min(bits):>17.4f} / {np.mean(bits):.4f}")
        lines += [f"  note: {note}" for note in self.notes]
        if self.rule == "cross_cpu":
            lines.append(f"  moved (differ as bf16), worst group: {self.moved().worst():.2%} "
                         "(limit 12.5%)")
            lines += [f"  FAIL count rule: {v}" for v in self.moved().violations()]
        failures = [r for r in self.rows if not r.result.ok]
        for row in failures[:20]:
            lines.append(f"  FAIL {row.step} L{row.layer} {row.array}: {row.result.detail}")
        if len(failures) > 20:
            lines.append(f"  ... {len(failures) - 20} more failures")
        lines.append(f"  {'PASS' if self.ok else 'FAIL'}: {sum(r.result.ok for r in self.rows)}"
                     f" of {len(self.rows)} comparisons")
        return "\n".join(lines)


def _compare_step(report: VerifyReport, case: GoldenCase, step: str, plan: StackPlan,
                  result: StepOutputs, start_pos: int, *, chunked: bool = False,
                  settle: bool = False) -> None:
    """One step's outputs against the golden's. `chunked`: a chunked prefill (merged) against
    the one-shot golden prefill (its selections come as positions; the window part of
    attn_topk_idxs is laid out per chunk and not compared). `settle` (chunked and fast
    numerics): on rows the golden flags tie-decided, a different pick counts as the golden's
    when it is a valid top-k of the run's own scores; such a row attends to other rows, so
    its attn_topk_idxs, attn_o and out (in the layers using that selection) are not
    comparable and are left out, counted."""
    settled: dict[int, np.ndarray] = {}
    left_out = 0
    for p in plan.layers:
        layer = p.layer
        for name in (*DEBUG_OUTPUTS, "out"):
            key = f"L{layer}.{name}"
            if not case.has(step, layer, name) or (chunked and name == "attn_topk_idxs"):
                continue
            want = case.step(step, layer, name)
            if name == "out":
                got = result.out[layer]
            elif chunked and name == "index_topk_idxs":
                want = as_positions(want, want.shape[1])  # one-shot offset: s
                got = result.extra[f"L{layer}.index_topk_positions"]
            elif key in result.extra:
                got = result.extra[key]
            else:
                continue
            if settle and name == "index_topk_idxs":
                score = result.extra[f"L{layer}.index_score"]
                if chunked:
                    k, offset = result.extra[f"L{layer}.index_topk_k"], 0
                else:  # one call: its k, and its selections offset past its window rows
                    k = np.full(got.shape[1], got.shape[-1])
                    offset = min(start_pos, plan.config.window_size) + got.shape[1]
                got, settled[layer] = _settle_ties(got, want, case, step, layer, score, k,
                                                   offset)
            rows = settled.get(p.topk_from) if p.topk_from is not None else None
            if (name in ("attn_topk_idxs", "attn_o", "out") and rows is not None
                    and rows.any()):
                got = np.where(rows.reshape(rows.shape + (1,) * (got.ndim - 2)), want, got)
                left_out += int(rows.sum()) if name != "attn_topk_idxs" else 0
            report.rows.append(Row(step, layer, name, compare(
                got, want, exact=name in EXACT, name=name, rule=report.rule)))
    if left_out:
        report.notes.append(f"{step}: {left_out // 2} (layer, row) pairs of attn_o/out left "
                            "out: a tie-decided selection picked another valid top-k there")


def _settle_ties(got: np.ndarray, want: np.ndarray, case: GoldenCase, step: str, layer: int,
                 score: np.ndarray, k: np.ndarray, offset: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """On rows the golden flags tie-decided, a different pick counts as the golden's when it
    is a valid top-k of the run's own `score` (k[t] for query row t). `offset`: what turns
    a row of `got` into compressed positions (as_positions; 0: it already holds them).
    Returns the selections to compare and the rows [b, s] settled that way."""
    settled = np.zeros(want.shape[:2], bool)
    if got.shape[-1] != want.shape[-1] or not case.has(step, layer, "index_topk_ambiguous"):
        return got, settled
    ambiguous = case.step(step, layer, "index_topk_ambiguous")
    got = got.copy()
    for b, t in zip(*np.nonzero(ambiguous & (got != want).any(-1)), strict=True):
        picked = as_positions(got[b, t], offset) if offset else got[b, t]
        if valid_topk(picked, score[b, t], int(k[t])):
            got[b, t] = want[b, t]
            settled[b, t] = True
    return got, settled


def index_keys_of(case: GoldenCase) -> IndexKeys:
    patch = case.meta.get("behaviour_patch") or {}
    text = patch if isinstance(patch, str) else " ".join(f"{k} {v}" for k, v in patch.items())
    return "own" if "owner_reads_own_index_k" in text else "shared"


def verify_case(path: str | Path, *, portable: bool = False, numerics: Numerics = "exact",
                index_keys: IndexKeys | None = None,
                provider: str = "cpu", threads: int = 0, out_dir: Path | None = None,
                rule: Rule | None = None, prefill_chunk: int | None = None,
                progress: Callable[[str], None] | None = None) -> VerifyReport:
    """`rule`: same_cpu or cross_cpu; by default from the golden's `machine`.
    `prefill_chunk`: run the prefill in chunks of this many tokens (export/chunked_prefill.py)
    and judge it against the one-shot golden: floats by the cross-CPU rule, selections
    exact except on tie-decided rows, which must be a valid top-k of the scores.
    `numerics` "fast": judged the same way (its kernels sum in their own order)."""
    check_numerics(numerics, portable=portable)
    case = load_case(path)
    keys = index_keys or index_keys_of(case)
    config = AttentionConfig.from_model_args(case.model_args)
    plan = plan_stack(config, index_keys=keys)
    weights = from_golden(case.arrays, range(config.n_layers))
    report = VerifyReport(case.name, keys, portable, rule or rule_for(case.meta), numerics=numerics)
    machine = case.meta.get("machine") or {}
    made_on = f"made on {cpu_class(machine)} ({machine.get('cpu', 'AMD EPYC')})"
    if rule is None and report.rule == "cross_cpu":
        report.notes.append(f"{made_on}, not the class csa2onnx reproduces: cross-CPU rule")
    elif rule is not None and rule != rule_for(case.meta):
        report.notes.append(f"{made_on}; rule {rule} as asked")
    if numerics == "fast":
        report.rule = "cross_cpu"
        report.notes.append("fast numerics: cross-CPU rule; selections exact except "
                            "tie-decided rows (a valid top-k of the run's own scores instead)")
    if prefill_chunk is not None:
        report.rule = "cross_cpu"
        report.notes.append(f"prefill in chunks of {prefill_chunk} against the one-shot "
                            "golden: cross-CPU rule; selections exact except tie-decided rows "
                            "(a valid top-k instead); the window part of attn_topk_idxs is "
                            "laid out per chunk and not compared")
    tiebreak = case.meta.get("topk_tiebreak", "torch_cpu")
    if tiebreak == "lowest_index" and not portable:
        report.notes.append("this case breaks top-k ties lowest-index-first (ONNX TopK); the "
                            "default export follows torch's CPU topk: use --portable for it")
    elif tiebreak == "torch_cpu" and portable:
        report.notes.append("portable mode breaks top-k ties lowest-index-first; this case "
                            "follows torch's CPU topk, so tied rows may differ")
    with tempfile.TemporaryDirectory(prefix="csa2onnx-verify-") as tmp:
        folder = out_dir or Path(tmp)
        export_stack(plan, weights, folder, portable=portable, numerics=numerics,
                     debug_outputs=True, progress=progress)
        runtime = AttentionRuntime(folder, provider=provider, intra_op_num_threads=threads)
        layers = runtime.layers
        for entry in case.meta["schedule"]:
            step = entry["step"]
            xs = {layer: case.step(step, layer, "x") for layer in layers}
            if progress:
                progress(f"{case.name}: {step}")
            if entry["start_pos"] == 0 and prefill_chunk is not None:
                result, _ = run_chunked_prefill(runtime, xs, prefill_chunk)
                _compare_step(report, case, step, plan, result, 0, chunked=True, settle=True)
                continue
            result = runtime.prefill(xs) if entry["start_pos"] == 0 else runtime.decode(xs)
            _compare_step(report, case, step, plan, result, entry["start_pos"],
                          settle=numerics == "fast")
        last = case.meta["schedule"][-1]["step"]
        for layer in layers:
            for golden_name, role in FINAL_STATE.items():
                tensor = runtime.layout.get(layer, role)
                if tensor is not None and case.has(last, layer, golden_name):
                    want = case.step(last, layer, golden_name)
                    # The golden holds the rows written so far; the cache at least as many.
                    got = runtime.state_array(tensor.name)[:, :want.shape[1]]
                    report.rows.append(Row(last, layer, golden_name, compare(
                        got, want, name=golden_name, rule=report.rule), "state"))
    return report
