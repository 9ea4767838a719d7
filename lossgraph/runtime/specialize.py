"""Batch specialization: an epoch graph as onnxruntime should run it for one batch size.

A program's ``train_epoch`` graph serves every batch size: its Scan hands each step
a batch of symbolic size, so the step recomputes shapes every time (the mean's
count, the ones row that sums a bias gradient over the batch). For the one batch
size a fit uses they are constants:

    Scan body data input  x[N, ...]  ->  x[batch, ...]
    Shape(v), Size(v)                ->  Constant      where v's shape is then static
    Reshape(v, s) -> Identity(v)                       where v already has the shape s

after which onnxruntime's constant folding takes the rest of the shape arithmetic
(``Cast``, ``Div``, ``Concat``, ``ConstantOfShape``, ``Expand`` of constants) out of
every step. The result is for running, not for saving: the program keeps the
general graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["specialize_batch"]


def specialize_batch(model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    """A copy of the epoch graph ``model`` whose Scan steps take batches of ``batch`` rows."""
    specialized = onnx.ModelProto()
    specialized.CopyFrom(model)
    scans = [i for i, node in enumerate(specialized.graph.node) if node.op_type == "Scan"]
    for i in scans:
        scan = specialized.graph.node[i]
        body = _body(scan)
        scanned = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
        for value in body.input[len(body.input) - scanned:]:
            dims = value.type.tensor_type.shape.dim
            if dims and not dims[0].HasField("dim_value"):  # a batch (not a per-step scalar)
                dims[0].Clear()
                dims[0].dim_value = batch
    changed = True
    while changed:  # a folded Shape can make more shapes static (Expand, Reshape by it)
        inferred = onnx.shape_inference.infer_shapes(specialized)
        changed = False
        for i in scans:
            changed |= _fold_static_shapes(_body(specialized.graph.node[i]),
                                           _static_shapes(_body(inferred.graph.node[i])))
    return specialized


def _body(scan: onnx.NodeProto) -> onnx.GraphProto:
    return next(a.g for a in scan.attribute if a.name == "body")


def _static_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The values of ``graph`` whose (inferred) shapes are fully static, with those shapes."""
    shapes: dict[str, list[int]] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = [d.dim_value for d in tensor.shape.dim]
    return shapes


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
