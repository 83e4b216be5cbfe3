"""The SIMD tiles' vector members (VAvx2::fma, VAvx512::load, Ops<VAvx2>::cast_bf16, ...: an
instruction or a few each) are inlined into the `flatten` wrappers that carry their target
(custom_ops/src/sparse_attention_tiled.h). GCC leaves a call without a word where a
function compiled for the default target sits between them (a lambda not marked
always_inline did): IndexerScore's AVX2 tiles then ran 5x slower, every fma a call."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from csa2onnx.custom_ops.library import library_path

# A call whose target is a member of a vector type (sparse_attention::tiled::VAvx2,
# VAvx512, ...) or of indexer_score::Ops<V>, as `objdump -C` names it.
VECTOR_MEMBER_CALL = re.compile(r"\bcall\w*\s+[0-9a-f]+\s+<[^>]*(::VAvx\w*::|::Ops<)")


def test_no_vector_member_is_called_out_of_line() -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the vector types are x86's (AVX2, AVX-512)")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils) to read the built library")
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(library_path())],
                          check=True, capture_output=True, text=True).stdout
    calls, function = [], ""
    for line in text.splitlines():
        if line.endswith(">:"):
            function = line
        elif VECTOR_MEMBER_CALL.search(line):
            calls.append(f"{function} {line.split('<', 1)[1]}")
    assert not calls, f"{len(calls)} calls of vector members, the first: {calls[:3]}"
    assert "tiled_avx2" in text  # the wrappers this test is about are there to read
