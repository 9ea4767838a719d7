"""The graphs of a model the speed rewrites work in: the main graph and each Scan body.

An epoch graph runs its training step as a ``Scan`` body, so a rewrite for onnxruntime
must reach into it; other subgraphs (``If`` branches, ``Loop`` bodies) run rarely and
are left alone.
"""

from __future__ import annotations

import onnx

from ..graphs import subgraphs

__all__ = ["main_and_scan_bodies"]


def main_and_scan_bodies(model: onnx.ModelProto, inferred: onnx.ModelProto
                         ) -> list[tuple[onnx.GraphProto, onnx.GraphProto]]:
    """``(graph, the same graph in inferred)`` for the body of each Scan of ``model`` and
    its main graph, in that order (rewriting the main graph's node list copies the bodies
    its nodes hold); ``inferred`` is ``model`` after shape inference."""
    bodies = [(next(subgraphs(node)), next(subgraphs(shaped)))  # a Scan holds one graph
              for node, shaped in zip(model.graph.node, inferred.graph.node)
              if node.op_type == "Scan"]
    return [*bodies, (model.graph, inferred.graph)]
