"""Shape arithmetic of statically shaped values folded to constants::

    Shape(v)   ->  Constant(shape of v)        (start/end attributes honoured)
    Size(v)    ->  Constant(element count of v)
    Reshape(v, s)  ->  Identity(v)             where v already has the shape s

where shape inference gives ``v`` a static shape, in the main graph and in Scan bodies,
repeated until nothing changes (a folded ``Shape`` can make more shapes static:
``Expand`` or ``Reshape`` by it). A node that computed only for what was folded goes
with it (:func:`~lossgraph.speed.rewriting.drop_unread`): a value recomputed for the
backward (:class:`~lossgraph.passes.Recompute`) whose shape alone the backward read, a
shape a ``Reshape`` no longer reads. Left in, onnxruntime would run it anyway, last,
holding what it reads until then (GPT-2's step: 12 MiB a layer through the backward).

Why: a graph of symbolic batch size recomputes its shapes every step (the mean's count,
the ones row that sums a bias gradient over the batch). Once the batch size is fixed
(:class:`~lossgraph.speed.SpecializeBatch`) they are constants, and onnxruntime's
constant folding takes the rest of the shape arithmetic (``Cast``, ``Div``, ``Concat``,
``ConstantOfShape``, ``Expand`` of constants) out of every step; each node it removes
saves a kernel's fixed cost (about 0.7 us).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..passes.contract import Pass, PassResult
from .rewriting import drop_unread
from .scopes import static_scopes

__all__ = ["FoldStaticShapes"]


@dataclass(frozen=True)
class FoldStaticShapes(Pass[None]):
    """``Shape``/``Size`` of static shapes to constants, no-op ``Reshape`` to ``Identity``
    (module doc). Shapes are inferred with data propagation, which resolves shapes
    computed from ``Shape`` values: on a 665-node transformer's step graph 43 ``Shape``
    nodes are left instead of 119 (docs/design.md)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        changed, folded = False, True
        while folded:
            folded = False
            for graph, static in static_scopes(model):
                folded |= _fold(graph, static)
            changed |= folded
        return PassResult(model, changed=changed)


def _fold(graph: onnx.GraphProto, shapes: dict[str, list[int]]) -> bool:
    """Fold ``graph``'s shape arithmetic of the values in ``shapes`` in place, and drop
    what computed only for it; True if any."""
    released: set[str] = set()  # values a folded node read and no longer reads
    for index, node in enumerate(graph.node):
        if node.op_type not in ("Shape", "Size", "Reshape") or node.input[0] not in shapes:
            continue
        shape = shapes[node.input[0]]
        if node.op_type == "Reshape":
            if shapes.get(node.output[0]) == shape:
                identity = helper.make_node("Identity", [node.input[0]], [node.output[0]],
                                            name=node.name)
                released.update(node.input[1:])
                graph.node[index].CopyFrom(identity)
            continue
        if node.op_type == "Size":
            value = np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
        else:
            attributes = {a.name: a.i for a in node.attribute}
            start, end = attributes.get("start", 0), attributes.get("end", len(shape))
            value = np.array(shape[slice(start, end)], np.int64)  # negative: from the end
        constant = helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                    value=numpy_helper.from_array(value))
        released.update(node.input)
        graph.node[index].CopyFrom(constant)
    drop_unread(graph, released)
    return bool(released)
