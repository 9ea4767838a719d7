"""A program's initial state: the values training starts from and ``reset`` returns to.

Held as arrays, it is a copy of every weight beside the model the user compiled and the
trainer's own buffers: 418 MiB more for BERT-base. So where a model given as a
``ModelProto`` or a file holds :data:`READ_MIN_BYTES` of the state or more,
:class:`InitialState` keeps, for each large weight and buffer the program starts from as
the model holds it under the same name (64 KiB and more: those compile's
:class:`~lossgraph.graphs.HeldWeights` store copied from it), no array but where to read
it and the digest of its bytes, and reads the value again when asked for: from the
``ModelProto``, or from the file (its bytes where :func:`~lossgraph.graphs.spans.
initializer_spans` finds them, in the ``.onnx`` file or its external data, kept open so
that a file renamed, replaced or removed since reads as it was), so that a program
compiled from a file holds none of the model's large weights; a program loaded from its
folder reads its state archive so too (:meth:`InitialState.archived`). The digest is
checked on every read: a model changed after compile is a
:class:`~lossgraph.errors.ModelChangedError`, never a training run started from other
weights. Every other value (a compiled program's optimizer states, adapters, a weight
compile made, any value of a model given as bytes) is held as an array.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ModelChangedError
from .graphs.held import HeldWeights
from .graphs.spans import OpenedFile, OpenedFiles, Span, initializer_spans

__all__ = ["InitialState", "ArchivedArray", "READ_MIN_BYTES"]

#: The bytes of state a model must hold for the program to read them from it rather than
#: keep a copy (the size from which a trainer writes in place by default, too).
READ_MIN_BYTES = 64 * 2**20


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array)).cast("B")


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(_bytes(array)).digest()


@dataclass(frozen=True)
class _Read:
    """A value read when asked for, not held: its bytes must have ``digest``."""

    digest: bytes
    shape: tuple[int, ...]
    dtype: np.dtype

    def value(self, name: str) -> np.ndarray:
        """The value of ``name``, read-only, or a ModelChangedError saying what changed."""
        array, change = self._read(name)
        if array is not None:
            if array.shape == self.shape and array.dtype == self.dtype \
                    and _digest(array) == self.digest:
                array.flags.writeable = False
                return array
            change = f"is not the value {self._made}"
        raise ModelChangedError(self._changed(name, change))

    #: how the program came by the value (messages): it was compiled, or loaded
    _made = "compiled"

    def _read(self, name: str) -> tuple[np.ndarray | None, str]:
        """The value read (None: none), and why not."""
        raise NotImplementedError

    def _changed(self, name: str, change: str) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class _ModelRead(_Read):
    """A value read from ``model``'s initializer of its name (at ``position`` among the
    initializers, unless the model moved it)."""

    model: onnx.ModelProto
    position: int

    def _read(self, name: str) -> tuple[np.ndarray | None, str]:
        tensors = self.model.graph.initializer
        tensor = tensors[self.position] if self.position < len(tensors) else None
        if tensor is None or tensor.name != name:  # the model's initializers changed
            tensor = next((t for t in tensors if t.name == name), None)
        if tensor is None:
            return None, "is gone"
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            return None, ("has its data in an external file now (onnx.save(model, ..., "
                          "save_as_external_data=True) moves it out of the model object)")
        try:
            return numpy_helper.to_array(tensor), ""
        except ValueError:  # data of another size than its dims
            return None, "is not the value compiled"

    def _changed(self, name: str, change: str) -> str:
        return (f"The model this program was compiled from changed after compile: its "
                f"initializer {name!r} {change}. The program reads its initial state from "
                f"that model rather than keep a copy of its weights. Put the model back as "
                f"it was, or compile it again; to change a model after compiling it, compile "
                f"a copy of it (copy = onnx.ModelProto(); copy.CopyFrom(model)).")


@dataclass(frozen=True)
class _FileRead(_Read):
    """A value read from the bytes of ``span`` in a file kept open since the program was
    made (``file``: a file renamed, replaced or removed since reads as it was): the model
    file it was compiled from (or its external data), or the state archive of the program
    folder it was loaded from (``loaded``). Little-endian, as ONNX and lossgraph's
    archives store them."""

    span: Span
    file: OpenedFile
    #: the model file compiled (its external data may be ``file``), or the state file
    source: Path
    loaded: bool = False

    @property
    def _made(self) -> str:
        return "loaded" if self.loaded else "compiled"

    def _read(self, name: str) -> tuple[np.ndarray | None, str]:
        data = self.file.read(self.span)
        if data is None:
            return None, f"cannot be read from {str(self.span.path)!r} (cut short)"
        return np.frombuffer(data, self.dtype.newbyteorder("<")).reshape(self.shape), ""

    def _changed(self, name: str, change: str) -> str:
        if self.loaded:
            return (f"The state file {str(self.source)!r} this program was loaded from "
                    f"changed after it was loaded: its array {name!r} {change}. The program "
                    f"reads its initial state from that file rather than keep a copy of its "
                    f"weights. Put the file back as it was, or load the program again.")
        return (f"The model file {str(self.source)!r} this program was compiled from "
                f"changed after compile: its initializer {name!r} {change}. The program reads "
                f"its initial state from that file rather than keep a copy of its weights. "
                f"Put the file back as it was, or compile it again.")


@dataclass(frozen=True)
class ArchivedArray:
    """An array of a state archive as it lies in the file: where its bytes are, its dtype
    and shape, and the digest of its bytes."""

    span: Span
    dtype: np.dtype
    shape: tuple[int, ...]
    digest: bytes


def _file_reads(found: Mapping[str, np.ndarray], model: Path) -> dict[str, _FileRead]:
    """Reads of those of ``found`` the model file at ``model`` holds as compiled, byte for
    byte where :func:`initializer_spans` says, each file opened once, now."""
    files = OpenedFiles()
    reads = {}
    for name, span in initializer_spans(model).items():
        array = found.get(name)
        if array is None or span.length != array.nbytes:
            continue
        file = files.file(span)
        if file is None:
            continue
        data = file.read(span)
        if data is not None and memoryview(data) == _bytes(array):
            reads[name] = _FileRead(_digest(array), array.shape, array.dtype, span, file, model)
    return reads


class InitialState(MutableMapping[str, np.ndarray]):
    """The initial state by name (module docstring): held arrays, and values read from
    the model compiled when asked for (read-only arrays, read again on each access: take
    one once where it is used more than once). Setting a value holds it."""

    def __init__(self, values: Mapping[str, np.ndarray] | None = None) -> None:
        self._values: dict[str, np.ndarray | _Read] = (
            dict(values._values) if isinstance(values, InitialState) else dict(values or {}))

    @classmethod
    def reading(cls, values: Mapping[str, np.ndarray], model: onnx.ModelProto | Path,
                held: HeldWeights) -> InitialState:
        """``values`` of which ``model`` (a ``ModelProto`` or the path of its file) holds
        the large ones byte for byte under their names are read from it when asked for,
        where those come to :data:`READ_MIN_BYTES`. ``held``: compile's store, which
        copied ``model``'s large weights first: a value that is its array under the same
        name is the model's. A file's bytes are checked against the values compiled
        here, one at a time: a value the file does not hold as compiled stays held."""
        state = cls(values)
        found = {name: array for name, array in values.items()
                 if held.first_held(name) is array}
        if sum(array.nbytes for array in found.values()) < READ_MIN_BYTES:
            return state
        if isinstance(model, onnx.ModelProto):
            positions = {t.name: i for i, t in enumerate(model.graph.initializer)}
            reads = {name: _ModelRead(_digest(array), array.shape, array.dtype, model,
                                      positions[name]) for name, array in found.items()}
        else:
            reads = _file_reads(found, model)
        if sum(found[name].nbytes for name in reads) >= READ_MIN_BYTES:
            state._values.update(reads)
        return state

    @classmethod
    def archived(cls, values: Mapping[str, np.ndarray], archive: OpenedFile,
                 members: Mapping[str, ArchivedArray]) -> InitialState:
        """``values``, and the arrays ``members`` of the archive kept open as ``archive``
        (a program folder's state, its bytes checked as saved): read from it when asked
        for where they come to :data:`READ_MIN_BYTES`, else read now and held."""
        state = cls(values)
        reads = {name: _FileRead(m.digest, m.shape, m.dtype, m.span, archive, archive.path,
                                 loaded=True) for name, m in members.items()}
        if sum(m.span.length for m in members.values()) >= READ_MIN_BYTES:
            state._values.update(reads)
        else:  # writable arrays of their own, as np.load gives
            state._values.update((name, read.value(name).copy()) for name, read in reads.items())
        return state

    def __reduce__(self) -> tuple:
        """Pickled with every value held: another process has no model or file to read."""
        return InitialState, (dict(self),)

    @property
    def read(self) -> frozenset[str]:
        """The names whose values are read from the model compiled, not held."""
        return frozenset(n for n, v in self._values.items() if isinstance(v, _Read))

    def like(self, name: str) -> np.ndarray:
        """An array with ``name``'s shape and dtype, without reading its value (a held
        array itself, else a read-only broadcast of one zero): for sizes and allocation."""
        value = self._values[name]
        if isinstance(value, _Read):
            return np.broadcast_to(np.zeros((), value.dtype), value.shape)
        return value

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._values[name]
        return value.value(name) if isinstance(value, _Read) else value

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._values[name] = value

    def __delitem__(self, name: str) -> None:
        del self._values[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return (f"InitialState({len(self)} values, {len(self.read)} read from the model "
                f"compiled)")
