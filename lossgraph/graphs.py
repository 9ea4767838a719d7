"""Queries over ONNX graphs shared by every pass, and the one in-place rewrite they share.

Passes never walk protobufs by hand: they ask here for subgraphs, node attributes,
what shape inference knows of a model's values (:class:`ForwardFacts`) and the names
used anywhere in a model (subgraphs included), and rename values with
:func:`rename_values`, which keeps every reference consistent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "FLOAT_TYPES",
    "Shape",
    "ForwardFacts",
    "attribute_values",
    "attribute_value",
    "subgraphs",
    "all_graphs",
    "names_in_graph",
    "outer_references",
    "consumers",
    "stored_tensors",
    "shortest_path",
    "elem_type_name",
    "np_dtype",
    "opset_version",
    "initializer_arrays",
    "rename_values",
]

#: Element types lossgraph differentiates and trains.
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})

#: A static shape: ints for known dims, strings for symbolic ones, None for unknown.
Shape = tuple[int | str | None, ...]


def attribute_values(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes by name as Python values: a single string decoded (UTF-8,
    undecodable bytes replaced, so a bad value reaches the caller's own check), string
    lists kept as bytes (class labels are bytes in string tensors)."""
    return {attribute.name: _decoded(helper.get_attribute_value(attribute))
            for attribute in node.attribute}


def attribute_value(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The attribute ``name`` of ``node`` as :func:`attribute_values` gives it, or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            return _decoded(helper.get_attribute_value(attribute))
    return default


def _decoded(value: Any) -> Any:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


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


@dataclass(frozen=True)
class ForwardFacts:
    """What a model tells about its top-level values: types and shapes from shape
    inference (with data propagation, and the static ranks it leaves unknown, see
    :func:`_with_known_ranks`), constant values, and the nodes reading each value.

    Analyses read ``types``; the gradient walker and its rules read all of it.
    """

    types: dict[str, onnx.TypeProto]
    #: value -> (op type, outputs) of each node that reads it
    readers: dict[str, list[tuple[str, list[str]]]]
    _graph: onnx.GraphProto = field(repr=False, compare=False)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ForwardFacts:
        inferred = _with_known_ranks(onnx.shape_inference.infer_shapes(model, data_prop=True))
        graph = inferred.graph
        readers: dict[str, list[tuple[str, list[str]]]] = {}
        for node in graph.node:
            for name in dict.fromkeys(node.input):
                readers.setdefault(name, []).append((node.op_type, list(node.output)))
        return cls(_declared_types(graph), readers, graph)

    @cached_property
    def elem_types(self) -> dict[str, int]:
        """The element type of every tensor value."""
        return {name: t.tensor_type.elem_type for name, t in self.types.items()
                if t.HasField("tensor_type")}

    @cached_property
    def shapes(self) -> dict[str, Shape]:
        """The shape of every tensor value of known rank (see :data:`Shape`)."""
        return {name: tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                            for d in t.tensor_type.shape.dim)
                for name, t in self.types.items()
                if t.HasField("tensor_type") and t.tensor_type.HasField("shape")}

    @cached_property
    def constants(self) -> dict[str, np.ndarray]:
        """The value of every initializer and ``Constant`` output (read on first use:
        analyses that need types only never copy the weights)."""
        constants = initializer_arrays(self._graph)
        for node in self._graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = _constant_node_value(node)
                if value is not None:
                    constants[node.output[0]] = value
        return constants


def _declared_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """The type of every value ``graph`` declares: value_info, inputs, outputs, initializers."""
    types = {v.name: v.type for v in (*graph.value_info, *graph.input, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(
            tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        )
    return types


def _with_known_ranks(inferred: onnx.ModelProto, rounds: int = 4) -> onnx.ModelProto:
    """``inferred`` with ranks onnx's shape inference leaves unknown although they are
    static: a Reshape to a computed target (``Reshape(t, Shape(x))``) has the target's
    length as its rank, and a reduction over computed axes with ``keepdims=1`` keeps
    its input's rank. Each round declares those ranks and infers again, so that the
    ops after them get shapes too."""
    for _ in range(rounds):
        graph = inferred.graph
        known = _declared_types(graph)
        ranked = []
        for node in graph.node:
            out = node.output[0] if node.output else ""
            if node.domain not in ("", "ai.onnx") or not out or (
                    out in known and known[out].tensor_type.HasField("shape")):
                continue
            rank = _static_rank(node, known)
            data = known.get(node.input[0]) if node.input else None
            if rank is not None and data is not None:
                ranked.append(helper.make_tensor_value_info(
                    out, data.tensor_type.elem_type, [None] * rank))
        if not ranked:
            break
        declared = onnx.ModelProto()
        declared.CopyFrom(inferred)
        kept = [v for v in declared.graph.value_info if v.name not in {r.name for r in ranked}]
        del declared.graph.value_info[:]
        declared.graph.value_info.extend([*kept, *ranked])
        inferred = onnx.shape_inference.infer_shapes(declared, data_prop=True)
    return inferred


def _static_rank(node: onnx.NodeProto, known: Mapping[str, onnx.TypeProto]) -> int | None:
    """The rank of a Reshape or keepdims reduction's output, when static (see above)."""
    def dims(name: str):
        value = known.get(name)
        shape = value.tensor_type.shape if value is not None else None
        return shape.dim if shape is not None and value.tensor_type.HasField("shape") else None

    if node.op_type == "Reshape":
        target = dims(node.input[1])
        if target is not None and len(target) == 1 and target[0].HasField("dim_value"):
            return target[0].dim_value
    elif node.op_type.startswith("Reduce") and attribute_value(node, "keepdims", 1):
        data = dims(node.input[0])
        return len(data) if data is not None else None
    return None


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attribute in node.attribute:
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name in ("value_float", "value_int", "value_floats", "value_ints"):
            return np.array(helper.get_attribute_value(attribute))
    return None


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
