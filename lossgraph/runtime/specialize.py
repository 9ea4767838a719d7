"""Batch specialization: a training graph as onnxruntime should run it for one batch size.

A program's ``train_step`` and ``train_epoch`` graphs serve every batch size: a step
takes a batch of symbolic size and recomputes shapes every time (the mean's count,
the ones row that sums a bias gradient over the batch). For the one batch size a fit
uses they are constants:

    batch input  x[N, ...]  ->  x[batch, ...]    (the scanned inputs of an epoch graph's
                                                 Scan; a step graph's own data inputs)
    Shape(v), Size(v)                ->  Constant      where v's shape is then static
    Reshape(v, s) -> Identity(v)                       where v already has the shape s

after which onnxruntime's constant folding takes the rest of the shape arithmetic
(``Cast``, ``Div``, ``Concat``, ``ConstantOfShape``, ``Expand`` of constants) out of
every step. With the shapes known, one product is rewritten for speed:

    MatMul(row[1, n], m[n, k])  ->  ReduceSum(MatMul(row[p, 1, n/p], m[p, n/p, k]), 0)

for a long row (n >= 1000 rows of a batch: the weight gradient of a one-output layer).
onnxruntime computes a one-row product on one thread; split into ``p`` parts it uses
them all (12% faster linear-regression epochs at batch 1000 and 10000).

The result is for running, not for saving: the program keeps its general graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder import GraphBuilder
from ..graphs import known_shapes, opset_version, subgraphs
from ..names import NameAuthority

__all__ = ["row_product_parts", "specialize_batch"]


def specialize_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy of the training graph ``model`` whose steps take batches of ``batch`` rows.

    In an epoch graph (one with a ``Scan``) the Scan's batches get the static size and
    its body is folded; in a step graph, the inputs of symbolic leading dimension (the
    data) and the graph itself.
    """
    specialized = onnx.ModelProto()
    specialized.CopyFrom(model)
    scans = [i for i, node in enumerate(specialized.graph.node) if node.op_type == "Scan"]
    if scans:
        for i in scans:
            scan = specialized.graph.node[i]
            scanned = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
            body_inputs = next(subgraphs(scan)).input  # a Scan holds one graph: its body
            _fix_leading_dim(body_inputs[len(body_inputs) - scanned:], batch)
    else:
        _fix_leading_dim(specialized.graph.input, batch)
    changed = True
    while changed:  # a folded Shape can make more shapes static (Expand, Reshape by it)
        inferred = onnx.shape_inference.infer_shapes(specialized)
        pairs = ([(next(subgraphs(specialized.graph.node[i])),
                   next(subgraphs(inferred.graph.node[i]))) for i in scans]
                 or [(specialized.graph, inferred.graph)])
        statics = [{name: shape for name, shape in known_shapes(shaped).items()
                    if None not in shape} for _, shaped in pairs]
        changed = False
        for (graph, _), static in zip(pairs, statics):
            changed |= _fold_static_shapes(graph, static)
    names = NameAuthority.for_model(specialized)
    opset = opset_version(specialized) or onnx.defs.onnx_opset_version()
    for (graph, _), static in zip(pairs, statics):
        _split_row_products(graph, static, names, opset)
    return specialized


def _fix_leading_dim(values, batch: int) -> None:
    """Give every value of symbolic leading dimension (a batch, not a scalar or a weight)
    the leading dimension ``batch``."""
    for value in values:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].Clear()
            dims[0].dim_value = batch


def _fold_static_shapes(graph: onnx.GraphProto, shapes: dict[str, list[int]]) -> bool:
    """Replace ``Shape`` and ``Size`` of statically shaped values by constants, and
    ``Reshape`` to the shape a value already has by ``Identity``, in place; True if any."""
    changed = False
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Shape", "Size", "Reshape") or node.input[0] not in shapes:
            continue
        shape = shapes[node.input[0]]
        if node.op_type == "Reshape":
            if shapes.get(node.output[0]) == shape:
                identity = helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                            name=node.name)
                graph.node[index].CopyFrom(identity)
                changed = True
            continue
        if node.op_type == "Size":
            value = np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
        else:
            attributes = {a.name: a.i for a in node.attribute}
            start, end = attributes.get("start", 0), attributes.get("end", len(shape))
            value = np.array(shape[slice(start, end)], np.int64)  # negative: from the end
        constant = helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                    value=numpy_helper.from_array(value))
        graph.node[index].CopyFrom(constant)
        changed = True
    return changed


#: A one-row product is split when its row is this long at least (at 100 the extra
#: kernels cost more than the threads gain), into at most SPLIT_PARTS parts of at least
#: SPLIT_PART_ROWS rows each (measured best at 1000 and 10000 rows: 4 and 8 parts).
SPLIT_ROWS, SPLIT_PARTS, SPLIT_PART_ROWS = 1000, 8, 250


def _row_product_parts(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """Into how many parts :func:`_split_row_products` splits ``node``: ``None`` unless
    it is ``MatMul(row[1, n], m[n, k])`` with n long and divisible into enough parts."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    row, matrix = (shapes.get(name) for name in node.input)
    if row is None or matrix is None or len(row) != 2 or len(matrix) != 2 or row[0] != 1:
        return None
    return row_product_parts(matrix[0])


def row_product_parts(rows: int) -> int | None:
    """Into how many parts a one-row product over ``rows`` rows is split (``None``: not
    split): the most, up to SPLIT_PARTS, that divide it into parts of SPLIT_PART_ROWS
    rows at least, for SPLIT_ROWS rows or more."""
    if rows < SPLIT_ROWS:
        return None
    return next((parts for parts in range(SPLIT_PARTS, 1, -1)
                 if rows % parts == 0 and rows // parts >= SPLIT_PART_ROWS), None)


def _split_row_products(graph: onnx.GraphProto, shapes: dict[str, list[int]],
                        names: NameAuthority, opset: int) -> None:
    """Rewrite, in place, every long one-row ``MatMul`` of ``graph`` as a batched
    ``MatMul`` over parts of its rows and a ``ReduceSum`` of the parts (split-K)."""
    rebuilt: list[onnx.NodeProto] = []
    for node in graph.node:
        parts = _row_product_parts(node, shapes)
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
    if len(rebuilt) != len(graph.node):
        graph.ClearField("node")
        graph.node.extend(rebuilt)
