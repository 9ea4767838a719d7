"""lossgraph train (lossgraph/cli/train.py): resuming a checkpoint continues like one longer
run; the loss curve is a PNG; the progress bar on request."""

from __future__ import annotations

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
