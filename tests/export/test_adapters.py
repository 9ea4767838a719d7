"""Adapter files (lossgraph.export.adapters): the formats, PEFT's names, the base model's
record and what loading refuses.

The first tests build the records by hand; those through models and compiled programs
(PEFT's predictions, resuming, onnxruntime's multi-LoRA) follow them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime
import pytest
from support.adapters import lora_program, query_data, query_model, torch_net, torch_program

import lossgraph
from lossgraph.adapters import Adapter, LoRA
from lossgraph.errors import (
    AdapterMismatchError,
    InvalidProgramError,
    RuntimeUnavailableError,
)
from lossgraph.export.adapters import (
    _FORMATS,
    PEFT_FILE,
    file_tensors,
    loaded_values,
    with_adapter_inputs,
)
from lossgraph.optim import SGD, AdamW

HAS_ADAPTER_FORMAT = hasattr(onnxruntime, "AdapterFormat")


QUERY = Adapter("val_3", "encoder.query", "encoder.query.lora_A", "encoder.query.lora_B",
                "linear", 2, 4.0, "in_out")
LOOSE = Adapter("W", None, "W.lora_A", "W.lora_B", "linear", 2, 4.0, "out_in")
CONV = Adapter("conv.weight", "conv", "conv.lora_A", "conv.lora_B", "conv", 2, 4.0, "conv")
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
    other_alpha = tuple(replace(a, alpha=8.0) for a in ADAPTERS)
    message = "model_version" if suffix == ".onnx_adapter" else "alpha 4.0 in the file, 8.0"
    with pytest.raises(AdapterMismatchError, match=message):
        loaded_values(other_alpha, state(), read, record, kind.peft_names, where=str(path))
    with pytest.raises(AdapterMismatchError):
        loaded_values(tuple(replace(a, rank=3) for a in ADAPTERS), state(rank=3),
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
    value = replace(QUERY, weight="val_9", module="decoder.value", a="decoder.value.lora_A",
                    b="decoder.value.lora_B")
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


# -- through compiled programs -------------------------------------------------------------


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_training_resumes_from_an_adapter_file_as_if_it_had_not_stopped(tmp_path, fuse):
    X, y = query_data()
    program = lora_program(fuse)
    assert program.weights == ["encoder.query.lora_A", "encoder.query.lora_B"]
    continued = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=8, shuffle=False,
                                               progress=False)
    path = lossgraph.export_adapters(continued, tmp_path / "adapters.npz")
    continued.fit(X, y, epochs=1, batch_size=8, shuffle=False, progress=False, warm_start=True)
    resumed = lossgraph.Trainer(lora_program(fuse))
    lossgraph.load_adapters(resumed, path)
    resumed.fit(X, y, epochs=1, batch_size=8, shuffle=False, progress=False, warm_start=True)
    for name in program.weights:
        np.testing.assert_allclose(resumed.state[name], continued.state[name], rtol=1e-6,
                                   atol=1e-7)
    np.testing.assert_allclose(resumed.predict(X), continued.predict(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", pytest.param(
    ".onnx_adapter", marks=pytest.mark.skipif(not HAS_ADAPTER_FORMAT,
                                              reason="needs onnxruntime>=1.20"))])
def test_a_program_loads_the_adapters_a_trainer_exported(tmp_path, suffix):
    X, y = query_data()
    trainer = lossgraph.Trainer(lora_program()).fit(X, y, epochs=2, progress=False)
    path = lossgraph.export_adapters(trainer, tmp_path / f"adapters{suffix}")
    program = lora_program()
    loaded = lossgraph.load_adapters(program, path)
    assert sorted(loaded) == sorted(program.weights)
    for name, value in loaded.items():
        np.testing.assert_array_equal(program.state[name], value)
        np.testing.assert_array_equal(value, trainer.state[name])
    np.testing.assert_allclose(lossgraph.Trainer(program).predict(X), trainer.predict(X),
                               rtol=1e-6)
    other = lora_program(rank=3)
    with pytest.raises(AdapterMismatchError, match="for another base model"):
        lossgraph.load_adapters(other, path)


def test_loading_starts_the_adapters_optimizer_afresh(tmp_path):
    X, y = query_data()
    trainer = lossgraph.Trainer(lora_program(optimizer=AdamW(0.05))).fit(X, y, batch_size=8,
                                                                         progress=False)
    path = lossgraph.export_adapters(trainer, tmp_path / "adapters.safetensors")
    moments, initial = trainer.program.optimizer_states, trainer.program.state
    assert moments and all(np.any(trainer.state[m] != initial[m]) for m in moments)
    trained = trainer.state
    lossgraph.load_adapters(trainer, path)
    for name in moments:
        np.testing.assert_array_equal(trainer.state[name], initial[name])
    for name in trainer.program.weights:
        np.testing.assert_array_equal(trainer.state[name], trained[name])


@pytest.mark.skipif(not HAS_ADAPTER_FORMAT, reason="needs onnxruntime>=1.20")
def test_onnxruntime_runs_an_onnx_adapter_as_the_merged_model(tmp_path):
    X, y = query_data()
    trainer = lossgraph.Trainer(lora_program()).fit(X, y, epochs=2, progress=False)
    merged = trainer.to_inference_model(merge=True)
    fed = with_adapter_inputs(lossgraph.Trainer(lora_program()).to_inference_model())
    path = lossgraph.export_adapters(trainer, tmp_path / "tuned.onnx_adapter")
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # the inputs with defaults are not folded: a warning
    session = onnxruntime.InferenceSession(fed.SerializeToString(), options)
    adapter = onnxruntime.LoraAdapter()
    adapter.Load(str(path))
    run_options = onnxruntime.RunOptions()
    run_options.add_active_adapter(adapter)
    expected = onnxruntime.InferenceSession(merged.SerializeToString()).run(None, {"x": X})[0]
    np.testing.assert_allclose(session.run(None, {"x": X}, run_options)[0], expected,
                               rtol=1e-5, atol=1e-6)
    base = onnxruntime.InferenceSession(query_model().SerializeToString()).run(None, {"x": X})
    np.testing.assert_allclose(session.run(None, {"x": X})[0], base[0], rtol=1e-6)  # B = 0


@pytest.mark.torch
@pytest.mark.parametrize("direct", [False, True], ids=["parent-calls", "grandparent-calls"])
def test_peft_loads_lossgraphs_adapters_and_predicts_the_same(tmp_path, direct):
    import copy

    import peft
    import torch

    net = torch_net(direct)
    X, _ = query_data()
    y = np.random.default_rng(2).normal(size=(len(X), 3)).astype(np.float32)
    trainer = lossgraph.Trainer(torch_program(net)).fit(X, y, epochs=3, batch_size=8,
                                                       progress=False)
    lossgraph.export_adapters(trainer, tmp_path / PEFT_FILE, peft_config=True)
    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(net), tmp_path)
    with torch.no_grad():
        predicted = tuned(torch.from_numpy(X)).numpy()
    assert not np.allclose(predicted, net(torch.from_numpy(X)).detach().numpy(), atol=1e-3)
    np.testing.assert_allclose(predicted, trainer.predict(X), rtol=1e-5, atol=1e-5)


@pytest.mark.torch
def test_lossgraph_loads_peft_save_pretrained_and_predicts_the_same(tmp_path):
    import copy

    import peft
    import torch

    net = torch_net()
    tuned = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query", "value"]))
    with torch.no_grad():
        for name, parameter in tuned.named_parameters():
            if "lora_" in name:
                parameter.normal_()
    tuned.save_pretrained(tmp_path)
    trainer = lossgraph.Trainer(torch_program(net))
    lossgraph.load_adapters(trainer, tmp_path)
    X, _ = query_data()
    with torch.no_grad():
        expected = tuned(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-5)
    other = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(
        r=2, lora_alpha=8, target_modules=["query", "value"]))
    other.save_pretrained(tmp_path / "alpha8")
    with pytest.raises(AdapterMismatchError, match="alpha 8"):
        lossgraph.load_adapters(trainer, tmp_path / "alpha8")


@pytest.mark.torch
def test_conv_adapters_go_to_peft_and_back_in_peft_shapes(tmp_path):
    import copy

    import peft
    import torch
    from support.torch_steps import legacy_export

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 5 * 5, 3))
    X = np.random.default_rng(0).normal(size=(6, 2, 5, 5)).astype(np.float32)
    program = lossgraph.compile_program(legacy_export(net, X[:2]), optimizer=SGD(0.05),
                                        adapters=LoRA(rank=2, alpha=4.0, targets=["0"]))
    tuned = peft.get_peft_model(copy.deepcopy(net), peft.LoraConfig(r=2, lora_alpha=4,
                                                                    target_modules=["0"]))
    with torch.no_grad():
        for name, parameter in tuned.named_parameters():
            if "lora_" in name:
                parameter.normal_()
        expected = tuned(torch.from_numpy(X)).numpy()
    tuned.save_pretrained(tmp_path / "peft")
    trainer = lossgraph.Trainer(program)
    lossgraph.load_adapters(trainer, tmp_path / "peft")
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-5)
    (tmp_path / "ours").mkdir()
    lossgraph.export_adapters(trainer, tmp_path / "ours" / PEFT_FILE, peft_config=True)
    back = peft.PeftModel.from_pretrained(copy.deepcopy(net), tmp_path / "ours")
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(X)).numpy(), expected, rtol=1e-5,
                                   atol=1e-5)


def test_a_peft_folder_whose_file_links_out_of_it_is_refused(tmp_path):
    """lossgraph never reads outside the folder it is given: a PEFT folder's
    adapter_model.safetensors (or adapter_config.json) that is a link is refused."""
    program = lora_program()
    outside = tmp_path / "outside.safetensors"
    lossgraph.export_adapters(program, outside)
    folder = tmp_path / "peft"
    folder.mkdir()
    (folder / "adapter_model.safetensors").symlink_to(outside)
    with pytest.raises(InvalidProgramError, match="is a link"):
        lossgraph.load_adapters(program, folder)
