"""The safetensors format, written and read with numpy alone (no new dependency).

A file is::

    8 bytes          N, the header's length (unsigned, little-endian)
    N bytes          a JSON object: {name: {"dtype": "F32", "shape": [...],
                     "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}},
                     padded with spaces to a multiple of 8 bytes
    the data         every tensor's bytes (C order, little-endian), offsets relative to here

as `huggingface/safetensors <https://github.com/huggingface/safetensors>`_ specifies it,
so ``safetensors.torch.load_file`` and PEFT read what :func:`safetensors_bytes` writes, and
:func:`parse_safetensors` reads what they write. The reader checks everything (the header's
length and JSON, each dtype, shape and offsets, that the tensors tile the data exactly)
and turns anything malformed into an :class:`~lossgraph.errors.InvalidProgramError`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import DTypeMismatchError, InvalidProgramError

__all__ = ["DTYPES", "METADATA", "safetensors_bytes", "parse_safetensors",
           "read_safetensors_metadata"]

#: safetensors' dtype names -> numpy's (bfloat16 and the float8 types have no numpy dtype).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
          "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
          "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(numpy): name for name, numpy in DTYPES.items()}
#: The header's entry of free-form string metadata.
METADATA = "__metadata__"
_LENGTH = struct.Struct("<Q")
_ALIGNMENT = 8


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """The safetensors file of ``tensors`` (in their order) with ``metadata``."""
    header: dict[str, object] = {METADATA: dict(metadata)}
    offset, chunks = 0, []
    for name, value in tensors.items():
        array = np.ascontiguousarray(value)
        if array.dtype not in _NAMES:
            raise DTypeMismatchError(
                f"Tensor {name!r} is {array.dtype}; safetensors holds "
                f"{', '.join(str(np.dtype(d)) for d in DTYPES.values())}.")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGNMENT)
    return _LENGTH.pack(len(text)) + text + b"".join(chunks)


def _header(data: bytes, where: str) -> tuple[dict, int]:
    """The parsed header of ``data`` and where its tensors' bytes start."""
    if len(data) < _LENGTH.size:
        raise InvalidProgramError(f"{where} is not a safetensors file: it has {len(data)} bytes.")
    (length,) = _LENGTH.unpack_from(data)
    if length > len(data) - _LENGTH.size:
        raise InvalidProgramError(
            f"{where} is not a safetensors file (or is cut short): its header would take "
            f"{length} bytes, past the file's end.")
    try:
        header = json.loads(data[_LENGTH.size:_LENGTH.size + length])
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidProgramError(f"{where}: the safetensors header is not JSON ({exc}).") \
            from None
    if not isinstance(header, dict):
        raise InvalidProgramError(f"{where}: the safetensors header is not a JSON object.")
    metadata = header.get(METADATA, {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidProgramError(f"{where}: the safetensors {METADATA} must map str to str.")
    return header, _LENGTH.size + length


def parse_safetensors(data: bytes, where: str = "The file"
                      ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors (by name, in file order) and the metadata of a safetensors file."""
    header, start = _header(data, where)
    body = memoryview(data)[start:]
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == METADATA:
            continue
        try:
            dtype, shape = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<"), entry["shape"]
            begin, end = entry["data_offsets"]
        except KeyError as exc:
            known = entry.get("dtype") if isinstance(entry, dict) else None
            problem = (f"has dtype {known!r}, which numpy cannot hold (known: "
                       f"{', '.join(DTYPES)})" if known is not None and known not in DTYPES
                       else f"lacks {exc}")
            raise InvalidProgramError(f"{where}: tensor {name!r} {problem}.") from None
        except (TypeError, ValueError):
            raise InvalidProgramError(f"{where}: tensor {name!r} has a malformed entry "
                                      f"{entry!r}.") from None
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(begin, int) and isinstance(end, int)
                and 0 <= begin <= end <= len(body)
                and end - begin == math.prod(shape) * dtype.itemsize):
            raise InvalidProgramError(
                f"{where}: tensor {name!r} ({entry['dtype']}{shape}) does not fit its bytes "
                f"[{begin}, {end}) of the {len(body)} the file holds.")
        spans.append((begin, end))
        tensors[name] = np.frombuffer(body[begin:end], dtype).reshape(shape).astype(
            dtype.newbyteorder("="))
    spans.sort()
    if [b for b, _ in spans] != [0, *(e for _, e in spans[:-1])] or (
            spans and spans[-1][1] != len(body)):
        raise InvalidProgramError(f"{where}: the tensors' bytes overlap or leave gaps.")
    return tensors, dict(header.get(METADATA, {}))


def read_safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of the safetensors file at ``path`` (its header alone is read), or None
    when it is not one."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return None
            (length,) = _LENGTH.unpack(head)
            if length > path.stat().st_size:
                return None
            return _header(head + stream.read(length), str(path))[0].get(METADATA, {})
    except (OSError, InvalidProgramError):
        return None
