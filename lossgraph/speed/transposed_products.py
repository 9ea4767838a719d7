"""A transposed product written as the product of the transposes::

    Transpose(Gemm(a, b, transA=i, transB=j))  ->  Gemm(b, a, transA=1-j, transB=1-i)

for a ``Gemm`` without a ``C`` input whose output only that ``Transpose`` (``perm=[1, 0]``)
reads, in the main graph and in Scan bodies. ``(a b)^T = b^T a^T``: each element is the
same products summed over the same axis.

Why: an export that keeps a layer's ``Transpose(W)`` (torch's legacy exporter without
constant folding, as lossgraph advises) has its weight's gradient come out of the backward
as ``Transpose(x^T @ upstream)``. onnxruntime fuses that ``Transpose`` into a node of its
own, and its execution order (a depth-first walk back from the graph's leaves, the node
of the highest index first) then no longer follows the order
:class:`~lossgraph.passes.recompute.UpdatesInBackwardOrder` gave the gradients: it runs
every weight's gradient after the whole backward, holding the activations and activation
gradients they read to the end. Measured on BERT-base's separate gradient session (batch
8 x 128, one thread): 1,220 MiB above the baseline with the ``Transpose``, 855 without
(the folded export's: 845), the outputs the same bit for bit; and one weight-sized
temporary and one transpose kernel fewer for each such weight in every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import onnx
from onnx import helper

from ..graphs import attribute_values, is_default_domain, node_reads
from ..passes.contract import Pass, PassResult
from .rewriting import drop_unread
from .scopes import main_and_scan_bodies

__all__ = ["TransposedProducts"]


@dataclass(frozen=True)
class TransposedProducts(Pass[None]):
    """``Transpose(Gemm(a, b))`` as ``Gemm(b, a)`` with the operands' transposes swapped
    (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        changed = False
        for graph, _ in main_and_scan_bodies(model, model, nested=True):
            changed |= _swap(graph)
        return PassResult(model, changed=changed)


def _swap(graph: onnx.GraphProto) -> bool:
    """Rewrite ``graph``'s transposed products in place; True if any."""
    readers = Counter(v for node in graph.node for v in node_reads(node))
    outputs = {o.name for o in graph.output}
    producer = {node.output[0]: node for node in graph.node if node.output}
    unread: set[str] = set()  # the products the swapped nodes no longer read
    for index, node in enumerate(graph.node):
        product = producer.get(node.input[0]) if node.input else None
        if not (is_default_domain(node.domain) and node.op_type == "Transpose"
                and list(attribute_values(node).get("perm", [1, 0])) == [1, 0]
                and product is not None and is_default_domain(product.domain)
                and product.op_type == "Gemm" and len(product.input) == 2
                and readers[product.output[0]] == 1 and product.output[0] not in outputs):
            continue
        attributes = attribute_values(product)
        swapped = helper.make_node(
            "Gemm", [product.input[1], product.input[0]], [node.output[0]], name=node.name,
            transA=1 - int(attributes.get("transB", 0)),
            transB=1 - int(attributes.get("transA", 0)),
            alpha=float(attributes.get("alpha", 1.0)))
        unread.add(node.input[0])
        graph.node[index].CopyFrom(swapped)
    drop_unread(graph, unread)
    return bool(unread)
