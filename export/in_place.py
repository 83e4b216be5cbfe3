"""Ordering of in-place cache writes.

The runtime binds a cache's past.* input and present.* output to one buffer, so the
WriteRows node that produces present.X overwrites past.X while the graph runs.
onnxruntime runs nodes that do not depend on each other in any order; any other node
that reads past.X must therefore be an ancestor of the write (layer.py adds the edges
through WriteRows' `After` input). This check, run on every export, refuses a graph where
some reader is not ordered before the write.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from csa2onnx.custom_ops.library import DOMAIN


def in_place_writes(graph: ir.Graph) -> dict[str, ir.Node]:
    """present.* output name -> the WriteRows node that writes its past.* input: in place
    where the runtime binds both to one buffer (the caches), else onto a copy."""
    writes = {}
    for value in graph.outputs:
        node = value.producer()
        name = value.name or ""
        if (node is not None and node.domain == DOMAIN and node.op_type == "WriteRows"
                and name.startswith("present.")
                and node.inputs[0] is not None
                and node.inputs[0].name == "past." + name.removeprefix("present.")):
            writes[name] = node
    return writes


def _subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            yield attr.value
        elif attr.type == ir.AttributeType.GRAPHS:
            yield from attr.value


def _values_read(node: ir.Node) -> Iterator[ir.Value]:
    """A node's inputs and the values its subgraphs' nodes read (an If branch captures
    outer values that way)."""
    yield from (v for v in node.inputs if v is not None)
    for sub in _subgraphs(node):
        for inner in sub:
            yield from _values_read(inner)


def _top_level(graph: ir.Graph) -> dict[ir.Node, ir.Node]:
    """Every node, subgraphs' too, -> the top-level node it runs inside."""
    top: dict[ir.Node, ir.Node] = {}

    def enclose(sub: ir.Graph, outer: ir.Node) -> None:
        for inner in sub:
            top[inner] = outer
            for g in _subgraphs(inner):
                enclose(g, outer)

    for node in graph:
        top[node] = node
        for g in _subgraphs(node):
            enclose(g, node)
    return top


def _ancestors(node: ir.Node, top: dict[ir.Node, ir.Node]) -> set[ir.Node]:
    """Top-level nodes `node` depends on (its inputs' producers, transitively)."""
    seen: set[ir.Node] = set()
    stack = [node]
    while stack:
        for value in _values_read(stack.pop()):
            producer = value.producer()
            producer = top.get(producer) if producer is not None else None
            if producer is not None and producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return seen


def check_in_place_order(graph: ir.Graph) -> None:
    """Raise ValueError if a node reads a cache's old contents (past.*) without being
    ordered before the in-place write of that cache."""
    writes = in_place_writes(graph)
    if not writes:
        return
    top = _top_level(graph)
    readers: dict[str, list[ir.Node]] = {}
    for node in graph:
        for value in _values_read(node):
            if value.is_graph_input() and (value.name or "").startswith("past."):
                readers.setdefault(value.name, []).append(node)
    for present, write in writes.items():
        past = "past." + present.removeprefix("present.")
        before = _ancestors(write, top)
        late = [n for n in dict.fromkeys(readers.get(past, []))
                if n is not write and n not in before]
        if late:
            names = ", ".join(f"{n.op_type} {n.name!r}" for n in late[:4])
            raise ValueError(f"{past} is written in place, but {len(late)} node(s) reading "
                             f"its old contents are not ordered before the write ({names}); "
                             "pass them to write_rows(after=...)")
