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


def test_torch_linear_panel() -> None:
    assert header_constant("torch_linear_op.cc", "kPanel") == constants.TORCH_LINEAR_PANEL
