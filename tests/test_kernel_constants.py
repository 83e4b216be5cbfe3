"""Every constant the kernels and the Python side share has one Python definition
(custom_ops/constants.py); the C++ headers hold the same values, read here."""

from __future__ import annotations

import re
from pathlib import Path

from csa2onnx.custom_ops import constants

SRC = Path(__file__).resolve().parents[1] / "custom_ops" / "src"


def header_constant(header: str, name: str) -> float:
    text = (SRC / header).read_text()
    number = r"([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)f?"
    match = re.search(rf"constexpr\s+[\w:]+\s+{name}\s*=\s*{number}\s*;", text)
    assert match, f"{header} defines no constexpr {name}"
    return float(match.group(1))


def test_sparse_attention_constants() -> None:
    assert header_constant("sparse_attention.h", "kBlock") == constants.SPARSE_ATTENTION_BLOCK
    assert (header_constant("sparse_attention.h", "kRunningMaxInit")
            == constants.SPARSE_ATTENTION_RUNNING_MAX_INIT)


def test_fp8_block() -> None:
    assert header_constant("fp8_linear.h", "kBlock") == constants.FP8_BLOCK


def test_packed_formats() -> None:
    """Each packed format's block and codes per byte (row_bytes follows from them: the op's
    output width is checked against constants.packed_row_bytes in tests/test_packed_ops.py)."""
    names = {"fp4_e4m3_16": ("kFp4E4m3Block", "kFp4CodesPerByte"),
             "fp4_e8m0_32": ("kFp4E8m0Block", "kFp4CodesPerByte"),
             "fp8_e8m0_32": ("kFp8E8m0Block", "kFp8CodesPerByte")}
    assert set(names) == set(constants.PACKED_FORMATS)
    for fmt, (block, per_byte) in names.items():
        assert header_constant("packed_quant.h", block) == constants.PACKED_FORMATS[fmt][0]
        assert header_constant("packed_quant.h", per_byte) == constants.PACKED_FORMATS[fmt][1]
    assert header_constant("packed_quant.h", "kFp8E8m0Block") == constants.FP8_BLOCK


def test_torch_linear_panel() -> None:
    assert header_constant("torch_linear_op.cc", "kPanel") == constants.TORCH_LINEAR_PANEL


def test_indexer_score_max_dim() -> None:
    assert header_constant("indexer_score.h", "kMaxDim") == constants.INDEXER_SCORE_MAX_DIM
