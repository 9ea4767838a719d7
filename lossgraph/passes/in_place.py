"""A training graph that writes the next state over the state it reads: one buffer set.

A training graph reads each state tensor ``S`` (a weight, an optimizer state, a buffer)
as an input and writes its next value ``S'`` as an output. Bound to arrays of their own,
the outputs make the engine hold the state twice (:mod:`lossgraph.runtime.ring`); bound
to ``S``'s own array, ``S'`` is written over ``S`` while the graph runs. That is right
only when

- the node writing ``S'`` reads ``S`` at the index it writes and no other (an
  elementwise node: :data:`ELEMENTWISE`), and
- every other node reading ``S`` has run before it.

ONNX has no control edges and onnxruntime picks its own order among independent nodes
(a backward product ``dY @ W^T`` is independent of ``W``'s update), so
:class:`WriteInPlace` makes both hold in any order: ``S'`` is written last by
``Where(ok, S'_computed, S)``, and a node that reads ``S`` without being an ancestor of
that ``Where`` becomes one through an empty slice of its output concatenated to ``ok``
(no value changes; a few scalar nodes). ``ok`` is whether the step's loss is finite: a
step whose loss is not finite writes back the state it read, so the live state is still
the last whose loss was finite when the engine reads the loss, as it was with a second
set. :func:`in_place_problem` says why a graph cannot be written in place, or None.

A table that only ``Gather`` reads (an embedding) and that plain SGD updates,
``S' = S - rate * G`` with ``G`` its gradient's rows added into zeros of the table's
size, is written row by row instead (:func:`_row_update`): the rows its batch gathered
(``Unique`` of the indices) are summed in the same order as ``G`` sums them, stepped and
guarded as above, and scattered over ``S`` (``ScatterND``, which onnxruntime runs over a
bound output in place). The same values bit for bit; the table-sized zeros, gradient and
step are never made (BERT-base's word embeddings: 89 MiB each).

A node "reads" ``S`` through the values onnxruntime may make views of ``S`` or fold into
their readers (``Reshape``, ``Transpose``, ``Cast``, ... :data:`_PASSED_ON`): the nodes
reading those are the readers the ``Where`` waits for, so that onnxruntime's fusions (a
``Transpose`` into the ``MatMul`` after it) keep their place.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import TensorProto, numpy_helper

from ..builder import GraphBuilder
from ..errors import InternalError
from ..graphs import attribute_value, is_onnx_op, node_reads, opset_version
from ..names import NameAuthority
from ..speed.rewriting import constant_ints, drop_unread
from .contract import Pass, PassResult

__all__ = ["WriteInPlace", "in_place_problem", "ELEMENTWISE"]

#: Ops whose output element ``i`` reads element ``i`` of an input shaped like it and no
#: other: the only nodes that may write a state tensor over itself.
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Neg", "Abs",
                         "Sqrt", "Clip", "Sign", "Reciprocal", "Relu"})
#: Ops that hand their input on unchanged in values (onnxruntime makes some views of the
#: input, eliminates or fuses others into their readers).
_PASSED_ON = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast",
                        "Transpose"})


class _Graph:
    """A graph's producers, readers and ancestry, by node position."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.nodes = list(model.graph.node)
        self.outputs = frozenset(o.name for o in model.graph.output)
        #: value -> the position of the node computing it
        self.producer: dict[str, int] = {}
        #: value -> the positions of the nodes reading it
        self.readers: dict[str, list[int]] = {}
        #: each node's ancestors, as a bit mask of positions (a graph lists its nodes in a
        #: topological order)
        self.ancestry: list[int] = []
        for i, node in enumerate(self.nodes):
            mask = 0
            for value in dict.fromkeys(node_reads(node)):
                self.readers.setdefault(value, []).append(i)
                if value in self.producer:
                    j = self.producer[value]
                    mask |= self.ancestry[j] | 1 << j
            self.ancestry.append(mask)
            self.producer.update((o, i) for o in node.output if o)

    def ancestors(self, values: list[str]) -> int:
        """The nodes ``values`` are computed from, their producers included (a bit mask)."""
        mask = 0
        for value in values:
            if value in self.producer:
                i = self.producer[value]
                mask |= self.ancestry[i] | 1 << i
        return mask

    def users(self, state: str) -> set[int]:
        """The nodes that use ``state``'s values: its readers, and where a reader hands it
        on (:data:`_PASSED_ON`) to other nodes, theirs instead."""
        found: set[int] = set()
        stack = [state]
        while stack:
            value = stack.pop()
            for i in self.readers.get(value, ()):
                node = self.nodes[i]
                passed = [o for o in node.output
                          if o and o in self.readers and o not in self.outputs]
                if node.op_type in _PASSED_ON and node.input[0] == value and passed:
                    stack.extend(passed)
                else:
                    found.add(i)
        return found


def _waits(graph: _Graph, state: str, written: str, before: int
           ) -> tuple[list[int], str | None]:
    """The nodes using ``state`` that the node writing ``written`` must wait for (those
    not among its ancestors ``before``, a bit mask), or a problem."""
    waits = []
    writer = graph.producer[written]
    for i in sorted(graph.users(state)):
        if before >> i & 1:
            continue
        if graph.ancestry[i] >> writer & 1:
            return [], (f"node {graph.nodes[i].name or graph.nodes[i].op_type!r} reads both "
                        f"{state!r} and its next value {written!r}")
        waits.append(i)
    return waits, None


def _plan(graph: _Graph, pairs: Mapping[str, str], loss: str | None
          ) -> tuple[dict[str, list[int]], str | None]:
    """For each state tensor of ``pairs``, the nodes using it that the write of its next
    value must wait for; or why the graph cannot be written in place: as it is (``loss``
    None: each writer elementwise, nothing to wait for) or guarded by ``loss``."""
    if loss is not None and loss not in graph.producer:
        return {}, f"its loss {loss!r} is not computed by a node"
    plan = {}
    for state, written in pairs.items():
        if written not in graph.producer:
            return {}, f"{written!r} is not computed by a node"
        writer = graph.nodes[graph.producer[written]]
        if loss is None and not is_onnx_op(writer, *ELEMENTWISE):
            return {}, f"{written!r} is written by a {writer.op_type}, not an elementwise node"
        waits, problem = _waits(graph, state, written,
                                graph.ancestors([written, *([loss] if loss else [])]))
        if problem or (waits and loss is None):
            return {}, problem or (f"node {graph.nodes[waits[0]].name!r} may read {state!r} "
                                   f"after {written!r} is written")
        plan[state] = waits
    return plan, None


def in_place_problem(model: onnx.ModelProto, pairs: Mapping[str, str],
                     loss: str | None = None) -> str | None:
    """Why ``model`` cannot write each output ``pairs[S]`` over its input ``S``, or None:
    as it is (each writer elementwise, after every reader of ``S``) or, with ``loss``, once
    :class:`WriteInPlace` guards it with that loss (no reader of ``S`` reads its next
    value too)."""
    return _plan(_Graph(model), pairs, loss)[1]


@dataclass(frozen=True)
class WriteInPlace(Pass[None]):
    """Each output ``pairs[S]`` written last by ``Where(loss is finite, S'_computed, S)``,
    after every node that reads ``S`` (module doc): the graph may then write it over
    ``S``. A graph where some node reads both ``S`` and its next value cannot be: an
    InternalError (:func:`in_place_problem` first, to fall back to two buffer sets)."""

    pairs: Mapping[str, str]
    loss: str

    def call(self, model: onnx.ModelProto) -> PassResult[None]:
        graph = _Graph(model)
        nodes = graph.nodes
        plan, problem = _plan(graph, self.pairs, self.loss)
        if problem:
            raise InternalError(f"WriteInPlace cannot write the graph's state in place: "
                                f"{problem}.")
        names = NameAuthority.for_model(model)
        b = GraphBuilder(names, opset_version(model) or 13, prefix="in_place/")
        ok = b.Not(b.Or(b.IsNaN(self.loss), b.IsInf(self.loss)), hint="loss_is_finite")
        inserted: dict[int, list[onnx.NodeProto]] = {graph.producer[self.loss]: list(b.nodes)}
        scalars = _scalars(model.graph)
        replaced: set[int] = set()
        for state, written in self.pairs.items():
            waits = plan[state]
            rows = _row_update(graph, model.graph, scalars, state, written)
            start = len(b.nodes)
            flag = ok
            if waits:  # an empty slice of each reader's output: an edge, no value
                parts = [b.Reshape(ok, b.ints([1]))]
                for i in waits:
                    read = next(o for o in nodes[i].output if o)
                    empty = b.Slice(b.Reshape(read, b.ints([-1])), b.ints([0]), b.ints([0]))
                    parts.append(b.Cast(empty, to=TensorProto.BOOL))
                flag = b.Reshape(b.Concat(*parts, axis=0), b.ints([]), hint=f"{state}_read")
            at = max(graph.producer[written], graph.producer[self.loss], *waits)
            if rows is not None:
                replaced.update(rows.dense)
                _write_rows(b, rows, state, written, flag)
            else:
                writer = nodes[graph.producer[written]]
                computed = names.fresh(f"{written}_computed")
                writer.output[list(writer.output).index(written)] = computed
                b.op("Where", flag, computed, state, outputs=[written])
            inserted.setdefault(at, []).extend(b.nodes[start:])
        model.graph.initializer.extend(b.initializers)
        placed = [kept for i, node in enumerate(nodes)
                  for kept in ((() if i in replaced else (node,)) + tuple(inserted.get(i, ())))]
        unread = {v for i in replaced for v in node_reads(nodes[i])}  # the dense step's
        ordered = _sorted(placed)
        kept = [onnx.NodeProto() for _ in ordered]
        for copy, node in zip(kept, ordered):
            copy.CopyFrom(node)
        del model.graph.node[:]
        model.graph.node.extend(kept)
        drop_unread(model.graph, unread)
        return PassResult(model, None)


@dataclass(frozen=True)
class _Rows:
    """A table's SGD step ``S - rate * G``, ``G`` the rows ``rows[j]`` added at row
    ``ids[j]`` of zeros in order (a Gather's gradient:
    :func:`~lossgraph.autodiff.rules.indexing.scatter_add_rows`)."""

    ids: str
    rows: str
    rate: str
    rate_first: bool  # Mul(rate, G) rather than Mul(G, rate)
    fill: onnx.TensorProto | None  # the zeros' value (None: float 0)
    axes: list[int]  # the Unsqueeze spreading an index over its row
    dense: tuple[int, ...]  # the positions of the nodes of the dense form


def _scalars(graph: onnx.GraphProto) -> set[str]:
    """The graph's inputs and initializers of one element (a learning rate)."""
    found = {t.name for t in graph.initializer if math.prod(t.dims) == 1}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(
                d.HasField("dim_value") and d.dim_value == 1 for d in dims):
            found.add(value.name)
    return found


def _sole(graph: _Graph, value: str, op_type: str, reader: int) -> int | None:
    """The position of the ``op_type`` node computing ``value`` when the node at ``reader``
    is the only one reading it, else None."""
    i = graph.producer.get(value)
    if (i is None or value in graph.outputs or graph.readers.get(value) != [reader]
            or not is_onnx_op(graph.nodes[i], op_type)):
        return None
    return i


def _row_update(graph: _Graph, proto: onnx.GraphProto, scalars: set[str], state: str,
                written: str) -> _Rows | None:
    """``written``'s dense SGD step of a table only ``Gather`` reads, as :class:`_Rows`; None
    for any other update (momentum, decay, a penalty or a clipping norm reads the gradient,
    a table read otherwise adds to it). ``proto``: the graph itself, whose constants hold
    the index's axes."""
    nodes = graph.nodes
    w = graph.producer[written]
    if not is_onnx_op(nodes[w], "Sub") or nodes[w].input[0] != state:
        return None
    m = _sole(graph, nodes[w].input[1], "Mul", w)
    if m is None:
        return None
    for first in (False, True):
        gradient, rate = nodes[m].input[int(first)], nodes[m].input[int(not first)]
        s = _sole(graph, gradient, "ScatterElements", m)
        if s is not None and rate in scalars:
            break
    else:
        return None
    scatter = nodes[s]
    if attribute_value(scatter, "axis", 0) != 0 or attribute_value(scatter, "reduction") != "add":
        return None
    base = next((i for op in ("Reshape", "Identity")  # a fill made at each run, reshaped
                 if (i := _sole(graph, scatter.input[0], op, s)) is not None), None)
    z = _sole(graph, nodes[base].input[0] if base is not None else scatter.input[0],
              "ConstantOfShape", s if base is None else base)
    e = _sole(graph, scatter.input[1], "Expand", s)
    if z is None or e is None:
        return None
    fill = attribute_value(nodes[z], "value")
    if fill is not None and numpy_helper.to_array(fill).any():
        return None
    u = _sole(graph, nodes[e].input[0], "Unsqueeze", e)
    if u is None:
        return None
    axes = attribute_value(nodes[u], "axes")
    if axes is None and len(nodes[u].input) > 1:
        axes = constant_ints(proto, nodes[u].input[1])
    if axes is None or list(axes) != list(range(1, len(axes) + 1)):
        return None
    return _Rows(ids=nodes[u].input[0], rows=scatter.input[2], rate=rate, rate_first=first,
                 fill=fill, axes=list(axes),
                 dense=tuple(i for i in (w, m, s, base, z, e, u) if i is not None))


def _write_rows(b: GraphBuilder, rows: _Rows, state: str, written: str, flag: str) -> None:
    """``written``: the rows of ``state`` that ``rows.ids`` names, each stepped by the sum of
    its gradient rows (summed in ``G``'s order) where ``flag``, scattered over ``state``."""
    unique, _, inverse, _ = b.op("Unique", rows.ids, outputs=4, hint=f"{state}_rows", sorted=1)
    shape = b.Shape(rows.rows)
    sums_shape = b.Concat(b.Shape(unique), b.Slice(shape, b.ints([1]), b.ints([2**62])),
                          axis=0)
    zeros = b.ConstantOfShape(sums_shape,
                              **({"value": rows.fill} if rows.fill is not None else {}))
    spread = b.Expand(b.unsqueeze(inverse, rows.axes), shape)
    sums = b.ScatterElements(zeros, spread, rows.rows, axis=0, reduction="add")
    old = b.Gather(state, unique, axis=0)
    step = b.Mul(rows.rate, sums) if rows.rate_first else b.Mul(sums, rows.rate)
    kept = b.Where(flag, b.Sub(old, step), old)
    b.op("ScatterND", state, b.unsqueeze(unique, [1]), kept, outputs=[written])


def _sorted(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in a topological order, each as early in the given order as its inputs
    allow (a guard placed before the next value it reads moves after it)."""
    produced = {o for node in nodes for o in node.output if o}
    waiting = {i: {v for v in node_reads(node) if v in produced} for i, node in enumerate(nodes)}
    readers: dict[str, list[int]] = {}
    for i, values in waiting.items():
        for value in values:
            readers.setdefault(value, []).append(i)
    ready = [i for i, values in waiting.items() if not values]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for value in (o for o in nodes[i].output if o):
            for j in readers.get(value, ()):
                waiting[j].discard(value)
                if not waiting[j]:
                    heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise InternalError("WriteInPlace made a cycle: a node waits for a state's next "
                            "value that waits for it.")
    return order
