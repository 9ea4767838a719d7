"""The lossgraph command as a whole (lossgraph/cli/__init__.py): each command from the shell, every
bad command line an exit status 2 with one line and nothing written (the catalogue of
docs/reference/errors.md: ``PYTHONPATH=.:tests python tests/cli/test_main.py`` prints its
table), a scikit-learn model trained end to end and the documented walkthrough, export,
exit statuses and help."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.adapters import query_data, query_model
from support.catalogue import Row, assert_listed, message_of, print_table, slug
from support.cli import (
    export_has,
    initializers,
    installed,
    needs_skl2onnx,
    ok,
    shell,
    two_output_data,
    write_csv,
)
from support.cli import npz_data as _data
from support.cli import program_folder as _program
from support.cli import write_file as _file
from support.environment import ROOT
from support.models import NET as MODEL

from lossgraph import TrainingProgram, get_roles, load_adapters
from lossgraph.cli import main
from lossgraph.runtime import Trainer


def test_add_loss_then_gradient_from_the_shell(model_file, tmp_path, run_model, rng):
    loss_file, grad_file = tmp_path / "loss.onnx", tmp_path / "grad.onnx"
    assert main(["add-loss", str(model_file), "-o", str(loss_file), "--loss", "huber",
                 "--loss-option", "delta=0.5", "--penalty", '{"z_weight": 0.1}']) == 0
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


def test_accumulation_from_the_shell_equals_a_larger_batch(model_file, tmp_path, rng):
    """compile --accumulation-steps 4, train at batch 5: the weights of batch 20."""
    X = rng.normal(size=(50, 3)).astype(np.float32)
    y = np.stack([X @ [1.0, 2.0, -1.0], X @ [0.5, 0.0, 1.0]], axis=1).astype(np.float32)
    np.savez(tmp_path / "train.npz", X=X, y=y)
    program = str(tmp_path / "program")
    assert main(["compile", str(model_file), "-o", program, "--optimizer", "adam",
                 "--accumulation-steps", "4"]) == 0
    trained = {}
    for batch, steps in (("5", "4"), ("20", "1")):
        out = tmp_path / f"trained-{batch}.onnx"
        assert main(["train", program, "--data", str(tmp_path / "train.npz"), "--epochs", "2",
                     "--batch-size", batch, "--accumulation-steps", steps, "--no-shuffle",
                     "-o", str(out)]) == 0
        trained[batch] = initializers(out)
    for name, value in trained["20"].items():
        np.testing.assert_allclose(trained["5"][name], value, rtol=1e-5, atol=1e-6)


def test_recompute_from_the_shell(model_file, tmp_path):
    """compile --recompute (alone: auto; a plan's name; or tensors) or --recompute-budget:
    the manifest records the plan; --recompute none, or nothing for a small model, keeps
    every activation."""
    for index, extra in enumerate((["--recompute"], ["--recompute", "auto"],
                                   ["--recompute", "activations"],
                                   ["--recompute", "elementwise"], ["--recompute-budget", "1"])):
        program = tmp_path / f"program{index}"
        assert main(["compile", str(model_file), "-o", str(program), *extra]) == 0
        plan = json.loads((program / "manifest.json").read_text())["recompute"]["train_step"]
        assert plan["recomputed"] or plan["kept"]
    for extra in ([], ["--recompute", "none"]):
        program = tmp_path / f"none{len(extra)}"
        assert main(["compile", str(model_file), "-o", str(program), *extra]) == 0
        assert "recompute" not in json.loads((program / "manifest.json").read_text())


def test_lora_from_the_shell(model_file, tmp_path):
    """compile --lora RANK (--lora-alpha, --lora-targets): the adapters are the weights, the
    manifest lists them."""
    program = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program), "--lora", "1",
                 "--lora-alpha", "2", "--lora-targets", "z_weight"]) == 0
    manifest = json.loads((program / "manifest.json").read_text())
    assert [w["name"] for w in manifest["weights"]] == ["z_weight.lora_A", "z_weight.lora_B"]
    assert [(a["weight"], a["rank"], a["alpha"]) for a in manifest["adapters"]] == [
        ("z_weight", 1, 2.0)]


# -- every bad input: exit status 2, one line on stderr, no traceback, nothing written -------


def _model(tmp_path) -> str:
    return _file(tmp_path, "m.onnx", onnx.parser.parse_model(MODEL).SerializeToString())


def _lora_program(tmp_path) -> str:
    """A program folder training rank-1 adapters on NET's weight."""
    assert main(["compile", _model(tmp_path), "-o", f"{tmp_path}/lora", "--lora",
                 "1"]) == 0
    return f"{tmp_path}/lora"


def _quantized_lora_program(tmp_path) -> str:
    """A program folder training a rank-1 adapter beside a quantized (DequantizeLinear)
    base, which --merge refuses, and its data as d4.npz."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x) => (float[N, 2] y)
        <int8[4, 2] q = {1, 2, 3, 4, 5, 6, 7, 8}, float s = {0.1}, int8 z = {0}>
        { w = DequantizeLinear(q, s, z)  y = MatMul(x, w) }""")
    np.savez(tmp_path / "d4.npz", X=np.ones((4, 4), np.float32), y=np.ones((4, 2), np.float32))
    assert main(["compile", _file(tmp_path, "q.onnx", model.SerializeToString()), "-o",
                 f"{tmp_path}/quantized", "--lora", "1"]) == 0
    return f"{tmp_path}/quantized"


def _overflowing_npz(tmp_path) -> str:
    """float64 arrays (converted to the model's float32), one value beyond float32."""
    X = np.ones((10, 3))
    X[4, 2] = -1e40
    np.savez(tmp_path / "big.npz", X=X, y=np.ones((10, 2)))
    return str(tmp_path / "big.npz")


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


def _npy(tmp_path) -> str:
    np.save(tmp_path / "X.npy", np.ones((4, 3), np.float32))
    return str(tmp_path / "X.npy")


def _csv(tmp_path) -> str:
    return _file(tmp_path, "d.csv", b"a,b,c,y,z\n1,2,3,4,5\n2,3,4,5,6\n")


def _other_program(tmp_path) -> str:
    model = tmp_path / "other.onnx"
    onnx.save(onnx.parser.parse_model(MODEL), model)
    assert main(["compile", str(model), "-o", str(tmp_path / "other"), "--optimizer",
                 "adam"]) == 0
    return str(tmp_path / "other")


def _checkpoint(tmp_path) -> str:
    assert main(["train", _program(tmp_path), "--data", _data(tmp_path), "-o",
                 str(tmp_path / "first.onnx"), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    return str(tmp_path / "ckpt")


def _checkpoint_dir(tmp_path) -> str:
    assert main(["train", _program(tmp_path), "--data", _data(tmp_path), "-o",
                 str(tmp_path / "first.onnx"), "--checkpoint-dir", str(tmp_path / "ckpts")]) == 0
    return str(tmp_path / "ckpts")


JUNK = b"this is not an ONNX model\n"


def _unimported_domain(tmp_path) -> str:
    """The model with its Add in the domain com.microsoft, which it does not import."""
    model = onnx.parser.parse_model(MODEL)
    model.graph.node[1].domain = "com.microsoft"
    return _file(tmp_path, "ms.onnx", model.SerializeToString())

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
    "accumulation steps zero": lambda t: ["train", _program(t), "--data", _data(t),
                                          "--accumulation-steps", "0", "-o", f"{t}/o.onnx"],
    "accumulation not compiled": lambda t: ["train", _program(t), "--data", _data(t),
                                            "--accumulation-steps", "4", "-o", f"{t}/o.onnx"],
    "unknown fuse": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p", "--fuse", "turbo"],
    "unknown optimizer": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer",
                                    '{"type": "Nope"}'],
    "optimizer neither a name nor JSON": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p",
                                                    "--optimizer", "turbo"],
    "momentum for adam": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer", "adam",
                                    "--momentum", "0.9"],
    "momentum out of range": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer",
                                        "momentum", "--momentum", "1.5"],
    "learning rate twice": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer",
                                      '{"type": "SGD", "learning_rate": 0.1}',
                                      "--learning-rate", "0.2"],
    "negative learning rate": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--optimizer",
                                         "adam", "--learning-rate", "-1"],
    "learning rate not a number": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p",
                                             "--learning-rate", "fast"],
    "both penalty forms": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--penalty",
                                     '{"z_weight": 0.1}', "--penalty-l2", "0.1"],
    "negative penalty": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--penalty-l1", "-1"],
    "unknown trainable weight": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                           "--weights", "z_weigth"],
    "untie an unknown initializer": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                               "--untie", "z_weigth"],
    "max grad norm zero": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--max-grad-norm",
                                     "0"],
    "lora option without --lora": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                             "--lora-alpha", "8"],
    "lora rank zero": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--lora", "0"],
    "lora target that matches nothing": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                   "--lora", "1", "--lora-targets", "query"],
    "lora targets with an empty name": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                  "--lora", "1", "--lora-targets", "query,"],
    "lora targets and a pattern": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--lora",
                                             "1", "--lora-targets", "query", "--lora-pattern",
                                             "q.*"],
    "recompute budget with tensors": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                "--recompute", "h", "--recompute-budget",
                                                "0.5"],
    "ema decay one": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--ema-decay", "1"],
    "ema for ort artifacts": lambda t: ["compile", _model(t), "-o", f"{t}/a", "--format",
                                        "ort-artifacts", "--ema-decay", "0.9"],
    "train --ema without an average": lambda t: ["train", _program(t), "--data", _data(t),
                                                 "--ema", "-o", f"{t}/o.onnx"],
    "unknown format": lambda t: ["compile", f"{t}/m.onnx", "-o", f"{t}/p", "--format", "zip"],
    "fuse for ort artifacts": lambda t: ["compile", _model(t), "-o", f"{t}/a", "--format",
                                         "ort-artifacts", "--fuse", "epoch"],
    "nesterov for ort artifacts": lambda t: ["compile", _model(t), "-o", f"{t}/a", "--format",
                                             "ort-artifacts", "--optimizer", "nesterov"],
    "artifacts over a program": lambda t: ["compile", _model(t), "-o", _program(t), "--format",
                                           "ort-artifacts"],
    "schedule option without a schedule": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                     "--warmup-steps", "10"],
    "schedule without its total steps": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                   "--schedule", "cosine"],
    "unknown schedule": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--schedule",
                                   "cosin"],
    "decay exclusion for sgd": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                          "--exclude-from-weight-decay"],
    "decay exclusion matching no weight": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                     "--optimizer", "adamw",
                                                     "--exclude-from-weight-decay", "z_bias"],
    "score option without =": lambda t: ["add-loss", f"{t}/m.onnx", "-o", f"{t}/o.onnx",
                                         "--loss-option", "delta"],
    "unknown target": lambda t: ["compile", _model(t), "-o", f"{t}/p", "--target", "mars"],
    "class weights not a JSON list": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                "--loss-option", "class_weight=[1, 2"],
    "balanced class weights without labels": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                        "--loss-option",
                                                        "class_weight=balanced"],
    "class weight labels without balanced": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                       "--class-weight-labels", _data(t)],
    "class weight labels not whole numbers": lambda t: [
        "compile", _model(t), "-o", f"{t}/p", "--loss-option", "class_weight=balanced",
        "--class-weight-labels", _file(t, "d.csv", b"a,y\n1,0.5\n2,1\n")],
    "class weight labels of a missing file": lambda t: [
        "compile", _model(t), "-o", f"{t}/p", "--loss-option", "class_weight=balanced",
        "--class-weight-labels", f"{t}/none.csv"],
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
    "one npy file": lambda t: ["train", _program(t), "--data", _npy(t), "-o", f"{t}/o.onnx"],
    "npz without the named array": lambda t: ["train", _program(t), "--data", _data(t),
                                              "--label", "target", "-o", f"{t}/o.onnx"],
    "csv without a label column": lambda t: ["train", _program(t), "--data",
                                             _file(t, "d.csv", b"a,b,c\n1,2,3\n"),
                                             "-o", f"{t}/o.onnx"],
    "csv unknown column": lambda t: ["train", _program(t), "--data", _csv(t), "--features",
                                     "a", "b", "q", "-o", f"{t}/o.onnx"],
    "csv with text in a cell": lambda t: ["train", _program(t), "--data",
                                          _file(t, "d.csv", b"a,b,c,y\n1,2,3,4\n1,2,x,4\n"),
                                          "--label", "y", "-o", f"{t}/o.onnx"],
    "csv with a short line": lambda t: ["train", _program(t), "--data",
                                        _file(t, "d.csv", b"a,b,c,y\n1,2,3,4\n1,2\n"),
                                        "-o", f"{t}/o.onnx"],
    "csv header only": lambda t: ["train", _program(t), "--data",
                                  _file(t, "d.csv", b"a,b,c,y\n"), "-o", f"{t}/o.onnx"],
    "empty csv": lambda t: ["train", _program(t), "--data", _file(t, "d.csv", b""),
                            "-o", f"{t}/o.onnx"],
    "binary file as csv": lambda t: ["train", _program(t), "--data",
                                     _file(t, "d.csv", b"\xff\xfe\x00\x01"), "-o",
                                     f"{t}/o.onnx"],
    "csv with too few features": lambda t: ["train", _program(t), "--data", _csv(t),
                                            "--features", "a", "b", "-o", f"{t}/o.onnx"],
    "csv label of one column for two": lambda t: ["train", _program(t), "--data", _csv(t),
                                                  "--features", "a", "b", "c", "--label", "y",
                                                  "-o", f"{t}/o.onnx"],
    "csv with a duplicate column": lambda t: ["train", _program(t), "--data",
                                              _file(t, "d.csv", b"a,a,c,y\n1,2,3,4\n"),
                                              "-o", f"{t}/o.onnx"],
    "csv value beyond float32": lambda t: ["train", _program(t), "--data",
                                           _file(t, "d.csv", b"a,b,c,y,z\n1,2,3,4,5\n"
                                                 b"2,1e39,4,5,6\n"), "--label", "y", "z",
                                           "-o", f"{t}/o.onnx"],
    "npz value beyond float32": lambda t: ["train", _program(t), "--data", _overflowing_npz(t),
                                           "-o", f"{t}/o.onnx"],
    "sample weights for a program without": lambda t: ["train", _program(t), "--data",
                                                       _csv(t), "--label", "y", "z",
                                                       "--sample-weight", "a", "-o",
                                                       f"{t}/o.onnx"],
    "a column both feature and label": lambda t: ["train", _program(t), "--data", _csv(t),
                                                  "--features", "a", "b", "y", "--label", "y",
                                                  "z", "-o", f"{t}/o.onnx"],
    "a feature column twice": lambda t: ["train", _program(t), "--data", _csv(t), "--features",
                                         "a", "a", "b", "--label", "y", "z", "-o",
                                         f"{t}/o.onnx"],
    "junk parquet": lambda t: ["train", _program(t), "--data", _file(t, "d.parquet", JUNK),
                               "-o", f"{t}/o.onnx"],
    "validation split of 1": lambda t: ["train", _program(t), "--data", _data(t),
                                        "--validation-split", "1", "-o", f"{t}/o.onnx"],
    "validation split of no row": lambda t: ["train", _program(t), "--data", _data(t),
                                             "--validation-split", "0.01", "-o", f"{t}/o.onnx"],
    "early stopping patience of 0": lambda t: ["train", _program(t), "--data", _data(t),
                                               "--validation-split", "0.2",
                                               "--early-stopping-patience", "0", "-o",
                                               f"{t}/o.onnx"],
    "early stopping on validation without a split": lambda t: [
        "train", _program(t), "--data", _data(t), "--early-stopping-patience", "3", "-o",
        f"{t}/o.onnx"],
    "an unknown metric": lambda t: ["train", _program(t), "--data", _data(t), "--metrics",
                                    "rsme", "-o", f"{t}/o.onnx"],
    "neither program nor resume": lambda t: ["train", "--data", _data(t), "-o", f"{t}/o.onnx"],
    "resume a missing checkpoint": lambda t: ["train", "--resume", f"{t}/ckpt", "--data",
                                              _data(t), "-o", f"{t}/o.onnx"],
    "resume a program folder": lambda t: ["train", "--resume", _program(t), "--data",
                                          _data(t), "-o", f"{t}/o.onnx"],
    "resume with another program": lambda t: ["train", _other_program(t), "--resume",
                                              _checkpoint(t), "--data", _data(t),
                                              "-o", f"{t}/o.onnx"],
    "history over the user's file": lambda t: ["train", _program(t), "--data", _data(t),
                                               "-o", f"{t}/o.onnx", "--history",
                                               _file(t, "h.json", b"{}")],
    "plot over the user's file": lambda t: ["train", _program(t), "--data", _data(t),
                                            "-o", f"{t}/o.onnx", "--plot",
                                            _file(t, "curve.png", b"\x89PNG\r\n\x1a\n")],
    "max steps negative": lambda t: ["train", _program(t), "--data", _data(t), "--max-steps",
                                     "-1", "-o", f"{t}/o.onnx"],
    "checkpoint every zero": lambda t: ["train", _program(t), "--data", _data(t),
                                        "--checkpoint-dir", f"{t}/ckpts", "--checkpoint-every",
                                        "0", "-o", f"{t}/o.onnx"],
    "keep last zero": lambda t: ["train", _program(t), "--data", _data(t), "--checkpoint-dir",
                                 f"{t}/ckpts", "--keep-last", "0", "-o", f"{t}/o.onnx"],
    "keep last without a checkpoint dir": lambda t: ["train", _program(t), "--data", _data(t),
                                                     "--keep-last", "2", "-o", f"{t}/o.onnx"],
    "checkpoint dir a file": lambda t: ["train", _program(t), "--data", _data(t),
                                        "--checkpoint-dir", _file(t, "c", b"x"), "-o",
                                        f"{t}/o.onnx"],
    "checkpoint dir of another run": lambda t: ["train", _program(t), "--data", _data(t),
                                                "--checkpoint-dir", _checkpoint_dir(t), "-o",
                                                f"{t}/o.onnx"],
    "csv log over the user's file": lambda t: ["train", _program(t), "--data", _data(t),
                                               "-o", f"{t}/o.onnx", "--log-csv",
                                               _file(t, "log.csv", b"a,b\n1,2\n")],
    "two outputs at one path": lambda t: ["train", _program(t), "--data", _data(t),
                                          "-o", f"{t}/o.onnx", "--history", f"{t}/o.onnx"],
    "export a missing folder": lambda t: ["export", f"{t}/ckpt", "-o", f"{t}/o.onnx"],
    "export junk": lambda t: ["export", _file(t, "j.onnx", JUNK), "-o", f"{t}/o.onnx"],
    "export corrupt manifest": lambda t: ["export", _broken_manifest(t), "-o", f"{t}/o.onnx"],
    "export over the user's file": lambda t: ["export", _program(t), "-o", _user_file(t)],
    "export with an unknown target": lambda t: ["export", _program(t), "-o", f"{t}/o.onnx",
                                                "--target", "mars"],
    # found by the fuzzer (tests/test_fuzz.py): onnx.load reads a .json file as JSON text
    "export to a json file": lambda t: ["export", _program(t), "-o", f"{t}/o.json"],
    "export neither the model nor adapters": lambda t: ["export", _program(t)],
    "export adapters of a program without": lambda t: ["export", _program(t), "--adapters",
                                                        f"{t}/a.safetensors"],
    "export adapters of an unknown format": lambda t: ["export", _lora_program(t), "--adapters",
                                                       f"{t}/a.pt"],
    "export a PEFT config beside another name": lambda t: ["export", _lora_program(t),
                                                           "--adapters", f"{t}/a.safetensors",
                                                           "--peft-config"],
    "export adapters over the user's file": lambda t: ["export", _lora_program(t), "--adapters",
                                                       _file(t, "a.npz", b"PK mine")],
    "compile LoRA of a rank too large": lambda t: ["compile", _model(t), "-o", f"{t}/p",
                                                   "--lora", "3"],
    "export --merge without -o": lambda t: ["export", _lora_program(t), "--adapters",
                                            f"{t}/a.npz", "--merge"],
    "export --merge of a quantized base": lambda t: ["export", _quantized_lora_program(t),
                                                     "--adapters", f"{t}/a.npz", "-o",
                                                     f"{t}/o.onnx", "--merge"],
    "train --merge of a quantized base": lambda t: ["train", _quantized_lora_program(t),
                                                    "--data", f"{t}/d4.npz", "-o", f"{t}/o.onnx",
                                                    "--merge"],
    # found by the fuzzer: onnx's InferenceError, exit 1
    "trainable of a domain not imported": lambda t: ["trainable", _unimported_domain(t)],
    "inspect of a domain not imported": lambda t: ["inspect", _unimported_domain(t)],
    "inspect junk": lambda t: ["inspect", _file(t, "j.onnx", JUNK)],
    "inspect a folder": lambda t: ["inspect", _program(t)],
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


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lossgraph", "trainable", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


# -- from a scikit-learn model to a trained model, as a user would --------------------------


def _linear_regression(path: Path, X: np.ndarray) -> None:
    """A scikit-learn LinearRegression fitted to other targets, converted by skl2onnx with
    its defaults, as docs/reference/cli.md says (skl2onnx 1.20: ai.onnx opset 22, listed
    twice, which compile lowers to the default target's 21)."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LinearRegression

    start = LinearRegression().fit(X, X @ np.array([0.2, 0.1, -0.3]) + 1.0)
    path.write_bytes(to_onnx(start, X[:1]).SerializeToString())


@needs_skl2onnx
def test_from_a_scikit_learn_model_to_a_trained_model_in_the_shell(tmp_path):
    import onnxruntime

    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 3)).astype(np.float32)
    y = (X @ np.array([1.5, -2.0, 0.5]) + 0.3).astype(np.float32)
    _linear_regression(tmp_path / "model.onnx", X)
    write_csv(tmp_path / "train.csv", {"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": y})

    table = ok(shell("inspect", "model.onnx", cwd=tmp_path))
    assert "ai.onnx.ml::LinearRegressor" in table and "lowered into standard ops" in table
    report = json.loads(ok(shell("inspect", "model.onnx", "--json", cwd=tmp_path)))
    assert report["trainable"] == ["coef", "intercept"]
    assert [(t["name"], t["shape"], t["origin"]) for t in report["initializers"]] == [
        ("coef", [1, 3], "lowered"), ("intercept", [1], "lowered")]

    ok(shell("compile", "model.onnx", "-o", "program", "--optimizer", "momentum",
             "--learning-rate", "0.05", "--fuse", "epoch", cwd=tmp_path))
    plot = ["--plot", "loss.png"] if installed("matplotlib") else []
    out = ok(shell("train", "program", "--data", "train.csv", "--epochs", "15", "--batch-size",
                   "16", "--validation-split", "0.25", "--random-state", "0", "-o",
                   "trained.onnx", "--checkpoint", "ckpt", "--history", "history.json",
                   "--no-progress", *plot, cwd=tmp_path))
    assert "losses by epoch:" in out and "validation losses by epoch:" in out
    first = json.loads((tmp_path / "history.json").read_text())
    assert first["format"] == "lossgraph-history/1" and first["epochs"] == 15
    assert len(first["train_loss"]) == len(first["validation_loss"]) == 15
    assert first["train_loss"][-1] < first["train_loss"][0] / 100
    assert first["steps"] == 15 * math.ceil(180 / 16)
    if plot:
        assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    # three more epochs from the checkpoint, over the outputs of the first run
    ok(shell("train", "--resume", "ckpt", "--data", "train.csv", "--epochs", "3",
             "--validation-split", "0.25", "-o", "trained.onnx", "--checkpoint", "ckpt",
             "--history", "history.json", *plot, cwd=tmp_path))
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["epochs"] == 18 and history["train_loss"][:15] == first["train_loss"]
    assert len(history["validation_loss"]) == 18 and history["resumed_from"] == "ckpt"

    # plain onnxruntime runs the trained model, which predicts as lossgraph's Trainer does
    session = onnxruntime.InferenceSession(str(tmp_path / "trained.onnx"),
                                           providers=["CPUExecutionProvider"])
    predicted = session.run(None, {"X": X})[0]
    trainer = Trainer.load_checkpoint(tmp_path / "ckpt")
    assert trainer.epochs_ == 18
    np.testing.assert_allclose(predicted, trainer.predict(X), rtol=1e-5, atol=1e-6)
    assert np.mean((predicted[180:, 0] - y[180:]) ** 2) < 1e-4

    if not export_has("save_inference_model"):
        pytest.skip("lossgraph.export.save_inference_model is not in this checkout yet: the "
                    "export step is untested")
    ok(shell("export", "ckpt", "-o", "deployed.onnx", cwd=tmp_path))
    deployed = onnxruntime.InferenceSession(str(tmp_path / "deployed.onnx"),
                                            providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(deployed.run(None, {"X": X})[0], predicted, rtol=1e-6, atol=1e-7)
    assert (tmp_path / "deployed.onnx").read_bytes() == (tmp_path / "trained.onnx").read_bytes()


CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"


def _walkthrough() -> list[list[str]]:
    """The commands of the walkthrough in docs/reference/cli.md (its first sh block)."""
    block = re.search(r"```sh\n(.*?)```", CLI_PAGE.read_text(), re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line)[1:] for line in lines if line.startswith("lossgraph ")]


@needs_skl2onnx
def test_the_walkthrough_in_the_docs_runs(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3)).astype(np.float32)
    y = (X @ np.array([1.5, -2.0, 0.5]) + 0.3 + 0.1 * rng.normal(size=500)).astype(np.float32)
    _linear_regression(tmp_path / "model.onnx", X)
    write_csv(tmp_path / "train.csv", {"a": X[:, 0], "b": X[:, 1], "c": X[:, 2], "y": y})
    monkeypatch.chdir(tmp_path)
    commands = _walkthrough()
    assert [argv[0] for argv in commands] == ["inspect", "compile", "train", "train", "export"]
    for argv in commands:
        if not installed("matplotlib") and "--plot" in argv:
            at = argv.index("--plot")
            argv = argv[:at] + argv[at + 2:]
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    said = capsys.readouterr().out
    assert "30 in all with those of ckpt" in said
    # what the page shows inspect and compile say of skl2onnx's default export
    page = CLI_PAGE.read_text()
    for line in ("compile: ai.onnx opset 22 lowered to 21: none of its ai.onnx ops changed in "
                 "between", "training output (compile's default, --loss auto): 'variable', "
                 "values (made by the Gemm node 'LinearRegressor/Gemm'), with loss squared_error",
                 "program: ai.onnx opset 22 lowered to 21"):
        assert line in said and line in page, line
    assert (tmp_path / "deployed.onnx").read_bytes() == (tmp_path / "trained.onnx").read_bytes()
    assert json.loads((tmp_path / "history.json").read_text())["epochs"] == 30


@pytest.mark.skipif(not export_has("save_inference_model"),
                    reason="lossgraph.export.save_inference_model is not in this checkout yet")
def test_export_writes_the_inference_model_of_a_program_or_checkpoint(model_file, tmp_path,
                                                                      run_model):
    X, y = two_output_data()
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program)]) == 0
    assert main(["train", str(program), "--data", str(tmp_path / "d.npz"), "--epochs", "3",
                 "-o", str(tmp_path / "trained.onnx"), "--checkpoint",
                 str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "from_ckpt.onnx")]) == 0
    assert main(["export", str(program), "-o", str(tmp_path / "initial.onnx")]) == 0
    trained = run_model(tmp_path / "trained.onnx", {"x": X})["y"]
    np.testing.assert_allclose(run_model(tmp_path / "from_ckpt.onnx", {"x": X})["y"], trained,
                               rtol=1e-6)
    initial = run_model(model_file, {"x": X})["y"]
    np.testing.assert_allclose(run_model(tmp_path / "initial.onnx", {"x": X})["y"], initial,
                               rtol=1e-6)
    # and never over a file lossgraph did not write, unless --force
    (tmp_path / "mine.onnx").write_bytes(b"mine")
    assert main(["export", str(program), "-o", str(tmp_path / "mine.onnx")]) == 2
    assert (tmp_path / "mine.onnx").read_bytes() == b"mine"
    assert main(["export", str(program), "-o", str(tmp_path / "mine.onnx"), "--force"]) == 0


def test_export_writes_the_lora_adapters_of_a_checkpoint_alone_or_with_the_model(
        tmp_path, capsys):
    X, y = query_data()
    np.savez(tmp_path / "d.npz", X=X, y=y)
    onnx.save(query_model(), tmp_path / "query.onnx")
    program = tmp_path / "program"
    assert main(["compile", str(tmp_path / "query.onnx"), "-o", str(program), "--lora",
                 "2", "--lora-targets", "query"]) == 0
    assert main(["train", str(program), "--data", str(tmp_path / "d.npz"), "--epochs", "2",
                 "-o", str(tmp_path / "trained.onnx"), "--checkpoint",
                 str(tmp_path / "ckpt")]) == 0
    adapters = tmp_path / "adapter" / "adapter_model.safetensors"
    adapters.parent.mkdir()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--adapters", str(adapters),
                 "--peft-config"]) == 0
    assert capsys.readouterr().out == (f"wrote {adapters} and "
                                       f"{adapters.with_name('adapter_config.json')}\n")
    assert main(["export", str(tmp_path / "ckpt"), "--adapters", str(tmp_path / "a.npz"),
                 "-o", str(tmp_path / "model.onnx")]) == 0
    checkpoint = Trainer.load_checkpoint(tmp_path / "ckpt")
    for path in (adapters, tmp_path / "a.npz"):
        fresh = TrainingProgram.load(program)
        for name, value in load_adapters(fresh, path).items():
            np.testing.assert_array_equal(value, checkpoint.state[name])
    assert (tmp_path / "model.onnx").read_bytes() == (tmp_path / "trained.onnx").read_bytes()
    # --merge: the adapters folded in, the base model's graph (train and export alike)
    assert main(["train", str(program), "--data", str(tmp_path / "d.npz"), "--epochs", "2",
                 "-o", str(tmp_path / "trained-merged.onnx"), "--merge"]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "merged.onnx"),
                 "--merge"]) == 0
    expected = checkpoint.to_inference_model(merge=True)
    for path in ("trained-merged.onnx", "merged.onnx"):
        merged = onnx.load(tmp_path / path)
        assert [n.op_type for n in merged.graph.node] == ["Gemm"]
        for ours, theirs in zip(merged.graph.initializer, expected.graph.initializer):
            np.testing.assert_allclose(onnx.numpy_helper.to_array(ours),
                                       onnx.numpy_helper.to_array(theirs), rtol=1e-5, atol=1e-6)


def test_export_keeps_large_weights_in_a_data_file_on_request(tmp_path, capsys, run_model):
    weight = np.arange(32 * 32, dtype=np.float32).reshape(32, 32) / 1000
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 32])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 32])],
        [onnx.numpy_helper.from_array(weight, "W")]),
        opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=8)
    onnx.save(model, tmp_path / "wide.onnx")
    assert main(["compile", str(tmp_path / "wide.onnx"), "-o", str(tmp_path / "program")]) == 0
    capsys.readouterr()
    output = tmp_path / "deployed.onnx"
    assert main(["export", str(tmp_path / "program"), "-o", str(output), "--external-data"]) == 0
    assert capsys.readouterr().out == f"wrote {output} and {output}.data\n"
    x = np.ones((2, 32), np.float32)
    np.testing.assert_allclose(run_model(output, {"x": x})["y"], x @ weight, rtol=1e-6)


# -- exit statuses and help -------------------------------------------------------------------


def test_an_internal_error_exits_1_with_one_line(model_file, capsys, monkeypatch):
    def broken(path):
        raise KeyError("a bug")

    monkeypatch.setattr("lossgraph.cli.inspection.inspect_model", broken)  # read when run
    monkeypatch.delenv("LOSSGRAPH_DEBUG", raising=False)
    assert main(["inspect", str(model_file)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("lossgraph inspect: internal error, please report it: KeyError: ")
    assert "LOSSGRAPH_DEBUG=1" in err

    monkeypatch.setenv("LOSSGRAPH_DEBUG", "1")
    assert main(["inspect", str(model_file)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith(
        "lossgraph inspect: internal error")


def test_warnings_are_one_line_like_errors(model_file, capsys, monkeypatch):
    def warns(report):
        warnings.warn("something odd\non two lines", UserWarning, stacklevel=1)
        return "table"

    monkeypatch.setattr("lossgraph.cli.inspection.format_inspection", warns)
    assert main(["inspect", str(model_file)]) == 0
    assert capsys.readouterr().err == "lossgraph inspect: warning: something odd on two lines\n"


def test_a_closed_stdout_ends_quietly(model_file, capsys, monkeypatch):
    def closed(report):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("lossgraph.cli.inspection.format_inspection", closed)
    assert main(["inspect", str(model_file)]) == 141
    assert capsys.readouterr().err == ""


def test_the_installed_command_shows_the_walkthrough_and_exit_statuses(tmp_path):
    help_ = shell("--help", cwd=tmp_path)
    assert help_.returncode == 0
    for step in ("lossgraph inspect", "lossgraph compile", "lossgraph train",
                 "lossgraph export", "exit status"):
        assert step in help_.stdout
    assert shell("--version", cwd=tmp_path).stdout.startswith("lossgraph ")


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
