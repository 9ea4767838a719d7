"""Queries over ONNX graphs: node attributes, subgraphs, the names used anywhere, the
values a graph reads from outside, who reads a value, shortest paths.

Passes never walk protobufs by hand: they ask here (and :class:`~lossgraph.graphs.GraphIndex`
for the producers and readers of a graph's values).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .held import tensor_array

__all__ = ["attribute_values", "attribute_value", "constant_value", "subgraphs", "all_graphs",
           "names_in_graph", "values_read", "outer_references",
           "initializer_arrays", "known_shapes", "TORCH_NAME_SCOPES", "torch_name_scopes"]

#: Where torch's exporter records the module scopes a node came from, outermost first.
TORCH_NAME_SCOPES = "pkg.torch.onnx.name_scopes"


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


def torch_name_scopes(node: onnx.NodeProto) -> list[str]:
    """The module scopes torch's exporter recorded for ``node``, outermost first
    (``"['', 'layer1', 'layer1.0']"`` as its strings); empty where it recorded none."""
    text = next((p.value for p in node.metadata_props if p.key == TORCH_NAME_SCOPES), "")
    return re.findall(r"'([^']*)'", text)


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


def captured_values(node: onnx.NodeProto) -> list[str]:
    """The outer values ``node``'s subgraphs read, in a stable order."""
    return list(dict.fromkeys(n for sub in subgraphs(node) for n in sorted(outer_references(sub))))


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads: its inputs, then what its subgraphs capture."""
    return [i for i in node.input if i] + captured_values(node)


def constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """A ``Constant`` node's value: its ``value`` tensor, or its ``value_int(s)`` (int64)
    or ``value_float(s)`` (float32); None for another kind (a sparse or string value)."""
    for attribute in node.attribute:
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name in ("value_float", "value_int", "value_floats", "value_ints"):
            return np.array(helper.get_attribute_value(attribute),
                            np.int64 if "int" in attribute.name else np.float32)
    return None


def initializer_arrays(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's initializers as numpy arrays, by name."""
    return {t.name: tensor_array(t) for t in graph.initializer}


def known_shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """The shape of every input, output and ``value_info`` of ``graph`` whose rank is
    known: a dimension is its size, or ``None`` when symbolic or unknown."""
    return {v.name: [d.dim_value if d.HasField("dim_value") else None
                     for d in v.type.tensor_type.shape.dim]
            for v in (*graph.input, *graph.value_info, *graph.output)
            if v.type.tensor_type.HasField("shape")}
