"""The pass contract: one base class, one result type, one pipeline.

A pass is an object built with its options and called on a model
(onnx-ir's ``passes`` framework has the same shape)::

    result = AddLossOutput(loss="huber")(model)      # -> PassResult
    result.model      # the new model
    result.report     # what the pass reports (a mapping of names, initial values, ...)
    result.changed    # whether the pass changed anything

:class:`Pass` keeps the contract for every subclass, which only writes :meth:`Pass.call`:

- **tolerant in what it takes**: a ``ModelProto``, serialized bytes or a file path;
- **pure**: the pass works on a private copy, the caller's model is never mutated;
- **honest about bad input**: a model that fails ``onnx.checker`` (full check) is
  rejected with :class:`~lossgraph.errors.InvalidModelError` before any work, and so is
  an opset the active target (:func:`lossgraph.target.use_target`) cannot load;
- **valid and loadable**: the result gets a deliberate IR version and opset list and
  must pass the full checker, including strict shape inference
  (:func:`lossgraph.models.check_emitted`); failing that is a lossgraph bug.

Passes are deterministic because everything they name goes through one
:class:`~lossgraph.names.NameAuthority` and nothing iterates over unordered sets.

A :class:`Pipeline` is a pass made of passes, run in order; ``print(pipeline)`` shows
them with their options, so what ``compile`` does can be read before it runs.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from ..models import ModelLike, as_model, check_emitted, check_model
from ..options import names
from ..target import check_opset

__all__ = ["Pass", "PassResult", "Pipeline", "name_fields"]


@dataclass(frozen=True)
class PassResult:
    """What every pass returns: the model, what the pass reports, whether it changed it."""

    model: onnx.ModelProto
    report: Any = None
    changed: bool = True


class Pass(abc.ABC):
    """A model-to-model rewrite keeping the pass contract (see the module docstring).

    Subclasses are frozen dataclasses: their fields are the pass's options, and their
    ``repr`` is what a printed pipeline shows.
    """

    @property
    def name(self) -> str:
        """The pass's name in a pipeline: its class name."""
        return type(self).__name__

    def __call__(self, model: ModelLike) -> PassResult:
        working = as_model(model)
        check_model(working, f"The model given to {self.name}")
        check_opset(working)
        result = self.call(working)
        check_emitted(result.model, self.name)
        return result

    @abc.abstractmethod
    def call(self, model: onnx.ModelProto) -> PassResult:
        """Rewrite ``model``, a private, checked copy the pass may change in place."""

    def __str__(self) -> str:
        return _describe(self)


@dataclass(frozen=True)
class Pipeline(Pass):
    """Passes run in order, each on the previous one's model.

    The report is ``{pass name: its report}`` for the passes that report something;
    the pipeline changed the model when any of its passes did.
    """

    passes: Sequence[Pass] = field(default_factory=tuple)

    def __call__(self, model: ModelLike) -> PassResult:
        return self.call(as_model(model))  # each pass checks its own input and output

    def call(self, model: onnx.ModelProto) -> PassResult:
        reports: dict[str, Any] = {}
        changed = False
        for step in self.passes:
            result = step(model)
            model, changed = result.model, changed or result.changed
            if result.report is not None:
                reports[step.name] = result.report
        return PassResult(model, reports, changed)

    def then(self, *passes: Pass) -> Pipeline:
        """This pipeline followed by ``passes``."""
        return Pipeline((*self.passes, *passes))

    def __str__(self) -> str:
        return " -> ".join(str(step) for step in self.passes) or "(no passes)"


def name_fields(options: Pass, *fields: str) -> None:
    """Make each of ``fields`` of ``options`` (a frozen dataclass pass) a tuple of names:
    one name is a tuple of one, never its letters (:func:`lossgraph.options.names`); an
    empty list stays empty, for the pass to refuse once it knows the valid names."""
    for field_name in fields:
        listed = names(field_name, getattr(options, field_name), allow_empty=True)
        object.__setattr__(options, field_name, None if listed is None else tuple(listed))


def _describe(value: Any) -> str:
    """``Name(option=value, ...)`` for a pass, or an option that is itself a dataclass (an
    optimizer), with the options that differ from their defaults; ``repr`` otherwise."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return repr(value)
    shown = [f"{f.name}={_describe(getattr(value, f.name))}" for f in dataclasses.fields(value)
             if f.repr and getattr(value, f.name) != _default(f)]
    name = type(value).__name__
    return f"{name}({', '.join(shown)})" if shown else name


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING

