"""Fuzz every csa2onnx custom op (Fp4QuantDequant, TorchTopK, Fp8Linear, SparseAttention,
WriteRows, PackQuantized, UnpackQuantized, TorchLinear, IndexerScore, IndexerTopK,
CandidateMask, ApplyRope, RopeCosSin, TorchRMSNorm) under AddressSanitizer and UBSan.

    python tools/fuzz_ops.py --build --cases 30000 --seed 1

`--build` builds the sanitizer library (custom_ops/build-asan, CPU kernels only) first;
without it a library built from other sources than today's is refused (it would fuzz old
kernels). The cases run in a worker subprocess with the sanitizer runtimes preloaded (Python
itself is not instrumented, so they must come first) and `CSA2ONNX_OPS_LIBRARY` pointing at
that library.
Each case is a random model and input: shapes with 0-sized and huge dims, valid and invalid
attributes, K of every value and shape, every dtype, NaN/inf/subnormal/random-bit data, 1 or 2
threads; for Fp8Linear also W constant or fed, plain or pairs16, every code (NaN codes,
blocks too wide for int16), scales of every kind, rows on the few-rows and the tile paths;
for SparseAttention indices in and out of range (-1 included, int64 and int32), packed
compressed caches of each format (random bytes included); for the row ops RowStart anywhere,
float and uint8 caches, every format, d and dim; for TorchLinear float and bf16 W, plain and
panels64, constant or fed, 1-3 groups; for IndexerScore float and packed keys, Width
anywhere, Lengths and Candidates (a value a key or a block of keys) or none (IndexerTopK the
same, with k and block_size of every kind, BlockScores asked for or not, streamed or not);
for ApplyRope, RopeCosSin and TorchRMSNorm every layout they take; and each forced
instruction-set path the CPU has (SparseAttention, TorchLinear, IndexerScore, IndexerTopK
and ApplyRope checked against their own definition paths; the others against the NumPy
definitions of custom_ops/reference.py, the C library's cosf/sinf, or a float64 evaluation
for TorchRMSNorm). A case must either return outputs of the right shape (checked against an
oracle where the input is valid) or raise an onnxruntime error.
Findings: a crash, a sanitizer report, a hang, a wrong shape or value, a valid input
rejected or an invalid one accepted. A crashed worker is restarted after the case that
killed it, so one run reports them all.
Case i of seed S is reproducible alone: `--seed S --start i --cases 1 -v`.

Exit status: 0 no findings, 1 findings, 2 could not run (no sanitizer runtime, no library).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from csa2onnx.custom_ops.build import built_from_current_sources
from csa2onnx.custom_ops.weight_layout import pack_pairs16, unpack_pairs16
from csa2onnx.graphs.standalone import IR_VERSION

ROOT = Path(__file__).resolve().parents[1]
ASAN_BUILD = ROOT / "custom_ops" / "build-asan"
LIBRARY_NAME = "libcsa2onnx_ops.so"
BUILD_LOCK = "/tmp/csa_build.lock"  # shared with `make setup` and other engineers' builds
MAX_ELEMENTS = 1 << 22  # "huge but allocatable": 16 MiB of float32 per input
CASE_TIMEOUT_S = 120.0

# ONNX element types (TensorProto values), spelled out so the parent needs no onnx import.
FLOAT, UINT8, INT32, INT64, BOOL = 1, 2, 6, 7, 9
FLOAT16, DOUBLE, BFLOAT16, FLOAT8E4M3FN = 10, 11, 16, 17
FP8_MAX_WORK = 1 << 24  # Fp8Linear cases: M * N * K at most (the oracle is NumPy)
GOOD_X_TYPES = (FLOAT, BFLOAT16, FLOAT16)


# ---------------------------------------------------------------- setup (parent side)
def sanitizer_runtimes() -> list[str] | None:
    """Paths of libasan.so and libubsan.so from the compiler the library is built with."""
    for cxx in ("g++", "c++", "gcc"):
        if shutil.which(cxx) is None:
            continue
        paths = []
        for name in ("libasan.so", "libubsan.so"):
            out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True,
                                 text=True).stdout.strip()
            # Unknown files come back as the bare name.
            if not out or out == name or not Path(out).exists():
                break
            paths.append(str(Path(out).resolve()))
        else:
            return paths
    return None


def build_asan_library(build_dir: Path = ASAN_BUILD) -> Path:
    """Build the sanitizer library, holding the shared build lock."""
    cmd = [sys.executable, str(ROOT / "custom_ops" / "build.py"), "--sanitize",
           "--build-dir", str(build_dir), "--cuda", "OFF"]
    with open(BUILD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return build_dir / LIBRARY_NAME


def is_instrumented(library: Path) -> bool:
    """Whether the library was compiled with ASan and UBSan (else fuzzing proves little)."""
    data = library.read_bytes()
    return b"__asan_report" in data and b"__ubsan_handle" in data


def worker_env(library: Path, runtimes: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*runtimes, *filter(None, [env.get("LD_PRELOAD")])])
    # Python leaks by design, so no leak checks; stop at the first report.
    env["ASAN_OPTIONS"] = ("detect_leaks=0:halt_on_error=1:abort_on_error=0:"
                           "allocator_may_return_null=1")
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env["CSA2ONNX_OPS_LIBRARY"] = str(library)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------- case generation
@dataclass
class Case:
    index: int
    op: str  # "fp4" | "topk"
    x_type: int
    x: np.ndarray  # float32 / float16 / uint16 (bf16 bits) / float64 / int32
    attributes: dict[str, Any]
    outputs: list[str]  # node output names; "" = omitted optional output
    threads: int
    inputs: list[str] = field(default_factory=list)  # node input names; [] = the usual ones
    k: np.ndarray | None = None  # topk only
    k_type: int = INT64
    isa: str | None = None  # the path forced when the kernel is created (the op's variable)
    more: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)  # other inputs: type
    constants: tuple[str, ...] = ()  # those of `more` given as initializers, not fed
    expect_ok: bool | None = None  # None: no prediction, only crash and shape checks
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # set while the session is created

    def describe(self) -> str:
        k = "" if self.k is None else f" K={self.k.tolist()!r}:{self.k.dtype}"
        if self.more:
            k = " " + " ".join(f"{name}={list(a.shape)}:{a.dtype}"
                               for name, (_, a) in self.more.items()) + f" isa={self.isa}"
            k += f" constants={list(self.constants)}" if self.constants else ""
        inputs = f" inputs={self.inputs}" if self.inputs else ""
        return (f"#{self.index} {self.op} x_type={self.x_type} shape={list(self.x.shape)}{k} "
                f"attrs={self.attributes}{inputs} outputs={self.outputs} threads={self.threads} "
                f"expect_ok={self.expect_ok} {' '.join(self.notes)}")


SPECIAL_F32 = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA00000,  # NaNs
                        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # inf, zeros
                        0x00000001, 0x80000001, 0x007FFFFF, 0x00800000,  # subnormals
                        0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000,  # max, +-1
                        0x40C00000, 0x40A00000, 0x3E800000, 0x43E00000],  # 6, 5, .25, 448
                       dtype=np.uint32).view(np.float32)


def random_data(rng: np.random.Generator, size: int) -> np.ndarray:
    """float32 values in a random style; ties, specials and odd bit patterns included."""
    style = int(rng.integers(7))
    if style == 0:
        return rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if style == 1:
        return rng.choice(SPECIAL_F32, size)
    if style == 2:
        with np.errstate(over="ignore"):
            return (rng.standard_normal(size) *
                    np.exp2(rng.integers(-150, 128, size).astype(np.float64))).astype(np.float32)
    if style == 3:
        return np.full(size, rng.choice(SPECIAL_F32), np.float32)
    if style == 4:  # subnormals only
        return (rng.integers(0, 1 << 23, size, dtype=np.uint32) |
                (rng.integers(0, 2, size, dtype=np.uint32) << 31)).view(np.float32)
    if style == 5:  # few distinct values: ties
        return rng.choice(np.array([-2, -1, 0, -0.0, 0.5, 1, 3, np.inf, -np.inf], np.float32),
                          size)
    mixed = rng.standard_normal(size).astype(np.float32)
    mask = rng.random(size) < 0.2
    mixed[mask] = rng.choice(SPECIAL_F32, int(mask.sum()))
    return mixed


def as_x_type(values: np.ndarray, x_type: int) -> np.ndarray:
    if x_type == BFLOAT16:  # raw bits, truncated (a low-payload NaN becomes inf: fine)
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    if x_type == FLOAT16:
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(np.float16)
    if x_type == DOUBLE:
        return values.astype(np.float64)
    if x_type == INT32:
        return values.view(np.int32)
    return values


def random_shape(rng: np.random.Generator, last: int) -> tuple[int, ...]:
    """Leading dims (rank 0..3 of them) times `last`, at most MAX_ELEMENTS elements."""
    lead = [int(d) for d in rng.choice([0, 1, 1, 2, 3, 4, 7, 16, 33], int(rng.integers(0, 4)))]
    if rng.random() < 0.03 and 0 in [*lead, last]:  # a huge dim beside a 0: still empty
        lead.insert(0, 1 << int(rng.integers(20, 41)))
    shape = (*lead, last)
    size = int(np.prod(shape, dtype=np.float64))
    # Only single long rows get the full budget: many-row cases are slow to check.
    limit = MAX_ELEMENTS if last > (1 << 18) else (1 << 19)
    while size > limit and len(shape) > 1:  # drop leading dims until it fits
        shape = shape[1:]
        size = int(np.prod(shape, dtype=np.float64))
    return shape


def random_array(rng: np.random.Generator, shape: tuple[int, ...], x_type: int) -> np.ndarray:
    size = int(np.prod(shape, dtype=np.float64))
    if size > MAX_ELEMENTS:
        shape, size = (min(shape[-1], MAX_ELEMENTS),), min(shape[-1], MAX_ELEMENTS)
    try:
        values = random_data(rng, size).reshape(shape)
    except ValueError:  # numpy refuses some 0-sized shapes with huge dims
        values = random_data(rng, 0).reshape(0, 1)
    return np.asarray(as_x_type(values, x_type))  # ufuncs turn 0-d arrays into scalars


def random_x_type(rng: np.random.Generator) -> int:
    return int(rng.choice([FLOAT, FLOAT, BFLOAT16, BFLOAT16, FLOAT16, DOUBLE, INT32],
                          p=[0.3, 0.1, 0.25, 0.05, 0.2, 0.05, 0.05]))


def last_dim(rng: np.random.Generator, multiple_of: int = 1) -> int:
    u = rng.random()
    if u < 0.05:
        return 0
    if u < 0.06:  # huge: one long row
        n = int(rng.integers(1 << 18, MAX_ELEMENTS + 1))
    elif u < 0.4:
        n = int(rng.integers(1, 9))
    else:
        n = int(rng.integers(1, 5000))
    if multiple_of > 1:
        n = max(multiple_of, n - n % multiple_of)
    return n


def fp4_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    ok = True
    attributes: dict[str, Any] = {}
    u = rng.random()
    block = int(rng.choice([1, 2, 4, 16, 32, 32, 64, 128, 7]))
    if u < 0.8:
        attributes["block_size"] = block
    elif u < 0.85:
        ok = False  # absent
    elif u < 0.9:
        attributes["block_size"] = float(block)
        ok = False
    elif u < 0.95:
        attributes["block_size"] = int(rng.choice([0, -1, -32, -(1 << 62)]))
        ok = False
    else:
        attributes["block_size"] = 1 << int(rng.integers(31, 63))  # valid, dwarfs the dims
    u = rng.random()
    if u < 0.85:
        attributes["scale_format"] = str(rng.choice(["e8m0", "e4m3"]))
    elif u < 0.9:
        ok = False
    else:
        attributes["scale_format"] = ["", "E8M0", "nvfp4", "e8m0 ", 1][int(rng.integers(5))]
        ok = False
    x_type = random_x_type(rng)
    ok = ok and x_type in GOOD_X_TYPES
    bs = attributes.get("block_size")
    bs_int = bs if isinstance(bs, int) and 0 < bs <= MAX_ELEMENTS else 1
    divisible = rng.random() < 0.85
    n = last_dim(rng, bs_int if divisible else 1)
    shape = random_shape(rng, n) if rng.random() > 0.03 else ()
    x = random_array(rng, shape, x_type)
    if x.ndim == 0 or (isinstance(bs, int) and bs > 0 and x.shape[-1] % bs):
        ok = False
    outputs = [["Y", "Scale"], ["Y"], ["Y", ""], ["Y", "Scale"]][int(rng.integers(4))]
    if rng.random() < 0.02:
        outputs, ok = ["", "Scale"], None  # required output omitted: onnxruntime decides
    inputs: list[str] = []
    if rng.random() < 0.01 and omit_inputs:
        inputs, ok = [[""], ["X", "X"]][int(rng.integers(2))], None
    return Case(index, "fp4", x_type, x, attributes, outputs, int(rng.integers(1, 3)),
                inputs=inputs, expect_ok=ok)


def random_flag(rng: np.random.Generator) -> tuple[Any, bool]:
    """(value or None for absent, is valid)."""
    u = rng.random()
    if u < 0.25:
        return None, True
    if u < 0.92:
        return int(rng.integers(0, 2)), True
    return [2, -1, 1 << 40, "yes", 1.0, ""][int(rng.integers(6))], False


def topk_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    ok: bool | None = True
    attributes: dict[str, Any] = {}
    notes = []
    for name in ("largest", "sorted"):
        value, valid = random_flag(rng)
        if value is not None:
            attributes[name] = value
        ok = ok and valid
    x_type = random_x_type(rng)
    ok = ok and x_type in GOOD_X_TYPES
    n = last_dim(rng)
    shape = random_shape(rng, n) if rng.random() > 0.03 else ()
    x = random_array(rng, shape, x_type)
    if x.ndim == 0:
        ok = False
    n = x.shape[-1] if x.ndim else 0
    u = rng.random()
    big = np.iinfo(np.int64)
    if u < 0.85:
        k_value = int(rng.choice([0, 1, n, max(n - 1, 0), n // 64, n // 64 + 1,
                                  int(rng.integers(0, n + 1))]))
    else:
        k_value = int(rng.choice([n + 1, -1, big.max, big.min, -(1 << 40), 1 << 40]))
    if x.ndim and not 0 <= k_value <= n:
        ok = False
    k_shape: tuple[int, ...] = [(), (1,), (2,), (0,), (1, 1)][
        int(rng.choice(5, p=[0.45, 0.4, 0.05, 0.05, 0.05]))]
    if k_shape not in ((), (1,)):
        ok = False
    k = np.full(k_shape, k_value, np.int64)
    k_type = INT64
    if rng.random() < 0.04:
        k_type, ok = INT32, False
        k = k.astype(np.int32)
    outputs = ["Values", "Indices"]
    if rng.random() < 0.03:
        outputs, ok = [["Values"], ["", "Indices"], ["Values", ""]][int(rng.integers(3))], None
        notes.append("outputs omitted")
    inputs: list[str] = []
    if rng.random() < 0.01 and omit_inputs:  # K (or X) omitted, or one too many
        inputs, ok = [["X", ""], ["X"], ["", "K"], ["X", "K", "X"]][int(rng.integers(4))], None
    return Case(index, "topk", x_type, x, attributes, outputs, int(rng.integers(1, 3)), k=k,
                k_type=k_type, inputs=inputs, expect_ok=ok, notes=notes)


def choose(rng: np.random.Generator, values: list[int]) -> int:
    return int(rng.choice(values))


def forced_isa(rng: np.random.Generator, paths: tuple[str, ...]) -> str | None:
    """None (the kernel's own choice) or one of `paths` this CPU can run, to force through
    the op's ISA variable ("avx512-novbmi" and "avx512-nofp16" need AVX-512; IndexerScore's
    "amx" AMX-INT8)."""
    from csa2onnx.custom_ops.library import cpu_flags, cpu_isas

    has = set(cpu_isas())
    if "avx512" in has:
        has |= {"avx512-novbmi", "avx512-nofp16"}
    if {"amx_int8", "avx512_vnni"} <= set(cpu_flags()):
        has.add("amx")
    runnable = [None] + [p for p in paths if p in has]
    return runnable[int(rng.integers(len(runnable)))]


def numerics_attribute(rng: np.random.Generator, attributes: dict[str, Any]) -> bool:
    """Sets (or leaves out) the attribute numerics; whether the value is valid."""
    u = rng.random()
    if u < 0.2:
        attributes["numerics"] = "exact"
    elif u < 0.4:
        attributes["numerics"] = "fast"
    elif u < 0.43:
        attributes["numerics"] = ["", "Fast", "faster", "bf16", 1][int(rng.integers(5))]
        return False
    return True


def fp8_codes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """W's e4m3 codes in a random style: checkpoint-like normal weights, every byte (NaN codes
    included), blocks spanning too many binades for int16, saturated, or zero."""
    style = int(rng.integers(5))
    if style == 0:  # normal values scaled into e4m3's range, as a checkpoint holds them
        import ml_dtypes

        w = rng.standard_normal((n, k)) * 100.0
        return np.clip(w, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    if style == 1:
        return rng.integers(0, 256, (n, k), dtype=np.uint8)
    if style == 2:  # huge and tiny values side by side: blocks that are not int16
        return rng.choice(np.array([0x7E, 0xFE, 0x01, 0x81, 0x09, 0x77, 0x00], np.uint8),
                          (n, k))
    if style == 3:
        return np.full((n, k), rng.choice([0x7E, 0xFE, 0x00, 0x80, 0x7F, 0x01]), np.uint8)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    return codes


def fp8_scales(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """WScale values: powers of two (as the checkpoint's ue8m0), or any float."""
    size = int(np.prod(shape, dtype=np.int64))
    if rng.random() < 0.7:
        return np.exp2(rng.integers(-30, 10, size).astype(np.float64)).astype(
            np.float32).reshape(shape)
    return random_data(rng, size).reshape(shape)


def fp8_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    ok: bool | None = True
    notes = []
    attributes: dict[str, Any] = {}
    u = rng.random()
    if u < 0.1:
        attributes["block_size"] = 32
    elif u < 0.14:
        attributes["block_size"], ok = int(rng.choice([16, 64, 0, -32, 1 << 40])), False
    elif u < 0.15:
        attributes["block_size"], ok = 32.0, False
    elif u < 0.17:
        attributes["round_output"], ok = choose(rng, [2, -1]), False
    elif u < 0.6:
        attributes["round_output"] = choose(rng, [0, 1])
    ok = numerics_attribute(rng, attributes) and ok
    kb = int(rng.choice([0, 1, 1, 2, 3, 8, 40, 160, 257]))
    k = 32 * kb if rng.random() > 0.04 else int(rng.integers(1, 100)) * 32 + int(
        rng.integers(1, 32))
    n = int(rng.choice([0, 1, 15, 16, 17, 31, 32, 33, 64, 65, 100, 257]))
    rows = int(rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 17, 64, 255, 256, 257, 300]))
    while rows * n * k > FP8_MAX_WORK and rows > 1:  # the oracle must stay quick
        rows //= 2
    lead = [[rows], [], [1, rows], [2, max(rows // 2, 1)]][int(rng.integers(4))]
    if not lead:
        rows = 1
    x_type = FLOAT if rng.random() < 0.9 else random_x_type(rng)
    ok = ok and x_type == FLOAT
    if rng.random() < 0.6:  # normal values at one scale, else anything
        x = rng.standard_normal((*lead, k)).astype(np.float32) * np.float32(
            2.0 ** int(rng.integers(-20, 20)))
    else:
        x = random_data(rng, int(np.prod([*lead, k], dtype=np.int64))).reshape(*lead, k)
    x = np.asarray(as_x_type(x.astype(np.float32), x_type))
    x_k = k
    if rng.random() < 0.03:  # X's K is not W's
        x = x[..., : max(k - 32, 0)] if k >= 32 else np.concatenate([x, x], axis=-1)
        x_k = x.shape[-1]
        ok = ok and x_k == k
    w = fp8_codes(rng, n, k)
    u = rng.random()
    if u < 0.35:  # W as k-pairs of 16 columns (an error unless N % 16 == 0 and K % 32 == 0)
        attributes["weight_layout"] = "pairs16"
        if n % 16 == 0 and k % 32 == 0:
            w = pack_pairs16(w)
        else:
            ok = False
    elif u < 0.37:  # the default spelled out, or a layout Fp8Linear does not have
        layout = str(rng.choice(["plain", "panels64", ""]))
        attributes["weight_layout"], ok = layout, ok and layout == "plain"
    scale_shape: tuple[int, ...] = (-(-n // 32), k // 32)
    if rng.random() < 0.05:
        scale_shape = [(scale_shape[0] + 1, scale_shape[1]), (scale_shape[0], scale_shape[1] + 1),
                       (scale_shape[1],), (1, 1, 1)][int(rng.integers(4))]
        ok = False
    w_scale = fp8_scales(rng, scale_shape)
    if k % 32:
        ok = False
    isa = forced_isa(rng, ("scalar", "avx2", "avx512", "avx512-nofp16", "avx512-novbmi"))
    inputs: list[str] = []
    if rng.random() < 0.01 and omit_inputs:
        inputs, ok = [["X", "W"], ["X", "", "WScale"], ["", "W", "WScale"]][
            int(rng.integers(3))], None
        notes.append("inputs omitted")
    if ok and x_k == k:
        notes.append(f"rows={int(np.prod(x.shape[:-1], dtype=np.int64))}")
    threads = int(rng.integers(1, 3))
    constants = ("W", "WScale") if rng.random() < 0.5 else ()
    return Case(index, "fp8", x_type, x, attributes, ["Y"], threads, inputs=inputs,
                expect_ok=ok, notes=notes, isa=isa, constants=constants,
                more={"W": (FLOAT8E4M3FN, w), "WScale": (FLOAT, w_scale)})


ISA_VARIABLES = {"fp8": "CSA_FP8_LINEAR_ISA", "sa": "CSA_SPARSE_ATTENTION_ISA",
                 "pack": "CSA_PACK_QUANTIZED_ISA", "unpack": "CSA_UNPACK_QUANTIZED_ISA",
                 "linear": "CSA_TORCH_LINEAR_ISA", "indexer": "CSA_INDEXER_SCORE_ISA",
                 "rope": "CSA_APPLY_ROPE_ISA", "blockmax": "CSA_BLOCK_MAX_ISA",
                 "itopk": "CSA_INDEXER_SCORE_ISA"}
# op -> its output, checked against the same call on the op's definition path
REFERENCE_CHECKED = {"sa": "O", "linear": "Y", "indexer": "Score", "rope": "Y",
                     "itopk": "Indices"}
REFERENCE_PATH = {"rope": "scalar"}  # the others': "reference"
SA_WORK = 1 << 21  # SparseAttention cases: b * s * h * k * d at most (ASan is slow)


def model_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """bf16-valued normal values (what a layer feeds) or anything (specials included)."""
    size = int(np.prod(shape, dtype=np.int64))
    if rng.random() < 0.7:
        return (rng.standard_normal(size).astype(np.float32).view(np.uint32)
                & np.uint32(0xFFFF0000)).view(np.float32).reshape(shape)
    return random_data(rng, size).reshape(shape)


def sa_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes
    from csa2onnx.custom_ops.reference import pack_quantized

    ok: bool | None = True
    notes: list[str] = []
    packed = rng.random() < 0.35  # a packed compressed cache: d mostly a multiple of 32
    b, s = choose(rng, [0, 1, 1, 2, 3]), choose(rng, [0, 1, 1, 2, 5, 17])
    h = choose(rng, [1, 2, 3, 4, 5, 16, 64])
    d = choose(rng, [32, 64, 128, 512] if packed and rng.random() < 0.85 else
             [1, 7, 16, 32, 64, 128, 512])
    n, k = choose(rng, [0, 1, 5, 64, 130]), choose(rng, [0, 1, 3, 64, 65, 128, 200])
    while b * s * h * k * d > SA_WORK:  # shrink the largest factor until it is quick
        if h >= max(s, k // 8):
            h = max(h // 2, 1)
        elif s >= k // 8:
            s = max(s // 2, 1)
        else:
            k = max(k // 2, 1)
    attributes: dict[str, Any] = {}
    u = rng.random()
    if u < 0.92:
        attributes["softmax_scale"] = float(rng.choice([d ** -0.5 if d else 1.0, 1.0, 1e-3, 30.0]))
    elif u < 0.95:
        attributes["softmax_scale"], ok = float(rng.choice([0.0, -1.0, np.nan])), False
    else:
        ok = False  # absent (required)
    ok = numerics_attribute(rng, attributes) and ok
    q = model_values(rng, (b, s, h, d))
    kv = model_values(rng, (b, n, d))
    sink = model_values(rng, (h,))
    more: dict[str, tuple[int, np.ndarray]] = {}
    n_cache = 0
    fmt = None
    if packed:
        fmt = str(rng.choice(list(PACKED_FORMATS)))
        block = PACKED_FORMATS[fmt][0]
        n_cache = choose(rng, [0, 1, 33, 100])
        if d % block == 0:
            rows = (pack_quantized(model_values(rng, (b, n_cache, d)), fmt) if rng.random() < 0.7
                    else rng.integers(0, 256, (b, n_cache, packed_row_bytes(fmt, d)),
                                      dtype=np.uint8))
        else:  # d is no multiple of the format's block: refused
            rows, ok = np.zeros((b, n_cache, max(d // 2, 1)), np.uint8), False
        u = rng.random()
        if u < 0.85:
            attributes["compressed_format"] = fmt
        elif u < 0.92:
            ok = False  # Compressed without its format
        else:
            attributes["compressed_format"], ok = "fp4", False
        if rng.random() < 0.04:
            rows, ok = rows[:, :, :-1] if rows.shape[-1] else rows[:, :, :0], False
        more["Compressed"] = (UINT8, np.ascontiguousarray(rows))
    elif rng.random() < 0.05:  # a format without Compressed: no packed rows
        attributes["compressed_format"] = str(rng.choice(list(PACKED_FORMATS)))
    total = n + n_cache
    idx = rng.integers(-1, max(total, 1), (b, s, k))
    if total == 0:
        idx[:] = -1
    if rng.random() < 0.3 and total > 0:  # the window first, as a layer's lists are
        idx[..., : min(k, total)] = np.arange(min(k, total))
    if rng.random() < 0.06 and idx.size:  # one index out of range
        idx.flat[int(rng.integers(idx.size))] = int(rng.choice([total, -2, 1 << 40, -(1 << 40)]))
        ok = False
    idx_type = INT64
    if rng.random() < 0.15:
        idx_type = INT32
        idx = idx.astype(np.int64).clip(-(1 << 31), (1 << 31) - 1).astype(np.int32)
    elif rng.random() < 0.02:
        idx_type, ok, idx = FLOAT, False, idx.astype(np.float32)
    if rng.random() < 0.04:  # a shape that does not agree with Q
        which = int(rng.integers(3))
        if which == 0:
            kv = model_values(rng, (b, n, d + 1))
        elif which == 1:
            sink = model_values(rng, (h + 1,))
        else:
            idx = idx.reshape(b * s, k) if idx_type != FLOAT else idx.reshape(-1)
        ok = False
    more = {"KV": (FLOAT, kv), "Sink": (FLOAT, sink), "Idx": (idx_type, idx), **more}
    inputs: list[str] = []
    if rng.random() < 0.01 and omit_inputs:
        inputs, ok = [["Q", "KV", "Sink"], ["Q", "", "Sink", "Idx"]][int(rng.integers(2))], None
        notes.append("inputs omitted")
    notes.append(f"n={n} n_cache={n_cache} fmt={fmt}")
    return Case(index, "sa", FLOAT, q, attributes, ["O"], int(rng.integers(1, 3)),
                inputs=inputs, expect_ok=ok, notes=notes,
                isa=forced_isa(rng, ("scalar", "avx2", "avx512", "avx512bf16")), more=more)


def rows_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """The state's row ops: WriteRows (float or uint8 caches, RowStart anywhere),
    PackQuantized and UnpackQuantized (each format, any d and dim, random bytes)."""
    from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes

    ok: bool | None = True
    attributes: dict[str, Any] = {}
    more: dict[str, tuple[int, np.ndarray]] = {}
    op = str(rng.choice(["write", "pack", "unpack"]))
    fmt = str(rng.choice(list(PACKED_FORMATS)))
    block = PACKED_FORMATS[fmt][0]
    d = int(rng.choice([0, 16, 32, 64, 512, 7, 48]))
    lead = tuple(int(v) for v in rng.choice([0, 1, 2, 3, 17], int(rng.integers(0, 3))))
    if op == "write":
        big = int(rng.choice([1, 2, 3]))
        small = int(rng.integers(0, big + 1)) if rng.random() < 0.85 else big + 1
        r, n = int(rng.choice([0, 1, 8, 130])), int(rng.choice([0, 1, 2, 8]))
        start = (int(rng.integers(0, r - n + 1)) if r >= n and rng.random() < 0.7
                 else int(rng.choice([0, 1, r - n + 1, -1, 1 << 40, r])))
        t = UINT8 if rng.random() < 0.4 else FLOAT
        make = ((lambda shape: rng.integers(0, 256, shape, dtype=np.uint8)) if t == UINT8
                else (lambda shape: random_data(rng, int(np.prod(shape))).reshape(shape)))
        cache, rows = make((big, r, d)), make((small, n, d))
        ok = small <= big and 0 <= start <= r - n
        if rng.random() < 0.04:
            rows, ok = make((small, n, d + 1)), False
        start_shape = [(), (1,), (1,), (2,)][int(rng.integers(4))]
        ok = ok and start_shape != (2,)
        more = {"Rows": (t, rows), "RowStart": (INT64, np.full(start_shape, start, np.int64))}
        return Case(index, "write", t, cache, {}, ["CacheOut"], int(rng.integers(1, 3)),
                    expect_ok=ok, more=more, notes=[f"RowStart={start}"])
    if rng.random() < 0.95:
        attributes["format"] = fmt
    else:
        attributes["format"], ok = str(rng.choice(["fp4", "", "FP8_E8M0_32"])), False
    isa = forced_isa(rng, ("scalar", "avx2", "avx512"))
    if op == "pack":
        x = random_data(rng, int(np.prod((*lead, d)))).reshape(*lead, d) if rng.random() < 0.5 \
            else model_values(rng, (*lead, d))
        ok = ok and d % block == 0
        if rng.random() < 0.03:
            x, ok = np.float32(1.0) * np.ones((), np.float32), False  # rank 0
        return Case(index, "pack", FLOAT, np.asarray(x, np.float32), attributes, ["P"],
                    int(rng.integers(1, 3)), expect_ok=ok, isa=isa)
    dim = d
    u = rng.random()
    if u < 0.9:
        attributes["dim"] = dim
    elif u < 0.95:
        ok = False  # absent (required)
    else:
        attributes["dim"], ok = int(rng.choice([-32, 1 << 40])), False
    ok = ok and dim % block == 0
    rb = packed_row_bytes(fmt, dim) if dim % block == 0 else max(dim // 2, 1)
    if rng.random() < 0.04:
        rb, ok = rb + 1, False
    packed = rng.integers(0, 256, (*lead, rb), dtype=np.uint8)
    return Case(index, "unpack", UINT8, packed, attributes, ["Y"], int(rng.integers(1, 3)),
                expect_ok=ok, isa=isa)


def blockmax_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """BlockMax: any rank and width (0 included), block_size from 1 to past the width, NaN
    and the other special values, a missing or non-positive block_size, a scalar X."""
    ok = True
    lead = tuple(int(v) for v in rng.choice([0, 1, 2, 3, 17], int(rng.integers(0, 3))))
    t = int(rng.choice([0, 1, 7, 8, 9, 16, 17, 64, 1000, 4099]))
    x = random_data(rng, int(np.prod((*lead, t)))).reshape(*lead, t)
    attributes: dict[str, Any] = {}
    u = rng.random()
    if u < 0.9:
        attributes["block_size"] = int(rng.choice([1, 2, 3, 8, 16, 5000, 1 << 40, (1 << 63) - 1]))
    elif u < 0.95:
        ok = False  # absent (required)
    else:
        attributes["block_size"], ok = int(rng.choice([0, -8])), False
    if rng.random() < 0.03:
        x, ok = np.ones((), np.float32), False  # rank 0
    return Case(index, "blockmax", FLOAT, np.asarray(x, np.float32), attributes, ["Y"],
                int(rng.integers(1, 3)), expect_ok=ok, isa=forced_isa(rng, ("scalar", "avx512")))


def mask_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """CandidateMask: any rank (0 refused), width (0 included), block_size from 1 to past the
    width; distinct picks, or ones out of range or repeated (refused); Keep of another shape."""
    lead = tuple(int(v) for v in rng.choice([0, 1, 2, 3, 17], int(rng.integers(0, 3))))
    t = int(rng.choice([0, 1, 7, 8, 9, 17, 64, 1000, 4099]))
    block = int(rng.choice([1, 3, 8, 5000, 1 << 40])) if rng.random() < 0.95 else 0
    n = -(-t // block) if block > 0 else t
    k = int(rng.integers(0, n + 1))
    blocks = np.argsort(rng.random((*lead, n)), axis=-1)[..., :k].astype(np.int64)
    if blocks.size and rng.random() < 0.1:  # one pick out of range, or repeated
        blocks.reshape(-1)[0] = (n, -1, 1 << 62, int(blocks.reshape(-1)[-1]))[
            int(rng.integers(0, 4))]
    keep = rng.random(blocks.shape) < float(rng.choice([0.0, 0.5, 1.0]))
    if rng.random() < 0.03:
        keep = keep[..., :-1] if k else np.ones((*lead, 1), bool)
    if rng.random() < 0.03:
        blocks, keep = np.zeros((), np.int64), np.ones((), bool)
    ordered = np.sort(blocks, axis=-1) if blocks.ndim else blocks
    ok = (block > 0 and blocks.ndim > 0 and keep.shape == blocks.shape
          and not ((blocks < 0) | (blocks >= n)).any()
          and not (ordered[..., 1:] == ordered[..., :-1]).any())
    # as they are: ascontiguousarray would make the rank-0 ones rank 1
    return Case(index, "mask", INT64, blocks.copy(),
                {"block_size": block}, ["Mask"], int(rng.integers(1, 3)), expect_ok=ok,
                more={"Keep": (BOOL, keep.copy()),
                      "Width": (INT64, np.array([t], np.int64))}, notes=[f"T={t}"])


LINEAR_WORK = 1 << 21  # TorchLinear cases: rows * G * N * K at most (reference path, ASan)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> bf16 bit patterns (uint16), truncated (the values are bf16 already
    where a model's are)."""
    return (np.ascontiguousarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def linear_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """TorchLinear: float or bf16 W, plain or panels64 layout, constant or fed, 1-3 groups,
    round_output, numerics; checked against the op's reference path (exact numerics)."""
    import ml_dtypes

    from csa2onnx.custom_ops.weight_layout import pack_panels

    ok: bool | None = True
    groups = choose(rng, [1, 1, 1, 1, 2, 3])
    k = choose(rng, [0, 1, 2, 3, 31, 64, 65, 512, 1280])
    n = choose(rng, [0, 1, 5, 64, 65, 130, 257, 320])  # 5 panels: decode's two-panel tasks
    rows = choose(rng, [0, 1, 2, 4, 5, 7, 33, 100])
    while rows * groups * n * k > LINEAR_WORK and rows > 1:
        rows //= 2
    while rows * groups * n * k > LINEAR_WORK:
        k //= 2
    lead = [[rows], [], [1, rows]][int(rng.integers(3))]
    x = model_values(rng, (*lead, groups * k))
    bf16 = rng.random() < 0.7
    w = model_values(rng, (groups * n, k))
    attributes: dict[str, Any] = {}
    if rng.random() < 0.5 or groups > 1:
        attributes["groups"] = groups
    if rng.random() < 0.4:
        attributes["round_output"] = choose(rng, [0, 1])
    ok = numerics_attribute(rng, attributes) and ok  # fast: AMX tiles where the CPU has them
    panels = rng.random() < 0.5
    if panels:
        attributes |= {"weight_layout": "panels64", "out_features": n, "in_features": k}
        packed = pack_panels(w.astype(ml_dtypes.bfloat16) if bf16 else w, groups).panels
        w = np.asarray(packed).astype(np.float32)
    u = rng.random()
    if u < 0.03:
        attributes["groups"], ok = choose(rng, [0, -1]), False
    elif u < 0.05:
        attributes["round_output"], ok = 2, False
    elif u < 0.07:
        attributes["weight_layout"], ok = "panels", False
    elif u < 0.09 and panels:
        del attributes["in_features"]
        ok = False
    elif u < 0.11:
        x, ok = model_values(rng, (*lead, groups * k + 1)), False
    w_type = BFLOAT16 if bf16 else FLOAT
    w_array = bf16_bits(w) if bf16 else w
    threads = int(rng.integers(1, 3))
    isa = forced_isa(rng, ("scalar", "avx2", "avx512", "avx512bf16"))
    return Case(index, "linear", FLOAT, x, attributes, ["Y"], threads, expect_ok=ok, isa=isa,
                more={"W": (w_type, np.ascontiguousarray(w_array))},
                constants=("W",) if rng.random() < 0.5 else (),
                notes=[f"G={groups} N={n} K={k} bf16={bf16} panels={panels}"])


def indexer_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """IndexerScore: float or packed keys (each format, random bytes too), Width anywhere;
    checked against the op's reference path."""
    from csa2onnx.custom_ops.constants import PACKED_FORMATS, packed_row_bytes
    from csa2onnx.custom_ops.reference import fp4_round_trip, pack_quantized

    ok: bool | None = True
    packed = rng.random() < 0.4
    b, s, heads = choose(rng, [0, 1, 2]), choose(rng, [0, 1, 3, 17]), choose(rng, [1, 4, 16, 64])
    d = choose(rng, [32, 64, 128] if packed else [1, 7, 32, 64, 128, 129])
    r = choose(rng, [0, 1, 5, 64, 130])
    while b * s * heads * r * d > SA_WORK:
        s = max(s // 2, 1)
        heads = max(heads // 2, 1) if s == 1 else heads
    ok = d <= 128
    q, w = model_values(rng, (b, s, heads, d)), model_values(rng, (b, s, heads))
    if d % 32 == 0 and rng.random() < 0.5:  # fp4 values, as the model's: AVX2's integer dots
        with np.errstate(all="ignore"):
            q = fp4_round_trip(q, 32, "e8m0")[0]
    attributes: dict[str, Any] = {}
    if packed:
        fmt = str(rng.choice(list(PACKED_FORMATS)))
        if d % PACKED_FORMATS[fmt][0]:
            fmt = "fp4_e8m0_32"
        keys = (pack_quantized(model_values(rng, (b, r, d)), fmt) if rng.random() < 0.7
                else rng.integers(0, 256, (b, r, packed_row_bytes(fmt, d)), dtype=np.uint8))
        keys_type = UINT8
        if rng.random() < 0.95:
            attributes["keys_format"] = fmt
        else:
            ok = False
    else:
        keys, keys_type = model_values(rng, (b, r, d)), FLOAT
        if rng.random() < 0.03:
            attributes["keys_format"], ok = "fp4_e8m0_32", False
    width = (choose(rng, [0, r, max(r - 1, 0), r // 2]) if rng.random() < 0.92
             else choose(rng, [r + 1, -1]))
    ok = ok and 0 <= width <= r
    more = {"W": (FLOAT, w), "Keys": (keys_type, np.ascontiguousarray(keys)),
            "Width": (INT64, np.array([width], np.int64))}
    lengths = rng.random() < 0.4
    if lengths:  # [s] reachable keys, past both ends too; sometimes another shape
        shape = (s,) if rng.random() < 0.9 else ((s + 1,), (1, s))[int(rng.integers(0, 2))]
        ok = ok and shape == (s,)
        more["Lengths"] = (INT64, rng.integers(-2, max(width, 0) + 3, shape).astype(np.int64))
    candidates = rng.random() < 0.4
    if candidates:  # [b, s, Width], sometimes another width; blocks of keys or single keys;
        # or a value a block of candidate_block_size keys (some sizes invalid)
        cb = 1
        if rng.random() < 0.4:
            cb = choose(rng, [2, 3, 8, 64, 1000, 2**40]) if rng.random() < 0.9 else \
                choose(rng, [0, -8])
            attributes["candidate_block_size"] = cb
        cols = -(-max(width, 0) // cb) if cb >= 1 else max(width, 0)
        t = cols if rng.random() < 0.9 else choose(rng, [cols + 1, 0, 3])
        ok = ok and t == cols and cb >= 1
        keep = rng.random((b, s, t)) < float(rng.choice([0.0, 0.05, 0.5, 1.0]))
        if rng.random() < 0.5:  # whole blocks of 8, as select_candidate_blocks publishes
            keep = np.repeat(keep[..., ::8], 8, axis=-1)[..., :t]
        more["Candidates"] = (BOOL, np.ascontiguousarray(keep))
        ok = ok and lengths  # Candidates come with Lengths
    notes = [f"R={r} T={width} packed={packed} lengths={lengths} candidates={candidates}"]
    isa = forced_isa(rng, ("scalar", "avx2", "avx512", "avx512bf16", "amx"))
    if rng.random() < 0.5:
        return Case(index, "indexer", FLOAT, q, attributes, ["Score"],
                    int(rng.integers(1, 3)), expect_ok=ok, isa=isa, more=more, notes=notes)
    # IndexerTopK: the same inputs ranked; k and block_size of every kind, BlockScores asked
    # for or not (it must be exactly when block_size >= 1), streamed (forced) or not
    k = choose(rng, [1, 2, 3, 64, 600]) if rng.random() < 0.9 else choose(rng, [0, -1])
    attributes["k"] = k
    block = choose(rng, [1, 3, 8]) if rng.random() < 0.6 else choose(rng, [0, -1])
    if block != 0 or rng.random() < 0.5:  # 0 given, or left to the default
        attributes["block_size"] = block
    # force_newest_block (below) needs block_size >= 1
    outputs = ["Indices", "BlockScores"] if rng.random() < (0.9 if block > 0 else 0.1) \
        else ["Indices"]
    force = rng.random() < 0.3
    if force:
        attributes["force_newest_block"] = 1
    ok = ok and k >= 1 and block >= 0 and (len(outputs) == 2) == (block > 0)
    ok = ok and (block > 0 or not force)
    env = {"CSA_INDEXER_TOPK_STREAM": "always"} if rng.random() < 0.5 else {}
    return Case(index, "itopk", FLOAT, q, attributes, outputs, int(rng.integers(1, 3)),
                expect_ok=ok, isa=isa, more=more, notes=notes, env=env)


def rope_case(rng: np.random.Generator, index: int, omit_inputs: bool) -> Case:
    """ApplyRope (X of rank 3 or 4, Cos/Sin per row or per batch, either direction; checked
    against its scalar path), RopeCosSin (positions of any shape, in and out of range;
    against the C library's cosf/sinf) and TorchRMSNorm (float or bf16 W; against a float64
    evaluation, to 1e-5 relative: its own order is torch's)."""
    ok: bool | None = True
    op = str(rng.choice(["rope", "cossin", "rmsnorm"]))
    attributes: dict[str, Any] = {}
    if op == "rope":
        b, s = choose(rng, [0, 1, 2]), choose(rng, [0, 1, 3, 17])
        heads, d = choose(rng, [0, 1, 4, 64]), choose(rng, [0, 2, 7, 64, 128, 512])
        rd = choose(rng, [2, 8, 64]) if rng.random() < 0.9 else choose(rng, [0, 3, 1024])
        ok = rd >= 2 and rd % 2 == 0 and rd <= d
        while b * s * heads * d > (1 << 20):
            heads = max(heads // 2, 1)
        x = model_values(rng, (b, s, heads, d) if rng.random() < 0.6 else (b, s, d))
        attributes["rope_head_dim"] = rd
        if rng.random() < 0.5:
            attributes["inverse"] = choose(rng, [0, 1]) if rng.random() < 0.95 else 2
            ok = ok and attributes["inverse"] in (0, 1)
        table = [(s, rd // 2), (b, s, rd // 2), (1, s, rd // 2)][int(rng.integers(3))]
        if rng.random() < 0.04:
            table, ok = (s + 1, rd // 2), False
        angles = rng.standard_normal(table).astype(np.float32) * 100
        cos = (np.cos(angles) if rng.random() < 0.9 else model_values(rng, table)).astype(
            np.float32)
        more = {"Cos": (FLOAT, cos), "Sin": (FLOAT, np.sin(angles).astype(np.float32))}
        return Case(index, "rope", FLOAT, x, attributes, ["Y"], int(rng.integers(1, 3)),
                    expect_ok=ok, more=more, isa=forced_isa(rng, ("scalar", "avx2", "avx512")))
    if op == "cossin":
        count = choose(rng, [1, 2, 32, 64])
        freqs = (rng.random(count) * 2.0 ** -rng.integers(0, 20, count)).astype(np.float32)
        if rng.random() < 0.04:
            freqs[int(rng.integers(count))], ok = np.float32(rng.choice([np.inf, np.nan])), False
        attributes["inverse_frequencies"] = [float(f) for f in freqs]
        max_positions = choose(rng, [1, 16, 1 << 20])
        attributes["max_positions"] = max_positions if rng.random() < 0.96 else choose(rng, [0, -5])
        ok = ok and attributes["max_positions"] > 0
        shape = [(choose(rng, [0, 1, 5, 33]),), (choose(rng, [1, 2]), choose(rng, [1, 7])),
                 ()][int(rng.integers(3))]
        pos = rng.integers(0, max_positions, shape)
        if rng.random() < 0.05 and pos.size:
            pos.flat[0], ok = choose(rng, [max_positions, -1]), False
        return Case(index, "cossin", INT64, np.asarray(pos, np.int64), attributes,
                    ["Cos", "Sin"], int(rng.integers(1, 3)), expect_ok=ok)
    n = choose(rng, [0, 1, 7, 512, 1280, 4096])
    lead = [choose(rng, [0, 1, 3, 17]) for _ in range(int(rng.integers(0, 3)))]
    x = model_values(rng, (*lead, n))
    bf16 = rng.random() < 0.5
    w = model_values(rng, (n,) if rng.random() < 0.96 else (n + 1,))
    ok = w.shape == (n,)
    attributes["epsilon"] = 1e-6 if rng.random() < 0.95 else choose(rng, [0, -1])
    ok = ok and attributes["epsilon"] > 0
    u = rng.random()
    if u < 0.03:
        attributes["round_output"], ok = choose(rng, [2, -1]), False
    elif u < 0.5:
        attributes["round_output"] = choose(rng, [0, 1])
    return Case(index, "rmsnorm", FLOAT, x, attributes, ["Y"], int(rng.integers(1, 3)),
                expect_ok=ok, more={"W": (BFLOAT16, bf16_bits(w)) if bf16 else (FLOAT, w)})


def check_rope(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    """RopeCosSin: cos/sin of f32(pos) * f, by the C library; TorchRMSNorm: close to a
    float64 evaluation where that is finite and not tiny."""
    import ctypes

    if case.op == "cossin":
        libm = ctypes.CDLL("libm.so.6")
        libm.cosf.restype = libm.sinf.restype = ctypes.c_float
        libm.cosf.argtypes = libm.sinf.argtypes = [ctypes.c_float]
        freqs = np.array(case.attributes["inverse_frequencies"], np.float32)
        angles = case.x.astype(np.float32)[..., None] * freqs  # one float32 multiply
        for name, fn in (("Cos", libm.cosf), ("Sin", libm.sinf)):
            want = np.array([fn(float(a)) for a in angles.reshape(-1)],
                            np.float32).reshape(angles.shape)
            if not same_floats(outputs[name], want):
                return f"{name} differs from the C library's"
        return None
    w_type, w = case.more["W"]
    w = (w.astype(np.uint32) << 16).view(np.float32) if w_type == BFLOAT16 else w
    x = case.x.astype(np.float64)
    with np.errstate(all="ignore"):
        want = w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6))
    got = outputs["Y"]
    if got.shape != x.shape:
        return f"Y shape {list(got.shape)}, expected {list(x.shape)}"
    # where float32 has the range for every step (the mean of squares, the product)
    mean_sq = np.mean(x * x, axis=-1, keepdims=True) if x.shape[-1] else np.ones(x.shape)
    finite = (np.isfinite(want) & (np.abs(want) > 1e-30) & (np.abs(want) < 1e37) &
              (mean_sq > 1e-30) & (mean_sq < 1e30))
    rounded = case.attributes.get("round_output") == 1
    tolerance = 1e-5 + (2.0 ** -8 if rounded else 0.0)  # bf16's rounding: half its spacing
    if np.any(np.abs(got[finite] - want[finite]) > tolerance * np.abs(want[finite])):
        return f"Y is not within {tolerance:g} of a float64 evaluation"
    if rounded:
        from csa2onnx.custom_ops.reference import round_bf16

        if not same_floats(got, round_bf16(got)):
            return "round_output: Y is not bf16-valued"
    return None


def make_case(seed: int, index: int, omit_inputs: bool = False) -> Case:
    rng = np.random.default_rng([seed, index])
    u = rng.random()
    make = (fp4_case if u < 0.14 else topk_case if u < 0.28 else fp8_case if u < 0.43
            else sa_case if u < 0.58 else rows_case if u < 0.69 else linear_case if u < 0.81
            else indexer_case if u < 0.9 else blockmax_case if u < 0.92
            else mask_case if u < 0.94 else rope_case)
    return make(rng, index, omit_inputs)


# ---------------------------------------------------------------- oracles (worker side)
def order_keys(x: np.ndarray, x_type: int) -> np.ndarray:
    """uint64 keys ordering as torch ranks values: -0 == +0, NaN above +inf."""
    if x_type == FLOAT16:
        bits, sign, inf = x.view(np.uint16).astype(np.uint64), 0x8000, 0x7C00
    else:
        bits = (x.view(np.uint16).astype(np.uint64) << 16 if x_type == BFLOAT16
                else x.view(np.uint32).astype(np.uint64))
        sign, inf = 0x80000000, 0x7F800000
    mag = bits & (sign - 1)
    keys = np.where(bits & sign, (sign - 1) - mag, sign | bits)
    keys = np.where(mag == 0, sign, keys)
    return np.where(mag > inf, np.uint64(0xFFFFFFFF), keys).astype(np.uint64)


def as_f32_bits(x: np.ndarray, x_type: int) -> np.ndarray:
    """Values widened to float32, as bits (bf16 is read back through a Cast to float)."""
    if x_type == BFLOAT16:
        return x.astype(np.uint32) << 16
    return x.astype(np.float32).view(np.uint32)


def same_floats(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit-equal, except that any NaN matches any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return got.shape == want.shape and bool(np.all(
        (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))))


def expected_fp4(x: np.ndarray, block: int, scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """reference.fp4_round_trip, except for e8m0 blocks whose amax is NaN or inf: there the
    kernel (and portable.py, and torch's 2**ceil(log2(t))) give the scale NaN or inf and the
    whole block NaN, while reference.pow2_ceil maps NaN and inf to 1.0 (np.frexp quirk)."""
    from csa2onnx.custom_ops.reference import fp4_round_trip

    y, scale = fp4_round_trip(x, block, scale_format)
    if scale_format == "e8m0":
        amax = np.abs(x.reshape(*x.shape[:-1], -1, block)).max(axis=-1)
        bad = ~np.isfinite(amax)
        scale = np.where(bad, amax, scale).astype(np.float32)
        y = np.where(bad[..., None], np.float32(np.nan),
                     y.reshape(*x.shape[:-1], -1, block)).reshape(x.shape)
    return y, scale


def check_fp4(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    x, bs = case.x, case.attributes["block_size"]
    y = outputs["Y"]
    want_y_type = np.float16 if case.x_type == FLOAT16 else np.float32
    if y.shape != x.shape or y.dtype != want_y_type:
        return f"Y has shape {y.shape} {y.dtype}, want {x.shape} {np.dtype(want_y_type)}"
    scale_shape = (*x.shape[:-1], x.shape[-1] // bs)
    if "Scale" in outputs and (outputs["Scale"].shape != scale_shape or
                               outputs["Scale"].dtype != np.float32):
        return f"Scale has shape {outputs['Scale'].shape}, want {scale_shape}"
    if x.size == 0 or x.size > (1 << 20):
        return None
    wide = as_f32_bits(x, case.x_type).view(np.float32)
    want_y, want_scale = expected_fp4(wide, bs, case.attributes["scale_format"])
    if case.x_type == FLOAT16:
        with np.errstate(over="ignore", invalid="ignore"):
            want_y = want_y.astype(np.float16).astype(np.float32)
    if not same_floats(y.astype(np.float32), want_y):
        bad = int(np.flatnonzero(~((y.astype(np.float32).view(np.uint32) ==
                                    want_y.view(np.uint32)) |
                                   (np.isnan(y.astype(np.float32)) & np.isnan(want_y))))[0])
        return (f"Y differs from reference.fp4_round_trip at flat {bad}: x bits "
                f"{wide.reshape(-1)[bad].view(np.uint32):#010x} got {y.reshape(-1)[bad]!r} "
                f"want {want_y.reshape(-1)[bad]!r}")
    if "Scale" in outputs and not same_floats(outputs["Scale"], want_scale):
        return "Scale differs from reference.fp4_block_scales"
    return None


def check_topk(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    x, k = case.x, int(case.k.reshape(-1)[0])
    values, indices = outputs["Values"], outputs["Indices"]
    want_shape = (*x.shape[:-1], k)
    if values.shape != want_shape or indices.shape != want_shape or indices.dtype != np.int64:
        return f"outputs have shapes {values.shape} {indices.shape}, want {want_shape}"
    n = x.shape[-1]
    if x.size == 0 or k == 0:
        return None
    rows_x, rows_i = x.reshape(-1, n), indices.reshape(-1, k)
    if rows_i.min() < 0 or rows_i.max() >= n:
        return "an index is out of range"
    if any(len(np.unique(r)) != k for r in rows_i[:64]):
        return "repeated index in a row"
    keys = order_keys(rows_x, case.x_type)
    picked = np.take_along_axis(keys, rows_i, axis=1)
    largest = bool(case.attributes.get("largest", 1))
    ranked = -np.sort(-keys.astype(np.int64), axis=1) if largest else np.sort(keys, axis=1)
    want = ranked[:, :k].astype(np.int64)
    got = (-np.sort(-picked.astype(np.int64), axis=1) if largest
           else np.sort(picked, axis=1).astype(np.int64))
    if not np.array_equal(got, want):
        return "the selected values are not the top k"
    if bool(case.attributes.get("sorted", 1)) or k * 64 <= n:
        steps = np.diff(picked.astype(np.int64), axis=1)
        if (steps > 0).any() if largest else (steps < 0).any():
            return "output is not sorted"
    elif not np.array_equal(picked[:, -1].astype(np.int64), want[:, -1]):
        return "the k-th output is not the k-th ranked value (nth_element places it)"
    # Values are the selected inputs; torch writes bf16 NaNs back as the canonical 0x7FC0.
    if case.x_type == FLOAT16:
        got_bits, src = values.reshape(-1, k).view(np.uint16), rows_x.view(np.uint16)
    else:  # float32, or bf16 read back through a Cast to float32
        got_bits, src = values.reshape(-1, k).view(np.uint32), as_f32_bits(rows_x, case.x_type)
    src = np.take_along_axis(src, rows_i, axis=1)
    if case.x_type == BFLOAT16:
        src = np.where((src & 0x7FFFFFFF) > 0x7F800000, np.uint32(0x7FC00000), src)
    if not np.array_equal(got_bits, src):
        return "Values are not the inputs at Indices"
    return None


# ---------------------------------------------------------------- running (worker side)
def check_rows(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    """WriteRows, PackQuantized, UnpackQuantized: the NumPy definitions, bit for bit."""
    from csa2onnx.custom_ops.reference import pack_quantized, unpack_quantized, write_rows

    (name, got), = outputs.items()
    if case.op == "write":
        rows = case.more["Rows"][1]
        want = write_rows(case.x, rows, int(case.more["RowStart"][1].reshape(-1)[0]))
    elif case.op == "pack":
        want = pack_quantized(case.x, case.attributes["format"])
    else:
        want = unpack_quantized(case.x, case.attributes["format"], case.attributes["dim"])
    if got.shape != want.shape:
        return f"{name} shape {list(got.shape)}, expected {list(want.shape)}"
    same = (np.array_equal(got, want) if got.dtype == np.uint8 else same_floats(got, want))
    return None if same else f"{name} differs from the definition"


def check_blockmax(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    """BlockMax: the NumPy definition, bit for bit (NaN is always 0x7FC00000)."""
    from csa2onnx.custom_ops.reference import block_max

    got = outputs["Y"]
    want = block_max(case.x, case.attributes["block_size"])
    if got.shape != want.shape:
        return f"Y shape {list(got.shape)}, expected {list(want.shape)}"
    return None if np.array_equal(got.view(np.uint32), want.view(np.uint32)) else \
        "Y differs from the definition"


def check_mask(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    """CandidateMask: the NumPy definition."""
    from csa2onnx.custom_ops.reference import candidate_mask

    got = outputs["Mask"]
    want = candidate_mask(case.x, case.more["Keep"][1], int(case.more["Width"][1][0]),
                          case.attributes["block_size"])
    if got.shape != want.shape:
        return f"Mask shape {list(got.shape)}, expected {list(want.shape)}"
    return None if np.array_equal(got, want) else "Mask differs from the definition"


def check_fp8(case: Case, outputs: dict[str, np.ndarray]) -> str | None:
    """Exact numerics (or a forced path, which always is): the NumPy definition bit for bit;
    fast numerics: the shape, and NaN exactly where the definition has it."""
    import ml_dtypes

    from csa2onnx.custom_ops.reference import fp8_linear, round_bf16

    got = outputs["Y"]
    codes, w_scale = case.more["W"][1], case.more["WScale"][1]
    if case.attributes.get("weight_layout") == "pairs16":
        codes = unpack_pairs16(codes)
    want_shape = (*case.x.shape[:-1], codes.shape[0])
    if got.shape != want_shape:
        return f"Y shape {list(got.shape)}, expected {list(want_shape)}"
    w = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = fp8_linear(case.x, w, w_scale)
    if case.attributes.get("round_output") == 1:
        want = round_bf16(want)
    if case.attributes.get("numerics") == "fast" and case.isa is None:
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return "fast numerics: NaN where the definition has none, or the reverse"
        return None
    if not same_floats(got, want):
        bad = int(np.sum(~((got.view(np.uint32) == want.view(np.uint32)) |
                           (np.isnan(got) & np.isnan(want)))))
        return f"Y differs from the definition in {bad} of {got.size} values"
    return None


class Runner:
    """Builds models and caches sessions (creating one costs more than most runs)."""

    def __init__(self) -> None:
        import onnxruntime as ort
        from onnx import helper

        from csa2onnx.custom_ops import session_options

        self.ort, self.helper, self.session_options = ort, helper, session_options
        ort.set_default_logger_severity(4)  # expected errors would flood stderr
        self.sessions: OrderedDict[tuple[bytes, int, str | None], Any] = OrderedDict()

    def model(self, case: Case) -> tuple[bytes, list[str]]:
        h = self.helper
        graph_outputs: list[str] = []
        nodes = []
        initializers = [h.make_tensor(name, case.more[name][0], list(case.more[name][1].shape),
                                      case.more[name][1].tobytes(), raw=True)
                        for name in case.constants]
        if case.op == "fp4":
            op_type, out_types = "Fp4QuantDequant", {"Y": case.x_type, "Scale": FLOAT}
            node_inputs = case.inputs or ["X"]
        elif case.op == "fp8":
            op_type, out_types = "Fp8Linear", {"Y": FLOAT}
            node_inputs = case.inputs or ["X", "W", "WScale"]
        elif case.op in ("write", "pack", "unpack", "blockmax", "mask"):
            op_type, out_types, node_inputs = {
                "mask": ("CandidateMask", {"Mask": BOOL}, ["X", "Keep", "Width"]),
                "write": ("WriteRows", {"CacheOut": case.x_type}, ["X", "Rows", "RowStart"]),
                "pack": ("PackQuantized", {"P": UINT8}, ["X"]),
                "unpack": ("UnpackQuantized", {"Y": FLOAT}, ["X"]),
                "blockmax": ("BlockMax", {"Y": FLOAT}, ["X"])}[case.op]
        elif case.op in ("rope", "cossin", "rmsnorm"):
            op_type, out_types, node_inputs = {
                "rope": ("ApplyRope", {"Y": FLOAT}, ["X", "Cos", "Sin"]),
                "cossin": ("RopeCosSin", {"Cos": FLOAT, "Sin": FLOAT}, ["X"]),
                "rmsnorm": ("TorchRMSNorm", {"Y": FLOAT}, ["X", "W"])}[case.op]
        elif case.op in ("linear", "indexer", "itopk"):
            scoring = ["Q", "W", "Keys", "Width", *(
                ["Lengths" if "Lengths" in case.more else "", "Candidates"]
                if "Candidates" in case.more else ["Lengths"] if "Lengths" in case.more else [])]
            op_type, out_types, node_inputs = {
                "linear": ("TorchLinear", {"Y": FLOAT}, ["X", "W"]),
                "indexer": ("IndexerScore", {"Score": FLOAT}, scoring),
                "itopk": ("IndexerTopK", {"Indices": INT64, "BlockScores": FLOAT},
                          scoring)}[case.op]
        elif case.op == "sa":
            op_type, out_types = "SparseAttention", {"O": FLOAT}
            node_inputs = case.inputs or ["Q", "KV", "Sink", "Idx", *(
                ["Compressed"] if "Compressed" in case.more else [])]
        else:
            op_type, out_types = "TorchTopK", {"Values": case.x_type, "Indices": INT64}
            node_inputs = case.inputs or ["X", "K"]
        node = h.make_node(op_type, node_inputs, list(case.outputs), domain="csa2onnx",
                           **case.attributes)
        types = {"X": case.x_type, "Q": case.x_type, "K": case.k_type, "W": FLOAT8E4M3FN,
                 "WScale": FLOAT} | {name: t for name, (t, _) in case.more.items()}
        constant = {t.name for t in initializers}
        inputs = [h.make_tensor_value_info(name, types[name], None)
                  for name in dict.fromkeys(node_inputs) if name and name not in constant]
        nodes.append(node)
        outputs = []
        for i, name in enumerate(case.outputs):
            if not name:
                continue
            out_type = out_types[name]
            if out_type == BFLOAT16:  # numpy has no bfloat16: read it through a Cast
                node.output[i] = name + "_bf16"
                nodes.append(h.make_node("Cast", [name + "_bf16"], [name], to=FLOAT))
                out_type = FLOAT
            outputs.append(h.make_tensor_value_info(name, out_type, None))
            graph_outputs.append(name)
        graph = h.make_graph(nodes, "fuzz", inputs, outputs, initializer=initializers)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21),
                                                   h.make_opsetid("csa2onnx", 1)],
                             ir_version=IR_VERSION)
        return model.SerializeToString(), graph_outputs

    def session(self, model: bytes, threads: int, isa: str | None = None,
                variable: str = "", env: dict[str, str] | None = None) -> Any:
        """`isa`: the path forced through the environment `variable` (read when the session
        creates the kernel); `env`: more such settings."""
        env = dict(env or {})
        if isa is not None:
            env[variable] = isa
        key = (model, threads, tuple(sorted(env.items())))
        if key in self.sessions:
            self.sessions.move_to_end(key)
            return self.sessions[key]
        options = self.session_options(threads)
        options.log_severity_level = 4
        os.environ.update(env)
        try:
            session = self.ort.InferenceSession(model, sess_options=options,
                                                providers=["CPUExecutionProvider"])
        finally:
            for name in env:
                del os.environ[name]
        self.sessions[key] = session
        if len(self.sessions) > 48:
            self.sessions.popitem(last=False)
        return session

    def feed(self, x: np.ndarray, x_type: int) -> Any:
        if x_type == BFLOAT16:
            return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x, BFLOAT16)
        return self.ort.OrtValue.ortvalue_from_numpy(x)

    def run(self, case: Case) -> tuple[str, str]:
        """("ok" | "error" | "finding", detail)."""
        ort_errors = tuple(
            t for t in vars(self.ort.capi.onnxruntime_pybind11_state).values()
            if isinstance(t, type) and issubclass(t, Exception))
        model, names = self.model(case)
        try:
            variable = ISA_VARIABLES.get(case.op, "")
            session = self.session(model, case.threads, case.isa, variable, case.env)
            feeds = {}
            x_name = "Q" if case.op in ("sa", "indexer", "itopk") else "X"
            if x_name in (case.inputs or [x_name]):  # as is: ascontiguousarray makes 0-d 1-d
                feeds[x_name] = self.feed(case.x, case.x_type)
            for name, (onnx_type, array) in case.more.items():
                if name in case.constants:
                    continue
                if name in (case.inputs or [name]):
                    feeds[name] = self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        array, onnx_type)
            if case.k is not None and "K" in (case.inputs or ["K"]):
                feeds["K"] = self.ort.OrtValue.ortvalue_from_numpy(case.k)
            got = session.run_with_ort_values(names, feeds)
            outputs = dict(zip(names, (v.numpy() for v in got), strict=True))
        except ort_errors as e:
            if case.expect_ok:
                return "finding", f"valid input rejected: {type(e).__name__}: {e}"
            return "error", type(e).__name__
        if case.expect_ok is False:
            return "finding", "invalid input accepted"
        if case.expect_ok is None:
            return "ok", "unpredicted"
        if case.op in REFERENCE_CHECKED:  # the oracle: the same call on the definition's path
            problem = self.check_reference(case, model, names, feeds, outputs)
        else:
            check = {"fp4": check_fp4, "topk": check_topk, "fp8": check_fp8,
                     "write": check_rows, "pack": check_rows, "unpack": check_rows,
                     "blockmax": check_blockmax, "mask": check_mask, "cossin": check_rope,
                     "rmsnorm": check_rope}[case.op]
            problem = check(case, outputs)
        return ("finding", problem) if problem else ("ok", "checked")


    def check_reference(self, case: Case, model: bytes, names: list[str],
                        feeds: dict[str, Any], outputs: dict[str, np.ndarray]) -> str | None:
        """The output's shape, and (exact numerics, or a forced path, which always is) the
        bits of the op's "reference" path: its scalar definition."""
        name = REFERENCE_CHECKED[case.op]
        got = outputs[name]
        if case.op in ("sa", "rope"):
            want_shape = case.x.shape
        elif case.op == "indexer":
            want_shape = (*case.x.shape[:2], int(case.more["Width"][1][0]))
        elif case.op == "itopk":
            t = int(case.more["Width"][1][0])
            want_shape = (*case.x.shape[:2], min(case.attributes["k"], t))
            if "BlockScores" in outputs:
                block = case.attributes["block_size"]
                blocks = (*case.x.shape[:2], -(-t // block))
                if outputs["BlockScores"].shape != blocks:
                    return f"BlockScores shape {list(outputs['BlockScores'].shape)}, expected " \
                           f"{list(blocks)}"
        else:
            n = case.attributes.get("out_features", case.more["W"][1].shape[0] //
                                    case.attributes.get("groups", 1))
            want_shape = (*case.x.shape[:-1], case.attributes.get("groups", 1) * n)
        if got.shape != tuple(want_shape):
            return f"{name} shape {list(got.shape)}, expected {list(want_shape)}"
        if case.attributes.get("numerics") == "fast" and case.isa in (None, "avx512bf16"):
            return None
        path = REFERENCE_PATH.get(case.op, "reference")
        reference = self.session(model, 1, path, ISA_VARIABLES[case.op])
        wants = [v.numpy() for v in reference.run_with_ort_values(names, feeds)]
        want = wants[0]
        if case.op == "itopk":
            for out, (got_i, want_i) in zip(names, zip(outputs.values(), wants, strict=True),
                                            strict=True):
                same = (got_i == want_i).all() if out == "Indices" else same_floats(got_i, want_i)
                if not same:
                    return f"{out} differs from the reference path"
            return None
        if not same_floats(got, want):
            bad = int(np.sum(~((got.view(np.uint32) == want.view(np.uint32)) |
                               (np.isnan(got) & np.isnan(want)))))
            return f"{name} differs from the reference path in {bad} of {got.size} values"
        return None


def overflow_on_purpose() -> None:
    """The --self-test case: an out-of-bounds read inside the library, which the sanitizer
    must report and the driver must count (proves the whole chain works)."""
    import ctypes

    from csa2onnx.custom_ops import library_path

    n = 1 << 16
    angles, cos, sin = (np.zeros(n, np.float32) for _ in range(3))
    fn = ctypes.CDLL(str(library_path())).csa2onnx_cos_sin
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn(angles.ctypes.data, n + 64, cos.ctypes.data, sin.ctypes.data)


def worker(seed: int, start: int, stop: int, omit_inputs: bool, self_test: bool) -> int:
    np.seterr(all="ignore")  # NaN/inf inputs are the point; warnings would bury reports
    if self_test:
        print(json.dumps({"start": start}), flush=True)
        overflow_on_purpose()
        print(json.dumps({"done": start, "status": "ok", "detail": "no report", "op": "self",
                          "s": 0.0}), flush=True)
        return 0
    runner = Runner()
    for index in range(start, stop):
        case = make_case(seed, index, omit_inputs)
        print(json.dumps({"start": index}), flush=True)
        t0 = time.perf_counter()
        try:
            status, detail = runner.run(case)
        except Exception as e:  # anything but an onnxruntime error is a finding
            status, detail = "finding", f"non-onnxruntime exception {type(e).__name__}: {e}"
        print(json.dumps({"done": index, "status": status, "detail": detail,
                          "describe": case.describe() if status == "finding" else "",
                          "op": case.op, "s": round(time.perf_counter() - t0, 4)}), flush=True)
    return 0


# ---------------------------------------------------------------- driving (parent side)
SANITIZER_MARKERS = ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error:",
                     "LeakSanitizer", "SUMMARY:")


def sanitizer_excerpt(stderr: str) -> str:
    lines = stderr.splitlines()
    hits = [i for i, line in enumerate(lines) if any(m in line for m in SANITIZER_MARKERS)]
    if not hits:
        return "\n".join(lines[-15:])
    return "\n".join(lines[max(hits[0] - 2, 0):hits[0] + 25])


@dataclass
class Totals:
    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    slowest: tuple[float, int] = (0.0, -1)
    case_seconds: float = 0.0


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def drive(seed: int, start: int, count: int, env: dict[str, str], verbose: bool,
          omit_inputs: bool, totals: Totals, self_test: bool = False,
          fresh_every: int = 250) -> None:
    """Runs cases [start, start+count) in workers, restarting after each crash and every
    `fresh_every` cases: some faults show only in a fresh process (the first C++ exception
    a process unwinds initialises state in libgcc_s)."""
    next_index, stop = start, start + count
    while next_index < stop:
        batch = min(stop - next_index, fresh_every)
        with subprocess.Popen(
                [sys.executable, __file__, "--worker", "--seed", str(seed),
                 "--start", str(next_index), "--cases", str(batch),
                 *(["--omit-inputs"] if omit_inputs else []),
                 *(["--self-test"] if self_test else [])],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                cwd=ROOT) as proc:
            # Reader threads: a per-case deadline on stdout, and stderr never fills its pipe.
            lines: queue.Queue[str | None] = queue.Queue()
            errs: list[str] = []
            out_reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
            err_reader = threading.Thread(target=errs.extend, args=(proc.stderr,), daemon=True)
            out_reader.start()
            err_reader.start()
            current: int | None = None
            hung = False
            while True:
                try:
                    line = lines.get(timeout=CASE_TIMEOUT_S)
                except queue.Empty:
                    hung = True
                    proc.kill()
                    break
                if line is None:
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue  # stray output from a library
                if "start" in msg:
                    current = msg["start"]
                    continue
                current = None
                totals.cases += 1
                next_index = msg["done"] + 1
                totals.outcomes[f"{msg['op']}:{msg['status']}"] += 1
                totals.slowest = max(totals.slowest, (msg["s"], msg["done"]))
                totals.case_seconds += msg["s"]
                if msg["status"] == "finding":
                    totals.findings.append(f"{msg['describe']}\n    {msg['detail']}")
                    print(f"FINDING {msg['describe']}\n    {msg['detail']}", flush=True)
                elif verbose:
                    print(f"case {msg['done']}: {msg['status']} {msg['detail']}", flush=True)
            rc = proc.wait()
            err_reader.join(timeout=10)
            stderr = "".join(errs)
        if current is not None or rc != 0 or any(m in stderr for m in SANITIZER_MARKERS[:3]):
            where = f"case {current}" if current is not None else "after the last case"
            what = "hang (killed)" if hung else f"worker exit status {rc}"
            if rc < 0:
                what += f" ({signal.Signals(-rc).name})"
            case = (make_case(seed, current, omit_inputs).describe()
                    if current is not None and not self_test else "")
            excerpt = sanitizer_excerpt(stderr)
            if rc < 0 and not any(m in stderr for m in SANITIZER_MARKERS):
                excerpt += ("\n    (no sanitizer report: std::terminate, or an unwinder abort "
                            "such as a C++ exception unwound through onnxruntime's frames)")
            finding = f"{what} at {where} {case}\n{excerpt}"
            totals.findings.append(finding)
            print(f"FINDING {finding}", flush=True)
            if current is not None:
                totals.cases += 1
                totals.outcomes["crash"] += 1
                next_index = current + 1
            elif rc != 0:
                break  # died outside a case: restarting would loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first case index")
    parser.add_argument("--build", action="store_true",
                        help="build the sanitizer library first (custom_ops/build-asan)")
    parser.add_argument("--library", type=Path, default=ASAN_BUILD / LIBRARY_NAME)
    parser.add_argument("--omit-inputs", action="store_true",
                        help="also omit required inputs (\"\" or absent): the kernels reject "
                        "such nodes at session creation (kernel_support.h require_node_io)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--fresh-every", type=int, default=250,
                        help="start a fresh worker process every N cases")
    parser.add_argument("--self-test", action="store_true",
                        help="one deliberate out-of-bounds read in the library: must give "
                        "1 finding (checks that sanitizer reports are caught)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.seed, args.start, args.start + args.cases, args.omit_inputs,
                      args.self_test)

    runtimes = sanitizer_runtimes()
    if runtimes is None:
        print("fuzz_ops: no libasan.so/libubsan.so from g++ -print-file-name "
              "(install the compiler's sanitizer runtimes)", file=sys.stderr)
        return 2
    library = build_asan_library() if args.build else args.library.resolve()
    if not library.is_file():
        print(f"fuzz_ops: no library at {library}; run with --build", file=sys.stderr)
        return 2
    if not built_from_current_sources(library.parent):  # it would fuzz old kernels
        print(f"fuzz_ops: {library} is stale (custom_ops' sources changed since it was built, "
              "or it has no build stamp); run with --build", file=sys.stderr)
        return 2
    if not is_instrumented(library):
        print(f"fuzz_ops: {library} is not built with -fsanitize=address,undefined",
              file=sys.stderr)
        return 2
    totals = Totals()
    t0 = time.perf_counter()
    drive(args.seed, args.start, 1 if args.self_test else args.cases,
          worker_env(library, runtimes), args.verbose, args.omit_inputs, totals, args.self_test,
          max(args.fresh_every, 1))
    elapsed = time.perf_counter() - t0
    print(f"outcomes: {dict(sorted(totals.outcomes.items()))}")
    print(f"slowest case: #{totals.slowest[1]} {totals.slowest[0]:.2f} s; "
          f"{totals.case_seconds:.1f} s in cases, elapsed {elapsed:.1f} s")
    print(f"cases={totals.cases} findings={len(totals.findings)} seed={args.seed}")
    return 1 if totals.findings else 0


if __name__ == "__main__":
    sys.exit(main())
