"""to_ort_artifacts: onnxruntime's on-device training artifacts, with no torch or training build.

onnxruntime's training APIs (``onnxruntime.training.api`` in Python; the C, C++, C#, Java
and mobile APIs alike) train from four files in one folder::

    training_model.onnx    (features, label[, sample_weight], <w>...,
                            <w>_grad.accumulation.buffer..., lazy_reset_grad)
                            -> (loss, outputs..., <w>_grad.accumulation.out...)
                            (the last ones bool[1] flags: "the buffer was updated")
    eval_model.onnx        (features, label[, sample_weight], <w>...) -> (loss, outputs...)
    optimizer_model.onnx   (learning_rate, step, params, gradients, first_order_moments
                            [, second_order_moments]) -> (update_completed)
    checkpoint             the weights, the optimizer's step and moments (a flatbuffer,
                            lossgraph.export.ort_checkpoint)

The training model is lossgraph's loss model with its weights as inputs, its gradients from
lossgraph's own standard-op autodiff (:class:`~lossgraph.passes.gradient.Gradient`), each
accumulated into its buffer by a ``com.microsoft::InPlaceAccumulatorV2`` node::

    <w>_grad.accumulation.out = InPlaceAccumulatorV2(<w>_grad.accumulation.buffer, <w>_grad,
                                                     lazy_reset_grad)
        buffer <- grad            the first step after Module.lazy_reset_grad()
        buffer <- buffer + grad   the steps after it (gradient accumulation)

The optimizer model is one ``com.microsoft`` node over sequences of tensors:
``SGDOptimizerV2`` (``w <- w - lr g``) or ``AdamWOptimizer`` with ``adam_mode=0`` and
``correct_bias=1``, which is torch's AdamW, and so lossgraph's :class:`~lossgraph.optim.AdamW`
(and :class:`~lossgraph.optim.Adam`, an AdamW without decay)::

    w <- w (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    w <- w - lr m / ((1 - b1^t) (sqrt(v / (1 - b2^t)) + eps))

A program compiled with ``max_grad_norm`` (:mod:`lossgraph.update_options`) clips the
gradients first by ``com.microsoft::InplaceClipGradNorm`` (onnxblock's ``ClipGradNorm``:
``g <- g min(1, c / (norm + 1e-6))`` over the whole sequence, torch's
``clip_grad_norm_``); onnxruntime's Optimizer reports no norm. An EMA of the weights
(``ema_decay``) has no place in the format (the optimizer graph's inputs are fixed): it is
an :class:`~lossgraph.errors.UnsupportedOptionError`.

Every model has IR version 10 and ``ai.onnx`` opset 21 at most, as onnxruntime-training
1.19 (the last training build) requires.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..compiler import compile_program
from ..errors import (
    DTypeMismatchError,
    NameCollisionError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..fileio import (
    FolderKind,
    check_folder_target,
    replace_directory,
    serialize,
    written_by_lossgraph,
)
from ..graphs import opset_version, values_read
from ..metadata import GRADIENTS_KEY, read_json, remove_record, write_json
from ..models import ModelLike, check_emitted
from ..names import NameAuthority
from ..optim import SGD, Adam, AdamW, Optimizer, as_optimizer
from ..passes.contract import Pass, PassResult, Pipeline, Requirement
from ..passes.fuse import GRADIENT_MODEL
from ..passes.gradient import Gradient
from ..passes.plan import GraphSource, Plan, Planned, PlanRunner
from ..passes.strip import InferenceMode
from ..program import TrainingProgram
from ..schedules import Schedule
from ..speed import SumRowsByProduct, WidenScalarConstants
from ..target import DEFAULT_TARGET, use_target
from .ort_checkpoint import (
    MOMENT_NAMES,
    OptimizerGroup,
    OrtCheckpoint,
    check_properties,
    checkpoint_bytes,
)

__all__ = ["to_ort_artifacts", "OrtArtifacts", "artifacts_plan", "AccumulateGradients",
           "accumulate_gradients", "OrtOptimizerGraph", "optimizer_model", "ARTIFACTS_FOLDER",
           "ARTIFACT_FILES"]

TRAINING_FILE, EVAL_FILE, OPTIMIZER_FILE, CHECKPOINT_FILE = ARTIFACT_FILES = (
    "training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
#: The names onnxruntime's Module and Optimizer look for.
LAZY_RESET_GRAD = "lazy_reset_grad"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
FLAG_SUFFIX = "_grad.accumulation.out"
OPTIMIZER_INPUTS = ("learning_rate", "step", "params", "gradients", "first_order_moments",
                    "second_order_moments")
MS_DOMAIN = "com.microsoft"
#: Metadata of the ONNX files: the format and the checksum of the checkpoint written with them.
RECORD_KEY = "lossgraph.ort_artifacts"
RECORD_FORMAT = "lossgraph-ort-artifacts/1"
_COMPILE_OPTIONS = ("weights", "loss", "loss_options", "penalty", "fixed_batch", "untie",
                    "max_grad_norm", "ema_decay", "adapters")
#: Why an EMA of the weights cannot be exported.
_NO_EMA = ("onnxruntime's training artifacts cannot keep an EMA of the weights (ema_decay): "
           "their optimizer graph takes the parameters, gradients and moments onnxruntime's "
           "Optimizer feeds, nothing more. Train with lossgraph.Trainer, or export without "
           "ema_decay.")


class OrtArtifacts(NamedTuple):
    """The paths :func:`to_ort_artifacts` wrote."""

    training_model: Path
    eval_model: Path
    optimizer_model: Path
    checkpoint: Path


def to_ort_artifacts(model_or_program: ModelLike | TrainingProgram,
                     directory: str | os.PathLike, *, optimizer: Any = None, step: int = 0,
                     properties: Mapping[str, int | float | str] | None = None,
                     **compile_options: Any) -> OrtArtifacts:
    """Write onnxruntime's training artifacts for a model into the folder ``directory``.

    The folder then holds ``training_model.onnx``, ``eval_model.onnx``,
    ``optimizer_model.onnx`` and ``checkpoint`` (module docstring), which
    ``onnxruntime.training.api`` (``CheckpointState``, ``Module``, ``Optimizer``) and
    onnxruntime's C, C++, C#, Java and mobile training APIs run. Neither torch nor the
    training build is needed to write them, and the same inputs give the same bytes.

    Args:
        model_or_program: an inference model (ModelProto, bytes or path), compiled with
            ``compile_options`` as :func:`~lossgraph.compile_program` would; or a
            :class:`~lossgraph.TrainingProgram`, whose loss, penalty, weights, state and
            optimizer are used.
        directory: the artifacts folder: new, empty, or one lossgraph wrote (holding
            nothing else, and a checkpoint onnxruntime has not saved over); anything else
            is an :class:`~lossgraph.errors.UnsafeWriteError`, raised before any work. The
            folder is replaced atomically.
        optimizer: :class:`~lossgraph.optim.SGD` with a constant rate,
            :class:`~lossgraph.optim.AdamW` or :class:`~lossgraph.optim.Adam` (their names
            and dict forms too); default the program's optimizer, else ``SGD()``. Others
            are an :class:`~lossgraph.errors.UnsupportedOptionError`. onnxruntime's
            ``Optimizer`` starts at a learning rate of 0.001 whatever the checkpoint says:
            call ``set_learning_rate`` with the optimizer's rate (the checkpoint records it
            as ``initial_learning_rate``).
        step: the updates already done (e.g. ``Trainer.steps_`` for a program holding a
            trained state), stored in the checkpoint; AdamW's bias correction counts from it.
        properties: ints, floats and strings stored in the checkpoint's property bag.
        compile_options: ``weights``, ``loss``, ``loss_options``, ``penalty``,
            ``fixed_batch``, ``untie``, ``adapters`` (LoRA adapters, then the only
            trainable parameters), ``max_grad_norm`` (clipping in the optimizer graph),
            as :func:`~lossgraph.compile_program` takes them (models only); ``ema_decay``
            is refused (module docstring).

    Returns:
        The four paths, as an :class:`OrtArtifacts`.
    """
    check_folder_target(directory, ARTIFACTS_FOLDER)
    _check_step(step)
    check_properties(properties or {})
    program = _program(model_or_program, optimizer, compile_options)
    if program.buffers:  # the evaluate graph runs them in inference mode, as inputs
        raise UnsupportedModelError(
            f"The model's BatchNormalization runs in training mode, with running statistics "
            f"({', '.join(program.buffers)}) that training updates every step; onnxruntime "
            "training artifacts made by lossgraph do not carry them. Train with "
            "lossgraph.Trainer and export the inference model, or export the layer in "
            "inference mode.")
    chosen = program.optimizer if optimizer is None else as_optimizer(optimizer)
    plan = artifacts_plan(program, chosen)  # an optimizer without an op: an error first
    evaluate = program.graphs["evaluate"]
    _check_float32(evaluate, program.weights)
    _check_opset(evaluate)
    with use_target(DEFAULT_TARGET):
        built = PlanRunner({"evaluate": evaluate}).build_all(plan)
    training, eval_model, optimizer_graph = (built[name].model for name in ARTIFACT_FILES[:3])
    op_type = built[OPTIMIZER_FILE].report.of(OrtOptimizerGraph)
    checkpoint = checkpoint_bytes(OrtCheckpoint(
        trainable={w: program.state[w] for w in program.weights},
        optimizer_groups=[OptimizerGroup(step=int(step),
                                         initial_learning_rate=chosen.learning_rate,
                                         states=_moments(program, op_type))],
        properties=dict(properties or {})))
    evaluation = _unmarked(eval_model)
    record = {"format": RECORD_FORMAT, EVAL_FILE: _checksum(evaluation),
              CHECKPOINT_FILE: _checksum(checkpoint)}
    files = {TRAINING_FILE: _marked(training, record), EVAL_FILE: evaluation,
             OPTIMIZER_FILE: _marked(optimizer_graph, record), CHECKPOINT_FILE: checkpoint}
    with replace_directory(directory, ARTIFACTS_FOLDER) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
    folder = Path(directory)
    return OrtArtifacts(*(folder / name for name in ARTIFACT_FILES))


def artifacts_plan(program: TrainingProgram, optimizer: Any = None) -> Plan:
    """The plan of the artifacts' three graphs (``print`` shows it), from ``program``'s
    ``evaluate`` graph; ``optimizer`` (default the program's) must have an onnxruntime
    optimizer op (:func:`ort_optimizer`)::

        training_model.onnx  = evaluate -> Gradient -> SumRowsByProduct
                               -> WidenScalarConstants -> AccumulateGradients
        eval_model.onnx      = evaluate -> InferenceMode
        optimizer_model.onnx = OrtOptimizerGraph(op_type=..., ...)
    """
    chosen = program.optimizer if optimizer is None else as_optimizer(optimizer)
    op_type, attributes = ort_optimizer(chosen)
    options = program.update_options
    if options.averages:
        raise UnsupportedOptionError(_NO_EMA)
    opset = opset_version(program.light_graphs["evaluate"]) or 21
    return Plan({
        TRAINING_FILE: Planned("evaluate", Pipeline((
            Gradient(tuple(program.weights)), SumRowsByProduct(), WidenScalarConstants(),
            AccumulateGradients()))),
        EVAL_FILE: Planned("evaluate", Pipeline((InferenceMode(),))),
        OPTIMIZER_FILE: Planned(OrtOptimizerGraph(op_type, tuple(attributes.items()), opset,
                                                  options.max_grad_norm), Pipeline(())),
    })


@dataclass(frozen=True)
class OrtOptimizerGraph(GraphSource):
    """The optimizer model: one onnxruntime optimizer op (:func:`optimizer_model`). Reports
    the op."""

    op_type: str
    attributes: tuple[tuple[str, Any], ...] = ()
    opset: int = 21
    #: clip the gradients to this global norm first (InplaceClipGradNorm); None: no clipping
    max_grad_norm: float | None = None

    def build(self, known: Any = None) -> PassResult[str]:
        return PassResult(optimizer_model(self.op_type, dict(self.attributes), self.opset,
                                          self.max_grad_norm), self.op_type)


# -- what is trained ----------------------------------------------------------------------


def _program(source: Any, optimizer: Any, options: Mapping[str, Any]) -> TrainingProgram:
    """The program to export: ``source`` itself, or ``source`` compiled with ``options``."""
    unknown = sorted(set(options) - set(_COMPILE_OPTIONS))
    if unknown:
        raise UnsupportedOptionError(
            f"to_ort_artifacts has no option {unknown[0]!r}."
            + suggest(unknown[0], [*_COMPILE_OPTIONS, "optimizer", "step", "properties"],
                      "options"))
    if isinstance(source, TrainingProgram):
        if options:
            raise UnsupportedOptionError(
                f"to_ort_artifacts got a TrainingProgram and {sorted(options)[0]}=: a program "
                "carries its weights, loss and penalty already. Compile the inference model "
                "with the options you want, or pass the model itself with them.")
        return source
    chosen = as_optimizer(optimizer)
    ort_optimizer(chosen)  # an optimizer the format lacks fails before compiling
    if options.get("ema_decay") is not None:
        raise UnsupportedOptionError(_NO_EMA)
    return compile_program(source, optimizer=chosen, fuse="step", **options)


def ort_optimizer(optimizer: Optimizer) -> tuple[str, dict[str, Any]]:
    """The ``com.microsoft`` optimizer op and attributes that compute ``optimizer``'s update.

    SGD with a constant rate is ``SGDOptimizerV2``; AdamW (and Adam, an AdamW without
    decay) is ``AdamWOptimizer`` in torch's mode (``adam_mode=0``: the decay first, the
    bias corrections applied to the moments). Other optimizers have no op in the format.
    """
    if isinstance(optimizer.learning_rate, Schedule):
        raise UnsupportedOptionError(
            f"learning_rate={optimizer.learning_rate!r} cannot be exported to onnxruntime's "
            "training artifacts: their checkpoint holds one initial learning rate, and their "
            "runner sets each step's (onnxruntime.training.api.Optimizer.set_learning_rate, "
            "or its LinearLRScheduler for a linear warmup and decay to 0). Export with the "
            "schedule's rate as a number and set each step's rate to schedule(step) yourself.")
    if isinstance(optimizer, AdamW) and not optimizer.same_for_every_weight:
        raise UnsupportedOptionError(
            f"AdamW(exclude_from_weight_decay={list(optimizer.exclude_from_weight_decay)!r}) "
            "cannot be exported to onnxruntime's training artifacts: their optimizer graph is "
            "one AdamWOptimizer op with one weight_decay for every weight. Export AdamW without "
            "exclusions, or train with lossgraph.Trainer, which runs decay groups.")
    if isinstance(optimizer, SGD):
        if optimizer.learning_rate_schedule != "constant":
            raise UnsupportedOptionError(
                f"SGD(learning_rate_schedule={optimizer.learning_rate_schedule!r}) cannot be "
                "exported to onnxruntime's training artifacts, which support SGD with a "
                "constant rate and AdamW (or Adam) only: their runner feeds one learning rate "
                "per step (Optimizer.set_learning_rate), and onnxruntime schedules it linearly "
                "only. Export SGD with a constant rate and set each step's rate yourself.")
        return "SGDOptimizerV2", {}
    if isinstance(optimizer, Adam):  # AdamW derives from Adam
        decay = optimizer.weight_decay if isinstance(optimizer, AdamW) else 0.0
        return "AdamWOptimizer", {"alpha": optimizer.beta1, "beta": optimizer.beta2,
                                  "epsilon": optimizer.epsilon, "weight_decay": decay,
                                  "correct_bias": 1, "adam_mode": 0}
    raise UnsupportedOptionError(
        f"{type(optimizer).__name__} cannot be exported to onnxruntime's training artifacts: "
        "their optimizer graph holds one onnxruntime optimizer op, and onnxruntime has ops for "
        "SGD (a constant rate: lossgraph.optim.SGD) and AdamW (lossgraph.optim.AdamW, or Adam) "
        "only, none for momentum or Nesterov momentum. Export with optimizer=SGD(...) or "
        "AdamW(...), or train with lossgraph's own graphs (lossgraph.Trainer), which run "
        "every lossgraph optimizer.")


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise UnsupportedOptionError(f"step={step!r} must be an integer >= 0 (the updates "
                                     "already done).")


def _check_opset(model: onnx.ModelProto) -> None:
    version = opset_version(model)
    if version is None or not DEFAULT_TARGET.supports(version):
        raise UnsupportedModelError(
            f"The model uses ai.onnx opset {version}; onnxruntime's training artifacts run on "
            f"onnxruntime-training 1.19 (the last training build), which loads opsets "
            f"{DEFAULT_TARGET.min_opset} to {DEFAULT_TARGET.max_opset}. Compile the model "
            "for the default target (compile_program(model) moves it to those opsets where "
            "its ops keep their meaning), or pass the model itself to to_ort_artifacts.")


def _check_float32(model: onnx.ModelProto, weights: list[str]) -> None:
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    for name in weights:
        if types.get(name) != TensorProto.FLOAT:
            kind = helper.tensor_dtype_to_np_dtype(types[name]) if types.get(name) else "?"
            raise DTypeMismatchError(
                f"Weight {name!r} is {kind}: onnxruntime's training optimizers "
                "(SGDOptimizerV2, AdamWOptimizer) update float32 weights only. Convert the "
                "model to float32 before exporting it.")


def _moments(program: TrainingProgram, op_type: str) -> dict[str, dict[str, np.ndarray]]:
    """Each weight's moments as onnxruntime names them (SGD keeps one, unused, as
    onnxruntime's own artifacts do): the program's Adam moments when it has them, else zeros."""
    count = 2 if op_type == "AdamWOptimizer" else 1
    reuse = count == 2 and isinstance(program.optimizer, Adam)
    states = {w["name"]: [s["name"] for s in w["states"]] for w in program.manifest["weights"]}
    moments = {}
    for weight in program.weights:
        value = program.state[weight]
        kept = [program.state[s] for s in states[weight]] if reuse else []
        moments[weight] = {MOMENT_NAMES[i]: kept[i] if i < len(kept) else np.zeros_like(value)
                           for i in range(count)}
    return moments


# -- the models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AccumulateGradients(Pass[dict[str, str]]):
    """The gradient model (:class:`~lossgraph.passes.gradient.Gradient`, weights as inputs)
    with each gradient accumulated into its buffer by ``InPlaceAccumulatorV2`` (module
    docstring)::

        (inputs) -> (outputs, <w>_grad...)
            becomes
        (inputs, <w>_grad.accumulation.buffer..., lazy_reset_grad)
            -> (outputs, <w>_grad.accumulation.out...)

    The buffer and flag names are those onnxruntime's Module looks for; its output runs on
    the training build only. Reports each weight's buffer.
    """

    requires: ClassVar[tuple[Requirement, ...]] = (GRADIENT_MODEL,)

    def call(self, model: onnx.ModelProto) -> PassResult[dict[str, str]]:
        gradients: dict[str, str] = read_json(model, GRADIENTS_KEY)
        graph = model.graph
        names = NameAuthority.for_model(model)
        reset = _reserved(names, LAZY_RESET_GRAD)
        types = {o.name: o.type for o in graph.output}
        flags = []
        buffers = {}
        for weight, grad in gradients.items():
            buffers[weight] = buffer = _reserved(names, f"{weight}{BUFFER_SUFFIX}")
            flag = _reserved(names, f"{weight}{FLAG_SUFFIX}")
            graph.node.append(helper.make_node(
                "InPlaceAccumulatorV2", [buffer, grad, reset], [flag],
                name=names.fresh(f"{weight}_grad_accumulator"), domain=MS_DOMAIN))
            flags.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, [1]))
        kept = [o for o in graph.output if o.name not in set(gradients.values())]
        del graph.output[:]
        graph.output.extend([*kept, *flags])
        graph.input.extend([*(helper.make_value_info(buffers[w], types[g])
                              for w, g in gradients.items()),
                            helper.make_tensor_value_info(reset, TensorProto.BOOL, [1])])
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        _drop_unread_initializers(graph)
        return PassResult(model, buffers)


def accumulate_gradients(model: ModelLike) -> onnx.ModelProto:
    """:class:`AccumulateGradients` as a function: the model in, the model out."""
    return AccumulateGradients()(model).model


def _reserved(names: NameAuthority, name: str) -> str:
    """``name``, which onnxruntime's Module finds by name, once the model does not use it."""
    if name in names:
        raise NameCollisionError(
            f"The model already uses the name {name!r}, which onnxruntime's training Module "
            "reserves (gradient buffers, their flags, lazy_reset_grad). Rename that value "
            "or input in the model before exporting it.")
    return names.claim(name)


def _drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Drop initializers nothing reads (WidenScalarConstants leaves the scalars it widened),
    which onnxruntime would warn about each time it loads the model."""
    read = values_read(graph) | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def optimizer_model(op_type: str, attributes: Mapping[str, Any], opset: int,
                    max_grad_norm: float | None = None) -> onnx.ModelProto:
    """The optimizer model: ``op_type`` (``SGDOptimizerV2`` or ``AdamWOptimizer``) over the
    inputs onnxruntime's Optimizer feeds, by name and in this order: ``learning_rate``
    (float[1]), ``step`` (int64[1], the update's 1-based number), then sequences of float
    tensors ``params``, ``gradients``, ``first_order_moments`` (and for AdamW
    ``second_order_moments``); one output, ``update_completed`` (bool). With
    ``max_grad_norm``, the gradients go through ``InplaceClipGradNorm`` first."""
    adamw = op_type == "AdamWOptimizer"
    names = OPTIMIZER_INPUTS if adamw else OPTIMIZER_INPUTS[:5]
    inputs = [helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [1]),
              helper.make_tensor_value_info(names[1], TensorProto.INT64, [1])]
    inputs += [helper.make_tensor_sequence_value_info(n, TensorProto.FLOAT, None)
               for n in names[2:]]
    node_inputs = list(names) if adamw else ["learning_rate", "params", "gradients"]
    nodes = []
    if max_grad_norm is not None:
        nodes.append(helper.make_node("InplaceClipGradNorm", ["gradients"],
                                      ["clipped_gradients"], name="InplaceClipGradNorm",
                                      domain=MS_DOMAIN, max_norm=float(max_grad_norm)))
        node_inputs[node_inputs.index("gradients")] = "clipped_gradients"
    nodes.append(helper.make_node(op_type, node_inputs, ["update_completed"], name=op_type,
                                  domain=MS_DOMAIN, **attributes))
    output = helper.make_tensor_value_info("update_completed", TensorProto.BOOL, [1])
    model = helper.make_model(
        helper.make_graph(nodes, "optimizer", inputs, [output]),
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS_DOMAIN, 1)])
    check_emitted(model, "to_ort_artifacts (optimizer model)")
    return model


# -- the folder ------------------------------------------------------------------------------


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _marked(model: onnx.ModelProto, record: Mapping[str, str]) -> bytes:
    """``model``'s bytes, marked as lossgraph's and carrying the folder's ``record``."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    remove_record(copy, GRADIENTS_KEY)  # the gradients are no longer outputs
    write_json(copy, RECORD_KEY, dict(record))
    return serialize(copy)


def _unmarked(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes without lossgraph's metadata. onnxruntime's
    ``Module.export_model_for_inferencing`` copies the eval model's metadata into the
    inference model it writes: a lossgraph mark there would make lossgraph take that file
    for its own, and a loss record would name a loss the inference model lacks."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [p for p in copy.metadata_props if not p.key.startswith("lossgraph.")]
    del copy.metadata_props[:]
    copy.metadata_props.extend(kept)
    return copy.SerializeToString()


def _artifact_entries(folder: Path) -> set[str] | None:
    """The artifacts lossgraph wrote in ``folder``: its training and optimizer models (marked
    as lossgraph's, carrying the folder's record), and the eval model and checkpoint while
    they have the checksums recorded (onnxruntime saving its own checkpoint over lossgraph's
    makes it foreign). None when no file shows that lossgraph wrote the folder."""
    owned: set[str] = set()
    checksums: dict[str, set[str]] = {EVAL_FILE: set(), CHECKPOINT_FILE: set()}
    for name in (TRAINING_FILE, OPTIMIZER_FILE):
        path = folder / name
        if not written_by_lossgraph(path):
            continue
        try:
            record = read_json(onnx.load_model(str(path), load_external_data=False),
                               RECORD_KEY)
        except ValueError:  # a damaged record: not a folder lossgraph can vouch for
            record = None
        if isinstance(record, dict) and record.get("format") == RECORD_FORMAT:
            owned.add(name)
            for other, found in checksums.items():
                found.add(str(record.get(other)))
    if not owned:
        return None
    for name, found in checksums.items():
        path = folder / name
        if path.is_file() and not path.is_symlink() and _checksum(path.read_bytes()) in found:
            owned.add(name)
    return owned


ARTIFACTS_FOLDER = FolderKind("an onnxruntime training artifacts folder", _artifact_entries)

