"""compile_program: an inference model into a TrainingProgram, by a declared pipeline.

The loss model comes first::

    loss model      = LowerMlOps -> AddLossOutput(loss, penalty, ...)   (or the model's own loss)
    inference model = LowerMlOps -> StripTraining     (no loss; BatchNormalization and Dropout
                                                       in inference mode)

then every graph of the program is a pipeline of passes from the loss model (``predict``:
from the lowered inference model), declared by :func:`plan` and printable before it
runs (``print(describe_plan(...))``)::

    evaluate            = WeightsToInputs -> InferenceMode -> StabilizeNumerics
                          -> WidenScalarConstants
    predict             = WeightsToInputs -> WidenScalarConstants           (no loss)
    train_step          = WeightsToInputs -> StabilizeNumerics -> Gradient -> (speed)
                          -> StepGraph -> WidenScalarConstants
    train_epoch         = WeightsToInputs -> StabilizeNumerics -> Gradient -> (speed)
                          -> PackWeights -> StepGraph -> EpochGraph -> WidenScalarConstants
    (speed)             = FoldBatchIntoProducts -> SumRowsByProduct -> ConcatScatteredSlabs
                          -> UnfoldConvWeightGradients
    train_epoch_ordered = ... -> EpochGraph(shuffled=False) -> WidenScalarConstants

A loss model holding a ``SplitToSequence`` gets ``SequencesToTensors``
(:mod:`lossgraph.passes.sequences`) right before ``StabilizeNumerics`` in the same graphs:
a split written as a sequence becomes a ``Split``, since gradients pass tensors only.
``StabilizeNumerics`` (:mod:`lossgraph.passes.stabilize`) rewrites the overflowing forms
converters emit (skl2onnx's ``1 / (1 + Exp(-s))``, ``Log(Softmax)``, ``Log(Sigmoid)``, ...)
into stable ones with the same values, so that their gradients stay finite. It runs on
every graph that computes the loss, before ``Gradient`` (and in ``fuse="separate"`` on the
forward model the ``gradient`` graph differentiates), after ``WeightsToInputs`` so that a
weight is never taken for a constant; never on the inference model: ``predict`` and the
exported model keep the user's ops. ``fuse="separate"``'s ``loss`` graph is lossgraph's own
loss, written in stable forms already.

A model whose BatchNormalization runs in training mode has **buffers**, the running
statistics that training updates every step (:mod:`lossgraph.passes.running_stats`):
``WeightsToInputs`` lifts them with the weights in every graph, and every training
pipeline (and ``fuse="separate"``'s gradient graph) runs ``RunningStatistics`` right after
it, so that the graphs output their next values. ``evaluate`` and ``predict`` run every
BatchNormalization and Dropout in inference mode, with the buffers as inputs.

The ``(speed)`` passes and ``WidenScalarConstants`` are optimization passes for
onnxruntime (:mod:`lossgraph.optimize`): same values, faster kernels. Pipelines that
begin alike share the work: a prefix runs once. ``fuse="separate"`` builds the
reference documents' four graphs instead of the training graphs
(:mod:`lossgraph.separate`), each finished with ``WidenScalarConstants`` too. The
manifest is written from the graphs and the signature they record
(:mod:`lossgraph.manifest`).
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .analysis import default_weights, trainable_initializers
from .deprecation import renamed_keywords
from .errors import UnsupportedModelError, UnsupportedOptionError
from .graphs import weights_dtype
from .manifest import build_manifest
from .models import ModelLike, as_model
from .optim import Optimizer
from .optimize import (
    ConcatScatteredSlabs,
    FoldBatchIntoProducts,
    SumRowsByProduct,
    UnfoldConvWeightGradients,
    WidenScalarConstants,
)
from .options import names
from .passes.contract import Pass, PassResult, Pipeline, Reports
from .passes.fuse import EpochGraph, PackWeights, StepGraph
from .passes.gradient import Gradient
from .passes.loss import AddLossOutput
from .passes.lower_ml import LowerMlOps
from .passes.running_stats import RunningStatistics, buffer_names
from .passes.sequences import SequencesToTensors, holds_splits
from .passes.stabilize import StabilizeNumerics
from .passes.strip import InferenceMode, StripTraining
from .passes.weights import WeightsToInputs
from .program import TrainingProgram
from .roles import check_loss_roles, get_roles
from .separate import separate_graphs
from .signature import Signature
from .target import Target, use_target
from .validation import (
    check_learnable,
    check_penalized,
    check_trainable_model,
    compile_options,
    no_weights_error,
)

__all__ = ["compile_program", "plan", "describe_plan"]


@dataclass(frozen=True)
class Plan:
    """Every graph of a program as a pipeline, from the model named by its ``start``."""

    pipelines: dict[str, Pipeline]
    starts: dict[str, str]  # graph -> "loss model" or "inference model"
    #: fuse="separate": the passes on the forward model before lossgraph.separate builds
    #: the gradient graph from it (and the loss, penalty and update graphs beside it)
    separate: Pipeline | None = None

    def __str__(self) -> str:
        lines = [(name, f"{self.starts[name]} -> {pipeline}")
                 for name, pipeline in self.pipelines.items()]
        if self.separate is not None:
            lines.append(("gradient", f"forward model -> {self.separate} -> separate_graphs "
                                      "-> WidenScalarConstants"))
        width = max(len(name) for name, _ in lines)
        return "\n".join(f"{name:<{width}} = {text}" for name, text in lines)


def plan(weights: Sequence[str], optimizer: Optimizer, backend: str, fuse: str,
         buffers: Sequence[str] = (), splits: bool = False) -> Plan:
    """The pipelines of a program's graphs (see the module docstring); ``buffers``: the
    running statistics the training graphs update (:func:`buffer_names`); ``splits``: the
    loss model holds a ``SplitToSequence`` (:func:`holds_splits`)."""
    lift, widen = WeightsToInputs((*weights, *buffers)), WidenScalarConstants()
    # the buffers' update, where there are buffers (then the loss model's layers are in
    # training mode, and the evaluate graph's are not)
    update_buffers = (RunningStatistics(),) if buffers else ()
    # stable forms of what the loss computes, before it is differentiated (never in predict)
    # and before it, the splits written as sequences as tensors (gradients pass tensors only)
    stabilize: tuple[Pass, ...] = (*((SequencesToTensors(),) if splits else ()),
                                   StabilizeNumerics(backend))
    pipelines = {"evaluate": Pipeline((lift, InferenceMode(), *stabilize, widen)),
                 "predict": Pipeline((lift, widen))}
    starts = {"evaluate": "loss model", "predict": "inference model"}
    separate = Pipeline((lift, *update_buffers, *stabilize)) if fuse == "separate" else None
    if fuse != "separate":
        differentiate = (*update_buffers, *stabilize, Gradient(tuple(weights), backend=backend),
                         FoldBatchIntoProducts(), SumRowsByProduct(), ConcatScatteredSlabs(),
                         UnfoldConvWeightGradients())
        step = StepGraph(optimizer)
        pipelines["train_step"] = Pipeline((lift, *differentiate, step, widen))
        starts["train_step"] = "loss model"
    if fuse == "epoch":
        pack = PackWeights(optimizer)
        for name, shuffled in (("train_epoch_ordered", False), ("train_epoch", True)):
            pipelines[name] = Pipeline((lift, *differentiate, pack, step, EpochGraph(shuffled),
                                        widen))
            starts[name] = "loss model"
    return Plan(pipelines, starts, separate)


def describe_plan(model: ModelLike, **options: Any) -> str:
    """What :func:`compile_program` would run on ``model`` with ``options`` (its keyword
    arguments but ``target``), as text: the loss model is built, nothing else runs."""
    unknown = sorted(set(options) - set(_DEFAULTS))
    if unknown:
        raise UnsupportedOptionError(f"compile_program has no option {unknown[0]!r}.")
    loss_model, _, _, weights, buffers, checked = _front(model, {**_DEFAULTS, **options})
    return str(plan(weights, checked.optimizer, checked.backend, checked.fuse, buffers,
                    holds_splits(loss_model)))



@renamed_keywords(trainable="weights", gradient="backend")
def compile_program(
    model: ModelLike,
    weights: Sequence[str] | str | None = None,
    loss: str | None = "squared_error",
    loss_options: Mapping[str, Any] | None = None,
    penalty: Mapping[str, Any] | None = None,
    optimizer: Any = None,
    backend: str = "onnx",
    fuse: str = "step",
    target: Target | str | None = None,
) -> TrainingProgram:
    """Compile ``model`` into a :class:`~lossgraph.program.TrainingProgram`.

    Options are checked before the model is read, and the model before any pass runs
    (:mod:`lossgraph.validation`); every bad input is a :mod:`lossgraph.errors` error.

    Args:
        model: an inference model (a loss is added), or a model that already has a loss
            output, recorded by :func:`~lossgraph.add_loss_output` (pass ``loss=None``).
        weights: the weights to train (a list of names, or one name); default
            :func:`~lossgraph.trainable_initializers`, or an ``UnsupportedModelError`` when
            a weight influences the loss through a sequence lossgraph does not
            differentiate (:func:`lossgraph.analysis.default_weights`).
        loss: the loss function, a name :func:`~lossgraph.add_loss_output` knows, or
            ``None`` when the model carries its loss already.
        loss_options: further arguments of ``add_loss_output`` (``weight_name``,
            ``output_index``, ``reduction``, options of the loss such as ``delta``).
        penalty: ``{weight: {"l1": a, "l2": b}}`` or ``{weight: b}``, added to the loss
            (and so to its gradient and to the reported loss).
        optimizer: a :mod:`lossgraph.optim` optimizer, its name (``"adam"``) or its dict
            form (``{"type": "Adam", "learning_rate": 0.01}``); default ``SGD()``.
        backend: the gradient backend: ``"onnx"`` (standard ops, any onnxruntime) or
            ``"ort"`` (onnxruntime-training's builder, training build only).
        fuse: ``"separate"``, ``"step"`` or ``"epoch"`` (see the module docstring).
        target: the runtimes the graphs must load in: a name of
            :data:`lossgraph.target.TARGETS` (``"default"``: onnxruntime-training 1.19 and
            every onnxruntime since 1.19, opsets 13-21; ``"onnxruntime-1.23"``, ...,
            ``"onnxruntime-latest"``), an explicit pair such as ``"ir10-opset21"``, or a
            :class:`~lossgraph.target.Target` (docs/reference/targets.md).
    """
    options = {"weights": weights, "loss": loss, "loss_options": loss_options,
               "penalty": penalty, "optimizer": optimizer, "backend": backend, "fuse": fuse}
    with use_target(target):
        return _compile(model, options)


#: compile_program's options but the model and the target, with their defaults.
_DEFAULTS: dict[str, Any] = {name: p.default for name, p in
                             inspect.signature(compile_program).parameters.items()
                             if name not in ("model", "target")}


def _front(model: ModelLike, options: Mapping[str, Any]):
    """The loss model, the models without a loss in training and in inference mode, the
    weights, the buffers (running statistics training updates) and the checked options."""
    checked = compile_options(options["weights"], options["loss"], options["loss_options"],
                              options["penalty"], options["optimizer"], options["backend"],
                              options["fuse"])
    given = as_model(model)
    check_trainable_model(given)
    source = LowerMlOps()(given).model
    loss, penalty = options["loss"], options["penalty"]
    carried = get_roles(source).get("loss")
    if loss is None:
        if not carried:
            raise UnsupportedModelError(
                "loss=None says the model carries its loss, but it records no loss output: "
                "pass a loss name (e.g. loss='squared_error'), or build the loss with "
                "lossgraph.add_loss_output.")
        check_loss_roles(source)
        loss_model = source
    elif carried:
        raise UnsupportedModelError(
            f"The model carries a loss already ({carried!r}, recorded by add_loss_output): "
            "pass loss=None to train on it, or compile the inference model.")
    else:
        output_options = {k: v for k, v in checked.loss_options.items()
                          if k in _OUTPUT_FIELDS}
        score_options = {k: v for k, v in checked.loss_options.items()
                         if k not in _OUTPUT_FIELDS}
        loss_model = AddLossOutput(loss, penalty=penalty, options=score_options,
                                   **output_options)(source).model
    if checked.weights == []:
        names("weights", [], candidates=trainable_initializers(loss_model))
    # never around a weight no gradient (or part of one) would reach: that is an error
    weights = checked.weights or default_weights(loss_model)
    if not weights:
        raise no_weights_error(loss_model)
    check_penalized(penalty, weights)
    check_learnable(loss_model, weights)
    buffers = buffer_names(loss_model)
    trained = [w for w in weights if w in buffers]
    if trained:
        raise UnsupportedOptionError(
            f"weights names {trained[0]!r}, a running statistic of a BatchNormalization in "
            "training mode: training updates it from the batch statistics (a buffer, as torch "
            "updates it), not by gradient. Leave it out of weights.")
    types = {t.name: t.data_type for t in loss_model.graph.initializer}
    if all(w in types for w in weights):  # one float type, or a clear error before any work
        weights_dtype({w: np.empty(0, helper.tensor_dtype_to_np_dtype(types[w]))
                       for w in weights}, "compile_program")
    if checked.fuse == "separate" and loss is None:
        raise UnsupportedOptionError(
            "fuse='separate' builds its own loss graph: pass a loss name as loss=.")
    # what predicts and what is exported: the loss gone, every layer in inference mode
    stripped = StripTraining()(source)
    inference = stripped.model if stripped.changed else source  # unchanged: one prefix run
    return loss_model, source, inference, weights, buffers, checked


_OUTPUT_FIELDS = ("loss_name", "label_name", "weight_name", "output_index", "reduction")


def _compile(model: ModelLike, options: Mapping[str, Any]) -> TrainingProgram:
    loss_model, forward, inference, weights, buffers, checked = _front(model, options)
    optimizer, fuse = checked.optimizer, checked.fuse
    the_plan = plan(weights, optimizer, checked.backend, fuse, buffers, holds_splits(loss_model))
    runner = _PrefixRunner({"loss model": loss_model, "inference model": inference,
                            "forward model": forward})
    results = {name: runner.run(the_plan.starts[name], pipeline.passes)
               for name, pipeline in the_plan.pipelines.items()}
    lifted = results["evaluate"].report.of(WeightsToInputs)  # weights and buffers
    initial = {w: lifted[w] for w in weights}
    graphs = {name: result.model for name, result in results.items()}
    roles = get_roles(loss_model)
    if fuse == "separate":
        signature = Signature.of_loss_model(graphs["evaluate"], list(weights), list(buffers))
        # the model's forward pass as training runs it (a layer's training mode kept, the
        # buffers' next values as outputs, stable forms): weights and buffers to inputs,
        # RunningStatistics where there are buffers, StabilizeNumerics
        assert the_plan.separate is not None
        forward_pass = runner.run("forward model", the_plan.separate.passes)
        separate, graph_roles = separate_graphs(
            forward_pass.model, roles, options["loss"], checked.loss_options,
            options["penalty"], initial, optimizer, checked.backend, signature)
        graphs.update({name: WidenScalarConstants()(graph).model
                       for name, graph in separate.items()})
        signature.new.update(forward_pass.report.get(RunningStatistics, {}))
    else:
        last = "train_epoch" if fuse == "epoch" else "train_step"
        signature = results[last].report.of(StepGraph if fuse == "step" else EpochGraph)
        graph_roles = {}
    state = dict(initial)
    for weight in weights:
        for name, value in zip(signature.states[weight], optimizer.initial_state(initial[weight])):
            state[name] = value
    state.update((b, lifted[b]) for b in buffers)
    manifest = build_manifest(graphs, signature, optimizer, fuse, roles, graph_roles)
    return TrainingProgram(graphs, manifest, state, inference)


class _PrefixRunner:
    """Runs pipelines from named start models; a prefix several pipelines share runs once.

    A prefix is known by its start model's name and its passes' values (frozen
    dataclasses: equal options, equal passes), so two pipelines built separately share
    what they have in common. Every start model is a pass's output, checked already: each
    pass checks only the model it emits.
    """

    def __init__(self, starts: Mapping[str, onnx.ModelProto]) -> None:
        self.starts = starts
        self.done: dict[tuple[Hashable, ...], PassResult[Reports]] = {}

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
