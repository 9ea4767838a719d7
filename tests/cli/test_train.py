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


@pytest.mark.parametrize("flag", ["--progress", "--no-progress"])
def test_the_progress_bar_on_request(model_file, tmp_path, capsys, flag):
    argv = ["train", program_folder(tmp_path), "--data", npz_data(tmp_path), "--epochs", "3", flag,
            "-o", str(tmp_path / "o.onnx")]
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("3/3" in err) == (flag == "--progress"), err
