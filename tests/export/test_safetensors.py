"""The safetensors format written and read with numpy alone, against the safetensors package."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from lossgraph.errors import DTypeMismatchError, InvalidProgramError
from lossgraph.export.safetensors import (
    parse_safetensors,
    read_safetensors_metadata,
    safetensors_bytes,
)

TENSORS = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1.5, -2.0]),
           "h": np.ones((1, 2, 1), np.float16), "i": np.array([3], np.int64),
           "e": np.zeros((0, 4), np.float32)}


def test_written_tensors_and_metadata_read_back_equal():
    tensors, metadata = parse_safetensors(safetensors_bytes(TENSORS, {"k": "v"}))
    assert list(tensors) == list(TENSORS) and metadata == {"k": "v"}
    for name, value in TENSORS.items():
        assert tensors[name].dtype == value.dtype
        np.testing.assert_array_equal(tensors[name], value)


def test_the_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    numpy_io = pytest.importorskip("safetensors.numpy")
    ours = tmp_path / "ours.safetensors"
    ours.write_bytes(safetensors_bytes(TENSORS, {"format": "pt"}))
    for name, value in numpy_io.load_file(str(ours)).items():
        np.testing.assert_array_equal(value, TENSORS[name])
    theirs = tmp_path / "theirs.safetensors"
    numpy_io.save_file(TENSORS, str(theirs), metadata={"x": "y"})
    tensors, metadata = parse_safetensors(theirs.read_bytes())
    assert metadata == {"x": "y"} and read_safetensors_metadata(theirs) == {"x": "y"}
    for name, value in TENSORS.items():
        np.testing.assert_array_equal(tensors[name], value)


def _file(header: dict, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@pytest.mark.parametrize("data, message", [
    (b"\x01", "not a safetensors file"),
    (struct.pack("<Q", 99) + b"{}", "past the file's end"),
    (struct.pack("<Q", 2) + b"{x", "not JSON"),
    (_file({"__metadata__": {"a": 1}}), "must map str to str"),
    (_file({"t": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0"),
     "numpy cannot hold"),
    (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "does not fit its bytes"),
    (_file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
     "overlap or leave gaps"),
], ids=["short", "header-past-the-end", "header-not-json", "metadata-not-strings",
        "bfloat16", "bytes-of-another-size", "gap"])
def test_a_malformed_file_is_an_invalid_program_error(data, message):
    with pytest.raises(InvalidProgramError, match=message):
        parse_safetensors(data, "adapter.safetensors")


def test_a_dtype_safetensors_cannot_hold_is_refused():
    with pytest.raises(DTypeMismatchError, match="complex64"):
        safetensors_bytes({"c": np.zeros(2, np.complex64)}, {})
