"""The graphs of a model the speed rewrites work in: the main graph and each Scan body
(for the static shapes a fit's batch size gives, the Scans' bodies inside those too).

An epoch graph runs its training step as a ``Scan`` body, so a rewrite for onnxruntime
must reach into it; other subgraphs (``If`` branches, ``Loop`` bodies) run rarely and
are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from ..graphs import (
    ForwardFacts,
    all_graphs,
    infer_shapes_with_data,
    known_shapes,
    opset_version,
    subgraphs,
)
from ..names import NameAuthority
from ..passes.contract import PassResult

__all__ = ["main_and_scan_bodies", "rewrite_typed_scopes", "static_scopes", "typed_scopes"]

#: rewrites one graph in place, given its shapes and element types, the model's name
#: authority and opset; True if it changed anything
ScopeRewrite = Callable[[onnx.GraphProto, dict[str, list], dict[str, int], NameAuthority, int],
                        bool]


def main_and_scan_bodies(model: onnx.ModelProto, inferred: onnx.ModelProto,
                         nested: bool = False) -> list[tuple[onnx.GraphProto, onnx.GraphProto]]:
    """``(graph, the same graph in inferred)`` for the body of each Scan of ``model`` and
    its main graph, in that order (rewriting the main graph's node list copies the bodies
    its nodes hold); ``inferred`` is ``model`` after shape inference. With ``nested``, the
    bodies of the Scans in those bodies too, before them (an epoch graph that accumulates
    gradients runs its micro-batches in a Scan in the Scan over updates)."""
    return [*_bodies(model.graph, inferred.graph, nested), (model.graph, inferred.graph)]


def _bodies(graph: onnx.GraphProto, inferred: onnx.GraphProto, nested: bool
            ) -> list[tuple[onnx.GraphProto, onnx.GraphProto]]:
    found = []
    for node, shaped in zip(graph.node, inferred.node):
        if node.op_type == "Scan":
            body, shaped_body = next(subgraphs(node)), next(subgraphs(shaped))  # one graph
            if nested:
                found += _bodies(body, shaped_body, nested)
            found.append((body, shaped_body))
    return found


def static_scopes(model: onnx.ModelProto) -> list[tuple[onnx.GraphProto, dict[str, list[int]]]]:
    """``(graph, the static shapes of its values)`` for each graph of
    :func:`main_and_scan_bodies`, from shape inference with data propagation, which
    resolves shapes computed from ``Shape`` values
    (:func:`~lossgraph.graphs.infer_shapes_with_data`: an epoch graph's packed weights
    cost it nothing)."""
    inferred = infer_shapes_with_data(model)
    return [(graph, {name: shape for name, shape in known_shapes(shaped).items()
                     if None not in shape})
            for graph, shaped in main_and_scan_bodies(model, inferred, nested=True)]


def typed_scopes(model: onnx.ModelProto, symbolic: bool = False
                 ) -> list[tuple[onnx.GraphProto, dict[str, int], dict[str, list]]]:
    """``(graph, element types, shapes)`` for each graph of :func:`main_and_scan_bodies`,
    from onnx's shape inference, the main graph's from
    :class:`~lossgraph.graphs.ForwardFacts` (data propagation too). A dim is its size, or
    ``None`` when unknown; a symbolic dim is its symbol with ``symbolic``, else ``None``."""
    inferred = onnx.shape_inference.infer_shapes(model)
    facts = ForwardFacts.of(model)
    scopes = []
    for graph, shaped in main_and_scan_bodies(model, inferred):
        types = {v.name: v.type.tensor_type.elem_type
                 for v in (*shaped.input, *shaped.value_info, *shaped.output)}
        shapes: dict[str, list] = dict(known_shapes(shaped))
        if graph is model.graph:
            types.update(facts.elem_types)
            shapes.update((name, [d if symbolic or isinstance(d, int) else None for d in shape])
                          for name, shape in facts.shapes.items())
        scopes.append((graph, types, shapes))
    return scopes



def rewrite_typed_scopes(model: onnx.ModelProto, op_type: str, symbolic: bool,
                         rewrite: ScopeRewrite) -> PassResult:
    """A speed pass's body: ``rewrite`` each of :func:`typed_scopes` (``symbolic`` as
    there), when any graph of ``model`` holds an ``op_type`` node at all (else no work)."""
    if not any(n.op_type == op_type for g in all_graphs(model.graph) for n in g.node):
        return PassResult(model, changed=False)
    names = NameAuthority.for_model(model)
    opset = opset_version(model) or onnx.defs.onnx_opset_version()
    changed = False
    for graph, types, shapes in typed_scopes(model, symbolic=symbolic):
        changed |= rewrite(graph, shapes, types, names, opset)
    return PassResult(model, changed=changed)
