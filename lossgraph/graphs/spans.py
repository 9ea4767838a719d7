"""Where in a model file each initializer's bytes lie, read without parsing the model.

A model file's large weights need not pass through protobuf: compile reads the model
without their data (:func:`model_without_raw_data`) and holds each weight's bytes once,
read from the file (:mod:`lossgraph.models`), and a program compiled from a file reads its
large weights back from that file when asked for rather than hold a copy
(:mod:`lossgraph.initial_state`). :func:`initializer_spans` tells where: the ``raw_data``
of each main-graph initializer stored in the ``.onnx`` file itself, or the ``offset`` and
``length`` of one stored as external data in a file of the model's folder. The walk
follows protobuf's wire format (onnx.proto: ``ModelProto.graph`` is field 7,
``GraphProto.initializer`` 5; ``TensorProto.name`` 8, ``raw_data`` 9, ``external_data``
13, ``data_location`` 14) through a memory map, stepping over every tensor's data without
reading it. Anything it does not expect (a field repeated that protobuf would merge, a
name given twice, a group) leaves the tensor, or the whole file, without a span: it is
then read as protobuf reads it. A span is a claim, not a proof: its readers check the
bytes against the values compiled.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Span", "OpenedFile", "OpenedFiles", "initializer_spans", "model_without_raw_data"]

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


@dataclass(frozen=True)
class _Field:
    """One field of a message: its number, wire type, where it starts (its key) and
    ends, and its value (a varint) or payload's start (length-delimited)."""

    number: int
    kind: int
    start: int
    end: int
    value: int | None

    @property
    def payload(self) -> tuple[int, int]:
        return self.value, self.end


@dataclass(frozen=True)
class _Initializer:
    """An initializer's field in the graph, and where its embedded data field lies."""

    name: str
    field: _Field
    raw: _Field | None
    span: Span | None


class _Unexpected(Exception):
    """The wire format holds something the walk does not read."""


def _varint(data: Any, at: int, end: int) -> tuple[int, int]:
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


def _encoded_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(data: Any, start: int, end: int) -> Iterator[_Field]:
    """The fields of the message in ``data[start:end]``."""
    at = start
    while at < end:
        begin = at
        key, at = _varint(data, at, end)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, at = _varint(data, at, end)
        elif kind == _BYTES:
            length, value = _varint(data, at, end)
            at = value + length
        elif kind in (_FIXED64, _FIXED32):
            value, at = None, at + (8 if kind == _FIXED64 else 4)
        else:
            raise _Unexpected
        if at > end:
            raise _Unexpected
        yield _Field(number, kind, begin, at, value)


def _only(fields: list[_Field], number: int, kind: int) -> _Field | None:
    """Field ``number``, None when absent; given twice or of another wire type,
    unexpected."""
    found = [field for field in fields if field.number == number]
    if not found:
        return None
    if len(found) > 1 or found[0].kind != kind:
        raise _Unexpected
    return found[0]


def _text(data: Any, field: _Field) -> str:
    start, end = field.payload
    return bytes(data[start:end]).decode("utf-8")


def _initializer(data: Any, field: _Field, model: Path) -> _Initializer:
    """One initializer's name, data field and span (None: not one the walk can tell)."""
    fields = list(_fields(data, *field.payload))
    name = _only(fields, _TENSOR_NAME, _BYTES)
    if name is None:
        raise _Unexpected
    location = _only(fields, _TENSOR_DATA_LOCATION, _VARINT)
    if location is None or location.value != _EXTERNAL:
        raw = _only(fields, _TENSOR_RAW_DATA, _BYTES)
        span = None if raw is None else Span(model, raw.value, raw.end - raw.value)
        return _Initializer(_text(data, name), field, raw, span)
    entries = {}
    for entry in (f for f in fields if f.number == _TENSOR_EXTERNAL_DATA):
        parts = list(_fields(data, *entry.payload)) if entry.kind == _BYTES else []
        key, text = _only(parts, _ENTRY_KEY, _BYTES), _only(parts, _ENTRY_VALUE, _BYTES)
        if key is None or text is None:
            raise _Unexpected
        entries[_text(data, key)] = _text(data, text)
    return _Initializer(_text(data, name), field, None,
                        _external_span(entries, model.parent))


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


def _walk(data: Any, model: Path) -> tuple[_Field, list[_Initializer]] | None:
    """The model's graph field and its initializers (names given twice: without a span),
    or None without a graph."""
    graph = _only(list(_fields(data, 0, len(data))), _MODEL_GRAPH, _BYTES)
    if graph is None:
        return None
    found = [_initializer(data, field, model) for field in _fields(data, *graph.payload)
             if field.number == _GRAPH_INITIALIZER and field.kind == _BYTES]
    names = [item.name for item in found]
    return graph, [item if names.count(item.name) == 1 else
                   _Initializer(item.name, item.field, None, None) for item in found]


def _walked(path: str | os.PathLike, use: Any) -> Any:
    """``use(data, graph, initializers)`` over the file at ``path`` mapped, or None where
    it cannot be walked. Spans name the file by its absolute path: a change of working
    folder does not move them."""
    model = Path(os.path.abspath(os.fspath(path)))
    try:
        with open(model, "rb") as file, mmap.mmap(file.fileno(), 0,
                                                  access=mmap.ACCESS_READ) as data:
            walked = _walk(data, model)
            return None if walked is None else use(data, *walked)
    except (OSError, ValueError, UnicodeDecodeError, _Unexpected):
        return None


def initializer_spans(path: str | os.PathLike) -> dict[str, Span]:
    """The span of each main-graph initializer's data in the model file at ``path``
    (module doc), by name; {} where the file cannot be walked."""
    spans = _walked(path, lambda data, graph, found: {
        item.name: item.span for item in found if item.span is not None})
    return spans or {}


def model_without_raw_data(path: str | os.PathLike) -> tuple[bytes, dict[str, Span]] | None:
    """The model file at ``path`` serialized without the data its main-graph initializers
    hold in the file (``raw_data``), and the span of each of those, by name: what it
    takes to parse the model without reading its weights. None where the file cannot be
    walked."""
    def cut(data: Any, graph: _Field, found: list[_Initializer]):
        graph_bytes, spans, at = bytearray(), {}, graph.value
        for item in found:
            if item.raw is None:
                continue
            tensor = (bytes(data[item.field.value:item.raw.start])
                      + bytes(data[item.raw.end:item.field.end]))
            graph_bytes += data[at:item.field.start]
            graph_bytes += (_encoded_varint(_GRAPH_INITIALIZER << 3 | _BYTES)
                            + _encoded_varint(len(tensor)) + tensor)
            at = item.field.end
            spans[item.name] = item.span
        graph_bytes += data[at:graph.end]
        return (bytes(data[:graph.start]) + _encoded_varint(_MODEL_GRAPH << 3 | _BYTES)
                + _encoded_varint(len(graph_bytes)) + bytes(graph_bytes)
                + bytes(data[graph.end:])), spans

    return _walked(path, cut)


class OpenedFile:
    """A file kept open to read spans of, again and again: renamed, replaced or removed
    since it was opened, it still reads the file it opened (an open file keeps it on
    disk), so that only bytes written into that very file change what it reads, which a
    reader's digest tells. Closed by :meth:`close`, or when no one refers to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115  (open for the object's life)
        self._lock = threading.Lock()  # one seek and read at a time
        self.close = weakref.finalize(self, self._file.close)

    def read(self, span: Span) -> bytes | None:
        """The bytes of ``span`` (of this file), or None where it is shorter now."""
        with self._lock:
            try:
                self._file.seek(span.offset)
                data = self._file.read(span.length)
            except (OSError, ValueError):
                return None
        return data if len(data) == span.length else None


class OpenedFiles:
    """The files of a model's spans (its ``.onnx`` file, its external data files), each
    opened once, when first read; as a context manager, closed at its end."""

    def __init__(self) -> None:
        self._files: dict[Path, OpenedFile | None] = {}

    def __enter__(self) -> OpenedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close every file opened (readers that keep one keep it open no longer)."""
        for file in self._files.values():
            if file is not None:
                file.close()

    def file(self, span: Span) -> OpenedFile | None:
        """The opened file of ``span``, or None where it cannot be opened."""
        if span.path not in self._files:
            try:
                self._files[span.path] = OpenedFile(span.path)
            except OSError:
                self._files[span.path] = None
        return self._files[span.path]

    def read(self, span: Span) -> bytes | None:
        """The bytes of ``span``, or None where its file cannot be opened or is shorter."""
        file = self.file(span)
        return None if file is None else file.read(span)
