"""``fuse="separate"``: onnxcustom's forward/backward design, four graphs a runner chains.

    gradient (x, weights..., prediction_grad) -> (prediction, <w>_grad...)     model VJP
    loss     (prediction, label[, weight])    -> (loss, prediction_grad)
    penalty  (penalized weights...)           -> (penalty, <w>_penalty_grad...)   optional
    update   (learning_rate, step, <w>, <w>_grad, <w states>...) -> (<w>_new, <state>_new...
                                                                     [, grad_norm])

planned as::

    gradient = forward model -> WeightsToInputs -> [RunningStatistics] -> [SequencesToTensors]
               -> StabilizeNumerics -> Gradient(outputs=(prediction,)) -> (speed)
               -> SumRowsByProduct -> [Recompute] -> UpdatesInBackwardOrder
               -> WidenScalarConstants
    loss     = LossGraph(loss, options) -> WidenScalarConstants     (lossgraph.passes.loss)
    update   = UpdateGraph(optimizer) -> WidenScalarConstants       (lossgraph.optim)
    penalty  = PenaltyGraph(penalty) -> WidenScalarConstants        (lossgraph.penalties)

(speed: the fused modes' rewrites, :attr:`~lossgraph.modes.PlanContext.speed`, the
attention heads' slabs concatenated among them: a 2-layer transformer's separate step
128 -> 106 MiB; ``SumRowsByProduct`` once more: a sum it rewrites can leave one more it
rewrites;
``UpdatesInBackwardOrder`` lists the gradients so that onnxruntime computes each as the
backward reaches its layer, freeing the activations' gradients early: BERT-base's step
peak 2,621 -> 2,315 MiB, GPT-2's 2,790 -> 2,632.) The
model's gradient starts from the forward model as training runs it (training-mode layers
kept, the buffers' next values as outputs, stable forms). Every name lossgraph invents (a
gradient, a state, ``learning_rate``, ``step``, ``penalty``) is a free one: a weight or
input named alike keeps its name, and the invented one gets a suffix; each graph's roles
come from its builder.

A step runs the gradient graph cut in two (its forward half once), the loss, the backward
half, the penalty and the update (:class:`~lossgraph.runtime.separate_step.SeparateStep`),
with the update of every weight at once where the state lies packed
(:mod:`lossgraph.runtime.packed`). The gradients are outputs, which data-parallel training
(:mod:`lossgraph.parallel`) all-reduces between :meth:`SeparateSteps.gradients` and
:meth:`SeparateSteps.update`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UnsupportedOptionError
from ..graphs import opset_version
from ..optim import BuiltUpdate, Optimizer, build_update
from ..passes.contract import PassResult, Pipeline
from ..passes.gradient import Gradient
from ..passes.in_place import in_place_problem
from ..passes.loss import program_loss_graph
from ..passes.plan import GraphSource, Planned
from ..passes.recompute import UpdatesInBackwardOrder
from ..passes.running_stats import RunningStatistics
from ..penalties import BuiltPenalty, build_penalty
from ..runtime.packed import PackedUpdate, packed_update
from ..runtime.separate_step import SeparateStep
from ..signature import Signature
from ..speed import SumRowsByProduct
from ..update_options import UpdateOptions
from . import Assembled, Compiling, FuseMode, PlanContext, accumulation_problem

__all__ = ["SeparateMode", "SeparateSteps", "LossGraph", "UpdateGraph", "PenaltyGraph"]


@dataclass(frozen=True)
class LossGraph(GraphSource):
    """``(prediction, label[, weight]) -> (loss, prediction_grad)`` for the model's
    prediction (:func:`~lossgraph.passes.loss.program_loss_graph`); reports the name of the
    prediction's gradient."""

    loss: str
    options: Mapping[str, Any] = field(default_factory=dict)
    backend: str = "onnx"

    def build(self, compiling: Compiling) -> PassResult[str]:
        gradient = compiling.built["gradient"].model
        prediction = next(o for o in gradient.graph.output
                          if o.name == compiling.roles["prediction"])
        built = program_loss_graph(prediction, compiling.roles["label"], self.loss,
                                   self.options, self.backend,
                                   opset=opset_version(gradient) or 18)
        return PassResult(built.model, built.report[prediction.name])


@dataclass(frozen=True)
class UpdateGraph(GraphSource):
    """The optimizer's update of every weight (:func:`~lossgraph.optim.build_update`), its
    names free of the model's; reports them."""

    optimizer: Optimizer
    #: gradient clipping and an EMA of the weights (:mod:`lossgraph.update_options`)
    options: UpdateOptions = UpdateOptions()

    def build(self, compiling: Compiling) -> PassResult[BuiltUpdate]:
        gradient = compiling.built["gradient"]
        gradients = set(gradient.report.of(Gradient).values())
        taken = {v.name for v in (*gradient.model.graph.input, *gradient.model.graph.output)
                 if v.name not in gradients}
        taken.update(compiling.roles.values())
        update = build_update(self.optimizer, compiling.initial, taken=taken,
                              options=self.options)
        return PassResult(update.model, update)


@dataclass(frozen=True)
class PenaltyGraph(GraphSource):
    """The penalty and its gradient (:func:`~lossgraph.penalties.build_penalty`)."""

    penalty: Any

    def build(self, compiling: Compiling) -> PassResult[BuiltPenalty]:
        built = build_penalty(compiling.initial, self.penalty)
        return PassResult(built.model, built)


class SeparateMode(FuseMode):
    """Four graphs a runner chains: the model's vector-Jacobian product, the loss, the
    penalty and the update."""

    name = "separate"
    graphs = ("gradient", "loss", "update", "penalty")
    optional = ("penalty",)
    exposes_gradients = True
    summary = "onnxcustom's design: gradient, loss, penalty and update graphs, run one by one"

    def check(self, context: PlanContext) -> None:
        if context.loss is None:
            raise UnsupportedOptionError(
                "fuse='separate' builds its own loss graph: pass a loss name as loss=.")

    def plan(self, context: PlanContext) -> dict[str, Planned]:
        prediction = context.roles["prediction"]
        widen = Pipeline((context.widen,))
        planned = {
            "gradient": Planned("forward model", Pipeline((
                context.lift, *context.update_buffers, *context.stabilize,
                Gradient(context.weights, outputs=(prediction,), backend=context.backend),
                *context.speed, SumRowsByProduct(),
                *context.recomputing, UpdatesInBackwardOrder(),
                context.widen))),
            "loss": Planned(LossGraph(str(context.loss), dict(context.loss_options),
                                      context.backend), widen),
            "update": Planned(UpdateGraph(context.optimizer, context.update_options), widen),
        }
        if context.penalty:
            planned["penalty"] = Planned(PenaltyGraph(context.penalty), widen)
        return planned

    def assemble(self, compiling: Compiling) -> Assembled:
        built = compiling.built
        signature = Signature.of_loss_model(built["evaluate"].model, list(compiling.weights),
                                            list(compiling.buffers))
        gradient = built["gradient"].report
        update: BuiltUpdate = built["update"].report.of(UpdateGraph)
        prediction, seed = compiling.roles["prediction"], built["loss"].report.of(LossGraph)
        gradients = gradient.of(Gradient)
        signature.gradients = dict(gradients)
        signature.learning_rate, signature.step = update.learning_rate, update.step
        signature.grad_norm = update.grad_norm
        signature.states = update.states
        signature.new = {**update.new, **gradient.get(RunningStatistics, {})}
        signature.prediction, signature.prediction_grad = prediction, seed
        roles = {"gradient": {prediction: "prediction", seed: "prediction_grad",
                              **{g: "gradient" for g in gradients.values()}},
                 "loss": {prediction: "prediction", seed: "prediction_grad"},
                 "update": update.roles}
        if "penalty" in built:
            roles["penalty"] = built["penalty"].report.of(PenaltyGraph).roles
        return Assembled(signature, roles)

    def packed_update(self, program: Any) -> PackedUpdate | None:
        return packed_update(program.light_graphs["update"], program.optimizer,
                             {w: program.state.like(w) for w in program.weights},
                             program.update_options)

    def stepper(self, engine: Any) -> SeparateSteps:
        return SeparateSteps(engine)

    def in_place_problem(self, program: Any, packed: PackedUpdate | None) -> str | None:
        """The update graph writes the next state after the loss is known (a step whose
        loss is not finite does not run it), so it runs in place as it is, where its
        writes are elementwise; the buffers' next values come with the forward."""
        if program.buffers:
            return ("its forward writes the buffers' next values (running statistics) "
                    "before the loss is known")
        problem = accumulation_problem(program) or in_place_problem(
            program.light_graphs["update"], program.state_updates("update"))
        if problem is None and packed is not None:
            problem = in_place_problem(packed.model, {
                name: written for name, group in packed.inputs.items()
                for written, next_group in packed.outputs.items() if next_group == group})
        return problem


class SeparateSteps:
    """Separate steps over an engine's state: one :class:`SeparateStep` per batch size, the
    one of ``full`` rows (the fit's batch size) on graphs specialized to it.

    ``program`` replaces the engine's for the graphs the steps run (the data-parallel
    replica's summed loss graph); the state is the engine's either way.
    """

    def __init__(self, engine: Any, program: Any = None) -> None:
        self.engine = engine
        self.program = program if program is not None else engine.program
        self._steps: dict[int | None, SeparateStep] = {}
        self._sums: dict[str, np.ndarray] | None = None  # accumulated gradients

    def _of(self, rows: int, full: int | None) -> SeparateStep:
        size = rows if rows == full else None
        if size not in self._steps:
            if size is not None:  # one batch size at a time, as for the fused graphs
                self._steps = {k: v for k, v in self._steps.items() if k is None}
            engine = self.engine
            self._steps[size] = SeparateStep(self.program, engine.ring, engine.new_session,
                                             engine.runner, size, engine.packed)
        return self._steps[size]

    def step(self, batch: Mapping[str, np.ndarray], full: int | None) -> float:
        return self._of(len(next(iter(batch.values()))), full).run(batch)

    def accumulate(self, batches: Sequence[Mapping[str, np.ndarray]], scales: np.ndarray,
                   full: int | None) -> np.ndarray:
        """One update from ``batches``, micro-batches whose gradients add up with the
        factors ``scales`` (here, in arrays shaped like the weights): the gradient graph on
        each, the penalty and the update once; their losses (the penalty included)."""
        engine = self.engine
        if self._sums is None:
            self._sums = {w: np.empty_like(self.program.state.like(w))
                          for w in self.program.weights}
        sums, losses = self._sums, np.empty(len(batches))
        with engine.ring.chaining(self.program.buffers) as carry:
            for index, (batch, scale) in enumerate(zip(batches, scales)):
                losses[index], gradients = self.gradients(batch, full)
                for weight, total in sums.items():
                    gradient = gradients[weight]
                    gradient = gradient if isinstance(gradient, np.ndarray) else gradient.numpy()
                    if index == 0:
                        np.multiply(gradient, scale, out=total)
                    else:
                        total += gradient * scale
                carry()
            penalty = self.update(sums, float(losses.sum()))
        return losses + penalty

    def gradients(self, batch: Mapping[str, np.ndarray], full: int | None
                  ) -> tuple[float, dict[str, Any]]:
        """Forward, loss and backward: the loss and each weight's gradient (valid until the
        next call or the update), without the penalty (:meth:`SeparateStep.gradients`)."""
        return self._of(len(next(iter(batch.values()))), full).gradients(batch)

    def update(self, gradients: Mapping[str, Any], loss: float) -> float:
        """The penalty's gradients added and the update run from ``gradients`` (of a step
        whose loss is ``loss``): the penalty; the next state waits in the engine's
        following buffer set (:meth:`SeparateStep.update`)."""
        step = next(iter(self._steps.values())) if self._steps else self._of(0, None)
        return step.update(gradients, loss)
