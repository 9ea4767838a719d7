"""Large fills made at each run, not stored::

    ConstantOfShape(s)  ->  ConstantOfShape(Concat(s, Cast(Slice(Reshape(r, [-1]), [0], [0]))))

for every ``ConstantOfShape`` of :data:`~lossgraph.autodiff.context.RUN_TIME_FILL_VALUES`
values or more whose shape a runtime knows before the run (computed from constants and
static shapes), in the main graph and in Scan bodies, ``r`` the graph's smallest input:
the empty slice appended leaves the shape as it was, and reads a value no runtime knows
before the run.

Why: onnxruntime folds a ``ConstantOfShape`` of a constant shape into a constant it stores
for the session's life, the size of the whole fill. The gradient rules make the fills they
know to be large at each run (``GradContext.filled``'s ``run_time``); a fill whose shape
becomes static only once the batch is fixed is found here
(:class:`~lossgraph.speed.SpecializeBatch` runs it last): GPT-2's cross-entropy gradient
scatters into zeros the size of its logits, ``[4, 128, 50257]``, which its step's session
held as a 98 MiB constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff.context import RUN_TIME_FILL_VALUES
from ..graphs import all_graphs
from ..names import NameAuthority
from ..passes.contract import Pass, PassResult
from .scopes import static_scopes

__all__ = ["LargeFillsAtRunTime"]


@dataclass(frozen=True)
class LargeFillsAtRunTime(Pass[None]):
    """Large static fills read an empty slice of a graph input (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        if not any(node.op_type == "ConstantOfShape"
                   for graph in all_graphs(model.graph) for node in graph.node):
            return PassResult(model, changed=False)
        names = NameAuthority.for_model(model)
        changed = False
        for graph, shapes in static_scopes(model):
            changed |= _fill_at_run_time(graph, shapes, names)
        return PassResult(model, changed=changed)


def _fill_at_run_time(graph: onnx.GraphProto, shapes: dict[str, list[int]],
                      names: NameAuthority) -> bool:
    """Rewrite ``graph``'s large static fills in place (``shapes``: its static shapes);
    True if any was."""
    stored = {tensor.name for tensor in graph.initializer}
    known = _known_before_the_run(graph, stored, shapes)
    large = {node.output[0] for node in graph.node if node.op_type == "ConstantOfShape"
             and node.input[0] in known
             and _static_size(shapes.get(node.output[0])) >= RUN_TIME_FILL_VALUES}
    inputs = [value for value in graph.input if value.name not in stored
              and value.type.tensor_type.elem_type not in (0, onnx.TensorProto.STRING)]
    if not large or not inputs:
        return False
    smallest = min(inputs, key=lambda value: _static_size(shapes.get(value.name)) or 1 << 62)
    flat, none, empty, minus_one, zero = (
        names.fresh(f"{smallest.name}_{what}")
        for what in ("flat", "none", "empty_shape", "minus_one", "zero"))
    graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), minus_one),
                              numpy_helper.from_array(np.array([0], np.int64), zero)])
    rewritten = [helper.make_node("Reshape", [smallest.name, minus_one], [flat]),
                 helper.make_node("Slice", [flat, zero, zero], [none]),
                 helper.make_node("Cast", [none], [empty], to=onnx.TensorProto.INT64)]
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.output[0] in large:
            # its shape is computed by now: the Concat goes right before it
            shape = names.fresh(f"{node.input[0]}_at_run_time")
            rewritten.append(helper.make_node("Concat", [node.input[0], empty], [shape],
                                              axis=0))
            node.input[0] = shape
        rewritten.append(node)
    nodes = [onnx.NodeProto() for _ in rewritten]
    for copy, node in zip(nodes, rewritten):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def _known_before_the_run(graph: onnx.GraphProto, stored: set[str],
                          shapes: dict[str, list]) -> set[str]:
    """The values of ``graph`` a runtime can compute before any input arrives (and fold):
    its initializers and ``Constant`` outputs, the ``Shape`` and ``Size`` of values of
    static shape, and the outputs of nodes without subgraphs that read only those."""
    inputs = {value.name for value in graph.input} - stored
    known = set(stored)
    for node in graph.node:
        reads = [name for name in node.input if name]
        if node.op_type in ("Shape", "Size") and _static_size(shapes.get(reads[0])):
            known.update(node.output)
        elif not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                     for a in node.attribute) and all(
                         name in known and name not in inputs for name in reads):
            known.update(node.output)
    return known


def _static_size(shape: list | None) -> int:
    """The number of values of a fully known ``shape``, else 0."""
    if shape is None or not all(isinstance(dim, int) for dim in shape):
        return 0
    return prod(shape)
