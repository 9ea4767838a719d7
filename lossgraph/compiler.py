"""compile_program: an inference model into a TrainingProgram, by a declared pipeline.

The loss model comes first::

    loss model      = ConvertOpset -> LowerMlOps -> (weights) -> ZipMapToTensor
                      -> AddLossOutput(loss, ...)     (or the model's own loss; ZipMapToTensor
                                                       where the model has a ZipMap)
    inference model = ConvertOpset -> LowerMlOps -> (weights) -> StripTraining     (no loss;
                      BatchNormalization and Dropout in inference mode; a ZipMap kept)
    (weights)       = ConstantsToInitializers (Constant nodes named in weights)
                      -> UntieWeights (untie=...) -> AddLoRA (adapters=...), where asked

``ConvertOpset`` moves the model to an opset the target loads (:mod:`lossgraph.opsets`);
``loss="auto"``, the default, is the loss that fits what the trained output holds
(:mod:`lossgraph.predictions`: a log loss for a classifier's probabilities, ``squared_error``
for values), the output a ZipMap's tensor where the model has one (``predict`` then gives
that tensor too). What compile decided is kept in ``TrainingProgram.notes``
(:class:`CompileNotes`) and printed by ``describe_plan`` with the pipelines above.

A model whose inputs fix the batch size (torch's default export) gets ``GeneralizeBatch``
right after ``LowerMlOps`` (``fixed_batch="auto"`` or ``"generalize"``): its batch freed
where the graph proves which shape constants hold it, else kept (the program then runs
batches of exactly that size, recorded in the manifest's ``batch``). ``describe_plan``
prints what it did as its first line, ``model = given model -> GeneralizeBatch: ...``.

then every graph of the program is a pipeline of passes from the loss model (``predict``:
from the lowered inference model), declared by :func:`plan` and printable before it
runs (``print(describe_plan(...))``)::

    evaluate            = WeightsToInputs -> InferenceMode -> StabilizeNumerics
                          -> WidenScalarConstants
    predict             = (ZipMapToTensor) -> WeightsToInputs -> WidenScalarConstants
    train_step          = WeightsToInputs -> StabilizeNumerics -> Gradient -> (speed)
                          -> StepGraph -> WidenScalarConstants
    train_epoch         = WeightsToInputs -> StabilizeNumerics -> Gradient -> (speed)
                          -> PackWeights -> StepGraph -> EpochGraph -> WidenScalarConstants
    (speed)             = FoldBatchIntoProducts -> SumRowsByProduct -> ConcatScatteredSlabs
                          -> UnfoldConvWeightGradients
    train_epoch_ordered = ... -> EpochGraph(shuffle=False) -> WidenScalarConstants

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

``max_grad_norm`` and ``ema_decay`` (:mod:`lossgraph.update_options`) are options of
``StepGraph``, ``PackWeights`` and ``fuse="separate"``'s ``UpdateGraph``: the gradients
clipped by their global norm before the optimizer's update (the norm an output of every
training graph) and an average of each weight after it (one more state per weight).

A model whose BatchNormalization runs in training mode has **buffers**, the running
statistics that training updates every step (:mod:`lossgraph.passes.running_stats`):
``WeightsToInputs`` lifts them with the weights in every graph, and every training
pipeline (and ``fuse="separate"``'s gradient graph) runs ``RunningStatistics`` right after
it, so that the graphs output their next values. ``evaluate`` and ``predict`` run every
BatchNormalization and Dropout in inference mode, with the buffers as inputs.

The ``(speed)`` passes and ``WidenScalarConstants`` are optimization passes for
onnxruntime (:mod:`lossgraph.speed`): same values, faster kernels. Pipelines that
begin alike share the work: a prefix runs once (:class:`~lossgraph.passes.plan.PlanRunner`).
Each fusion mode (:mod:`lossgraph.modes`) declares its training graphs; ``fuse="separate"``
builds onnxcustom's four graphs (gradient, loss, penalty, update) instead of the fused
ones, each finished with ``WidenScalarConstants`` too. The manifest is written from the
graphs and the signature they record (:mod:`lossgraph.manifest`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .adapters import LoRA, read_adapters
from .analysis import (
    default_weights,
    excluded_from_decay,
    tied_initializers,
    trainable_initializers,
)
from .deprecation import renamed_keywords
from .errors import FixedBatchWarning, UnsupportedModelError, UnsupportedOptionError
from .graphs import HeldWeights, weights_dtype
from .initial_state import InitialState
from .manifest import build_manifest
from .memory import release_free_memory
from .models import ModelLike, as_model
from .modes import Compiling, FuseMode, PlanContext, fuse_mode
from .opsets import OpsetMove
from .optim import AdamW
from .options import names
from .passes.contract import Pass, Pipeline
from .passes.fixed_batch import BatchReport, GeneralizeBatch, export_advice, fixed_batch, rows
from .passes.lora import AddLoRA
from .passes.loss import AddLossOutput, LossChoice, choose_loss
from .passes.lower_ml import LowerMlOps
from .passes.opset import ConvertOpset
from .passes.plan import Plan, Planned, PlanRunner
from .passes.recompute import Recompute, default_recompute
from .passes.running_stats import buffer_names
from .passes.sequences import holds_splits
from .passes.strip import InferenceMode, StripTraining
from .passes.untie import UntieWeights
from .passes.weights import ConstantsToInitializers
from .passes.zipmap import ZipMapToTensor, zipped_outputs
from .penalties import Penalty
from .program import TrainingProgram
from .roles import check_loss_roles, get_roles
from .target import Target, use_target
from .validation import (
    check_learnable,
    check_penalized,
    check_trainable_model,
    compile_options,
    no_weights_error,
    warn_folded,
    warn_tied,
    warn_zero_adapters,
)

__all__ = ["compile_program", "plan", "describe_plan", "trained_weights", "CompileNotes"]


def plan(context: PlanContext, fuse: str | FuseMode) -> Plan:
    """The plan of a program's graphs (see the module docstring): ``evaluate`` and
    ``predict``, then the training graphs of the fusion mode ``fuse``."""
    mode = fuse if isinstance(fuse, FuseMode) else fuse_mode(fuse)
    graphs = {
        "evaluate": Planned("loss model", Pipeline((context.lift, InferenceMode(),
                                                    *context.stabilize, context.widen))),
        "predict": Planned("inference model", Pipeline((*context.tensor_outputs, context.lift,
                                                        context.widen))),
    }
    return Plan({**graphs, **mode.plan(context)})


def describe_plan(model: ModelLike, **options: Any) -> str:
    """What :func:`compile_program` would run on ``model`` with ``options`` (its keyword
    arguments but ``target``), as text: the loss model is built, nothing else runs."""
    return _front(model, _options(options), stacklevel=3).describe()


def trained_weights(model: ModelLike, **options: Any) -> list[str]:
    """The weights :func:`compile_program` trains on ``model`` with ``options`` (its
    keyword arguments but ``target``): ``weights``, or by default those of the loss model
    it builds."""
    return list(_front(model, _options(options), stacklevel=3).context.weights)


@renamed_keywords(trainable="weights", gradient="backend")
def compile_program(
    model: ModelLike,
    weights: Sequence[str] | str | None = None,
    loss: str | None = "auto",
    loss_options: Mapping[str, Any] | None = None,
    penalty: Mapping[str, Any] | None = None,
    optimizer: Any = None,
    backend: str = "onnx",
    fuse: str = "step",
    target: Target | str | None = None,
    fixed_batch: str = "auto",
    untie: Sequence[str] | str | bool | None = None,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    ema_decay: float | None = None,
    recompute: str | float | Sequence[str] | None = None,
    adapters: LoRA | None = None,
) -> TrainingProgram:
    """Compile ``model`` into a :class:`~lossgraph.program.TrainingProgram`.

    Options are checked before the model is read, and the model before any pass runs
    (:mod:`lossgraph.validation`); every bad input is a :mod:`lossgraph.errors` error.

    Args:
        model: an inference model (a loss is added), or a model that already has a loss
            output, recorded by :func:`~lossgraph.add_loss_output` (pass ``loss=None``).
            A ``ModelProto`` or a file path whose weights come to 64 MiB or more is not
            copied: the program reads its initial state from it when asked for (keep it
            unchanged while the program lives: :mod:`lossgraph.initial_state`).
        weights: the weights to train (a list of names, or one name); default
            :func:`~lossgraph.trainable_initializers`, or an ``UnsupportedModelError`` when
            a weight influences the loss through a sequence lossgraph does not
            differentiate (:func:`lossgraph.analysis.default_weights`). A name may be the
            output of a ``Constant`` node: it becomes an initializer and trains
            (:class:`~lossgraph.passes.ConstantsToInitializers`).
        loss: the loss function, a name :func:`~lossgraph.add_loss_output` knows; by
            default ``"auto"``, the loss that fits what the trained output holds (a log loss
            for a classifier's probabilities, ``squared_error`` for values, see
            :mod:`lossgraph.predictions`); or ``None`` when the model carries its loss
            already. A loss that does not fit the output is an error naming the one that
            does.
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
        fixed_batch: what to do with a model whose inputs fix the batch size (torch's
            default export, ``float[2, 1, 28, 28]``): ``"auto"`` frees it where the graph
            proves which shape constants hold it (:class:`~lossgraph.passes.GeneralizeBatch`)
            and otherwise trains in batches of exactly that size, with a
            :class:`~lossgraph.errors.FixedBatchWarning` saying why; ``"generalize"`` frees
            it or raises an ``UnsupportedModelError``; ``"keep"`` trains at that size.
        untie: initializers several layers read to give each layer its own copy of
            (:class:`~lossgraph.passes.UntieWeights`): ``"auto"`` (or ``True``) for every one
            that layers read as their own (:func:`lossgraph.analysis.tied_initializers`,
            what torch's exporters make of equal values), or their names. Each copy is a
            weight (of ``weights``' when it names the initializer; penalized as it is), the
            manifest's ``untied`` maps each initializer to its copies, and the inference
            model keeps them apart. Without it, training a tied weight warns
            (``TiedWeightWarning``).
        accumulation_steps: the micro-batches of one update a fit takes by default
            (:meth:`~lossgraph.runtime.trainer.Trainer.fit`'s ``accumulation_steps``); above
            1 the program holds the graphs that accumulate gradients
            (:mod:`lossgraph.passes.accumulate`) and records how its loss reduces rows, and
            a fit may then take any number of micro-batches per update.
        max_grad_norm: clip the gradients the optimizer receives (the loss's plus the
            penalty's) to this global norm, as ``torch.nn.utils.clip_grad_norm_`` does after
            ``backward()``; the training graphs output the norm before clipping
            (``Trainer.grad_norms_``). None (default): no clipping.
        ema_decay: keep an exponential moving average of each weight, ``e = d e + (1 - d)
            w`` after each update (the first update copies the weights), as
            ``torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(d))``:
            one more state per weight, which ``evaluate``, ``predict`` and
            ``to_inference_model`` use with ``ema=True``. None (default): no average.
            See :mod:`lossgraph.update_options`.
        recompute: activations recomputed in the backward instead of kept, the graph form
            of ``torch.utils.checkpoint`` (:class:`~lossgraph.passes.Recompute`): None (the
            default) is ``"activations"`` for a model of 64 MiB of initializers or more
            (:data:`~lossgraph.passes.recompute.ACTIVATIONS_MIN_BYTES`), else ``"none"``;
            ``"none"``: every activation the backward reads is kept; ``"activations"``: what
            elementwise arithmetic computes from values the backward keeps anyway (a
            decomposed GELU's intermediates from its input) is recomputed, fewer bytes kept
            and never more, at about the same step time; ``"elementwise"``
            (the outputs of elementwise ops, views and shape ops recomputed, every other
            op's kept: nearly free in time), ``"auto"``
            (boundaries chosen among the forward graph's cuts, about ``sqrt(n)`` segments of
            equal activation size: the least memory), a budget (a float in (0, 1]: ``"auto"``'s
            segments, the costliest to recompute kept whole while the backward holds at most
            that fraction of the activations it reads), or a list of forward tensor names, the
            boundaries kept (the forward values between them that the backward reads are
            recomputed from them).
            Outputs of random nodes (a Dropout in training mode) are kept, never drawn
            again. What is kept and recomputed is the manifest's ``recompute``.
        adapters: LoRA adapters to train instead of the weights, a
            :class:`~lossgraph.adapters.LoRA` (:class:`~lossgraph.passes.AddLoRA` runs on
            the model first): only the adapters train, and ``weights`` names base weights
            that train too (PEFT's ``modules_to_save``); the base weights stay initializers.
            A model :func:`~lossgraph.add_lora` rewrote trains its adapters the same way
            without it. The manifest's ``adapters`` lists them
            (:attr:`~lossgraph.TrainingProgram.adapters`); ``to_inference_model(merge=True)``
            folds them into the weights. See docs/reference/adapters.md.
    """
    options = {"weights": weights, "loss": loss, "loss_options": loss_options,
               "penalty": penalty, "optimizer": optimizer, "backend": backend, "fuse": fuse,
               "fixed_batch": fixed_batch, "untie": untie,
               "accumulation_steps": accumulation_steps, "max_grad_norm": max_grad_norm,
               "ema_decay": ema_decay, "recompute": recompute, "adapters": adapters}
    with use_target(target):
        return _compile(model, options)


#: compile_program's options but the model and the target, with their defaults.
_DEFAULTS: dict[str, Any] = {name: p.default for name, p in
                             inspect.signature(compile_program).parameters.items()
                             if name not in ("model", "target")}


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    """compile_program's options: ``options`` (checked names) over the defaults."""
    unknown = sorted(set(options) - set(_DEFAULTS))
    if unknown:
        raise UnsupportedOptionError(f"compile_program has no option {unknown[0]!r}.")
    return {**_DEFAULTS, **options}


@dataclass(frozen=True)
class CompileNotes:
    """What compile decided about the model it was given: how its ``ai.onnx`` opset was
    moved to the target's (:class:`~lossgraph.opsets.OpsetMove`), which ZipMap outputs it
    trains through the tensors they zip (``{output: tensor}``), and the output and loss it
    trains (:class:`~lossgraph.passes.loss.LossChoice`; None for a model carrying its
    loss)."""

    opset: OpsetMove
    zipmaps: Mapping[str, str]
    loss: LossChoice | None

    def lines(self) -> list[str]:
        """The notes as sentences, one per decision worth telling."""
        said = []
        if self.opset.direction != "kept" or self.opset.imported:
            said.append(str(self.opset))
        said.extend(f"output {output!r} is a ZipMap of {tensor!r}: trained and predicted as "
                    "that tensor, the ZipMap kept in the exported model"
                    for output, tensor in self.zipmaps.items())
        if self.loss is not None:
            said.append(f"trains output {self.loss}")
        return said


@dataclass(frozen=True)
class _Front:
    """What compile starts from: the models its graphs are planned from, by name (the loss
    model, the model without a loss in training mode and in inference mode), the passes
    that made each from the model given, the mode and the context it plans with, and what
    it decided (:class:`CompileNotes`)."""

    starts: dict[str, onnx.ModelProto]
    made_by: dict[str, Pipeline]
    mode: FuseMode
    context: PlanContext
    #: each untied initializer -> its copies (UntieWeights)
    untied: dict[str, list[str]]
    notes: CompileNotes
    #: the data of the start models' large weights (light models point there)
    held: HeldWeights
    batch: BatchReport | None = None

    def describe(self) -> str:
        """The plan as text: what compile did with a fixed batch (the first line, where the
        model has one), the pipelines of the start models the plan uses, then the plan."""
        planned = plan(self.context, self.mode)
        used = [name for name in self.made_by
                if any(p.start == name for p in planned.values())]
        width = max(len(name) for name in (*used, *planned))
        batch = [] if self.batch is None else [f"{'model':<{width}} = {_batch_step(self.batch)}"]
        starts = [f"{name:<{width}} = model -> {self.made_by[name]}" for name in used]
        graphs = [f"{name:<{width}} = {planned[name]}" for name in planned]
        return "\n".join([*batch, *starts, *graphs])


def _front(model: ModelLike, options: Mapping[str, Any], stacklevel: int) -> _Front:
    """The start models, the weights, the buffers (running statistics training updates)
    and the checked options, each checked before any graph is built. ``stacklevel``: the
    user's frame from here, for a warning."""
    checked = compile_options(options["weights"], options["loss"], options["loss_options"],
                              options["penalty"], options["optimizer"], options["backend"],
                              options["fuse"], options["fixed_batch"], options["untie"],
                              options["accumulation_steps"], options["max_grad_norm"],
                              options["ema_decay"], options["recompute"],
                              options["adapters"])
    held = HeldWeights()  # the passes copy light models, the weights stay here
    given = as_model(model, held)
    check_trainable_model(given)
    lowering = Pipeline((ConvertOpset(), LowerMlOps()))
    lowered = lowering(given)
    freed, batch, freeing = _free_batch(lowered.model, checked.fixed_batch, stacklevel + 1)
    source, untied, weighting = _weights_made(freed, checked.weights, checked.untie)
    adapting = (AddLoRA(checked.adapters),) if checked.adapters else ()
    if adapting:
        source = adapting[0].run(source, checked=True).model
    adapters = read_adapters(source)
    lowering = lowering.then(*freeing, *weighting, *adapting)
    zipmaps = zipped_outputs(source)
    # the outputs a loss reads: a ZipMap's tensor, not its list of maps
    tensors = Pipeline((ZipMapToTensor(),) if zipmaps else ())
    trainable = tensors.run(source, checked=True).model if zipmaps else source
    loss, penalty = options["loss"], _with_copies(options["penalty"], untied)
    carried = get_roles(source).get("loss")
    choice = None
    if loss is None:
        if not carried:
            raise UnsupportedModelError(
                "loss=None says the model carries its loss, but it records no loss output: "
                "pass a loss name (e.g. loss='squared_error'), or build the loss with "
                "lossgraph.add_loss_output.")
        check_loss_roles(source)
        loss_model, adding = source, Pipeline()
    elif carried:
        raise UnsupportedModelError(
            f"The model carries a loss already ({carried!r}, recorded by add_loss_output): "
            "pass loss=None to train on it, or compile the inference model.")
    else:
        output_options = {k: v for k, v in checked.loss_options.items()
                          if k in _OUTPUT_FIELDS}
        score_options = {k: v for k, v in checked.loss_options.items()
                         if k not in _OUTPUT_FIELDS}
        choice = choose_loss(trainable, loss, output_options.get("output_index"), score_options)

        def adding_penalty(penalty: Mapping[str, Any] | None) -> Pipeline:
            return Pipeline((AddLossOutput(choice.loss, penalty=penalty,
                                           options=dict(choice.options),
                                           **{**output_options, "output_index": choice.output}),))
        # a Penalty on every trained weight: added once they are known
        adding = adding_penalty(None if isinstance(penalty, Penalty) else penalty)
        loss_model = adding.run(trainable, checked=True).model
    if checked.weights == []:
        names("weights", [], candidates=trainable_initializers(loss_model))
    # never around a weight no gradient (or part of one) would reach: that is an error
    given = list(_with_copies(dict.fromkeys(checked.weights or ()), untied))
    if adapters:  # the adapters train, and the base weights weights= names
        given = list(dict.fromkeys([*(n for a in adapters for n in (a.a, a.b)), *given]))
        warn_zero_adapters(loss_model, adapters)
    weights = given or default_weights(loss_model)
    if not weights:
        raise no_weights_error(loss_model)
    if isinstance(penalty, Penalty):
        penalty = penalty.by_weight(weights, _excluded(
            penalty.exclude_from_weight_decay, loss_model, weights, untied, "Penalty"))
        adding = adding_penalty(penalty)
        loss_model = adding.run(trainable, checked=True).model
    optimizer = checked.optimizer
    if isinstance(optimizer, AdamW) and optimizer.exclude_from_weight_decay:
        optimizer = dataclasses.replace(optimizer, exclude_from_weight_decay=tuple(_excluded(
            optimizer.exclude_from_weight_decay, loss_model, weights, untied, "AdamW")))
    check_penalized(penalty, weights)
    check_learnable(loss_model, weights)
    if checked.untie is None:
        warn_tied(loss_model, weights)
    warn_folded(loss_model, weights)
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
    mode = fuse_mode(checked.fuse)
    loss_options = {**checked.loss_options, **(choice.options if choice else {})}
    context = PlanContext(tuple(weights), optimizer, checked.backend, tuple(buffers),
                          holds_splits(loss_model), get_roles(loss_model),
                          choice.loss if choice else None, loss_options, penalty,
                          zipmaps=bool(zipmaps),
                          accumulation_steps=checked.accumulation_steps,
                          update_options=checked.update,
                          recompute=(default_recompute(loss_model) if checked.recompute is None
                                     else checked.recompute))
    mode.check(context)
    # what predicts and what is exported: the loss gone, every layer in inference mode
    stripping = Pipeline((StripTraining(),))
    stripped = stripping.run(source, checked=True)
    inference = stripped.model if stripped.changed else source  # unchanged: one prefix run
    made_by = {"loss model": lowering.then(*tensors.passes, *adding.passes),
               "inference model": lowering.then(*stripping.passes),
               "forward model": lowering.then(*tensors.passes)}
    notes = CompileNotes(lowered.report.of(ConvertOpset), zipmaps, choice)
    return _Front({"loss model": loss_model, "inference model": inference,
                   "forward model": trainable}, made_by, mode, context, untied,
                  notes, held, batch)


def _free_batch(model: onnx.ModelProto, choice: str, stacklevel: int
                ) -> tuple[onnx.ModelProto, BatchReport | None, tuple[Pass, ...]]:
    """``model`` with its fixed batch freed where the graph proves it (``fixed_batch=``
    ``choice``), what was done, and the pass that ran; a model whose batch is free comes
    back as it is. A batch kept by ``"auto"`` is a FixedBatchWarning (``stacklevel``: the
    user's frame)."""
    batch = fixed_batch(model)
    if batch is None:
        return model, None, ()
    if choice == "keep":
        return model, BatchReport(batch, False, reason=_KEPT), ()
    generalize = GeneralizeBatch(strict=choice == "generalize")
    try:
        result = generalize.run(model, checked=True)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"{exc} Or compile with fixed_batch='auto' (the default) to train it in batches "
            f"of exactly {rows(batch)}.") from None
    report = result.report
    if not report.freed:
        warnings.warn(
            f"The model's batch is fixed at {rows(batch)} and lossgraph cannot prove which "
            f"of its constants hold it ({report.reason}): the program trains in batches of "
            f"exactly {rows(batch)}, and each epoch's remaining rows are left out (as torch's "
            f"DataLoader(drop_last=True)). {export_advice(model)}", FixedBatchWarning,
            stacklevel=stacklevel)
    return result.model, report, (generalize,)


def _batch_step(report: BatchReport) -> str:
    """The first line of a fixed-batch model's plan: what compile does with its batch."""
    ran = report.freed or report.reason != _KEPT
    return f"given model{' -> GeneralizeBatch' if ran else ''}: {report.describe()}"


#: The reason a fixed batch is kept when the option says so.
_KEPT = "fixed_batch='keep'"


def _batch_record(report: BatchReport, context: PlanContext) -> dict[str, Any]:
    """The manifest's record of a fixed-batch model: its batch, whether the program keeps
    it (then the runtime feeds batches of exactly that size) and how its loss reduces
    rows (how the losses of several batches combine)."""
    reduction = context.loss_options.get("reduction", "mean") if context.loss else None
    return {"size": report.batch, "fixed": not report.freed, "detail": report.describe(),
            "loss_reduction": reduction}


def _accumulation_record(context: PlanContext) -> dict[str, Any] | None:
    """The manifest's record of a program compiled to accumulate gradients: the
    micro-batches of an update by default, and how its loss reduces rows (so how the
    gradients of micro-batches combine); None for the others."""
    if context.accumulation_steps == 1:
        return None
    return {"steps": context.accumulation_steps,
            "loss_reduction": context.loss_options.get("reduction", "mean")}


def _recompute_record(compiling: Compiling) -> dict[str, dict[str, list[str]]] | None:
    """What each graph recomputes (:class:`~lossgraph.passes.recompute.RecomputePlan`), by
    graph, where compile recomputes."""
    plans = {name: built.report.of(Recompute).as_record()
             for name, built in compiling.built.items() if Recompute in built.report}
    return plans or None


def _weights_made(model: onnx.ModelProto, weights: Sequence[str] | None,
                  untie: str | list[str] | None
                  ) -> tuple[onnx.ModelProto, dict[str, list[str]], tuple[Pass, ...]]:
    """``model`` with the ``Constant`` nodes ``weights`` names made initializers, and the
    initializers ``untie`` names (``"auto"``: every tied one) untied; the copies made of
    each, and the passes that ran."""
    outputs = {n.output[0] for n in model.graph.node if n.op_type == "Constant" and n.output}
    constants = [w for w in weights or () if w in outputs]
    ran: list[Pass] = []
    if constants:
        ran.append(ConstantsToInitializers(constants))
        model = ran[-1].run(model, checked=True).model
    names = [t.name for t in tied_initializers(model)] if untie == "auto" else untie
    if not names:
        return model, {}, tuple(ran)
    ran.append(UntieWeights(names))
    result = ran[-1].run(model, checked=True)
    return result.model, result.report, tuple(ran)


def _with_copies(by_weight: Mapping[str, Any] | None, untied: Mapping[str, list[str]]
                 ) -> Mapping[str, Any] | None:
    """``by_weight`` (a penalty, or weights as keys) with each untied weight's copies after
    it, given what it gives the weight."""
    if not untied or not isinstance(by_weight, Mapping):
        return by_weight
    return {name: value for weight, value in by_weight.items()
            for name in (weight, *untied.get(weight, ()))}


def _excluded(patterns: str | Sequence[str], model: onnx.ModelProto, weights: Sequence[str],
              untied: Mapping[str, list[str]], owner: str) -> list[str]:
    """The trained ``weights`` an ``exclude_from_weight_decay`` of ``owner`` selects in
    ``model``, each untied weight's copies with it."""
    excluded = excluded_from_decay(model, weights, patterns,
                                   f"{owner}: exclude_from_weight_decay")
    return [w for w in _with_copies(dict.fromkeys(excluded), untied) if w in weights]


_OUTPUT_FIELDS = ("loss_name", "label_name", "weight_name", "output_index", "reduction")


def _compile(model: ModelLike, options: Mapping[str, Any]) -> TrainingProgram:
    front = _front(model, options, stacklevel=5)  # compile_program, its keyword wrapper
    context, mode = front.context, front.mode
    runner = PlanRunner(front.starts)
    compiling = Compiling(context.roles, context.weights, context.buffers)
    for name, planned in plan(context, mode).items():
        compiling.built[name] = runner.build(planned, compiling)
    assembled = mode.assemble(compiling)
    signature, optimizer = assembled.signature, context.optimizer
    lifted = compiling.lifted  # weights and buffers
    state = {w: lifted[w] for w in context.weights}
    for weight in context.weights:
        for name, value in zip(signature.states[weight], context.update_options.initial_state(
                optimizer, lifted[weight])):
            state[name] = value
    state.update((b, lifted[b]) for b in context.buffers)
    # light: the frozen weights (initializers of the graphs) stay in the store, which the
    # program keeps; the state's arrays are the store's too
    graphs = {name: result.model for name, result in compiling.built.items()}
    manifest = build_manifest(graphs, signature, optimizer, mode.name, context.roles,
                              assembled.graph_roles, front.untied,
                              front.batch and _batch_record(front.batch, context),
                              _accumulation_record(context), context.update_options,
                              _recompute_record(compiling),
                              read_adapters(front.starts["inference model"]))
    inference, held, notes = front.starts["inference model"], front.held, front.notes
    del front, runner, compiling  # every intermediate model
    # light: the program keeps every weight once, its state's and the frozen ones
    program = TrainingProgram(graphs, manifest, state, inference, notes=notes)
    # its large weights read from the model or its file when asked for, not held twice
    if isinstance(model, onnx.ModelProto):
        program.state = InitialState.reading(state, model, held)
    elif isinstance(model, (str, os.PathLike)):
        program.state = InitialState.reading(state, Path(os.fspath(model)), held)
    del held, state
    release_free_memory()
    return program
