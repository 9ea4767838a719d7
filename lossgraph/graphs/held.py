"""A model's large weights held apart from its ``ModelProto`` while passes run.

Protobuf copies a message's data on every copy, and a pass works on a copy of its input
(the pass contract: it never mutates what it is given), so a pipeline of passes over
BERT-base copied its 440 MB of weights once per pass, and every model a pipeline kept
held them again. :meth:`HeldWeights.hold` gives the model without the data of its large
floating-point weights: each keeps its name, element type and dims, and points, as onnx's
external data does, to a location that names this store (``lossgraph-held:<store>/<key>``,
a file that never exists, so that onnx or onnxruntime reading it fails loudly rather than
reading nothing). The store holds each weight's bytes once, and the array a pass reads
(:func:`tensor_array`) is a view of them, never a copy. The models that leave the pipeline
get their data back (:func:`lossgraph.graphs.with_weight_data`), so what a pipeline emits
is byte for byte what it would emit on the whole model.
"""

from __future__ import annotations

import itertools
import math
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import numpy_helper

from ..errors import InternalError

__all__ = ["HeldWeights", "held_in", "held_tensors", "is_held", "tensor_array"]

#: Bytes per element of the floating-point types whose large tensors are set aside
#: (:func:`lossgraph.graphs.without_weight_data`) or held.
FLOAT_ITEM_SIZES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.DOUBLE: 8,
                    onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2}
#: The types a store holds, with their numpy types (bfloat16 has none in numpy itself).
_HELD_DTYPES = {onnx.TensorProto.FLOAT: np.dtype("<f4"), onnx.TensorProto.DOUBLE: np.dtype("<f8"),
                onnx.TensorProto.FLOAT16: np.dtype("<f2")}
#: Smaller tensors keep their data: they cost less to copy than to set aside, and passes
#: read small constants (a Reshape target, Resize scales), never a weight.
HOLD_MIN_BYTES = 1 << 16
_VALUE_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data",
                 "uint64_data")
_PREFIX = "lossgraph-held:"
#: The live stores by number: a light model names its store, which may be gone.
_STORES: weakref.WeakValueDictionary[int, HeldWeights] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


@dataclass
class _Weight:
    """One held weight: its bytes, its array (a view of them, made on first use), and
    whether its tensor set ``data_location`` (to put back exactly)."""

    data: bytes
    dtype: np.dtype
    dims: tuple[int, ...]
    located: bool
    array: np.ndarray | None = field(default=None, repr=False)


class HeldWeights:
    """The data of a model's large weights, held once while passes copy the light model
    (see the module docstring). Light models read their weights from here for as long as
    the store lives: one that outlives it is an InternalError wherever it is read."""

    def __init__(self, min_bytes: int = HOLD_MIN_BYTES) -> None:
        self.number = next(_NUMBERS)
        self.min_bytes = min_bytes
        self._weights: list[_Weight] = []
        #: each weight's key by name, so that a weight held again (the same name and
        #: bytes: a program's graphs read from files) is held once
        self._keys: dict[str, int] = {}
        #: the keys of the weights of each (dtype, dims, located), to find one by its bytes
        self._kinds: dict[tuple[np.dtype, tuple[int, ...], bool], list[int]] = {}
        _STORES[self.number] = self

    def hold(self, model: onnx.ModelProto, nested: bool = False) -> onnx.ModelProto:
        """A copy of ``model`` whose large float initializers of the main graph (not
        listed as inputs, data of exactly their size) point here; ``model`` itself when it
        has none (a model of IR version 3, which lists initializers as inputs, or a
        big-endian machine hold none). ``model`` is never changed. ``nested``: those of
        its nested graphs too (an epoch graph's Scan body), and a weight held here already
        under another name, the same bytes, is held once (a program's graphs read from
        files: the step graph's frozen weight and the Scan body's copy of it)."""
        graph = model.graph
        inputs = {value.name for value in graph.input}
        held = [tensor.raw_data if self._holdable(model, tensor, inputs) else None
                for tensor in graph.initializer]
        held = [data if data is not None and len(data) == _nbytes(tensor) else None
                for tensor, data in zip(graph.initializer, held)]
        inner = [tensor for sub in _nested_graphs(graph) for tensor in sub.initializer
                 if self._holdable(model, tensor, set())] if nested else []
        if all(data is None for data in held) and not inner:
            return model
        light = onnx.ModelProto()
        copy_fields(model, light, skip="graph")
        copy_fields(model.graph, light.graph, skip="initializer")
        for tensor, data in zip(graph.initializer, held):
            if data is None:
                light.graph.initializer.append(tensor)
                continue
            copy = light.graph.initializer.add()
            copy_fields(tensor, copy, skip="raw_data")
            self.mark(copy, self._key(tensor, data, nested))
        for tensor in (t for sub in _nested_graphs(light.graph) if inner
                       for t in sub.initializer if self._holdable(model, t, set())):
            data = tensor.raw_data
            if len(data) == _nbytes(tensor):
                tensor.ClearField("raw_data")
                self.mark(tensor, self._key(tensor, data, by_content=True))
        return light

    def take(self, model: onnx.ModelProto, tensor: onnx.TensorProto, data: bytes) -> None:
        """Give ``tensor``, an initializer of ``model``'s main graph parsed without its raw
        data (:func:`~lossgraph.graphs.spans.model_without_raw_data`), ``data``: held here
        where :meth:`hold` would hold it, the tensor pointing here, else set as its raw
        data; in place. A weight held is never copied into the tensor: protobuf would keep
        that copy until the whole model is freed."""
        tensor.raw_data = b""  # present, as in the file: the same checks as hold()'s
        if self._holdable(model, tensor, {value.name for value in model.graph.input}) \
                and len(data) == _nbytes(tensor):
            tensor.ClearField("raw_data")
            self.mark(tensor, self._key(tensor, data))
        else:
            tensor.raw_data = data

    def _holdable(self, model: onnx.ModelProto, tensor: onnx.TensorProto,
                  inputs: set[str]) -> bool:
        """Whether ``tensor``, an initializer of ``model``, is one to hold here."""
        return (model.ir_version >= 4 and sys.byteorder == "little"
                and tensor.name not in inputs and tensor.data_type in _HELD_DTYPES
                and well_formed_weight(tensor, self.min_bytes, measured=False))

    def _key(self, tensor: onnx.TensorProto, data: bytes, by_content: bool = False) -> int:
        """The key of ``tensor``'s weight (its ``data``), held now unless held already
        under its name (or, ``by_content``, under any name)."""
        kind = (_HELD_DTYPES[tensor.data_type], tuple(tensor.dims),
                tensor.HasField("data_location"))
        named = self._keys.get(tensor.name)
        known = self._kinds.get(kind, []) if by_content else []
        for key in ([named] if named is not None else []) + known:
            weight = self._weights[key]
            if (weight.dtype, weight.dims, weight.located) == kind and weight.data == data:
                return key
        self._weights.append(_Weight(data, *kind))
        key = len(self._weights) - 1
        self._keys.setdefault(tensor.name, key)
        self._kinds.setdefault(kind, []).append(key)
        return key

    def first_held(self, name: str) -> np.ndarray | None:
        """The array of the weight first held under ``name`` (the model given, in compile's
        store), or None."""
        key = self._keys.get(name)
        return None if key is None else self.array(key)

    def mark(self, tensor: onnx.TensorProto, key: int) -> None:
        """Point ``tensor``, without data, to weight ``key`` here, in place."""
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=f"{_PREFIX}{self.number}/{key}")

    def array(self, key: int) -> np.ndarray:
        """Weight ``key``'s values, read-only (as ``numpy_helper.to_array`` gives them),
        one array per weight."""
        weight = self._weights[key]
        if weight.array is None:
            weight.array = np.frombuffer(weight.data, weight.dtype).reshape(weight.dims)
        return weight.array

    def put_back(self, tensor: onnx.TensorProto, key: int) -> None:
        """Give ``tensor``, a light tensor of this store, its data back, in place."""
        self.unmark(tensor, key)
        tensor.raw_data = self._weights[key].data

    def unmark(self, tensor: onnx.TensorProto, key: int) -> None:
        """Make ``tensor``, a light tensor of this store, the tensor it was without its
        data (no pointer here), in place."""
        del tensor.external_data[:]
        tensor.ClearField("data_location")
        if self._weights[key].located:
            tensor.data_location = onnx.TensorProto.DEFAULT

    def __len__(self) -> int:
        return len(self._weights)


def held_in(tensor: onnx.TensorProto) -> tuple[HeldWeights, int] | None:
    """The store and key ``tensor`` points to, or None when it is not light; an
    InternalError when its store is gone."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL or len(tensor.external_data) != 1:
        return None
    entry = tensor.external_data[0]
    if entry.key != "location" or not entry.value.startswith(_PREFIX):
        return None
    number, _, key = entry.value[len(_PREFIX):].partition("/")
    store = _STORES.get(int(number)) if number.isdigit() else None
    if store is None or not key.isdigit() or int(key) >= len(store):
        raise InternalError(
            f"The tensor {tensor.name!r} points to {entry.value!r}, weights held apart by a "
            "store that is gone: a light model outlived its store. This is a bug in "
            "lossgraph; please report it.")
    return store, int(key)


def is_held(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is a light tensor (its data in a store)."""
    return held_in(tensor) is not None


def held_tensors(tensors: Iterator[onnx.TensorProto]
                 ) -> Iterator[tuple[onnx.TensorProto, HeldWeights, int]]:
    """The light ones of ``tensors``, each with its store and key."""
    for tensor in tensors:
        found = held_in(tensor)
        if found is not None:
            yield tensor, *found


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """``numpy_helper.to_array(tensor)``, a held weight's values read from its store."""
    found = held_in(tensor)
    return numpy_helper.to_array(tensor) if found is None else found[0].array(found[1])


def well_formed_weight(tensor: onnx.TensorProto, min_bytes: int, measured: bool = True) -> bool:
    """A floating-point tensor of ``min_bytes`` or more whose data onnx's checker accepts:
    raw data of exactly its size (not ``measured``: not checked, for a caller that reads
    the data anyway), no other value field, not external, named in text."""
    nbytes = _nbytes(tensor)
    return (nbytes >= max(min_bytes, 1) and all(d >= 0 for d in tensor.dims)
            and isinstance(tensor.name, str)
            and tensor.HasField("raw_data")
            and tensor.data_location != onnx.TensorProto.EXTERNAL
            and not any(len(getattr(tensor, name)) for name in _VALUE_FIELDS)
            and (not measured or len(tensor.raw_data) == nbytes))


def _nested_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graphs nested in ``graph``'s nodes' attributes, at any depth (queries.all_graphs
    without the import: queries reads held weights)."""
    found = []
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                found += [sub, *_nested_graphs(sub)]
    return found


def _nbytes(tensor: onnx.TensorProto) -> int:
    """The bytes a floating-point tensor's dims call for (0 for another type)."""
    return math.prod(tensor.dims) * FLOAT_ITEM_SIZES.get(tensor.data_type, 0)


def copy_fields(source: Any, target: Any, skip: str) -> None:
    """Copy every field set in protobuf message ``source`` into ``target`` but ``skip``,
    which is never read (``ListFields`` would hand out a copy of a tensor's data)."""
    for descriptor in source.DESCRIPTOR.fields:
        name = descriptor.name
        # protobuf 7 has is_repeated, older ones label
        repeated = descriptor.is_repeated if hasattr(descriptor, "is_repeated") \
            else descriptor.label == descriptor.LABEL_REPEATED
        if name == skip or (not repeated and not source.HasField(name)):
            continue
        value = getattr(source, name)
        if repeated:
            getattr(target, name).extend(value)
        elif isinstance(value, Message):
            getattr(target, name).CopyFrom(value)
        else:
            setattr(target, name, value)
