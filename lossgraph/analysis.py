"""Analyses that read a model and answer a question about it, without changing it: which
values are differentiable, which initializers are trainable, blocked (their gradient would
pass a sequence) or stuck (their gradient is zero everywhere), which an exporter tied
(:func:`tied_initializers`), froze into constants (:func:`constant_weights`) or computed
from the module's parameters (:func:`folded_weights`), which are biases and normalization
scales and shifts, left out of weight decay (:func:`no_decay_weights`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .autodiff.registry import (
    differentiable_inputs,
    not_differentiable_reason,
    zero_gradient_op,
)
from .errors import InternalError, UnsupportedModelError
from .graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    GraphIndex,
    attribute_value,
    elem_type_name,
    is_default_domain,
    is_held,
    is_onnx_op,
    opset_version,
    outer_references,
    shortest_path,
    subgraphs,
    tensor_array,
    torch_name_scopes,
)
from .models import ModelLike, as_model, check_model
from .options import select_weights
from .roles import get_roles

__all__ = ["trainable_initializers", "blocked_initializers", "blocked_weights", "default_weights",
           "differentiable_values", "influenced_values", "GradientBlock", "gradient_block",
           "BlockedWeight", "StaticSplit", "static_splits", "StuckWeight", "stuck_weights",
           "TiedWeight", "tied_initializers", "layer_readers", "ConstantWeight",
           "constant_weights", "LARGE_CONSTANT", "FoldedWeight", "folded_weights",
           "no_decay_weights", "excluded_from_decay"]

#: Kinds of values that hold tensors without being one, as messages name them.
_CONTAINERS = {"sequence_type": "a sequence", "optional_type": "an optional",
               "map_type": "a map"}


def _may_be_float(types: Mapping[str, onnx.TypeProto]):
    """A predicate: may this value carry a gradient? Values of unknown type (outputs of
    ops shape inference does not know, e.g. custom domains) may, so they are never
    silently skipped."""

    def may_be_float(name: str) -> bool:
        value_type = types.get(name)
        if value_type is None or not value_type.HasField("tensor_type"):
            return value_type is None
        elem_type = value_type.tensor_type.elem_type
        return elem_type in FLOAT_TYPES or elem_type == onnx.TensorProto.UNDEFINED

    return may_be_float


def _container(value_type: onnx.TypeProto | None) -> str | None:
    """``"a sequence"``, ``"an optional"`` or ``"a map"`` for a value of that kind that may
    hold floats (its element type is float, double or unknown); None for anything else."""
    kind = value_type.WhichOneof("value") if value_type is not None else None
    if kind not in _CONTAINERS:
        return None
    inner = value_type
    while (inner_kind := inner.WhichOneof("value")) in _CONTAINERS:
        held = getattr(inner, inner_kind)
        inner = held.value_type if inner_kind == "map_type" else held.elem_type
    inner_kind = inner.WhichOneof("value")
    elem_type = getattr(inner, inner_kind).elem_type if inner_kind else 0
    return _CONTAINERS[kind] if elem_type in FLOAT_TYPES or not elem_type else None


def _reaching(model: onnx.ModelProto, targets: Iterable[str], passes: Callable[[str], bool],
              trainable: bool, through_zero: bool = True) -> set[str]:
    """The values of the top-level graph that ``passes`` admits and that influence
    ``targets`` through admitted values, each entering its node through a differentiable
    input (a subgraph's captured outer values count as inputs of the node that holds it);
    without ``through_zero``, never through an op whose gradient is zero everywhere."""
    needed = {t for t in targets if passes(t)}
    for node in reversed(model.graph.node):
        if not any(o in needed for o in node.output):
            continue
        if not through_zero and zero_gradient_op(node.op_type, node.domain,
                                                 opset_version(model, node.domain)):
            continue
        for position in differentiable_inputs(node.op_type, node.domain, len(node.input),
                                              trainable, opset_version(model, node.domain)):
            name = node.input[position]
            if name and passes(name):
                needed.add(name)
        for sub in subgraphs(node):
            needed.update(n for n in outer_references(sub) if passes(n))
    return needed


def differentiable_values(model: onnx.ModelProto, targets: Iterable[str],
                          types: Mapping[str, onnx.TypeProto] | None = None,
                          trainable: bool = False) -> set[str]:
    """Float values of the top-level graph that influence ``targets`` differentiably.

    Walks the graph backwards from ``targets`` through differentiable inputs only
    (see :mod:`lossgraph.autodiff.registry`); a subgraph's captured outer values count
    as inputs of the node that holds it. ``trainable`` also skips the inputs that are
    differentiable but never trained (batch-normalization statistics).
    """
    types = ForwardFacts.of(model).types if types is None else types
    return _reaching(model, targets, _may_be_float(types), trainable)


def influenced_values(model: onnx.ModelProto, sources: Iterable[str],
                      types: Mapping[str, onnx.TypeProto]) -> set[str]:
    """Float values of the top-level graph that ``sources`` influence differentiably."""

    is_float = _may_be_float(types)

    reached = set(sources)
    for node in model.graph.node:
        positions = differentiable_inputs(node.op_type, node.domain, len(node.input),
                                          opset=opset_version(model, node.domain))
        hit = any(node.input[p] in reached for p in positions)
        hit = hit or any(n in reached for sub in subgraphs(node) for n in outer_references(sub))
        if hit:
            reached.update(o for o in node.output if o and is_float(o))
    return reached


@dataclass(frozen=True)
class GradientBlock:
    """Why no gradient flows from a value to the targets, found on one path between them.

    ``path`` alternates value names and nodes: ``[v0, node1, v1, node2, v2, ...]``
    from the source to a target; ``at`` is the index in ``path`` of the first node
    that passes no gradient on, and ``reason`` says why. No path at all: ``path`` is
    empty and ``at`` is -1.
    """

    path: tuple
    at: int
    reason: str


def gradient_block(model: onnx.ModelProto, source: str, targets: Iterable[str],
                   types: Mapping[str, onnx.TypeProto]) -> GradientBlock:
    """The shortest path from ``source`` to one of ``targets`` and where it carries no
    gradient: a value entering a node only through inputs that carry none (a shape,
    index, axis or condition input), or a node whose output on the path is not float
    (an integer Cast, a comparison, a Shape)."""
    is_float = _may_be_float(types)
    path = shortest_path(model.graph, source, set(targets))
    if path is None:
        return GradientBlock((), -1, "no path of nodes leads from it to them")
    for at in range(1, len(path), 2):
        value, node, out = path[at - 1], path[at], path[at + 1]
        if not is_float(out):
            container = _container(types[out])
            if container:
                hint = _split_hint(model, node, types)
                return GradientBlock(tuple(path), at, (
                    f"its output {out!r} is {container}, and lossgraph differentiates "
                    "tensors only" + (f" ({hint})" if hint else "")))
            elem_type = types[out].tensor_type.elem_type
            kind = elem_type_name(elem_type) if elem_type else "not a tensor"
            why = not_differentiable_reason(node.op_type, node.domain)
            return GradientBlock(tuple(path), at, f"its output {out!r} is {kind}, which "
                                 "carries no gradient" + (f" ({why})" if why else ""))
        positions = differentiable_inputs(node.op_type, node.domain, len(node.input),
                                          opset=opset_version(model, node.domain))
        captured = any(value in outer_references(sub) for sub in subgraphs(node))
        if not captured and not any(node.input[p] == value for p in positions):
            where = [i for i, name in enumerate(node.input) if name == value]
            reason = (not_differentiable_reason(node.op_type, node.domain, where[0],
                                                opset_version(model, node.domain))
                      or "a shape, index, axis, count or condition input")
            return GradientBlock(tuple(path), at, (
                f"{value!r} enters it as input {', '.join(map(str, where))}, which carries no "
                f"gradient ({reason})"))
    return GradientBlock(tuple(path), -1, "every link carries a gradient")


def _split_hint(model: onnx.ModelProto, node: onnx.NodeProto,
                types: Mapping[str, onnx.TypeProto]) -> str:
    """What :class:`~lossgraph.passes.SequencesToTensors` does about a SplitToSequence that
    blocks a gradient, for messages; empty for other nodes."""
    if node.op_type != "SplitToSequence":
        return ""
    if node.output[0] in static_splits(model.graph, types):
        return ("lossgraph.passes.SequencesToTensors rewrites this SplitToSequence into a "
                "Split, as compile_program does: run it first")
    return ("lossgraph.passes.SequencesToTensors rewrites a SplitToSequence into a Split "
            "only when the number of its pieces is static and every node that reads the "
            "sequence takes one piece at a constant position, the count or all the pieces")


# -- SplitToSequence that is a Split ----------------------------------------------------


@dataclass(frozen=True)
class StaticSplit:
    """A ``SplitToSequence`` whose sequence is a tensor split in disguise: the number of its
    pieces is static, the sequence is no graph output, and every node that reads it takes
    one piece at a constant position (``SequenceAt``), the count (``SequenceLength``) or
    all the pieces (``ConcatFromSequence``). :class:`~lossgraph.passes.SequencesToTensors`
    rewrites it into a ``Split``.
    """

    node: onnx.NodeProto
    #: each piece's length along the axis
    sizes: tuple[int, ...]
    #: keepdims=0 without a split input: each piece loses the axis
    squeezed: bool
    #: the nodes that read the sequence, in graph order
    readers: tuple[onnx.NodeProto, ...]
    #: the output of each SequenceAt reader -> the index of the piece it takes (0..n-1)
    pieces: Mapping[str, int]


def static_splits(graph: onnx.GraphProto,
                  types: Mapping[str, onnx.TypeProto]) -> dict[str, StaticSplit]:
    """The ``SplitToSequence`` nodes of ``graph`` that are splits (:class:`StaticSplit`),
    by sequence name; ``types`` gives the static dims (a scalar ``split``, or none, needs
    the split axis's length)."""
    nodes = [n for n in graph.node
             if is_onnx_op(n, "SplitToSequence")]
    if not nodes:
        return {}
    index = GraphIndex(graph.node)
    outputs = {o.name for o in graph.output}
    constant = _constants(graph)
    found = {}
    for node in nodes:
        sequence = node.output[0]
        shape = _split_shape(node, types, constant)
        if sequence in outputs or shape is None:
            continue
        sizes, squeezed = shape
        pieces = _pieces(sequence, len(sizes), index.readers(sequence), constant)
        if pieces is not None:
            found[sequence] = StaticSplit(node, sizes, squeezed,
                                          tuple(index.readers(sequence)), pieces)
    return found


def _split_shape(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto],
                 constant: Callable[[str], np.ndarray | None]
                 ) -> tuple[tuple[int, ...], bool] | None:
    """``(the pieces' lengths, whether they lose the axis)`` of a SplitToSequence whose
    number of pieces is static, else None."""
    axis = int(attribute_value(node, "axis", 0))
    x_type = types.get(node.input[0])
    dims = (x_type.tensor_type.shape.dim if x_type is not None
            and x_type.tensor_type.HasField("shape") else None)
    length = None
    if dims is not None and -len(dims) <= axis < len(dims) and dims[axis].HasField("dim_value"):
        length = dims[axis].dim_value
    given = node.input[1] if len(node.input) > 1 else ""
    if not given:  # pieces of length 1
        if not length:
            return None
        return (1,) * length, int(attribute_value(node, "keepdims", 1)) == 0
    split = constant(given)
    if split is None or split.dtype.kind not in "iu" or split.ndim > 1:
        return None
    if split.ndim == 1:
        sizes = tuple(int(v) for v in split)
        if not sizes or min(sizes) < 0 or (length is not None and sum(sizes) != length):
            return None
        return sizes, False
    chunk = int(split)  # a scalar: pieces of this length, the last one maybe shorter
    if chunk <= 0 or not length:
        return None
    count = -(-length // chunk)
    return (chunk,) * (count - 1) + (length - chunk * (count - 1),), False


def _pieces(sequence: str, count: int, readers: Sequence[onnx.NodeProto],
            constant: Callable[[str], np.ndarray | None]) -> dict[str, int] | None:
    """Each SequenceAt reader's output -> the index of the piece it takes, when every
    reader of ``sequence`` takes a piece at a constant position, the count or all the
    pieces; else None."""
    pieces = {}
    for reader in readers:
        if (not is_default_domain(reader.domain) or not reader.input
                or reader.input[0] != sequence):
            return None
        if reader.op_type == "SequenceAt":
            position = constant(reader.input[1])
            if position is None or position.dtype.kind not in "iu" or position.size != 1:
                return None
            index = int(position.reshape(-1)[0])
            if not -count <= index < count:
                return None
            pieces[reader.output[0]] = index % count
        elif reader.op_type not in ("SequenceLength", "ConcatFromSequence"):
            return None
    return pieces


def _constants(graph: onnx.GraphProto) -> Callable[[str], np.ndarray | None]:
    """The value of a constant of ``graph`` by name (an initializer no input overrides, or
    a ``Constant`` node's output), read when asked; None for anything else."""
    fed = {v.name for v in graph.input}
    tensors = {t.name: t for t in graph.initializer if t.name not in fed}
    nodes = {n.output[0]: n for n in graph.node
             if is_onnx_op(n, "Constant")}

    def value(name: str) -> np.ndarray | None:
        if name in tensors:
            return tensor_array(tensors[name])
        for attribute in nodes[name].attribute if name in nodes else ():
            if attribute.name == "value":
                return numpy_helper.to_array(attribute.t)
            if attribute.name in ("value_int", "value_ints"):
                return np.asarray(helper.get_attribute_value(attribute), np.int64)
        return None

    return value


# -- trainable and blocked weights ------------------------------------------------------


def _loss_or_outputs(model: onnx.ModelProto) -> list[str]:
    """The outputs whose gradients train the model: its loss, else every output."""
    loss = get_roles(model).get("loss")
    return [loss] if loss else [o.name for o in model.graph.output]


def _view(model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto],
          splits_as_tensors: bool) -> Callable[[str], bool]:
    """Which values a gradient passes: float tensors, and with ``splits_as_tensors`` the
    sequences :class:`~lossgraph.passes.SequencesToTensors` turns into tensors (the model
    as compile_program differentiates it)."""
    is_float = _may_be_float(types)
    splits = static_splits(model.graph, types) if splits_as_tensors else {}
    if not splits:
        return is_float
    return lambda name: is_float(name) or name in splits


def _trainable(model: onnx.ModelProto, targets: Sequence[str],
               types: Mapping[str, onnx.TypeProto], splits_as_tensors: bool) -> list[str]:
    reached = _reaching(model, targets, _view(model, types, splits_as_tensors), trainable=True)
    return [t.name for t in model.graph.initializer
            if t.name in reached and t.data_type in FLOAT_TYPES and len(t.dims) > 0]


def trainable_initializers(model: ModelLike) -> list[str]:
    """The float initializers that influence a differentiable output, in graph order.

    The outputs considered are the loss when the model has one (see
    :mod:`lossgraph.roles`), else every float output. Excluded: integer tensors
    (shapes, class lists, indices), initializers reaching the outputs only through
    non-differentiable inputs, inputs that carry gradients but are not weights
    (batch-normalization statistics, class weights of the losses, one-hot values: the
    ``constant`` inputs of :func:`~lossgraph.autodiff.registry.grad_rule`), and rank-0
    scalars, which exporters use for constants (pass such a name explicitly to train it).

    The model is read as compile_program differentiates it: a ``SplitToSequence`` that
    :class:`~lossgraph.passes.SequencesToTensors` rewrites into a ``Split`` passes
    gradients. Weights that influence the outputs through other sequences (or optionals,
    maps) are :func:`blocked_initializers`.
    """
    model = as_model(model)
    check_model(model, "The model given to trainable_initializers")
    return _trainable(model, _loss_or_outputs(model), ForwardFacts.of(model).types, True)


@dataclass(frozen=True)
class BlockedWeight:
    """A float initializer (or input) whose influence on the outputs passes through a
    value lossgraph does not differentiate: a sequence, an optional or a map.

    ``path`` is the shortest way from the weight to such a value,
    ``[weight, node, value, ..., node, value]``; ``partial``: the weight also reaches the
    outputs through tensors alone, so a gradient would miss part of its effect rather
    than all of it.
    """

    name: str
    path: tuple
    kind: str
    partial: bool

    @property
    def value(self) -> str:
        """The value that blocks the gradient (the last one of ``path``)."""
        return self.path[-1]

    @property
    def node(self) -> onnx.NodeProto:
        """The node whose output blocks the gradient."""
        return self.path[-2]

    def describe(self) -> str:
        """``'w' -> [Op 'name'] -> ... -> 'value' (a sequence)``, for messages."""
        steps = [_label(p) if isinstance(p, onnx.NodeProto) else repr(p) for p in self.path]
        return f"{' -> '.join(steps)} ({self.kind})"


def _label(node: onnx.NodeProto) -> str:
    return f"[{node.op_type} {node.name!r}]" if node.name else f"[{node.op_type}]"


def blocked_weights(model: onnx.ModelProto, targets: Sequence[str],
                    types: Mapping[str, onnx.TypeProto], candidates: Sequence[str],
                    splits_as_tensors: bool = True) -> list[BlockedWeight]:
    """The ``candidates`` whose influence on ``targets`` passes through a sequence, an
    optional or a map that no gradient passes (:class:`BlockedWeight`), in their order;
    ``splits_as_tensors`` as for :func:`default_weights`."""
    if not any(_container(t) for t in types.values()):
        return []
    passes = _view(model, types, splits_as_tensors)

    def influences(name: str) -> bool:
        return passes(name) or _container(types.get(name)) is not None

    # from the float targets only: an output that is a sequence is no differentiable output
    outputs = [t for t in targets if passes(t)]
    blocking = {v for v in _reaching(model, outputs, influences, trainable=True)
                if not passes(v)}
    behind = _reaching(model, blocking, influences, trainable=True)
    reached = _reaching(model, outputs, passes, trainable=True)
    found = []
    for name in candidates:
        if name in behind:
            path = _path_within(model.graph, name, blocking, behind)
            found.append(BlockedWeight(name, tuple(path), _container(types[path[-1]]) or "",
                                       name in reached))
    return found


def _path_within(graph: onnx.GraphProto, source: str, targets: set[str],
                 within: set[str]) -> list:
    """``[source, node, value, ..., target]``: the shortest chain of nodes from ``source``
    to one of ``targets`` through values of ``within`` only (breadth first)."""
    path = shortest_path(graph, source, targets, within)
    if path is None:
        raise InternalError(f"{source!r} influences {sorted(targets)}, but no path leads there")
    return path


def blocked_initializers(model: ModelLike) -> list[BlockedWeight]:
    """The float initializers that would be :func:`trainable_initializers` (rank >= 1,
    weights rather than statistics) but influence the loss (else the float outputs)
    through a value lossgraph does not differentiate: a sequence other than a
    ``SplitToSequence`` :class:`~lossgraph.passes.SequencesToTensors` rewrites, an optional
    or a map. No gradient, or only part of one, would reach them, so compile_program
    refuses to choose its default weights around them (:func:`default_weights`)."""
    model = as_model(model)
    check_model(model, "The model given to blocked_initializers")
    types = ForwardFacts.of(model).types
    return blocked_weights(model, _loss_or_outputs(model), types, _candidates(model))


def _candidates(model: onnx.ModelProto) -> list[str]:
    """The initializers that may be weights: float, rank >= 1."""
    return [t.name for t in model.graph.initializer
            if t.data_type in FLOAT_TYPES and len(t.dims) > 0]


def default_weights(model: ModelLike, targets: Sequence[str] | None = None,
                    types: Mapping[str, onnx.TypeProto] | None = None,
                    splits_as_tensors: bool = True) -> list[str]:
    """The weights lossgraph trains when none are named: the trainable initializers that
    reach ``targets`` (default: the loss, else every output), or an
    :class:`~lossgraph.errors.UnsupportedModelError` when a weight influences them through
    a value lossgraph does not differentiate (:func:`blocked_initializers`): leaving it
    out silently would train another model. ``splits_as_tensors``: the model is
    differentiated after :class:`~lossgraph.passes.SequencesToTensors` (compile_program);
    False: as it is (:func:`lossgraph.gradient`)."""
    model = as_model(model)
    targets = list(targets) if targets is not None else _loss_or_outputs(model)
    types = ForwardFacts.of(model).types if types is None else types
    trainable = _trainable(model, targets, types, splits_as_tensors)
    blocked = blocked_weights(model, targets, types, _candidates(model), splits_as_tensors)
    if blocked:
        raise UnsupportedModelError(blocked_message(model, types, blocked, targets, trainable))
    return trainable


@dataclass(frozen=True)
class StuckWeight:
    """A weight whose every differentiable path to the targets passes an op whose gradient
    is zero everywhere (``Round``, ``Sign``, ``Hardmax``, ...): gradient descent never
    changes it. ``path`` is the shortest such path, ``[weight, node, value, ..., target]``;
    ``node`` the first zero-gradient op on it."""

    name: str
    path: tuple
    node: onnx.NodeProto

    def describe(self) -> str:
        """``'w' -> [MatMul] -> 'h' -> [Round] -> 'r' -> ... -> 'loss'``, for messages:
        the path up to the zero-gradient op's output, then its end."""
        shown = self.path[:self.path.index(self.node) + 2]
        steps = [_label(p) if isinstance(p, onnx.NodeProto) else repr(p) for p in shown]
        if len(shown) < len(self.path):
            steps += ["...", repr(self.path[-1])]
        return " -> ".join(steps)


def stuck_weights(model: onnx.ModelProto, weights: Sequence[str],
                  targets: Sequence[str] | None = None,
                  types: Mapping[str, onnx.TypeProto] | None = None) -> list[StuckWeight]:
    """The ``weights`` that reach ``targets`` (default: the loss, else every output)
    differentiably, but only through ops whose gradient is zero everywhere
    (:class:`StuckWeight`), in their order; a weight that also has another path is not."""
    if not any(zero_gradient_op(n.op_type, n.domain, opset_version(model, n.domain))
               for n in model.graph.node):
        return []  # the common case, without inferring shapes
    targets = list(targets) if targets is not None else _loss_or_outputs(model)
    types = ForwardFacts.of(model).types if types is None else types
    passes = _may_be_float(types)
    reached = _reaching(model, targets, passes, trainable=False)
    live = _reaching(model, targets, passes, trainable=False, through_zero=False)
    stuck = []
    for name in weights:
        if name not in reached or name in live:
            continue
        path = shortest_path(model.graph, name, set(targets), reached)
        zero = [p for p in path or () if isinstance(p, onnx.NodeProto) and zero_gradient_op(
            p.op_type, p.domain, opset_version(model, p.domain))]
        if path is not None and zero:
            stuck.append(StuckWeight(name, tuple(path), zero[0]))
    return stuck


def blocked_message(model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto],
                    blocked: Sequence[BlockedWeight], targets: Sequence[str],
                    trainable: Sequence[str] | None = None) -> str:
    """Why the ``blocked`` weights get no gradient, or a partial one, and the ways out:
    for the default weights (``trainable``: the weights that do get a gradient) or for
    weights named (``trainable=None``)."""
    shown = repr(targets[0]) if len(targets) == 1 else repr(list(targets))
    names = ", ".join(repr(b.name) for b in blocked)
    lines = "".join(f"\n  {b.describe()}" + (", and through tensors alone: its gradient "
                                              "would be partial" if b.partial else "")
                    for b in blocked)
    hints = dict.fromkeys(hint for b in blocked for hint in (
        _split_hint(model, b.node, types), _EXPORT_HINTS.get(b.node.op_type)) if hint)
    tensors = ("make these values tensors: "
               + ("; ".join(hints) if hints else "export the model so that they are") + ".")
    head = (f"Weight{'s' * (len(blocked) > 1)} {names} influence{'s' * (len(blocked) == 1)} "
            f"{shown} through values lossgraph does not differentiate (it differentiates "
            f"tensors only):{lines}\n")
    if trainable is None:
        return head + ("A gradient would miss that part of their effect: a wrong number. "
                       "Leave them out of the weights to differentiate, or " + tensors)
    complete = [w for w in trainable if w not in {b.name for b in blocked}]
    listed = (f" (those whose gradient is complete: {', '.join(map(repr, complete))})"
              if complete else "")
    them = "them" if len(blocked) > 1 else "it"
    return head + (f"lossgraph chooses no default weights around {them}: training the others "
                   "alone would silently train another model. Name the weights to train with "
                   f"weights=[...]{listed}, or " + tensors)


#: What avoids a blocking node, by its op type, for the message of a blocked weight.
_EXPORT_HINTS = {
    "SplitToSequence": "torch.onnx.export(..., dynamo=True) with its default optimize=True "
                       "writes torch.split as Split",
    "Loop": "e.g. torch.onnx.export(..., dynamo=True) writes nn.EmbeddingBag as a Loop "
            "that collects a sequence; the TorchScript exporter (dynamo=False) writes it as "
            "a Loop over tensors, which trains",
}


# -- weights an exporter tied or froze ---------------------------------------------------


@dataclass(frozen=True)
class TiedWeight:
    """A float initializer read by several layers that look independent: two nodes of one
    op type or more read it at the same input (the LayerNorm scales of different blocks,
    the biases of different Linear layers), directly or through ``Identity`` nodes (torch's
    legacy exporter names each merged parameter by one). torch's exporters merge
    initializers of equal values (a fresh model's unit LayerNorm scales and zero biases,
    a layer's copies): the model then trains them as one weight, which torch does not.

    ``readers`` are ``(node, input position)`` of every layer reading it, in graph order
    (position -1: a subgraph of the node captures it).
    """

    name: str
    readers: tuple[tuple[onnx.NodeProto, int], ...]

    def describe(self, most: int = 4) -> str:
        """``'w' (read by 5 layers: LayerNormalization 'a', 'b', ... and Add 'c')``."""
        labels = [f"{n.op_type} {n.name or n.output[0]!r}" for n, _ in self.readers]
        shown = ", ".join(labels[:most]) + (f" and {len(labels) - most} more"
                                            if len(labels) > most else "")
        return f"{self.name!r} (read by {len(labels)} layers: {shown})"


def layer_readers(graph: onnx.GraphProto, name: str, index: GraphIndex | None = None
                  ) -> list[tuple[onnx.NodeProto, int]]:
    """``(node, input position)`` of each node of ``graph`` reading ``name``, the readers
    of an ``Identity`` of it in the ``Identity``'s stead (an ``Identity`` whose output is a
    graph output counts itself), in graph order; -1 for a node whose subgraph captures it.
    ``index``: ``graph``'s, when the caller has it."""
    index = index or GraphIndex(graph.node)
    outputs = {o.name for o in graph.output}
    order = {id(node): position for position, node in enumerate(graph.node)}
    found: list[tuple[onnx.NodeProto, int]] = []
    pending = [name]
    while pending:
        value = pending.pop()
        for node in index.readers(value):
            if is_onnx_op(node, "Identity") and node.output[0] not in outputs:
                pending.append(node.output[0])
                continue
            positions = [p for p, i in enumerate(node.input) if i == value] or [-1]
            found += [(node, p) for p in positions]
    return sorted(found, key=lambda reader: (order[id(reader[0])], reader[1]))


def tied_initializers(model: ModelLike, candidates: Sequence[str] | None = None
                      ) -> list[TiedWeight]:
    """The ``candidates`` (default: :func:`trainable_initializers`) of more than one value
    that several layers read as if each had its own (:class:`TiedWeight`), in their order.
    A weight two different layers share on purpose (a language model's embedding and
    output projection: a Gather and a MatMul) is not one, nor one that ops read in parts
    (:data:`_PART_READS`: an LSTM's gates sliced out of one weight)."""
    model = as_model(model)
    candidates = trainable_initializers(model) if candidates is None else candidates
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer
             if t.data_type in FLOAT_TYPES}
    index = GraphIndex(model.graph.node)
    found = []
    for name in candidates:
        if sizes.get(name, 0) <= 1:  # one value: a constant in all likelihood
            continue
        readers = layer_readers(model.graph, name, index)
        kinds = Counter((n.domain, n.op_type, p) for n, p in readers if p >= 0
                        and not (is_default_domain(n.domain) and n.op_type in _PART_READS))
        if kinds and max(kinds.values()) >= 2:
            found.append(TiedWeight(name, tuple(readers)))
    return found


#: Ops that read a part of a tensor, or its shape: several of them reading one weight
#: take its parts (an LSTM's gates, an embedding's rows), not each a copy of its own.
_PART_READS = ("Slice", "Split", "Gather", "GatherElements", "GatherND", "Shape", "Size")

#: A float constant of at least this many values that feeds a product like a weight is
#: reported by :func:`constant_weights`.
LARGE_CONSTANT = 16
#: The inputs where a tensor is a layer's weight: (op type, input positions).
_WEIGHT_INPUTS = {"MatMul": (0, 1), "Gemm": (0, 1), "Conv": (1,), "ConvTranspose": (1,),
                  "Gather": (0,), "Einsum": None}
#: Ops between a constant and the product it feeds that only lay its values out.
_LAYOUT_OPS = ("Identity", "Transpose", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Flatten")


@dataclass(frozen=True)
class ConstantWeight:
    """A float ``Constant`` node of :data:`LARGE_CONSTANT` values or more that feeds a
    product like a weight (a MatMul, Gemm, Conv or Einsum operand, a Gather's table),
    maybe through ops that lay it out (Transpose, Reshape, ...): an exporter folded what
    may be a parameter into a constant, which lossgraph does not train unless
    ``weights=`` names it (:class:`~lossgraph.passes.ConstantsToInitializers`)."""

    name: str
    node: onnx.NodeProto
    reader: onnx.NodeProto
    elem_type: int
    dims: tuple[int, ...]


def constant_weights(model: ModelLike) -> list[ConstantWeight]:
    """The :class:`ConstantWeight` of ``model``'s graph, in graph order."""
    model = as_model(model)
    graph = model.graph
    index = GraphIndex(graph.node)
    found = []
    for node in graph.node:
        tensor = _constant_tensor(node)
        if tensor is None or tensor.data_type not in FLOAT_TYPES \
                or math.prod(tensor.dims) < LARGE_CONSTANT:
            continue
        reader = _product_reading(index, node.output[0])
        if reader is not None:
            found.append(ConstantWeight(node.output[0], node, reader, tensor.data_type,
                                        tuple(tensor.dims)))
    return found


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor of a ``Constant`` node given by its ``value`` attribute, else None."""
    if not is_onnx_op(node, "Constant"):
        return None
    return next((a.t for a in node.attribute if a.name == "value"), None)


def _product_reading(index: GraphIndex, name: str) -> onnx.NodeProto | None:
    """The first product reading ``name`` as a weight, through layout ops; else None."""
    pending, seen = [name], set()
    while pending:
        value = pending.pop(0)
        seen.add(value)
        for node in index.readers(value):
            if not is_default_domain(node.domain):
                continue
            if node.op_type in _LAYOUT_OPS and node.input[0] == value:
                pending += [o for o in node.output if o and o not in seen]
                continue
            positions = _WEIGHT_INPUTS.get(node.op_type, ())
            if positions is None or any(node.input[p] == value for p in positions
                                        if p < len(node.input)):
                return node
    return None


# -- weights an exporter computed from the module's parameters ---------------------------

#: Where torch's dynamo exporter records the module's parameters and buffers.
TORCH_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
#: Where onnxscript's optimizer (the dynamo exporter's ``optimize=True``) records the
#: rewrite rules that made a node.
_REWRITE_RULES = "pkg.onnxscript.rewriter.rule_name"
#: The ops torch's legacy exporter names a transposed ``Linear`` weight after when it
#: folds the transpose (``onnx::MatMul_123``): a layout of a parameter, trained as one.
_LAYOUT_FOLDS = ("MatMul",)


@dataclass(frozen=True)
class FoldedWeight:
    """A weight of the export that is not a parameter of the module it came from, or a
    parameter the export dropped: torch's exporters fold computations of parameters alone
    into initializers (a BatchNorm into the Conv before it, a weight norm, a table
    gathered by constant indices), remove zero biases and store a tied tensor twice.
    Training the export then trains another model than the module; exporting without
    folding (``optimize=False``, ``do_constant_folding=False``) keeps the parameters.

    ``name`` is the initializer (or, for a dropped parameter, the module's parameter);
    ``how`` says what the exporter did.
    """

    name: str
    how: str

    def describe(self) -> str:
        """``'conv1.weight' (BatchNorm 'bn1' folded in ...)``."""
        return f"{self.name!r} ({self.how})"


def folded_weights(model: ModelLike, candidates: Sequence[str] | None = None
                   ) -> list[FoldedWeight]:
    """The :class:`FoldedWeight` of ``model`` among ``candidates`` (default:
    :func:`trainable_initializers`): a candidate that holds another initializer's values
    (or their transpose), and in torch's exports what the export records it folded:
    the dynamo exporter's optimizer rules (its graph signature names the parameters) and
    the legacy exporter's folded values (initializers it names ``onnx::<Op>_<n>``, but a
    transposed ``Linear`` weight)."""
    model = as_model(model)
    candidates = trainable_initializers(model) if candidates is None else list(candidates)
    found = _copies(model, candidates)
    signature = next((p.value for p in model.graph.metadata_props if p.key == TORCH_SIGNATURE),
                     None)
    if signature is not None:
        found += _optimizer_folds(model, signature)
    elif model.producer_name == "pytorch":
        found += _legacy_folds(model, candidates)
    seen: set[str] = set()
    return [f for f in found if not (f.name in seen or seen.add(f.name))]


def _float_values(tensor: onnx.TensorProto) -> np.ndarray | None:
    """A float initializer's values of :data:`LARGE_CONSTANT` or more, not all equal (a
    fresh model's zero biases are equal by design, not copies); else None."""
    if tensor.data_type not in FLOAT_TYPES or math.prod(tensor.dims) < LARGE_CONSTANT \
            or tensor.data_location == onnx.TensorProto.EXTERNAL and not is_held(tensor):
        return None
    values = tensor_array(tensor)
    flat = values.reshape(-1)
    return None if bool(np.all(flat == flat[0])) else values


def _copies(model: onnx.ModelProto, candidates: Sequence[str]) -> list[FoldedWeight]:
    """Candidates holding the values of an earlier initializer, or their transpose (a tied
    embedding stored again for the output projection). Tensors of one size are compared
    by their sums first, one tensor's values in memory at a time beyond the pair."""
    wanted = set(candidates)
    tensors = {t.name: t for t in model.graph.initializer}
    by_size: dict[tuple[int, int], list[onnx.TensorProto]] = {}
    for tensor in model.graph.initializer:
        by_size.setdefault((tensor.data_type, math.prod(tensor.dims)), []).append(tensor)
    found = []
    for group in by_size.values():
        if len(group) < 2 or not any(t.name in wanted for t in group):
            continue
        sums: list[tuple[str, float]] = []
        for tensor in group:
            values = _float_values(tensor)
            if values is None:
                continue
            total = float(np.sum(values, dtype=np.float64))
            copy = next(((name, layout) for name, other in sums if tensor.name in wanted
                         and math.isclose(other, total, rel_tol=1e-9, abs_tol=1e-9)
                         for layout in [_copy_layout(tensor_array(tensors[name]), values)]
                         if layout is not None), None)
            if copy is None:
                sums.append((tensor.name, total))
                continue
            original, layout = copy
            found.append(FoldedWeight(
                tensor.name, f"a copy of {original!r}{layout}: the export stores one tensor "
                "twice (a tied embedding and output projection), and the copies train apart"))
    return found


def _copy_layout(a: np.ndarray, b: np.ndarray) -> str | None:
    """How ``b`` holds ``a``'s values: ``""`` as they are, ``", transposed"`` their
    transpose (2-D); None when it does not."""
    if a.shape == b.shape and np.array_equal(a, b):
        return ""
    if a.ndim == 2 and a.T.shape == b.shape and np.array_equal(a.T, b):
        return ", transposed"
    return None


def _optimizer_folds(model: onnx.ModelProto, signature: str) -> list[FoldedWeight]:
    """What the dynamo exporter's optimizer recorded folding: a BatchNorm into the Conv
    before it, a zero bias removed; and parametrized weights computed at export."""
    parameters = re.findall(r"PARAMETER target='([^']+)'", signature)
    stored = {t.name for t in model.graph.initializer}
    dropped = [p for p in parameters
               if p not in stored and p not in {i.name for i in model.graph.input}]
    found = []
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        rules = [r.strip() for r in meta.get(_REWRITE_RULES, "").split(",") if r.strip()]
        if not rules:
            continue
        scopes = torch_name_scopes(node)
        module = next((s for s in reversed(scopes)
                       if any(p.startswith(s + ".") for p in parameters)), None)
        fused = next((r for r in rules if r.startswith("Fuse")), None)
        removed = next((r for r in rules if r.startswith("RemoveOptionalBias")), None)
        if fused and module:
            found += [FoldedWeight(name, f"'{module}' folded in by torch's optimizer ({fused})")
                      for name in node.input[1:] if name in stored]
        elif removed and module:
            found += [FoldedWeight(p, f"a zero bias torch's optimizer removed ({removed}): the "
                                   "layer has no bias to train")
                      for p in dropped if p.startswith(module + ".") and p.endswith("bias")]
    parametrized: dict[str, list[str]] = {}
    for p in dropped:
        if ".parametrizations." in p:
            owner, _, rest = p.partition(".parametrizations.")
            parametrized.setdefault(f"{owner}.{rest.split('.')[0]}", []).append(p)
    found += [FoldedWeight(weight, f"computed at export from its parametrization "
                           f"({', '.join(map(repr, originals))}), which does not train")
              for weight, originals in parametrized.items()]
    return found


def _legacy_folds(model: onnx.ModelProto, candidates: Sequence[str]) -> list[FoldedWeight]:
    """Candidates torch's legacy exporter computed by constant folding: it names them
    ``onnx::<Op>_<n>`` after their reader (a weight norm's ``onnx::Conv_12``, a gathered
    position table's ``onnx::Add_34``), where it names parameters after the module. A
    vector (one dimension above 1: a scale reshaped to broadcast) or a transposed ``Linear``
    weight is a parameter laid out otherwise, which trains as the parameter does."""
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer
            if t.data_type in FLOAT_TYPES}
    found = []
    for name in candidates:
        match = re.fullmatch(r"onnx::(\w+?)_\d+", name)
        shape = dims.get(name, ())
        if match and match.group(1) not in _LAYOUT_FOLDS and \
                math.prod(shape) >= LARGE_CONSTANT and sum(d > 1 for d in shape) > 1:
            found.append(FoldedWeight(
                name, f"computed at export by torch's constant folding, read by a "
                f"{match.group(1)}: no parameter of the module"))
    return found


# -- weights left out of weight decay ----------------------------------------------------

#: Where an op reads a bias or a normalization's scale or shift: (op type, input positions).
_NO_DECAY_INPUTS = {"Gemm": (2,), "Conv": (2,), "ConvTranspose": (2,), "RNN": (3,),
                    "GRU": (3,), "LSTM": (3,), "LayerNormalization": (1, 2),
                    "BatchNormalization": (1, 2), "InstanceNormalization": (1, 2),
                    "GroupNormalization": (1, 2)}
#: Products whose output an Add of a weight biases (torch's Linear: MatMul then Add).
_PRODUCTS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")


def no_decay_weights(model: ModelLike, weights: Sequence[str]) -> list[str]:
    """The ``weights`` that are biases or normalization scales and shifts, in their order:
    what Hugging Face's Trainer leaves out of weight decay (every bias, every LayerNorm
    weight), found from the main graph's ops rather than the names:

    - the bias input of Gemm (C), Conv and ConvTranspose (B), RNN, GRU and LSTM (B);
    - a weight added to the output of a MatMul, Gemm, Conv, ConvTranspose or Einsum (a
      Linear layer as torch exports it);
    - the scale and shift of LayerNormalization, BatchNormalization, InstanceNormalization
      and GroupNormalization;
    - the scale and shift of a layer norm written out in ops, as torch's exporter writes it
      below opset 17: ``Div(Sub(x, ReduceMean(x)), Sqrt(...))``, then ``Mul`` by the scale,
      then ``Add`` of the shift.

    Each weight may be read through ops that only lay it out (Identity, Reshape, Cast,
    Unsqueeze, ...).
    """
    graph = as_model(model).graph
    index = GraphIndex(graph.node)
    wanted = set(weights)

    def weight_of(value: str) -> str | None:
        """The weight ``value`` lays out, or None."""
        seen = set()
        while value not in wanted:
            node = index.producer(value)
            if node is None or value in seen or not is_default_domain(node.domain) \
                    or node.op_type not in _LAYOUT_OPS:
                return None
            seen.add(value)
            value = node.input[0]
        return value

    def made_by(value: str, *op_types: str) -> onnx.NodeProto | None:
        node = index.producer(value)
        return node if node is not None and is_default_domain(node.domain) \
            and node.op_type in op_types else None

    found: set[str] = set()
    for node in graph.node:
        if not is_default_domain(node.domain):
            continue
        found.update(weight_of(node.input[p]) for p in _NO_DECAY_INPUTS.get(node.op_type, ())
                     if p < len(node.input) and node.input[p])
        if node.op_type == "Add":
            for this, other in ((0, 1), (1, 0)):
                if made_by(node.input[other], *_PRODUCTS):
                    found.add(weight_of(node.input[this]))
        if node.op_type == "Div" and _normalizes(node, made_by):
            for scaling in index.readers(node.output[0]):
                if is_onnx_op(scaling, "Mul"):
                    scales = [weight_of(i) for i in scaling.input if i != node.output[0]]
                    if any(scales):
                        found.update(scales)
                        found.update(weight_of(i) for shifting in index.readers(
                            scaling.output[0]) if is_onnx_op(shifting, "Add")
                            for i in shifting.input if i != scaling.output[0])
    return [w for w in weights if w in found]


def _normalizes(node: onnx.NodeProto, made_by: Callable[..., onnx.NodeProto | None]) -> bool:
    """Whether the Div ``node`` is a layer norm's ``(x - mean(x)) / sqrt(var + eps)``."""
    centred = made_by(node.input[0], "Sub")
    return centred is not None and made_by(centred.input[1], "ReduceMean") is not None \
        and made_by(node.input[1], "Sqrt") is not None


def excluded_from_decay(model: ModelLike, weights: Sequence[str], patterns: str | Sequence[str],
                        option: str) -> list[str]:
    """The ``weights`` an ``exclude_from_weight_decay`` option (``option``, for the message)
    selects: :func:`no_decay_weights` for ``"auto"``, else those its names and regular
    expressions select (:func:`lossgraph.options.select_weights`: one that selects none is
    an error listing the weights)."""
    if patterns == "auto":
        return no_decay_weights(model, weights)
    return select_weights(option, patterns, weights)
