"""Where in a model file each initializer's bytes lie, read without parsing the model.

A program compiled from a file reads its large weights back from that file when asked for
rather than hold a copy (:mod:`lossgraph.initial_state`); :func:`initializer_spans` tells
where: the ``raw_data`` of each main-graph initializer stored in the ``.onnx`` file
itself, or the ``offset`` and ``length`` of one stored as external data in a file of the
model's folder. It walks protobuf's wire format (onnx.proto: ``ModelProto.graph`` is field
7, ``GraphProto.initializer`` 5; ``TensorProto.name`` 8, ``raw_data`` 9, ``external_data``
13, ``data_location`` 14) through a memory map, stepping over every tensor's data without
reading it. Anything it does not expect (a field repeated that protobuf would merge, a
name given twice, a group) leaves the tensor, or the whole file, without a span: its
value is then held as before. A span is a claim, not a proof: the reader checks the bytes
against the digest of the values compiled.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Span", "initializer_spans", "read_span"]

# onnx.proto's field numbers (wire format: key = field << 3 | wire type)
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_NAME, _TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 8, 9, 13, 14
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` of the file at ``path``."""

    path: Path
    offset: int
    length: int


class _Unexpected(Exception):
    """The wire format holds something the walk does not read."""


def _varint(data: mmap.mmap, at: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise _Unexpected
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value or (start, end) of its bytes) of a message."""
    at = start
    while at < end:
        key, at = _varint(data, at, end)
        field, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, at = _varint(data, at, end)
        elif kind == _BYTES:
            length, at = _varint(data, at, end)
            value, at = (at, at + length), at + length
        elif kind in (_FIXED64, _FIXED32):
            value, at = None, at + (8 if kind == _FIXED64 else 4)
        else:
            raise _Unexpected
        if at > end:
            raise _Unexpected
        yield field, kind, value


def _only(fields: list[tuple[int, int, Any]], number: int, kind: int) -> Any:
    """The value of field ``number``, None when absent; given twice or of another wire
    type, unexpected."""
    found = [(wire, value) for field, wire, value in fields if field == number]
    if not found:
        return None
    if len(found) > 1 or found[0][0] != kind:
        raise _Unexpected
    return found[0][1]


def _text(data: mmap.mmap, where: tuple[int, int]) -> str:
    return bytes(data[where[0]:where[1]]).decode("utf-8")


def _tensor_span(data: mmap.mmap, where: tuple[int, int], model: Path
                 ) -> tuple[str, Span | None]:
    """One initializer's name and span (None: not one the walk can tell)."""
    fields = list(_fields(data, *where))
    name = _only(fields, _TENSOR_NAME, _BYTES)
    if name is None:
        raise _Unexpected
    name = _text(data, name)
    if (_only(fields, _TENSOR_DATA_LOCATION, _VARINT) or 0) != _EXTERNAL:
        raw = _only(fields, _TENSOR_RAW_DATA, _BYTES)
        return name, None if raw is None else Span(model, raw[0], raw[1] - raw[0])
    entries = {}
    for field, kind, value in fields:
        if field == _TENSOR_EXTERNAL_DATA and kind == _BYTES:
            entry = list(_fields(data, *value))
            key, text = _only(entry, _ENTRY_KEY, _BYTES), _only(entry, _ENTRY_VALUE, _BYTES)
            if key is None or text is None:
                raise _Unexpected
            entries[_text(data, key)] = _text(data, text)
    return name, _external_span(entries, model.parent)


def _external_span(entries: dict[str, str], folder: Path) -> Span | None:
    """The span external data ``entries`` name, in a regular file inside ``folder`` (the
    rule lossgraph loads external data by), else None."""
    location = entries.get("location", "")
    try:
        offset, length = int(entries.get("offset", 0)), int(entries["length"])
    except (KeyError, ValueError):
        return None
    target = (folder / location).resolve()
    if (not location or os.path.isabs(location) or not target.is_relative_to(folder.resolve())
            or not target.is_file() or offset < 0 or length < 0):
        return None
    return Span(target, offset, length)


def initializer_spans(path: str | os.PathLike) -> dict[str, Span]:
    """The span of each main-graph initializer's data in the model file at ``path``
    (module doc), by name; {} where the file cannot be walked."""
    model = Path(os.fspath(path))
    try:
        with open(model, "rb") as file, mmap.mmap(file.fileno(), 0,
                                                  access=mmap.ACCESS_READ) as data:
            top = list(_fields(data, 0, len(data)))
            graph = _only(top, _MODEL_GRAPH, _BYTES)
            if graph is None:
                return {}
            spans: dict[str, Span | None] = {}
            for field, kind, value in _fields(data, *graph):
                if field == _GRAPH_INITIALIZER and kind == _BYTES:
                    name, span = _tensor_span(data, value, model)
                    spans[name] = None if name in spans else span  # a name twice: neither
    except (OSError, ValueError, UnicodeDecodeError, _Unexpected):
        return {}
    return {name: span for name, span in spans.items() if span is not None}


def read_span(span: Span) -> bytearray | None:
    """The bytes of ``span``, or None where the file is gone or shorter."""
    try:
        with open(span.path, "rb") as file:
            file.seek(span.offset)
            data = bytearray(span.length)
            read = file.readinto(data)
    except OSError:
        return None
    return data if read == span.length else None
