"""A program's initial state: the values training starts from and ``reset`` returns to.

Held as arrays, it is a copy of every weight beside the model the user compiled and the
trainer's own buffers: 418 MiB more for BERT-base. So where a model given as a
``ModelProto`` holds :data:`READ_MIN_BYTES` of the state or more, :class:`InitialState`
keeps, for each large weight and buffer the program starts from as the model holds it
under the same name (64 KiB and more: those compile's
:class:`~lossgraph.graphs.HeldWeights` store copied from it), no array but the model and
the digest of its bytes, and reads the value from the model again when asked for. The
digest is checked on every read: a model changed after compile is a
:class:`~lossgraph.errors.ModelChangedError`, never a training run started from other
weights. Every other value (optimizer states, adapters, a weight compile made, any value
of a model given as a file or bytes) is held as an array.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import ModelChangedError
from .graphs.held import HeldWeights

__all__ = ["InitialState", "READ_MIN_BYTES"]

#: The bytes of state a model must hold for the program to read them from it rather than
#: keep a copy (the size from which a trainer writes in place by default, too).
READ_MIN_BYTES = 64 * 2**20


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(memoryview(np.ascontiguousarray(array)).cast("B")).digest()


@dataclass(frozen=True)
class _Read:
    """A value read from ``model``'s initializer of its name when asked for (at
    ``position`` among the initializers, unless the model moved it)."""

    model: onnx.ModelProto
    position: int
    digest: bytes
    shape: tuple[int, ...]
    dtype: np.dtype

    def value(self, name: str) -> np.ndarray:
        tensors = self.model.graph.initializer
        tensor = tensors[self.position] if self.position < len(tensors) else None
        if tensor is None or tensor.name != name:  # the model's initializers changed
            tensor = next((t for t in tensors if t.name == name), None)
        if tensor is None:
            change = "is gone"
        elif tensor.data_location == onnx.TensorProto.EXTERNAL:
            change = ("has its data in an external file now (onnx.save(model, ..., "
                      "save_as_external_data=True) moves it out of the model object)")
        else:
            try:
                array = numpy_helper.to_array(tensor)
            except ValueError:  # data of another size than its dims
                array = None
            if array is not None and array.shape == self.shape \
                    and array.dtype == self.dtype and _digest(array) == self.digest:
                return array
            change = "is not the value compiled"
        raise ModelChangedError(
            f"The model this program was compiled from changed after compile: its "
            f"initializer {name!r} {change}. The program reads its initial state from that "
            f"model rather than keep a copy of its weights. Put the model back as it was, or "
            f"compile it again; to change a model after compiling it, compile a copy of it "
            f"(copy = onnx.ModelProto(); copy.CopyFrom(model)).")


class InitialState(MutableMapping[str, np.ndarray]):
    """The initial state by name (module docstring): held arrays, and values read from
    the model compiled when asked for (read-only arrays, read again on each access: take
    one once where it is used more than once). Setting a value holds it."""

    def __init__(self, values: Mapping[str, np.ndarray] | None = None) -> None:
        self._values: dict[str, np.ndarray | _Read] = (
            dict(values._values) if isinstance(values, InitialState) else dict(values or {}))

    @classmethod
    def reading(cls, values: Mapping[str, np.ndarray], model: onnx.ModelProto,
                held: HeldWeights) -> InitialState:
        """``values`` of which ``model`` holds the large ones byte for byte under their
        names are read from ``model`` when asked for, where those come to
        :data:`READ_MIN_BYTES`. ``held``: compile's store, which copied ``model``'s large
        weights first: a value that is its array under the same name is the model's."""
        state = cls(values)
        found = {name: array for name, array in values.items()
                 if held.first_held(name) is array}
        if sum(array.nbytes for array in found.values()) >= READ_MIN_BYTES:
            positions = {t.name: i for i, t in enumerate(model.graph.initializer)}
            state._values.update(
                (name, _Read(model, positions[name], _digest(array), array.shape, array.dtype))
                for name, array in found.items())
        return state

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
