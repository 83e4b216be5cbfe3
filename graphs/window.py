"""The sliding window of Attention.forward step 2: which window rows each query attends
to (get_window_topk_idxs) and the ring buffer that carries the last `window_size` rows of
window KV between calls (position p lives in slot p % window_size)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import OpBuilder

from csa2onnx.graphs.kv_cache import write_rows
from csa2onnx.graphs.numerics import INT64


def _check_window(window_size: int) -> None:
    if not isinstance(window_size, int) or window_size <= 0:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")


def _scalar(op: OpBuilder, x: ir.Value) -> ir.Value:
    """An int64 scalar from a scalar or [1] graph value."""
    return op.Reshape(op.Cast(x, to=INT64), op.Constant(value=ir.tensor(np.zeros(0, np.int64))))


def window_prefill(op: OpBuilder, kv: ir.Value, window_size: int) -> tuple[ir.Value, ir.Value]:
    """Prefill (start_pos 0) window over kv [b, s, d]: (idx, ring).

    idx [b, s, min(s, win)] int64: query t reads rows max(0, t-win+1) + j, and -1 where
    that passes t (the reference's matrix, -1 padding at the END of short rows).
    ring [b, win, d]: the last min(s, win) rows in slots p % win, other slots zero.
    """
    _check_window(window_size)
    shape = op.Shape(kv)
    s = op.Slice(shape, [1], [2])
    t = op.Range(0, op.Squeeze(s, [0]), 1)  # query positions [s]
    j = op.Range(0, op.Squeeze(op.Min(s, [window_size]), [0]), 1)  # [min(s, win)]
    first = op.Max(op.Sub(t, window_size - 1), 0)
    rows = op.Add(op.Unsqueeze(first, [1]), op.Unsqueeze(j, [0]))
    idx = op.Where(op.Greater(rows, op.Unsqueeze(t, [1])), -1, rows)
    idx = op.Expand(op.Unsqueeze(idx, [0]),
                    op.Concat(op.Slice(shape, [0], [1]), op.Shape(idx), axis=0))

    # Slot i holds the latest position p < s with p % win == i: p = s-1 - ((s-1-i) mod win)
    # (Mod takes the divisor's sign). p < 0 means no such token yet; kv is front-padded
    # with win zero rows so those slots gather zeros, and s == 0 needs no special case.
    slots = op.Range(0, window_size, 1)
    last = op.Sub(s, 1)
    pos = op.Sub(last, op.Mod(op.Sub(last, slots), window_size))
    padded = op.Pad(kv, op.Constant(value_ints=[0, window_size, 0, 0, 0, 0]))
    ring = op.Gather(padded, op.Add(pos, window_size), axis=1)
    return idx, ring


def window_decode(op: OpBuilder, kv_new: ir.Value, ring: ir.Value, start_pos: ir.Value,
                  window_size: int) -> tuple[ir.Value, ir.Value]:
    """Decode step at `start_pos` (> 0, int64 scalar or [1]) with kv_new [b, 1, d] and
    the ring [b, win, d] carried from the previous call: (idx [b, 1, win], new ring).

    The new row goes into slot start_pos % win; the query reads every slot, oldest first
    (start_pos%win+1 .. win-1, 0 .. start_pos%win), and a slot past start_pos (the ring
    still filling) is -1 in its place: at start_pos 3, win 8, [-1, -1, -1, -1, 0, 1, 2, 3].
    """
    _check_window(window_size)
    pos = _scalar(op, start_pos)
    slot = op.Mod(pos, window_size)
    slots = op.Range(0, window_size, 1)
    oldest_first = op.Mod(op.Add(op.Add(slots, slot), 1), window_size)
    row = op.Where(op.Greater(oldest_first, pos), -1, oldest_first)
    batch = op.Slice(op.Shape(kv_new), [0], [1])  # the ring's batch: only the write reads it
    idx = op.Expand(op.Reshape(row, [1, 1, window_size]),
                    op.Concat(batch, [1, window_size], axis=0))

    # one row written into a copy of the ring (a Where over the whole ring took ~10x longer)
    return idx, write_rows(op, ring, kv_new, slot)


def window_chunk(op: OpBuilder, kv: ir.Value, ring: ir.Value, start_pos: ir.Value,
                 window_size: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """A prefill that continues a sequence: kv [b, s, d] at positions P = start_pos ..
    P+s-1 (int64 scalar or [1], any P >= 0) with the ring [b, win, d] of the previous call.
    Returns (idx, rows, new ring).

    rows [b, c+s, d] are the c = min(P, win) ring rows before P, oldest first, then kv;
    idx [b, s, min(P+s, win)] indexes rows in the one-shot prefill's layout: query t reads
    its min(win, P+t+1) positions in order, then -1. At P = 0 (c = 0) all three equal
    window_prefill's (rows is kv), so a first chunk is the one-shot prefill bit for bit.
    """
    _check_window(window_size)
    pos = op.Reshape(_scalar(op, start_pos), [1])
    shape = op.Shape(kv)
    s = op.Slice(shape, [1], [2])
    c = op.Min(pos, [window_size])
    older = op.Gather(ring, op.Mod(op.Range(op.Squeeze(op.Sub(pos, c), [0]),
                                            op.Squeeze(pos, [0]), 1), window_size), axis=1)
    rows = op.Concat(older, kv, axis=1)

    t = op.Range(0, op.Squeeze(s, [0]), 1)  # [s]
    seen = op.Min(op.Add(op.Add(pos, t), 1), [window_size])  # positions query t reads
    width = op.Min(op.Add(pos, s), [window_size])
    j = op.Range(0, op.Squeeze(width, [0]), 1)
    # Query t's j-th position is P+t+1-seen+j, at row (that - (P - c)).
    first_row = op.Sub(op.Add(op.Add(t, 1), c), seen)  # [s]
    idx = op.Add(op.Unsqueeze(first_row, [1]), op.Unsqueeze(j, [0]))
    idx = op.Where(op.Less(op.Unsqueeze(j, [0]), op.Unsqueeze(seen, [1])), idx, -1)
    idx = op.Expand(op.Unsqueeze(idx, [0]),
                    op.Concat(op.Slice(shape, [0], [1]), op.Shape(idx), axis=0))

    # Slot i holds the latest position p < P+s with p % win == i, at row p - (P - c) of
    # rows; rows are front-padded with win zero rows for positions before the sequence.
    slots = op.Range(0, window_size, 1)
    last = op.Sub(op.Add(pos, s), 1)
    latest = op.Sub(last, op.Mod(op.Sub(last, slots), window_size))
    padded = op.Pad(rows, op.Constant(value_ints=[0, window_size, 0, 0, 0, 0]))
    new_ring = op.Gather(padded, op.Add(op.Sub(latest, op.Sub(pos, c)), window_size), axis=1)
    return idx, rows, new_ring
