"""The lossgraph command line."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from catalogue import Row, assert_listed, message_of, print_table, slug

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
    assert main(["add-loss", str(model_file), "-o", str(loss_file), "--loss", "huber",
                 "--option", "delta=0.5", "--penalty", '{"z_weight": 0.1}']) == 0
    assert get_roles(onnx.load(loss_file))["loss"] == "loss"
    assert main(["gradient", str(loss_file), "-o", str(grad_file), "--weights", "a_bias"]) == 0
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
    assert main(["add-loss", str(model_file), "-o", str(output), "--loss", "nope"]) == 2
    assert "Unknown loss 'nope'" in capsys.readouterr().err
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


# -- every bad input: exit status 2, one line on stderr, no traceback, nothing written -------


def _program(tmp_path) -> str:
    model = tmp_path / "net.onnx"
    onnx.save(onnx.parser.parse_model(MODEL), model)
    folder = tmp_path / "program"
    assert main(["compile", str(model), "-o", str(folder)]) == 0
    return str(folder)


def _file(tmp_path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


def _model(tmp_path) -> str:
    return _file(tmp_path, "m.onnx", onnx.parser.parse_model(MODEL).SerializeToString())


def _data(tmp_path) -> str:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", X=rng.normal(size=(10, 3)).astype(np.float32),
             y=rng.normal(size=(10, 2)).astype(np.float32))
    return str(tmp_path / "data.npz")


def _broken_manifest(tmp_path) -> str:
    folder = _program(tmp_path)
    (tmp_path / "program" / "manifest.json").write_text('{"format": ')
    return folder


def _user_folder(tmp_path) -> str:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.txt").write_text("keep")
    return str(tmp_path / "mine")


def _user_file(tmp_path) -> str:
    return _file(tmp_path, "mine.onnx", b"the user's own file")


JUNK = b"this is not an ONNX model\n"
BAD_COMMANDS = {
    # junk files for every command that reads a model
    "add-loss junk": lambda t: ["add-loss", _file(t, "j.onnx", JUNK), "-o", f"{t}/o.onnx"],
    "gradient junk": lambda t: ["gradient", _file(t, "j.onnx", JUNK), "-o", f"{t}/o.onnx"],
    "compile junk": lambda t: ["compile", _file(t, "j.onnx", JUNK), "-o", f"{t}/prog"],
    "lower-ml junk": lambda t: ["lower-ml", _file(t, "j.onnx", JUNK), "-o", f"{t}/o.onnx"],
    "alphabetize junk": lambda t: ["alphabetize", _file(t, "j.onnx", JUNK), "-o", f"{t}/o.onnx"],
    "trainable junk": lambda t: ["trainable", _file(t, "j.onnx", JUNK)],
    "trainable empty file": lambda t: ["trainable", _file(t, "e.onnx", b"")],
    "trainable missing file": lambda t: ["trainable", f"{t}/missing.onnx"],
    "train junk program": lambda t: ["train", _file(t, "j.onnx", JUNK), "--data", _data(t),
                                     "-o", f"{t}/o.onnx"],
    "train a model file": lambda t: ["train", _model(t), "--data", _data(t), "-o", f"{t}/o.onnx"],
    "train corrupt manifest": lambda t: ["train", _broken_manifest(t), "--data", _data(t),
                                         "-o", f"{t}/o.onnx"],
    # missing option values and arguments
    "no command": lambda t: [],
    "unknown command": lambda t: ["fly"],
    "missing -o value": lambda t: ["lower-ml", f"{t}/m.onnx", "-o"],
    "missing -o": lambda t: ["compile", f"{t}/m.onnx"],
    "no --data option": lambda t: ["train", _program(t), "-o", f"{t}/o.onnx"],
    # bad values
    "epochs not a number": lambda t: ["train", _program(t), "--data", _data(t), "--epochs",
                                      "ten", "-o", f"{t}/o.onnx"],
    "batch size zero": lambda t: ["train", _program(t), "--data", _data(t), "--batch-size",
                                  "0", "-o", f"{t}/o.onnx"],
    "unknown fuse": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p", "--fuse", "turbo"],
    "unknown optimizer": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer",
                                    '{"type": "Nope"}'],
    "optimizer not JSON": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p",
                                     "--optimizer", "Adam"],
    "score option without =": lambda t: ["add-loss", f"{t}/m.onnx", "-o", f"{t}/o.onnx",
                                         "--option", "delta"],
    "unknown target": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--target", "mars"],
    # penalties in the wrong form
    "penalty not JSON": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p", "--penalty",
                                   "z_weight=0.1"],
    "penalty unknown weight": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--penalty",
                                         '{"nope": 0.1}'],
    # outputs: missing folders, the user's files and folders
    "output in a missing folder": lambda t: ["lower-ml", _model(t), "-o", f"{t}/missing/o.onnx"],
    "program in a missing folder": lambda t: ["compile", _model(t), "-o", f"{t}/missing/prog"],
    "output over the user's file": lambda t: ["lower-ml", _model(t), "-o", _user_file(t)],
    "program over the user's folder": lambda t: ["compile", _model(t), "-o", _user_folder(t)],
    "checkpoint over the user's folder": lambda t: ["train", _program(t), "--data", _data(t),
                                                    "-o", f"{t}/o.onnx", "--checkpoint",
                                                    _user_folder(t)],
    # data files
    "corrupt npz": lambda t: ["train", _program(t), "--data", _file(t, "d.npz", b"PK\x03\x04junk"),
                              "-o", f"{t}/o.onnx"],
    "text file as npz": lambda t: ["train", _program(t), "--data", _file(t, "d.npz", b"1,2\n"),
                                   "-o", f"{t}/o.onnx"],
    "data file that does not exist": lambda t: ["train", _program(t), "--data",
                                                f"{t}/none.npz", "-o", f"{t}/o.onnx"],
}


@pytest.mark.parametrize("command", BAD_COMMANDS.values(), ids=BAD_COMMANDS.keys())
def test_every_bad_command_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, command):
    argv = command(tmp_path)
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "error:" in captured.err, captured.err
    assert "Traceback" not in captured.err and "losses by epoch" not in captured.out
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_force_replaces_a_file_lossgraph_did_not_write(model_file, tmp_path):
    output = tmp_path / "lowered.onnx"
    output.write_bytes(b"old")
    assert main(["lower-ml", str(model_file), "-o", str(output)]) == 2
    assert main(["lower-ml", str(model_file), "-o", str(output), "--force"]) == 0
    assert onnx.load(output).graph.node
    assert main(["lower-ml", str(model_file), "-o", str(output)]) == 0  # now lossgraph's


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "lossgraph", "trainable", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


# -- the catalogue in docs/reference/errors.md ---------------------------------------------------


def catalogue_rows(tmp: Path) -> Iterator[Row]:
    """This file's catalogue of bad commands, with the line each prints."""
    for described, command in BAD_COMMANDS.items():
        folder = tmp / slug(described)
        folder.mkdir()
        message = io.StringIO()
        with contextlib.redirect_stderr(message), contextlib.redirect_stdout(io.StringIO()):
            argv = command(folder)
            message.truncate(0)
            status = main(argv)
        assert status == 2, described
        shown = " ".join(argv).replace(str(folder), "<tmp>")
        yield (f"cli-{slug(described)}", f"{described}: `lossgraph {shown}`", "exit 2",
               message_of(message.getvalue(), folder))


def test_every_bad_command_is_listed_in_the_errors_page(tmp_path):
    assert_listed((row[0] for row in catalogue_rows(tmp_path)), __file__)


if __name__ == "__main__":
    print_table(catalogue_rows)
