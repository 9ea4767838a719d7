"""lossgraph train (lossgraph/cli/train.py): resuming a checkpoint continues like one longer
run; rotating checkpoints, a CSV log and max_steps; the loss curve is a PNG; the progress
bar on request."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
from support.cli import (
    initializers,
    installed,
    npz_data,
    program_folder,
    two_output_data,
)

from lossgraph.cli import main


def test_resuming_a_checkpoint_continues_like_one_longer_run(model_file, tmp_path):
    X, y = two_output_data()
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program, data = str(tmp_path / "program"), str(tmp_path / "d.npz")
    assert main(["compile", str(model_file), "-o", program, "--optimizer", "nesterov",
                 "--fuse", "epoch"]) == 0
    assert main(["train", program, "--data", data, "--epochs", "5", "--batch-size", "16",
                 "--random-state", "7", "-o", str(tmp_path / "once.onnx")]) == 0
    assert main(["train", program, "--data", data, "--epochs", "2", "--batch-size", "16",
                 "--random-state", "7", "-o", str(tmp_path / "part.onnx"), "--checkpoint",
                 str(tmp_path / "ckpt")]) == 0
    # the program may be named again, or left out
    assert main(["train", program, "--resume", str(tmp_path / "ckpt"), "--data", data,
                 "--epochs", "3", "--batch-size", "16", "-o", str(tmp_path / "twice.onnx")]) == 0
    once, twice = initializers(tmp_path / "once.onnx"), initializers(tmp_path / "twice.onnx")
    for name, value in once.items():
        np.testing.assert_array_equal(twice[name], value, err_msg=name)


def test_rotating_checkpoints_a_csv_log_and_max_steps_from_the_shell(model_file, tmp_path):
    """--checkpoint-dir keeps the last --keep-last; --resume of that folder continues its
    latest like one longer run; --log-csv writes a row per step; --max-steps stops there."""
    X, y = two_output_data()
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program, data, ckpts = str(tmp_path / "program"), str(tmp_path / "d.npz"), tmp_path / "ck"
    assert main(["compile", str(model_file), "-o", program, "--optimizer", "adam"]) == 0
    common = ["--data", data, "--batch-size", "16", "--random-state", "3"]  # 4 steps an epoch
    assert main(["train", program, *common, "--epochs", "5", "-o", str(tmp_path / "a.onnx")]) == 0
    assert main(["train", program, *common, "--epochs", "3", "-o", str(tmp_path / "b.onnx"),
                 "--checkpoint-dir", str(ckpts), "--keep-last", "2", "--log-csv",
                 str(tmp_path / "log.csv"), "--log-per", "step"]) == 0
    assert sorted(os.listdir(ckpts)) == ["checkpoint-12", "checkpoint-8"]
    with open(tmp_path / "log.csv", newline="") as stream:
        assert [row["step"] for row in csv.DictReader(stream)] == [str(s) for s in range(1, 13)]
    assert main(["train", "--resume", str(ckpts), *common[:4], "--epochs", "2", "-o",
                 str(tmp_path / "c.onnx")]) == 0
    straight, resumed = initializers(tmp_path / "a.onnx"), initializers(tmp_path / "c.onnx")
    for name, value in straight.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert main(["train", program, *common, "--max-steps", "6", "--checkpoint-dir",
                 str(tmp_path / "short"), "-o", str(tmp_path / "d.onnx")]) == 0
    assert sorted(os.listdir(tmp_path / "short")) == ["checkpoint-4", "checkpoint-6"]


@pytest.mark.skipif(not installed("matplotlib"), reason="needs matplotlib (pip install matplotlib)")
def test_the_loss_curve_is_a_png_lossgraph_recognises(model_file, tmp_path):
    from lossgraph.cli.outputs import _is_plot
    from lossgraph.cli.train import loss_curve_png

    data = loss_curve_png([1.0, 0.5, 0.25], [1.1, 0.6, 0.3])
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "curve.png").write_bytes(data)
    assert _is_plot(tmp_path / "curve.png")
    (tmp_path / "other.png").write_bytes(data.replace(b"Software\x00lossgraph",
                                                      b"Software\x00somebody"))
    assert not _is_plot(tmp_path / "other.png")
    with_metrics = loss_curve_png([1.0, 0.5, 0.25], [], metrics={"accuracy": [0.5, 0.7, 0.8]})
    assert with_metrics.startswith(b"\x89PNG\r\n\x1a\n") and len(with_metrics) > len(data)


@pytest.mark.parametrize("flag", ["--progress", "--no-progress"])
def test_the_progress_bar_on_request(model_file, tmp_path, capsys, flag):
    argv = ["train", program_folder(tmp_path), "--data", npz_data(tmp_path), "--epochs", "3", flag,
            "-o", str(tmp_path / "o.onnx")]
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("3/3" in err) == (flag == "--progress"), err


def test_metrics_and_early_stopping_as_the_trainer_runs_them(tmp_path, capsys):
    """--metrics and --early-stopping-* train as Trainer.fit(metrics=, early_stopping=) on
    the rows --validation-split keeps (the last ones held out); the history holds the
    metrics and early stopping's record, and the output says where it stopped."""
    import json

    from support.heads import head_data, head_program

    import lossgraph

    X, y = head_data("softmax", rows=40)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program = head_program("softmax", optimizer=lossgraph.optim.SGD(0.5))
    program.save(tmp_path / "program")
    assert main(["train", str(tmp_path / "program"), "--data", str(tmp_path / "d.npz"),
                 "--epochs", "30", "--batch-size", "8", "--random-state", "0",
                 "--validation-split", "0.25", "--metrics", "accuracy", "log_loss",
                 "--early-stopping-patience", "2", "--early-stopping-monitor",
                 "validation_log_loss", "-o", str(tmp_path / "m.onnx"),
                 "--history", str(tmp_path / "h.json")]) == 0
    out = capsys.readouterr().out
    rule = lossgraph.EarlyStopping("validation_log_loss", 2)
    trainer = lossgraph.Trainer(program).fit(
        X[:30], y[:30], epochs=30, batch_size=8, random_state=0, progress=False,
        validation_data=(X[30:], y[30:]), metrics=["accuracy", "log_loss"], early_stopping=rule)
    history = json.loads((tmp_path / "h.json").read_text())
    assert history["metrics"] == {k: v for k, v in trainer.history_.items()
                                  if k not in ("loss", "validation_loss")}
    assert history["early_stopping"] == trainer.early_stopping_.to_record()
    stopped = trainer.early_stopping_.stopped_epoch
    assert stopped is not None and f"stopped after epoch {stopped + 1}" in out
    assert f"trained {stopped + 1} epochs" in out and "metrics after the last epoch" in out
    for name, value in initializers(tmp_path / "m.onnx").items():
        if name in trainer.state:
            np.testing.assert_array_equal(value, trainer.state[name], err_msg=name)


def test_clipping_and_the_average_from_compile_to_the_exported_model(model_file, tmp_path):
    """compile --max-grad-norm --ema-decay; train writes the norms into the history and,
    with --ema, the averaged weights (those export --ema writes from the checkpoint)."""
    import json

    import lossgraph

    X, y = two_output_data(24)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program, data = str(tmp_path / "program"), str(tmp_path / "d.npz")
    assert main(["compile", str(model_file), "-o", program, "--max-grad-norm", "0.5",
                 "--ema-decay", "0.9"]) == 0
    assert main(["train", program, "--data", data, "--epochs", "2", "--batch-size", "8",
                 "--no-shuffle", "--ema", "-o", str(tmp_path / "ema.onnx"), "--history",
                 str(tmp_path / "h.json"), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--ema", "-o",
                 str(tmp_path / "exported.onnx")]) == 0
    trainer = lossgraph.Trainer(lossgraph.TrainingProgram.load(program))
    trainer.fit(X, y, epochs=2, batch_size=8, shuffle=False, progress=False)
    expected = {w: trainer.state[f"{w}_ema"] for w in trainer.program.weights}
    for path in ("ema.onnx", "exported.onnx"):
        written = initializers(tmp_path / path)
        for name, value in expected.items():
            np.testing.assert_array_equal(written[name], value, err_msg=name)
    history = json.loads((tmp_path / "h.json").read_text())
    assert history["grad_norm"] == pytest.approx(trainer.grad_norms_) and \
        len(history["grad_norm"]) == 6
