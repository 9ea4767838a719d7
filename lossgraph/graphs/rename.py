"""The one in-place rewrite the passes share: renaming values everywhere they are used."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from .queries import subgraphs

__all__ = ["rename_values"]


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
