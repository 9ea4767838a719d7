"""Checks of options, models and data, done before any work by compile and the Trainer.

Each check returns the value in the form the caller uses (a list for a single name, an
optimizer for its name) or raises the :mod:`lossgraph.errors` class that fits, with a
message naming the option, tensor or row at fault and how to fix it. Decisions made
here, once for every caller:

- a single name where a list of names is expected (``weights="coef"``, one
  callback) is a list of one, never split into letters;
- Python lists are data: converted to the dtype the model declares (a list has no dtype
  of its own); objects with ``to_numpy()`` (pandas, polars) or ``__array__`` are read as
  arrays; an array of another dtype is an error, never a silent copy to another type;
- data are checked for NaN and infinity before training (one read of the data, about
  as long as one epoch of a linear model takes to read it; the row is named); arrays
  already checked, the same objects with the same layout, are not checked again
  (:class:`CheckedArrays`), so a loop of warm-start fits over the same arrays pays once.
"""

from __future__ import annotations

import numbers
import reprlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from . import training_build
from .analysis import stuck_weights
from .errors import (
    DTypeMismatchError,
    InvalidDataError,
    InvalidModelError,
    NoGradientError,
    ShapeMismatchError,
    StuckWeightWarning,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from .graphs import FLOAT_TYPES, elem_type_name
from .manifest import FUSE_MODES
from .models import check_declared_outputs
from .optim import Optimizer, as_optimizer
from .options import choice, count, flag, names
from .passes.gradient import BACKENDS
from .passes.loss import OUTPUT_OPTIONS, resolve_score
from .penalties import parse_penalty
from .roles import get_roles

__all__ = [
    "CompileOptions", "compile_options", "check_trainable_model", "no_weights_error",
    "check_penalized", "count", "flag", "choice", "random_state", "callbacks", "names",
    "as_array", "check_values", "CheckedArrays",
]

#: ai.onnx.ml operators that keep their parameters in attributes: nothing to train.
_ATTRIBUTE_MODELS = ("TreeEnsembleRegressor", "TreeEnsembleClassifier", "TreeEnsemble",
                     "SVMRegressor", "SVMClassifier")
#: Elements per block of the NaN check (256 KiB of float32, its mask 64 KiB).
_FINITE_BLOCK = 1 << 16


# -- options -----------------------------------------------------------------------------


def random_state(value: Any) -> int | np.random.Generator | None:
    """A seed for ``numpy.random.default_rng``: None, an integer >= 0, or a Generator."""
    if value is None or isinstance(value, np.random.Generator):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) \
            and value >= 0:
        return int(value)
    raise UnsupportedOptionError(
        f"random_state={reprlib.repr(value)} must be None, an integer >= 0 or a "
        "numpy.random.Generator.")


def callbacks(value: Any) -> list[Callable]:
    """The callbacks as a list (a single callable is a list of one), each callable."""
    if value is None:
        return []
    if callable(value):
        return [value]
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise UnsupportedOptionError(
            f"callbacks={reprlib.repr(value)} must be a list of functions "
            "callback(trainer, epoch, logs).")
    listed = list(value)
    for index, callback in enumerate(listed):
        if not callable(callback):
            raise UnsupportedOptionError(
                f"callbacks[{index}]={reprlib.repr(callback)} is not callable: each callback is "
                "a function callback(trainer, epoch, logs).")
    return listed


@dataclass(frozen=True)
class CompileOptions:
    """``compile``'s options, checked and in the form the pipeline uses."""

    weights: list[str] | None
    loss_options: dict[str, Any]
    optimizer: Optimizer
    backend: str
    fuse: str


def compile_options(weights: Any, loss: Any, loss_options: Any, penalty: Any,
                    optimizer: Any, backend: Any, fuse: Any) -> CompileOptions:
    """Check every option of ``compile`` that does not need the model."""
    fuse = choice("fuse", fuse, FUSE_MODES)
    backend = choice("backend", backend, BACKENDS)
    if backend == "ort":
        training_build.bindings("backend='ort'")  # before any work, not after the loss
    options = _loss_options(loss, loss_options)
    parse_penalty(penalty)
    if loss is None and penalty:
        raise UnsupportedOptionError(
            "penalty= needs lossgraph to add the loss; with loss=None the model carries its "
            "own. Add the penalty when building it: add_loss_output(..., penalty=...).")
    return CompileOptions(names("weights", weights, allow_empty=True), options,
                          as_optimizer(optimizer),
                          backend, fuse)


def _loss_options(loss: Any, options: Any) -> dict[str, Any]:
    """``loss_options`` as a dict: add_loss_output's options and those of the score."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise UnsupportedOptionError(
            f"loss_options={reprlib.repr(options)} must be a dict of add_loss_output options, "
            "e.g. {'weight_name': 'sample_weight', 'reduction': 'sum'}.")
    options = dict(options)
    if loss is None:
        if options:
            raise UnsupportedOptionError(
                f"loss_options={options!r} has no effect with loss=None (the model carries its "
                "loss already): leave it out.")
        return options
    for key in options:
        if key in ("loss", "score_name", "penalty"):
            where = "penalty=" if key == "penalty" else "loss="
            raise UnsupportedOptionError(
                f"loss_options holds {key!r}: pass it to compile itself as {where}...")
    score, _ = resolve_score(loss, {}, option="loss")
    valid = [*OUTPUT_OPTIONS, *score.options]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise UnsupportedOptionError(
            f"loss_options has no key {unknown[0]!r} for loss={loss!r}."
            + suggest(str(unknown[0]), valid, "keys"))
    resolve_score(loss, {k: v for k, v in options.items() if k in score.options}, option="loss")
    if options.get("reduction") == "none":
        raise UnsupportedOptionError(
            "loss_options={'reduction': 'none'} gives a loss per row; training needs one number "
            "to minimize: use 'mean' (the default) or 'sum'.")
    return options


def check_penalized(penalty: Mapping[str, Any] | None, weights: Sequence[str]) -> None:
    """Every penalized weight is trained: a penalty on a frozen weight changes nothing."""
    for name in parse_penalty(penalty):
        if name not in weights:
            raise UnsupportedOptionError(
                f"penalty names {name!r}, which is not trained (trained: {list(weights)}): a "
                "penalty on a frozen weight would add a constant to the loss and change "
                "nothing. Train it, or drop it from penalty." + suggest(name, weights, "weights"))


# -- models ------------------------------------------------------------------------------


def check_trainable_model(model: onnx.ModelProto) -> None:
    """What makes a valid model untrainable, named before any pass runs: an empty graph,
    a data input or an output without a free batch axis, an output declared of another
    shape than its node computes (:func:`~lossgraph.models.check_declared_outputs`),
    parameters kept in attributes only."""
    graph = model.graph
    if not graph.node:
        raise UnsupportedModelError(
            f"The model's graph {graph.name!r} has no nodes: its outputs are its inputs or "
            "constants, so there is nothing to train.")
    for kind, values in (("Input", graph.input), ("Output", graph.output)):
        for value in values:
            elem_type = value.type.tensor_type.elem_type
            if value.type.HasField("tensor_type") and (
                    elem_type == onnx.TensorProto.UNDEFINED
                    or elem_type not in onnx.TensorProto.DataType.values()):
                raise InvalidModelError(
                    f"{kind} {value.name!r} has no element type (elem_type {elem_type}, "
                    "which ONNX does not define as a type): the model is damaged, or its "
                    "exporter wrote it wrong. Declare its type (e.g. float) in the model.")
    initializers = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and not dims:
            raise UnsupportedModelError(
                f"Input {value.name!r} is a scalar: lossgraph feeds data in batches of rows, "
                "so every data input needs a batch axis first.")
        if dims and dims[0].HasField("dim_value"):
            shape = ", ".join(str(d.dim_value) if d.HasField("dim_value") else
                              (d.dim_param or "?") for d in dims)
            raise UnsupportedModelError(
                f"Input {value.name!r} has a fixed batch dimension of {dims[0].dim_value} "
                f"(shape ({shape})), as torch.onnx.export writes without dynamic axes: it "
                "could train and predict only that many rows at a time. Export again with a "
                f"free batch axis: torch.onnx.export(..., dynamic_axes={{{value.name!r}: "
                "{0: 'batch'}, <output>: {0: 'batch'}}) (or dynamo=True with dynamic_shapes). "
                "A graph that does not hard-code the batch size can also be freed with "
                "onnx.tools.update_model_dims.update_inputs_outputs_dims.")
    for value in graph.output:
        dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else ()
        if dims and dims[0].HasField("dim_value"):
            shape = ", ".join(str(d.dim_value) if d.HasField("dim_value") else
                              (d.dim_param or "?") for d in dims)
            raise UnsupportedModelError(
                f"Output {value.name!r} has a fixed batch dimension of {dims[0].dim_value} "
                f"(shape ({shape})), but the inputs' batch dimension is free: lossgraph trains "
                "on batches of rows, so each output needs a free batch axis first as well. "
                "Declare it like the inputs' (e.g. 'N'), or export again with dynamic axes for "
                "the outputs too.")
    check_declared_outputs(model)
    floats = [t for t in graph.initializer if t.data_type in FLOAT_TYPES]
    fixed = [n for n in graph.node if n.domain == "ai.onnx.ml" and n.op_type in _ATTRIBUTE_MODELS]
    if fixed and not floats:
        node = fixed[0]
        raise UnsupportedModelError(
            f"Node {node.name or '(unnamed)'!r} is an ai.onnx.ml {node.op_type}: it keeps its "
            "parameters in node attributes and computes a piecewise-constant function, so "
            "there is no weight to train by gradient descent. Refit the estimator (e.g. with "
            "scikit-learn) and convert it again.")


def check_learnable(model: onnx.ModelProto, weights: Sequence[str]) -> None:
    """Weights that training can never change (every path to the loss passes an op whose
    gradient is zero everywhere: :func:`~lossgraph.analysis.stuck_weights`): a
    NoGradientError when all are, else a StuckWeightWarning naming them."""
    stuck = stuck_weights(model, weights)
    if not stuck:
        return
    loss = get_roles(model).get("loss", "the outputs")
    paths = "".join(f"\n  {weight.describe()}" for weight in stuck)
    zeros = ", ".join(dict.fromkeys(w.node.op_type for w in stuck))
    way_out = (f"Train through a differentiable stand-in for {zeros} (e.g. the straight-"
               "through estimator, x + (Round(x) - x) with the difference as a constant, "
               "before export), or train weights with a differentiable path.")
    names = ", ".join(repr(w.name) for w in stuck)
    if len(stuck) == len(weights):
        raise NoGradientError(
            f"No weight can learn: {names} reach{'es' * (len(stuck) == 1)} the loss {loss!r} "
            f"only through ops whose gradient is zero wherever it exists ({zeros}), so "
            f"gradient descent would never change {'them' if len(stuck) > 1 else 'it'}:"
            f"{paths}\n{way_out}")
    warnings.warn(
        f"{names} reach{'es' * (len(stuck) == 1)} the loss {loss!r} only through ops whose "
        f"gradient is zero wherever it exists ({zeros}): training will not change "
        f"{'them' if len(stuck) > 1 else 'it'}:{paths}\n{way_out}", StuckWeightWarning,
        stacklevel=4)


def weights_dtype(weights: Mapping[str, np.ndarray], what: str) -> np.dtype:
    """The one float dtype (float32 or float64) all ``weights`` share."""
    if not weights:
        raise UnsupportedOptionError(f"{what} needs at least one weight; none was given.")
    dtypes: dict[np.dtype, str] = {}
    for name, value in weights.items():
        dtype = np.asarray(value).dtype
        if helper.np_dtype_to_tensor_dtype(dtype) not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Weight {name!r} is {dtype}; {what} works on float32 or float64 weights."
            )
        dtypes.setdefault(dtype, name)
    if len(dtypes) > 1:
        listing = ", ".join(f"{name!r} is {dtype}" for dtype, name in dtypes.items())
        raise UnsupportedModelError(
            f"{what} needs weights of one float type, but {listing}. Cast the model's "
            "weights to one type first."
        )
    return next(iter(dtypes))


def no_weights_error(model: onnx.ModelProto) -> UnsupportedModelError:
    """Why the model has no trainable weight, and what to do."""
    graph = model.graph
    if not graph.initializer:
        constants = [n.output[0] for n in graph.node if n.op_type == "Constant"]
        where = (f" Its weights seem to be Constant nodes ({', '.join(map(repr, constants[:5]))}"
                 "), which are not trainable: lift them into initializers first, e.g. with "
                 "onnx_ir.passes.common.LiftConstantsToInitializersPass, or export without "
                 "constant folding." if constants else "")
        return UnsupportedModelError(f"The model has no initializers, so no trainable weights."
                                     f"{where}")
    listed = ", ".join(f"{t.name!r} ({elem_type_name(t.data_type)}{list(t.dims)})"
                       for t in list(graph.initializer)[:10])
    return UnsupportedModelError(
        "The model has no trainable weights (float initializers of rank >= 1 that influence the "
        f"loss); its initializers: {listed}. Pass weights=[...] to name the ones to train.")


# -- data --------------------------------------------------------------------------------


def _shape_text(shape: Sequence[int | str | None]) -> str:
    """``(N, K)`` for a declared shape: each dimension's size or own name, ``?`` unnamed."""
    dims = ["?" if d is None else str(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def as_array(value: Any, spec: Mapping[str, Any], what: str) -> np.ndarray:
    """``value`` as a C-contiguous array of the dtype and shape input ``spec`` declares.

    ``spec`` is a manifest entry (``name``, ``dtype``, ``shape``, ``role``); ``what`` names
    the data in messages (``X``, ``y``, ``validation_data y``...). The caller's array is
    never written to: a conversion makes a copy. An ``(N,)`` array is read as one column
    where the input is ``(N, 1)``, and a label in one column, ``(N, 1)``, where the label is
    ``(N,)`` (onnxcustom's examples pass ``y.reshape((-1, 1))``); no other shape changes.
    """
    expected = np.dtype(spec["dtype"])
    declared = f"{expected} of shape {_shape_text(spec['shape'])}"
    if value is None:
        raise InvalidDataError(f"No data for input {spec['name']!r} ({declared}).")
    if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):
        value = value.to_numpy()
    if isinstance(value, (list, tuple)):
        array = _from_list(value, expected, what)
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InvalidDataError(f"{what} cannot be read as an array: {exc}.") from None
    if array.dtype.kind not in "biuf":
        raise DTypeMismatchError(
            f"{what} holds {array.dtype} values, not numbers; input {spec['name']!r} of the "
            f"model is {declared}.")
    if array.ndim and not len(array):
        raise InvalidDataError(f"{what} has no rows.")
    if array.dtype != expected:
        if not (array.dtype.kind in "iub" and expected.kind in "iu"):
            raise DTypeMismatchError(
                f"{what} is {array.dtype} but input {spec['name']!r} of the model is "
                f"{declared}: convert it first with .astype(np.{expected.name}) (lossgraph "
                "does not change your data's type behind your back).")
        array = array.astype(expected)
    shape = spec["shape"]
    if array.ndim == len(shape) - 1 and shape and shape[-1] == 1:
        array = array.reshape(*array.shape, 1)  # y of shape (N,) for an (N, 1) output
    elif (spec.get("role") == "label" and len(shape) == 1 and array.ndim == 2
          and array.shape[1] == 1):
        array = array.reshape(len(array))  # y in one column, (N, 1), for an (N,) label
    if array.ndim != len(shape) or any(
            isinstance(d, int) and d != n for d, n in zip(shape[1:], array.shape[1:])):
        raise ShapeMismatchError(
            f"{what} has shape {array.shape} but input {spec['name']!r} of the model is "
            f"{declared}.")
    return np.ascontiguousarray(array)


def _from_list(value: list | tuple, expected: np.dtype, what: str) -> np.ndarray:
    """A list's numbers in the model's dtype; integral values only for integer inputs."""
    try:
        array = np.asarray(value)
    except ValueError:
        raise InvalidDataError(
            f"{what} is a list whose rows differ in length (or nest differently): every row "
            "needs the same shape.") from None
    if array.dtype.kind == "f" and expected.kind in "iu":
        if not np.array_equal(array, np.round(array)):
            raise DTypeMismatchError(
                f"{what} holds non-integral numbers, but the model takes {expected} there "
                "(class indices).")
    if array.dtype.kind in "biuf":
        return array.astype(expected)
    return array


def check_values(array: np.ndarray, role: str, what: str, classes: int | None = None,
                 finite: bool = True, ignored: int | None = None) -> None:
    """The values fit their role: finite floats (unless ``finite`` is False), sample weights
    >= 0 and not all zero, integer labels class indices in ``0..classes-1`` (any index
    >= 0 when ``classes`` is None: the model's class count is not static) or ``ignored``
    (the loss's ``ignore_index``), which may not be every label."""
    if finite and array.dtype.kind == "f" and not _all_finite(array):
        rows = np.isfinite(array.reshape(len(array), -1))
        row = int(np.flatnonzero(~rows.all(axis=1))[0])
        column = int(np.flatnonzero(~rows[row])[0])
        where = f"row {row}" + (f", column {column}" if rows.shape[1] > 1 else "")
        raise InvalidDataError(
            f"{what} holds {array.reshape(len(array), -1)[row, column]} at {where}: "
            "clean or impute NaN and infinite values first.")
    if role == "sample_weight":
        negative = np.flatnonzero(array < 0)
        if negative.size:
            raise InvalidDataError(
                f"{what} is negative at row {int(negative[0])} ({array[negative[0]]}): sample "
                "weights must be >= 0.")
        if not array.any():
            raise InvalidDataError(
                f"{what} is all zero: no row would count. Give some rows a positive weight.")
    if role == "label" and array.dtype.kind in "iu":
        _check_class_labels(array, what, classes, ignored)


def _check_class_labels(array: np.ndarray, what: str, classes: int | None,
                        ignored: int | None) -> None:
    """Class indices, or ``ignored``; the first bad one named by row (and position)."""
    outside = (array < 0) | (array >= classes if classes else False)
    if ignored is not None:
        counted = array != ignored
        if not counted.any():
            raise InvalidDataError(
                f"{what} is {ignored} (the loss's ignore_index) everywhere: no label would "
                "count, so the mean loss is 0/0. Give some positions a class label.")
        outside &= counted
    bad = np.flatnonzero(outside)
    if bad.size:
        index = [int(i) for i in np.unravel_index(int(bad[0]), array.shape)]
        position = f", position {tuple(index[1:])}" if array.ndim > 1 else ""
        valid = f"0..{classes - 1}" if classes else ">= 0"
        also = f" (or {ignored}, the loss's ignore_index)" if ignored is not None else ""
        raise InvalidDataError(
            f"{what} holds the class label {int(array.reshape(-1)[bad[0]])} at row {index[0]}"
            f"{position}, but the model's classes are {valid}{also}: encode labels as class "
            "indices, e.g. with sklearn.preprocessing.LabelEncoder.")


def _all_finite(array: np.ndarray) -> bool:
    """True when ``array`` holds no NaN or infinity. Blocks of rows keep the temporary mask
    in cache: one read of the data, single-threaded (a BLAS product against ones would
    leave its threads spinning on the cores onnxruntime needs next)."""
    rows = array.reshape(len(array), -1)
    step = max(1, _FINITE_BLOCK // max(1, rows.shape[1]))
    return all(np.isfinite(rows[lo:lo + step]).all() for lo in range(0, len(rows), step))


class CheckedArrays:
    """Arrays whose values were checked, kept by identity and layout (weakly).

    An array counts as checked while the same object still has the same data pointer,
    shape, strides and dtype. Writing into it in place is not noticed: a NaN written
    between fits is caught when it makes the loss non-finite (the error names its row).
    """

    def __init__(self) -> None:
        self._seen: dict[tuple, weakref.ref] = {}

    @staticmethod
    def _key(array: np.ndarray, context: tuple) -> tuple:
        return (id(array), array.__array_interface__["data"][0], array.shape, array.strides,
                array.dtype.str, context)

    def __contains__(self, item: tuple[np.ndarray, tuple]) -> bool:
        array, context = item
        ref = self._seen.get(self._key(array, context))
        return ref is not None and ref() is array

    def add(self, array: np.ndarray, context: tuple) -> None:
        self._seen = {k: r for k, r in self._seen.items() if r() is not None}
        self._seen[self._key(array, context)] = weakref.ref(array)
