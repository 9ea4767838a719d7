"""What a model tells about its values: :class:`ForwardFacts`, the types and shapes shape
inference finds (with data propagation), the static ranks it leaves unknown, constant
values, and the nodes reading each value.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .queries import all_graphs, attribute_value, constant_value, initializer_arrays, subgraphs
from .types import Shape, is_default_domain, is_onnx_op, np_dtype
from .weights import without_weight_data

__all__ = ["ForwardFacts"]


@dataclass(frozen=True)
class ForwardFacts:
    """What a model tells about its top-level values: types and shapes from shape
    inference (with data propagation, and the static ranks it leaves unknown, see
    :func:`_with_known_ranks`), constant values, and the nodes reading each value.

    Analyses read ``types``; the gradient walker and its rules read all of it.
    """

    types: dict[str, onnx.TypeProto]
    #: value -> (op type, outputs) of each node that reads it
    readers: dict[str, list[tuple[str, list[str]]]]
    _graph: onnx.GraphProto = field(repr=False, compare=False)
    #: the model's weights, which shape inference did without (:func:`without_weight_data`)
    _weights: tuple[onnx.TensorProto, ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ForwardFacts:
        light, weights = without_weight_data(model)
        inferred = _with_known_ranks(onnx.shape_inference.infer_shapes(light, data_prop=True))
        graph = inferred.graph
        readers: dict[str, list[tuple[str, list[str]]]] = {}
        for node in graph.node:
            for name in dict.fromkeys(node.input):
                readers.setdefault(name, []).append((node.op_type, list(node.output)))
        return cls(_declared_types(graph), readers, graph, tuple(weights))

    @cached_property
    def elem_types(self) -> dict[str, int]:
        """The element type of every tensor value."""
        return {name: t.tensor_type.elem_type for name, t in self.types.items()
                if t.HasField("tensor_type")}

    @cached_property
    def shapes(self) -> dict[str, Shape]:
        """The shape of every tensor value of known rank (see :data:`Shape`)."""
        return {name: tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                            for d in t.tensor_type.shape.dim)
                for name, t in self.types.items()
                if t.HasField("tensor_type") and t.tensor_type.HasField("shape")}

    @cached_property
    def constants(self) -> dict[str, np.ndarray]:
        """The value of every initializer and ``Constant`` output (read on first use:
        analyses that need types only never copy the weights)."""
        constants = initializer_arrays(self._graph)
        constants.update((tensor.name, numpy_helper.to_array(tensor)) for tensor in self._weights)
        for node in self._graph.node:
            if is_onnx_op(node, "Constant"):
                value = constant_value(node)
                if value is not None:
                    constants[node.output[0]] = value
        return constants


def _declared_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """The type of every value ``graph`` declares: value_info, inputs, outputs, initializers."""
    types = {v.name: v.type for v in (*graph.value_info, *graph.input, *graph.output)}
    for tensor in graph.initializer:
        types.setdefault(
            tensor.name, helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        )
    return types


#: The shape arithmetic :func:`_fold_shape_arithmetic` computes: integer and boolean tensors
#: of at most this many elements (inputs and outputs).
_FOLDED_TYPES = frozenset({
    onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16,
    onnx.TensorProto.INT8, onnx.TensorProto.UINT64, onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT16, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL})
_FOLDED_SIZE = 64


def _with_known_ranks(inferred: onnx.ModelProto, rounds: int = 8) -> onnx.ModelProto:
    """``inferred`` with ranks onnx's shape inference leaves unknown although they are
    static, so that the gradient rules, which need ranks, find them.

    Two things get onnx going again where it stops (a model whose every value has a rank
    is returned as it is):

    - shape arithmetic on constants that onnx's data propagation does not evaluate
      (``Mod`` of two constants, as torch's legacy exporter writes for ``unflatten``): a
      scratch copy holds its values, so that onnx sees the Reshape targets built from them;
    - the rank rules of :func:`_static_ranks`, for ops onnx gives no rank although it is
      fixed by the op's definition and its inputs' ranks or lengths.

    Each round declares the ranks found and infers again, so that the ops after them get
    shapes too. The returned model has the input's nodes; only its types are richer.
    """
    if not _unranked(inferred.graph):
        return inferred
    scratch = onnx.ModelProto()
    scratch.CopyFrom(inferred)
    folded = _fold_shape_arithmetic(scratch)
    if folded:
        scratch = onnx.shape_inference.infer_shapes(scratch, data_prop=True)
    for _ in range(rounds):
        if not _declare_static_ranks(scratch.graph, {}):
            break
        scratch = onnx.shape_inference.infer_shapes(scratch, data_prop=True)
    for position, node in folded.items():
        scratch.graph.node[position].CopyFrom(node)
    return scratch


def _unranked(graph: onnx.GraphProto) -> bool:
    """True when some node output of ``graph`` (subgraphs included) has no known rank."""
    for g in all_graphs(graph):
        known = _declared_types(g)
        for node in g.node:
            for out in node.output:
                if out and (out not in known or not known[out].tensor_type.HasField("shape")):
                    return True
    return False


def _fold_shape_arithmetic(model: onnx.ModelProto) -> dict[int, onnx.NodeProto]:
    """Replace each node of ``model``'s graph that computes a small integer or boolean
    tensor from constants alone by a ``Constant`` of its value (onnx's reference evaluator
    computes them, all in one run); returns the replaced nodes by position.

    The values are exact (constants in, deterministic ops), so the shapes onnx infers
    from them are too. Nodes with subgraphs, several outputs or in other domains are left
    alone.
    """
    graph = model.graph
    types = _declared_types(graph)
    fed = {v.name for v in graph.input}  # an initializer that is an input is only a default
    constant = {t.name for t in graph.initializer
                if t.name not in fed and _small(types.get(t.name))}
    evaluated: list[onnx.NodeProto] = []
    foldable: dict[int, onnx.NodeProto] = {}
    for position, node in enumerate(graph.node):
        inputs = [i for i in node.input if i]
        outputs = [o for o in node.output if o]
        if not is_default_domain(node.domain) or any(True for _ in subgraphs(node)):
            continue
        if node.op_type == "Constant" and _small(types.get(outputs[0])):
            constant.add(outputs[0])
            evaluated.append(node)
        elif inputs and len(outputs) == 1 and all(i in constant for i in inputs) \
                and _small(types.get(outputs[0]), _FOLDED_TYPES):
            constant.add(outputs[0])
            evaluated.append(node)
            foldable[position] = node
    if not foldable:
        return {}
    from onnx.reference import ReferenceEvaluator  # imported only where needed: 0.1 s

    wanted = [node.output[0] for node in foldable.values()]
    evaluator = helper.make_model(
        helper.make_graph(
            evaluated, "shape_arithmetic", [],
            [helper.make_tensor_value_info(o, types[o].tensor_type.elem_type, None)
             for o in wanted],
            [t for t in graph.initializer if t.name in constant]),
        opset_imports=[op for op in model.opset_import if is_default_domain(op.domain)])
    try:
        values = ReferenceEvaluator(evaluator).run(None, {})
    except Exception:  # noqa: BLE001 - an op the evaluator lacks: onnx alone sets the ranks
        return {}
    replaced = {}
    for (position, node), out, value in zip(foldable.items(), wanted, values):
        replaced[position] = onnx.NodeProto()
        replaced[position].CopyFrom(node)
        array = np.asarray(value, dtype=np_dtype(types[out].tensor_type.elem_type))
        graph.node[position].CopyFrom(helper.make_node(
            "Constant", [], [out], name=node.name,
            value=numpy_helper.from_array(array, out)))
    return replaced


def _small(value: onnx.TypeProto | None, elem_types: Container[int] | None = None) -> bool:
    """True for a tensor of static shape with at most :data:`_FOLDED_SIZE` elements (and,
    when given, one of ``elem_types``)."""
    if value is None or not value.tensor_type.HasField("shape"):
        return False
    tensor = value.tensor_type
    if elem_types is not None and tensor.elem_type not in elem_types:
        return False
    dims = tensor.shape.dim
    return all(d.HasField("dim_value") for d in dims) and \
        int(np.prod([d.dim_value for d in dims])) <= _FOLDED_SIZE


def _declare_static_ranks(graph: onnx.GraphProto,
                          outer: Mapping[str, onnx.TypeProto]) -> bool:
    """Declare in ``graph``'s value_info (and its subgraphs') the ranks :func:`_static_ranks`
    finds, in node order, each one seen by the nodes after it. True when it declared any."""
    known = {**outer, **_declared_types(graph)}
    found: dict[str, onnx.ValueInfoProto] = {}
    declared = False
    for node in graph.node:
        for sub in subgraphs(node):
            declared |= _declare_static_ranks(sub, known)
        if not is_default_domain(node.domain):
            continue
        for out, (elem_type, rank) in _static_ranks(node, known).items():
            if out in known and known[out].tensor_type.HasField("shape"):
                continue
            if out in known and known[out].tensor_type.elem_type:
                elem_type = known[out].tensor_type.elem_type
            found[out] = helper.make_tensor_value_info(out, elem_type, [None] * rank)
            known[out] = found[out].type
    declared |= bool(found)
    for output in graph.output:  # a graph output's declared type is its type
        if output.name in found:
            output.type.CopyFrom(found.pop(output.name).type)
    if found:
        kept = [v for v in graph.value_info if v.name not in found]
        del graph.value_info[:]
        graph.value_info.extend([*kept, *found.values()])
    return declared


def _rank(value: onnx.TypeProto | None) -> int | None:
    """The rank of a tensor type, ``None`` when unknown."""
    if value is None or not value.tensor_type.HasField("shape"):
        return None
    return len(value.tensor_type.shape.dim)


def _length(value: onnx.TypeProto | None) -> int | None:
    """The static length of a 1-D tensor type (axes, a target shape), else ``None``."""
    if _rank(value) != 1:
        return None
    dim = value.tensor_type.shape.dim[0]
    return dim.dim_value if dim.HasField("dim_value") else None


def _static_ranks(node: onnx.NodeProto, known: Mapping[str, onnx.TypeProto]
                  ) -> dict[str, tuple[int, int]]:
    """(element type, rank) of the outputs of ``node`` whose rank its definition fixes
    from what ``known`` tells of its inputs, where onnx's shape inference gives none:

    - Reshape to a computed target of static length k: rank k;
    - a reduction with ``keepdims=1``: its input's rank r, whatever the axes; with
      ``keepdims=0`` over one computed axis: r - 1; over none: 0 (all axes), or r with
      ``noop_with_empty_axes``;
    - Squeeze over one computed axis: r - 1 (more than one could repeat an axis, which
      onnxruntime squeezes once: not static);
    - Unsqueeze over k computed axes: r + k (repeats are an error by the definition);
    - Concat: the rank of any input whose rank is known (all inputs share it);
    - GatherElements: the rank of its data or its indices (they share it);
    - If: the rank both branches give an output, where they agree;
    - Loop: a carried value's rank is its initial value's, where the body's output agrees
      (or has none); a scan output's is one more than the body's.
    """
    op, inputs, out = node.op_type, list(node.input), node.output[0] if node.output else ""
    data = known.get(inputs[0]) if inputs and inputs[0] else None
    elem_type = data.tensor_type.elem_type if data is not None else onnx.TensorProto.UNDEFINED
    rank = _rank(data)

    def second() -> onnx.TypeProto | None:
        return known.get(inputs[1]) if len(inputs) > 1 and inputs[1] else None

    found: int | None = None
    if op == "Reshape":
        found = _length(second())
    elif op.startswith("Reduce") and rank is not None:
        if attribute_value(node, "keepdims", 1):
            found = rank
        elif attribute_value(node, "axes") is None and _length(second()) == 1:
            found = rank - 1
        elif attribute_value(node, "axes") is None and _length(second()) == 0:
            found = rank if attribute_value(node, "noop_with_empty_axes", 0) else 0
    elif op == "Squeeze" and rank is not None and _length(second()) == 1:
        found = rank - 1
    elif op == "Unsqueeze" and rank is not None and _length(second()) is not None:
        found = rank + _length(second())
    elif op == "Concat":
        ranked = [known.get(i) for i in inputs if _rank(known.get(i)) is not None]
        if ranked:
            found, elem_type = _rank(ranked[0]), ranked[0].tensor_type.elem_type
    elif op == "GatherElements":
        found = rank if rank is not None else _rank(second())
    elif op == "If":
        return _if_ranks(node)
    elif op == "Loop":
        return _loop_ranks(node, known)
    return {out: (elem_type, found)} if out and found is not None else {}


def _if_ranks(node: onnx.NodeProto) -> dict[str, tuple[int, int]]:
    """(element type, rank) of each output of an If node whose two branches give it the
    same rank."""
    branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    if set(branches) != {"then_branch", "else_branch"}:
        return {}
    outputs = []
    for branch in (branches["then_branch"], branches["else_branch"]):
        shaped = {v.name: v.type for v in (*branch.value_info, *branch.output)
                  if v.type.tensor_type.HasField("shape")}
        outputs.append([shaped.get(v.name) for v in branch.output])
    ranks = {}
    for out, then, other in zip(node.output, *outputs):
        if out and _rank(then) is not None and _rank(then) == _rank(other):
            ranks[out] = (then.tensor_type.elem_type, _rank(then))
    return ranks


def _loop_ranks(node: onnx.NodeProto, known: Mapping[str, onnx.TypeProto]
                ) -> dict[str, tuple[int, int]]:
    """(element type, rank) of the outputs of a Loop node: each carried value has its
    initial value's rank where the body's output does not say otherwise (the body's
    declared rank when the initial one is unknown); each scan output one more than the
    body's."""
    body = next(subgraphs(node), None)
    if body is None:
        return {}
    shaped = {v.name: v.type for v in (*body.value_info, *body.output)
              if v.type.tensor_type.HasField("shape")}
    produced = [shaped.get(v.name) for v in body.output[1:]]  # after the condition
    initial = [known.get(name) if name else None for name in node.input[2:]]
    ranks = {}
    for index, out in enumerate(node.output):
        inner = produced[index] if index < len(produced) else None
        if index < len(initial):  # a carried value
            start = initial[index]
            rank = _rank(start) if _rank(start) is not None else _rank(inner)
            if rank is None or (_rank(inner) is not None and _rank(inner) != rank):
                continue
            source = start if _rank(start) is not None else inner
            ranks[out] = (source.tensor_type.elem_type, rank)
        elif _rank(inner) is not None:  # a scan output: the iterations stacked
            ranks[out] = (inner.tensor_type.elem_type, _rank(inner) + 1)
    return {out: found for out, found in ranks.items() if out}
