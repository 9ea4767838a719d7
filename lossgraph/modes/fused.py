"""``fuse="step"`` and ``fuse="epoch"``: the optimizer's update fused into the training graphs.

    train_step          = loss model -> WeightsToInputs -> [RunningStatistics]
                          -> [SequencesToTensors] -> StabilizeNumerics -> Gradient -> (speed)
                          -> StepGraph -> UpdatesInBackwardOrder -> WidenScalarConstants
    train_epoch_ordered = loss model -> ... -> Gradient -> (speed) -> [PackWeights] -> StepGraph
                          -> UpdatesInBackwardOrder -> EpochGraph(shuffle=False)
                          -> WidenScalarConstants
    train_epoch         = ... -> EpochGraph -> WidenScalarConstants

(speed: :attr:`~lossgraph.modes.PlanContext.speed`; PackWeights where the optimizer updates
every weight alike, :attr:`~lossgraph.optim.Optimizer.same_for_every_weight`: not an AdamW
with decay groups). A step runs ``train_step`` over the
engine's state buffers; an epoch mode runs every full batch of an epoch in one run of
``train_epoch`` (or ``train_epoch_ordered`` without shuffling), and a last, smaller batch
with ``train_step``.

Compiled with ``accumulation_steps`` above 1, both modes also hold the graphs that
accumulate gradients over the micro-batches of one update (:mod:`lossgraph.passes.accumulate`)::

    train_accumulate                = ... -> Gradient -> (speed) -> SumGradients
    train_step_accumulated          = ... -> SumGradients -> StepGraph
    train_epoch_accumulated         = ... -> [PackWeights] -> SumGradients
                                      -> GroupGradients -> StepGraph -> EpochGraph
    train_epoch_ordered_accumulated = ... -> EpochGraph(shuffle=False)

An update of ``k`` micro-batches runs ``train_accumulate`` on the first ``k - 1`` and
``train_step_accumulated`` on the last (its sum of gradients in arrays the steps swap);
an epoch runs its full groups in one run of an epoch graph whose Scan steps over groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InternalError
from ..passes.accumulate import GroupGradients, SumGradients
from ..passes.contract import Pipeline
from ..passes.fuse import EpochGraph, PackWeights, StepGraph
from ..passes.gradient import Gradient
from ..passes.in_place import in_place_problem
from ..passes.plan import Planned
from ..passes.recompute import UpdatesInBackwardOrder
from ..signature import Signature
from . import Assembled, Compiling, FuseMode, PlanContext, accumulation_problem

__all__ = ["StepMode", "EpochMode", "FusedSteps", "FusedEpochs", "GradientSums"]


def _differentiated(context: PlanContext) -> tuple:
    """A loss model's passes up to its gradient, speed rewrites (and recomputation)
    included."""
    return (context.lift, *context.update_buffers, *context.stabilize,
            Gradient(context.weights, backend=context.backend), *context.speed,
            *context.recomputing)


def _packing(context: PlanContext) -> tuple[PackWeights, ...]:
    """An epoch graph's weights laid end to end, to update as one, where the update is the
    same for all (not an AdamW with decay groups)."""
    return ((PackWeights(context.optimizer, context.update_options),)
            if context.optimizer.same_for_every_weight else ())


def _step(context: PlanContext) -> tuple:
    """The optimizer's update, with the clipping and EMA around it the program asks for,
    the updates in the backward's order (onnxruntime frees each layer's activations'
    gradients early: the 2-layer transformer's step 73 -> 63 MiB)."""
    return (StepGraph(context.optimizer, context.update_options), UpdatesInBackwardOrder())


def _accumulating(context: PlanContext, epochs: bool) -> dict[str, Planned]:
    """The graphs that accumulate gradients over micro-batches (module doc), where the
    program is compiled to (``epochs``: an epoch mode's, with its epoch graphs)."""
    if context.accumulation_steps == 1:
        return {}
    accumulate = (*_differentiated(context), SumGradients())
    step = _step(context)
    graphs = {
        "train_accumulate": Planned("loss model", Pipeline((*accumulate, context.widen))),
        "train_step_accumulated": Planned("loss model", Pipeline((*accumulate, *step,
                                                                  context.widen))),
    }
    if epochs:
        group = (*_differentiated(context), *_packing(context), SumGradients(),
                 GroupGradients(), *step)
        graphs.update({name: Planned("loss model", Pipeline((*group, EpochGraph(shuffle),
                                                             context.widen)))
                       for name, shuffle in (("train_epoch_ordered_accumulated", False),
                                             ("train_epoch_accumulated", True))})
    return graphs


#: The accumulating graphs of a step and of an epoch mode (module doc).
_STEPS = ("train_accumulate", "train_step_accumulated")
_EPOCHS = ("train_epoch_accumulated", "train_epoch_ordered_accumulated")
#: The pass whose signature tells each accumulating graph's names.
_ACCUMULATING = dict(zip((*_STEPS, *_EPOCHS), (SumGradients, StepGraph, EpochGraph,
                                                EpochGraph)))


def _accumulating_roles(compiling: Compiling, signature: Signature) -> dict[str, dict[str, str]]:
    """The roles of the accumulating graphs' inputs and outputs, which must name the
    program's weights, states, buffers and their next values as ``signature`` does."""
    roles = {}
    for name, kind in _ACCUMULATING.items():
        if name in compiling.built:
            own = compiling.built[name].report.of(kind)
            updates = kind is not SumGradients
            if _state_names(own, updates) != _state_names(signature, updates):
                raise InternalError(f"The {name!r} graph names the program's state otherwise "
                                    "than its training graphs.")
            roles[name] = own.roles()
    return roles


def _state_names(signature: Signature, updates: bool) -> list[str]:
    """The names of the state a graph reads and writes: weights and buffers, and where
    it ``updates`` the optimizer states, learning rate and step; the next values."""
    changed = [*signature.buffers, *(signature.weights + signature.state_names
                                     if updates else [])]
    read = [*signature.weights, *signature.buffers,
            *([signature.learning_rate, signature.step, *signature.state_names]
              if updates else [])]
    return [*read, *(signature.new[n] for n in changed)]


class StepMode(FuseMode):
    """One graph per minibatch step, the update included."""

    name = "step"
    graphs = ("train_step",)
    accumulating = _STEPS
    summary = "one graph per minibatch step (update included)"

    def plan(self, context: PlanContext) -> dict[str, Planned]:
        return {"train_step": Planned("loss model", Pipeline((
            *_differentiated(context), *_step(context), context.widen))),
            **_accumulating(context, epochs=False)}

    def assemble(self, compiling: Compiling) -> Assembled:
        signature = compiling.built["train_step"].report.of(StepGraph)
        return Assembled(signature, _accumulating_roles(compiling, signature))

    def stepper(self, engine: Any) -> FusedSteps:
        return FusedSteps(engine)

    guarded = ("train_step",)

    def in_place_problem(self, program: Any, packed: Any) -> str | None:
        return accumulation_problem(program) or in_place_problem(
            program.light_graphs["train_step"], program.state_updates("train_step"),
            program.io("train_step", "loss")[0])


class EpochMode(StepMode):
    """One graph per epoch: a Scan over the full batches, the step graph for the rest.

    A Scan writes its loop state into arrays of its own, two beside its input and output,
    so an epoch graph holds the weights four times over. Run in place (by default where
    the state is large: :class:`~lossgraph.runtime.engine.Engine`), an epoch program runs
    every batch with ``train_step`` instead, writing the state over itself: the same
    updates, the state held once.
    """

    name = "epoch"
    graphs = ("train_step", "train_epoch", "train_epoch_ordered")
    accumulating = _STEPS + _EPOCHS
    runs_epochs = True
    summary = "one graph per epoch (a Scan over the full batches)"

    def plan(self, context: PlanContext) -> dict[str, Planned]:
        step = _step(context)
        # weights laid end to end update as one where the update is the same for all
        packed = (*_differentiated(context), *_packing(context), *step)
        return {
            "train_step": Planned("loss model", Pipeline((*_differentiated(context), *step,
                                                          context.widen))),
            **{name: Planned("loss model", Pipeline((*packed, EpochGraph(shuffle),
                                                     context.widen)))
               for name, shuffle in (("train_epoch_ordered", False), ("train_epoch", True))},
            **_accumulating(context, epochs=True),
        }

    def assemble(self, compiling: Compiling) -> Assembled:
        signature = compiling.built["train_epoch"].report.of(EpochGraph)
        return Assembled(signature, _accumulating_roles(compiling, signature))

    def stepper(self, engine: Any) -> FusedEpochs:
        return FusedEpochs(engine)


class FusedSteps:
    """Steps of ``train_step`` over an engine's state: a batch of ``full`` rows (the fit's
    batch size) runs the graph specialized to it, others (the last, smaller batch;
    streamed batches) the general one."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._sums: GradientSums | None = None

    def step(self, batch: Mapping[str, np.ndarray], full: int | None) -> float:
        self.engine.runner("train_step", _size(batch, full)).run(batch)
        return self.engine.loss

    def accumulate(self, batches: Sequence[Mapping[str, np.ndarray]], scales: np.ndarray,
                   full: int | None) -> np.ndarray:
        """One update from ``batches``, micro-batches whose gradients add up with the
        factors ``scales``: ``train_accumulate`` on each but the last, which runs
        ``train_step_accumulated``; their losses."""
        engine = self.engine
        if self._sums is None:
            self._sums = GradientSums(engine.program)
        sums = self._sums
        losses = np.empty(len(batches))
        with engine.ring.chaining(engine.program.buffers) as carry:
            for index, (batch, scale) in enumerate(zip(batches, scales)):
                sums.scale[()] = scale
                if index == len(batches) - 1:
                    runner = engine.runner("train_step_accumulated", _size(batch, full),
                                           sums.reading(index))
                else:
                    runner = engine.runner("train_accumulate", _size(batch, full),
                                           sums.reading(index), sums.writing(index))
                runner.run(batch)
                losses[index] = engine.loss
                carry()  # the next micro-batch reads the buffers this one wrote
        return losses


class GradientSums:
    """The running sums of the gradients over an update's micro-batches, as the
    accumulating graphs read and write them: micro-batch ``i`` reads set ``i`` (zeros for
    the first) and writes set ``i + 1``, two sets taking turns (a run never writes the
    arrays it reads)."""

    def __init__(self, program: Any) -> None:
        weights = program.weights
        self.inputs = program.io("train_accumulate", "gradient_sum")
        self.outputs = program.io("train_accumulate", "new_gradient_sum")
        self.scale_input = program.io("train_accumulate", "gradient_scale")[0]
        #: the factor of the next micro-batch's gradient (bound to the graphs)
        self.scale = np.zeros((), program.state.like(weights[0]).dtype)
        # zeros from calloc cost no memory until written, and they never are
        self._sets = [[np.zeros_like(program.state.like(w)) for w in weights],
                      *([np.empty_like(program.state.like(w)) for w in weights] for _ in range(2))]

    def _set(self, index: int) -> list[np.ndarray]:
        return self._sets[0] if index == 0 else self._sets[1 + (index - 1) % 2]

    def reading(self, index: int) -> dict[str, np.ndarray]:
        """The inputs micro-batch ``index`` reads: the sums so far and the scale."""
        return {**dict(zip(self.inputs, self._set(index))), self.scale_input: self.scale}

    def writing(self, index: int) -> dict[str, np.ndarray]:
        """The outputs micro-batch ``index`` writes its sums into."""
        return dict(zip(self.outputs, self._set(index + 1)))


def _size(batch: Mapping[str, np.ndarray], full: int | None) -> int | None:
    """The batch size a graph runs specialized to for ``batch``: ``full`` where the batch
    has that many rows, else None (the general graph)."""
    rows = len(next(iter(batch.values())))
    return rows if rows == full else None


class FusedEpochs(FusedSteps):
    """:class:`FusedSteps`, and every full batch of an epoch in one run of ``train_epoch``
    (shuffled by a permutation input) or ``train_epoch_ordered``; where it accumulates,
    ``train_epoch_accumulated`` or ``train_epoch_ordered_accumulated``."""

    def epoch(self, data: Mapping[str, np.ndarray], order: np.ndarray | None, batches: int,
              batch_size: int, rates: np.ndarray,
              scales: np.ndarray | None = None) -> np.ndarray:
        """The losses of ``batches`` full batches of ``data`` (rows in ``order``, or as they
        are), one update each at ``rates``, from the engine's step counter on; with
        ``scales`` (updates x micro-batches), one update every ``scales.shape[1]``
        batches, their gradients added with those factors."""
        engine = self.engine
        graph = "train_epoch" if order is not None else "train_epoch_ordered"
        if scales is not None:
            graph = f"{graph}_accumulated"
        runner = engine.runner(graph, batch_size)
        losses = np.empty(batches, engine.dtype)
        runner.bind_output(engine.program.io(graph, "losses")[0], losses)
        for norms in engine.program.io(graph, "grad_norms"):  # where the update clips
            engine.grad_norms = np.empty(len(rates), engine.dtype)  # one per update
            runner.bind_output(norms, engine.grad_norms)
        feeds = {engine.program.io(graph, "learning_rates")[0]: rates.astype(engine.dtype)}
        if scales is not None:
            feeds[engine.program.io(graph, "gradient_scales")[0]] = scales
        if order is None:
            feeds.update({name: array[:batches * batch_size] for name, array in data.items()})
        else:
            feeds.update(data)
            feeds[engine.program.io(graph, "permutation")[0]] = np.ascontiguousarray(
                order[:batches * batch_size])
        runner.run(feeds)
        return losses
