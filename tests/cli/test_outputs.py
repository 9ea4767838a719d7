"""The files a command writes (lossgraph/cli/outputs.py), checked before any work: rewritten
when lossgraph wrote them, never over foreign files unless forced; a plot needs matplotlib."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
from support.cli import (
    installed,
    npz_data,
    program_folder,
    two_output_data,
)

from lossgraph.cli import main


def test_force_replaces_a_file_lossgraph_did_not_write(model_file, tmp_path):
    output = tmp_path / "lowered.onnx"
    output.write_bytes(b"old")
    assert main(["lower-ml", str(model_file), "-o", str(output)]) == 2
    assert main(["lower-ml", str(model_file), "-o", str(output), "--force"]) == 0
    assert onnx.load(output).graph.node
    assert main(["lower-ml", str(model_file), "-o", str(output)]) == 0  # now lossgraph's


def test_outputs_are_rewritten_but_never_over_foreign_files(model_file, tmp_path, capsys):
    X, y = two_output_data(rows=20)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program = str(tmp_path / "program")
    assert main(["compile", str(model_file), "-o", program]) == 0
    plot = ["--plot", str(tmp_path / "curve.png")] if installed("matplotlib") else []
    outputs = ["-o", str(tmp_path / "out.onnx"), "--history", str(tmp_path / "history.json"),
               *plot]
    train = ["train", program, "--data", str(tmp_path / "d.npz")]
    assert main([*train, *outputs]) == 0
    assert main([*train, "--epochs", "2", *outputs]) == 0  # over its own outputs
    assert json.loads((tmp_path / "history.json").read_text())["epochs"] == 2
    (tmp_path / "history.json").write_text('{"mine": true}')
    capsys.readouterr()
    assert main([*train, *outputs]) == 2
    assert "history.json' exists and was not written by lossgraph" in capsys.readouterr().err
    assert (tmp_path / "history.json").read_text() == '{"mine": true}'
    assert main([*train, *outputs, "--force"]) == 0
    assert json.loads((tmp_path / "history.json").read_text())["epochs"] == 1


def test_plot_without_matplotlib_is_a_one_line_error_before_training(model_file, tmp_path,
                                                                     capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    argv = ["train", program_folder(tmp_path), "--data", npz_data(tmp_path), "-o",
            str(tmp_path / "o.onnx"), "--plot", str(tmp_path / "curve.png")]
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "pip install matplotlib" in captured.err
    assert captured.out == "" and not (tmp_path / "o.onnx").exists()
