"""Analyses that read a model and answer a question about it, without changing it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import onnx

from .differentiability import differentiable_inputs, not_differentiable_reason
from .graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    elem_type_name,
    opset_version,
    outer_references,
    shortest_path,
    subgraphs,
)
from .models import ModelLike, as_model
from .roles import get_roles

__all__ = ["trainable_initializers", "differentiable_values", "influenced_values",
           "GradientBlock", "gradient_block"]


def _may_be_float(types: Mapping[str, onnx.TypeProto]):
    """A predicate: may this value carry a gradient? Values of unknown type (outputs of
    ops shape inference does not know, e.g. custom domains) may, so they are never
    silently skipped."""

    def may_be_float(name: str) -> bool:
        value_type = types.get(name)
        if value_type is None or not value_type.HasField("tensor_type"):
            return value_type is None
        elem_type = value_type.tensor_type.elem_type
        return elem_type in FLOAT_TYPES or elem_type == onnx.TensorProto.UNDEFINED

    return may_be_float


def differentiable_values(model: onnx.ModelProto, targets: Iterable[str],
                          types: Mapping[str, onnx.TypeProto] | None = None,
                          trainable: bool = False) -> set[str]:
    """Float values of the top-level graph that influence ``targets`` differentiably.

    Walks the graph backwards from ``targets`` through differentiable inputs only
    (see :mod:`lossgraph.differentiability`); a subgraph's captured outer values count
    as inputs of the node that holds it. ``trainable`` also skips the inputs that are
    differentiable but never trained (batch-normalization statistics).
    """
    types = ForwardFacts.of(model).types if types is None else types

    is_float = _may_be_float(types)

    needed = {t for t in targets if is_float(t)}
    for node in reversed(model.graph.node):
        if not any(o in needed for o in node.output):
            continue
        for position in differentiable_inputs(node.op_type, node.domain, len(node.input),
                                              trainable, opset_version(model, node.domain)):
            name = node.input[position]
            if name and is_float(name):
                needed.add(name)
        for sub in subgraphs(node):
            needed.update(n for n in outer_references(sub) if is_float(n))
    return needed


def influenced_values(model: onnx.ModelProto, sources: Iterable[str],
                      types: Mapping[str, onnx.TypeProto]) -> set[str]:
    """Float values of the top-level graph that ``sources`` influence differentiably."""

    is_float = _may_be_float(types)

    reached = set(sources)
    for node in model.graph.node:
        positions = differentiable_inputs(node.op_type, node.domain, len(node.input),
                                          opset=opset_version(model, node.domain))
        hit = any(node.input[p] in reached for p in positions)
        hit = hit or any(n in reached for sub in subgraphs(node) for n in outer_references(sub))
        if hit:
            reached.update(o for o in node.output if o and is_float(o))
    return reached


@dataclass(frozen=True)
class GradientBlock:
    """Why no gradient flows from a value to the targets, found on one path between them.

    ``path`` alternates value names and nodes: ``[v0, node1, v1, node2, v2, ...]``
    from the source to a target; ``at`` is the index in ``path`` of the first node
    that passes no gradient on, and ``reason`` says why. No path at all: ``path`` is
    empty and ``at`` is -1.
    """

    path: tuple
    at: int
    reason: str


def gradient_block(model: onnx.ModelProto, source: str, targets: Iterable[str],
                   types: Mapping[str, onnx.TypeProto]) -> GradientBlock:
    """The shortest path from ``source`` to one of ``targets`` and where it carries no
    gradient: a value entering a node only through inputs that carry none (a shape,
    index, axis or condition input), or a node whose output on the path is not float
    (an integer Cast, a comparison, a Shape)."""
    is_float = _may_be_float(types)
    path = shortest_path(model.graph, source, set(targets))
    if path is None:
        return GradientBlock((), -1, "no path of nodes leads from it to them")
    for at in range(1, len(path), 2):
        value, node, out = path[at - 1], path[at], path[at + 1]
        if not is_float(out):
            elem_type = types[out].tensor_type.elem_type
            kind = elem_type_name(elem_type) if elem_type else "not a tensor"
            why = not_differentiable_reason(node.op_type, node.domain)
            return GradientBlock(tuple(path), at, f"its output {out!r} is {kind}, which "
                                 "carries no gradient" + (f" ({why})" if why else ""))
        positions = differentiable_inputs(node.op_type, node.domain, len(node.input),
                                          opset=opset_version(model, node.domain))
        captured = any(value in outer_references(sub) for sub in subgraphs(node))
        if not captured and not any(node.input[p] == value for p in positions):
            where = [i for i, name in enumerate(node.input) if name == value]
            reason = (not_differentiable_reason(node.op_type, node.domain, where[0],
                                                opset_version(model, node.domain))
                      or "a shape, index, axis, count or condition input")
            return GradientBlock(tuple(path), at, (
                f"{value!r} enters it as input {', '.join(map(str, where))}, which carries no "
                f"gradient ({reason})"))
    return GradientBlock(tuple(path), -1, "every link carries a gradient")


def trainable_initializers(model: ModelLike) -> list[str]:
    """The float initializers that influence a differentiable output, in graph order.

    The outputs considered are the loss when the model has one (see
    :mod:`lossgraph.roles`), else every float output. Excluded: integer tensors
    (shapes, class lists, indices), initializers reaching the outputs only through
    non-differentiable inputs, inputs that carry gradients but are not weights
    (batch-normalization statistics, class weights of the losses, one-hot values; see
    :data:`~lossgraph.differentiability.NON_TRAINABLE_INPUTS`), and rank-0 scalars,
    which exporters use for constants (pass such a name explicitly to train it).
    """
    model = as_model(model)
    loss = get_roles(model).get("loss")
    targets = [loss] if loss else [o.name for o in model.graph.output]
    needed = differentiable_values(model, targets, trainable=True)
    return [
        t.name
        for t in model.graph.initializer
        if t.name in needed and t.data_type in FLOAT_TYPES and len(t.dims) > 0
    ]
