"""The inference model with trained weights written back and nothing of training left.

    to_inference_model(source, state=None, ema=False, merge=False)  -> onnx.ModelProto
    save_inference_model(source, path, state=None, ema=False, merge=False)
                                                  -> path (+ path.data if large)

``source`` is where the model and its weights come from:

- a :class:`~lossgraph.Trainer`: its program's inference model and the trainer's live
  weights and buffers (the running statistics of a training-mode BatchNormalization);
- a :class:`~lossgraph.TrainingProgram`: its inference model and its ``state``'s weights
  and buffers;
- a program folder (``TrainingProgram.save``) or a checkpoint folder
  (``Trainer.save_checkpoint``), read and checked by :mod:`lossgraph.storage`;
- a model (``ModelProto``, bytes or an ``.onnx`` path): an inference model or one that
  carries its loss (:func:`~lossgraph.add_loss_output`), lowered as ``compile_program``
  lowers it (:class:`~lossgraph.passes.LowerMlOps`), with its own initializers as weights.

``state`` (a mapping of arrays by name: ``Trainer.state``, a checkpoint's parameters)
overrides the source's weights: each name is an initializer of the inference model, or a
graph input of a model source that takes its weights as inputs (it becomes an
initializer), or an optimizer state of a program (skipped). ``ema=True`` writes each
weight's average instead (a trainer, program or folder compiled with ``ema_decay``,
:meth:`~lossgraph.TrainingProgram.model_state`). Names, dtypes, shapes and
finiteness are checked. A new source kind (e.g. on-device training artifacts) is one
more case of :func:`_source`: a model plus its weights by name.

Then :class:`~lossgraph.passes.StripTraining` removes what only training needs (loss,
label and sample-weight inputs, the roles record; BatchNormalization and Dropout in
inference mode), under the active target (or ``target=``, as ``compile_program`` takes
it) for the IR version and opsets. The model in memory carries no file mark; what
:func:`save_inference_model` writes does (:mod:`lossgraph.fileio`), so lossgraph knows its
own files again.

Large models. Protobuf cannot hold a model over 2 GiB (the Python runtime refuses to
build one), so the passes never see the large weights: every initializer of the main
graph of :data:`EXTERNAL_MIN_BYTES` or more is a graph input while they run, and goes
back in place, in its order, afterwards. :func:`save_inference_model` writes those
tensors to one data file ``<name>.data`` beside the model (locations relative to it)
when asked (``external_data=True``) or when the model would be larger than
``size_limit`` (2 GiB by default); the model never exists whole in memory then. The data
file starts with a header that marks it as lossgraph's: an existing data file without it
is never replaced. Each file is written atomically; the data file goes first, so the
model file read with it never points past its end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..adapters import check_merge
from ..errors import UnsupportedOptionError
from ..fileio import check_file_target, save_model, write_file
from ..inference import DATA_MAGIC, EXTERNAL_MIN_BYTES, PROTOBUF_LIMIT, Exported, export_model
from ..models import as_model
from ..options import flag
from ..passes.loss import RemoveLossOutput
from ..program import TrainingProgram
from ..runtime.trainer import Trainer
from ..storage import read_saved
from ..target import Target, target_for
from .artifacts import CHECKPOINT_FILE, EVAL_FILE
from .ort_checkpoint import read_ort_checkpoint

__all__ = ["to_inference_model", "save_inference_model", "check_merge_of", "Source",
           "EXTERNAL_MIN_BYTES", "PROTOBUF_LIMIT", "DATA_SUFFIX", "DATA_MAGIC"]

#: What the inference model and its weights can come from (see the module docstring).
Source = Trainer | TrainingProgram | onnx.ModelProto | bytes | str | os.PathLike

#: The data file of ``model.onnx`` is ``model.onnx.data``.
DATA_SUFFIX = ".data"


# -- the public functions ---------------------------------------------------------------------


def to_inference_model(source: Source, state: Mapping[str, Any] | None = None, *,
                       target: Target | str | None = None, ema: bool = False,
                       merge: bool = False) -> onnx.ModelProto:
    """The inference model of ``source`` with its trained weights as initializers and
    nothing of training left (see the module docstring for ``source`` and ``state``).

    ``target``: the runtimes the model must load in (a name of
    :data:`lossgraph.target.TARGETS` or a Target); default, the active target, else the
    most widely loadable one that loads the model. The result passes
    ``onnx.checker.check_model(full_check=True)``. A model over 2 GiB cannot be one
    ModelProto: save it with :func:`save_inference_model`. ``merge=True`` folds LoRA
    adapters into their base weights (:func:`~lossgraph.adapters.merge_adapters`).
    """
    return _export(source, state, target, ema, merge).to_model()


def save_inference_model(source: Source, path: str | os.PathLike,
                         state: Mapping[str, Any] | None = None,
                         external_data: bool | None = None, *,
                         target: Target | str | None = None,
                         size_limit: int = PROTOBUF_LIMIT, overwrite: bool = False,
                         ema: bool = False, merge: bool = False) -> Path:
    """Write :func:`to_inference_model`'s model to ``path``; returns its absolute path.
    ``merge=True`` folds LoRA adapters into their base weights, as there; by default
    (the form every model has) the adapters' branches stay.

    ``external_data``: ``True`` writes the initializers of :data:`EXTERNAL_MIN_BYTES` or
    more to ``<path>.data`` (one file, located relative to the model), ``False`` keeps
    every tensor in the model file, ``None`` (default) writes external data when the
    model would be larger than ``size_limit`` bytes (protobuf's 2 GiB limit). Existing
    files are replaced only when lossgraph wrote them (or with ``overwrite=True``);
    both paths are checked before anything is written (:mod:`lossgraph.fileio`).
    """
    if external_data is not None and not isinstance(external_data, bool):
        raise UnsupportedOptionError(
            f"external_data={external_data!r} must be True, False or None (automatic: external "
            "data when the model would exceed size_limit).")
    if isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit < 0:
        raise UnsupportedOptionError(f"size_limit={size_limit!r} must be a number of bytes "
                                     "(an int >= 0).")
    if not isinstance(overwrite, bool):
        raise UnsupportedOptionError(f"overwrite={overwrite!r} must be True or False.")
    model_path = check_file_target(path, overwrite=overwrite)
    data_path = model_path.with_name(model_path.name + DATA_SUFFIX)
    if external_data:
        check_file_target(data_path, _is_lossgraph_data, overwrite)
    exported = _export(source, state, target, ema, merge)
    external = (external_data if external_data is not None else
                exported.too_large() or exported.size() > size_limit)
    if not external and exported.too_large():
        raise UnsupportedOptionError(
            f"external_data=False, but the inference model takes about "
            f"{exported.size() / 2**30:.1f} GiB, over protobuf's 2 GiB: it needs external data "
            "(external_data=True or None).")
    if external:
        model, data = exported.assemble(data_path.name)
        write_file(data_path, data, _is_lossgraph_data, overwrite)  # checks the path again
    else:
        model, _ = exported.assemble()
    return save_model(model, model_path, overwrite=overwrite)


def check_merge_of(source: Source) -> None:
    """Refuse ``merge=True`` on a source whose adapters cannot be merged
    (:func:`~lossgraph.adapters.check_merge`), before any work: for a caller that writes
    other files first (``lossgraph export --adapters ... -o ... --merge``)."""
    program = source.program if isinstance(source, Trainer) else source
    if isinstance(program, TrainingProgram):  # its structure alone, no weight copied
        program.check_merge()
    else:
        check_merge(_source(source).model)


# -- sources ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A model (read, never changed) and the weights to write into it, by name."""

    model: onnx.ModelProto
    weights: Mapping[str, np.ndarray] = field(default_factory=dict)
    skipped: frozenset[str] = frozenset()  # names a state may hold that are not weights
    target: Target | None = None  # a program's: the target it was compiled for


def _source(source: Source, ema: bool = False) -> _Source:
    """What ``source`` gives: its model and its own weights (their averages with ``ema``)."""
    if isinstance(source, Trainer):
        return _of_program(source.program, source.state, ema)
    if isinstance(source, TrainingProgram):
        return _of_program(source, source.state, ema)
    if flag("ema", ema) and not (isinstance(source, (str, os.PathLike))
                                 and Path(source).is_dir()):
        raise UnsupportedOptionError(
            "ema=True exports the weights' averages a program keeps (compile_program("
            "ema_decay=...)): pass a Trainer, a TrainingProgram or a program or checkpoint "
            "folder, not a model.")
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        folder = Path(source)
        if all((folder / name).is_file() for name in (EVAL_FILE, CHECKPOINT_FILE)):
            # onnxruntime training artifacts: the eval model, with the checkpoint's weights
            # (a folder lossgraph wrote, or one onnxruntime trained and saved over)
            if ema:
                raise UnsupportedOptionError(
                    "ema=True: onnxruntime training artifacts keep no average of the weights "
                    "(to_ort_artifacts refuses ema_decay); export without ema.")
            evaluation = as_model(folder / EVAL_FILE)
            loss = evaluation.graph.output[0].name  # the artifacts' contract: loss first
            return _Source(RemoveLossOutput(loss)(evaluation).model,
                           dict(read_ort_checkpoint(folder / CHECKPOINT_FILE)))
        program = TrainingProgram(*read_saved(folder))
        return _of_program(program, program.state, ema)
    if isinstance(source, (onnx.ModelProto, bytes, bytearray, memoryview, str, os.PathLike)):
        return _Source(as_model(source))
    raise UnsupportedOptionError(
        f"Cannot export the inference model of a {type(source).__name__}: pass a Trainer, a "
        "TrainingProgram, the path of a program, checkpoint or onnxruntime training artifacts "
        "folder, or a model "
        "(ModelProto, bytes or .onnx path) with state= its weights by name.")


def _of_program(program: TrainingProgram, state: Mapping[str, np.ndarray],
                ema: bool = False) -> _Source:
    """The program's inference model, with its weights (or their averages) and buffers from
    ``state``."""
    model = program.inference_model
    return _Source(model, program.model_state(state, ema=ema),
                   frozenset(program.optimizer_states), target_for(model))


def _export(source: Source, state: Mapping[str, Any] | None,
            target: Target | str | None, ema: bool = False, merge: bool = False) -> Exported:
    if flag("ema", ema) and state is not None:
        raise UnsupportedOptionError(
            "ema=True writes the averages the source's own state holds; state= would override "
            "them: pass one or the other (a state holding the averages: "
            "TrainingProgram.model_state(state, ema=True)).")
    given = _source(source, ema)
    return export_model(given.model, given.weights, given.skipped, state,
                        target if target is not None else given.target, merge)


def _is_lossgraph_data(path: Path) -> bool:
    """True when ``path`` is a regular file that starts with lossgraph's data header."""
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as stream:
        return stream.read(len(DATA_MAGIC)) == DATA_MAGIC
