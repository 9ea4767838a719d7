"""The lossgraph command line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lossgraph import get_roles
from lossgraph.cli import main

MODEL = """
    <ir_version: 8, opset_import: ["" : 18]>
    net (float[N, 3] x) => (float[N, 2] y)
    <float[3, 2] z_weight = {1, 2, 3, 4, 5, 6}, float[2] a_bias = {0.5, -0.5}>
    { h = MatMul(x, z_weight)
      y = Add(h, a_bias) }
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(onnx.parser.parse_model(MODEL), path)
    return path


def test_add_loss_then_gradient_from_the_shell(model_file, tmp_path, run_model, rng):
    loss_file, grad_file = tmp_path / "loss.onnx", tmp_path / "grad.onnx"
    assert main(["add-loss", str(model_file), "-o", str(loss_file), "--score", "huber",
                 "--option", "delta=0.5", "--penalty", '{"z_weight": 0.1}']) == 0
    assert get_roles(onnx.load(loss_file))["loss"] == "loss"
    assert main(["gradient", str(loss_file), "-o", str(grad_file), "--wrt", "a_bias"]) == 0
    feeds = {"x": rng.normal(size=(4, 3)).astype(np.float32),
             "label": rng.normal(size=(4, 2)).astype(np.float32)}
    assert run_model(onnx.load(grad_file), feeds)["a_bias_grad"].shape == (2,)


def test_trainable_and_alphabetize_print_names(model_file, tmp_path, capsys):
    assert main(["trainable", str(model_file)]) == 0
    assert capsys.readouterr().out.split() == ["z_weight", "a_bias"]
    assert main(["alphabetize", str(model_file), "-o", str(tmp_path / "r.onnx")]) == 0
    assert '"z_weight": "I0_z_weight"' in capsys.readouterr().out


def test_ops_lists_the_supported_ops(capsys):
    assert main(["ops"]) == 0
    assert "MatMul\topset" in capsys.readouterr().out


def test_errors_print_a_message_and_exit_2_leaving_no_output(model_file, tmp_path, capsys):
    output = tmp_path / "out.onnx"
    assert main(["add-loss", str(model_file), "-o", str(output), "--score", "nope"]) == 2
    assert "Unknown score_name 'nope'" in capsys.readouterr().err
    assert not output.exists()
    assert list(tmp_path.iterdir()) == [model_file]


def test_compile_then_train_from_the_shell(model_file, tmp_path, run_model, rng):
    X = rng.normal(size=(120, 3)).astype(np.float32)
    y = np.stack([X @ [1.0, 2.0, -1.0], X @ [0.5, 0.0, 1.0]], axis=1).astype(np.float32)
    np.savez(tmp_path / "train.npz", X=X, y=y)
    program_dir, trained = tmp_path / "program", tmp_path / "trained.onnx"
    assert main(["compile", str(model_file), "-o", str(program_dir), "--fuse", "epoch",
                 "--optimizer", '{"type": "Adam", "learning_rate": 0.1}',
                 "--penalty", '{"z_weight": 0.001}']) == 0
    assert (program_dir / "manifest.json").exists()
    assert main(["train", str(program_dir), "--data", str(tmp_path / "train.npz"),
                 "--epochs", "30", "--batch-size", "20", "--random-state", "0",
                 "-o", str(trained), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    prediction = run_model(onnx.load(trained), {"x": X})["y"]
    assert np.mean((prediction - y) ** 2) < 0.05
    assert (tmp_path / "ckpt" / "trainer.json").exists()


def test_training_data_without_labels_is_a_clear_error(model_file, tmp_path, capsys):
    program_dir = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program_dir)]) == 0
    np.savez(tmp_path / "data.npz", X=np.ones((3, 3), np.float32))
    assert main(["train", str(program_dir), "--data", str(tmp_path / "data.npz"),
                 "-o", str(tmp_path / "out.onnx")]) == 2
    assert "needs arrays named X and y" in capsys.readouterr().err
