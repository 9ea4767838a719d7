"""add_loss_output: append a scalar loss to an inference model.

For a prediction ``p`` (the chosen output), a label ``y`` and optional per-row
sample weights ``w`` (shape ``(N,)``), the pass adds

    l_i    = mean over the non-batch axes of score(p_i, y_i)       (per-row loss)
    loss   = sum_i w_i l_i / sum_i w_i f_i  reduction="mean"  (plain mean without w)
           = sum_i w_i l_i                  reduction="sum"
           + sum_k a_k sum|W_k| + b_k sum W_k^2                     (penalty)
    loss_i = w_i l_i                        reduction="none"  (per row, no penalty:
                                                               for evaluation, not training)

with these loss functions (``d = p - y``):

    squared_error (l2)    d^2
    half_squared_error    0.5 d^2   (scikit-learn's MLP loss, whose gradient is d)
    absolute_error (l1)   |d|
    elastic               l1_weight |d| + l2_weight d^2
    huber                 0.5 q^2 + delta (|d| - q),   q = min(|d|, delta)
    binary_log_loss       -(y log p1 + (1 - y) log(1 - p1)),  p1 clipped to [eps, 1 - eps]
    logistic              max(s, 0) - y s + log(1 + exp(-|s|))    (s a raw score)
    multiclass_log_loss   -log p[y]   (or -log_softmax(z)[y] with from_logits=True)

and ``auto``, the loss that fits what the output holds (:mod:`lossgraph.predictions`:
a log loss for class probabilities, ``logistic`` or ``multiclass_log_loss`` with
``from_logits=True`` for class scores, ``squared_error`` for values), which is
:func:`~lossgraph.compile_program`'s default; a loss that does not fit the output
(squared error on class probabilities, a log loss of probabilities on unbounded values)
is an :class:`~lossgraph.errors.UnsupportedOptionError` naming the one that does
(:func:`choose_loss`),

so that ``reduction="mean"`` equals scikit-learn's ``mean_squared_error``,
``mean_absolute_error`` and ``log_loss`` (sample weights included): ``log_loss`` is
``binary_log_loss`` for two classes given the probability of the second, and
``multiclass_log_loss`` for a probability per class. ``"log"`` and
``"cross_entropy"``, their names in the previous release, still work (deprecated). Regression
labels have the prediction's shape and type; class labels are int64 class
indices of shape ``(N,)``.

``multiclass_log_loss`` is also the **token-level** cross entropy: for a prediction of
shape ``(N, d1, ..., C)``, the classes on the last axis (as for ``(N, C)``; torch's
``F.cross_entropy`` takes them on axis 1), the labels have shape ``(N, d1, ...)`` and
the score is taken at each position. With ``ignore_index=k`` (torch's ``-100``
convention, default None: none ignored) a position whose label is ``k`` scores 0 and
does not count: ``f_i`` is the fraction of row ``i``'s positions that count (1 for every
other loss), so that the mean is the sum over the counted positions divided by their
(weighted) number, torch's ``F.cross_entropy(p.view(-1, C), y.view(-1),
ignore_index=k)``. ``sum`` and ``none`` keep the per-row losses ``l_i``: torch's
``reduction="sum"`` over positions is ``d1 * ... * dk`` times lossgraph's.

``multiclass_log_loss`` takes torch's ``label_smoothing=e`` and ``class_weight=c`` (one
weight per class): a position scores ``(1 - e) c[y] (-log p[y]) + e / C sum_k c[k] (-log
p[k])`` and counts ``c[y]`` (``f_i`` is the mean of row ``i``'s counts), so that the mean
divides by the weights of the labels counted, ``CrossEntropyLoss(weight=c,
label_smoothing=e, ignore_index=k)``; sample weights multiply the class weights
(scikit-learn's rule). :func:`balanced_class_weight` gives scikit-learn's ``"balanced"``
weights of training labels, computed before compiling so that the program holds numbers.
``binary_log_loss`` and ``logistic`` take ``pos_weight=c``, the positive term multiplied by
``c`` and the mean left plain, ``BCEWithLogitsLoss(pos_weight=c)``.

The result's inputs are the original inputs, the label, then the weight; its
outputs are the loss (a scalar of the prediction's float type), then the original
outputs. The roles of these tensors are recorded in the metadata
(:mod:`lossgraph.roles`); an ``ignore_index`` and a ``class_weight`` under
``lossgraph.loss`` (:func:`read_loss_record`: the Trainer accepts that label, and weighs
batch means by those weights).
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..builder import GraphBuilder
from ..deprecation import warn_renamed
from ..errors import (
    DTypeMismatchError,
    InvalidDataError,
    InvalidProgramError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import (
    FLOAT_TYPES,
    elem_type_name,
    np_dtype,
    opset_version,
    outer_references,
    subgraphs,
)
from ..metadata import LOSS_KEY, ROLES_KEY, read_json, remove_record, write_json
from ..models import ModelLike
from ..names import NameAuthority
from ..options import flag, non_negative
from ..penalties import parse_penalty, penalty_terms
from ..predictions import OutputKind, default_loss, mismatch, output_kind
from ..roles import get_roles, set_roles
from ..speed.sum_rows import SumRowsByProduct  # (the module: speed/__init__ imports passes)
from .contract import Pass, PassResult, Pipeline
from .gradient import Gradient

__all__ = ["AddLossOutput", "RemoveLossOutput", "add_loss_output", "SCORES", "resolve_score",
           "OUTPUT_OPTIONS", "REDUCTIONS", "loss_graph", "program_loss_graph", "AUTO",
           "LossChoice", "choose_loss", "canonical_loss", "balanced_class_weight",
           "position_weights", "read_loss_record"]


@dataclass(frozen=True)
class _Prediction:
    """The output the loss is computed on."""

    name: str
    elem_type: int
    dims: list[onnx.TensorShapeProto.Dimension]

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self.elem_type)


ScoreFn = Callable[[GraphBuilder, _Prediction, str, Mapping[str, Any]], str]


@dataclass(frozen=True)
class Score:
    """A loss function: how to build it, what label it needs, which options it takes."""

    build: ScoreFn
    class_labels: bool
    options: Mapping[str, Any]
    per_element: bool  # True: the result has the prediction's shape and is averaged per row
    #: True: classes on the prediction's last axis, a class label (and a result) at each
    #: position of the others (averaged per row); False: one class label per row
    per_position: bool = False

    def item_dims(self, p: _Prediction) -> list[onnx.TensorShapeProto.Dimension]:
        """The shape of the score's result: the label's for class labels."""
        if self.per_element:
            return p.dims
        return p.dims[:-1] if self.per_position else p.dims[:1]


# -- scores ------------------------------------------------------------------------


def _diff(b: GraphBuilder, p: _Prediction, label: str) -> str:
    return b.Sub(p.name, label, hint="diff")


def _squared(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    d = _diff(b, p, label)
    return b.Mul(d, d, hint="squared_error")


def _half_squared(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    d = _diff(b, p, label)
    return b.Mul(b.Mul(d, d), b.const(0.5, p.dtype, "half"), hint="half_squared_error")


def _absolute(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    return b.Abs(_diff(b, p, label), hint="absolute_error")


def _elastic(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    d = _diff(b, p, label)
    l1 = b.Mul(b.Abs(d), b.const(o["l1_weight"], p.dtype, "l1_weight"))
    l2 = b.Mul(b.Mul(d, d), b.const(o["l2_weight"], p.dtype, "l2_weight"))
    return b.Add(l1, l2, hint="elastic_error")


def _huber(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    # 0.5 q^2 + delta (|d| - q) with q = min(|d|, delta): no Where (slow in ort 1.19).
    a = b.Abs(_diff(b, p, label))
    delta = b.const(o["delta"], p.dtype, "delta")
    q = b.Min(a, delta)
    quadratic = b.Mul(b.Mul(q, q), b.const(0.5, p.dtype, "half"))
    linear = b.Mul(b.Sub(a, q), delta)
    return b.Add(quadratic, linear, hint="huber_error")


def _positive_probability(b: GraphBuilder, p: _Prediction) -> str:
    """The probability of class 1 as a (N,) tensor, from (N,), (N, 1) or (N, 2) outputs."""
    columns = p.dims[1].dim_value if p.rank == 2 else 1
    if p.rank == 1:
        return p.name
    if p.rank == 2 and columns in (1, 2):
        return b.Gather(p.name, b.const(columns - 1, np.int64, "positive_class"), axis=1)
    raise ShapeMismatchError(
        f"loss='binary_log_loss' needs a probability output of shape "
        f"(N,), (N, 1) or (N, 2); output {p.name!r} has {_shape_text(p.dims)}. "
        "Use loss='multiclass_log_loss' for more than two classes."
    )


def _binary_log_loss(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    eps = o["eps"] if o["eps"] is not None else float(np.finfo(p.dtype).eps)
    p1 = b.Clip(_positive_probability(b, p), b.const(eps, p.dtype, "eps"),
                b.const(1 - eps, p.dtype, "one_minus_eps"))
    y = b.Cast(label, to=p.elem_type)
    one = b.const(1, p.dtype, "one")
    positive = y if o["pos_weight"] is None else b.Mul(
        y, b.const(o["pos_weight"], p.dtype, "pos_weight"))
    log_likelihood = b.Add(b.Mul(positive, b.Log(p1)),
                           b.Mul(b.Sub(one, y), b.Log(b.Sub(one, p1))))
    return b.Neg(log_likelihood, hint="log_loss")


def _raw_score(b: GraphBuilder, p: _Prediction, what: str) -> str:
    if p.rank == 1:
        return p.name
    if p.rank == 2 and p.dims[1].dim_value == 1:
        return b.squeeze(p.name, [1])
    raise ShapeMismatchError(
        f"loss={what!r} needs a raw score of shape (N,) or (N, 1); output {p.name!r} "
        f"has {_shape_text(p.dims)}. Use loss='multiclass_log_loss' with from_logits=True "
        "for several classes."
    )


def _logistic(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    s = _raw_score(b, p, "logistic")
    y = b.Cast(label, to=p.elem_type)
    one = b.const(1, p.dtype, "one")
    # max(s, 0) as (s + |s|) / 2: its derivative at 0 is 1/2 (Relu's is 0), so the gradient
    # at s = 0 is sigmoid(0) - y, as everywhere else (a zero-initialized model starts there)
    a = b.Abs(s)
    half = b.const(0.5, p.dtype, "half")
    softplus = b.Add(b.Add(b.Mul(s, half), b.Mul(a, half)), b.Log(b.Add(one, b.Exp(b.Neg(a)))))
    if o["pos_weight"] is None:
        return b.Sub(softplus, b.Mul(y, s), hint="logistic_loss")
    # torch's pos_weight c: c y softplus(-s) + (1 - y) softplus(s)
    #                     = (1 + (c - 1) y) softplus(s) - c y s    (softplus(-s) = softplus(s) - s)
    c = o["pos_weight"]
    scale = b.Add(one, b.Mul(y, b.const(c - 1, p.dtype, "pos_weight_minus_one")))
    return b.Sub(b.Mul(scale, softplus), b.Mul(b.Mul(y, b.const(c, p.dtype, "pos_weight")), s),
                 hint="logistic_loss")


def _multiclass_log_loss(b: GraphBuilder, p: _Prediction, label: str, o: Mapping[str, Any]) -> str:
    if p.rank < 2 or p.dims[-1].dim_value == 1:
        raise ShapeMismatchError(
            f"loss='multiclass_log_loss' needs an output of shape (N, classes) with at least 2 "
            f"classes, or (N, d1, ..., classes) for a class at each position (the classes on "
            f"the last axis); output {p.name!r} has {_shape_text(p.dims)}. For one column of "
            "probabilities use loss='binary_log_loss', for one raw score 'logistic'; for "
            "torch's (N, classes, d1, ...) layout move the classes last before export "
            "(logits.movedim(1, -1))."
        )
    classes = p.rank - 1
    if o["from_logits"]:
        log_p = b.LogSoftmax(p.name, axis=classes)
    else:
        eps = o["eps"] if o["eps"] is not None else float(np.finfo(p.dtype).eps)
        clipped = b.Clip(p.name, b.const(eps, p.dtype, "eps"),
                         b.const(1 - eps, p.dtype, "one_minus_eps"))
        log_p = b.Log(clipped)
    picked = b.squeeze(b.GatherElements(log_p, b.unsqueeze(label, [classes]), axis=classes),
                       [classes])
    weights, smoothing = o["class_weight"], o["label_smoothing"]
    if weights is not None:
        count = p.dims[-1].dim_value
        if count and count != len(weights):
            raise UnsupportedOptionError(
                f"class_weight has {len(weights)} weights but output {p.name!r} has {count} "
                f"classes ({_shape_text(p.dims)}): give one weight per class.")
        picked = b.Mul(picked, _label_weight(b, label, weights, p.dtype))
    if not smoothing:
        return b.Neg(picked, hint="multiclass_log_loss")
    # torch's label smoothing e: (1 - e) w[y] (-log p[y]) + e / C sum_c w[c] (-log p[c])
    every = (b.reduce("ReduceSum", log_p, [classes], keepdims=0) if weights is None else
             b.MatMul(log_p, _class_weight(b, weights, p.dtype)))
    count = p.dims[-1].dim_value or len(weights or ())
    if count:
        spread = b.Mul(every, b.const(smoothing / count, p.dtype, "label_smoothing_share"))
    else:  # the number of classes known at run time only
        count_value = b.squeeze(b.Cast(b.dims(log_p, classes, classes + 1), to=p.elem_type), [0])
        spread = b.Div(b.Mul(every, b.const(smoothing, p.dtype, "label_smoothing")), count_value)
    kept = b.Mul(picked, b.const(1 - smoothing, p.dtype, "one_minus_label_smoothing"))
    return b.Neg(b.Add(kept, spread), hint="multiclass_log_loss")


def _class_weight(b: GraphBuilder, weights: list[float], dtype: np.dtype) -> str:
    """The class weights as a ``Constant`` node, not an initializer: a float initializer
    that reaches the loss would be taken for a weight to train."""
    return b.memo(("class_weight",), lambda: b.Constant(
        value=numpy_helper.from_array(np.asarray(weights, dtype)), hint="class_weight"))


def _label_weight(b: GraphBuilder, label: str, weights: list[float], dtype: np.dtype) -> str:
    """``class_weight[label]`` at each position (emitted once, for the score and the mean's
    divisor)."""
    return b.memo(("label_weight", label), lambda: b.Gather(
        _class_weight(b, weights, dtype), label, axis=0, hint="label_weight"))


SCORES: dict[str, Score] = {
    "squared_error": Score(_squared, False, {}, True),
    "half_squared_error": Score(_half_squared, False, {}, True),
    "absolute_error": Score(_absolute, False, {}, True),
    "elastic": Score(_elastic, False, {"l1_weight": 0.5, "l2_weight": 0.5}, True),
    "huber": Score(_huber, False, {"delta": 1.0}, True),
    "binary_log_loss": Score(_binary_log_loss, True, {"eps": None, "pos_weight": None}, False),
    "logistic": Score(_logistic, True, {"pos_weight": None}, False),
    "multiclass_log_loss": Score(_multiclass_log_loss, True,
                                 {"eps": None, "from_logits": False, "ignore_index": None,
                                  "label_smoothing": 0.0, "class_weight": None},
                                 False, per_position=True),
}
#: The loss that fits what the output holds (:func:`choose_loss`).
AUTO = "auto"
_ALIASES = {"l2": "squared_error", "l1": "absolute_error"}
#: Score names of the previous release (deprecated).
_RENAMED = {"log": "binary_log_loss", "cross_entropy": "multiclass_log_loss"}
_NON_NEGATIVE_OPTIONS = ("l1_weight", "l2_weight", "delta", "eps", "pos_weight")
_BOOL_OPTIONS = ("from_logits",)
_INT64 = np.iinfo(np.int64)
#: How the per-row losses become the loss output.
REDUCTIONS = ("mean", "sum", "none")
#: The options of add_loss_output other than the score's own (``delta``, ``eps``, ...).
OUTPUT_OPTIONS = ("loss_name", "label_name", "weight_name", "output_index", "reduction")


# -- options -------------------------------------------------------------------------


def _shape_text(dims: list[onnx.TensorShapeProto.Dimension]) -> str:
    parts = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
    return "shape (" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def resolve_score(score_name: str, options: Mapping[str, Any],
                  option: str = "loss") -> tuple[Score, dict[str, Any]]:
    """The score and its complete options; ``option`` is the name errors give the score
    (``compile`` calls it ``loss``)."""
    if not isinstance(score_name, str):
        raise UnsupportedOptionError(
            f"{option}={reprlib.repr(score_name)} must be a loss name: one of "
            f"{', '.join(map(repr, [*SCORES, *_ALIASES]))}.")
    if score_name in _RENAMED:
        warn_renamed(f"{option}={score_name!r}", f"{option}={_RENAMED[score_name]!r}", 4)
        score_name = _RENAMED[score_name]
    canonical = _ALIASES.get(score_name, score_name)
    if canonical not in SCORES:
        raise UnsupportedOptionError(
            f"Unknown {option} {score_name!r}."
            + suggest(score_name, [*SCORES, *_ALIASES], "loss names")
        )
    score = SCORES[canonical]
    unknown = sorted(set(options) - set(score.options))
    if unknown:
        valid = ", ".join(score.options) or "none"
        raise UnsupportedOptionError(
            f"{option}={score_name!r} takes no option {unknown[0]!r} (its options: {valid})."
        )
    resolved = {**score.options, **options}
    where = f" of {option}={score_name!r}"
    for key in _NON_NEGATIVE_OPTIONS:
        if resolved.get(key) is not None:
            non_negative(f"Option {key}", resolved[key], where)
    for key in _BOOL_OPTIONS:
        if key in resolved:
            flag(f"Option {key}", resolved[key], where)
    if resolved.get("ignore_index") is not None:
        resolved["ignore_index"] = _label_value("Option ignore_index", resolved["ignore_index"],
                                                where)
    if "label_smoothing" in resolved:
        resolved["label_smoothing"] = _smoothing(resolved["label_smoothing"], where)
    if resolved.get("class_weight") is not None:
        resolved["class_weight"] = _class_weights(resolved["class_weight"], where)
    if canonical == "huber" and resolved["delta"] == 0:
        raise UnsupportedOptionError(f"Option delta of {option}='huber' must be > 0.")
    if resolved.get("eps") is not None and not resolved["eps"] < 0.5:
        raise UnsupportedOptionError(f"Option eps={resolved['eps']!r} must be below 0.5.")
    return score, resolved


def canonical_loss(name: str) -> str:
    """A loss name as :data:`SCORES` spells it (aliases and previous names resolved)."""
    name = _RENAMED.get(name, name)
    return _ALIASES.get(name, name)


@dataclass(frozen=True)
class LossChoice:
    """The loss ``loss`` (with the score's ``options``) on the output ``output``, which
    holds ``kind``; ``picked``: chosen by ``loss="auto"``."""

    output: str
    kind: OutputKind
    loss: str
    options: Mapping[str, Any]
    picked: bool

    def __str__(self) -> str:
        spelled = "".join(f", {k}={v!r}" for k, v in self.options.items()
                          if SCORES[self.loss].options.get(k) != v)
        how = " (loss='auto' picks it for them)" if self.picked else ""
        return f"{self.output!r}, {self.kind}, with loss {self.loss}{spelled}{how}"


def choose_loss(model: onnx.ModelProto, loss: str, output_index: int | str | None = None,
                options: Mapping[str, Any] | None = None) -> LossChoice:
    """The output the loss is computed on (``output_index``'s, else the only output or
    the only float one) and the loss: ``loss``, or for :data:`AUTO` the one that fits
    what the output holds (:func:`lossgraph.predictions.default_loss`), its options
    completed with ``options``; a loss that does not fit the output is an
    :class:`UnsupportedOptionError` naming the one that does."""
    output = _select_output(model.graph, output_index)
    kind = output_kind(model, output.name)
    given = dict(options or {})
    if loss == AUTO:
        name, defaults = default_loss(kind)
        chosen = {**defaults, **given}
    else:
        name, chosen = canonical_loss(loss), given
    problem = mismatch(kind, name, chosen)
    if problem:
        other = "" if output_index is not None else (
            " (or name the output to train with output_index=...)")
        raise UnsupportedOptionError(f"{problem}{other}.")
    return LossChoice(output.name, kind, name, chosen, loss == AUTO)


def _label_value(what: str, value: Any, where: str) -> int:
    """An int64 class label value such as ``ignore_index`` (any sign: torch's is -100); an
    integral float such as the command line's ``-100.0`` is that integer."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
            and math.isfinite(value) and float(value).is_integer():
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or not _INT64.min <= value <= _INT64.max:
        raise UnsupportedOptionError(
            f"{what}={reprlib.repr(value)}{where} must be an int64 label value, e.g. -100 "
            "(torch's ignore_index), or None.")
    return int(value)


def _smoothing(value: Any, where: str) -> float:
    """``label_smoothing``: a number in [0, 1) (1 would leave no trace of the label)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not 0 <= value < 1:
        raise UnsupportedOptionError(
            f"Option label_smoothing={reprlib.repr(value)}{where} must be a number in [0, 1), "
            "e.g. 0.1 (torch's CrossEntropyLoss(label_smoothing=0.1)); 0 smooths nothing.")
    return float(value)


def _class_weights(value: Any, where: str) -> list[float]:
    """``class_weight``: one finite weight >= 0 per class, not all zero, as a list (JSON, for
    the metadata record)."""
    if isinstance(value, str) and value == "balanced":
        raise UnsupportedOptionError(
            f"Option class_weight='balanced'{where} needs the training labels, which compile "
            "does not see: pass class_weight=lossgraph.balanced_class_weight(y_train) "
            "(scikit-learn's n_samples / (n_classes * bincount(y)), computed now and kept in "
            "the program).")
    array = None
    if not isinstance(value, (str, bytes, Mapping)):
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            array = None
    if array is None or array.ndim != 1 or len(array) < 2 or not np.isfinite(array).all() \
            or (array < 0).any() or not array.any():
        raise UnsupportedOptionError(
            f"Option class_weight={reprlib.repr(value)}{where} must be a list of one weight per "
            "class, each a finite number >= 0 and not all zero (torch's CrossEntropyLoss "
            "weight=), e.g. [1.0, 2.5, 0.5], or lossgraph.balanced_class_weight(y_train).")
    return [float(w) for w in array]


def balanced_class_weight(y: Any, classes: int | None = None,
                          ignore_index: int | None = None) -> list[float]:
    """scikit-learn's ``class_weight="balanced"`` of the class labels ``y``:
    ``n_samples / (n_classes * bincount(y))``, for
    ``loss_options={"class_weight": balanced_class_weight(y_train)}``.

    ``classes`` is the model's number of classes (default: the largest label + 1); every
    class must occur in ``y``, as scikit-learn requires. Labels equal to ``ignore_index``
    (token labels, torch's ``-100``) are not counted.
    """
    labels = np.asarray(y)
    if labels.dtype.kind not in "iu" or labels.size == 0:
        raise InvalidDataError(
            f"balanced_class_weight needs integer class labels, not an array of "
            f"{labels.size} {labels.dtype} values: encode labels as class indices first (e.g. "
            "sklearn.preprocessing.LabelEncoder).")
    labels = labels.reshape(-1)
    if ignore_index is not None:
        labels = labels[labels != ignore_index]
    if labels.size == 0 or labels.min() < 0:
        problem = "no label" if labels.size == 0 else f"the label {int(labels.min())}"
        raise InvalidDataError(
            f"balanced_class_weight: y holds {problem} to count; labels must be class indices "
            "0, 1, ... (pass ignore_index= for a label the loss ignores).")
    count = int(labels.max()) + 1 if classes is None else classes
    counts = np.bincount(labels, minlength=count)
    missing = np.flatnonzero(counts == 0)
    if len(counts) > count or missing.size:
        problem = (f"the label {int(labels.max())}, beyond the {count} classes"
                   if len(counts) > count else f"no label of class {int(missing[0])}")
        raise InvalidDataError(
            f"balanced_class_weight: y holds {problem}; every class must occur, as scikit-learn "
            "requires. Pass classes= (the model's number of classes), or weights of your own.")
    return [float(w) for w in labels.size / (count * counts)]


def _select_output(graph: onnx.GraphProto, output_index: int | str | None) -> onnx.ValueInfoProto:
    outputs = list(graph.output)
    names = [o.name for o in outputs]
    if isinstance(output_index, str):
        if output_index not in names:
            raise UnknownNameError(
                f"output_index={output_index!r} is not an output of the model."
                + suggest(output_index, names, "outputs")
            )
        chosen = outputs[names.index(output_index)]
    elif isinstance(output_index, (int, np.integer)) and not isinstance(output_index, bool):
        if not -len(outputs) <= output_index < len(outputs):
            raise UnknownNameError(
                f"output_index={output_index} is out of range: the model has {len(outputs)} "
                f"output(s) ({', '.join(names)})."
            )
        chosen = outputs[output_index]
    elif output_index is None:
        floats = [o for o in outputs if o.type.tensor_type.elem_type in FLOAT_TYPES]
        if len(outputs) == 1:
            chosen = outputs[0]
        elif len(floats) == 1:
            chosen = floats[0]
        elif not floats and any(not o.type.HasField("tensor_type") for o in outputs):
            raise _not_a_tensor(graph, next(o for o in outputs
                                            if not o.type.HasField("tensor_type")))
        else:
            raise UnsupportedOptionError(
                f"The model has {len(outputs)} outputs ({', '.join(names)}) and "
                f"{len(floats)} of them are float tensors: pass output_index=<name or position> "
                "to say which one the loss is computed on."
            )
    else:
        raise UnsupportedOptionError(
            f"output_index must be None, an int or an output name, not {output_index!r}."
        )
    if not chosen.type.HasField("tensor_type"):
        raise _not_a_tensor(graph, chosen)
    return chosen


def _not_a_tensor(graph: onnx.GraphProto, output: onnx.ValueInfoProto) -> UnsupportedModelError:
    """The error for a loss on a sequence or map output, naming a ZipMap as such."""
    producer = next((n for n in graph.node if output.name in n.output), None)
    if producer is not None and producer.op_type == "ZipMap":
        return UnsupportedModelError(
            f"Output {output.name!r} comes from a ZipMap node ({producer.name or 'unnamed'}): "
            "a list of {class: probability} dicts, not a tensor a loss can use. "
            "compile_program trains on the tensor it zips by itself; here, replace the ZipMap "
            "first with lossgraph.passes.ZipMapToTensor(), or convert the classifier with "
            "skl2onnx.to_onnx(estimator, X, options={'zipmap': False}).")
    kind = (output.type.WhichOneof("value") or "value of unknown type").removesuffix("_type")
    return UnsupportedModelError(
        f"Output {output.name!r} is a {kind}, not a tensor: a loss needs a float tensor output "
        "(pass output_index=... to pick one).")


# -- the pass --------------------------------------------------------------------------


@dataclass(frozen=True)
class AddLossOutput(Pass[dict[str, str]]):
    """Add a scalar loss as the model's first output (module docstring; the options are
    those of :func:`add_loss_output`, the score's own in ``options``). The report is
    the roles recorded (:mod:`lossgraph.roles`)."""

    loss: str = AUTO
    loss_name: str | None = None
    label_name: str | None = None
    weight_name: str | None = None
    penalty: Mapping[str, Any] | None = None
    output_index: int | str | None = None
    reduction: str = "mean"
    options: Mapping[str, Any] = field(default_factory=dict)

    def call(self, model: onnx.ModelProto) -> PassResult:
        roles = _add_loss(model, self.loss, self.loss_name, self.label_name, self.weight_name,
                          self.penalty, self.output_index, self.reduction, dict(self.options))
        return PassResult(model, roles)


class _DefaultLoss(str):
    """``"squared_error"`` as add_loss_output's default, told apart from a loss given (so
    that onnxcustom's ``score_name`` may replace it, and a loss given with it is an error)."""


def add_loss_output(
    model: ModelLike,
    loss: str = _DefaultLoss("squared_error"),
    loss_name: str | None = None,
    label_name: str | None = None,
    weight_name: str | None = None,
    penalty: Mapping[str, Any] | None = None,
    output_index: int | str | None = None,
    reduction: str = "mean",
    *,
    score_name: str | None = None,
    **options: Any,
) -> onnx.ModelProto:
    """Return a copy of ``model`` with a scalar loss as its first output.

    Args:
        model: the inference model (ModelProto, bytes or path).
        loss: the loss function: ``squared_error`` (``l2``), ``absolute_error`` (``l1``),
            ``elastic``, ``huber``, ``binary_log_loss``, ``logistic`` or
            ``multiclass_log_loss``; see the module docstring. ``None`` is the previous
            release's spelling of the default (with a warning): ``compile_program``'s
            ``loss=None`` means a model that carries its loss.
        loss_name: name of the loss output; ``None`` means ``"loss"`` or, if taken, the
            first free ``"loss_1"``, ``"loss_2"``, ... An explicit name must be free.
        label_name: name of the label input, chosen like ``loss_name`` (``"label"``).
        weight_name: name of a per-row sample-weight input of shape ``(N,)``; ``None``
            means unweighted.
        penalty: ``{initializer: {"l1": a, "l2": b}}`` or ``{initializer: b}`` (L2).
        output_index: the output the loss is computed on: ``None`` (the only output, or
            the only float output), a position or a name.
        reduction: ``"mean"`` (weighted mean over rows; over the counted positions with
            ``ignore_index``), ``"sum"``, or ``"none"`` (the weighted loss of each row, shape
            ``(N,)``: an evaluation graph, which the gradient pass refuses, and without a
            penalty).
        score_name: onnxcustom's name of ``loss`` (either may be given, not both).
        **options: options of the loss function (``l1_weight``, ``l2_weight``, ``delta``,
            ``eps``, ``from_logits``, ``ignore_index``, ``label_smoothing``,
            ``class_weight``, ``pos_weight``).
    """
    if loss is None:
        warn_renamed("add_loss_output(loss=None)", "loss='squared_error' (None means a model "
                     "carrying its loss in compile_program)")
        loss = _DefaultLoss("squared_error")
    if score_name is not None:
        if not isinstance(loss, _DefaultLoss):
            raise UnsupportedOptionError(
                f"add_loss_output got loss={loss!r} and score_name={score_name!r}: score_name "
                "is onnxcustom's name of loss; pass one of them.")
        loss = score_name
    return AddLossOutput(str(loss), loss_name, label_name, weight_name, penalty, output_index,
                         reduction, options)(model).model


def _add_loss(model: onnx.ModelProto, score_name: str, loss_name: str | None,
              label_name: str | None, weight_name: str | None,
              penalty: Mapping[str, Any] | None, output_index: int | str | None,
              reduction: str, kwargs: dict[str, Any]) -> dict[str, str]:
    graph = model.graph
    if get_roles(model).get("loss"):
        raise UnsupportedModelError(
            f"The model already has a loss output ({get_roles(model)['loss']!r}); "
            "add_loss_output works on inference models."
        )
    if score_name != AUTO:
        resolve_score(score_name, kwargs)  # the options, checked before the model is read
    for option, value in (("loss_name", loss_name), ("label_name", label_name),
                          ("weight_name", weight_name)):
        if value is not None and not isinstance(value, str):
            raise UnsupportedOptionError(f"{option}={value!r} must be a tensor name or None.")
    if reduction not in REDUCTIONS:
        raise UnsupportedOptionError(
            f"reduction={reduction!r} is not one of {', '.join(map(repr, REDUCTIONS))}.")
    penalties = parse_penalty(penalty)
    if reduction == "none" and penalties:
        raise UnsupportedOptionError(
            "reduction='none' gives a loss per row, to which a penalty on the weights does not "
            "belong: leave penalty= out, or use reduction='mean' or 'sum'.")
    output = _select_output(graph, output_index)
    tensor_type = output.type.tensor_type
    prediction = _Prediction(output.name, tensor_type.elem_type, list(tensor_type.shape.dim))
    if prediction.elem_type not in FLOAT_TYPES:
        raise DTypeMismatchError(
            f"Output {prediction.name!r} is {elem_type_name(prediction.elem_type)}; "
            f"loss={score_name!r} needs a float or double output. Pick another output "
            "with output_index=..."
        )
    if prediction.rank == 0:
        raise ShapeMismatchError(
            f"Output {prediction.name!r} is a scalar; the loss needs a batch axis first."
        )
    choice = choose_loss(model, score_name, output_index, kwargs)
    score, options = resolve_score(choice.loss, choice.options)

    names = NameAuthority.for_model(model)
    loss = names.claim(loss_name, "loss name") if loss_name else names.fresh("loss")
    label = names.claim(label_name, "label name") if label_name else names.fresh("label")
    weight = names.claim(weight_name, "weight name") if weight_name else None
    batch = prediction.dims[0]

    b = GraphBuilder(names, opset_version(model), prefix="loss/")
    item_dims = score.item_dims(prediction)
    positions = list(range(1, len(item_dims)))  # a row's loss is the mean over these axes
    ignored = options.get("ignore_index")
    counted = None  # 1 where a position counts, 0 where its label is ignore_index
    scored_label = label
    if ignored is not None:  # the score sees class 0 there, and its loss is multiplied by 0
        kept = b.Not(b.Equal(label, b.const(ignored, np.int64, "ignore_index")))
        scored_label = b.Mul(label, b.Cast(kept, to=TensorProto.INT64), hint="scored_label")
        counted = b.Cast(kept, to=prediction.elem_type, hint="counted")
    per_item = score.build(b, prediction, scored_label, options)
    if counted is not None:
        per_item = b.Mul(per_item, counted, hint="counted_loss")
    share = counted  # a position's share of the mean (None: 1 each)
    class_weight = options.get("class_weight")
    if class_weight is not None:  # torch divides by the weights of the labels counted
        label_weight = _label_weight(b, scored_label, class_weight, prediction.dtype)
        share = label_weight if counted is None else b.Mul(counted, label_weight, hint="share")
    if weight is None and reduction == "mean":  # one reduction over rows and positions
        if share is None:
            total = b.reduce("ReduceMean", per_item, keepdims=0)
        else:
            total = b.Div(b.reduce("ReduceSum", per_item, keepdims=0),
                          b.reduce("ReduceSum", share, keepdims=0))
    else:
        per_row = _row_mean(b, per_item, positions, "row_loss")
        if reduction == "none":
            total = per_row if weight is None else b.Mul(per_row, weight)
        elif weight is None:
            total = b.reduce("ReduceSum", per_row, keepdims=0)
        else:
            total = b.reduce("ReduceSum", b.Mul(per_row, weight), keepdims=0)
            if reduction == "mean":
                row_share = weight if share is None else b.Mul(
                    weight, _row_mean(b, share, positions, "row_share"))  # w_i f_i
                total = b.Div(total, b.reduce("ReduceSum", row_share, keepdims=0))
    for term in _penalty_terms(b, graph, penalties, prediction):
        total = b.Add(total, term)
    b.rename(total, loss)
    b.append_to(graph)

    if score.class_labels:
        label_info = helper.make_tensor_value_info(label, TensorProto.INT64,
                                                   [None] * len(item_dims))
        for dim, item_dim in zip(label_info.type.tensor_type.shape.dim, item_dims):
            dim.CopyFrom(item_dim)
    else:
        label_info = helper.make_value_info(label, output.type)
    graph.input.append(label_info)
    if weight is not None:
        weight_info = helper.make_tensor_value_info(weight, prediction.elem_type, [None])
        weight_info.type.tensor_type.shape.dim[0].CopyFrom(batch)
        graph.input.append(weight_info)
    outputs = list(graph.output)
    del graph.output[:]
    loss_shape = [None] if reduction == "none" else []
    graph.output.append(helper.make_tensor_value_info(loss, prediction.elem_type, loss_shape))
    if reduction == "none":
        graph.output[-1].type.tensor_type.shape.dim[0].CopyFrom(batch)
    graph.output.extend(outputs)

    roles = {"loss": loss, "label": label, "prediction": prediction.name}
    if weight is not None:
        roles["sample_weight"] = weight
    set_roles(model, roles)
    record = {key: options[key] for key in ("ignore_index", "class_weight")
              if options.get(key) is not None}
    if record:
        write_json(model, LOSS_KEY, record)
    return roles


def read_loss_record(model: onnx.ModelProto) -> dict[str, Any]:
    """What the Trainer must know of a loss model's labels, as :class:`AddLossOutput`
    recorded it: ``ignore_index`` (the label value the loss ignores) and ``class_weight``
    (one weight per class), each None when the loss has none."""
    record = read_json(model, LOSS_KEY)
    if record is None:
        return {"ignore_index": None, "class_weight": None}
    ignored = record.get("ignore_index") if isinstance(record, dict) else None
    weights = record.get("class_weight") if isinstance(record, dict) else None
    if not isinstance(record, dict) or isinstance(ignored, bool) or not isinstance(
            ignored, (int, type(None))) or not (weights is None or (
                isinstance(weights, list) and all(isinstance(w, (int, float))
                                                  and not isinstance(w, bool) for w in weights))):
        raise InvalidProgramError(
            f"The model's metadata {LOSS_KEY!r} must be a JSON object such as "
            f'{{"ignore_index": -100, "class_weight": [1.0, 2.0]}}, not {record!r}: compile '
            "the model again.")
    return {"ignore_index": ignored, "class_weight": weights}


def position_weights(labels: np.ndarray, ignore_index: int | None,
                     class_weight: list[float] | None) -> np.ndarray | None:
    """Each label position's share of the mean loss, as the loss graph weighs it: 0 where
    the label is ``ignore_index``, else its class's weight (1 without ``class_weight``);
    None when every position counts 1. For batch means combined over several runs."""
    if ignore_index is None and class_weight is None:
        return None
    kept = labels != ignore_index if ignore_index is not None else np.ones(labels.shape, bool)
    if class_weight is None:
        return kept.astype(np.float64)
    return np.where(kept, np.asarray(class_weight)[np.where(kept, labels, 0)], 0.0)


def _row_mean(b: GraphBuilder, values: str, positions: list[int], hint: str) -> str:
    """The mean of each row of ``values`` over the axes ``positions`` (none: ``values``)."""
    if not positions:
        return values
    return b.reduce("ReduceMean", values, positions, keepdims=0, hint=hint)


def _penalty_terms(b: GraphBuilder, graph: onnx.GraphProto,
                   penalties: Mapping[str, Mapping[str, float]],
                   prediction: _Prediction) -> list[str]:
    """``a * sum|W| + b * sum W^2`` per penalized initializer, in the loss's dtype."""
    initializers = {t.name: t for t in graph.initializer}
    floats = [n for n, t in initializers.items() if t.data_type in FLOAT_TYPES]
    terms = []
    for name, coefficients in penalties.items():
        if name not in initializers:
            raise UnknownNameError(
                f"Penalty names {name!r}, which is not an initializer of the model."
                + suggest(name, floats, "float initializers")
            )
        if initializers[name].data_type not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Penalty names {name!r}, a {elem_type_name(initializers[name].data_type)} "
                "initializer; only float and double weights can be penalized."
            )
        weight = name
        if initializers[name].data_type != prediction.elem_type:
            weight = b.Cast(name, to=prediction.elem_type)
        terms += penalty_terms(b, weight, coefficients, prediction.dtype, hint=name)
    return terms


@dataclass(frozen=True)
class RemoveLossOutput(Pass[None]):
    """The inference model inside a loss model: :class:`AddLossOutput` undone::

        (inputs, label[, weight]) -> (loss, outputs)   becomes   (inputs) -> (outputs)

    The loss output goes with every node, initializer and input only it needed (the
    label, the sample weight, the penalty's constants), and so does the roles record.
    ``loss_name`` names the loss of a model that records none (onnxruntime's eval model,
    whose loss is its first output); by default the recorded loss, and a model without
    one is returned unchanged.
    """

    loss_name: str | None = None

    def call(self, model: onnx.ModelProto) -> PassResult:
        loss = self.loss_name or get_roles(model).get("loss")
        if loss is None:
            return PassResult(model, None, changed=False)
        graph = model.graph
        if loss not in {o.name for o in graph.output}:
            raise UnknownNameError(f"RemoveLossOutput: {loss!r} is not an output of the model."
                                   + suggest(loss, [o.name for o in graph.output], "outputs"))
        outputs = [o for o in graph.output if o.name != loss]
        needed = {o.name for o in outputs}
        kept = []
        for node in reversed(graph.node):
            if any(o in needed for o in node.output):
                kept.append(node)
                needed.update(i for i in node.input if i)
                needed.update(n for sub in subgraphs(node) for n in outer_references(sub))
        del graph.node[:]
        graph.node.extend(reversed(kept))
        for field_name, values in (("output", outputs),
                                   ("input", [i for i in graph.input if i.name in needed]),
                                   ("initializer", [t for t in graph.initializer
                                                    if t.name in needed])):
            del getattr(graph, field_name)[:]
            getattr(graph, field_name).extend(values)
        kept_info = [v for v in graph.value_info if v.name in needed]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
        remove_record(model, ROLES_KEY)
        remove_record(model, LOSS_KEY)
        return PassResult(model, None)


# -- the loss graph of fuse='separate' ------------------------------------------------


def program_loss_graph(prediction: onnx.ValueInfoProto, label: str, loss: str,
                       options: Mapping[str, Any], backend: str,
                       reduction: str | None = None, opset: int = 18) -> PassResult:
    """The ``loss`` graph of a separate program: :func:`loss_graph` of ``loss`` with
    compile_program's ``loss_options`` (``options``) on the prediction ``prediction``, whose
    label is named ``label``, at ``ai.onnx`` opset ``opset`` (the gradient graph's, so that
    a runner can chain the two into one session). ``reduction`` replaces the options' reduction: the
    data-parallel step (:mod:`lossgraph.parallel`) needs the gradient of the loss summed
    over the rows where the program's loss is their mean, which it divides by the rows'
    total weight. A mean over the positions an ``ignore_index`` leaves, or weighted by a
    ``class_weight``, is not that (its divisor counts positions, or sums their classes'
    weights): an UnsupportedOptionError."""
    own = {k: v for k, v in options.items() if k not in ("output_index", "label_name")}
    output_options = {k: own.pop(k) for k in ("loss_name", "weight_name", "reduction")
                      if k in own}
    if reduction is not None:
        divisor = [f"{key}={own[key]!r}" for key in ("ignore_index", "class_weight")
                   if own.get(key) is not None]
        if divisor and reduction == "sum" and output_options.get("reduction", "mean") == "mean":
            raise UnsupportedOptionError(
                f"loss={loss!r} with {' and '.join(divisor)} and reduction='mean' divides by "
                "the labels that count (their number, or the sum of their classes' weights) "
                "over the whole batch; the data-parallel step divides summed gradients by the "
                "rows' total weight, so it would not compute that mean. Train in one process "
                "(lossgraph.Trainer), or compile with loss_options reduction='sum' (the "
                "learning rate then scales with the batch).")
        output_options["reduction"] = reduction
    return loss_graph(prediction, loss, own, label_name=label, backend=backend, opset=opset,
                      **output_options)


def loss_graph(prediction: onnx.ValueInfoProto, loss: str, options: Mapping[str, Any],
               *, label_name: str | None = None, loss_name: str | None = None,
               weight_name: str | None = None, reduction: str = "mean",
               backend: str = "onnx", opset: int = 18) -> PassResult:
    """The graph ``(prediction, label[, weight]) -> (loss, prediction_grad)`` of
    ``loss`` (an :func:`~lossgraph.add_loss_output` loss with its ``options``) on a
    prediction of type ``prediction``; the report maps the prediction to its gradient.

    With ``reduction="none"`` the graph is ``(prediction, label[, weight]) -> (loss)``,
    the loss of each row, and has no gradient.
    """
    names = NameAuthority({prediction.name})
    copy = names.fresh(f"{prediction.name}_copy")  # the loss pass needs an output to score
    prediction = _named_dims(prediction)
    identity = helper.make_model(
        helper.make_graph([helper.make_node("Identity", [prediction.name], [copy])], "loss",
                          [prediction], [helper.make_value_info(copy, prediction.type)]),
        opset_imports=[helper.make_opsetid("", opset)])
    loss_model = AddLossOutput(loss, loss_name, label_name, weight_name, None, None, reduction,
                               dict(options))(identity).model
    kept = [o for o in loss_model.graph.output if o.name != copy]
    del loss_model.graph.output[:]
    loss_model.graph.output.extend(kept)
    if reduction == "none":
        return PassResult(loss_model, {})
    step = Pipeline((Gradient([prediction.name], loss_name=get_roles(loss_model)["loss"],
                              backend=backend), SumRowsByProduct()))(loss_model)
    return PassResult(step.model, step.report.of(Gradient))


def _named_dims(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """``value`` with a name for each dimension that has neither a size nor a name: the
    label, declared like the prediction, then shares them, so shape inference proves the
    two alike and the loss's gradient needs no run-time broadcast reduction."""
    named = onnx.ValueInfoProto()
    named.CopyFrom(value)
    dims = named.type.tensor_type.shape.dim
    taken = {dim.dim_param for dim in dims if dim.dim_param}
    for index, dim in enumerate(dims):
        if not dim.HasField("dim_value") and not dim.dim_param:
            # a name of the model's own (a column named 'N') never doubles as this one
            base = "N" if index == 0 else f"d{index}"
            name = next(n for n in (base, *(f"{base}_{i}" for i in range(1, len(dims) + 2)))
                        if n not in taken)
            dim.dim_param = name
            taken.add(name)
    return named
