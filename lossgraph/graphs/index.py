"""One index of a graph's values: which node produces each, at which position, and which
nodes read it, built once from the nodes as they are (rebuild it after an edit); and the
shortest path between values, which it answers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable

import onnx

from .queries import outer_references, subgraphs

__all__ = ["GraphIndex", "shortest_path"]


class GraphIndex:
    """The producers and readers of the values of ``nodes`` (a graph's ``node`` list, or a
    list being rebuilt; a subgraph's captured outer values count as read by the node
    holding the subgraph)."""

    def __init__(self, nodes: Iterable[onnx.NodeProto]) -> None:
        self._producers: dict[str, tuple[int, onnx.NodeProto]] = {}
        self._readers: dict[str, list[onnx.NodeProto]] = {}
        for position, node in enumerate(nodes):
            for output in node.output:
                if output:
                    self._producers[output] = (position, node)
            for name in dict.fromkeys([*node.input, *(n for sub in subgraphs(node)
                                                      for n in sorted(outer_references(sub)))]):
                if name:
                    self._readers.setdefault(name, []).append(node)

    def producer(self, value: str) -> onnx.NodeProto | None:
        """The node producing ``value``; None for a graph input, an initializer or a name the
        graph does not have."""
        found = self._producers.get(value)
        return found[1] if found else None

    def position(self, value: str) -> int | None:
        """The position in ``graph.node`` of the node producing ``value``, or None."""
        found = self._producers.get(value)
        return found[0] if found else None

    def readers(self, value: str) -> list[onnx.NodeProto]:
        """The nodes reading ``value``, in graph order (as an input or captured by a
        subgraph)."""
        return list(self._readers.get(value, ()))

    def read_once(self, value: str) -> onnx.NodeProto | None:
        """The one node reading ``value``, or None when none or several do."""
        readers = self._readers.get(value, ())
        return readers[0] if len(readers) == 1 else None

    def produced(self) -> Iterable[str]:
        """Every value a node of the graph produces."""
        return self._producers.keys()


def shortest_path(graph: onnx.GraphProto, source: str, targets: Container[str],
                  within: Container[str] | None = None) -> list[str | onnx.NodeProto] | None:
    """``[source, node, value, node, ..., target]``: the shortest chain of nodes by which
    ``source`` reaches one of ``targets`` (breadth first), through values of ``within``
    only when it is given; None when it reaches none."""
    index = GraphIndex(graph.node)
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
        for node in index.readers(value):
            for out in node.output:
                if out and out not in parents and (within is None or out in within):
                    parents[out] = (value, node)
                    queue.append(out)
    return None
