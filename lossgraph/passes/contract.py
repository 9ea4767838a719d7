"""The contract every pass keeps, checked by one decorator.

A pass is a function ``pass_(model, ...) -> ModelProto`` (or a tuple whose first
item is the model). :func:`model_pass` makes it

- **tolerant in what it takes**: a ``ModelProto``, serialized bytes or a file path;
- **pure**: the pass works on a private copy, the caller's model is never mutated;
- **honest about bad input**: a model that fails ``onnx.checker`` (full check) is
  rejected with :class:`~lossgraph.errors.InvalidModelError` before any work;
- **valid and loadable**: the input's opset must suit the active target
  (:func:`lossgraph.target.use_target`, default: onnxruntime-training 1.19 and current
  onnxruntime); the result gets a deliberate IR version and opset list
  (:func:`lossgraph.target.finalize`) and must pass the full checker, including
  strict shape inference; failing that is a lossgraph bug (:class:`InternalError`).

Passes are deterministic because everything they name goes through one
:class:`~lossgraph.names.NameAuthority` and nothing iterates over unordered sets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import onnx

from ..errors import InternalError
from ..models import ModelLike, as_model, check_model
from ..target import check_opset, finalize

__all__ = ["model_pass"]

P = ParamSpec("P")
R = TypeVar("R")


def model_pass(
    fn: Callable[Concatenate[onnx.ModelProto, P], R],
) -> Callable[Concatenate[ModelLike, P], R]:
    """Wrap a pass so that it keeps the pass contract (see the module docstring)."""

    @functools.wraps(fn)
    def run(model: ModelLike, *args: P.args, **kwargs: P.kwargs) -> R:
        working = as_model(model)
        check_model(working, f"The model given to {fn.__name__}")
        check_opset(working)
        result = fn(working, *args, **kwargs)
        emitted = result[0] if isinstance(result, tuple) else result
        finalize(emitted)
        try:
            onnx.checker.check_model(emitted, full_check=True)
        except Exception as exc:
            raise InternalError(
                f"{fn.__name__} emitted an invalid model ({exc}). This is a bug in lossgraph; "
                "please report it with the input model."
            ) from exc
        return result

    return run
