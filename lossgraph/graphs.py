"""Queries over ONNX graphs shared by every pass, and the one in-place rewrite they share.

Passes never walk protobufs by hand: they ask here for subgraphs, value types and
the names used anywhere in a model (subgraphs included), and rename values with
:func:`rename_values`, which keeps every reference consistent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "FLOAT_TYPES",
    "subgraphs",
    "all_graphs",
    "names_in_graph",
    "outer_references",
    "consumers",
    "stored_tensors",
    "shortest_path",
    "value_types",
    "elem_type_name",
    "np_dtype",
    "opset_version",
    "initializer_arrays",
    "rename_values",
]

#: Element types lossgraph differentiates and trains.
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held by a node's attributes (If branches, Loop and Scan bodies)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in it, depth first."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def names_in_graph(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name used in ``graph`` or any nested graph."""
    names: set[str] = set()
    for g in all_graphs(graph):
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        names.update(t.values.name for t in g.sparse_initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
            names.add(node.name)
    names.discard("")
    return names


def values_read(graph: onnx.GraphProto) -> set[str]:
    """Every value a node of ``graph``, or of a graph nested in it, takes as input."""
    read = {name for g in all_graphs(graph) for node in g.node for name in node.input}
    read.discard("")
    return read


def outer_references(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads without defining them: values captured from outer scopes."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(i for i in node.input if i and i not in defined)
        for sub in subgraphs(node):
            used.update(n for n in outer_references(sub) if n not in defined)
        defined.update(node.output)
    used.update(o.name for o in graph.output if o.name not in defined)
    return used


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The nodes of ``graph`` that read each value, as an input or captured by a subgraph."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        captured = (n for sub in subgraphs(node) for n in sorted(outer_references(sub)))
        for name in dict.fromkeys([*node.input, *captured]):
            if name:
                readers.setdefault(name, []).append(node)
    return readers


def shortest_path(graph: onnx.GraphProto, source: str,
                  targets: Container[str]) -> list[str | onnx.NodeProto] | None:
    """``[source, node, value, node, ..., target]``: the shortest chain of nodes by which
    ``source`` reaches one of ``targets`` (breadth first), or None when it reaches none."""
    readers = consumers(graph)
    parents: dict[str, tuple[str, onnx.NodeProto] | None] = {source: None}
    queue = deque([source])
    while queue:
        value = queue.popleft()
        if value in targets:
            path: list[str | onnx.NodeProto] = [value]
            while parents[value] is not None:
                value, node = parents[value]
                path[:0] = [value, node]
            return path
        for node in readers.get(value, []):
            for out in node.output:
                if out and out not in parents:
                    parents[out] = (value, node)
                    queue.append(out)
    return None


def stored_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor the model stores, which onnx may keep in external files: initializers
    (sparse ones' values too) and attribute tensors, of the graph and its subgraphs."""
    for graph in all_graphs(model.graph):
        yield from graph.initializer
        yield from (sparse.values for sparse in graph.sparse_initializer)
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The type of every top-level value of ``model`` that shape inference can tell."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type for v in (*graph.value_info, *graph.input, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(
            tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        )
    return types


def known_shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """The shape of every input, output and ``value_info`` of ``graph`` whose rank is
    known: a dimension is its size, or ``None`` when symbolic or unknown."""
    return {v.name: [d.dim_value if d.HasField("dim_value") else None
                     for d in v.type.tensor_type.shape.dim]
            for v in (*graph.input, *graph.value_info, *graph.output)
            if v.type.tensor_type.HasField("shape")}


def elem_type_name(elem_type: int) -> str:
    """'float', 'double', 'int64'... for an ONNX element type."""
    return helper.tensor_dtype_to_string(elem_type).replace("TensorProto.", "").lower()


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type."""
    return helper.tensor_dtype_to_np_dtype(elem_type)


def opset_version(model: onnx.ModelProto, domain: str = "") -> int | None:
    """The version of ``domain`` the model imports (``None`` when it does not)."""
    aliases = {"", "ai.onnx"} if domain in ("", "ai.onnx") else {domain}
    versions = [op.version for op in model.opset_import if op.domain in aliases]
    return max(versions) if versions else None


def initializer_arrays(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's initializers as numpy arrays, by name."""
    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}


def rename_values(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Rename values in place everywhere they are defined or used, subgraphs included.

    A subgraph that defines a value of the same name (shadowing) keeps its own.
    """
    if not mapping:
        return
    for value in (*graph.input, *graph.output, *graph.value_info):
        value.name = mapping.get(value.name, value.name)
    for tensor in graph.initializer:
        tensor.name = mapping.get(tensor.name, tensor.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = mapping.get(sparse.values.name, sparse.values.name)
    for node in graph.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]
        node.output[:] = [mapping.get(o, o) for o in node.output]
        for sub in subgraphs(node):
            local = {v.name for v in sub.input} | {t.name for t in sub.initializer}
            local |= {o for n in sub.node for o in n.output}
            rename_values(sub, {k: v for k, v in mapping.items() if k not in local})
