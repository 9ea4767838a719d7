"""Checks of one option's value, shared by every function that takes options.

Each names the option as the caller shows it (``what``: ``"batch_size"``, ``"SGD:
learning_rate"``, ``"Option delta"``), and ``where`` says whose option it is when the
name alone does not (``" of loss='huber'"``, ``" on 'coef'"``):

    count("epochs", 1.5, 0)    ->  epochs=1.5 must be an integer >= 0, not a float.
    flag("shuffle", "no")      ->  shuffle='no' must be True or False.
    non_negative("Option delta", -1, " of loss='huber'")
                               ->  Option delta=-1 of loss='huber' must be a finite number >= 0.
"""

from __future__ import annotations

import math
import numbers
import re
import reprlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import UnknownNameError, UnsupportedOptionError, suggest

#: What compile does with a fixed batch (``compile_program(fixed_batch=...)``,
#: :mod:`lossgraph.passes.fixed_batch`): free it where the graph proves it, else train at
#: it (the default); free it or raise; train at it. Here, where the command line reads it
#: without importing onnx.
FIXED_BATCH_CHOICES = ("auto", "generalize", "keep")

__all__ = ["count", "flag", "choice", "finite", "non_negative", "names", "weight_patterns",
           "matching_weights", "select_weights"]


def _is_bool(value: Any) -> bool:
    """A bool, or numpy's (which exists only once numpy is imported: the command line checks
    its options before it imports numpy)."""
    numpy = sys.modules.get("numpy")
    return isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_))


def count(what: str, value: Any, minimum: int) -> int:
    """An integer option such as ``epochs`` or ``batch_size``, at least ``minimum``."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise UnsupportedOptionError(
            f"{what}={reprlib.repr(value)} must be an integer >= {minimum}, not a "
            f"{type(value).__name__}.")
    if value < minimum:
        raise UnsupportedOptionError(f"{what}={value} must be >= {minimum}.")
    return int(value)


def flag(what: str, value: Any, where: str = "") -> bool:
    """A True/False option (a string such as ``"no"`` would read as True)."""
    if not _is_bool(value):
        raise UnsupportedOptionError(f"{what}={reprlib.repr(value)}{where} must be True or False.")
    return bool(value)


def choice(what: str, value: Any, choices: Sequence[str]) -> str:
    """One of ``choices``, with a suggestion for a near miss."""
    if not isinstance(value, str) or value not in choices:
        hint = suggest(value, choices, "values") if isinstance(value, str) else (
            f" Valid values: {', '.join(map(repr, choices))}.")
        raise UnsupportedOptionError(f"{what}={reprlib.repr(value)} is not accepted.{hint}")
    return value


def finite(what: str, value: Any, where: str = "") -> float:
    """A finite real number (not a bool, a string or a NaN)."""
    if _is_bool(value) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UnsupportedOptionError(
            f"{what}={reprlib.repr(value)}{where} must be a finite real number.")
    return float(value)


def non_negative(what: str, value: Any, where: str = "") -> float:
    """A finite real number >= 0."""
    if _is_bool(value) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value >= 0):
        raise UnsupportedOptionError(
            f"{what}={reprlib.repr(value)}{where} must be a finite number >= 0.")
    return float(value)


def names(option: str, value: Any, *, allow_empty: bool = False,
          candidates: Sequence[str] | None = None) -> list[str] | None:
    """A list of distinct tensor names (a single name is a list of one); None stays None.

    An empty list is an error listing ``candidates`` (the names that would be valid),
    unless ``allow_empty``: then the caller, once it knows the candidates, calls again.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise UnsupportedOptionError(
            f"{option}={reprlib.repr(value)} must be a list of weight names, e.g. "
            f"{option}=['coef', 'intercept'].")
    listed = list(value)
    for item in listed:
        if not isinstance(item, str):
            raise UnsupportedOptionError(
                f"{option} holds {reprlib.repr(item)} ({type(item).__name__}), not a weight "
                "name: it takes names (str).")
    if not listed and not allow_empty:
        valid = "" if candidates is None else (
            f" The trainable weights: {', '.join(map(repr, candidates))}." if candidates
            else " The model has no trainable weight.")
        raise UnsupportedOptionError(
            f"{option}=[] names no weight. Leave {option}=None for every trainable "
            f"initializer, or name some.{valid}")
    repeated = sorted({n for n in listed if listed.count(n) > 1})
    if repeated:
        raise UnsupportedOptionError(f"{option} names {repeated[0]!r} more than once: {listed}.")
    return listed


def weight_patterns(option: str, value: Any) -> str | tuple[str, ...]:
    """``"auto"``, or the names and regular expressions ``value`` lists (one string is a list
    of one); None is ``()``. They are matched against the weights once these are known
    (:func:`select_weights`)."""
    if value is None:
        return ()
    if value == "auto":
        return "auto"
    listed = [value] if isinstance(value, str) else value
    if isinstance(listed, Mapping) or not isinstance(listed, Iterable) or not all(
            isinstance(item, str) for item in listed):
        raise UnsupportedOptionError(
            f"{option}={reprlib.repr(value)} must be 'auto' (biases and normalization scales "
            "and shifts, found from the graph) or a list of weight names or regular "
            "expressions, e.g. ['bias', 'norm'].")
    return tuple(listed)


def matching_weights(pattern: str, weights: Sequence[str]) -> list[str]:
    """The weights ``pattern`` selects: the one it names, else every one whose name it
    matches (``re.search``: ``"bias"`` selects ``fc1.bias`` and ``fc2.bias``)."""
    if pattern in weights:
        return [pattern]
    try:
        expression = re.compile(pattern)
    except re.error as exc:
        raise UnsupportedOptionError(
            f"{pattern!r} is neither a weight's name nor a regular expression ({exc}).") from None
    return [w for w in weights if expression.search(w)]


def select_weights(option: str, patterns: Sequence[str], weights: Sequence[str]) -> list[str]:
    """The weights any of ``patterns`` selects (:func:`matching_weights`), in ``weights``'
    order; a pattern that selects none is an UnknownNameError listing the weights."""
    selected: set[str] = set()
    for pattern in patterns:
        matched = matching_weights(pattern, weights)
        if not matched:
            raise UnknownNameError(
                f"{option} holds {pattern!r}, which names no trained weight and matches none "
                "as a regular expression." + suggest(pattern, weights, "trained weights"))
        selected.update(matched)
    return [w for w in weights if w in selected]
