"""The inference model with trained weights written back and nothing of training left.

    to_inference_model(source, state=None)          -> onnx.ModelProto
    save_inference_model(source, path, state=None)  -> path ( + path.data for large models)

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
initializer), or an optimizer state of a program (skipped). Names, dtypes, shapes and
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

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import (
    DTypeMismatchError,
    InternalError,
    InvalidDataError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..fileio import check_file_target, save_model, write_file
from ..metadata import WRITTEN_BY_KEY, remove_record
from ..models import as_model
from ..passes.loss import RemoveLossOutput
from ..passes.lower_ml import LowerMlOps
from ..passes.strip import StripTraining
from ..program import TrainingProgram
from ..runtime.trainer import Trainer
from ..storage import TRAINER_FILE, read_checkpoint, read_program
from ..target import Target, active_target, use_target
from .artifacts import CHECKPOINT_FILE, EVAL_FILE
from .ort_checkpoint import read_ort_checkpoint

__all__ = ["to_inference_model", "save_inference_model", "Source", "EXTERNAL_MIN_BYTES",
           "PROTOBUF_LIMIT", "DATA_SUFFIX", "DATA_MAGIC"]

#: What the inference model and its weights can come from (see the module docstring).
Source = Trainer | TrainingProgram | onnx.ModelProto | bytes | str | os.PathLike

#: Initializers this large or larger go to the external data file (onnx's own default).
EXTERNAL_MIN_BYTES = 1024
#: The largest message protobuf serializes: a larger model needs external data.
PROTOBUF_LIMIT = 2**31 - 1
#: The data file of ``model.onnx`` is ``model.onnx.data``.
DATA_SUFFIX = ".data"
#: The first bytes of every data file lossgraph writes; the header fills one page.
DATA_MAGIC = b"lossgraph external data, format 1\n"
_PAGE = 4096
_ALIGN = 64
_PAGE_ALIGNED = 1 << 20  # tensors this large start on a page boundary (for mmap)


# -- the public functions ---------------------------------------------------------------------


def to_inference_model(source: Source, state: Mapping[str, Any] | None = None, *,
                       target: Target | str | None = None) -> onnx.ModelProto:
    """The inference model of ``source`` with its trained weights as initializers and
    nothing of training left (see the module docstring for ``source`` and ``state``).

    ``target``: the runtimes the model must load in (a name of
    :data:`lossgraph.target.TARGETS` or a Target); default, the active target. The
    result passes ``onnx.checker.check_model(full_check=True)``. A model over 2 GiB
    cannot be one ModelProto: save it with :func:`save_inference_model`.
    """
    exported = _export(source, state, target)
    size = exported.size()
    if size > PROTOBUF_LIMIT:
        raise UnsupportedModelError(
            f"The inference model takes about {size / 2**30:.1f} GiB, over protobuf's 2 GiB: "
            "it cannot be one onnx.ModelProto. Write it with external data: "
            "lossgraph.export.save_inference_model(source, 'model.onnx').")
    model, _ = exported.assemble()
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise InternalError(f"to_inference_model emitted an invalid model ({exc}). This is a "
                            "bug in lossgraph; please report it with the model.") from exc
    return model


def save_inference_model(source: Source, path: str | os.PathLike,
                         state: Mapping[str, Any] | None = None,
                         external_data: bool | None = None, *,
                         target: Target | str | None = None,
                         size_limit: int = PROTOBUF_LIMIT, overwrite: bool = False) -> Path:
    """Write :func:`to_inference_model`'s model to ``path``; returns its absolute path.

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
    exported = _export(source, state, target)
    size = exported.size()
    external = external_data if external_data is not None else size > min(size_limit,
                                                                             PROTOBUF_LIMIT)
    if not external and size > PROTOBUF_LIMIT:
        raise UnsupportedOptionError(
            f"external_data=False, but the inference model takes about {size / 2**30:.1f} GiB, "
            "over protobuf's 2 GiB: it needs external data (external_data=True or None).")
    if external:
        model, data = exported.assemble(data_path.name)
        write_file(data_path, data, _is_lossgraph_data, overwrite)  # checks the path again
    else:
        model, _ = exported.assemble()
    return save_model(model, model_path, overwrite=overwrite)


# -- sources ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """A model (read, never changed) and the weights to write into it, by name."""

    model: onnx.ModelProto
    weights: Mapping[str, np.ndarray] = field(default_factory=dict)
    skipped: frozenset[str] = frozenset()  # names a state may hold that are not weights


def _source(source: Source) -> _Source:
    """What ``source`` gives: its model and its own weights."""
    if isinstance(source, Trainer):
        return _of_program(source.program, source.state)
    if isinstance(source, TrainingProgram):
        return _of_program(source, source.state)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        folder = Path(source)
        if all((folder / name).is_file() for name in (EVAL_FILE, CHECKPOINT_FILE)):
            # onnxruntime training artifacts: the eval model, with the checkpoint's weights
            # (a folder lossgraph wrote, or one onnxruntime trained and saved over)
            evaluation = as_model(folder / EVAL_FILE)
            loss = evaluation.graph.output[0].name  # the artifacts' contract: loss first
            return _Source(RemoveLossOutput(loss)(evaluation).model,
                           dict(read_ort_checkpoint(folder / CHECKPOINT_FILE)))
        if (folder / TRAINER_FILE).exists() or (folder / TRAINER_FILE).is_symlink():
            parts, _ = read_checkpoint(folder)
        else:
            parts = read_program(folder)
        program = TrainingProgram(*parts)
        return _of_program(program, program.state)
    if isinstance(source, (onnx.ModelProto, bytes, bytearray, memoryview, str, os.PathLike)):
        return _Source(as_model(source))
    raise UnsupportedOptionError(
        f"Cannot export the inference model of a {type(source).__name__}: pass a Trainer, a "
        "TrainingProgram, the path of a program, checkpoint or onnxruntime training artifacts "
        "folder, or a model "
        "(ModelProto, bytes or .onnx path) with state= its weights by name.")


def _of_program(program: TrainingProgram, state: Mapping[str, np.ndarray]) -> _Source:
    """The program's inference model, with its weights and buffers from ``state``."""
    return _Source(program.inference_model,
                   {name: state[name] for name in (*program.weights, *program.buffers)},
                   frozenset(program.states))


def _merged(source: _Source, state: Mapping[str, Any] | None) -> dict[str, Any]:
    """The source's weights, overridden by ``state``'s (optimizer states skipped)."""
    weights = dict(source.weights)
    if state is None:
        return weights
    if not isinstance(state, Mapping):
        raise UnsupportedOptionError(
            f"state must be a dict of arrays by name (as Trainer.state gives), not a "
            f"{type(state).__name__}.")
    weights.update({name: value for name, value in state.items() if name not in source.skipped})
    return weights


# -- the export -------------------------------------------------------------------------------


@contextlib.contextmanager
def _targeting(target: Target | str | None) -> Iterator[Target]:
    """``use_target(target)``, or the active target when ``target`` is None."""
    if target is None:
        yield active_target()
    else:
        with use_target(target) as chosen:
            yield chosen


def _export(source: Source, state: Mapping[str, Any] | None,
            target: Target | str | None) -> _Exported:
    with _targeting(target):
        given = _source(source)
        weights = _merged(given, state)
        light, large = _lighten(given.model)
        keep_inputs = ({t.name for t in given.model.graph.initializer}
                       & {i.name for i in given.model.graph.input})
        light = LowerMlOps()(light).model  # as compile_program does; a no-op once lowered
        order = [t.name for t in given.model.graph.initializer]
        order += _write_weights(light, large, weights)
        remove_record(light, WRITTEN_BY_KEY)
        stripped = StripTraining()(light).model
    inputs = {i.name for i in stripped.graph.input}
    live = {name: large[name] for name in order if name in large and name in inputs}
    return _Exported(stripped, live, [n for n in order if n in live or n not in large],
                     frozenset(keep_inputs))


@dataclass
class _Large:
    """A large initializer, kept out of the model while the passes run."""

    data_type: int
    dims: list[int]
    value: onnx.TensorProto | np.ndarray

    def nbytes(self) -> int:
        if isinstance(self.value, np.ndarray):
            return int(self.value.nbytes)
        return self.value.ByteSize()

    def tensor(self, name: str) -> onnx.TensorProto:
        """The initializer with its data."""
        if isinstance(self.value, np.ndarray):
            return numpy_helper.from_array(self.value, name)
        return self.value

    def raw(self, name: str) -> bytes | memoryview:
        """The data as ONNX stores it (little-endian), without a copy where possible."""
        value = self.value
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            little = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
            return memoryview(little.reshape(-1)).cast("B")
        tensor = self.tensor(name)
        if tensor.HasField("raw_data"):
            return tensor.raw_data
        return numpy_helper.from_array(numpy_helper.to_array(tensor), name).raw_data


def _lighten(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, _Large]]:
    """A copy of ``model`` whose main-graph initializers of EXTERNAL_MIN_BYTES or more are
    graph inputs (string tensors stay), and those initializers by name, not copied."""
    light = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            _copy_field(light, descriptor, value)
    for descriptor, value in model.graph.ListFields():
        if descriptor.name != "initializer":
            _copy_field(light.graph, descriptor, value)
    declared = {i.name for i in model.graph.input}
    large: dict[str, _Large] = {}
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.STRING or tensor.ByteSize() < EXTERNAL_MIN_BYTES:
            light.graph.initializer.append(tensor)
            continue
        large[tensor.name] = _Large(tensor.data_type, list(tensor.dims), tensor)
        if tensor.name not in declared:
            light.graph.input.append(
                helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return light, large


def _copy_field(target: Any, descriptor: Any, value: Any) -> None:
    repeated = getattr(descriptor, "is_repeated", None)  # protobuf >= 5.28; ``label`` before
    if repeated is None:
        repeated = descriptor.label == descriptor.LABEL_REPEATED
    if repeated:
        getattr(target, descriptor.name).extend(value)
    elif descriptor.type == descriptor.TYPE_MESSAGE:
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)


def _write_weights(light: onnx.ModelProto, large: dict[str, _Large],
                   weights: Mapping[str, Any]) -> list[str]:
    """Write ``weights`` into ``light`` (small initializers) or ``large``, checked; a graph
    input named there becomes an initializer. Returns the names of those new large ones."""
    graph = light.graph
    small = {t.name: t for t in graph.initializer}
    inputs = {i.name: i for i in graph.input}
    materialized: list[str] = []
    for name, given in weights.items():
        if not isinstance(name, str) or not (name in large or name in small or name in inputs):
            candidates = [*small, *large, *(n for n in inputs if n not in large)]
            raise UnknownNameError(
                f"{name!r} is not an initializer or a graph input of the inference model, so "
                "no weight can be written there." + suggest(str(name), candidates, "names"))
        if name in large:
            large[name].value = _checked(name, given, large[name].data_type, large[name].dims)
        elif name in small:
            tensor = small[name]
            value = _checked(name, given, tensor.data_type, list(tensor.dims))
            tensor.CopyFrom(numpy_helper.from_array(value, name))
        else:
            data_type, dims = _input_type(inputs[name])
            value = _checked(name, given, data_type, dims)
            if value.nbytes >= EXTERNAL_MIN_BYTES:
                large[name] = _Large(data_type, list(value.shape), value)
                materialized.append(name)
            else:
                kept = [i for i in graph.input if i.name != name]
                del graph.input[:]
                graph.input.extend(kept)
                graph.initializer.append(numpy_helper.from_array(value, name))
    return materialized


def _input_type(value: onnx.ValueInfoProto) -> tuple[int, list[int | None]]:
    if not value.type.HasField("tensor_type"):
        raise UnsupportedModelError(f"Graph input {value.name!r} is not a tensor; a weight "
                                    "written there must be one.")
    tensor_type = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    return tensor_type.elem_type, dims


def _checked(name: str, given: Any, data_type: int, dims: list[int | None]) -> np.ndarray:
    """``given`` as an array of the model's dtype and shape, with finite values."""
    value = np.asarray(given)
    dtype = helper.tensor_dtype_to_np_dtype(data_type)
    if value.dtype != dtype:
        raise DTypeMismatchError(f"Weight {name!r} is {value.dtype}; the model holds it as "
                                 f"{dtype}. Convert it (value.astype({str(dtype)!r})).")
    if value.ndim != len(dims) or any(d is not None and d != n for d, n in zip(dims, value.shape)):
        shown = ["?" if d is None else d for d in dims]
        raise ShapeMismatchError(f"Weight {name!r} has shape {list(value.shape)}; the model "
                                 f"holds it with shape {shown}.")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise InvalidDataError(f"Weight {name!r} holds NaN or infinite values: the exported "
                               "model would predict them. Export weights from before training "
                               "diverged.")
    return value


@dataclass
class _Exported:
    """The stripped model with its large initializers still apart (as graph inputs)."""

    model: onnx.ModelProto
    large: dict[str, _Large]
    order: list[str]  # every initializer's name in the final order, large ones included
    keep_inputs: frozenset[str]  # large initializers the source listed as inputs too

    def size(self) -> int:
        """An upper bound on the serialized size of the whole model, in bytes."""
        return self.model.ByteSize() + sum(v.nbytes() + len(n) + 16 * len(v.dims) + 64
                                           for n, v in self.large.items())

    def assemble(self, location: str | None = None) -> tuple[onnx.ModelProto, bytearray]:
        """The model with its large initializers in place: in the model, or (``location``)
        in the data returned, which the model reads from the file ``location``."""
        model, graph = self.model, self.model.graph
        small = {t.name: t for t in graph.initializer}
        data = bytearray(_header()) if location is not None else bytearray()
        final = []
        for name in self.order:
            if name in self.large:
                final.append(self._large_tensor(name, location, data))
            elif name in small:
                final.append(small.pop(name))
        final.extend(small.values())  # made by the passes (e.g. a constant false flag)
        del graph.initializer[:]
        graph.initializer.extend(final)
        for tensor in graph.initializer:  # onnx.load marks tensors it read from a data file
            if tensor.HasField("data_location") and tensor.data_location == tensor.DEFAULT:
                tensor.ClearField("data_location")
        inputs = [i for i in graph.input if i.name not in self.large or i.name in self.keep_inputs]
        del graph.input[:]
        graph.input.extend(inputs)
        return model, data

    def _large_tensor(self, name: str, location: str | None,
                      data: bytearray) -> onnx.TensorProto:
        entry = self.large[name]
        if location is None:
            return entry.tensor(name)
        raw = entry.raw(name)
        align = _PAGE if len(raw) >= _PAGE_ALIGNED else _ALIGN
        data.extend(b"\0" * (-len(data) % align))
        offset = len(data)
        data.extend(raw)
        tensor = onnx.TensorProto(name=name, data_type=entry.data_type, dims=entry.dims,
                                  data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", location), ("offset", str(offset)),
                           ("length", str(len(raw)))):
            tensor.external_data.add(key=key, value=value)
        return tensor


def _header() -> bytes:
    return DATA_MAGIC + b"\0" * (_PAGE - len(DATA_MAGIC))


def _is_lossgraph_data(path: Path) -> bool:
    """True when ``path`` is a regular file that starts with lossgraph's data header."""
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as stream:
        return stream.read(len(DATA_MAGIC)) == DATA_MAGIC
