"""Build a standalone ONNX model around one component, to test and inspect it on its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
import onnx_ir as ir
from onnxscript import GraphBuilder, OpBuilder

from csa2onnx.custom_ops.library import DOMAIN, DOMAIN_VERSION
from csa2onnx.custom_ops.ops import PORTABLE_KEY
from csa2onnx.custom_ops.portable import portable_functions

OPSET = 21
IR_VERSION = 10

# (name, dtype, shape): a graph input; shape entries are ints or symbolic names.
InputSpec = tuple[str, ir.DataType, Sequence[int | str]]


def build_model(name: str, inputs: Sequence[InputSpec], outputs: Sequence[str],
                body: Callable[..., ir.Value | Sequence[ir.Value]], *,
                portable: bool = False) -> onnx.ModelProto:
    """Trace `body(op, *inputs)` into a model whose outputs get the names `outputs`
    (`portable`: a library-free model, as a `--portable` artifact: the custom ops' function
    bodies attached, RoPE from tables; see custom_ops/ops.py)."""
    graph = ir.Graph([], [], nodes=[], name=name,
                     opset_imports={"": OPSET, DOMAIN: DOMAIN_VERSION})
    if portable:
        graph.metadata_props[PORTABLE_KEY] = "true"
    builder = GraphBuilder(graph)
    values = [builder.input(n, dtype, list(shape)) for n, dtype, shape in inputs]
    result = body(builder.op, *values)
    results = [result] if isinstance(result, ir.Value) else list(result)
    if len(results) != len(outputs):
        raise ValueError(f"{name}: body returned {len(results)} values for outputs {outputs}")
    for value, out_name in zip(results, outputs, strict=True):
        builder.add_output(_as_output(builder.op, value, graph), out_name)
    check_parameter_names(graph)
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=IR_VERSION))
    if portable:
        model.functions.extend(portable_functions())
    return model


def check_parameter_names(graph: ir.Graph) -> None:
    """Fail when two parameters got the same qualified name: the builder keeps only the
    last one as the initializer, and every node would silently read that one."""
    for node in graph:
        for value in node.inputs:
            if (value is not None and value.const_value is not None and value.producer() is None
                    and value not in graph.inputs
                    and graph.initializers.get(value.name) is not value):
                raise ValueError(f"{graph.name}: two parameters are named {value.name!r}; "
                                 "give the modules distinct names")


def _as_output(op: OpBuilder, value: ir.Value, graph: ir.Graph) -> ir.Value:
    # A graph input or an output used twice cannot simply be renamed: give it its own node.
    if value in graph.inputs or value.is_graph_output():
        return op.Identity(value)
    return value
