"""The pass contract: one base class, one result type, one pipeline.

A pass is an object built with its options and called on a model
(onnx-ir's ``passes`` framework has the same shape)::

    result = AddLossOutput(loss="huber")(model)      # -> PassResult
    result.model      # the new model
    result.report     # what the pass reports (a mapping of names, initial values, ...)
    result.changed    # whether the pass changed anything

:class:`Pass` keeps the contract for every subclass, which only writes :meth:`Pass.call`:

- **tolerant in what it takes**: a ``ModelProto``, serialized bytes, a file path or an
  ``onnx_graphsurgeon.Graph``;
- **pure**: the pass works on a private copy, the caller's model is never mutated;
- **honest about bad input**: a model that fails ``onnx.checker`` (full check) is
  rejected with :class:`~lossgraph.errors.InvalidModelError` before any work;
- **at the target's opset**: a model given at an ``ai.onnx`` opset the active target
  (:func:`lossgraph.target.use_target`) does not load is moved to one it loads where its
  ops keep their meaning (:func:`lossgraph.opsets.to_target`, the pass
  :class:`~lossgraph.passes.ConvertOpset`), and refused with an
  :class:`~lossgraph.errors.UnsupportedModelError` naming the node otherwise;
- **valid and loadable**: the result gets a deliberate IR version and opset list and
  must pass the full checker, including strict shape inference
  (:func:`lossgraph.models.check_emitted`); failing that is a lossgraph bug.

Passes are deterministic because everything they name goes through one
:class:`~lossgraph.names.NameAuthority` and nothing iterates over unordered sets.

A pass may declare **preconditions** (``requires``): what its input must be, beyond a valid
model (a gradient model for :class:`~lossgraph.passes.StepGraph`, a step graph for
:class:`~lossgraph.passes.EpochGraph`), each checked before the pass runs, an
:class:`~lossgraph.errors.UnsupportedModelError` naming the pass and what is missing.
**Reports are typed**: a ``Pass[R]`` reports an ``R``; a :class:`Pipeline` reports
:class:`Reports`, each pass's report looked up by the pass's class
(``result.report.of(WeightsToInputs)``).

A :class:`Pipeline` is a pass made of passes, run in order; ``print(pipeline)`` shows
them with their options, so what ``compile`` does can be read before it runs. Each
intermediate model is checked once: a pass in a pipeline takes the model the previous
pass emitted, which that pass proved valid, and does not check it again.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import onnx

from ..errors import InternalError, UnsupportedModelError
from ..models import ModelLike, as_model, check_emitted, check_model
from ..opsets import to_target
from ..options import names
from ..target import check_opset

__all__ = ["Pass", "PassResult", "Pipeline", "Reports", "Requirement", "describe_options",
           "name_fields"]

#: What a pass reports.
R = TypeVar("R")


@dataclass(frozen=True)
class PassResult(Generic[R]):
    """What every pass returns: the model, what the pass reports, whether it changed it."""

    model: onnx.ModelProto
    report: R = None  # type: ignore[assignment]
    changed: bool = True


@dataclass(frozen=True)
class Requirement:
    """A precondition of a pass: what its input must be (``description``, as a message
    ends "StepGraph needs <description>") and ``problem``, which says what is wrong with a
    model, or None when it meets it."""

    description: str
    problem: Callable[[onnx.ModelProto], str | None]


class Pass(abc.ABC, Generic[R]):
    """A model-to-model rewrite keeping the pass contract (see the module docstring).

    Subclasses are frozen dataclasses: their fields are the pass's options, and their
    ``repr`` is what a printed pipeline shows.
    """

    #: What the input must be besides a valid model, checked before :meth:`call`.
    requires: ClassVar[tuple[Requirement, ...]] = ()
    #: True for the pass that moves a model between opsets itself (and reports it).
    converts_opset: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The pass's name in a pipeline: its class name."""
        return type(self).__name__

    def __call__(self, model: ModelLike) -> PassResult[R]:
        return self.run(model)

    def run(self, model: ModelLike, *, checked: bool = False) -> PassResult[R]:
        """The pass on a private copy of ``model``; ``checked``: ``model`` is what a pass
        emitted (proved valid for the active target), so it is not checked again."""
        working = as_model(model)
        if not checked:
            check_model(working, f"The model given to {self.name}")
            if not self.converts_opset:
                to_target(working)
                check_opset(working)
        for requirement in self.requires:
            problem = requirement.problem(working)
            if problem:
                raise UnsupportedModelError(
                    f"{self.name} needs {requirement.description}: {problem}")
        result = self.call(working)
        check_emitted(result.model, self.name)
        return result

    @abc.abstractmethod
    def call(self, model: onnx.ModelProto) -> PassResult[R]:
        """Rewrite ``model``, a private, checked copy the pass may change in place."""

    def __str__(self) -> str:
        return describe_options(self)


class Reports(Mapping[type, Any]):
    """The reports of a pipeline's passes, by pass class (a later pass of the same class
    replaces an earlier one's)."""

    def __init__(self, reports: Mapping[type, Any] | None = None) -> None:
        self._reports = dict(reports or {})

    def of(self, kind: type[Pass[R]]) -> R:
        """The report of the pass of class ``kind``; an InternalError when none ran."""
        if kind not in self._reports:
            raise InternalError(f"No {kind.__name__} report: the pipeline ran "
                                f"{[k.__name__ for k in self._reports]}.")
        return self._reports[kind]

    def with_report(self, kind: type, report: Any) -> Reports:
        """These reports and ``report`` for ``kind``."""
        return Reports({**self._reports, kind: report})

    def __getitem__(self, kind: type) -> Any:
        return self._reports[kind]

    def __iter__(self) -> Iterator[type]:
        return iter(self._reports)

    def __len__(self) -> int:
        return len(self._reports)

    def __repr__(self) -> str:
        return f"Reports({', '.join(k.__name__ for k in self._reports)})"


@dataclass(frozen=True)
class Pipeline(Pass[Reports]):
    """Passes run in order, each on the previous one's model.

    The report holds the passes' reports by pass class (:class:`Reports`), for the passes
    that report something; the pipeline changed the model when any of its passes did.
    """

    passes: Sequence[Pass] = field(default_factory=tuple)

    def run(self, model: ModelLike, *, checked: bool = False) -> PassResult[Reports]:
        reports = Reports()
        changed = False
        for step in self.passes:
            result = step.run(model, checked=checked)
            model, changed, checked = result.model, changed or result.changed, True
            if result.report is not None:
                reports = reports.with_report(type(step), result.report)
        return PassResult(as_model(model) if not self.passes else model, reports, changed)

    def call(self, model: onnx.ModelProto) -> PassResult[Reports]:
        return self.run(model, checked=True)

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


def describe_options(value: Any) -> str:
    """``Name(option=value, ...)`` for a pass, or an option that is itself a dataclass (an
    optimizer), with the options that differ from their defaults; ``repr`` otherwise."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return repr(value)
    shown = [f"{f.name}={describe_options(getattr(value, f.name))}"
             for f in dataclasses.fields(value) if f.repr and getattr(value, f.name) != _default(f)]
    name = type(value).__name__
    return f"{name}({', '.join(shown)})" if shown else name


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING
