"""The inference model: a model with trained weights written back, nothing of training left.

    exported = export_model(model, weights, skipped=..., state=..., target=..., merge=False)
    exported.to_model()              -> onnx.ModelProto (checked, under 2 GiB)
    exported.assemble("m.onnx.data") -> the model reading its large weights from a data file

``weights`` (by name) are written into ``model``'s initializers, then ``state`` overrides
them (its names in ``skipped``, optimizer states, are left out). Each name is an
initializer of the model, or a graph input (it becomes an initializer); names, dtypes,
shapes and finiteness are checked. Then :class:`~lossgraph.passes.LowerMlOps` (a no-op once
lowered) and :class:`~lossgraph.passes.StripTraining` remove what only training needs,
under ``target``, else the active target (:func:`lossgraph.target.use_target`); a
program's model is exported for the target it was compiled for
(:func:`lossgraph.target.target_for`). ``merge=True`` then folds LoRA adapters into their
base weights (:func:`lossgraph.adapters.fold_adapters`), large ones included.

This is the one implementation behind ``TrainingProgram.to_inference_model``,
``Trainer.to_inference_model`` and :mod:`lossgraph.export.inference` (which reads the
weights from a trainer, a program, a folder or a model file, and writes external data).

Large models. Protobuf cannot hold a model over 2 GiB, so the passes never see the large
weights: every initializer of the main graph of :data:`EXTERNAL_MIN_BYTES` or more is a
graph input while they run, and goes back in place, in its order, when the model is
assembled, in the model or in one data file that starts with :data:`DATA_MAGIC`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .adapters import check_merge, fold_adapters
from .errors import (
    DTypeMismatchError,
    InternalError,
    InvalidDataError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from .metadata import WRITTEN_BY_KEY, remove_record
from .options import flag
from .passes.lower_ml import LowerMlOps
from .passes.strip import StripTraining
from .target import Target, active_target, use_target

__all__ = ["export_model", "Exported", "EXTERNAL_MIN_BYTES", "PROTOBUF_LIMIT", "DATA_MAGIC"]

#: Initializers this large or larger go to the external data file (onnx's own default).
EXTERNAL_MIN_BYTES = 1024
#: The largest message protobuf serializes: a larger model needs external data.
PROTOBUF_LIMIT = 2**31 - 1
#: The first bytes of every data file lossgraph writes; the header fills one page.
DATA_MAGIC = b"lossgraph external data, format 1\n"
_PAGE = 4096
_ALIGN = 64
_PAGE_ALIGNED = 1 << 20  # tensors this large start on a page boundary (for mmap)


def export_model(model: onnx.ModelProto, weights: Mapping[str, Any],
                 skipped: Collection[str] = (), state: Mapping[str, Any] | None = None,
                 target: Target | str | None = None, merge: bool = False) -> Exported:
    """``model`` (read, never changed) with ``weights``, then ``state``'s, written back
    and what only training needs removed (module docstring); ``merge=True`` folds its LoRA
    adapters into their base weights (:func:`~lossgraph.adapters.merge_adapters`)."""
    if flag("merge", merge):
        check_merge(model)
    weights = _merged(weights, skipped, state)
    with _targeting(target):
        light, large = _lighten(model)
        keep_inputs = ({t.name for t in model.graph.initializer}
                       & {i.name for i in model.graph.input})
        light = LowerMlOps()(light).model  # as compile_program does; a no-op once lowered
        order = [t.name for t in model.graph.initializer]
        order += _write_weights(light, large, weights)
        remove_record(light, WRITTEN_BY_KEY)
        stripped = StripTraining()(light).model
    if merge:
        _merge_adapters(stripped, large)
    inputs = {i.name for i in stripped.graph.input}
    live = {name: large[name] for name in order if name in large and name in inputs}
    return Exported(stripped, live, [n for n in order if n in live or n not in large],
                    frozenset(keep_inputs))


def _merge_adapters(model: onnx.ModelProto, large: dict[str, _Large]) -> None:
    """Fold ``model``'s adapters into their base weights, in place, those kept apart in
    ``large`` too (:func:`~lossgraph.adapters.fold_adapters`)."""
    small = {t.name: t for t in model.graph.initializer}
    folded = fold_adapters(model, lambda name: large[name].array() if name in large
                           else numpy_helper.to_array(small[name]))
    for name, value in folded.items():  # the bases kept apart
        large[name].value = value


def _merged(weights: Mapping[str, Any], skipped: Collection[str],
            state: Mapping[str, Any] | None) -> dict[str, Any]:
    """``weights`` overridden by ``state``'s (the names in ``skipped`` left out)."""
    merged = dict(weights)
    if state is None:
        return merged
    if not isinstance(state, Mapping):
        raise UnsupportedOptionError(
            f"state must be a dict of arrays by name (as Trainer.state gives), not a "
            f"{type(state).__name__}.")
    merged.update({name: value for name, value in state.items() if name not in skipped})
    return merged


@contextlib.contextmanager
def _targeting(target: Target | str | None) -> Iterator[Target]:
    """``use_target(target)``, or the active target when ``target`` is None."""
    if target is None:
        yield active_target()
    else:
        with use_target(target) as chosen:
            yield chosen


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

    def array(self) -> np.ndarray:
        """The value as an array."""
        if isinstance(self.value, np.ndarray):
            return self.value
        return numpy_helper.to_array(self.value)

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
class Exported:
    """The stripped model with its large initializers still apart (as graph inputs)."""

    model: onnx.ModelProto
    large: dict[str, _Large]
    order: list[str]  # every initializer's name in the final order, large ones included
    keep_inputs: frozenset[str]  # large initializers the source listed as inputs too

    def size(self) -> int:
        """An upper bound on the serialized size of the whole model, in bytes."""
        return self.model.ByteSize() + sum(v.nbytes() + len(n) + 16 * len(v.dims) + 64
                                           for n, v in self.large.items())

    def too_large(self) -> bool:
        """Whether the model is over protobuf's 2 GiB: it cannot be one ModelProto."""
        return self.size() > PROTOBUF_LIMIT

    def to_model(self) -> onnx.ModelProto:
        """The whole model in memory, checked (``onnx.checker``, full check); over
        protobuf's 2 GiB, an UnsupportedModelError naming the way out."""
        if self.too_large():
            raise UnsupportedModelError(
                f"The inference model takes about {self.size() / 2**30:.1f} GiB, over "
                "protobuf's 2 "
                "GiB: it cannot be one onnx.ModelProto. Write it with external data: "
                "lossgraph.export.save_inference_model(source, 'model.onnx').")
        model, _ = self.assemble()
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as exc:
            raise InternalError(f"to_inference_model emitted an invalid model ({exc}). This is "
                                "a bug in lossgraph; please report it with the model.") from exc
        return model

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


