"""stabilize_numerics: the overflowing forms converters emit, rewritten into stable ones::

    Reciprocal(Add(1, Exp(t)))     ->  Exp(Neg(softplus(t)))       = Sigmoid(s) for t = -s
    Div(1, Add(1, Exp(t)))         ->  Exp(Neg(softplus(t)))
    Log(Add(1, Exp(x)))            ->  softplus(x)
    Log(Sigmoid(x))                ->  Neg(softplus(Neg(x)))
    Log(Sub(1, Sigmoid(x)))        ->  Neg(softplus(x))            (also Add(1, Neg(Sigmoid(x))))
    Log(Softmax(x; axis))          ->  LogSoftmax(x; axis)
    Log(ReduceSum(Exp(x); axes))   ->  ReduceLogSumExp(x; axes)     (backend "onnx" only)
    Log(Exp(y))                    ->  y                            (Identity)

    softplus(x) = Softplus(x)                                   float, backend "onnx"
                = (x + |x|) / 2 + Log(Add(Exp(Neg(Abs(x))), 1))   double, or backend "ort"

with ``1`` an exact constant one and ``Add`` matched with its operands in either order.
The forms chain: ``Log(Reciprocal(Add(1, Exp(t))))`` becomes ``Neg(softplus(t))``.

Why: ``1 / (1 + Exp(-s))``, skl2onnx's probability for ``SGDClassifier(loss="log_loss")``
and ``torch``'s spelled-out sigmoid, is right in the forward pass (``1 / inf = 0``), but
past ``s = -88`` in float32 ``Exp`` overflows and the chain rule meets ``0 * inf``: the
gradient is NaN. ``Log(Softmax)``, ``Log(Sigmoid)`` (``torch.nn.functional.logsigmoid``
and the TorchScript export of ``binary_cross_entropy_with_logits``) and ``Log(1 - Sigmoid)``
take ``Log(0) = -inf`` once the probability underflows, and ``Log(1 + Exp(x))`` overflows
to ``inf`` past ``x = 88``. In every stable form ``Exp`` reads a value that is never
positive, or ``Log`` one that is never below 1, so forward and gradient stay finite.

Where both forms are finite they give the same numbers, to float rounding, and where the
original loses digits (``Log(1 - Sigmoid(x))`` near 1) the stable form keeps them. The sigmoid
is emitted as ``Exp(Neg(Softplus(t)))`` rather than onnxruntime's ``Sigmoid`` kernel, which
is accurate to about 6e-8 absolute only (measured, onnxruntime 1.19 and 1.32, float32:
``Sigmoid(-17) = 8.9e-8`` for 4.1e-8, 0 from -18 on; in double 0 from -37 on): a
normalization of one-vs-rest sigmoids (skl2onnx's multiclass ``SGDClassifier``) would
turn those tails into wrong probabilities, and ``Softplus`` is exact in both tails, in
as many kernels (three) as the form it replaces. ``Softplus`` has no double kernel in
onnxruntime at opsets 13 and 21, and at 18 it runs its function body, ``Log(Exp(x) + 1)``,
which overflows: double gets the explicit form. onnxruntime-training's gradient builder
has no rule for ``Softplus`` and fails on ``ReduceLogSumExp``: with ``backend="ort"`` the
explicit form is used and the log-sum-exp form is left alone.

What is matched, so that the result is provably the same value:

- the constant ``1`` is an initializer (not a graph input, which could be fed) or a
  ``Constant`` node, float or double, every element exactly 1, of a shape that broadcasts
  to the other operand's shape without enlarging it;
- a form's nodes are in one graph (a constant of an outer scope is not taken for one),
  in the standard domain; the root's element type is float or double;
- a form whose ``Exp`` reads a value that cannot be positive (``Neg``, ``Mul`` by -1 or
  ``Sub`` from 0 of ``Abs``, ``Relu``, ``Softplus``, ``Sigmoid`` or ``Exp``) is stable
  already and left alone (lossgraph's own ``logistic`` loss is written so);
- the root (the ``Reciprocal``, ``Div`` or ``Log``) is replaced, its output keeping its
  name; an intermediate value of the form that something else reads too, or that is a
  graph output, is kept as it is and the stable form is computed beside it (TorchScript's
  ``binary_cross_entropy_with_logits`` reads one ``Sigmoid`` in ``Log(Sigmoid(x))`` and
  in ``Log(1 - Sigmoid(x))``: both become stable and the ``Sigmoid`` goes); intermediates
  nothing reads any more go, with the constants only they read.

Every graph is rewritten, subgraphs included. The report lists each rewrite
(:class:`StableRewrite`): the value now computed stably, the form matched and the form
emitted, and the intermediates kept.

Where it runs: :func:`~lossgraph.compile_program` runs it on the loss model, after
``WeightsToInputs`` (so that a weight is never taken for a constant one) and before
``Gradient``, in every graph that computes the loss or differentiates (``evaluate``,
``train_step``, ``train_epoch``, separate mode's ``gradient``); never on the inference
model, so ``predict`` and the exported model keep the user's ops. :func:`lossgraph.gradient`
does not run it: it differentiates the graph as written (the op-level tool, compared with
onnxruntime-training's builder on the same graph). Call :func:`stabilize_numerics` first
for the compiler's behaviour.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder import GraphBuilder
from ..errors import UnsupportedOptionError
from ..graphs import (
    FLOAT_TYPES,
    GraphIndex,
    Shape,
    all_graphs,
    attribute_value,
    attribute_values,
    infer_shapes_with_data,
    is_default_domain,
    is_onnx_op,
    opset_version,
    outer_references,
    subgraphs,
    tensor_array,
    values_read,
)
from ..models import ModelLike
from ..names import NameAuthority
from .contract import Pass, PassResult
from .gradient import BACKENDS

__all__ = ["StabilizeNumerics", "StableRewrite", "stabilize_numerics"]

#: Ops a rewrite starts from, and ops every unstable form reads: a model without both
#: is not looked at further (no shape inference).
_ROOTS = frozenset({"Reciprocal", "Div", "Log"})
_INNER = frozenset({"Exp", "Softmax", "Sigmoid"})
#: Ops whose output is never negative: Exp of their negation cannot overflow.
_NON_NEGATIVE = frozenset({"Abs", "Relu", "Softplus", "Sigmoid", "Exp"})
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class StableRewrite:
    """One rewrite: ``value`` (its name kept) is now computed by ``stable`` instead of
    ``unstable``; ``kept`` are intermediates of the unstable form other nodes (or the
    graph's outputs) still read."""

    value: str
    unstable: str
    stable: str
    kept: tuple[str, ...] = ()


@dataclass(frozen=True)
class StabilizeNumerics(Pass[tuple[StableRewrite, ...]]):
    """Overflowing forms (``1 / (1 + Exp(-s))``, ``Log(Softmax)``, ``Log(1 + Exp)``,
    ``Log(Sigmoid)``, ...) rewritten into stable ones (module doc); the report is the
    tuple of :class:`StableRewrite` done, in graph order.

    ``backend`` is the gradient backend that will differentiate the result: with
    ``"ort"`` only ops onnxruntime-training differentiates are emitted.
    """

    backend: str = "onnx"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UnsupportedOptionError(
                f"StabilizeNumerics(backend={self.backend!r}): the backend must be one of "
                f"{', '.join(map(repr, BACKENDS))}.")

    def call(self, model: onnx.ModelProto) -> PassResult:
        graphs = list(all_graphs(model.graph))
        if not any(_has_candidates(graph) for graph in graphs):
            return PassResult(model, (), changed=False)
        names = NameAuthority.for_model(model)
        opset = opset_version(model) or onnx.defs.onnx_opset_version()
        facts = _Facts(model)
        rewrites: list[StableRewrite] = []
        # innermost graphs first: rewriting a graph copies the subgraphs its nodes hold
        for index in reversed(range(len(graphs))):
            rewriter = _Rewriter(graphs[index], lambda i=index: facts.of(i), names, opset,
                                 self.backend)
            rewrites[:0] = rewriter.run()
        return PassResult(model, tuple(rewrites), changed=bool(rewrites))


def stabilize_numerics(model: ModelLike, backend: str = "onnx") -> onnx.ModelProto:
    """A copy of ``model`` with its overflowing forms rewritten into stable ones
    (:class:`StabilizeNumerics`); run it before :func:`lossgraph.gradient` to
    differentiate as :func:`~lossgraph.compile_program` does."""
    return StabilizeNumerics(backend)(model).model


def _has_candidates(graph: onnx.GraphProto) -> bool:
    ops = {node.op_type for node in graph.node if is_default_domain(node.domain)}
    return bool(ops & _ROOTS) and bool(ops & _INNER)


class _Facts:
    """Element types and shapes of each graph's values (``all_graphs`` order), from shape
    inference with data propagation, run once and only when a rewrite needs them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self._known: list[tuple[dict[str, int], dict[str, Shape]]] | None = None

    def of(self, index: int) -> tuple[dict[str, int], dict[str, Shape]]:
        if self._known is None:
            inferred = infer_shapes_with_data(self.model)
            self._known = [_read(graph) for graph in all_graphs(inferred.graph)]
        return self._known[index]


def _read(graph: onnx.GraphProto) -> tuple[dict[str, int], dict[str, Shape]]:
    types = {t.name: t.data_type for t in graph.initializer}
    shapes: dict[str, Shape] = {t.name: tuple(t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            continue
        types[value.name] = tensor.elem_type
        if tensor.HasField("shape"):
            shapes[value.name] = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tensor.shape.dim)
    return types, shapes


@dataclass(frozen=True)
class _Match:
    """A form found at a root node: the nodes between the root and its inputs (``inner``)
    and what computes the root's value stably, emitted with a builder."""

    inner: tuple[onnx.NodeProto, ...]
    emit: Callable[[GraphBuilder], str]


class _Rewriter:
    """Rewrites one graph in place: one match at a time, in graph order, until none is left
    (each rewrite replaces a node of the given graph, so this ends)."""

    def __init__(self, graph: onnx.GraphProto,
                 facts: Callable[[], tuple[dict[str, int], dict[str, Shape]]],
                 names: NameAuthority, opset: int, backend: str) -> None:
        self.graph = graph
        self.nodes = list(graph.node)
        self.facts = facts
        self.backend = backend
        self.outputs = {o.name for o in graph.output}
        self.constants = _constants(graph)
        self.builder = GraphBuilder(names, opset, prefix="stabilize/")
        self.emitted: set[str] = set()  # names of the nodes this pass added: never roots
        self.released: set[str] = set()  # constants read by removed nodes
        self.removed: set[str] = set()  # values no node computes any more
        self.index = GraphIndex(())

    # -- the loop ------------------------------------------------------------------
    def run(self) -> list[StableRewrite]:
        if not _has_candidates(self.graph):
            return []
        rewrites: list[StableRewrite] = []
        while True:
            self.index = GraphIndex(self.nodes)
            for node in self.nodes:
                if node.name in self.emitted or not is_default_domain(node.domain):
                    continue
                match = self._match(node)
                if match is not None:
                    rewrites.append(self._apply(node, match))
                    break
            else:
                break
        if rewrites:
            self._write_back()
        return rewrites

    def _apply(self, root: onnx.NodeProto, match: _Match) -> StableRewrite:
        b = self.builder
        start = len(b.nodes)
        value = match.emit(b)
        target = root.output[0]
        if any(value in node.output for node in b.nodes[start:]):
            b.rename(value, target, uses=False)
        else:  # the stable form is a value the graph has already
            b.Identity(value, outputs=[target])
        emitted = b.nodes[start:]
        self.emitted.update(node.name for node in emitted)
        unstable = _render(target, {o: n for n in (root, *match.inner) for o in n.output},
                           self.constants)
        stable = _render(target, {o: n for n in emitted for o in n.output},
                         {**self.constants, **_arrays(b.initializers)})
        index = next(i for i, node in enumerate(self.nodes) if node is root)
        self.nodes[index:index + 1] = emitted
        self._release(root)
        kept = []
        for node in match.inner:  # from the root inwards: each may free the next
            out = node.output[0]
            still_read = any(out in n.input for n in self.nodes) or any(
                out in outer_references(g) for n in self.nodes for g in subgraphs(n))
            if still_read or out in self.outputs:
                kept.append(out)
            else:
                self.nodes = [n for n in self.nodes if n is not node]
                self._release(node)
        return StableRewrite(target, unstable, stable, tuple(kept))

    def _release(self, node: onnx.NodeProto) -> None:
        self.removed.update(node.output)
        self.released.update(i for i in node.input if i in self.constants)

    def _write_back(self) -> None:
        graph = self.graph
        graph.ClearField("node")
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.builder.initializers)
        self.builder.initializers = []
        read = values_read(graph) | self.outputs
        unread = self.released - read
        kept = [t for t in graph.initializer if t.name not in unread]
        if len(kept) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(kept)
        nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in unread)]
        if len(nodes) != len(graph.node):
            graph.ClearField("node")
            graph.node.extend(nodes)
        gone = self.removed | unread
        infos = [v for v in graph.value_info if v.name not in gone]
        if len(infos) != len(graph.value_info):
            del graph.value_info[:]
            graph.value_info.extend(infos)

    # -- matching ------------------------------------------------------------------
    def _match(self, node: onnx.NodeProto) -> _Match | None:
        if node.op_type in ("Reciprocal", "Div"):
            return self._sigmoid(node)
        if node.op_type == "Log":
            source = self._producer(node.input[0])
            if source is None:
                return None
            for rule in (self._log_softmax, self._softplus_of_exp, self._log_sigmoid,
                         self._log_one_minus_sigmoid, self._log_exp, self._log_sum_exp):
                match = rule(node, source)
                if match is not None:
                    return match
        return None

    def _sigmoid(self, node: onnx.NodeProto) -> _Match | None:
        """``Reciprocal(Add(1, Exp(t)))``, ``Div(1, Add(1, Exp(t)))`` -> ``Exp(-softplus(t))``."""
        if node.op_type == "Div":
            if self._one(node.input[0], node.input[1]) is None:
                return None
            denominator = node.input[1]
        else:
            denominator = node.input[0]
        found = self._one_plus_exp(denominator)
        if found is None:
            return None
        add, exp, dtype = found  # the constant's type is the root's: float or double
        t = exp.input[0]
        if self._never_positive(t):
            return None
        return _Match((add, exp), lambda b: b.Exp(b.Neg(self._softplus_form(b, t, dtype),
                                                          hint="negated_softplus"),
                                                    hint="sigmoid"))

    def _softplus_of_exp(self, node: onnx.NodeProto, source: onnx.NodeProto) -> _Match | None:
        """``Log(Add(1, Exp(x)))`` -> ``softplus(x)``."""
        found = self._one_plus_exp(node.input[0])
        if found is None:
            return None
        add, exp, dtype = found
        x = exp.input[0]
        if self._never_positive(x):
            return None
        return _Match((add, exp), lambda b: self._softplus_form(b, x, dtype))

    def _log_softmax(self, node: onnx.NodeProto, source: onnx.NodeProto) -> _Match | None:
        """``Log(Softmax(x; axis))`` -> ``LogSoftmax(x; axis)``."""
        if source.op_type != "Softmax" or not self._float(node.output[0]):
            return None
        attributes = {a.name: helper.get_attribute_value(a) for a in source.attribute}
        x = source.input[0]
        return _Match((source,), lambda b: b.LogSoftmax(x, hint="log_softmax", **attributes))

    def _log_sigmoid(self, node: onnx.NodeProto, source: onnx.NodeProto) -> _Match | None:
        """``Log(Sigmoid(x))`` -> ``Neg(softplus(Neg(x)))``."""
        if source.op_type != "Sigmoid" or not self._float(node.output[0]):
            return None
        x = source.input[0]
        dtype = self._dtype(node.output[0])
        return _Match((source,), lambda b: b.Neg(self._softplus_form(b, x, dtype, negated=True),
                                                 hint="log_sigmoid"))

    def _log_one_minus_sigmoid(self, node: onnx.NodeProto,
                               source: onnx.NodeProto) -> _Match | None:
        """``Log(Sub(1, Sigmoid(x)))``, ``Log(Add(1, Neg(Sigmoid(x))))`` -> ``Neg(softplus(x))``."""
        inner: tuple[onnx.NodeProto, ...]
        if source.op_type == "Sub" and self._one(source.input[0], source.input[1]) is not None:
            sigmoid, inner = self._producer(source.input[1]), (source,)
        elif source.op_type == "Add":
            split = self._split_one(source)
            negation = self._producer(split[0]) if split is not None else None
            if negation is None or negation.op_type != "Neg":
                return None
            sigmoid, inner = self._producer(negation.input[0]), (source, negation)
        else:
            return None
        if sigmoid is None or sigmoid.op_type != "Sigmoid" or not self._float(node.output[0]):
            return None
        x = sigmoid.input[0]
        dtype = self._dtype(node.output[0])
        return _Match((*inner, sigmoid), lambda b: b.Neg(self._softplus_form(b, x, dtype),
                                                         hint="log_one_minus_sigmoid"))

    def _log_exp(self, node: onnx.NodeProto, source: onnx.NodeProto) -> _Match | None:
        """``Log(Exp(y))`` -> ``y``."""
        if source.op_type != "Exp":
            return None
        y = source.input[0]
        return _Match((source,), lambda b: y)

    def _log_sum_exp(self, node: onnx.NodeProto, source: onnx.NodeProto) -> _Match | None:
        """``Log(ReduceSum(Exp(x); axes))`` -> ``ReduceLogSumExp(x; axes)``."""
        if self.backend != "onnx" or source.op_type != "ReduceSum":
            return None
        exp = self._producer(source.input[0])
        if exp is None or exp.op_type != "Exp" or not self._float(node.output[0]):
            return None
        given = source.input[1] if len(source.input) > 1 else ""
        if given:
            if given not in self.constants:
                return None
            axes: list[int] | None = [int(a) for a in self.constants[given].reshape(-1)]
        else:
            axes = attribute_value(source, "axes")
            axes = None if axes is None else [int(a) for a in axes]
        if not axes:
            if attribute_value(source, "noop_with_empty_axes", 0):
                return None  # a ReduceSum that sums nothing: rare, left alone
            axes = None
        keepdims = int(attribute_value(source, "keepdims", 1))
        x = exp.input[0]
        return _Match((source, exp), lambda b: b.reduce("ReduceLogSumExp", x, axes, keepdims,
                                                         hint="log_sum_exp"))

    # -- pieces ----------------------------------------------------------------------
    def _softplus_form(self, b: GraphBuilder, x: str, dtype: np.dtype,
                       negated: bool = False) -> str:
        """``softplus(x)`` (``softplus(-x)`` when ``negated``): the ``Softplus`` kernel, or
        its explicit stable form."""
        if dtype == np.float32 and self.backend == "onnx":
            return b.Softplus(b.Neg(x, hint="negated") if negated else x, hint="softplus")
        magnitude = b.Abs(x)
        tail = b.Log(b.Add(b.Exp(b.Neg(magnitude)), b.const(1, dtype, "one")))  # e^-|x| <= 1
        # max(x, 0) as (x + |x|) / 2: its derivative at 0 is 1/2, softplus's (Relu's is 0)
        twice = b.Sub(magnitude, x) if negated else b.Add(x, magnitude)
        return b.Add(b.Mul(twice, b.const(0.5, dtype, "half")), tail, hint="softplus")

    def _one_plus_exp(self, value: str
                      ) -> tuple[onnx.NodeProto, onnx.NodeProto, np.dtype] | None:
        """``(Add, Exp, the constant's dtype)`` when ``value`` is ``Add(1, Exp(t))``."""
        add = self._producer(value)
        if add is None or add.op_type != "Add":
            return None
        split = self._split_one(add)
        if split is None:
            return None
        exp = self._producer(split[0])
        if exp is None or exp.op_type != "Exp":
            return None
        return add, exp, split[1]

    def _split_one(self, add: onnx.NodeProto) -> tuple[str, np.dtype] | None:
        """``(the other operand, the constant's dtype)`` when ``add`` adds a constant 1."""
        if len(add.input) != 2:
            return None
        for index in (0, 1):
            dtype = self._one(add.input[index], add.input[1 - index])
            if dtype is not None:
                return add.input[1 - index], dtype
        return None

    def _one(self, name: str, other: str) -> np.dtype | None:
        """The dtype of ``name`` when it is a constant 1 that broadcasts to ``other``'s shape
        without enlarging it."""
        value = self.constants.get(name)
        if (value is None or value.dtype not in _FLOAT_DTYPES or value.size == 0
                or not np.all(value == 1)):
            return None
        if value.ndim and not _fits(value.shape, self.facts()[1].get(other)):
            return None
        return value.dtype

    def _never_positive(self, value: str) -> bool:
        """Whether ``value`` is the negation of a value that is never negative."""
        node = self._producer(value)
        if node is None:
            return False
        negated = None
        if node.op_type == "Neg":
            negated = node.input[0]
        elif node.op_type == "Mul" and len(node.input) == 2:
            for index in (0, 1):
                factor = self.constants.get(node.input[index])
                if factor is not None and factor.size and np.all(factor == -1):
                    negated = node.input[1 - index]
        elif node.op_type == "Sub":
            zero = self.constants.get(node.input[0])
            if zero is not None and zero.size and np.all(zero == 0):
                negated = node.input[1]
        source = self._producer(negated) if negated else None
        return source is not None and source.op_type in _NON_NEGATIVE

    def _producer(self, value: str) -> onnx.NodeProto | None:
        node = self.index.producer(value)
        return node if node is not None and is_default_domain(node.domain) else None

    def _float(self, value: str) -> bool:
        return self.facts()[0].get(value) in FLOAT_TYPES

    def _dtype(self, value: str) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.facts()[0][value])


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The initializers of ``graph`` that are not graph inputs, and its ``Constant`` values."""
    fed = {value.name for value in graph.input}
    constants = {t.name: tensor_array(t) for t in graph.initializer if t.name not in fed}
    for node in graph.node:
        if not is_onnx_op(node, "Constant"):
            continue
        for attribute in node.attribute:
            if attribute.name == "value":
                constants[node.output[0]] = numpy_helper.to_array(attribute.t)
            elif attribute.name in ("value_float", "value_floats"):
                constants[node.output[0]] = np.asarray(helper.get_attribute_value(attribute),
                                                       np.float32)
    return constants


def _arrays(tensors: Sequence[onnx.TensorProto]) -> dict[str, np.ndarray]:
    return {t.name: tensor_array(t) for t in tensors}


def _fits(shape: tuple[int, ...], other: Shape | None) -> bool:
    """Whether a constant of ``shape`` broadcasts against a value of shape ``other`` to
    ``other``'s own shape."""
    if other is None or len(shape) > len(other):
        return False
    return all(size == 1 or size == dim for size, dim in zip(reversed(shape), reversed(other)))


def _render(value: str, producers: Mapping[str, onnx.NodeProto],
            constants: Mapping[str, np.ndarray]) -> str:
    """``value`` as the expression of ``producers`` computing it, attributes after a
    semicolon (constants of one value shown as that value, other values by name)."""
    node = producers.get(value)
    if node is None:
        constant = constants.get(value)
        if constant is not None and constant.size and np.all(constant == constant.flat[0]):
            return f"{constant.flat[0]:g}"
        return value
    arguments = ", ".join(_render(name, producers, constants) for name in node.input if name)
    options = "; ".join(f"{key}={value}" for key, value in attribute_values(node).items()
                        if not isinstance(value, onnx.GraphProto))
    return f"{node.op_type}({arguments}{'; ' + options if options else ''})"
