"""onnxruntime's on-device training checkpoint: a flatbuffer, written and read without it.

The ``checkpoint`` file of onnxruntime's training artifacts is one flatbuffer (file
identifier ``ODTC``, schema ``onnxruntime/core/flatbuffers/schema/ort_training_checkpoint.fbs``,
tensors as in ``ort.fbs``)::

    Checkpoint        version: int32 (2, as onnxruntime 1.19 writes), module_state,
                      optimizer_groups: [OptimizerGroup], property_bag
    ModuleState       requires_grad_params: [Tensor], frozen_params: [Tensor],
                      is_nominal_state: bool, has_external_data: bool
    OptimizerGroup    group_name ("group0"), step: int64 (updates done),
                      initial_learning_rate: float32,
                      optimizer_states: [ParameterOptimizerState]
    ParameterOptimizerState   param_name, momentums: [Tensor]  ("momentum0"[, "momentum1"])
    PropertyBag       ints: [{name, int64}], floats: [{name, float32}], strings: [{name, string}]
    Tensor            name, dims: [int64], data_type (ONNX's numbering), raw_data: [ubyte]
                      (little-endian)

lossgraph writes it with the ``flatbuffers`` package's ``Builder`` alone: no training
build, no torch, and the same bytes for the same arrays in every environment. The
reader checks what it reads (identifier, version, bounds, sizes) and turns anything
malformed into an :class:`~lossgraph.errors.InvalidProgramError`.
"""

from __future__ import annotations

import math
import numbers
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import flatbuffers
import numpy as np
from onnx import helper

from ..errors import InvalidProgramError, UnsupportedOptionError
from ..fileio import write_file

__all__ = ["FILE_IDENTIFIER", "CHECKPOINT_VERSION", "MOMENT_NAMES", "OptimizerGroup",
           "OrtCheckpoint", "check_properties", "checkpoint_bytes", "parse_ort_checkpoint",
           "write_ort_checkpoint", "read_ort_checkpoint"]

FILE_IDENTIFIER = b"ODTC"
#: The version onnxruntime-training 1.19 writes and reads.
CHECKPOINT_VERSION = 2
#: The names onnxruntime gives a parameter's optimizer states, in order.
MOMENT_NAMES = ("momentum0", "momentum1")
_READABLE_VERSIONS = (1, 2)
_RAW_DATA_ALIGNMENT = 16  # lets a reader map a tensor's bytes in place

Property = int | float | str


@dataclass
class OptimizerGroup:
    """One optimizer group: its update count, learning rate and per-parameter moments."""

    step: int = 0
    initial_learning_rate: float = 1e-3
    #: parameter name -> {moment name ("momentum0", "momentum1"): array}
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    name: str = "group0"


@dataclass(eq=False)
class OrtCheckpoint(Mapping[str, np.ndarray]):
    """What a checkpoint holds. As a mapping: every parameter (trainable, then frozen)."""

    trainable: dict[str, np.ndarray]
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_groups: list[OptimizerGroup] = field(default_factory=list)
    properties: dict[str, Property] = field(default_factory=dict)
    version: int = CHECKPOINT_VERSION

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter by name, trainable ones first."""
        return {**self.trainable, **self.frozen}

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.trainable:
            return self.trainable[name]
        return self.frozen[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parameters)

    def __len__(self) -> int:
        return len(self.trainable) + len(self.frozen)


# -- writing ---------------------------------------------------------------------------------


def _array(name: str, value: object) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "biuf" or array.dtype.itemsize > 8:
        raise UnsupportedOptionError(
            f"Checkpoint tensor {name!r} is {array.dtype}: an onnxruntime checkpoint holds "
            "numeric tensors (bool, integers, float16/32/64) only.")
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


class _Writer:
    """Builds the flatbuffer back to front, as ``flatbuffers.Builder`` requires."""

    def __init__(self) -> None:
        self.b = flatbuffers.Builder(1024)

    def offsets(self, items: Sequence[int]) -> int:
        """A vector of tables or strings already written."""
        self.b.StartVector(4, len(items), 4)
        for item in reversed(items):
            self.b.PrependUOffsetTRelative(item)
        return self.b.EndVector()

    def table(self, fields: Sequence[tuple[str, int, object, object]]) -> int:
        """A table from ``(kind, slot, value, default)``: kind "offset", "int32", "int64",
        "float32" or "bool"; a value equal to its default is left out, as flatc does."""
        b = self.b
        b.StartObject(max(slot for _, slot, _, _ in fields) + 1)
        for kind, slot, value, default in fields:
            if kind == "offset":
                if value is not None:
                    b.PrependUOffsetTRelativeSlot(slot, value, 0)
            elif kind == "int32":
                b.PrependInt32Slot(slot, value, default)
            elif kind == "int64":
                b.PrependInt64Slot(slot, value, default)
            elif kind == "float32":
                b.PrependFloat32Slot(slot, value, default)
            else:
                b.PrependBoolSlot(slot, value, default)
        return b.EndObject()

    def tensor(self, name: str, value: object) -> int:
        array = _array(name, value)
        b = self.b
        data = array.tobytes()
        b.StartVector(1, len(data), _RAW_DATA_ALIGNMENT)
        b.head = b.head - len(data)
        b.Bytes[b.head:b.head + len(data)] = data
        b.vectorNumElems = len(data)
        raw = b.EndVector()
        dims = b.CreateNumpyVector(np.asarray(array.shape, dtype="<i8").reshape(-1))
        text = b.CreateString(name)
        elem_type = helper.np_dtype_to_tensor_dtype(array.dtype.newbyteorder("="))
        return self.table([("offset", 0, text, None), ("offset", 2, dims, None),
                           ("int32", 3, elem_type, 0), ("offset", 4, raw, None)])

    def named(self, what: int, slot_name: str, value: Property) -> int:
        """An Int-, Float- or StringProperty (``what`` 0, 1, 2)."""
        if what == 2:
            stored = self.b.CreateString(value)
            fields = [("offset", 1, stored, None)]
        else:
            fields = [("int64" if what == 0 else "float32", 1, value, 0)]
        return self.table([("offset", 0, self.b.CreateString(slot_name), None), *fields])


def _property_kind(name: object, value: object) -> int:
    if not isinstance(name, str):
        raise UnsupportedOptionError(f"Checkpoint property names are strings, not {name!r}.")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, str)):
        raise UnsupportedOptionError(
            f"Checkpoint property {name!r} = {value!r}: an onnxruntime checkpoint stores "
            "int, float (as float32) and str properties only.")
    if isinstance(value, str):
        return 2
    if isinstance(value, numbers.Integral):
        if not -2**63 <= int(value) < 2**63:
            raise UnsupportedOptionError(
                f"Checkpoint property {name!r} = {value} does not fit an int64.")
        return 0
    return 1


def check_properties(properties: Mapping[str, object]) -> None:
    """Raise UnsupportedOptionError unless every property fits the checkpoint's bag."""
    if not isinstance(properties, Mapping):
        raise UnsupportedOptionError(
            f"properties must be a dict of names to int, float or str, not {properties!r}.")
    for name, value in properties.items():
        _property_kind(name, value)


def checkpoint_bytes(checkpoint: OrtCheckpoint) -> bytes:
    """The flatbuffer of ``checkpoint``: the same arrays give the same bytes."""
    names = list(checkpoint.trainable) + list(checkpoint.frozen)
    if len(set(names)) != len(names):
        both = sorted(set(checkpoint.trainable) & set(checkpoint.frozen))
        raise UnsupportedOptionError(f"Parameter {both[0]!r} is both trainable and frozen.")
    w = _Writer()
    groups = []
    for group in checkpoint.optimizer_groups:
        _check_count("step", group.step)
        if not math.isfinite(group.initial_learning_rate):
            raise UnsupportedOptionError(
                f"initial_learning_rate={group.initial_learning_rate!r} must be finite.")
        states = []
        for param, moments in group.states.items():
            if param not in checkpoint.trainable:
                raise UnsupportedOptionError(
                    f"Optimizer group {group.name!r} holds moments for {param!r}, which is not a "
                    "trainable parameter of the checkpoint.")
            tensors = [w.tensor(name, value) for name, value in moments.items()]
            states.append(w.table([("offset", 0, w.b.CreateString(param), None),
                                   ("offset", 1, w.offsets(tensors), None)]))
        states_vector = w.offsets(states)
        groups.append(w.table([("offset", 0, w.b.CreateString(group.name), None),
                               ("int64", 1, int(group.step), 0),
                               ("float32", 2, float(group.initial_learning_rate), 0.0),
                               ("offset", 3, states_vector, None)]))
    groups_vector = w.offsets(groups) if groups else None
    bag = None
    if checkpoint.properties:
        by_kind: list[list[int]] = [[], [], []]
        for name, value in checkpoint.properties.items():
            kind = _property_kind(name, value)
            by_kind[kind].append(w.named(kind, name, value))
        bag = w.table([("offset", slot, w.offsets(items) if items else None, None)
                       for slot, items in enumerate(by_kind)])
    trainable = [w.tensor(n, v) for n, v in checkpoint.trainable.items()]
    frozen = [w.tensor(n, v) for n, v in checkpoint.frozen.items()]
    module = w.table([("offset", 0, w.offsets(trainable), None),
                      ("offset", 1, w.offsets(frozen), None),
                      ("bool", 2, False, False), ("bool", 3, False, False)])
    root = w.table([("int32", 0, CHECKPOINT_VERSION, 0), ("offset", 1, module, None),
                    ("offset", 2, groups_vector, None), ("offset", 3, bag, None)])
    w.b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(w.b.Output())


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not \
            0 <= int(value) < 2**63:
        raise UnsupportedOptionError(f"{name}={value!r} must be an integer >= 0.")


def write_ort_checkpoint(path: str | os.PathLike, checkpoint: OrtCheckpoint,
                         overwrite: bool = False) -> Path:
    """Write ``checkpoint`` to the file ``path`` atomically; an existing file is replaced
    only with ``overwrite=True`` (a checkpoint file carries no mark of who wrote it)."""
    return write_file(path, checkpoint_bytes(checkpoint), owned=lambda _: False,
                      overwrite=overwrite)


# -- reading ---------------------------------------------------------------------------------


class _Malformed(Exception):
    """Raised inside the reader; becomes an InvalidProgramError naming the file."""


class _Table:
    """A flatbuffer table at ``pos`` of ``buf``, read with bounds checks."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        vtable = pos - self._get("<i", pos)
        self.vtable = vtable
        self.vsize = self._get("<H", vtable)
        if self.vsize < 4 or self.vsize % 2:
            raise _Malformed("a table's vtable is damaged")

    def _get(self, fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize(fmt) > len(self.buf):
            raise _Malformed("an offset points outside the file")
        return struct.unpack_from(fmt, self.buf, at)[0]

    def _field(self, slot: int) -> int:
        entry = 4 + 2 * slot
        return self._get("<H", self.vtable + entry) if entry < self.vsize else 0

    def scalar(self, slot: int, fmt: str, default: float | int) -> float | int:
        offset = self._field(slot)
        return self._get(fmt, self.pos + offset) if offset else default

    def _indirect(self, slot: int) -> int | None:
        offset = self._field(slot)
        if not offset:
            return None
        at = self.pos + offset
        return at + self._get("<I", at)

    def table(self, slot: int) -> _Table | None:
        at = self._indirect(slot)
        return None if at is None else _Table(self.buf, at)

    def _vector(self, slot: int, size: int) -> tuple[int, int] | None:
        at = self._indirect(slot)
        if at is None:
            return None
        length = self._get("<I", at)
        if at + 4 + length * size > len(self.buf):
            raise _Malformed("a vector runs past the end of the file")
        return at + 4, length

    def string(self, slot: int) -> str | None:
        found = self._vector(slot, 1)
        if found is None:
            return None
        start, length = found
        try:
            return self.buf[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed("a name is not UTF-8 text") from None

    def bytes(self, slot: int) -> bytes | None:
        found = self._vector(slot, 1)
        return None if found is None else self.buf[found[0]:found[0] + found[1]]

    def int64s(self, slot: int) -> list[int]:
        found = self._vector(slot, 8)
        if found is None:
            return []
        start, length = found
        return list(struct.unpack_from(f"<{length}q", self.buf, start))

    def tables(self, slot: int) -> list[_Table]:
        found = self._vector(slot, 4)
        if found is None:
            return []
        start, length = found
        return [_Table(self.buf, start + 4 * i + self._get("<I", start + 4 * i))
                for i in range(length)]


def _read_tensor(table: _Table) -> tuple[str, np.ndarray]:
    name = table.string(0)
    if not name:
        raise _Malformed("a tensor has no name")
    if table.scalar(6, "<q", -1) != -1:
        raise _Malformed(f"tensor {name!r} keeps its data in an external file, which "
                         "lossgraph does not read")
    elem_type = table.scalar(3, "<i", 0)
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        dtype = None
    if dtype is None or dtype.kind not in "biuf":
        raise _Malformed(f"tensor {name!r} has data type {elem_type}, which is not a numeric "
                         "type lossgraph reads")
    dims = table.int64s(2)
    if any(d < 0 for d in dims):
        raise _Malformed(f"tensor {name!r} has a negative dimension {dims}")
    raw = table.bytes(4) or b""
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise _Malformed(f"tensor {name!r} of shape {dims} and type {dtype} should hold "
                         f"{expected} bytes, but holds {len(raw)}")
    array = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(dims)
    return name, array


def _named_tensors(tables: list[_Table], what: str) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for table in tables:
        name, array = _read_tensor(table)
        if name in tensors:
            raise _Malformed(f"{what} {name!r} appears twice")
        tensors[name] = array
    return tensors


def _parse(data: bytes) -> OrtCheckpoint:
    if len(data) < 8 or data[4:8] != FILE_IDENTIFIER:
        raise _Malformed("it does not carry the file identifier 'ODTC' of an onnxruntime "
                         "training checkpoint")
    root = _Table(data, struct.unpack_from("<I", data, 0)[0])
    version = root.scalar(0, "<i", 0)
    if version not in _READABLE_VERSIONS:
        raise _Malformed(f"it has checkpoint version {version}; lossgraph reads versions "
                         f"{', '.join(map(str, _READABLE_VERSIONS))}")
    module = root.table(1)
    if module is None:
        raise _Malformed("it holds no module state (no parameters)")
    if module.scalar(2, "<B", 0):
        raise _Malformed("it is a nominal checkpoint (parameter names and shapes, no values)")
    if module.scalar(3, "<B", 0):
        raise _Malformed("its parameters are kept in an external data file, which lossgraph "
                         "does not read")
    trainable = _named_tensors(module.tables(0), "parameter")
    frozen = _named_tensors(module.tables(1), "parameter")
    if set(trainable) & set(frozen):
        raise _Malformed(f"parameter {sorted(set(trainable) & set(frozen))[0]!r} is both "
                         "trainable and frozen")
    groups = []
    for table in root.tables(2):
        states = {}
        for state in table.tables(3):
            param = state.string(0)
            if not param:
                raise _Malformed("an optimizer state names no parameter")
            states[param] = _named_tensors(state.tables(1), f"moment of {param!r}")
        groups.append(OptimizerGroup(step=int(table.scalar(1, "<q", 0)),
                                     initial_learning_rate=float(table.scalar(2, "<f", 0.0)),
                                     states=states, name=table.string(0) or ""))
    properties: dict[str, Property] = {}
    bag = root.table(3)
    if bag is not None:
        for slot, fmt in ((0, "<q"), (1, "<f"), (2, None)):
            for item in bag.tables(slot):
                name = item.string(0)
                if name is None:
                    raise _Malformed("a property has no name")
                value = item.string(1) if fmt is None else item.scalar(1, fmt, 0)
                properties[name] = "" if value is None else value
    return OrtCheckpoint(trainable, frozen, groups, properties, version)


def parse_ort_checkpoint(data: bytes, where: str = "The checkpoint") -> OrtCheckpoint:
    """The checkpoint held in ``data``; malformed bytes are an InvalidProgramError."""
    try:
        return _parse(bytes(data))
    except _Malformed as exc:
        raise InvalidProgramError(f"{where} is not a checkpoint lossgraph can read: {exc}."
                                  ) from None
    except (struct.error, IndexError, ValueError, OverflowError, MemoryError) as exc:
        raise InvalidProgramError(f"{where} is damaged (truncated or corrupt: {exc}).") from None


def read_ort_checkpoint(path: str | os.PathLike) -> OrtCheckpoint:
    """Read an onnxruntime training checkpoint file (lossgraph's or onnxruntime's own).

    The result maps every parameter name to its array, and has ``trainable``,
    ``frozen``, ``optimizer_groups`` (step, learning rate, moments) and ``properties``.
    """
    source = Path(path)
    if source.is_dir():
        raise InvalidProgramError(
            f"{str(source)!r} is a folder; an onnxruntime checkpoint is a file (in an artifacts "
            "folder, its 'checkpoint' file).")
    if not source.is_file():
        raise InvalidProgramError(f"There is no checkpoint file at {str(source)!r}.")
    return parse_ort_checkpoint(source.read_bytes(), f"{str(source)!r}")
