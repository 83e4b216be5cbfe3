"""What several component graphs share: the call mode, -inf, int64 scalars."""

from __future__ import annotations

from typing import Literal

import onnx_ir as ir
from onnxscript import OpBuilder

Mode = Literal["prefill", "decode"]  # prefill: start_pos 0, any length; decode: one token
NEG_INF = float("-inf")


def scalar_i64(op: OpBuilder, value: ir.Value) -> ir.Value:
    """An int64 scalar or [1] tensor as a [1] tensor (start_pos may arrive either way)."""
    return op.Reshape(value, [1])
