"""Labels in one column: an ``(N, 1)`` array where the model's label is ``(N,)`` (the form
onnxcustom's examples pass, ``y.reshape((-1, 1))``) and an ``(N,)`` array where it is
``(N, 1)``, at every entry point that reads labels: ``Trainer.fit`` (arrays, validation
data, streamed batches), ``Trainer.score``, both onnxcustom estimators (``fit``,
``partial_fit``, ``score``, ``losses``) and the command line's data files. Anything else
(two columns for one, a trailing axis on a label that is not ``(N,)``) stays an error.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.linear import linear_text

import lossgraph
from lossgraph import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer, Trainer
from lossgraph.cli import main
from lossgraph.errors import ShapeMismatchError

#: The linear model under scikit-learn's names, its score (N, 1) or flat (N,).
SCORE_MODEL = linear_text(x="X", y="score")
FLAT_MODEL = linear_text(x="X", y="score", flat=True)


def score_model() -> onnx.ModelProto:
    return onnx.parser.parse_model(SCORE_MODEL)


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4)).astype(np.float32)
    classes = (X[:, 0] - X[:, 1] > 0).astype(np.int64)
    return X, classes


def label_spec(program: lossgraph.TrainingProgram) -> list:
    label = program.manifest["roles"]["label"]
    return next(i["shape"] for i in program.manifest["graphs"]["evaluate"]["inputs"]
                if i["name"] == label)


def test_trainer_takes_class_labels_of_shape_n_1_for_a_label_of_shape_n(data):
    X, y = data
    program = lossgraph.compile_program(score_model(), loss="logistic")
    assert label_spec(program) == ["N"]
    flat = Trainer(program).fit(X, y, epochs=2, batch_size=16, random_state=0,
                                validation_data=(X, y), progress=False)
    column = Trainer(program).fit(X, y.reshape(-1, 1), epochs=2, batch_size=16,
                                  random_state=0, validation_data=(X, y.reshape(-1, 1)),
                                  progress=False)
    assert column.train_losses_ == flat.train_losses_
    assert column.validation_losses_ == flat.validation_losses_
    assert column.evaluate(X, y.reshape(-1, 1)) == flat.evaluate(X, y)
    # streamed batches, each in one column
    batches = [(X[i:i + 20], y[i:i + 20].reshape(-1, 1)) for i in range(0, 60, 20)]
    streamed = Trainer(program).fit(batches, epochs=1, progress=False)
    by_rows = Trainer(program).fit(X, y, epochs=1, batch_size=20, shuffle=False,
                                   progress=False)
    assert streamed.train_losses_ == by_rows.train_losses_


def test_trainer_takes_float_labels_in_one_column_for_a_flat_prediction(data):
    X, _ = data
    y = (X @ np.float32([1, -1, 0.5, 0]) + 0.3).astype(np.float32)
    program = lossgraph.compile_program(onnx.parser.parse_model(FLAT_MODEL))
    assert label_spec(program) == ["N"]
    flat = Trainer(program).fit(X, y, epochs=2, batch_size=16, random_state=0, progress=False)
    column = Trainer(program).fit(X, y.reshape(-1, 1), epochs=2, batch_size=16,
                                  random_state=0, progress=False)
    assert column.train_losses_ == flat.train_losses_
    assert column.evaluate(X, y.reshape(-1, 1)) == flat.evaluate(X, y)
    # the other way, an (N,) array for an (N, 1) label, as before
    program = lossgraph.compile_program(score_model())
    assert label_spec(program) == ["N", 1]
    assert Trainer(program).evaluate(X, y) == Trainer(program).evaluate(X, y.reshape(-1, 1))


@pytest.mark.parametrize("shape", [(60, 2), (60, 1, 1)])
def test_labels_that_are_not_one_column_are_still_refused(data, shape):
    X, _ = data
    program = lossgraph.compile_program(score_model(), loss="logistic")
    with pytest.raises(ShapeMismatchError, match=r"y has shape .* int64 of shape \(N,\)"):
        Trainer(program).fit(X, np.zeros(shape, np.int64), progress=False)


def test_the_forward_backward_optimizer_takes_labels_in_one_column(data):
    X, y = data
    column = y.reshape(-1, 1)

    def estimator():
        return OrtGradientForwardBackwardOptimizer(score_model(), learning_loss="log",
                                                   max_iter=3, batch_size=16, random_state=0)

    flat, ours = estimator().fit(X, y, X_val=X, y_val=y), estimator().fit(
        X, column, X_val=X, y_val=column)
    assert ours.train_losses_ == flat.train_losses_
    assert ours.validation_losses_ == flat.validation_losses_
    assert ours.score(X, column) == flat.score(X, y)
    np.testing.assert_array_equal(ours.losses(X, column), flat.losses(X, y))
    partial = estimator().partial_fit(X, column, classes=[0, 1])
    assert partial.train_losses_ == flat.train_losses_[:1]


def test_the_whole_graph_optimizer_takes_labels_in_one_column(data):
    X, y = data
    column = y.reshape(-1, 1)
    model = lossgraph.add_loss_output(score_model(), score_name="logistic")

    def estimator():
        return OrtGradientOptimizer(model, None, max_iter=3, batch_size=16, random_state=0)

    flat, ours = estimator().fit(X, y, X_val=X, y_val=y), estimator().fit(
        X, column, X_val=X, y_val=column)
    assert ours.train_losses_ == flat.train_losses_
    assert ours.validation_losses_ == flat.validation_losses_
    assert ours.score(X, column) == flat.score(X, y)
    assert estimator().partial_fit(X, column).train_losses_ == flat.train_losses_[:1]


def test_the_command_line_reads_labels_in_one_column(data, tmp_path):
    X, y = data
    model = tmp_path / "score.onnx"
    onnx.save(score_model(), model)
    program = tmp_path / "program"
    assert main(["compile", str(model), "-o", str(program), "--loss", "logistic"]) == 0
    trained = {}
    for name, labels in (("flat", y), ("column", y.reshape(-1, 1))):
        np.savez(tmp_path / f"{name}.npz", X=X, y=labels)
        trained[name] = tmp_path / f"{name}.onnx"
        assert main(["train", str(program), "--data", str(tmp_path / f"{name}.npz"),
                     "--epochs", "2", "--batch-size", "16", "--random-state", "0",
                     "-o", str(trained[name])]) == 0
    weights = {name: {t.name: onnx.numpy_helper.to_array(t)
                      for t in onnx.load(path).graph.initializer}
               for name, path in trained.items()}
    for weight, value in weights["flat"].items():
        np.testing.assert_array_equal(weights["column"][weight], value)
