"""TrainingProgram: the training graphs of a model, their manifest and initial state.

``compile`` runs the pass pipeline

    lower_ml_ops -> add_loss_output (+ penalty) -> weights_to_inputs -> gradient
                 -> step_graph (optimizer update) [-> epoch_graph]

and packs the result. Whatever the fusion mode, a program holds

- ``evaluate``: (features, label[, sample_weight], weights) -> (loss, predictions...)
- ``predict``: (features, weights) -> (the inference model's outputs)

and, by mode,

- ``fuse="step"``: ``train_step`` (one minibatch step, update included);
- ``fuse="epoch"``: ``train_epoch`` (a Scan over all full batches) and ``train_step``
  (for a last, smaller batch);
- ``fuse="separate"``: the reference documents' four graphs: ``gradient`` (the
  model's vector-Jacobian product), ``loss`` (loss and its gradient against the
  prediction), ``penalty`` (the penalty and the total gradient) and ``update``.

The manifest (JSON) names every graph's inputs and outputs with their roles, so a
runner in any language can drive the graphs; see docs/reference/program.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .analysis import trainable_initializers
from .errors import UnsupportedModelError, UnsupportedOptionError
from .fileio import check_file_target, ensure_folder, save_model, serialize
from .manifest import FORMAT, FUSE_MODES
from .models import ModelLike, as_model
from .names import NameAuthority
from .passes.broadcast import widen_scalar_constants
from .passes.fuse import Signature, epoch_graph, pack_weights, step_graph
from .passes.gradient import GRADIENTS_KEY
from .passes.gradient import gradient as gradient_of
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.penalty import penalty_graph
from .passes.update import update_graph, weights_dtype
from .passes.weights import weights_to_inputs
from .roles import check_loss_roles, get_roles
from .storage import read_program, save_program
from .target import Target, use_target
from .validation import check_penalized, check_trainable_model, compile_options, no_weights_error

__all__ = ["TrainingProgram", "compile", "FUSE_MODES", "FORMAT"]


@dataclass
class TrainingProgram:
    """A compiled model: graphs by name, a JSON manifest, initial state, inference model."""

    graphs: dict[str, onnx.ModelProto]
    manifest: dict[str, Any]
    state: dict[str, np.ndarray]
    inference_model: onnx.ModelProto

    # -- what the manifest says -------------------------------------------------------
    @property
    def fuse(self) -> str:
        return self.manifest["fuse"]

    @property
    def weights(self) -> list[str]:
        return [w["name"] for w in self.manifest["weights"]]

    @property
    def states(self) -> list[str]:
        return [s["name"] for w in self.manifest["weights"] for s in w["states"]]

    @property
    def optimizer(self):
        from .optim import optimizer_from_dict

        return optimizer_from_dict(self.manifest["optimizer"])

    def io(self, graph: str, role: str) -> list[str]:
        """Names of ``graph``'s inputs and outputs that play ``role``, in order."""
        entry = self.manifest["graphs"][graph]
        return [v["name"] for v in (*entry["inputs"], *entry["outputs"]) if v["role"] == role]

    # -- persistence -------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write graphs, manifest and state into the folder ``directory``, atomically.

        ``directory`` must be new, empty, or a program folder lossgraph wrote (holding
        nothing else); anything else is an :class:`~lossgraph.errors.UnsafeWriteError`
        and is left untouched. A reader never sees half a program, and a failed or
        killed save leaves the previous program there loadable (see lossgraph.fileio).
        """
        return save_program(directory, self)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TrainingProgram:
        """Read a program written by :meth:`save`; a damaged folder is an
        :class:`~lossgraph.errors.InvalidProgramError` naming the file and the problem."""
        return cls(*read_program(directory))

    def save_onnx_graph(self, folder: str | os.PathLike | None = None) -> dict[str, Any]:
        """Every graph for inspection: ``{name: bytes}``, or ``{name: path}`` once written.

        With ``folder`` (created when missing, its parent must exist), each graph is
        written atomically to ``folder/<name>.onnx``; an existing file there is replaced
        only when lossgraph wrote it. Every path is checked before anything is written.
        """
        if folder is None:
            return {name: serialize(graph) for name, graph in self.graphs.items()}
        folder = ensure_folder(folder)
        paths = {name: folder / f"{name}.onnx" for name in self.graphs}
        for path in paths.values():
            check_file_target(path)
        return {name: save_model(graph, paths[name]) for name, graph in self.graphs.items()}

    # -- export -------------------------------------------------------------------------
    def to_inference_model(self, state: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
        """The inference model with ``state``'s weights (default: the initial ones) written back."""
        state = self.state if state is None else state
        model = onnx.ModelProto()
        model.CopyFrom(self.inference_model)
        by_name = {t.name: i for i, t in enumerate(model.graph.initializer)}
        for weight in self.weights:
            value = np.asarray(state[weight])
            tensor = numpy_helper.from_array(value.astype(self.state[weight].dtype), weight)
            model.graph.initializer[by_name[weight]].CopyFrom(tensor)
        return model


def compile(  # noqa: A001 - the name the issue asks for, mirrors torch.compile
    model: ModelLike,
    trainable: Sequence[str] | None = None,
    loss: str | None = "squared_error",
    loss_options: Mapping[str, Any] | None = None,
    penalty: Mapping[str, Any] | None = None,
    optimizer=None,
    gradient: str = "onnx",
    fuse: str = "step",
    target: Target | str | None = None,
) -> TrainingProgram:
    """Compile ``model`` into a :class:`TrainingProgram`.

    Options are checked before the model is read, and the model before any pass runs
    (:mod:`lossgraph.validation`); every bad input is a :mod:`lossgraph.errors` error.

    Args:
        model: an inference model (a loss is added), or a model that already has a loss
            output, recorded by :func:`~lossgraph.add_loss_output` (pass ``loss=None``).
        trainable: weights to train (a list of names, or one name); default
            :func:`~lossgraph.trainable_initializers`.
        loss: a score name of :func:`~lossgraph.add_loss_output`, or ``None`` when the
            model carries its loss already.
        loss_options: further arguments of ``add_loss_output`` (``weight_name``,
            ``output_index``, ``reduction``, score options such as ``delta``).
        penalty: ``{weight: {"l1": a, "l2": b}}`` or ``{weight: b}``, added to the loss
            (and so to its gradient and to the reported loss).
        optimizer: a :mod:`lossgraph.optim` optimizer, its name (``"adam"``) or its dict
            form (``{"type": "Adam", "learning_rate": 0.01}``); default ``SGD()``.
        gradient: the gradient backend: ``"onnx"`` (standard ops, any onnxruntime) or
            ``"ort"`` (onnxruntime-training's builder, training build only).
        fuse: ``"separate"``, ``"step"`` or ``"epoch"`` (see the module docstring).
        target: the runtimes the graphs must load in: a name of
            :data:`lossgraph.target.TARGETS` (``"default"``: onnxruntime-training 1.19
            and current onnxruntime, opsets 13-21; ``"onnxruntime"``: current
            onnxruntime only, opsets up to 25) or a :class:`~lossgraph.target.Target`.
    """
    with use_target(target):
        return _compile(model, trainable, loss, loss_options, penalty, optimizer, gradient,
                        fuse)


def _compile(model: ModelLike, trainable: Any, loss: Any, loss_options: Any, penalty: Any,
             optimizer: Any, gradient: Any, fuse: Any) -> TrainingProgram:
    checked = compile_options(trainable, loss, loss_options, penalty, optimizer, gradient, fuse)
    optimizer, gradient, fuse, options = (checked.optimizer, checked.gradient, checked.fuse,
                                          checked.loss_options)
    given = as_model(model)
    check_trainable_model(given)
    source = lower_ml_ops(given)
    carried = get_roles(source).get("loss")
    if loss is None:
        if not carried:
            raise UnsupportedModelError(
                "loss=None says the model carries its loss, but it records no loss output: "
                "pass a score name (e.g. loss='squared_error'), or build the loss with "
                "lossgraph.add_loss_output.")
        check_loss_roles(source)
        with_loss = source
    elif carried:
        raise UnsupportedModelError(
            f"The model carries a loss already ({carried!r}, recorded by add_loss_output): "
            "pass loss=None to train on it, or compile the inference model.")
    else:
        with_loss = add_loss_output(source, loss, penalty=penalty, **options)
    roles = get_roles(with_loss)
    weights = checked.trainable or trainable_initializers(with_loss)
    if not weights:
        raise no_weights_error(with_loss)
    check_penalized(penalty, weights)
    lifted, initial = weights_to_inputs(with_loss, weights)
    weights_dtype(initial, "compile")  # one float type, or a clear error
    data_inputs = [i.name for i in lifted.graph.input if i.name not in initial]
    label, sample_weight = roles["label"], roles.get("weight")
    features = [n for n in data_inputs if n not in (label, sample_weight)]
    signature = Signature(features=features, label=label, sample_weight=sample_weight,
                          loss=roles["loss"], weights=weights)

    graphs: dict[str, onnx.ModelProto] = {"evaluate": lifted,
                                          "predict": weights_to_inputs(source, weights)[0]}
    state = dict(initial)
    if fuse == "separate":
        graphs.update(_separate_graphs(graphs["predict"], roles, loss, options, penalty,
                                       initial, optimizer, gradient, signature))
    else:
        with_gradients = gradient_of(lifted, wrt=weights, loss=signature.loss,
                                                backend=gradient)
        signature.gradients = _gradient_names(with_gradients)
        step, signature = step_graph(with_gradients, signature, optimizer)
        graphs["train_step"] = step
    if fuse == "epoch":  # the Scan carries the weights and states packed in flat vectors
        packed, packed_signature = pack_weights(with_gradients, signature)
        packed_step, packed_signature = step_graph(packed, packed_signature, optimizer)
        graphs["train_epoch_ordered"], _ = epoch_graph(packed_step, packed_signature,
                                                       shuffled=False)
        graphs["train_epoch"], signature = epoch_graph(packed_step, packed_signature)
    for weight in weights:
        for name, value in zip(signature.states[weight], optimizer.initial_state(initial[weight])):
            state[name] = value
    graphs = {name: widen_scalar_constants(graph) for name, graph in graphs.items()}
    manifest = _manifest(graphs, signature, optimizer, fuse, roles)
    return TrainingProgram(graphs, manifest, state, source)


def _gradient_names(model: onnx.ModelProto) -> dict[str, str]:
    """``{weight: gradient output}`` as recorded by the gradient pass."""
    return json.loads({p.key: p.value for p in model.metadata_props}[GRADIENTS_KEY])


def _separate_graphs(predict: onnx.ModelProto, roles: Mapping[str, str], loss: str | None,
                     options: Mapping[str, Any], penalty: Mapping[str, Any] | None,
                     initial: Mapping[str, np.ndarray], optimizer, backend: str,
                     signature: Signature) -> dict[str, onnx.ModelProto]:
    """The reference documents' graphs: model gradient, loss, penalty, update.

    ``signature`` is completed with the update graph's names.
    """
    if loss is None:
        raise UnsupportedOptionError(
            "fuse='separate' builds its own loss graph: pass a score name as loss=.")
    prediction = roles["prediction"]
    weights = list(initial)
    model_gradient = gradient_of(predict, wrt=weights, outputs=[prediction],
                                            backend=backend)
    value = next(o for o in predict.graph.output if o.name == prediction)
    names = NameAuthority({prediction, roles["label"], roles.get("weight", "")})
    copy_name = names.fresh(f"{prediction}_copy")
    identity = helper.make_model(
        helper.make_graph([helper.make_node("Identity", [prediction], [copy_name])], "loss",
                          [value], [helper.make_value_info(copy_name, value.type)]),
        opset_imports=[helper.make_opsetid("", 18)])
    loss_options = {k: v for k, v in options.items() if k not in ("output_index", "label_name")}
    loss_model = add_loss_output(identity, loss, label_name=roles["label"], **loss_options)
    loss_graph = gradient_of(loss_model, wrt=[prediction], loss=roles["loss"],
                                        backend=backend)
    graphs = {"gradient": model_gradient, "loss": loss_graph,
              "update": update_graph(optimizer, initial)}
    if penalty:
        graphs["penalty"] = penalty_graph(initial, penalty)
    signature.gradients = {w: f"{w}_grad" for w in weights}
    signature.states = {w: optimizer.state_names(w) for w in weights}
    signature.new = {n: f"{n}_new" for w in weights for n in [w, *signature.states[w]]}
    signature.prediction = prediction
    signature.prediction_grad = _gradient_names(loss_graph)[prediction]
    return graphs


def _manifest(graphs: Mapping[str, onnx.ModelProto], signature: Signature, optimizer, fuse: str,
              roles: Mapping[str, str]) -> dict[str, Any]:
    """The program's description: graphs with the role of every input and output."""
    role_of = {name: "feature" for name in signature.features}
    role_of.update({signature.label: "label", signature.loss: "loss",
                    signature.learning_rate: "learning_rate", signature.step: "step"})
    if signature.sample_weight:
        role_of[signature.sample_weight] = "sample_weight"
    role_of.update({w: "weight" for w in signature.weights})
    role_of.update({s: "state" for s in signature.state_names})
    role_of.update({signature.new[w]: "new_weight" for w in signature.weights})
    role_of.update({signature.new[s]: "new_state" for s in signature.state_names})
    role_of.update({g: "gradient" for g in signature.gradients.values()})
    role_of.update({f"{w}_penalty_grad": "penalty_gradient" for w in signature.weights})
    role_of["penalty"] = "penalty"
    for key, role in (("permutation", "permutation"), ("learning_rates", "learning_rates"),
                      ("losses", "losses"), ("prediction", "prediction"),
                      ("prediction_grad", "prediction_grad")):
        if getattr(signature, key):
            role_of[getattr(signature, key)] = role

    def describe(values) -> list[dict[str, Any]]:
        described = []
        for value in values:
            tensor = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tensor.shape.dim]
            described.append({"name": value.name, "role": role_of.get(value.name, "output"),
                              "dtype": helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
                              "shape": dims})
        return described

    return {
        "format": FORMAT,
        "fuse": fuse,
        "optimizer": optimizer.to_dict(),
        "roles": dict(roles),
        "weights": [{"name": w, "new": signature.new[w],
                     "states": [{"name": s, "new": signature.new[s]}
                                for s in signature.states.get(w, [])]}
                    for w in signature.weights],
        "graphs": {name: {"file": f"{name}.onnx", "inputs": describe(g.graph.input),
                          "outputs": describe(g.graph.output)}
                   for name, g in graphs.items()},
    }
