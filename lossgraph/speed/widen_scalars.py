"""Scalar constants widened to the rank they broadcast against::

    Op(x[N, 1], c[])  ->  Op(x[N, 1], c[1, 1])        (same values, same shape)

for every one-element constant (initializer or ``Constant``) that an elementwise op
(:data:`BROADCASTING`) combines with a value of known rank ``r >= 2``, in the main graph
and in Scan bodies; the constant gets rank ``r`` (one widened copy per constant and rank).

Why: onnxruntime (1.19 and 1.31 alike) broadcasts a scalar against a tensor whose last
dimension is 1, such as the ``(N, 1)`` predictions and errors of a regression, element
by element: 15-30x slower than against a constant of the tensor's own rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import numpy_helper

from ..graphs import initializer_arrays, known_shapes, values_read
from ..names import NameAuthority
from ..passes.contract import Pass, PassResult
from .scopes import main_and_scan_bodies

__all__ = ["BROADCASTING", "WidenScalarConstants"]

#: Elementwise ops of two inputs with numpy broadcasting.
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Greater",
                          "GreaterOrEqual", "Less", "LessOrEqual", "And", "Or", "Xor"})


@dataclass(frozen=True)
class WidenScalarConstants(Pass[None]):
    """One-element constants take the rank of what they broadcast against (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        inferred = onnx.shape_inference.infer_shapes(model)
        names = NameAuthority.for_model(model)
        changed = False
        for graph, shaped in main_and_scan_bodies(model, inferred):
            changed |= _widen(graph, shaped, names)
        return PassResult(model, changed=changed)


def _widen(graph: onnx.GraphProto, shaped: onnx.GraphProto, names: NameAuthority) -> bool:
    """Widen ``graph``'s scalar constants in place; True if any was."""
    ranks = {name: len(shape) for name, shape in known_shapes(shaped).items()}
    constants = initializer_arrays(graph)
    constants.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                      if n.op_type == "Constant" and n.attribute[0].name == "value"})
    widened: dict[tuple[str, int], str] = {}
    changed = False
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
            changed = True
    originals = {name for name, _ in widened}
    if originals:  # a scalar now read only in its wide form goes (onnxruntime warns of it)
        read = values_read(graph) | {o.name for o in graph.output}
        kept = [t for t in graph.initializer if t.name not in originals or t.name in read]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return changed
