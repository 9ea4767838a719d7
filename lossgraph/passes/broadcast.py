"""Scalar constants widened to the rank they broadcast against, for onnxruntime's sake.

onnxruntime (1.19 and 1.31 alike) broadcasts a scalar against a tensor whose last
dimension is 1, such as the ``(N, 1)`` predictions and errors of a regression, element
by element: 15-30x slower than against a constant of the tensor's own rank. So

    Mul(x[N, 1], c[])  ->  Mul(x[N, 1], c[1, 1])        (same values, same shape)

for every one-element constant that an elementwise op combines with a tensor of known
rank ``r >= 2`` (constants stay shared: one widened copy per rank). ``compile`` applies
it to every graph of a program.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from ..graphs import initializer_arrays, known_shapes, subgraphs
from ..names import NameAuthority
from .contract import model_pass

__all__ = ["widen_scalar_constants"]

#: Elementwise ops of two inputs with numpy broadcasting.
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Greater",
                          "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor"})


@model_pass
def widen_scalar_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its one-element constants widened where they broadcast against a
    tensor of known rank ``r >= 2`` (module doc); in the main graph and Scan bodies."""
    inferred = onnx.shape_inference.infer_shapes(model)
    names = NameAuthority.for_model(model)
    _widen(model.graph, inferred.graph, names)
    for node, shaped in zip(model.graph.node, inferred.graph.node):
        if node.op_type == "Scan":  # a Scan holds one graph: its body
            _widen(next(subgraphs(node)), next(subgraphs(shaped)), names)
    return model


def _widen(graph: onnx.GraphProto, shaped: onnx.GraphProto, names: NameAuthority) -> None:
    ranks = {name: len(shape) for name, shape in known_shapes(shaped).items()}
    constants = initializer_arrays(graph)
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant" and n.attribute[0].name == "value"})
    widened: dict[tuple[str, int], str] = {}
    for node in graph.node:
        if node.op_type not in BROADCASTING or len(node.input) != 2:
            continue
        for index, other in ((0, node.input[1]), (1, node.input[0])):
            value = constants.get(node.input[index])
            rank = ranks.get(other, 0)
            if value is None or value.size != 1 or value.ndim >= rank or rank < 2:
                continue
            key = (node.input[index], rank)
            if key not in widened:
                widened[key] = names.fresh(f"{node.input[index]}_rank{rank}")
                graph.initializer.append(
                    numpy_helper.from_array(value.reshape([1] * rank), widened[key]))
            node.input[index] = widened[key]
