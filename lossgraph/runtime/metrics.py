"""Metrics: scikit-learn's scores of a model's predictions, computed by an ONNX graph.

    metrics = Metrics(engine, ["accuracy", "top_3_accuracy", "log_loss"])
    metrics(data)     # {"accuracy": 0.93, "top_3_accuracy": 1.0, "log_loss": 0.21}

``Trainer.fit(metrics=...)`` computes them over the training data (and the validation
data) after every epoch, ``Trainer.evaluate(X, y, metrics=...)`` on demand. The model's
``predict`` graph gives the prediction; a small graph of standard ops over
``(prediction, label, sample_weight)`` (:func:`metric_graph`, every metric one output,
computed in float64) scores it, in the same onnxruntime as the training. Each equals
scikit-learn's function on the same predictions, sample weights included::

    accuracy          accuracy_score(y, classes)
    top_<k>_accuracy  top_k_accuracy_score(y, scores, k=k)  (ties as scikit-learn breaks them)
    f1                f1_score(y, classes)                   (binary: the class 1)
    log_loss          log_loss(y, probabilities)             (clipped to [eps, 1 - eps])
    mae               mean_absolute_error(y, p)
    rmse              root_mean_squared_error(y, p)
    r2                r2_score(y, p)                         (force_finite)

A regression metric averages its columns uniformly (scikit-learn's default ``multioutput``;
a prediction of more axes is one column per element). A classification metric reads what
the prediction holds (:func:`lossgraph.predictions.output_kind`): probabilities are the
class probabilities and ``p > 0.5`` the class of a single one; class scores and unbounded
values are logits (softmax, or sigmoid for a single one) and ``s > 0`` the class of a
single one; for a probability or score per class the class is the first largest. A label
the loss ignores (its ``ignore_index``) leaves its row out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..builder import GraphBuilder, standalone_model
from ..errors import UnknownNameError, UnsupportedOptionError, suggest
from ..names import NameAuthority
from ..predictions import PROBABILITIES, UNKNOWN, output_kind

__all__ = ["METRICS", "Metrics", "metric_graph", "metric_names"]

#: The metrics by name: whether they score class labels (else regression targets).
#: ``top_<k>_accuracy`` (k >= 1) is the one family. Which way is better is the monitor's
#: rule (:class:`~lossgraph.runtime.callbacks.Monitor`: accuracies, F1 and R2 higher).
METRICS: dict[str, bool] = {"accuracy": True, "f1": True, "log_loss": True, "mae": False,
                            "rmse": False, "r2": False}
_TOP_K = re.compile(r"top_([1-9][0-9]*)_accuracy")
_OPSET = 18


def _family(name: str) -> str:
    return "top_k_accuracy" if _TOP_K.fullmatch(name) else name


def metric_names(value: Any) -> tuple[str, ...]:
    """The metric names ``value`` lists (a list of strings, or one string), checked."""
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, Sequence) or isinstance(listed, bytes) or not all(
            isinstance(name, str) for name in listed):
        raise UnsupportedOptionError(
            f"metrics={value!r} must be a list of metric names, e.g. ['accuracy', "
            "'top_5_accuracy'] or ['mae', 'r2'].")
    known = [*METRICS, "top_5_accuracy"]
    for name in listed:
        if _family(name) not in METRICS and _family(name) != "top_k_accuracy":
            raise UnknownNameError(f"metrics names {name!r}, not a metric."
                                   + suggest(name, known, "metrics (top_<k>_accuracy for any k)"))
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if twice:
        raise UnsupportedOptionError(f"metrics names {twice[0]!r} twice: name each once.")
    return tuple(listed)


@dataclass(frozen=True)
class _Spec:
    """What the metric graph scores: the prediction (name, element type, shape as the
    manifest writes it, what it holds) and the label (its element type)."""

    prediction: str
    elem_type: int
    shape: list
    kind: str
    label: str
    label_type: int
    weight: str
    ignored: int | None

    @property
    def columns(self) -> int | None:
        """Classes (columns) of a class prediction: 1 for one per row, None if not static."""
        if len(self.shape) == 1:
            return 1
        return self.shape[-1] if isinstance(self.shape[-1], int) else None


def _check(names: Sequence[str], spec: _Spec) -> None:
    """Every metric fits the prediction and labels, else a named error before any work."""
    classes = spec.label_type == TensorProto.INT64
    for name in names:
        family = _family(name)
        for_classes = family == "top_k_accuracy" or METRICS[family]
        what = f"metric {name!r}"
        if for_classes and not classes:
            raise UnsupportedOptionError(
                f"The {what} scores class labels, but this program's labels are regression "
                "targets (float): use 'mae', 'rmse' or 'r2'.")
        if not for_classes:
            if classes:
                raise UnsupportedOptionError(
                    f"The {what} scores regression targets, but this program's labels are "
                    "class indices: use 'accuracy', 'top_<k>_accuracy', 'f1' or 'log_loss'.")
            continue
        if len(spec.shape) > 2:
            raise UnsupportedOptionError(
                f"The {what} scores one class a row, but the prediction has shape "
                f"{spec.shape} (a class at each position): compute it from predict().")
        columns = spec.columns
        if columns is None:
            raise UnsupportedOptionError(
                f"The {what} needs the prediction's class count, which its shape "
                f"{spec.shape} does not fix: export the model with a static last axis.")
        if columns == 1 and spec.kind == UNKNOWN and family != "top_k_accuracy":
            raise UnsupportedOptionError(
                f"The {what} needs to know whether output {spec.prediction!r} holds a "
                "probability (class 1 above 0.5) or a score (class 1 above 0), and its graph "
                "does not show it: end the model with a Sigmoid for a probability.")
        if family == "top_k_accuracy" and columns < 2:
            raise UnsupportedOptionError(
                f"The {what} ranks a score per class, but the prediction has one column: "
                "use 'accuracy' for a binary classifier.")
        if family == "f1" and columns > 2:
            raise UnsupportedOptionError(
                f"The {what} is binary F1 (class 1 against 0), but the prediction has "
                f"{columns} classes: use 'accuracy' or 'top_<k>_accuracy'.")


def metric_graph(names: Sequence[str], spec: _Spec) -> onnx.ModelProto:
    """The graph ``(prediction, label, sample_weight) -> one float64 scalar per metric``
    (module docstring)."""
    _check(names, spec)
    taken = NameAuthority({spec.prediction, spec.label, spec.weight, *names})
    b = GraphBuilder(taken, _OPSET)
    double = TensorProto.DOUBLE
    p = b.Cast(spec.prediction, to=double, hint="prediction_f64")
    w = b.Cast(spec.weight, to=double, hint="weight_f64")
    y = spec.label
    if spec.ignored is not None and spec.label_type == TensorProto.INT64:
        counted = b.Not(b.Equal(y, b.const(spec.ignored, np.int64, "ignored")))
        w = b.Mul(w, b.Cast(counted, to=double), hint="counted_weight")
        y = b.Where(counted, y, b.const(0, np.int64, "zero_label"), hint="scored_label")
    total = b.reduce("ReduceSum", w, keepdims=0, hint="weight_sum")

    def mean(per_row: str, hint: str) -> str:
        return b.Div(b.reduce("ReduceSum", b.Mul(per_row, w), keepdims=0), total, hint=hint)

    eps = float(np.finfo(helper.tensor_dtype_to_np_dtype(spec.elem_type)).eps)
    outputs = []
    for name in names:
        family = _family(name)
        if family in ("mae", "rmse", "r2"):
            value = _regression(b, family, p, b.Cast(y, to=double), w, total)
        elif family == "accuracy":
            value = mean(b.Cast(b.Equal(_classes(b, p, spec), y), to=double), "accuracy")
        elif family == "f1":
            value = _f1(b, b.Equal(_classes(b, p, spec), b.const(1, np.int64, "one")),
                        b.Equal(y, b.const(1, np.int64, "one")), w)
        elif family == "log_loss":
            probabilities = b.Clip(_probabilities(b, p, spec), b.const(eps, np.float64, "eps"),
                                   b.const(1 - eps, np.float64, "one_minus_eps"))
            picked = b.GatherElements(probabilities, b.unsqueeze(y, [1]), axis=1)
            value = mean(b.Neg(b.squeeze(b.Log(picked), [1])), "log_loss")
        else:
            k = int(_TOP_K.fullmatch(name).group(1))
            value = mean(b.Cast(b.Less(_rank(b, p, y, spec.columns),
                                       b.const(k, np.int64, "k")), to=double), "top_k")
        outputs.append((value, name, helper.make_tensor_value_info(name, double, [])))
    inputs = [
        helper.make_tensor_value_info(spec.prediction, spec.elem_type, _dims(spec.shape)),
        helper.make_tensor_value_info(spec.label, spec.label_type,
                                      ["N"] if spec.label_type == TensorProto.INT64 else
                                      _dims(spec.shape)),
        helper.make_tensor_value_info(spec.weight, spec.elem_type, ["N"])]
    return standalone_model(b, "metrics", inputs, outputs, _OPSET)


def _dims(shape: Sequence[Any]) -> list[Any]:
    return ["N", *shape[1:]]


def _columns(b: GraphBuilder, x: str) -> str:
    """``x`` as ``(N, K)``: one column per non-batch element (a vector is one column)."""
    return b.Reshape(x, b.ints([0, -1]), hint="columns")


def _regression(b: GraphBuilder, family: str, p: str, y: str, w: str, total: str) -> str:
    """scikit-learn's MAE, RMSE or R2, each column's weighted, averaged over columns."""
    p, y = _columns(b, p), _columns(b, y)
    w_col = b.unsqueeze(w, [1])
    diff = b.Sub(p, y, hint="diff")

    def column_sum(x: str) -> str:
        return b.reduce("ReduceSum", b.Mul(x, w_col), [0], keepdims=0)

    if family == "mae":
        per_column = b.Div(column_sum(b.Abs(diff)), total)
    elif family == "rmse":
        per_column = b.Sqrt(b.Div(column_sum(b.Mul(diff, diff)), total))
    else:
        y_mean = b.unsqueeze(b.Div(column_sum(y), total), [0])
        centred = b.Sub(y, y_mean)
        residual = column_sum(b.Mul(diff, diff))
        spread = column_sum(b.Mul(centred, centred))
        zero, one = b.const(0.0, np.float64, "zero"), b.const(1.0, np.float64, "one_f64")
        exact = b.Equal(residual, zero)
        # force_finite: a constant target scores 1 when predicted exactly, else 0
        per_column = b.Where(b.Equal(spread, zero), b.Where(exact, one, zero),
                             b.Where(exact, one, b.Sub(one, b.Div(residual, spread))))
    return b.reduce("ReduceMean", per_column, keepdims=0, hint=family)


def _single(spec: _Spec) -> bool:
    return spec.columns == 1


def _classes(b: GraphBuilder, p: str, spec: _Spec) -> str:
    """The predicted class of each row, int64 ``(N,)``."""
    if _single(spec):
        threshold = 0.5 if spec.kind == PROBABILITIES else 0.0
        above = b.Greater(b.Reshape(p, b.ints([-1])), b.const(threshold, np.float64, "threshold"))
        return b.Cast(above, to=TensorProto.INT64, hint="classes")
    return b.ArgMax(p, axis=1, keepdims=0, hint="classes")


def _probabilities(b: GraphBuilder, p: str, spec: _Spec) -> str:
    """Class probabilities ``(N, C)``: the prediction's, or the softmax (sigmoid) of its
    logits."""
    if _single(spec):
        p1 = b.Reshape(p, b.ints([-1, 1]))
        if spec.kind != PROBABILITIES:
            p1 = b.Sigmoid(p1)
        return b.Concat(b.Sub(b.const(1.0, np.float64, "one_f64"), p1), p1, axis=1)
    return p if spec.kind == PROBABILITIES else b.Softmax(p, axis=1)


def _rank(b: GraphBuilder, scores: str, y: str, columns: int) -> str:
    """Where the true class stands among the classes sorted by decreasing score, counted
    from 0: the classes scored higher, and those scored equal with a larger index (the
    order of scikit-learn's reversed stable argsort)."""
    true_score = b.GatherElements(scores, b.unsqueeze(y, [1]), axis=1)
    higher = b.Greater(scores, true_score)
    later = b.Greater(b.ints(list(range(columns)), "class_index"), b.unsqueeze(y, [1]))
    ahead = b.Or(higher, b.And(b.Equal(scores, true_score), later))
    return b.reduce("ReduceSum", b.Cast(ahead, to=TensorProto.INT64), [1], keepdims=0,
                    hint="rank")


def _f1(b: GraphBuilder, predicted: str, actual: str, w: str) -> str:
    """Binary F1 of class 1: ``2 tp / (2 tp + fp + fn)``, 0 when no row is or is
    predicted class 1 (scikit-learn's zero_division)."""

    def weighted(mask: str) -> str:
        return b.reduce("ReduceSum", b.Mul(b.Cast(mask, to=TensorProto.DOUBLE), w), keepdims=0)

    tp2 = b.Mul(weighted(b.And(predicted, actual)), b.const(2.0, np.float64, "two"))
    denominator = b.Add(weighted(b.Xor(predicted, actual)), tp2)  # fp + fn + 2 tp
    zero = b.const(0.0, np.float64, "zero")
    safe = b.Max(denominator, b.const(1e-300, np.float64, "tiny"))
    return b.Where(b.Greater(denominator, zero), b.Div(tp2, safe), zero, hint="f1")


class Metrics:
    """The metrics ``names`` of an :class:`~lossgraph.runtime.engine.Engine`'s model, checked
    on construction (before any work) and computed on prepared data by one graph."""

    def __init__(self, engine: Any, names: Any) -> None:
        self.names = metric_names(names)
        self.engine = engine
        manifest = engine.program.manifest
        roles = manifest["roles"]
        entry = manifest["graphs"]["evaluate"]
        label = next(v for v in entry["inputs"] if v["role"] == "label")
        output = next(v for v in manifest["graphs"]["predict"]["outputs"]
                      if v["name"] == roles["prediction"])
        elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(output["dtype"]))
        kind = output_kind(engine.program.light_graphs["predict"], output["name"]).kind
        self._features = [v["name"] for v in manifest["graphs"]["predict"]["inputs"]
                          if v["role"] == "feature"]
        self._spec = _Spec(
            "prediction", elem_type, list(output["shape"]), kind, "label",
            helper.np_dtype_to_tensor_dtype(np.dtype(label["dtype"])), "sample_weight",
            engine.ignored_label)
        self.graph = metric_graph(self.names, self._spec) if self.names else None
        self._session = None

    def __bool__(self) -> bool:
        return bool(self.names)

    def __call__(self, data: Mapping[str, np.ndarray], ema: bool = False) -> dict[str, float]:
        """Each metric on ``data`` (prepared for the evaluate graph) at the live state (with
        ``ema=True``, at the weights' averages)."""
        if not self.names:
            return {}
        if self._session is None:
            self._session = self.engine.new_session(self.graph, "metrics")
        engine = self.engine
        prediction = engine.predict({name: data[name] for name in self._features}, ema)
        label = data[engine.label]
        rows = len(label)
        weight = (data[engine.sample_weight] if engine.sample_weight in data else
                  np.ones(rows, prediction.dtype))
        values = self._session.run(None, {"prediction": prediction, "sample_weight": weight,
                                          "label": label.reshape(rows, *prediction.shape[1:])
                                          if label.dtype.kind == "f" else label})
        return {name: float(value) for name, value in zip(self.names, values)}
