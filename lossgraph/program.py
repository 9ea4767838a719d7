"""TrainingProgram: the training graphs of a model, their manifest and initial state.

Whatever the fusion mode (:mod:`lossgraph.compiler` builds them), a program holds

- ``evaluate``: (features, label[, sample_weight], weights, buffers) -> (loss, predictions...)
- ``predict``: (features, weights, buffers) -> (the inference model's outputs)

(both with every BatchNormalization and Dropout in inference mode) and, by mode,

- ``fuse="step"``: ``train_step`` (one minibatch step, update included);
- ``fuse="epoch"``: ``train_epoch`` (a Scan over all full batches) and ``train_step``
  (for a last, smaller batch);
- ``fuse="separate"``: onnxcustom's four graphs: ``gradient`` (the
  model's vector-Jacobian product), ``loss`` (loss and its gradient against the
  prediction), ``penalty`` (the penalty and the total gradient) and ``update``.

The manifest (JSON) names every graph's inputs and outputs with their roles, so a
runner in any language can drive the graphs; see docs/reference/program.md.

The state holds the weights, the optimizer's states and the **buffers**: the running
mean and variance of each training-mode BatchNormalization, which the training graphs
read and write every step as torch updates them (:mod:`lossgraph.passes.running_stats`),
without gradients and untouched by the optimizer. The inference export writes the
weights and the buffers back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .adapters import Adapter, check_merge
from .deprecation import warn_renamed
from .errors import ShapeMismatchError, UnknownNameError, UnsupportedOptionError, suggest
from .fileio import check_file_target, ensure_folder, save_model, serialize
from .graphs import HeldWeights, held_apart, put_back, stored_tensors, with_weight_data
from .graphs.held import held_tensors
from .inference import export_model
from .initial_state import InitialState
from .optim import Optimizer, optimizer_from_dict
from .options import flag
from .storage import read_program, save_program
from .target import target_for
from .update_options import UpdateOptions

__all__ = ["TrainingProgram", "with_weights"]


class _WholeGraphs(Mapping[str, onnx.ModelProto]):
    """A program's graphs by name, each a whole copy of its light graph made when read."""

    def __init__(self, light: Mapping[str, onnx.ModelProto]) -> None:
        self._light = light

    def __getitem__(self, name: str) -> onnx.ModelProto:
        return with_weight_data(self._light[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._light)

    def __len__(self) -> int:
        return len(self._light)


@dataclass(init=False)
class TrainingProgram:
    """A compiled model: graphs by name, a JSON manifest, initial state, inference model.

    Each weight is held once. The trained ones are in ``state``: the inference model is
    kept without the data of the initializers ``state`` holds to the byte, and
    :attr:`inference_model` puts it back when asked for (a BERT-base model's 418 MiB are
    not held twice). A large model compiled from a ``ModelProto`` or a file is not copied
    even once: ``state`` reads its weights from it when asked for, checking they did not
    change
    (:class:`~lossgraph.initial_state.InitialState`). The large frozen ones (initializers
    of the graphs: a LoRA program's base weights, a weight ``compile_program(weights=
    [...])`` leaves out) are in one store
    (:class:`~lossgraph.graphs.HeldWeights`, :attr:`frozen`) that every graph and the
    inference model point to: :attr:`light_graphs` are the graphs without their data,
    which the engine's sessions read from the store, and :attr:`graphs` puts it back on
    each access.
    """

    #: the graphs without the data of their large frozen initializers (:attr:`frozen`)
    light_graphs: dict[str, onnx.ModelProto]
    manifest: dict[str, Any]
    #: the initial state: weights, optimizer states and buffers by name (its large weights
    #: read from the model compiled when asked for, where they are: :class:`InitialState`)
    state: InitialState
    #: what compile decided about the model (:class:`lossgraph.compiler.CompileNotes`: the
    #: opset, ZipMaps, the output and loss trained); None for a program loaded from a folder
    notes: Any = field(default=None, compare=False, repr=False)
    #: the inference model without the data of the initializers in ``state`` (and of the
    #: frozen weights), the names of the former
    _inference: tuple[onnx.ModelProto, frozenset[str]] = field(default=None, repr=False)
    #: the stores the light models point to, kept alive with the program
    _stores: tuple[HeldWeights, ...] = field(default=(), compare=False, repr=False)

    def __init__(self, graphs: Mapping[str, onnx.ModelProto], manifest: dict[str, Any],
                 state: Mapping[str, np.ndarray], inference_model: onnx.ModelProto,
                 notes: Any = None) -> None:
        """``graphs`` and ``inference_model``: whole models, or light ones (compile's,
        another program's :attr:`light_graphs`); a frozen weight several of them hold
        whole (a program read from files) is held once."""
        self.manifest, self.notes = manifest, notes
        store = HeldWeights()
        self.light_graphs = {name: store.hold(graph, nested=True)
                             for name, graph in graphs.items()}
        light, apart = held_apart(inference_model, state)
        self.state = InitialState(state)
        self._inference = (store.hold(light, nested=True), apart)
        models = (*self.light_graphs.values(), self._inference[0])
        self._stores = tuple({id(found): found for model in models for _, found, _ in
                              held_tensors(stored_tensors(model))}.values())

    @property
    def graphs(self) -> Mapping[str, onnx.ModelProto]:
        """The graphs by name, each a whole model (its frozen weights' data put back) made
        on access: read :attr:`light_graphs` where the structure is enough."""
        return _WholeGraphs(self.light_graphs)

    @property
    def frozen(self) -> dict[str, np.ndarray]:
        """The large frozen initializers of the graphs by name, read-only arrays of the
        one store every graph, the inference model and the engine's sessions read."""
        return {tensor.name: found.array(key) for model in self.light_graphs.values()
                for tensor, found, key in held_tensors(stored_tensors(model))}

    @property
    def inference_model(self) -> onnx.ModelProto:
        """The model given, before training: a new copy, its weights' data from ``state``."""
        model, apart = self._inference
        return put_back(model, self.state, apart)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as whole models: a store lives in one process."""
        return {"graphs": dict(self.graphs), "manifest": self.manifest,
                "state": dict(self.state),
                "inference_model": self.inference_model, "notes": self.notes}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(**saved)

    # -- what the manifest says -------------------------------------------------------
    @property
    def fuse(self) -> str:
        return self.manifest["fuse"]

    @property
    def weights(self) -> list[str]:
        return [w["name"] for w in self.manifest["weights"]]

    @property
    def optimizer_states(self) -> list[str]:
        """The optimizer's state tensors (a velocity, Adam's moments; with ``ema_decay``, each
        weight's average after them: :attr:`ema_states`), weight by weight; ``state`` holds
        every live tensor: these, the weights and the buffers."""
        return [s["name"] for w in self.manifest["weights"] for s in w["states"]]

    @property
    def states(self) -> list[str]:
        """The previous release's name of :attr:`optimizer_states` (with a warning)."""
        warn_renamed("TrainingProgram.states", "TrainingProgram.optimizer_states")
        return self.optimizer_states

    @property
    def buffers(self) -> list[str]:
        """The running statistics the training graphs update (none in most programs)."""
        return [b["name"] for b in self.manifest.get("buffers", [])]

    @property
    def optimizer(self) -> Optimizer:
        return optimizer_from_dict(self.manifest["optimizer"])

    @property
    def update_options(self) -> UpdateOptions:
        """The gradient clipping and EMA of the weights around the optimizer's update."""
        return UpdateOptions.from_dict(self.manifest.get("update"))

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        """The LoRA adapters the program trains (:mod:`lossgraph.adapters`); empty without."""
        return tuple(Adapter.from_record(r, "The manifest's adapters")
                     for r in self.manifest.get("adapters", ()))

    @property
    def ema_states(self) -> dict[str, str]:
        """Each weight's EMA state (``compile_program(ema_decay=...)``; else empty)."""
        return dict(self.manifest.get("ema", {}))

    def state_updates(self, graph: str) -> dict[str, str]:
        """The state tensors ``graph`` reads (weights, optimizer states, buffers) and
        writes the next value of: input name -> output name."""
        manifest = self.manifest
        new = {w["name"]: w["new"] for w in manifest["weights"]}
        new.update((s["name"], s["new"]) for w in manifest["weights"] for s in w["states"])
        new.update((b["name"], b["new"]) for b in manifest.get("buffers", []))
        entry = manifest["graphs"][graph]
        produced = {v["name"] for v in entry["outputs"]}
        return {v["name"]: new[v["name"]] for v in entry["inputs"]
                if v["role"] in ("weight", "state", "buffer") and new[v["name"]] in produced}

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
    def to_inference_model(self, state: Mapping[str, np.ndarray] | None = None, *,
                           ema: bool = False, merge: bool = False) -> onnx.ModelProto:
        """The inference model with the program's weights and buffers, overridden by
        ``state``'s (a weight it lacks keeps the program's value; its optimizer states
        are ignored), written back: :func:`lossgraph.export.to_inference_model`. With
        ``ema=True``, each weight's average instead (:meth:`model_state`). With
        ``merge=True``, each LoRA adapter is folded into its base weight, the branch gone
        (:func:`~lossgraph.adapters.merge_adapters`: the original graph); by default the
        adapters' branches stay."""
        if flag("ema", ema) and (state is None or isinstance(state, Mapping)):
            state = self.model_state({**self.state, **(state or {})}, ema=True)
        model = self.inference_model
        return export_model(model, self.model_state(), self.optimizer_states, state,
                            target_for(model), merge).to_model()

    def check_merge(self) -> None:
        """Refuse, before any work, a program whose adapters ``to_inference_model(merge=True)``
        cannot fold (:func:`~lossgraph.adapters.check_merge`): read from the inference
        model's structure, no weight copied."""
        check_merge(self._inference[0])

    def model_state(self, state: Mapping[str, np.ndarray] | None = None, *,
                    ema: bool = False) -> dict[str, np.ndarray]:
        """The weights and buffers of ``state`` (default: the program's), by name: what
        the inference model holds. With ``ema=True`` each weight is its EMA state's value
        (a program compiled with ``ema_decay``; else an UnsupportedOptionError); the
        buffers are the live ones (they are not averaged)."""
        state = self.state if state is None else state
        averages = self.ema_states if flag("ema", ema) else {}
        if ema and not averages:
            raise UnsupportedOptionError(
                "ema=True reads each weight's average, but the program keeps none: compile "
                "with ema_decay=... (e.g. 0.999) to keep one.")
        return {name: state[averages.get(name, name)] for name in (*self.weights,
                                                                   *self.buffers)}


def with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``weights`` hold those values (each
    keeps its name, dtype and shape)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    by_name = {t.name: t for t in copy.graph.initializer}
    for name, value in weights.items():
        if name not in by_name:
            raise UnknownNameError(f"{name!r} is not an initializer of the model."
                                   + suggest(name, list(by_name), "initializers"))
        old = by_name[name]
        value = np.asarray(value)
        if tuple(old.dims) != value.shape or old.data_type != helper.np_dtype_to_tensor_dtype(
                value.dtype):
            raise ShapeMismatchError(
                f"Weight {name!r} is {value.dtype}{list(value.shape)}; the model's initializer "
                f"is {helper.tensor_dtype_to_np_dtype(old.data_type)}{list(old.dims)}.")
        old.CopyFrom(numpy_helper.from_array(value, name))
    return copy
