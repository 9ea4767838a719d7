"""Checks of compile's options and of the model, done before any work.

Each check returns the value in the form the caller uses (a list for a single name, an
optimizer for its name) or raises the :mod:`lossgraph.errors` class that fits, with a
message naming the option, tensor or node at fault and how to fix it. The data a
Trainer is given are checked by :mod:`lossgraph.data`; a single option's value by
:mod:`lossgraph.options` (a single name where a list of names is expected is a list of
one, never split into letters).
"""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from . import training_build
from .adapters import Adapter, LoRA
from .analysis import folded_weights, stuck_weights, tied_initializers
from .errors import (
    FoldedWeightWarning,
    InvalidModelError,
    NoGradientError,
    StuckWeightWarning,
    TiedWeightWarning,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from .graphs import FLOAT_TYPES, elem_type_name, tensor_array
from .manifest import FUSE_MODES
from .models import check_declared_outputs
from .optim import Optimizer, as_optimizer
from .options import choice, count, names
from .passes.fixed_batch import FIXED_BATCH_CHOICES, export_advice, fixed_batch, rows
from .passes.gradient import BACKENDS
from .passes.loss import AUTO, OUTPUT_OPTIONS, SCORES, resolve_score
from .passes.recompute import recompute_choice
from .penalties import Penalty, parse_penalty
from .roles import get_roles
from .update_options import UpdateOptions

__all__ = ["CompileOptions", "compile_options", "check_trainable_model", "check_learnable",
           "no_weights_error", "check_penalized", "warn_tied", "warn_folded",
           "warn_zero_adapters"]

#: ai.onnx.ml operators that keep their parameters in attributes: nothing to train.
_ATTRIBUTE_MODELS = ("TreeEnsembleRegressor", "TreeEnsembleClassifier", "TreeEnsemble",
                     "SVMRegressor", "SVMClassifier")


# -- options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileOptions:
    """``compile``'s options, checked and in the form the pipeline uses."""

    weights: list[str] | None
    loss_options: dict[str, Any]
    optimizer: Optimizer
    backend: str
    fuse: str
    fixed_batch: str = "auto"
    #: None (nothing untied), "auto" (every tied initializer) or the initializers' names
    untie: str | list[str] | None = None
    #: the micro-batches of one update (above 1: the graphs that accumulate are built)
    accumulation_steps: int = 1
    #: gradient clipping and an EMA of the weights around the optimizer's update
    update: UpdateOptions = UpdateOptions()
    #: None (by the model's size), "none", "activations", "elementwise", "auto", a budget or
    #: the boundaries (:func:`lossgraph.passes.recompute.recompute_choice`)
    recompute: str | tuple[str, ...] | float | None = None
    #: LoRA adapters to add before training (:mod:`lossgraph.adapters`), or None
    adapters: LoRA | None = None


def compile_options(weights: Any, loss: Any, loss_options: Any, penalty: Any,
                    optimizer: Any, backend: Any, fuse: Any, fixed_batch: Any = "auto",
                    untie: Any = None, accumulation_steps: Any = 1, max_grad_norm: Any = None,
                    ema_decay: Any = None, recompute: Any = None,
                    adapters: Any = None) -> CompileOptions:
    """Check every option of ``compile`` that does not need the model."""
    fuse = choice("fuse", fuse, FUSE_MODES)
    fixed_batch = choice("fixed_batch", fixed_batch, FIXED_BATCH_CHOICES)
    backend = choice("backend", backend, BACKENDS)
    if backend == "ort":
        training_build.bindings("backend='ort'")  # before any work, not after the loss
    options = _loss_options(loss, loss_options)
    if not isinstance(penalty, Penalty):  # resolved once the trained weights are known
        parse_penalty(penalty)
    if loss is None and penalty:
        raise UnsupportedOptionError(
            "penalty= needs lossgraph to add the loss; with loss=None the model carries its "
            "own. Add the penalty when building it: add_loss_output(..., penalty=...).")
    accumulation_steps = count("accumulation_steps", accumulation_steps, 1)
    if loss is None and accumulation_steps > 1:
        raise UnsupportedOptionError(
            f"accumulation_steps={accumulation_steps} needs lossgraph to add the loss: how "
            "micro-batches' gradients combine into their rows' gradient depends on how the loss "
            "reduces rows, which a model carrying its own loss (loss=None) does not record. "
            "Compile the inference model with a loss name, or train at the larger batch.")
    return CompileOptions(names("weights", weights, allow_empty=True), options,
                          as_optimizer(optimizer), backend, fuse, fixed_batch,
                          _untie(untie), accumulation_steps,
                          UpdateOptions(max_grad_norm, ema_decay), recompute_choice(recompute),
                          _adapters(adapters))


def _adapters(adapters: Any) -> LoRA | None:
    """``adapters``, a :class:`~lossgraph.adapters.LoRA` or None."""
    if adapters is None or isinstance(adapters, LoRA):
        return adapters
    raise UnsupportedOptionError(
        f"adapters={reprlib.repr(adapters)} must be a lossgraph.LoRA(...) (e.g. "
        "LoRA(rank=8, alpha=16, targets=['query', 'value'])) or None.")


def _untie(untie: Any) -> str | list[str] | None:
    """``untie`` as None (False, None: nothing), ``"auto"`` (True, ``"auto"``: every
    initializer :func:`~lossgraph.analysis.tied_initializers` finds) or a list of names."""
    if untie is None or untie is False:
        return None
    if untie is True or untie == "auto":
        return "auto"
    if isinstance(untie, (str, list, tuple)) and untie:
        return names("untie", untie)
    raise UnsupportedOptionError(
        f"untie={reprlib.repr(untie)} must be 'auto' (or True: every initializer several "
        "layers read as their own), a list of initializer names, or None.")


def _loss_options(loss: Any, options: Any) -> dict[str, Any]:
    """``loss_options`` as a dict: add_loss_output's options and those of the score."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise UnsupportedOptionError(
            f"loss_options={reprlib.repr(options)} must be a dict of add_loss_output options, "
            "e.g. {'weight_name': 'sample_weight', 'reduction': 'sum'}.")
    options = dict(options)
    if loss is None:
        if options:
            raise UnsupportedOptionError(
                f"loss_options={options!r} has no effect with loss=None (the model carries its "
                "loss already): leave it out.")
        return options
    for key in options:
        if key in ("loss", "score_name", "penalty"):
            where = "penalty=" if key == "penalty" else "loss="
            raise UnsupportedOptionError(
                f"loss_options holds {key!r}: pass it to compile itself as {where}...")
    if loss == AUTO:  # the options of the loss it picks are checked once it is picked
        valid = [*OUTPUT_OPTIONS, *dict.fromkeys(k for s in SCORES.values() for k in s.options)]
    else:
        score, _ = resolve_score(loss, {}, option="loss")
        valid = [*OUTPUT_OPTIONS, *score.options]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise UnsupportedOptionError(
            f"loss_options has no key {unknown[0]!r} for loss={loss!r}."
            + suggest(str(unknown[0]), valid, "keys"))
    if loss != AUTO:
        resolve_score(loss, {k: v for k, v in options.items() if k in score.options},
                      option="loss")
    if options.get("reduction") == "none":
        raise UnsupportedOptionError(
            "loss_options={'reduction': 'none'} gives a loss per row; training needs one number "
            "to minimize: use 'mean' (the default) or 'sum'.")
    return options


def check_penalized(penalty: Mapping[str, Any] | None, weights: Sequence[str]) -> None:
    """Every penalized weight is trained: a penalty on a frozen weight changes nothing."""
    for name in parse_penalty(penalty):
        if name not in weights:
            raise UnsupportedOptionError(
                f"penalty names {name!r}, which is not trained (trained: {list(weights)}): a "
                "penalty on a frozen weight would add a constant to the loss and change "
                "nothing. Train it, or drop it from penalty." + suggest(name, weights, "weights"))


# -- models ------------------------------------------------------------------------------


def check_trainable_model(model: onnx.ModelProto) -> None:
    """What makes a valid model untrainable, named before any pass runs: an empty graph,
    a scalar data input, data inputs that fix different batch sizes
    (:func:`~lossgraph.passes.fixed_batch.fixed_batch`; one fixed batch trains), an output
    whose first axis is not the inputs' batch, an output declared of another
    shape than its node computes (:func:`~lossgraph.models.check_declared_outputs`),
    parameters kept in attributes only."""
    graph = model.graph
    if not graph.node:
        raise UnsupportedModelError(
            f"The model's graph {graph.name!r} has no nodes: its outputs are its inputs or "
            "constants, so there is nothing to train.")
    for kind, values in (("Input", graph.input), ("Output", graph.output)):
        for value in values:
            elem_type = value.type.tensor_type.elem_type
            if value.type.HasField("tensor_type") and (
                    elem_type == onnx.TensorProto.UNDEFINED
                    or elem_type not in onnx.TensorProto.DataType.values()):
                raise InvalidModelError(
                    f"{kind} {value.name!r} has no element type (elem_type {elem_type}, "
                    "which ONNX does not define as a type): the model is damaged, or its "
                    "exporter wrote it wrong. Declare its type (e.g. float) in the model.")
    initializers = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name in initializers or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and not dims:
            raise UnsupportedModelError(
                f"Input {value.name!r} is a scalar: lossgraph feeds data in batches of rows, "
                "so every data input needs a batch axis first.")
    batch = fixed_batch(model)  # a fixed batch (torch's default export) trains: compiler
    for value in graph.output:
        dims = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else ()
        if not dims or not dims[0].HasField("dim_value") or dims[0].dim_value == batch:
            continue
        if batch is not None:
            raise UnsupportedModelError(
                f"Output {value.name!r} has shape ({_dims_text(dims)}), but the inputs' batch "
                f"is fixed at {rows(batch)}: lossgraph trains models that compute one output "
                "row per input row, and this output's first axis is not the batch.")
        raise UnsupportedModelError(
            f"Output {value.name!r} has a fixed batch dimension of {dims[0].dim_value} "
            f"(shape ({_dims_text(dims)})), but the inputs' batch dimension is free: "
            "lossgraph trains on batches of rows, so each output needs a free batch axis "
            "first as well. Declare it like the inputs' (e.g. 'N'), or export again with "
            "the outputs' batch free too. " + export_advice(model))
    check_declared_outputs(model)
    floats = [t for t in graph.initializer if t.data_type in FLOAT_TYPES]
    fixed = [n for n in graph.node if n.domain == "ai.onnx.ml" and n.op_type in _ATTRIBUTE_MODELS]
    if fixed and not floats:
        node = fixed[0]
        raise UnsupportedModelError(
            f"Node {node.name or '(unnamed)'!r} is an ai.onnx.ml {node.op_type}: it keeps its "
            "parameters in node attributes and computes a piecewise-constant function, so "
            "there is no weight to train by gradient descent. Refit the estimator (e.g. with "
            "scikit-learn) and convert it again.")


def check_learnable(model: onnx.ModelProto, weights: Sequence[str]) -> None:
    """Weights that training can never change (every path to the loss passes an op whose
    gradient is zero everywhere: :func:`~lossgraph.analysis.stuck_weights`): a
    NoGradientError when all are, else a StuckWeightWarning naming them."""
    stuck = stuck_weights(model, weights)
    if not stuck:
        return
    loss = get_roles(model).get("loss", "the outputs")
    paths = "".join(f"\n  {weight.describe()}" for weight in stuck)
    zeros = ", ".join(dict.fromkeys(w.node.op_type for w in stuck))
    way_out = (f"Train through a differentiable stand-in for {zeros} (e.g. the straight-"
               "through estimator, x + (Round(x) - x) with the difference as a constant, "
               "before export), or train weights with a differentiable path.")
    names = ", ".join(repr(w.name) for w in stuck)
    if len(stuck) == len(weights):
        raise NoGradientError(
            f"No weight can learn: {names} reach{'es' * (len(stuck) == 1)} the loss {loss!r} "
            f"only through ops whose gradient is zero wherever it exists ({zeros}), so "
            f"gradient descent would never change {'them' if len(stuck) > 1 else 'it'}:"
            f"{paths}\n{way_out}")
    warnings.warn(
        f"{names} reach{'es' * (len(stuck) == 1)} the loss {loss!r} only through ops whose "
        f"gradient is zero wherever it exists ({zeros}): training will not change "
        f"{'them' if len(stuck) > 1 else 'it'}:{paths}\n{way_out}", StuckWeightWarning,
        stacklevel=4)


def warn_tied(model: onnx.ModelProto, weights: Sequence[str]) -> None:
    """A TiedWeightWarning naming the ``weights`` several layers read as their own
    (:func:`~lossgraph.analysis.tied_initializers`), and the way to untie them."""
    tied = tied_initializers(model, weights)
    if not tied:
        return
    lines = "".join(f"\n  {t.describe()}" for t in tied)
    warnings.warn(
        f"{'These weights are' if len(tied) > 1 else 'This weight is'} read by several layers "
        "that look independent, and trains as one weight those layers share:" + lines +
        "\ntorch's exporters merge initializers of equal values (a fresh model's LayerNorm "
        "scales and zero biases, copied layers): the torch model had one parameter per layer. "
        "Compile with untie='auto' (lossgraph compile --untie) to give each layer its own copy, "
        f"or untie=[{tied[0].name!r}, ...] for some; if the layers share it on purpose, "
        "ignore this.", TiedWeightWarning, stacklevel=4)


def warn_folded(model: onnx.ModelProto, weights: Sequence[str]) -> None:
    """A FoldedWeightWarning naming the ``weights`` that are no parameter of the module the
    model was exported from, and the parameters the export dropped
    (:func:`~lossgraph.analysis.folded_weights`), and how to export the parameters."""
    folded = folded_weights(model, weights)
    if not folded:
        return
    shown = "".join(f"\n  {f.describe()}" for f in folded[:6])
    more = f"\n  ... and {len(folded) - 6} more" if len(folded) > 6 else ""
    warnings.warn(
        f"The export's weights are not the module's parameters: {len(folded)} "
        f"{'were' if len(folded) > 1 else 'was'} folded, copied or dropped by the exporter:"
        f"{shown}{more}\nTraining them trains another model than the module. Export without "
        "folding to train the module's parameters: torch.onnx.export(..., optimize=False) with "
        "the dynamo exporter, do_constant_folding=False with the legacy one (dynamo=False); "
        "to train the export as it is, ignore this.", FoldedWeightWarning, stacklevel=4)


def no_weights_error(model: onnx.ModelProto) -> UnsupportedModelError:
    """Why the model has no trainable weight, and what to do."""
    graph = model.graph
    if not graph.initializer:
        constants = [n.output[0] for n in graph.node if n.op_type == "Constant"]
        where = (f" Its weights seem to be Constant nodes ({', '.join(map(repr, constants[:5]))}"
                 "), which are not trained unless named: pass weights=[...] naming their "
                 "outputs (compile makes them initializers), or export without constant "
                 "folding." if constants else "")
        return UnsupportedModelError(f"The model has no initializers, so no trainable weights."
                                     f"{where}")
    listed = ", ".join(f"{t.name!r} ({elem_type_name(t.data_type)}{list(t.dims)})"
                       for t in list(graph.initializer)[:10])
    return UnsupportedModelError(
        "The model has no trainable weights (float initializers of rank >= 1 that influence the "
        f"loss); its initializers: {listed}. Pass weights=[...] to name the ones to train.")


def _dims_text(dims: Sequence[onnx.TensorShapeProto.Dimension]) -> str:
    """``8, N, ?``: each dimension's size, else its name, else ``?``."""
    return ", ".join(str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                     for d in dims)


def warn_zero_adapters(model: onnx.ModelProto, adapters: Sequence[Adapter]) -> None:
    """A StuckWeightWarning for adapters whose A and B are both zero (``init="zeros"``):
    their gradients are zero, training never moves them."""
    tensors = {t.name: t for t in model.graph.initializer}
    zero = [a.a for a in adapters
            if not any(tensor_array(tensors[n]).any() for n in (a.a, a.b) if n in tensors)]
    if zero:
        warnings.warn(
            f"The LoRA adapters {', '.join(map(repr, zero[:4]))}{' ...' if len(zero) > 4 else ''}"
            " start with A and B both zero (init='zeros'): their gradients are zero and "
            "training never moves them. Load trained adapters first (lossgraph.load_adapters), "
            "or use init='kaiming'.", StuckWeightWarning, stacklevel=4)
