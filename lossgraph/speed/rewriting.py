"""What the optimization passes' rewrites share: constant integers of a graph, replacing
nodes by what a builder emits, and removing what a rewrite left unread (the nodes that
computed only for the replaced ones)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from ..builder import GraphBuilder
from ..graphs import node_reads

__all__ = ["constant_ints", "drop_unread", "replace_nodes"]


def constant_ints(graph: onnx.GraphProto, name: str) -> list[int] | None:
    """The value of ``name`` as a flat list of ints when an initializer or a ``Constant``
    node of ``graph`` holds it, else None."""
    for tensor in graph.initializer:
        if tensor.name == name:
            return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name and node.attribute:
            value = numpy_helper.to_array(node.attribute[0].t)
            return [int(v) for v in np.asarray(value).reshape(-1)]
    return None


def drop_unread(graph: onnx.GraphProto, replaced: set[str]) -> None:
    """Remove, in place, the nodes of ``graph`` that produced a value of ``replaced`` (the
    values a rewrite no longer reads) and that nothing reads any more, then the nodes that
    fed only those, and so on; initializers that only they read go too. A node with an
    output that is still read, or a graph output, stays. One walk over readers counted
    once, and the node list rebuilt once (a step graph's copies are memory the allocator
    keeps)."""
    if not replaced:
        return
    outputs = {o.name for o in graph.output}
    nodes = list(graph.node)
    readers = Counter(v for node in nodes for v in node_reads(node))
    producer = {o: i for i, node in enumerate(nodes) for o in node.output if o}
    fed = {v.name for v in graph.input}  # an initializer that is an input stays declared
    initial = {t.name for t in graph.initializer} - fed
    dropped: set[int] = set()
    unread: set[str] = set()
    stack = list(replaced)
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in dropped or any(
                readers[o] or o in outputs for o in nodes[i].output if o):
            continue
        dropped.add(i)
        for value in node_reads(nodes[i]):
            readers[value] -= 1
            if value in producer:
                stack.append(value)
            elif value in initial and not readers[value] and value not in outputs:
                unread.add(value)
    if dropped:
        kept = [node for i, node in enumerate(nodes) if i not in dropped]
        graph.ClearField("node")
        graph.node.extend(kept)
    if unread:
        kept_tensors = [t for t in graph.initializer if t.name not in unread]
        del graph.initializer[:]
        graph.initializer.extend(kept_tensors)


def replace_nodes(graph: onnx.GraphProto, g: GraphBuilder,
                  emit: Callable[[onnx.NodeProto], Iterable[str] | None]) -> bool:
    """Rebuild ``graph``'s node list in place. ``emit(node)`` either returns None (the node
    stays) or appends to ``g`` the nodes that compute the node's outputs in its stead and
    returns the values the replaced computation no longer reads; those go with what only
    they fed (:func:`drop_unread`), and ``g``'s constants join the graph. True if any node
    was replaced."""
    rebuilt: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    for node in graph.node:
        emitted = len(g.nodes)
        unread = emit(node)
        if unread is None:
            rebuilt.append(node)
            continue
        rebuilt += g.nodes[emitted:]
        replaced.update(unread)
    if not replaced:
        return False
    graph.ClearField("node")
    graph.node.extend(rebuilt)
    graph.initializer.extend(g.initializers)
    drop_unread(graph, replaced)
    return True

