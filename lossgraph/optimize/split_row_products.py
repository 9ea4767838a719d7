"""A long one-row product split into parts summed (split-K)::

    MatMul(row[1, n], m[n, k])  ->  ReduceSum(MatMul(row[p, 1, n/p], m[p, n/p, k]), axes=0)

with ``p = row_product_parts(n)`` (:data:`SPLIT_ROWS` rows or more, in parts of at
least :data:`SPLIT_PART_ROWS`), for statically shaped operands, in the main graph and
in Scan bodies. Such a product is the weight gradient of a one-output layer over a
batch of ``n`` rows.

Why: onnxruntime computes a one-row product on one thread; split into ``p`` parts it
uses them all (12% faster linear-regression epochs at batch 1000 and 10000). At 100
rows the extra kernels cost more than the threads gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..builder import GraphBuilder
from ..graphs import known_shapes, opset_version
from ..names import NameAuthority
from ..passes.contract import Pass, PassResult
from .scopes import main_and_scan_bodies

__all__ = ["SPLIT_PARTS", "SPLIT_PART_ROWS", "SPLIT_ROWS", "SplitRowProducts",
           "row_product_parts"]

#: A one-row product is split when its row is this long at least (at 100 the extra
#: kernels cost more than the threads gain), into at most SPLIT_PARTS parts of at least
#: SPLIT_PART_ROWS rows each (measured best at 1000 and 10000 rows: 4 and 8 parts).
SPLIT_ROWS, SPLIT_PARTS, SPLIT_PART_ROWS = 1000, 8, 250


def row_product_parts(rows: int) -> int | None:
    """Into how many parts a one-row product over ``rows`` rows is split (``None``: not
    split): the most, up to SPLIT_PARTS, that divide it into parts of SPLIT_PART_ROWS
    rows at least, for SPLIT_ROWS rows or more."""
    if rows < SPLIT_ROWS:
        return None
    return next((parts for parts in range(SPLIT_PARTS, 1, -1)
                 if rows % parts == 0 and rows // parts >= SPLIT_PART_ROWS), None)


@dataclass(frozen=True)
class SplitRowProducts(Pass):
    """Long one-row ``MatMul`` of static shapes as a sum of batched parts (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        inferred = onnx.shape_inference.infer_shapes(model)
        names = NameAuthority.for_model(model)
        opset = opset_version(model) or onnx.defs.onnx_opset_version()
        changed = False
        for graph, shaped in main_and_scan_bodies(model, inferred):
            static = {name: shape for name, shape in known_shapes(shaped).items()
                      if None not in shape}
            changed |= _split(graph, static, names, opset)
        return PassResult(model, changed=changed)


def _parts(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Into how many parts ``node`` is split: ``None`` unless it is
    ``MatMul(row[1, n], m[n, k])`` with n long and divisible into enough parts."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    row, matrix = (shapes.get(name) for name in node.input)
    if row is None or matrix is None or len(row) != 2 or len(matrix) != 2 or row[0] != 1:
        return None
    return row_product_parts(matrix[0])


def _split(graph: onnx.GraphProto, shapes: dict[str, list[int]], names: NameAuthority,
           opset: int) -> bool:
    """Split every long one-row ``MatMul`` of ``graph`` in place; True if any."""
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        parts = _parts(node, shapes)
        if parts is None:
            rebuilt.append(node)
            continue
        row, matrix = node.input
        rows, columns = shapes[matrix]
        g = GraphBuilder(names, opset, prefix=f"{node.name}/split/")
        products = g.MatMul(g.Reshape(row, g.ints([parts, 1, rows // parts], "shape")),
                            g.Reshape(matrix, g.ints([parts, rows // parts, columns], "shape")),
                            hint="part_products")
        g.rename(g.reduce("ReduceSum", products, [0], keepdims=0), node.output[0], uses=False)
        graph.initializer.extend(g.initializers)
        rebuilt += g.nodes
    if len(rebuilt) == len(graph.node):
        return False
    graph.ClearField("node")
    graph.node.extend(rebuilt)
    return True
