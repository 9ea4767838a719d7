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
every step.

The result is for running, not for saving: the program keeps its general graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graphs import known_shapes, subgraphs

__all__ = ["specialize_batch"]


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
        changed = False
        for graph, shaped in pairs:
            static = {name: shape for name, shape in known_shapes(shaped).items()
                      if None not in shape}
            changed |= _fold_static_shapes(graph, static)
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

