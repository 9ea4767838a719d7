"""Adapter files (lossgraph.export.adapters): the formats, PEFT's names, the base model's
record and what loading refuses.

The records here are built by hand (the ``Adapter`` record of the spec); the tests through
compiled programs (PEFT's predictions, resuming, onnxruntime's multi-LoRA) are below them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from lossgraph.errors import (
    AdapterMismatchError,
    InvalidProgramError,
    RuntimeUnavailableError,
)
from lossgraph.export.adapters import (
    _FORMATS,
    PEFT_CONFIG,
    PEFT_FILE,
    _peft_settings,
    file_tensors,
    loaded_values,
)
from lossgraph.export.safetensors import parse_safetensors

HAS_ADAPTER_FORMAT = hasattr(onnxruntime, "AdapterFormat")


@dataclass(frozen=True)
class Record:
    """The spec's ``Adapter`` record, as much of it as the files use."""

    weight: str
    module: str | None
    a: str
    b: str
    kind: str = "linear"
    rank: int = 2
    alpha: float = 4.0

    def peft_names(self) -> tuple[str, str] | None:
        if self.module is None:
            return None
        return (f"base_model.model.{self.module}.lora_A.weight",
                f"base_model.model.{self.module}.lora_B.weight")


QUERY = Record("val_3", "encoder.query", "encoder.query.lora_A", "encoder.query.lora_B")
LOOSE = Record("W", None, "W.lora_A", "W.lora_B")
CONV = Record("conv.weight", "conv", "conv.lora_A", "conv.lora_B", kind="conv")
ADAPTERS = (QUERY, LOOSE, CONV)


def state(seed: int = 0, rank: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {QUERY.a: (5, rank), QUERY.b: (rank, 3), LOOSE.a: (4, rank), LOOSE.b: (rank, 4),
              CONV.a: (rank, 3, 3, 3), CONV.b: (6, rank, 1, 1)}
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def test_safetensors_names_and_lays_out_as_peft_where_the_module_is_known():
    values = state()
    tensors, metadata = file_tensors(ADAPTERS, values, peft_names=True)
    assert sorted(tensors) == sorted([*QUERY.peft_names(), *CONV.peft_names(), LOOSE.a, LOOSE.b])
    a, b = QUERY.peft_names()
    assert tensors[a].shape == (2, 5) and tensors[b].shape == (3, 2)  # [r, in], [out, r]
    np.testing.assert_array_equal(tensors[a], values[QUERY.a].T)
    np.testing.assert_array_equal(tensors[CONV.peft_names()[1]], values[CONV.b])  # PEFT's own
    np.testing.assert_array_equal(tensors[LOOSE.a], values[LOOSE.a])  # ONNX name and layout
    assert metadata["lossgraph.written_by"] == "lossgraph"
    assert loaded_values(ADAPTERS, values, tensors, metadata, True).keys() == values.keys()


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", pytest.param(
    ".onnx_adapter", marks=pytest.mark.skipif(not HAS_ADAPTER_FORMAT,
                                              reason="needs onnxruntime>=1.20"))])
def test_every_format_reads_back_what_it_wrote(tmp_path, suffix):
    kind, values = _FORMATS[suffix], state()
    tensors, metadata = file_tensors(ADAPTERS, values, kind.peft_names)
    path = tmp_path / f"adapters{suffix}"
    path.write_bytes(kind.write(tensors, metadata))
    assert kind.owned(path)
    read, record = kind.read(path)
    loaded = loaded_values(ADAPTERS, values, read, record, kind.peft_names)
    for name, value in values.items():
        np.testing.assert_array_equal(loaded[name], value)
    other = tmp_path / f"other{suffix}"
    other.write_bytes(b"not lossgraph's")
    assert not kind.owned(other)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", pytest.param(
    ".onnx_adapter", marks=pytest.mark.skipif(not HAS_ADAPTER_FORMAT,
                                              reason="needs onnxruntime>=1.20"))])
def test_a_file_for_another_rank_or_alpha_is_refused_before_anything_is_set(tmp_path, suffix):
    kind = _FORMATS[suffix]
    tensors, metadata = file_tensors(ADAPTERS, state(), kind.peft_names)
    path = tmp_path / f"adapters{suffix}"
    path.write_bytes(kind.write(tensors, metadata))
    read, record = kind.read(path)
    other_alpha = tuple(Record(**{**vars(a), "alpha": 8.0}) for a in ADAPTERS)
    message = "model_version" if suffix == ".onnx_adapter" else "alpha 4.0 in the file, 8.0"
    with pytest.raises(AdapterMismatchError, match=message):
        loaded_values(other_alpha, state(), read, record, kind.peft_names, where=str(path))
    with pytest.raises(AdapterMismatchError):
        loaded_values(tuple(Record(**{**vars(a), "rank": 3}) for a in ADAPTERS), state(rank=3),
                      read, record, kind.peft_names)


def test_a_file_without_lossgraphs_record_is_checked_by_names_and_shapes():
    tensors, _ = file_tensors(ADAPTERS, state(), peft_names=True)
    with pytest.raises(AdapterMismatchError, match="has no tensor 'W.lora_B'"):
        loaded_values(ADAPTERS, state(), {k: v for k, v in tensors.items() if k != "W.lora_B"},
                      {}, True)
    with pytest.raises(AdapterMismatchError, match="'extra'.*no adapter of the program"):
        loaded_values(ADAPTERS, state(), {**tensors, "extra": np.zeros(1)}, {}, True)
    with pytest.raises(AdapterMismatchError, match=r"needs float32\[2, 5\]"):
        loaded_values(ADAPTERS, state(), {**tensors, QUERY.peft_names()[0]: np.zeros(
            (2, 5), np.float64)}, {}, True)
    with pytest.raises(AdapterMismatchError, match="use_rslora"):
        loaded_values(ADAPTERS, state(), tensors, {}, True, {"use_rslora": True})
    with pytest.raises(AdapterMismatchError, match="rank 2 and alpha 32"):
        loaded_values(ADAPTERS, state(), tensors, {}, True, {"r": 2, "lora_alpha": 32})


def test_another_base_models_adapters_are_refused_by_name():
    tensors, metadata = file_tensors((QUERY, LOOSE), state(), peft_names=False)
    value = Record("val_9", "decoder.value", "decoder.value.lora_A", "decoder.value.lora_B")
    values = {**state(), value.a: state()[QUERY.a], value.b: state()[QUERY.b]}
    with pytest.raises(AdapterMismatchError, match="no adapter on 'decoder.value'"):
        loaded_values((value, LOOSE), values, tensors, metadata, False)


@pytest.mark.skipif(HAS_ADAPTER_FORMAT, reason="onnxruntime here has AdapterFormat")
def test_onnx_adapter_needs_onnxruntime_1_20(tmp_path):
    tensors, metadata = file_tensors(ADAPTERS, state(), peft_names=False)
    with pytest.raises(RuntimeUnavailableError, match="onnxruntime 1.20 or later"):
        _FORMATS[".onnx_adapter"].write(tensors, metadata)


def test_a_malformed_npz_is_an_invalid_program_error(tmp_path):
    path = tmp_path / "adapters.npz"
    path.write_bytes(b"PK not a zip")
    with pytest.raises(InvalidProgramError, match="not a numpy .npz"):
        _FORMATS[".npz"].read(path)


# -- PEFT ----------------------------------------------------------------------------------


def peft_folder(tmp_path: Path) -> tuple[Path, object]:
    """PEFT's save_pretrained folder of a small torch model with LoRA on ``encoder.query``."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = torch.nn.Linear(5, 3)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()

        def forward(self, x):
            return self.encoder.query(x)

    torch.manual_seed(0)
    model = peft.get_peft_model(Net(), peft.LoraConfig(r=2, lora_alpha=4,
                                                        target_modules=["query"]))
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(parameter)
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.torch
def test_peft_save_pretrained_is_read_with_its_layout(tmp_path):
    folder, model = peft_folder(tmp_path)
    tensors, metadata = parse_safetensors((folder / PEFT_FILE).read_bytes())
    config = json.loads((folder / PEFT_CONFIG).read_text())
    values = state()
    loaded = loaded_values((QUERY,), values, tensors, metadata, True, config)
    layer = model.base_model.model.encoder.query
    np.testing.assert_array_equal(loaded[QUERY.a], layer.lora_A["default"].weight.detach().T)
    np.testing.assert_array_equal(loaded[QUERY.b], layer.lora_B["default"].weight.detach().T)
    settings = _peft_settings((QUERY,))
    assert (settings["r"], settings["lora_alpha"]) == (config["r"], config["lora_alpha"])
