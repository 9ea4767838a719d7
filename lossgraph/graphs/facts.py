"""What a model tells about its values: :class:`ForwardFacts`, the types and shapes shape
inference finds (with data propagation), the static ranks it leaves unknown, constant
values, and the nodes reading each value.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .held import tensor_array
from .queries import all_graphs, attribute_value, constant_value, initializer_arrays, subgraphs
from .types import Shape, is_default_domain, is_onnx_op, np_dtype, opset_version
from .weights import without_weight_data

__all__ = ["ForwardFacts", "LONG_VECTOR", "all_value_types", "infer_shapes_with_data"]


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
        inferred = _with_known_ranks(infer_shapes_with_data(light))
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
        constants.update((tensor.name, tensor_array(tensor)) for tensor in self._weights)
        for node in self._graph.node:
            if is_onnx_op(node, "Constant"):
                value = constant_value(node)
                if value is not None:
                    constants[node.output[0]] = value
        return constants


#: A 1-D value at least this long is kept out of onnx's data propagation
#: (:func:`infer_shapes_with_data`): no shape has that many dims, so none is computed from
#: it, and onnx would hold each of its values as a dimension.
LONG_VECTOR = 1 << 12


def infer_shapes_with_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(model, data_prop=True)``, without the time onnx
    spends on long vectors.

    onnx's data propagation holds the value of every static 1-D tensor that an ``Add``,
    ``Mul``, ``Concat``... reads as a list of dimensions, one per element, floating-point
    ones included: on the packed weights of ResNet-18's epoch graph (11 million values,
    :class:`~lossgraph.passes.PackWeights`) one call took 5 s, against 0.01 s on its step
    graph, and the flat positions a pooling gradient ranges over (200,704 int64 values in
    a small CNN's step at batch 64) kept 37 MiB. It does so for a vector whose values it
    does not know too, once a ``Slice`` or ``Cast`` reads it: the empty slice of a
    gradient that makes a fill at each run (:meth:`~lossgraph.autodiff.GradContext.filled`)
    made a transformer's compile peak at 129 MiB for 1.5 MiB of weights. A vector of
    :data:`LONG_VECTOR` values or more holds no shape, so each node that computes one
    (found by inference without data propagation), and each node that computes a vector
    from the values of one, stands, for the inference only, as a node of the same output
    type that computes nothing onnx propagates: a ``Constant`` holding no data (an empty
    sparse value). Where only data propagation finds a vector's length (a packed gradient
    whose parts' shapes are computed), a first inference has it stand as a vector of
    unknown length, onnx's own type inference of the node then gives its type from its
    inputs', and a second inference takes that. Every value's inferred type is onnx's,
    but where a shape is computed from part of a long vector's values (onnx would know
    them only for a long constant). The returned model has ``model``'s nodes and the
    inferred types."""
    scratch = onnx.ModelProto()
    scratch.CopyFrom(model)
    stand_ins = _vector_stand_ins(scratch, onnx.shape_inference.infer_shapes(model))
    if not stand_ins:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    inferred = onnx.shape_inference.infer_shapes(scratch, data_prop=True)
    unsized = [s for s in stand_ins if s.type is None]
    if unsized:
        graphs = list(all_graphs(scratch.graph))
        for stand_in, found in zip(unsized, _node_types(inferred, unsized, model)):
            if found is not None and _length(found) is not None:
                graphs[stand_in.graph].node[stand_in.position].CopyFrom(
                    _empty_constant(stand_in.node, found))
        inferred = onnx.shape_inference.infer_shapes(scratch, data_prop=True)
    graphs = list(all_graphs(inferred.graph))
    for stand_in in stand_ins:
        graphs[stand_in.graph].node[stand_in.position].CopyFrom(stand_in.node)
    del inferred.graph.input[len(model.graph.input):]  # the unknown length's, if any
    return inferred


@dataclass(frozen=True)
class _StandIn:
    """A node of a scratch model standing in for ``node``, the ``position``-th of the
    ``graph``-th graph of :func:`~lossgraph.graphs.all_graphs`; ``type`` is its output's
    type, or None when only data propagation finds its length."""

    graph: int
    position: int
    node: onnx.NodeProto
    type: onnx.TypeProto | None


def _vector_stand_ins(scratch: onnx.ModelProto, plain: onnx.ModelProto) -> list[_StandIn]:
    """Replace in ``scratch`` (in place) each single-output node that computes a vector of
    :data:`LONG_VECTOR` values or more, or a vector from the values of such a vector or of
    a stand-in of unknown length, by a stand-in (:func:`infer_shapes_with_data`);
    ``plain`` is ``scratch`` after inference without data propagation. The stand-ins, in
    graph order."""
    stand_ins: list[_StandIn] = []
    length = ""
    long: set[str] = set()  # long vectors, and the stand-ins' outputs
    for index, (graph, shaped) in enumerate(zip(list(all_graphs(scratch.graph)),
                                                all_graphs(plain.graph))):
        types = _declared_types(shaped)
        long |= {name for name, value in types.items() if _long_vector(value)}
        for position, node in enumerate(graph.node):
            value = types.get(node.output[0]) if len(node.output) == 1 else None
            if value is None or any(True for _ in subgraphs(node)) or _rank(value) != 1:
                continue
            if not (_long_vector(value) or _reads_values(node, long)):
                continue
            kept = onnx.NodeProto()
            kept.CopyFrom(node)
            sized = _length(value) is not None
            stand_ins.append(_StandIn(index, position, kept, value if sized else None))
            if not sized and not length:  # a vector of unknown length, from an unknown input
                length = _fresh_input(scratch, "lossgraph_unknown_length")
            node.CopyFrom(_empty_constant(kept, value) if sized else helper.make_node(
                "ConstantOfShape", [length], list(kept.output), name=kept.name,
                value=helper.make_tensor("zero", value.tensor_type.elem_type, [1], [0])))
            if not sized or _long_vector(value):  # a short one holds few unknown dims
                long.add(kept.output[0])
    return stand_ins


def _reads_values(node: onnx.NodeProto, vectors: Container[str]) -> bool:
    """Whether ``node`` computes from the values of one of ``vectors``: onnx's data
    propagation of a ``Slice``, ``Cast``, ``Concat``... of a static vector of ``n`` values
    makes ``n`` dimensions whether its values are known or not (measured: an empty
    ``Slice`` of a 262,144-value input held 20 MiB). ``Shape`` and ``Size`` read the
    length alone, which is shape data."""
    return node.op_type not in ("Shape", "Size") and any(name in vectors for name in node.input)


def _long_vector(value: onnx.TypeProto) -> bool:
    """A vector of :data:`LONG_VECTOR` values or more."""
    return (_length(value) or 0) >= LONG_VECTOR


def _empty_constant(node: onnx.NodeProto, value: onnx.TypeProto) -> onnx.NodeProto:
    """A ``Constant`` named as ``node`` giving its output a vector of ``value``'s type
    with no data: an empty sparse value."""
    elem_type = value.tensor_type.elem_type
    empty = helper.make_sparse_tensor(
        helper.make_tensor("values", elem_type, [0], []),
        helper.make_tensor("indices", onnx.TensorProto.INT64, [0], []), [_length(value)])
    return helper.make_node("Constant", [], list(node.output), name=node.name,
                            sparse_value=empty)


def _fresh_input(model: onnx.ModelProto, hint: str) -> str:
    """A new int64[1] input of ``model``'s main graph, of a name no value has."""
    taken = {name for g in all_graphs(model.graph)
             for name in (*(v.name for v in (*g.input, *g.output, *g.value_info)),
                          *(t.name for t in g.initializer),
                          *(o for n in g.node for o in n.output))}
    name = next(f"{hint}_{i}" if i else hint for i in range(len(taken) + 1)
                if (f"{hint}_{i}" if i else hint) not in taken)
    model.graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.INT64, [1]))
    return name


def _node_types(inferred: onnx.ModelProto, unsized: list[_StandIn],
                model: onnx.ModelProto) -> list[onnx.TypeProto | None]:
    """The output type onnx's inference of each node of ``unsized`` (in graph order) gives
    from its inputs' types in ``inferred`` (a stand-in's input: the type found for it
    before); None where it gives none."""
    graphs = list(all_graphs(inferred.graph))
    outer = _declared_types(inferred.graph)
    found: dict[str, onnx.TypeProto] = {}
    types = []
    for stand_in in unsized:
        node = stand_in.node
        known = {**outer, **_declared_types(graphs[stand_in.graph]), **found}
        try:
            schema = onnx.defs.get_schema(node.op_type, opset_version(model, node.domain) or 1,
                                          node.domain)
            result = onnx.shape_inference.infer_node_outputs(
                schema, node, {i: known[i] for i in node.input if i in known},
                opset_imports=list(model.opset_import)).get(node.output[0])
        except Exception:  # noqa: BLE001 - no schema, or inference fails: the length stays unknown
            result = None
        if result is not None:
            found[node.output[0]] = result
        types.append(result)
    return types


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


def _with_known_ranks(inferred: onnx.ModelProto, rounds: int = 8,
                      fold_rounds: int = 64) -> onnx.ModelProto:
    """``inferred`` with shapes onnx's shape inference leaves unknown although they are
    static, so that the gradient rules, which need ranks (and some, such as a grouped
    Conv's, a static channel count), find them.

    Three things get onnx going again where it stops (a model where none applies is
    returned as it is):

    - shape arithmetic on constants that onnx's data propagation does not evaluate
      (``Mod`` of two constants, as torch's legacy exporter writes for ``unflatten``): a
      scratch copy holds its values, so that onnx sees the Reshape targets built from them;
    - shape arithmetic on the static dims of a value whose other dims are not
      (:func:`_static_dim_values`): torch's legacy exporter writes ``x.chunk(2, dim=1)``
      as a Slice whose end is ``Div(Shape(x)[1] + 1, 2)``, which onnx leaves unknown when
      the batch is symbolic, and the channels after it with it;
    - the rank rules of :func:`_static_ranks`, for ops onnx gives no rank although it is
      fixed by the op's definition and its inputs' ranks or lengths.

    Each round declares the ranks found and infers again, so that the ops after them get
    shapes too. The returned model has the input's nodes; only its types are richer.
    """
    unranked = _unranked(inferred.graph)
    graph = inferred.graph
    from_dims = _static_dim_values(graph, _declared_types(graph), {v.name for v in graph.input})
    if not unranked and not from_dims:
        return inferred
    scratch = onnx.ModelProto()
    scratch.CopyFrom(inferred)
    folded: dict[int, onnx.NodeProto] = {}
    for _ in range(fold_rounds):  # static dims found make the dims after them static
        found, dims_used = _fold_shape_arithmetic(scratch, unranked, from_dims)
        from_dims = None  # found again from the next round's shapes
        folded.update(found)
        if not found or not (unranked or dims_used):
            break
        scratch = infer_shapes_with_data(scratch)
    for _ in range(rounds):
        if not _declare_static_ranks(scratch.graph, {}):
            break
        scratch = infer_shapes_with_data(scratch)
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


def _fold_shape_arithmetic(model: onnx.ModelProto, constants_too: bool = True,
                           from_dims: dict[str, np.ndarray] | None = None
                           ) -> tuple[dict[int, onnx.NodeProto], bool]:
    """Replace each node of ``model``'s graph that computes a small integer or boolean
    tensor from constants alone, or from static dims (:func:`_static_dim_values`), by a
    ``Constant`` of its value (onnx's reference evaluator computes those from constants,
    all in one run); returns the replaced nodes by position, and whether any value came
    from static dims. Without ``constants_too``, a graph where no value comes from static
    dims is left as it is (and costs one walk over its nodes). ``from_dims``: what
    :func:`_static_dim_values` finds in ``model``, when the caller has it.

    The values are exact (constants and static dims in, deterministic ops), so the shapes
    onnx infers from them are too. Nodes with subgraphs, several outputs or in other
    domains are left alone.
    """
    graph = model.graph
    types = _declared_types(graph)
    fed = {v.name for v in graph.input}  # an initializer that is an input is only a default
    if from_dims is None:
        from_dims = _static_dim_values(graph, types, fed)
    if not from_dims and not constants_too:
        return {}, False
    constant = {t.name for t in graph.initializer
                if t.name not in fed and _small(types.get(t.name))}
    recipes: dict[str, onnx.NodeProto] = {}  # how the evaluator computes each constant
    foldable: dict[int, onnx.NodeProto] = {}
    for position, node in enumerate(graph.node):
        if len(node.output) != 1 or not node.output[0]:
            continue
        out = node.output[0]
        if node.op_type == "Constant":
            if is_default_domain(node.domain) and _small_constant(node):
                constant.add(out)
                recipes[out] = node
        elif out in from_dims:
            constant.add(out)
            recipes[out] = _constant(node.name, out, from_dims[out])
            foldable[position] = node
        elif any(node.input) and all(i in constant for i in node.input if i) \
                and is_default_domain(node.domain) and not any(True for _ in subgraphs(node)) \
                and _small(types.get(out), _FOLDED_TYPES):
            constant.add(out)
            recipes[out] = node
            foldable[position] = node
    if not foldable:
        return {}, False
    wanted = [node.output[0] for node in foldable.values() if node.output[0] not in from_dims]
    values = dict(zip(wanted, _evaluate(model, recipes, wanted, types) if wanted else []))
    if len(values) < len(wanted):  # an op the evaluator lacks: fold the static dims only
        foldable = {p: n for p, n in foldable.items() if n.output[0] in from_dims}
    replaced = {}
    for position, node in foldable.items():
        out = node.output[0]
        replaced[position] = onnx.NodeProto()
        replaced[position].CopyFrom(node)
        value = from_dims[out] if out in from_dims else np.asarray(
            values[out], dtype=np_dtype(types[out].tensor_type.elem_type))
        graph.node[position].CopyFrom(_constant(node.name, out, value))
    return replaced, any(node.output[0] in from_dims for node in foldable.values())


def _small_constant(node: onnx.NodeProto) -> bool:
    """True for a ``Constant`` node of at most :data:`_FOLDED_SIZE` elements (its tensor's
    dims read, its data not)."""
    for attribute in node.attribute:
        if attribute.name in ("value", "sparse_value"):
            dims = attribute.t.dims if attribute.name == "value" else attribute.sparse_tensor.dims
            return math.prod(dims) <= _FOLDED_SIZE
        if attribute.name in ("value_floats", "value_ints", "value_strings"):
            return len(helper.get_attribute_value(attribute)) <= _FOLDED_SIZE
    return True  # a scalar


def _constant(name: str, output: str, value: np.ndarray) -> onnx.NodeProto:
    """A ``Constant`` node named ``name`` giving ``output`` the value ``value``."""
    return helper.make_node("Constant", [], [output], name=name,
                            value=numpy_helper.from_array(value, output))


def _evaluate(model: onnx.ModelProto, recipes: Mapping[str, onnx.NodeProto],
              wanted: list[str], types: Mapping[str, onnx.TypeProto]) -> list:
    """The values of ``wanted``, computed by the nodes of ``recipes`` (by output) they
    need and ``model``'s initializers (onnx's reference evaluator, in one run); empty
    when it cannot."""
    from onnx.reference import ReferenceEvaluator  # imported only where needed: 0.1 s

    needed: dict[str, onnx.NodeProto] = {}
    stack = list(wanted)
    while stack:
        name = stack.pop()
        if name in recipes and name not in needed:
            needed[name] = recipes[name]
            stack.extend(i for i in recipes[name].input if i)
    order = {name: position for position, name in enumerate(recipes)}  # graph order
    nodes = [needed[name] for name in sorted(needed, key=order.__getitem__)]
    read = {i for node in nodes for i in node.input}
    evaluator = helper.make_model(
        helper.make_graph(
            nodes, "shape_arithmetic", [],
            [helper.make_tensor_value_info(o, types[o].tensor_type.elem_type, None)
             for o in wanted],
            [t for t in model.graph.initializer if t.name in read]),
        opset_imports=[op for op in model.opset_import if is_default_domain(op.domain)])
    try:
        return ReferenceEvaluator(evaluator).run(None, {})
    except Exception:  # noqa: BLE001 - an op the evaluator lacks: onnx alone sets the ranks
        return []


class _Ints(NamedTuple):
    """A small integer tensor of rank 0 or 1 as :func:`_static_dim_values` follows it."""

    elements: tuple[int | None, ...]  # each known (an int) or not (None)
    scalar: bool = False

    @property
    def known(self) -> tuple[int, ...] | None:
        """The elements, when all are known."""
        return None if None in self.elements else self.elements  # type: ignore[return-value]


def _static_dim_values(graph: onnx.GraphProto, types: Mapping[str, onnx.TypeProto],
                       fed: Container[str]) -> dict[str, np.ndarray]:
    """The values of ``graph``'s node outputs that the static dims of values whose other
    dims are not (a symbolic batch) determine, where onnx's data propagation stops: each
    output of ``Shape``, ``Size``, and ``Gather``, ``Slice``, ``Concat``, ``Squeeze``,
    ``Unsqueeze``, ``Cast`` or ``Identity`` of them (and of constants) whose every
    element is known.

    ``Shape(x)[1]`` of an ``x`` of shape ``(N, 4, 6, 6)`` is 4 whatever ``N``; onnx
    propagates it, but not through the ``Div`` that follows (torch's ``chunk``), which
    the caller's evaluator then computes from it as from a constant."""
    constants = {t.name: t for t in graph.initializer if t.name not in fed}
    constants.update((n.output[0], n) for n in graph.node
                     if n.op_type == "Constant" and is_default_domain(n.domain) and n.output)

    read: dict[str, _Ints | None] = {}

    def constant(name: str) -> _Ints | None:
        """A small integer constant of rank 0 or 1, read once, on first use."""
        if name not in read:
            source = constants.get(name)
            value = None if source is None else tensor_array(source) \
                if isinstance(source, onnx.TensorProto) else constant_value(source)
            read[name] = None if value is None or value.ndim > 1 \
                or value.size > _FOLDED_SIZE or value.dtype.kind not in "iu" \
                else _Ints(tuple(int(v) for v in value.reshape(-1)), value.ndim == 0)
        return read[name]

    known: dict[str, _Ints] = {}  # the values computed from dims, each known in part
    found: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type not in _DIMS_OPS or not is_default_domain(node.domain) \
                or len(node.output) != 1 or not node.output[0]:
            continue
        if node.op_type not in ("Shape", "Size") and node.input[0] not in known \
                and not (node.op_type == "Concat" and any(i in known for i in node.input)):
            continue
        args = [known.get(i) or constant(i) if i else None for i in node.input]
        result = _dims_op(node, args, types)
        if result is None:
            continue
        out = node.output[0]
        known[out] = result
        elem_type = types[out].tensor_type.elem_type if out in types else None
        if result.known is not None and elem_type in _FOLDED_TYPES:
            found[out] = np.array(result.known[0] if result.scalar else list(result.known),
                                  np_dtype(elem_type))
    return found


#: The ops :func:`_static_dim_values` follows.
_DIMS_OPS = frozenset({"Shape", "Size", "Identity", "Cast", "Gather", "Slice", "Concat",
                       "Unsqueeze", "Squeeze"})


def _dims_op(node: onnx.NodeProto, args: list[_Ints | None],
             types: Mapping[str, onnx.TypeProto]) -> _Ints | None:
    """What :func:`_static_dim_values` knows of ``node``'s output from what it knows of its
    inputs (``args``), None if nothing."""
    op, data = node.op_type, args[0]

    def given(index: int) -> tuple[int, ...] | None:
        """Input ``index``'s elements when all are known."""
        arg = args[index] if index < len(args) else None
        return arg.known if arg is not None else None

    if op in ("Shape", "Size"):
        value = types.get(node.input[0])
        if value is None or not value.tensor_type.HasField("shape"):
            return None
        dims = tuple(d.dim_value if d.HasField("dim_value") else None
                     for d in value.tensor_type.shape.dim)
        if op == "Size":
            return _Ints((int(np.prod(dims)) if None not in dims else None,), True)
        start, end = attribute_value(node, "start", 0), attribute_value(node, "end")
        return _Ints(dims[slice(start, end)])
    if data is None:
        return None
    if op in ("Identity", "Cast"):
        to = attribute_value(node, "to", onnx.TensorProto.INT64)
        return data if to in _FOLDED_TYPES and to != onnx.TensorProto.BOOL else None
    if op == "Gather" and not data.scalar and attribute_value(node, "axis", 0) in (0, -1) \
            and given(1) is not None:
        size = len(data.elements)
        if not all(-size <= i < size for i in given(1)):
            return None
        return _Ints(tuple(data.elements[i] for i in given(1)), args[1].scalar)
    if op == "Slice" and not data.scalar and len(args) >= 3:
        starts, ends = given(1), given(2)
        axes = given(3) if len(args) > 3 and node.input[3] else (0,)
        steps = given(4) if len(args) > 4 and node.input[4] else (1,)
        if None in (starts, ends, axes, steps) or len(starts) != 1 or axes not in ((0,), (-1,)) \
                or steps == (0,):
            return None
        return _Ints(data.elements[slice(starts[0], ends[0], steps[0])])
    if op == "Concat" and attribute_value(node, "axis") in (0, -1) \
            and all(a is not None and not a.scalar for a in args):
        return _Ints(tuple(e for a in args for e in a.elements))
    if op == "Unsqueeze" and data.scalar:
        axes = given(1) if len(args) > 1 else tuple(attribute_value(node, "axes", []))
        return _Ints(data.elements) if axes in ((0,), (-1,)) else None
    if op == "Squeeze" and not data.scalar and len(data.elements) == 1:
        axes = given(1) if len(args) > 1 else tuple(attribute_value(node, "axes", [0]))
        return _Ints(data.elements, True) if axes in ((0,), (-1,)) else None
    return None


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


def all_value_types(model: onnx.ModelProto, data_prop: bool = False
                    ) -> dict[str, onnx.TypeProto]:
    """The type of every value of every graph of ``model`` (subgraphs included) that shape
    inference finds; the declared ones where inference fails (an invalid body)."""
    light, _ = without_weight_data(model)
    try:
        inferred = (infer_shapes_with_data(light) if data_prop
                    else onnx.shape_inference.infer_shapes(light))
    except Exception:  # noqa: BLE001  onnx raises several kinds; the types stay as declared
        inferred = light
    types: dict[str, onnx.TypeProto] = {}
    for graph in all_graphs(inferred.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            types.setdefault(value.name, value.type)
        for tensor in graph.initializer:
            types.setdefault(tensor.name, helper.make_tensor_type_proto(
                tensor.data_type, list(tensor.dims)))
    return types
