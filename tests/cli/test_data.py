"""The training data files of lossgraph train (lossgraph/cli/data.py): .npz, a folder of .npy,
.csv and .parquet read alike; columns chosen for features, label and sample weight; arrays
named by options; the validation split; what is refused."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.cli import (
    initializers,
    initializers_of,
    program_folder,
    two_output_data,
    write_csv,
    write_file,
)
from support.linear import linear_data, linear_model

from lossgraph import TrainingProgram
from lossgraph.cli import main
from lossgraph.runtime import Trainer


def test_training_data_without_labels_is_a_clear_error(model_file, tmp_path, capsys):
    program_dir = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program_dir)]) == 0
    np.savez(tmp_path / "data.npz", X=np.ones((3, 3), np.float32))
    assert main(["train", str(program_dir), "--data", str(tmp_path / "data.npz"),
                 "-o", str(tmp_path / "out.onnx")]) == 2
    assert "needs arrays named X and y" in capsys.readouterr().err


def _save_data(kind: str, folder: Path, X: np.ndarray, y: np.ndarray) -> tuple[Path, list[str]]:
    """The data in the format ``kind``, and the options that name its columns."""
    columns = {"f1": X[:, 0], "f2": X[:, 1], "f3": X[:, 2], "t1": y[:, 0], "t2": y[:, 1]}
    if kind == "npz":
        np.savez(folder / "d.npz", X=X, y=y)
        return folder / "d.npz", []
    if kind == "npy folder":
        (folder / "arrays").mkdir()
        np.save(folder / "arrays" / "X.npy", X)
        np.save(folder / "arrays" / "y.npy", y)
        return folder / "arrays", []
    if kind == "csv":
        write_csv(folder / "d.csv", columns)
        return folder / "d.csv", ["--label", "t1", "t2"]
    pyarrow = pytest.importorskip("pyarrow", reason="needs pyarrow (pip install pyarrow)")
    parquet = importlib.import_module("pyarrow.parquet")
    parquet.write_table(pyarrow.table(columns), folder / "d.parquet")
    return folder / "d.parquet", ["--label", "t1", "t2"]


@pytest.mark.parametrize("kind", ["npy folder", "csv", "parquet"])
def test_train_reads_npz_npy_csv_and_parquet_alike(model_file, tmp_path, kind):
    X, y = two_output_data()
    program = str(tmp_path / "program")
    assert main(["compile", str(model_file), "-o", program, "--optimizer", "adam"]) == 0
    reference, _ = _save_data("npz", tmp_path, X, y)
    assert main(["train", program, "--data", str(reference), "--epochs", "3",
                 "--random-state", "0", "-o", str(tmp_path / "npz.onnx")]) == 0
    data, options = _save_data(kind, tmp_path, X, y)
    assert main(["train", program, "--data", str(data), *options, "--epochs", "3",
                 "--random-state", "0", "-o", str(tmp_path / "other.onnx")]) == 0
    expected = initializers(tmp_path / "npz.onnx")
    for name, value in initializers(tmp_path / "other.onnx").items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_csv_columns_choose_features_label_and_sample_weight(model_file, tmp_path):
    X, y = two_output_data()
    weight = np.linspace(0.5, 2.0, len(X)).astype(np.float32)
    write_csv(tmp_path / "d.csv", {"id": np.arange(len(X)), "t1": y[:, 0], "f1": X[:, 0],
                                    "f2": X[:, 1], "f3": X[:, 2], "t2": y[:, 1], "w": weight})
    program = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program), "--weight-name",
                 "sample_weight"]) == 0
    assert main(["train", str(program), "--data", str(tmp_path / "d.csv"), "--features", "f1",
                 "f2", "f3", "--label", "t1", "t2", "--sample-weight", "w", "--epochs", "2",
                 "--no-shuffle", "-o", str(tmp_path / "out.onnx")]) == 0
    trainer = Trainer(TrainingProgram.load(program))
    trainer.fit(X, y, sample_weight=weight, epochs=2, shuffle=False)
    expected = initializers_of(trainer.to_inference_model())
    for name, value in initializers(tmp_path / "out.onnx").items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, err_msg=name)


def test_a_sample_weight_column_is_used_when_the_program_takes_one(model_file, tmp_path,
                                                                   capsys):
    X, y = two_output_data()
    weight = np.linspace(0.5, 2.0, len(X)).astype(np.float32)
    write_csv(tmp_path / "d.csv", {"f1": X[:, 0], "f2": X[:, 1], "f3": X[:, 2],
                                    "sample_weight": weight, "y1": y[:, 0], "y2": y[:, 1]})
    train = ["--data", str(tmp_path / "d.csv"), "--label", "y1", "y2", "--no-shuffle"]
    weighted, plain = tmp_path / "weighted", tmp_path / "plain"
    assert main(["compile", str(model_file), "-o", str(weighted), "--weight-name", "w"]) == 0
    assert main(["compile", str(model_file), "-o", str(plain)]) == 0
    assert main(["train", str(weighted), *train, "-o", str(tmp_path / "w.onnx")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["train", str(plain), *train, "-o", str(tmp_path / "p.onnx")]) == 0
    assert "holds sample weights ('sample_weight'), but the program has no sample-weight " \
           "input" in capsys.readouterr().err
    for program, output, weights in ((weighted, "w.onnx", weight), (plain, "p.onnx", None)):
        trainer = Trainer(TrainingProgram.load(program))
        trainer.fit(X, y, sample_weight=weights, shuffle=False)
        expected = initializers_of(trainer.to_inference_model())
        for name, value in initializers(tmp_path / output).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-6, err_msg=name)


def test_npz_arrays_named_by_options(model_file, tmp_path):
    X, y = two_output_data()
    np.savez(tmp_path / "d.npz", inputs=X, targets=y)
    program = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program)]) == 0
    assert main(["train", str(program), "--data", str(tmp_path / "d.npz"), "--features",
                 "inputs", "--label", "targets", "-o", str(tmp_path / "out.onnx")]) == 0


def test_validation_split_holds_out_the_last_rows(model_file, tmp_path):
    X, y = two_output_data(rows=40)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    program = tmp_path / "program"
    assert main(["compile", str(model_file), "-o", str(program)]) == 0
    assert main(["train", str(program), "--data", str(tmp_path / "d.npz"), "--epochs", "2",
                 "--validation-split", "0.25", "--random-state", "3", "-o",
                 str(tmp_path / "out.onnx"), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    resumed = Trainer.load_checkpoint(tmp_path / "ckpt")
    assert resumed.validation_losses_[-1] == pytest.approx(resumed.evaluate(X[30:], y[30:]),
                                                           rel=1e-5)
    trainer = Trainer(TrainingProgram.load(program))
    trainer.fit(X[:30], y[:30], epochs=2, random_state=3, validation_data=(X[30:], y[30:]))
    assert trainer.train_losses_ == resumed.train_losses_


def test_parquet_without_pyarrow_is_a_one_line_error(model_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    argv = ["train", program_folder(tmp_path), "--data", write_file(tmp_path, "d.parquet", b"PAR1"),
            "-o", str(tmp_path / "o.onnx")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install pyarrow" in err


def test_lossgraph_train_takes_float64_npz_and_npy_data(tmp_path):
    """float64 arrays (an .npz, a folder of .npy) train as their float32 values do, converted
    as the Trainer converts them (tests/test_data.py)."""
    model = tmp_path / "linear.onnx"
    onnx.save(linear_model(), model)
    assert main(["compile", str(model), "-o", str(tmp_path / "program")]) == 0
    X, y = linear_data(120, seed=5)
    np.savez(tmp_path / "f32.npz", X=X, y=y)
    np.savez(tmp_path / "f64.npz", X=X.astype(np.float64), y=y.astype(np.float64))
    (tmp_path / "f64").mkdir()
    np.save(tmp_path / "f64" / "X.npy", X.astype(np.float64))
    np.save(tmp_path / "f64" / "y.npy", y.astype(np.float64))
    weights = {}
    for data in ("f32.npz", "f64.npz", "f64"):
        output = tmp_path / f"{data}.onnx"
        assert main(["train", str(tmp_path / "program"), "--data", str(tmp_path / data),
                     "--random-state", "0", "--epochs", "2", "-o", str(output)]) == 0
        weights[data] = {t.name: onnx.numpy_helper.to_array(t)
                         for t in onnx.load(output).graph.initializer}
    for data in ("f64.npz", "f64"):
        for name, value in weights["f32.npz"].items():
            np.testing.assert_array_equal(weights[data][name], value)
