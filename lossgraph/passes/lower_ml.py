"""lower_ml_ops: rewrite linear ``ai.onnx.ml`` operators into standard ONNX ops.

skl2onnx exports linear models as ``ai.onnx.ml`` operators that keep their weights
in node attributes: nothing to train, no gradient in any runtime, and no kernel
outside onnxruntime's ML build. This pass rewrites ``LinearRegressor``,
``LinearClassifier`` and ``Normalizer`` nodes of the main graph into standard ops
that compute what onnxruntime's own kernels compute. Each linear node's weights
become two new float initializers, ``coef`` (shape ``(C, F)``) and ``intercept``
(shape ``(C,)``; zeros when the node has none), named ``coef_1``, ``intercept_1``,
... for later nodes in graph order, or whenever the name is taken.

Notation: ``Cast(X)`` converts double and integer inputs to float (onnxruntime does
the same; it is left out for float inputs); a 1-D ``X`` is one row; ``1`` and ``0``
are scalar constants; ``z`` is the raw score ``(N, C)``::

    z = Gemm(Cast(X), coef, intercept, transB=1)

    LinearRegressor(X)             -> T(z), T given by post_transform:
                                        NONE          z
                                        LOGISTIC      Sigmoid(z)
                                        SOFTMAX       Softmax(z, axis=1)
                                        SOFTMAX_ZERO  e / ReduceSum(e, axis=1) with
                                                      e = Exp(z - ReduceMax(z)) where
                                                      |z| > 1e-7, else z Exp(-ReduceMax(z))
                                                      (and those entries not summed)
                                        PROBIT        sqrt(2) ErfInv(2 z - 1)
                                      with targets=1 onnxruntime applies PROBIT only
                                      (any other transform leaves z as it is)
    LinearClassifier(X), C > 1     -> label  = Gather(classes, ArgMax(z, axis=1))
                                      scores = T(z)
      rows (-w, -b) and (w, b)        z = Concat(-s, s, axis=1), s = Gemm(Cast(X), coef,
      (skl2onnx's binary models)      intercept, transB=1) with coef = w: one weight
                                      that training keeps tied
    LinearClassifier(X), C = 1     -> label  = Gather(classes, Cast(Greater(z, 0)))
                                               classes = the 2 labels, else [0, 1]
      with 2 class labels             scores = Concat(1 - p, p, axis=1), p = Sigmoid(z)
                                               for LOGISTIC, p = z otherwise
      without class labels            scores = z (PROBIT: sqrt(2) ErfInv(2 z - 1))
    Normalizer(X), norm=MAX        -> Cast(X) / m(ReduceMax(Cast(X), axis=-1))
    Normalizer(X), norm=L1         -> Cast(X) / m(ReduceSum(Abs(Cast(X)), axis=-1))
    Normalizer(X), norm=L2         -> Cast(X) / Sqrt(m(ReduceSum(Cast(X) * Cast(X), axis=-1)))
                                      m(d) = d + Cast(d == 0): rows of norm 0 pass through

``ErfInv`` is onnxruntime's approximation (Winitzki, a = 0.147), op by op in the
same float32 order: ``w = Log((1 - t)(1 + t))``, ``v = 2 / (pi a) + w / 2``,
``ErfInv(t) = s Sqrt(Sqrt(v v - w / a) - v)`` with ``s = 1 - 2 Cast(t < 0)``.
``v v - w / a`` cancels badly near ``t = 0``, so its Log and Sqrt are computed in
double and rounded once to float, as the C library's ``logf`` and ``sqrtf`` do; the
results then equal onnxruntime's bit for bit except where ``logf`` itself is off by
an ulp (about 1 input in 4000), by at most a few 1e-6.

The prepacked-weight caveat: onnxruntime packs a Gemm's constant weight, and a
one-row batch then takes another MLAS kernel than LinearClassifier's, so its raw
scores may differ in the last bit (not with ``session.disable_prepacking`` set, nor
when the weights are graph inputs, as in training graphs).

Labels come from the raw scores, ties going to the first class, as in onnxruntime
(a saturated Sigmoid cannot change them). The ``multi_class`` attribute changes
nothing in onnxruntime and is ignored. Where onnxruntime versions disagree, the
newer one and the ONNX specification win: for a one-row ``LinearClassifier`` with
two class labels and ``post_transform="LOGISTIC"``, onnxruntime 1.19 returns
``[1 - z, z]``, later versions ``[1 - Sigmoid(z), Sigmoid(z)]``, as emitted here.
Nodes onnxruntime cannot run, or runs on uninitialized memory, are rejected with
:class:`~lossgraph.errors.InvalidModelError` or
:class:`~lossgraph.errors.UnsupportedModelError`. Other ``ai.onnx.ml`` operators
(ZipMap, ArrayFeatureExtractor, tree ensembles, ...) are kept as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..builder import GraphBuilder
from ..errors import InvalidModelError, UnsupportedModelError
from ..graphs import ForwardFacts, all_graphs, attribute_values, opset_version, values_read
from ..models import ModelLike, check_declared_outputs
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["LowerMlOps", "lower_ml_ops", "LOWERED_OPS"]

ML_DOMAIN = "ai.onnx.ml"
#: The ``ai.onnx.ml`` operators this pass rewrites.
LOWERED_OPS = ("LinearClassifier", "LinearRegressor", "Normalizer")
_TRANSFORMS = ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT")
_NORMS = ("MAX", "L1", "L2")
_F32 = np.float32


def _is_lowered(node: onnx.NodeProto) -> bool:
    return node.domain == ML_DOMAIN and node.op_type in LOWERED_OPS


@dataclass
class _Context:
    """What lowering one node needs to know about the graph around it."""

    builder: GraphBuilder
    types: dict[str, onnx.TypeProto]
    used: set[str]

    def rank(self, name: str) -> int | None:
        value_type = self.types.get(name)
        if value_type is None or not value_type.tensor_type.HasField("shape"):
            return None
        return len(value_type.tensor_type.shape.dim)

    def elem_type(self, name: str) -> int | None:
        value_type = self.types.get(name)
        return value_type.tensor_type.elem_type if value_type is not None else None

    def last_dim(self, name: str) -> int | None:
        rank = self.rank(name)
        if not rank:
            return None
        dim = self.types[name].tensor_type.shape.dim[rank - 1]
        return dim.dim_value if dim.HasField("dim_value") else None


def _describe(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name!r}" if node.name else (
        f"{node.op_type} node producing {list(node.output)}"
    )


def _string_choice(node: onnx.NodeProto, attrs: dict, name: str, default: str,
                   choices: Sequence[str]) -> str:
    value = attrs.get(name, default)
    if value not in choices:
        raise InvalidModelError(
            f"{_describe(node)} has {name}={value!r}; the ONNX specification allows "
            f"{', '.join(repr(c) for c in choices)}. Fix the attribute in the exporter's output."
        )
    return value


def _initializer(b: GraphBuilder, array: np.ndarray, hint: str) -> str:
    """A new initializer with its own fresh name (never shared with an equal constant)."""
    name = b.names.fresh(hint)
    b.initializers.append(numpy_helper.from_array(array, name))
    return name


def _scalar(b: GraphBuilder, value: float, hint: str = "const") -> str:
    """A rank-0 float constant (rank 0, so analyses never take it for a weight)."""
    return b.const(_F32(value), np.float32, hint)


# -- shared pieces ----------------------------------------------------------------------


def _float_input(ctx: _Context, name: str) -> str:
    """``name`` as float (onnxruntime casts double and integer inputs to float first)."""
    if ctx.elem_type(name) == TensorProto.FLOAT:
        return name
    return ctx.builder.Cast(name, to=TensorProto.FLOAT, hint=f"{name}_float")


def _as_rows(ctx: _Context, node: onnx.NodeProto, x: str, features: int) -> str:
    """``x`` as a 2-D ``(N, features)`` tensor; a 1-D input is one row, as in onnxruntime."""
    rank = ctx.rank(node.input[0])
    if rank == 2:
        return x
    if rank == 1:
        return ctx.builder.unsqueeze(x, [0], hint=f"{node.input[0]}_row")
    if rank is None:
        return ctx.builder.Reshape(x, ctx.builder.ints([-1, features], "rows_shape"),
                                   hint=f"{node.input[0]}_rows")
    raise UnsupportedModelError(
        f"{_describe(node)} reads {node.input[0]!r} of rank {rank}; onnxruntime runs it on "
        "rank 1 or 2 only. Reshape the input to (N, features) before this node."
    )


def _linear(ctx: _Context, node: onnx.NodeProto, coefficients: list[float],
            intercepts: list[float] | None, rows: int, what: str,
            output: str | None = None) -> str:
    """``Gemm(Cast(X), coef, intercept, transB=1)`` with new ``coef`` and ``intercept``.

    The raw scores are written to ``output`` when given (the node's own output, when no
    transform follows), else to a fresh name.
    """
    if len(coefficients) == 0 or len(coefficients) % rows:
        raise InvalidModelError(
            f"{_describe(node)} has {len(coefficients)} coefficients, not a positive multiple "
            f"of its {rows} {what}. 'coefficients' must hold {what} x features values, "
            "row by row; fix the exporter's output."
        )
    features = len(coefficients) // rows
    known = ctx.last_dim(node.input[0])
    if known is not None and known != features:
        raise InvalidModelError(
            f"{_describe(node)} has {len(coefficients)} coefficients for {rows} {what}, i.e. "
            f"{features} features, but its input {node.input[0]!r} has {known} features. "
            "Fix the coefficients or the declared input shape."
        )
    b = ctx.builder
    coef = _initializer(b, np.asarray(coefficients, _F32).reshape(rows, features), "coef")
    bias = np.zeros(rows, _F32) if intercepts is None else np.asarray(intercepts, _F32)
    intercept = _initializer(b, bias, "intercept")
    x = _as_rows(ctx, node, _float_input(ctx, node.input[0]), features)
    return _finish(b, "Gemm", output, "raw_scores", x, coef, intercept, transB=1)


def _in_double(b: GraphBuilder, op_type: str, x: str, hint: str | None = None) -> str:
    """``op_type(x)`` for float ``x``, computed in double and rounded once to float.

    That is the correctly rounded float result (what the C library's ``logf`` and
    ``sqrtf`` give, up to rare last-bit cases), which the float kernels of some
    onnxruntime versions miss by an ulp (Sqrt in 1.19).
    """
    wide = b.op(op_type, b.Cast(x, to=TensorProto.DOUBLE))
    return b.Cast(wide, to=TensorProto.FLOAT, hint=hint)


def _erfinv(b: GraphBuilder, t: str) -> str:
    """onnxruntime's ``ErfInv`` (Winitzki's approximation), op by op in float32.

    ``v^2 - w / a`` cancels badly near ``t = 0``: an ulp off in a log or square root
    moves the result by up to 1e-3, hence the correctly rounded ``_in_double``.
    """
    one = _scalar(b, 1.0, "one")
    log = _in_double(b, "Log", b.Mul(b.Sub(one, t), b.Add(one, t)), hint="erfinv_log")
    c1 = _F32(2) / (_F32(np.pi) * _F32(0.147))
    c2 = _F32(1) / _F32(0.147)
    v = b.Add(_scalar(b, c1, "erfinv_c1"), b.Mul(_scalar(b, 0.5, "half"), log))
    v2 = b.Mul(_scalar(b, c2, "erfinv_c2"), log)
    v3 = b.Sub(_in_double(b, "Sqrt", b.Sub(b.Mul(v, v), v2)), v)
    # sign: -1 where t < 0, else 1 (as onnxruntime; Sign would give 0 at 0 and has no
    # gradient in onnxruntime-training)
    negative = b.Cast(b.Less(t, _scalar(b, 0.0, "zero")), to=TensorProto.FLOAT)
    sign = b.Sub(one, b.Mul(_scalar(b, 2.0, "two"), negative), hint="sign")
    return b.Mul(sign, _in_double(b, "Sqrt", v3), hint="erfinv")


def _probit(b: GraphBuilder, z: str, output: str | None = None) -> str:
    """``sqrt(2) * ErfInv(2 z - 1)`` as onnxruntime computes it."""
    t = b.Sub(b.Mul(z, _scalar(b, 2.0, "two")), _scalar(b, 1.0, "one"))
    return _finish(b, "Mul", output, "probit", _scalar(b, float(np.sqrt(_F32(2))), "sqrt2"),
                   _erfinv(b, t))


def _finish(b: GraphBuilder, op_type: str, output: str | None, hint: str, *inputs: str,
            **attributes: object) -> str:
    """Emit the last node of a result, writing the original output name when given."""
    if output is None:
        return b.op(op_type, *inputs, hint=hint, **attributes)
    b.op(op_type, *inputs, outputs=[output], **attributes)
    return output


def _softmax_zero(b: GraphBuilder, z: str, output: str) -> str:
    """onnxruntime's SOFTMAX_ZERO: entries with ``|z| <= 1e-7`` are left out of the softmax."""
    z_max = b.reduce("ReduceMax", z, axes=[1], keepdims=1, hint="max_score")
    kept = b.Cast(b.Greater(b.Abs(z), _scalar(b, 1e-7, "zero_tolerance")),
                  to=TensorProto.FLOAT, hint="kept")
    exps = b.Mul(b.Exp(b.Sub(z, z_max)), kept, hint="kept_exp")
    total = b.reduce("ReduceSum", exps, axes=[1], keepdims=1, hint="exp_sum")
    # Left-out entries become z * exp(-max); such entries exist only when max >= -1e-7,
    # so clamping max at -1 changes nothing but keeps exp() finite (0 * inf is NaN).
    tiny = b.Mul(b.Clip(z, _scalar(b, -1e-7, "neg_tolerance"),
                        _scalar(b, 1e-7, "zero_tolerance")),
                 b.Sub(_scalar(b, 1.0, "one"), kept))
    scale = b.Exp(b.Neg(b.Max(z_max, _scalar(b, -1.0, "minus_one"))))
    return _finish(b, "Div", output, "softmax_zero", b.Add(exps, b.Mul(tiny, scale)), total)


def _transform(b: GraphBuilder, z: str, post: str, output: str) -> str:
    """Apply a post_transform to ``(N, C)`` scores with ``C > 1``, writing ``output``."""
    if post == "NONE":
        return _finish(b, "Identity", output, "scores", z)
    if post == "LOGISTIC":
        return _finish(b, "Sigmoid", output, "scores", z)
    if post == "SOFTMAX":
        return _finish(b, "Softmax", output, "scores", z, axis=1)
    if post == "SOFTMAX_ZERO":
        return _softmax_zero(b, z, output)
    return _probit(b, z, output)


# -- the three operators ----------------------------------------------------------------


def _lower_regressor(ctx: _Context, node: onnx.NodeProto) -> None:
    attrs = attribute_values(node)
    post = _string_choice(node, attrs, "post_transform", "NONE", _TRANSFORMS)
    targets = int(attrs.get("targets", 1))
    if targets < 1:
        raise InvalidModelError(f"{_describe(node)} has targets={targets}; it must be >= 1.")
    intercepts = list(attrs.get("intercepts", []))
    if intercepts and len(intercepts) != targets:
        raise InvalidModelError(
            f"{_describe(node)} has {len(intercepts)} intercepts for targets={targets} "
            "(onnxruntime silently ignores them then). Give one intercept per target, or "
            "none for zero intercepts."
        )
    if targets == 1 and post != "PROBIT":
        post = "NONE"  # onnxruntime applies no other transform to a single target
    direct = node.output[0] if post == "NONE" else None
    z = _linear(ctx, node, list(attrs.get("coefficients", [])), intercepts or None, targets,
                "targets", direct)
    if direct is None:
        _transform(ctx.builder, z, post, node.output[0])


def _class_labels(node: onnx.NodeProto, attrs: dict) -> np.ndarray | None:
    """The class labels as an array (int64, or bytes objects), or None when there are none."""
    ints = list(attrs.get("classlabels_ints", []))
    strings = list(attrs.get("classlabels_strings", []))
    if ints and strings:
        raise InvalidModelError(
            f"{_describe(node)} has both 'classlabels_ints' and 'classlabels_strings'; the "
            "ONNX specification allows one. Remove one of them."
        )
    if strings:
        return np.array(strings, dtype=object)
    if ints:
        return np.array(ints, dtype=np.int64)
    return None


def _tied_binary(coefficients: list[float], intercepts: list[float]) -> bool:
    """Two rows of coefficients that are exact negatives of each other, intercepts too."""
    if len(intercepts) != 2 or not coefficients or len(coefficients) % 2:
        return False
    rows = np.asarray(coefficients, _F32).reshape(2, -1)
    return bool(np.array_equal(rows[0], -rows[1]) and _F32(intercepts[0]) == -_F32(intercepts[1]))


def _lower_classifier(ctx: _Context, node: onnx.NodeProto) -> None:
    b = ctx.builder
    attrs = attribute_values(node)
    post = _string_choice(node, attrs, "post_transform", "NONE", _TRANSFORMS)
    intercepts = list(attrs.get("intercepts", []))
    if not intercepts:
        raise UnsupportedModelError(
            f"{_describe(node)} has no 'intercepts'. onnxruntime counts the classes by the "
            "intercepts and cannot run such a node (1.19 crashes, newer versions refuse it). "
            "Add intercepts=[0.0] * n_classes to the node."
        )
    rows = len(intercepts)
    labels = _class_labels(node, attrs)
    if rows == 1:
        if labels is not None and len(labels) != 2:
            raise InvalidModelError(
                f"{_describe(node)} has one row of coefficients (a binary classifier) and "
                f"{len(labels)} class labels; it needs exactly 2 (negative, positive) or none "
                "(labels 0 and 1)."
            )
        if labels is not None and post == "PROBIT":
            raise UnsupportedModelError(
                f"{_describe(node)} is a one-row binary classifier with two class labels and "
                "post_transform='PROBIT': onnxruntime fills half of its scores with "
                "uninitialized memory, so there is no result to reproduce. Use two rows of "
                "coefficients (one per class), or drop the class labels."
            )
        classes = labels if labels is not None else np.array([0, 1], np.int64)
    else:
        if labels is None:
            raise InvalidModelError(
                f"{_describe(node)} has {rows} classes but neither 'classlabels_ints' nor "
                "'classlabels_strings'. Add one label per class."
            )
        if len(labels) < rows:
            raise InvalidModelError(
                f"{_describe(node)} has {rows} classes (intercepts) but only {len(labels)} "
                "class labels. Give one label per class."
            )
        classes = labels
    label_out, scores_out = node.output[0], node.output[1] if len(node.output) > 1 else ""
    if scores_out not in ctx.used:
        scores_out = ""
    # When the scores are the raw scores themselves, Gemm writes them.
    if rows > 1:
        raw_is_scores = post == "NONE"
    else:  # one row: onnxruntime ignores every transform but PROBIT, or adds a column
        raw_is_scores = labels is None and post != "PROBIT"
    direct = scores_out if raw_is_scores and scores_out else None
    coefficients = list(attrs.get("coefficients", []))
    if _tied_binary(coefficients, intercepts):
        # skl2onnx's binary classifiers store (-w, -b) and (w, b): one weight, so that
        # training keeps the two rows tied: z = [-s, s].
        half = len(coefficients) // 2
        s = _linear(ctx, node, coefficients[half:], intercepts[1:], 1, "classes")
        z = b.Concat(b.Neg(s, hint="negative_raw_scores"), s, axis=1,
                     **({"outputs": [direct]} if direct else {"hint": "raw_scores"}))
    else:
        z = _linear(ctx, node, coefficients, intercepts, rows, "classes", direct)
    if label_out in ctx.used:
        class_list = _initializer(b, classes, "classes")
        if rows == 1:
            positive = b.Cast(b.squeeze(b.Greater(z, _scalar(b, 0.0, "zero")), [1]),
                              to=TensorProto.INT64, hint="is_positive")
            b.Gather(class_list, positive, outputs=[label_out])
        else:
            best = b.ArgMax(z, axis=1, keepdims=0, hint="best_class")
            b.Gather(class_list, best, outputs=[label_out])
    if not scores_out or direct is not None:
        return
    if rows > 1:
        _transform(b, z, post, scores_out)
    elif labels is not None:  # onnxruntime adds the negative class's column
        p = b.Sigmoid(z, hint="probability") if post == "LOGISTIC" else z
        negative = b.Sub(_scalar(b, 1.0, "one"), p, hint="negative_scores")
        b.Concat(negative, p, axis=1, outputs=[scores_out])
    else:
        _probit(b, z, scores_out)


def _lower_normalizer(ctx: _Context, node: onnx.NodeProto) -> None:
    b = ctx.builder
    attrs = attribute_values(node)
    norm = _string_choice(node, attrs, "norm", "MAX", _NORMS)
    rank = ctx.rank(node.input[0])
    if rank is not None and not 1 <= rank <= 2:
        raise UnsupportedModelError(
            f"{_describe(node)} reads {node.input[0]!r} of rank {rank}; onnxruntime's "
            "Normalizer accepts rank 1 or 2 only. Reshape the input to (N, features)."
        )
    x = _float_input(ctx, node.input[0])
    if norm == "MAX":
        d = b.reduce("ReduceMax", x, axes=[-1], keepdims=1, hint="row_max")
    elif norm == "L1":
        d = b.reduce("ReduceSum", b.Abs(x), axes=[-1], keepdims=1, hint="row_l1")
    else:
        d = b.reduce("ReduceSum", b.Mul(x, x), axes=[-1], keepdims=1, hint="row_sum_squares")
    # Rows whose norm is 0 pass through: divide them by 1 instead (no Where, it is slow).
    is_zero = b.Cast(b.Equal(d, _scalar(b, 0.0, "zero")), to=TensorProto.FLOAT, hint="is_zero")
    d = b.Add(d, is_zero, hint="row_norm")
    if norm == "L2":
        d = b.Sqrt(d, hint="row_l2")
    b.Div(x, d, outputs=[node.output[0]])


_LOWER = {
    "LinearRegressor": _lower_regressor,
    "LinearClassifier": _lower_classifier,
    "Normalizer": _lower_normalizer,
}


@dataclass(frozen=True)
class LowerMlOps(Pass[None]):
    """Rewrite ``ai.onnx.ml`` LinearRegressor, LinearClassifier and Normalizer nodes.

    The result computes the same outputs in standard ONNX ops (see the module
    docstring for each rewrite) with each linear node's weights as new float
    initializers ``coef`` (shape ``(C, F)``) and ``intercept`` (shape ``(C,)``), so
    later passes can train them. Other ``ai.onnx.ml`` operators stay as they are.
    """

    def call(self, model: onnx.ModelProto) -> PassResult:
        graph = model.graph
        for sub_graph in list(all_graphs(graph))[1:]:
            _reject_nested(sub_graph)
        if not any(_is_lowered(node) for node in graph.node):
            return PassResult(model, changed=False)
        produced = {name: node for node in graph.node if _is_lowered(node)
                    for name in node.output if name}
        _lower(model)
        # onnx infers no shapes for these ai.onnx.ml ops: a declared shape their outputs
        # contradict is found now, as the user's error, not by this pass's own check
        check_declared_outputs(model, {n: _describe(node) for n, node in produced.items()})
        return PassResult(model)


def lower_ml_ops(model: ModelLike) -> onnx.ModelProto:
    """``model`` with its ``ai.onnx.ml`` linear models in standard ops (:class:`LowerMlOps`)."""
    return LowerMlOps()(model).model


def _lower(model: onnx.ModelProto) -> None:
    graph = model.graph
    used = values_read(graph) | {output.name for g in all_graphs(graph) for output in g.output}
    names = NameAuthority.for_model(model)
    builder = GraphBuilder(names, opset_version(model) or 13)
    ctx = _Context(builder, ForwardFacts.of(model).types, used)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if not _is_lowered(node):
            nodes.append(node)
            continue
        builder.prefix = f"{node.name or node.op_type}/"
        start = len(builder.nodes)
        _LOWER[node.op_type](ctx, node)
        nodes.extend(builder.nodes[start:])
    initializers = list(builder.initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)


def _reject_nested(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if _is_lowered(node):
            raise UnsupportedModelError(
                f"{_describe(node)} sits in the subgraph {graph.name!r} (an If, Loop or Scan "
                "body); lower_ml_ops rewrites the main graph only. Move the node out of the "
                "control-flow operator."
            )
