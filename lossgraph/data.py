"""Checks of the data a Trainer, an estimator or the command line is given, before any work.

Each check returns the data in the form the runtime uses (a C-contiguous array of the dtype
and shape a graph input declares) or raises the :mod:`lossgraph.errors` class that fits,
naming the data, the row and how to fix it. Decisions made here, once for every caller:

- numbers are converted to the dtype the model declares as scikit-learn's
  ``check_array(X, dtype=...)`` converts them (:func:`converted`): float64 (or integer,
  or bool) data for a float32 input are cast, float32 data for a float64 input too
  (exactly); a value the cast would turn infinite (beyond float32's +-3.4e38) is refused
  by row and column, never trained on as infinity. The caller's array is never written:
  a conversion is a copy, made once per call (pass the model's dtype to skip it). Class
  labels stay whole numbers: float labels for an integer input are refused (lists and
  text tables, which have no dtype of their own, may hold whole numbers as floats), and
  an integer outside the input's range is refused, never wrapped. Text, complex and
  object values are refused;
- Python lists are data: converted to the dtype the model declares (a list has no dtype
  of its own); objects with ``to_numpy()`` (pandas, polars) or ``__array__`` are read as
  arrays;
- a label in one column, ``(N, 1)``, is read as the ``(N,)`` label a model declares, and
  ``(N,)`` as the one column of an ``(N, 1)`` input;
- data are checked for NaN and infinity before training (one read of the data, about
  as long as one epoch of a linear model takes to read it; the row is named); arrays
  already checked, the same objects with the same layout, are not checked again
  (:class:`CheckedArrays`), so a loop of warm-start fits over the same arrays pays once.
"""

from __future__ import annotations

import numbers
import reprlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import DTypeMismatchError, InvalidDataError, ShapeMismatchError, UnsupportedOptionError

__all__ = ["random_state", "as_array", "converted", "declared", "check_values",
           "CheckedArrays", "validation_fraction", "split_rows"]

#: Elements per block of the NaN check (256 KiB of float32, its mask 64 KiB).
_FINITE_BLOCK = 1 << 16


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


def validation_fraction(value: Any) -> float | None:
    """The share of rows held out for validation: None, or a number in (0, 1)."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
            and 0 < value < 1:
        return float(value)
    raise UnsupportedOptionError(
        f"validation_fraction={reprlib.repr(value)} must be a number between 0 and 1 (the "
        "share of rows held out, e.g. 0.1), or None.")


def split_rows(rows: int, fraction: float, seed: int | None,
               classes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows kept for training and those held out for validation: ``ceil(fraction *
    rows)`` held out at random, the rows scikit-learn's ``ShuffleSplit(test_size=fraction,
    random_state=seed)`` holds out, or with class labels ``classes``
    ``StratifiedShuffleSplit``'s (each class in proportion), which its estimators'
    ``validation_fraction`` uses (``seed`` None: unseeded)."""
    held = int(np.ceil(fraction * rows))
    if not 0 < held < rows:
        raise InvalidDataError(
            f"validation_fraction={fraction:g} of {rows} rows holds out {held}: choose a "
            "fraction that keeps at least one row on each side.")
    rng = np.random.RandomState(seed)
    if classes is None:
        order = rng.permutation(rows)
        return order[held:], order[:held]
    _, index, counts = np.unique(classes, return_inverse=True, return_counts=True)
    if counts.min() < 2 or min(held, rows - held) < len(counts):
        raise InvalidDataError(
            f"validation_fraction={fraction:g} cannot keep each of the {len(counts)} classes on "
            f"both sides of {rows} rows (the rarest has {counts.min()}, {held} are held out): "
            "pass validation_data, or more rows.")
    members = np.split(np.argsort(index, kind="stable"), np.cumsum(counts)[:-1])
    kept = _approximate_mode(counts, rows - held, rng)
    out = _approximate_mode(counts - kept, held, rng)
    train, validation = [], []
    for rows_of_class, k, o in zip(members, kept, out):
        shuffled = rows_of_class.take(rng.permutation(len(rows_of_class)))
        train.extend(shuffled[:k])
        validation.extend(shuffled[k:k + o])
    return rng.permutation(train), rng.permutation(validation)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` rows each class gives: its share rounded down, the rest to the
    largest remainders (ties drawn at random), as scikit-learn's stratified split counts."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(remainder == value)
        chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
        floored[chosen] += 1
        missing -= len(chosen)
    return floored.astype(int)


def declared(name: str, dtype: Any, shape: Sequence[int | str | None] | None,
             of: str = "input") -> str:
    """``input 'x' of the model is float32 of shape (N, K)``: what a graph declares, for
    messages (each dimension its size or own name, ``?`` unnamed; no shape when unknown)."""
    text = f"{of} {name!r} of the model is {np.dtype(dtype)}"
    if shape is None:
        return text
    dims = ["?" if d is None else str(d) for d in shape]
    return f"{text} of shape (" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def as_array(value: Any, spec: Mapping[str, Any], what: str) -> np.ndarray:
    """``value`` as a C-contiguous array of the dtype and shape input ``spec`` declares.

    ``spec`` is a manifest entry (``name``, ``dtype``, ``shape``, ``role``); ``what`` names
    the data in messages (``X``, ``y``, ``validation_data y``...). The caller's array is
    never written to: a conversion (:func:`converted`) makes a copy. An ``(N,)`` array is
    read as one column where the input is ``(N, 1)``, and a label in one column, ``(N, 1)``,
    where the label is ``(N,)`` (onnxcustom's examples pass ``y.reshape((-1, 1))``); no
    other shape changes.
    """
    expected = np.dtype(spec["dtype"])
    model_takes = declared(spec["name"], expected, spec["shape"])
    if value is None:
        raise InvalidDataError(f"No data for {model_takes}.")
    if hasattr(value, "to_numpy") and not isinstance(value, np.ndarray):
        value = value.to_numpy()
    listed = isinstance(value, (list, tuple))
    try:
        array = np.asarray(value)
    except ValueError as exc:
        raise InvalidDataError(
            f"{what} is a list whose rows differ in length (or nest differently): every row "
            "needs the same shape." if listed else
            f"{what} cannot be read as an array: {exc}.") from None
    except TypeError as exc:
        raise InvalidDataError(f"{what} cannot be read as an array: {exc}.") from None
    _check_numbers(array, what, model_takes)
    if array.ndim and not len(array):
        raise InvalidDataError(f"{what} has no rows.")
    array = converted(array, expected, what, model_takes, whole=listed)
    shape = spec["shape"]
    if array.ndim == len(shape) - 1 and shape and shape[-1] == 1:
        array = array.reshape(*array.shape, 1)  # y of shape (N,) for an (N, 1) output
    elif (spec.get("role") == "label" and len(shape) == 1 and array.ndim == 2
          and array.shape[1] == 1):
        array = array.reshape(len(array))  # y in one column, (N, 1), for an (N,) label
    if array.ndim != len(shape) or any(
            isinstance(d, int) and d != n for d, n in zip(shape[1:], array.shape[1:])):
        raise ShapeMismatchError(f"{what} has shape {array.shape} but {model_takes}.")
    return np.ascontiguousarray(array)


def _check_numbers(array: np.ndarray, what: str, model_takes: str) -> None:
    """A DTypeMismatchError for values that are not real numbers (text, complex, objects)."""
    if array.dtype.kind == "c":
        raise DTypeMismatchError(
            f"{what} holds {array.dtype} values; {model_takes}: lossgraph drops no imaginary "
            "part. Pass the real part (.real), or the real and imaginary parts as separate "
            "features.")
    if array.dtype.kind not in "biuf":
        raise DTypeMismatchError(
            f"{what} holds {array.dtype} values, not numbers; {model_takes}.")


def converted(array: np.ndarray, expected: np.dtype, what: str, model_takes: str,
              whole: bool = False) -> np.ndarray:
    """``array`` (real numbers) in dtype ``expected``, as scikit-learn's
    ``check_array(dtype=...)`` converts data: a copy when the dtype differs, the caller's
    array untouched.

    - Any real numbers (float64, float32, integers, bools) for a float input are cast;
      a finite value the cast makes infinite (beyond the dtype's range: +-3.4e38 for
      float32, 65504 for float16) is an InvalidDataError naming its row and column.
    - Integers (and bools) for an integer input are cast; a value outside the input's
      range is an InvalidDataError (never wrapped into another class index).
    - Floats for an integer input (class labels) are a DTypeMismatchError, unless
      ``whole`` (a list, a column of a text table: no dtype of their own) and every
      value is a whole number.

    ``what`` names the data and ``model_takes`` the input (:func:`declared`) in messages.
    """
    if array.dtype == expected:
        return array
    _check_numbers(array, what, model_takes)
    if expected.kind == "f":
        with np.errstate(over="ignore"):  # the overflow is found and named below
            result = array.astype(expected)
        overflow = _first_overflow(array, result)
        if overflow is not None:
            raise InvalidDataError(
                f"{what} holds {array[overflow]} at {_position(array.shape, overflow)}, "
                f"beyond the range of {expected} (largest {np.finfo(expected).max:.8g}): "
                f"{model_takes}, where it would be infinite. Scale the data (e.g. with "
                "sklearn.preprocessing.StandardScaler) or clip it first.")
        return result
    if array.dtype.kind == "f":
        if not whole:
            raise DTypeMismatchError(
                f"{what} is {array.dtype} but {model_takes}: class labels are whole numbers; "
                f"convert them with .astype(np.{expected.name}) once they are (lossgraph "
                "rounds no label).")
        fractional = ~np.isfinite(array) | (array != np.round(array))
        if fractional.any():
            index = tuple(int(i) for i in np.argwhere(fractional)[0])
            raise DTypeMismatchError(
                f"{what} holds {array[index]} at {_position(array.shape, index)}, not a "
                f"whole number, but {model_takes} (class indices).")
    if expected.kind in "iu" and not np.can_cast(array.dtype, expected):
        limits = np.iinfo(expected)
        outside = (array < limits.min) | (array > limits.max)
        if outside.any():
            index = tuple(int(i) for i in np.argwhere(outside)[0])
            raise InvalidDataError(
                f"{what} holds {array[index]} at {_position(array.shape, index)}, beyond "
                f"the range of {expected} ({limits.min}..{limits.max}): {model_takes}. Encode "
                "labels as class indices, e.g. with sklearn.preprocessing.LabelEncoder.")
    return array.astype(expected)


def _first_overflow(source: np.ndarray, result: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first value that ``result`` (``source`` cast to a float dtype) holds
    as infinite where ``source`` is finite; None when there is none (one read of
    ``result`` when it is all finite)."""
    if _all_finite(result):
        return None
    bad = np.isinf(result) & ~np.isinf(source)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _position(shape: tuple[int, ...], index: tuple[int, ...]) -> str:
    """``row 3, column 1`` for ``index`` in an array of ``shape`` (columns count every
    value of a row, in C order; ``row 3`` where a row holds one value)."""
    if not shape:
        return "its only value"
    row, rest = index[0], index[1:]
    if int(np.prod(shape[1:])) <= 1:
        return f"row {row}"
    column = int(np.ravel_multi_index(rest, shape[1:]))
    return f"row {row}, column {column}"


def check_values(array: np.ndarray, role: str, what: str, classes: int | None = None,
                 finite: bool = True, ignored: int | None = None) -> None:
    """The values fit their role: finite floats (unless ``finite`` is False), sample weights
    >= 0 and not all zero, integer labels class indices in ``0..classes-1`` (any index
    >= 0 when ``classes`` is None: the model's class count is not static) or ``ignored``
    (the loss's ``ignore_index``), which may not be every label."""
    if finite and array.dtype.kind == "f" and not _all_finite(array):
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
        raise InvalidDataError(
            f"{what} holds {array[index]} at {_position(array.shape, index)}: "
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
    rows = array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)
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
