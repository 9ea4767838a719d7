"""``fuse="step"`` and ``fuse="epoch"``: the optimizer's update fused into the training graphs.

    train_step          = loss model -> WeightsToInputs -> [RunningStatistics]
                          -> [SequencesToTensors] -> StabilizeNumerics -> Gradient -> (speed)
                          -> StepGraph -> WidenScalarConstants
    train_epoch_ordered = loss model -> ... -> Gradient -> (speed) -> PackWeights -> StepGraph
                          -> EpochGraph(shuffle=False) -> WidenScalarConstants
    train_epoch         = ... -> EpochGraph -> WidenScalarConstants

(speed: :attr:`~lossgraph.modes.PlanContext.speed`). A step runs ``train_step`` over the
engine's state buffers; an epoch mode runs every full batch of an epoch in one run of
``train_epoch`` (or ``train_epoch_ordered`` without shuffling), and a last, smaller batch
with ``train_step``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..passes.contract import Pipeline
from ..passes.fuse import EpochGraph, PackWeights, StepGraph
from ..passes.gradient import Gradient
from ..passes.plan import Planned
from . import Assembled, Compiling, FuseMode, PlanContext

__all__ = ["StepMode", "EpochMode", "FusedSteps", "FusedEpochs"]


def _differentiated(context: PlanContext) -> tuple:
    """A loss model's passes up to its gradient, speed rewrites included."""
    return (context.lift, *context.update_buffers, *context.stabilize,
            Gradient(context.weights, backend=context.backend), *context.speed)


class StepMode(FuseMode):
    """One graph per minibatch step, the update included."""

    name = "step"
    graphs = ("train_step",)
    summary = "one graph per minibatch step (update included)"

    def plan(self, context: PlanContext) -> dict[str, Planned]:
        return {"train_step": Planned("loss model", Pipeline((
            *_differentiated(context), StepGraph(context.optimizer, context.update_options),
            context.widen)))}

    def assemble(self, compiling: Compiling) -> Assembled:
        return Assembled(compiling.built["train_step"].report.of(StepGraph))

    def stepper(self, engine: Any) -> FusedSteps:
        return FusedSteps(engine)


class EpochMode(FuseMode):
    """One graph per epoch: a Scan over the full batches, the step graph for the rest."""

    name = "epoch"
    graphs = ("train_step", "train_epoch", "train_epoch_ordered")
    runs_epochs = True
    summary = "one graph per epoch (a Scan over the full batches)"

    def plan(self, context: PlanContext) -> dict[str, Planned]:
        step = StepGraph(context.optimizer, context.update_options)
        packed = (*_differentiated(context),
                  PackWeights(context.optimizer, context.update_options), step)
        return {
            "train_step": Planned("loss model", Pipeline((*_differentiated(context), step,
                                                          context.widen))),
            **{name: Planned("loss model", Pipeline((*packed, EpochGraph(shuffle),
                                                     context.widen)))
               for name, shuffle in (("train_epoch_ordered", False), ("train_epoch", True))},
        }

    def assemble(self, compiling: Compiling) -> Assembled:
        return Assembled(compiling.built["train_epoch"].report.of(EpochGraph))

    def stepper(self, engine: Any) -> FusedEpochs:
        return FusedEpochs(engine)


class FusedSteps:
    """Steps of ``train_step`` over an engine's state: a batch of ``full`` rows (the fit's
    batch size) runs the graph specialized to it, others (the last, smaller batch;
    streamed batches) the general one."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self, batch: Mapping[str, np.ndarray], full: int | None) -> float:
        rows = len(next(iter(batch.values())))
        self.engine.runner("train_step", rows if rows == full else None).run(batch)
        return self.engine.loss


class FusedEpochs(FusedSteps):
    """:class:`FusedSteps`, and every full batch of an epoch in one run of ``train_epoch``
    (shuffled by a permutation input) or ``train_epoch_ordered``."""

    def epoch(self, data: Mapping[str, np.ndarray], order: np.ndarray | None, batches: int,
              batch_size: int, rates: np.ndarray) -> np.ndarray:
        """The losses of ``batches`` full batches of ``data`` (rows in ``order``, or as they
        are), one update each at ``rates``, from the engine's step counter on."""
        engine = self.engine
        graph = "train_epoch" if order is not None else "train_epoch_ordered"
        runner = engine.runner(graph, batch_size)
        losses = np.empty(batches, engine.dtype)
        runner.bind_output(engine.program.io(graph, "losses")[0], losses)
        for norms in engine.program.io(graph, "grad_norms"):  # where the update clips
            engine.grad_norms = np.empty(batches, engine.dtype)
            runner.bind_output(norms, engine.grad_norms)
        feeds = {engine.program.io(graph, "learning_rates")[0]: rates.astype(engine.dtype)}
        if order is None:
            feeds.update({name: array[:batches * batch_size] for name, array in data.items()})
        else:
            feeds.update(data)
            feeds[engine.program.io(graph, "permutation")[0]] = np.ascontiguousarray(
                order[:batches * batch_size])
        runner.run(feeds)
        return losses
