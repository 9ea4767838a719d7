"""Products summed over many rows split into parts summed (split-K)::

    MatMul(row[1, n], m[n, k])  ->  ReduceSum(MatMul(row[p, 1, n/p], m[p, n/p, k]), axes=0)
    Gemm(a[n, k], b[n, m], transA=1)
                   ->  ReduceSum(MatMul(Transpose(a[q, n/q, k]), b[q, n/q, m]), axes=0)

with ``p = row_product_parts(n)`` (:data:`SPLIT_ROWS` rows or more, in parts of at
least :data:`SPLIT_PART_ROWS`) and ``q = gradient_product_parts(n)``, for statically
shaped operands, in the main graph and in Scan bodies. Such products are the weight
gradients of a layer over a batch of ``n`` rows: ``a^T @ upstream``, with one column
for a one-output layer.

Why: onnxruntime computes a one-row product on one thread, and ``a^T @ b`` whose
output is small (a layer's weights) against its ``n`` rows barely threads either; split
into parts it runs the parts on all threads. Measured on 2 cores, interleaved on a quiet
machine: 12% faster linear-regression epochs at batch 1000 and 10000 (the one-row
product); the MLP 100-50-1's epochs (``x^T @ dz`` of its hidden layer in 4 parts, its bias
gradient's row of ones in 8) 0.86-0.88x the time at batch 10000 in the step and epoch
modes; at batch 1000, ``x^T @ dz`` in 2 parts was 0.66x the time alone but no faster in
the epoch (1.00-1.02x), so it is not split there. At 100 rows the extra kernels cost more
than the threads gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..builder import GraphBuilder
from ..graphs import attribute_values, is_default_domain, opset_version
from ..names import NameAuthority
from ..passes.contract import Pass, PassResult
from .scopes import static_scopes

__all__ = ["SPLIT_PARTS", "SPLIT_PART_ROWS", "SPLIT_ROWS", "SplitRowProducts",
           "gradient_product_parts", "row_product_parts"]

#: A one-row product is split when its row is this long at least (at 100 the extra
#: kernels cost more than the threads gain), into at most SPLIT_PARTS parts of at least
#: SPLIT_PART_ROWS rows each (measured best at 1000 and 10000 rows: 4 and 8 parts).
SPLIT_ROWS, SPLIT_PARTS, SPLIT_PART_ROWS = 1000, 8, 250


#: A weight-gradient product ``a^T @ b`` is split into parts of GRADIENT_PART_ROWS rows
#: at least, GRADIENT_PARTS at most: 4 parts at 10000 rows (MLP epochs 0.86-0.88x the
#: time); at 1000 rows 2 parts gained nothing in the epoch, so a part is 2500 rows at least.
GRADIENT_PARTS, GRADIENT_PART_ROWS = 4, 2500


def gradient_product_parts(rows: int) -> int | None:
    """Into how many parts ``a^T @ b`` over ``rows`` rows is split (``None``: not split):
    the most, up to GRADIENT_PARTS, that divide it into parts of GRADIENT_PART_ROWS rows
    at least, for SPLIT_ROWS rows or more."""
    return _most_parts(rows, GRADIENT_PARTS, GRADIENT_PART_ROWS)


def row_product_parts(rows: int) -> int | None:
    """Into how many parts a one-row product over ``rows`` rows is split (``None``: not
    split): the most, up to SPLIT_PARTS, that divide it into parts of SPLIT_PART_ROWS
    rows at least, for SPLIT_ROWS rows or more."""
    return _most_parts(rows, SPLIT_PARTS, SPLIT_PART_ROWS)


def _most_parts(rows: int, most: int, least_rows: int) -> int | None:
    """The most parts, up to ``most``, of ``least_rows`` rows at least that divide
    ``rows`` (of SPLIT_ROWS or more); ``None`` if none."""
    if rows < SPLIT_ROWS:
        return None
    return next((parts for parts in range(most, 1, -1)
                 if rows % parts == 0 and rows // parts >= least_rows), None)


@dataclass(frozen=True)
class SplitRowProducts(Pass[None]):
    """Long one-row ``MatMul`` and ``Gemm(transA=1)`` of static shapes as sums of batched
    parts (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        # data propagation: a row of ones built from a constant shape (SumRowsByProduct)
        # has a static shape
        scopes = static_scopes(model)
        names = NameAuthority.for_model(model)
        opset = opset_version(model) or onnx.defs.onnx_opset_version()
        changed = False
        for graph, static in scopes:
            changed |= _split(graph, static, names, opset)
        return PassResult(model, changed=changed)


def _parts(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Into how many parts ``node`` is split: ``None`` unless it is
    ``MatMul(row[1, n], m[n, k])`` or ``Gemm(a[n, k], b[n, m], transA=1)`` (no bias,
    ``alpha`` 1, ``b`` not transposed) with n long and divisible into enough parts."""
    if not is_default_domain(node.domain) or node.op_type not in ("MatMul", "Gemm"):
        return None
    operands = [shapes.get(name) for name in node.input]
    if len(operands) != 2 or any(s is None or len(s) != 2 for s in operands):
        return None
    left, right = operands
    if node.op_type == "MatMul":
        return row_product_parts(right[0]) if left[0] == 1 else None
    attributes = attribute_values(node)
    if (attributes.get("transA") != 1 or attributes.get("transB", 0) != 0
            or attributes.get("alpha", 1.0) != 1.0 or left[0] != right[0]):
        return None
    return gradient_product_parts(left[0])


def _split(graph: onnx.GraphProto, shapes: dict[str, list[int]], names: NameAuthority,
           opset: int) -> bool:
    """Split every long product of ``graph`` (:func:`_parts`) in place; True if any."""
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        parts = _parts(node, shapes)
        if parts is None:
            rebuilt.append(node)
            continue
        left, right = node.input
        rows, columns = shapes[right]
        g = GraphBuilder(names, opset, prefix=f"{node.name}/split/")
        if node.op_type == "MatMul":
            left = g.Reshape(left, g.ints([parts, 1, rows // parts], "shape"))
        else:  # a^T: each part transposed (onnxruntime fuses it into the product)
            left = g.Transpose(g.Reshape(left, g.ints([parts, rows // parts, shapes[left][1]],
                                                      "shape")), perm=[0, 2, 1])
        products = g.MatMul(left, g.Reshape(right, g.ints([parts, rows // parts, columns],
                                                          "shape")),
                            hint="part_products")
        g.rename(g.reduce("ReduceSum", products, [0], keepdims=0), node.output[0], uses=False)
        graph.initializer.extend(g.initializers)
        rebuilt += g.nodes
    if len(rebuilt) == len(graph.node):
        return False
    graph.ClearField("node")
    graph.node.extend(rebuilt)
    return True
