"""The names of a stack model's inputs and outputs other than its state (the state's
past.* / present.* names are export/state_layout.py's). The exporter names the graphs'
inputs and outputs here and the runtime finds them here: nothing parses a name."""

from __future__ import annotations

START_POS = "start_pos"  # decode's position (prefill's too when a chunk continues a sequence)


def layer_input(layer: int) -> str:
    """The hidden states entering attention layer `layer`: [batch, seq, dim]."""
    return f"x.L{layer}"


def layer_output(layer: int) -> str:
    """Attention layer `layer`'s output: [batch, seq, dim]."""
    return f"out.L{layer}"


def slot_input(slot: str) -> str:
    """A shared slot this sub-stack reads but a layer outside it writes."""
    return f"slot_in.{slot}"


def slot_output(slot: str) -> str:
    """A shared slot this stack writes, for a sub-stack after it."""
    return f"slot_out.{slot}"


def debug_output(layer: int, name: str) -> str:
    """An intermediate value of layer `layer` (export's debug_outputs)."""
    return f"L{layer}.{name}"
