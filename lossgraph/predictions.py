"""What a model's float outputs hold, as far as its graph proves it, and the loss each takes.

A classifier exported by skl2onnx gives a label and, in another output, class
probabilities (or, for a classifier without them such as ``SGDClassifier``'s default
hinge loss, its raw class scores under the name ``probabilities``); a regressor gives
values. Which loss fits depends on which of these the trained output is, so
:func:`output_kind` reads it from the nodes that compute it (through ``Identity``,
``Reshape``, ``Flatten``, ``Squeeze``, ``Unsqueeze`` and float ``Cast``)::

    probabilities   Softmax; Sigmoid (also spelled 1 / (1 + Exp(t))); Concat(1 - p, p);
                    Div(a, d(ReduceSum(a))), a row of non-negative values divided by an
                    expression of its sum (skl2onnx's one-vs-rest and Normalizer forms)
    scores          read by ArgMax or ArgMin (the label's source), by TopK, or compared
                    with Greater or Less: class scores whose largest is the class
    values          Gemm, MatMul, Conv, ConvTranspose, Einsum, Add, Sub, Neg, Relu
                    (and Concat of such): unbounded values, no probability
    unknown         anything else (a graph input, an op not listed)

and :func:`default_loss` picks the loss that fits (``loss="auto"``, compile's default)::

    probabilities   binary_log_loss for one probability or two columns,
                    multiclass_log_loss for more (scikit-learn's log loss)
    scores          logistic for one score, multiclass_log_loss with from_logits=True
                    for more
    values, unknown squared_error

:func:`mismatch` names the loss that fits when the one given does not: squared error on
probabilities or class scores (they are fitted with class labels, by a log loss), a log
loss of probabilities on scores or values (it clips them into [eps, 1 - eps]), a loss of
scores on probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from .graphs import GraphIndex, attribute_value, is_default_domain, tensor_array

__all__ = ["OutputKind", "output_kind", "default_loss", "mismatch", "PROBABILITIES",
           "SCORES", "VALUES", "UNKNOWN", "REGRESSION_LOSSES"]

PROBABILITIES, SCORES, VALUES, UNKNOWN = "probabilities", "scores", "values", "unknown"
#: The losses of regression values (what class outputs do not take).
REGRESSION_LOSSES = ("squared_error", "half_squared_error", "absolute_error", "elastic",
                     "huber")

_PASS_THROUGH = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})
_UNBOUNDED = frozenset({"Gemm", "MatMul", "Conv", "ConvTranspose", "Einsum", "Add", "Sub",
                        "Neg", "Relu"})
_NON_NEGATIVE = frozenset({"Sigmoid", "Softmax", "Exp", "Abs", "Relu"})
_DECIDERS = frozenset({"ArgMax", "ArgMin", "TopK", "Greater", "Less"})
#: Ops whose output is a boolean: 0 or 1 once cast to a number.
_BOOLEAN = frozenset({"Not", "And", "Or", "Xor", "Equal", "Greater", "GreaterOrEqual", "Less",
                      "LessOrEqual", "IsNaN", "IsInf"})
#: How far back from a division :func:`output_kind` looks for the row sum it divides by.
_SUM_DEPTH = 6


@dataclass(frozen=True)
class OutputKind:
    """What output ``name`` holds: ``kind`` (:data:`PROBABILITIES`, :data:`SCORES`,
    :data:`VALUES` or :data:`UNKNOWN`), ``evidence`` (the node that shows it, in words),
    ``rank`` and ``classes`` (its last dimension; None when unknown or rank < 2)."""

    name: str
    kind: str
    evidence: str
    rank: int | None
    classes: int | None

    def __str__(self) -> str:
        what = {PROBABILITIES: "class probabilities", SCORES: "class scores",
                VALUES: "values", UNKNOWN: "values of unknown kind"}[self.kind]
        return f"{what} ({self.evidence})" if self.evidence else what


def _label(node: onnx.NodeProto) -> str:
    return f"the {node.op_type} node {node.name!r}" if node.name else f"the {node.op_type} node"


def _is_one(graph: onnx.GraphProto, name: str) -> bool:
    """Whether ``name`` is a constant whose every element is exactly 1."""
    for tensor in graph.initializer:
        if tensor.name == name:
            values = tensor_array(tensor)
            return values.size > 0 and bool((values == 1).all())
    for node in graph.node:
        if name in node.output and node.op_type == "Constant":
            value = attribute_value(node, "value")
            if isinstance(value, onnx.TensorProto):
                values = onnx.numpy_helper.to_array(value)
                return values.size > 0 and bool((values == 1).all())
    return False


class _Reader:
    """Walks back from a value through the nodes that compute it."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.index = GraphIndex(graph.node)

    def source(self, name: str) -> tuple[str, onnx.NodeProto | None]:
        """``name`` followed back through pass-through ops: the value and its producer."""
        node = self.index.producer(name)
        while node is not None and is_default_domain(node.domain) \
                and node.op_type in _PASS_THROUGH and node.input:
            name = node.input[0]
            node = self.index.producer(name)
        return name, node

    def probability(self, name: str) -> onnx.NodeProto | None:
        """The node proving ``name`` a probability (or a row of them), or None."""
        _, node = self.source(name)
        if node is None or not is_default_domain(node.domain):
            return None
        op = node.op_type
        if op in ("Softmax", "Sigmoid"):
            return node
        if op in ("Reciprocal", "Div") and self._sigmoid_form(node):
            return node
        if op == "Concat" and len(node.input) == 2 and self._complement(node):
            return node
        if op == "Div" and self._normalized(node):
            return node
        return None

    def _sigmoid_form(self, node: onnx.NodeProto) -> bool:
        """``Reciprocal(Add(1, Exp(t)))`` or ``Div(1, Add(1, Exp(t)))``."""
        if node.op_type == "Div" and not _is_one(self.graph, node.input[0]):
            return False
        _, add = self.source(node.input[-1])
        if add is None or add.op_type != "Add":
            return False
        ones = [i for i in add.input if _is_one(self.graph, i)]
        others = [self.source(i)[1] for i in add.input if not _is_one(self.graph, i)]
        return len(ones) == 1 and len(others) == 1 and others[0] is not None \
            and others[0].op_type == "Exp"

    def _complement(self, node: onnx.NodeProto) -> bool:
        """``Concat(1 - p, p)``: two columns of complementary probabilities."""
        first, second = node.input
        _, sub = self.source(first)
        return (sub is not None and sub.op_type == "Sub" and _is_one(self.graph, sub.input[0])
                and self.source(sub.input[1])[0] == self.source(second)[0]
                and self.probability(second) is not None)

    def _non_negative(self, name: str, depth: int = 0) -> bool:
        _, node = self.source(name)
        if node is None or not is_default_domain(node.domain) or depth > 4:
            return False
        if node.op_type in _NON_NEGATIVE or node.op_type in _BOOLEAN \
                or self.probability(name) is not None:
            return True
        return node.op_type in ("Mul", "Add", "Div") and all(
            self._non_negative(i, depth + 1) for i in node.input)

    def _normalized(self, node: onnx.NodeProto) -> bool:
        """``Div(a, d)`` with ``a`` non-negative and, among ``d``'s nearest ancestors, a
        ``ReduceSum`` of ``a``, of a value ``a`` is computed from, or of its ``Abs``."""
        numerator, producer = self.source(node.input[0])
        if not self._non_negative(numerator):
            return False
        family = {numerator} | {self.source(i)[0] for i in (producer.input if producer else ())}
        frontier, seen = [node.input[1]], set()
        for _ in range(_SUM_DEPTH):
            following = []
            for value in frontier:
                _, parent = self.source(value)
                if parent is None or value in seen:
                    continue
                seen.add(value)
                if parent.op_type == "ReduceSum":
                    summed, inner = self.source(parent.input[0])
                    if summed in family or (inner is not None and inner.op_type == "Abs"
                                            and self.source(inner.input[0])[0] in family):
                        return True
                following.extend(parent.input)
            frontier = following
        return False

    def decider(self, name: str) -> onnx.NodeProto | None:
        """A node choosing the class from ``name`` (ArgMax, TopK, a comparison), or None."""
        frontier, seen = [name], set()
        while frontier:
            value = frontier.pop()
            if value in seen:
                continue
            seen.add(value)
            for reader in self.index.readers(value):
                if not is_default_domain(reader.domain):
                    continue
                if reader.op_type in _DECIDERS:
                    return reader
                if reader.op_type in _PASS_THROUGH:
                    frontier.extend(reader.output)
        return None

    def unbounded(self, name: str, depth: int = 0) -> onnx.NodeProto | None:
        """The node computing ``name`` as unbounded values (an affine op, or a Concat or
        Mul with one), or None."""
        _, node = self.source(name)
        if node is None or not is_default_domain(node.domain) or depth > 4:
            return None
        if node.op_type in _UNBOUNDED:
            return node
        if node.op_type in ("Concat", "Mul") and any(
                self.unbounded(i, depth + 1) is not None for i in node.input):
            return node
        return None


def output_kind(model: onnx.ModelProto, name: str) -> OutputKind:
    """What the value ``name`` of ``model``'s main graph holds (module docstring)."""
    graph = model.graph
    declared = next((v for v in (*graph.output, *graph.value_info, *graph.input)
                     if v.name == name), None)
    rank = classes = None
    if declared is not None and declared.type.tensor_type.HasField("shape"):
        dims = declared.type.tensor_type.shape.dim
        rank = len(dims)
        if rank >= 2 and dims[-1].HasField("dim_value"):
            classes = dims[-1].dim_value
    reader = _Reader(graph)
    proof = reader.probability(name)
    if proof is not None:
        return OutputKind(name, PROBABILITIES, f"made by {_label(proof)}", rank, classes)
    decider = reader.decider(name)
    if decider is not None:
        return OutputKind(name, SCORES, f"read by {_label(decider)}", rank, classes)
    unbounded = reader.unbounded(name)
    if unbounded is not None:
        return OutputKind(name, VALUES, f"made by {_label(unbounded)}", rank, classes)
    return OutputKind(name, UNKNOWN, "", rank, classes)


def _single(kind: OutputKind) -> bool:
    """One probability or score per row: shape (N,) or (N, 1)."""
    return kind.rank == 1 or (kind.rank == 2 and kind.classes == 1)


def default_loss(kind: OutputKind) -> tuple[str, dict[str, Any]]:
    """The loss (and its options) that fits the output ``kind`` (module docstring)."""
    if kind.kind == PROBABILITIES:
        binary = _single(kind) or (kind.rank == 2 and kind.classes == 2)
        return ("binary_log_loss" if binary else "multiclass_log_loss"), {}
    if kind.kind == SCORES:
        return ("logistic", {}) if _single(kind) else ("multiclass_log_loss",
                                                       {"from_logits": True})
    return "squared_error", {}


def _spelled(loss: str, options: Mapping[str, Any]) -> str:
    extra = "".join(f", {k}={v!r}" for k, v in options.items())
    return f"loss={loss!r}{extra}"


def mismatch(kind: OutputKind, loss: str, options: Mapping[str, Any]) -> str | None:
    """Why ``loss`` (with its ``options``) does not fit the output ``kind``, naming the
    loss that does; None when it fits or the kind is not known."""
    fitting, fitting_options = default_loss(kind)
    right = _spelled(fitting, fitting_options)
    from_logits = bool(options.get("from_logits"))
    what = f"output {kind.name!r} holds {kind}"
    if kind.kind in (PROBABILITIES, SCORES) and loss in REGRESSION_LOSSES:
        return (f"{what}: a classifier's output, fitted to class labels by a log loss, not "
                f"by loss={loss!r} (which would need a float target per column). Use {right}")
    log_of_probabilities = loss == "binary_log_loss" or (loss == "multiclass_log_loss"
                                                         and not from_logits)
    if kind.kind == SCORES and log_of_probabilities:
        return (f"{what}, not probabilities: loss={loss!r} would clip them into "
                f"[eps, 1 - eps]. Use {right}")
    if kind.kind == VALUES and log_of_probabilities:
        logits = ("loss='logistic'" if _single(kind) else
                  "loss='multiclass_log_loss' with from_logits=True")
        return (f"{what}, not probabilities: loss={loss!r} would clip them into "
                f"[eps, 1 - eps]. For class scores (logits) use {logits}; for a regression "
                "loss='squared_error'")
    if kind.kind == PROBABILITIES and (loss == "logistic" or from_logits):
        return (f"{what}, not raw scores: {_spelled(loss, options)} would apply a sigmoid or "
                f"softmax to them again. Use {right}")
    return None
