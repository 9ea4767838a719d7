"""Plans: every graph lossgraph emits, declared before it is built.

A :class:`Plan` names each graph and how it is built: a :class:`Planned` start (a model,
by name, or a :class:`GraphSource` that builds a graph from nothing) and the
:class:`~lossgraph.passes.contract.Pipeline` run from there. ``print(plan)`` reads::

    evaluate   = loss model -> WeightsToInputs(weights=('W',)) -> InferenceMode -> ...
    train_step = loss model -> WeightsToInputs(weights=('W',)) -> ... -> StepGraph(...)
    update     = UpdateGraph(optimizer=SGD) -> WidenScalarConstants

:class:`PlanRunner` builds a plan's graphs from its start models; pipelines that begin
alike share the work (a prefix runs once). compile (:mod:`lossgraph.compiler`), the
training artifacts (:mod:`lossgraph.export.artifacts`) and the function graphs
(:mod:`lossgraph.runtime.graph_function`) each declare their plan and build it here.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from .contract import Pass, PassResult, Pipeline, Reports, describe_options

__all__ = ["GraphSource", "Planned", "Plan", "PlanRunner"]


class GraphSource(abc.ABC):
    """Where a graph built from nothing (no model to start from) comes from: a builder and
    its options, which a plan prints. :meth:`build` reads what it needs of what its
    builder knows so far (compile's :class:`~lossgraph.modes.Compiling`, or None); its
    report is what it chose (names, roles)."""

    @abc.abstractmethod
    def build(self, known: Any) -> PassResult:
        """The graph, and what it reports."""

    def __str__(self) -> str:
        return describe_options(self)


@dataclass(frozen=True)
class Planned:
    """One graph of a plan: its start (a start model's name, or a source) and the pipeline
    run from it."""

    start: str | GraphSource
    pipeline: Pipeline

    def __str__(self) -> str:
        return f"{self.start} -> {self.pipeline}" if self.pipeline.passes else str(self.start)


@dataclass(frozen=True)
class Plan(Mapping[str, Planned]):
    """Every graph of an output, by name, in build order."""

    graphs: Mapping[str, Planned]

    def __getitem__(self, name: str) -> Planned:
        return self.graphs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.graphs)

    def __len__(self) -> int:
        return len(self.graphs)

    def __str__(self) -> str:
        width = max(len(name) for name in self.graphs)
        return "\n".join(f"{name:<{width}} = {planned}" for name, planned in self.graphs.items())


class PlanRunner:
    """Builds planned graphs from named start models; a prefix several pipelines share
    runs once.

    A prefix is known by its start model's name and its passes' values (frozen
    dataclasses: equal options, equal passes), so two pipelines built separately share
    what they have in common. Every start model is checked already (a pass emitted it, or
    its owner checked it): each pass checks only the model it emits.
    """

    def __init__(self, starts: Mapping[str, onnx.ModelProto]) -> None:
        self.starts = starts
        self.done: dict[tuple[Hashable, ...], PassResult[Reports]] = {}

    def build_all(self, plan: Plan, known: Any = None) -> dict[str, PassResult[Reports]]:
        """Every graph of ``plan``, in its order (its sources read ``known``)."""
        return {name: self.build(planned, known) for name, planned in plan.items()}

    def build(self, planned: Planned, known: Any = None) -> PassResult[Reports]:
        """A planned graph: its pipeline run from its start model, or from what its source
        builds (whose report joins the pipeline's)."""
        if isinstance(planned.start, str):
            return self.run(planned.start, planned.pipeline.passes)
        source = planned.start.build(known)
        result = planned.pipeline.run(source.model, checked=True)
        return PassResult(result.model, result.report.with_report(type(planned.start),
                                                                  source.report))

    def run(self, start: str, passes: Sequence[Pass]) -> PassResult[Reports]:
        """The model after ``passes`` and their reports."""
        result = PassResult(self.starts[start], Reports())
        key: tuple[Hashable, ...] = (start,)
        for step in passes:
            key = (*key, _identity(step))
            if key not in self.done:
                done = step.run(result.model, checked=True)
                reports = (result.report.with_report(type(step), done.report)
                           if done.report is not None else result.report)
                self.done[key] = PassResult(done.model, reports)
            result = self.done[key]
        return result


def _identity(step: Pass) -> Hashable:
    """What tells two passes apart: their value, where it is hashable, else the object."""
    try:
        hash(step)
    except TypeError:
        return (type(step), id(step))
    return step
