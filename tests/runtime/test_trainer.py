"""Trainer behaviour: errors before work, divergence, checkpoints, streaming, export."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.linear import LINEAR, linear_data, linear_program

import lossgraph
from lossgraph.errors import (
    ConvergenceError,
    DTypeMismatchError,
    InvalidDataError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
)
from lossgraph.optim import SGD, Adam


@pytest.fixture(scope="module")
def data():
    return linear_data(205, seed=11)


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_training_reduces_the_loss_and_fit_returns_self(data, mode):
    X, y = data
    trainer = lossgraph.Trainer(linear_program(mode))
    assert trainer.fit(X, y, epochs=5, batch_size=20, random_state=0, progress=False) is trainer
    assert len(trainer.train_losses_) == 5
    assert trainer.train_losses_[-1] < 0.05 < trainer.train_losses_[0]


def test_validation_losses_are_recorded_per_epoch(data):
    X, y = data
    trainer = lossgraph.Trainer(linear_program()).fit(X[:150], y[:150], epochs=3, batch_size=25,
                                               validation_data=(X[150:], y[150:]),
                                               progress=False)
    assert len(trainer.validation_losses_) == 3
    assert trainer.validation_losses_[-1] == pytest.approx(trainer.evaluate(X[150:], y[150:]))


def test_a_non_finite_validation_loss_warns_and_is_recorded(data):
    """Validation features far outside the training ones (1e37 times them) overflow the
    squared error: the loss is recorded as it is, with a ValidationLossWarning."""
    from lossgraph.errors import LossgraphWarning, ValidationLossWarning

    X, y = data
    with pytest.warns(ValidationLossWarning, match="validation loss after epoch 0 is inf"):
        trainer = lossgraph.Trainer(linear_program()).fit(
            X[:150], y[:150], epochs=2, batch_size=25, progress=False,
            validation_data=(X[150:] * np.float32(1e37), y[150:]))
    assert trainer.validation_losses_ == [np.inf, np.inf]
    assert issubclass(ValidationLossWarning, LossgraphWarning)


def test_a_callback_returning_true_stops_training(data):
    X, y = data
    seen = []
    trainer = lossgraph.Trainer(linear_program()).fit(
        X, y, epochs=10, progress=False,
        callbacks=[lambda t, epoch, logs: seen.append(epoch) or epoch == 2])
    assert seen == [0, 1, 2] and trainer.epochs_ == 3


def test_warm_start_continues_where_the_last_fit_stopped(data):
    X, y = data
    once = lossgraph.Trainer(linear_program()).fit(X, y, epochs=2, batch_size=30, shuffle=True,
                                            random_state=4, progress=False)
    twice = lossgraph.Trainer(linear_program())
    twice.fit(X, y, epochs=1, batch_size=30, shuffle=True, random_state=4, progress=False)
    twice.fit(X, y, epochs=1, batch_size=30, shuffle=True, warm_start=True, progress=False)
    assert twice.train_losses_ == once.train_losses_
    np.testing.assert_array_equal(twice.state["coef"], once.state["coef"])


def test_a_cold_fit_restarts_from_the_programs_state(data):
    X, y = data
    trainer = lossgraph.Trainer(linear_program())
    first = trainer.fit(X, y, epochs=1, random_state=1, progress=False).state
    second = trainer.fit(X, y, epochs=1, random_state=1, progress=False).state
    np.testing.assert_array_equal(first["coef"], second["coef"])


@pytest.mark.parametrize("mode", ["step", "epoch"])
def test_checkpoint_resume_equals_an_uninterrupted_fit(data, tmp_path, mode):
    X, y = data
    straight = lossgraph.Trainer(linear_program(mode, Adam(0.01))).fit(
        X, y, epochs=4, batch_size=32, random_state=5, progress=False)
    first = lossgraph.Trainer(linear_program(mode, Adam(0.01))).fit(
        X, y, epochs=2, batch_size=32, random_state=5, progress=False)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt")
    resumed.fit(X, y, epochs=2, batch_size=32, warm_start=True, progress=False)
    assert resumed.train_losses_ == pytest.approx(straight.train_losses_, rel=1e-6)
    for name, value in straight.state.items():
        np.testing.assert_allclose(resumed.state[name], value, rtol=1e-6, err_msg=name)


def test_predict_equals_the_exported_inference_model(data, run_model):
    X, y = data
    trainer = lossgraph.Trainer(linear_program()).fit(X, y, epochs=2, progress=False)
    exported = trainer.to_inference_model()
    assert not {i.name for i in exported.graph.input} & {"coef", "intercept"}
    # Equal to float rounding: onnxruntime prepacks the exported (constant) weights for
    # another GEMM kernel than the one it runs on weights given as inputs.
    np.testing.assert_allclose(run_model(exported, {"x": X})["y"], trainer.predict(X),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(trainer.predict(X), lossgraph.Trainer(linear_program()).predict(X))


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_streaming_batches_equal_array_training(data, mode):
    X, y = data
    from_arrays = lossgraph.Trainer(linear_program(mode)).fit(X, y, epochs=2, batch_size=50,
                                                       shuffle=False, progress=False)

    def batches():
        for lo in range(0, len(X), 50):
            yield X[lo:lo + 50], y[lo:lo + 50]

    streamed = lossgraph.Trainer(linear_program(mode)).fit(batches, epochs=2, progress=False)
    np.testing.assert_allclose(streamed.state["coef"], from_arrays.state["coef"], rtol=1e-6)
    assert streamed.train_losses_ == pytest.approx(from_arrays.train_losses_)


def test_a_one_shot_generator_cannot_feed_two_epochs(data):
    X, y = data
    generator = ((X[i:i + 50], y[i:i + 50]) for i in range(0, len(X), 50))
    with pytest.raises(InvalidDataError, match="function that returns a new iterator"):
        lossgraph.Trainer(linear_program()).fit(generator, epochs=2, progress=False)


def test_a_fresh_generator_feeds_a_warm_start_fit(data):
    X, y = data

    def batches():
        return ((X[i:i + 50], y[i:i + 50]) for i in range(0, len(X), 50))

    trainer = lossgraph.Trainer(linear_program()).fit(batches(), epochs=1, progress=False)
    trainer.fit(batches(), epochs=1, warm_start=True, progress=False)
    assert trainer.epochs_ == 2 and len(trainer.train_losses_) == 2


def test_separate_mode_takes_a_chosen_label_name(data):
    X, y = data
    prog = linear_program("separate", loss_options={"label_name": "target"})
    assert prog.manifest["roles"]["label"] == "target"
    trainer = lossgraph.Trainer(prog).fit(X, y, epochs=2, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def test_sample_weights_weigh_rows(data):
    X, y = data
    weighted = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), fuse="step",
                                 loss_options={"weight_name": "w"}, optimizer=SGD(0.05))
    w = np.where(np.arange(len(X)) % 2 == 0, 1.0, 0.0).astype(np.float32)
    a = lossgraph.Trainer(weighted).fit(X, y, sample_weight=w, epochs=1, batch_size=len(X),
                                        shuffle=False, progress=False)
    b = lossgraph.Trainer(linear_program(optimizer=SGD(0.05))).fit(X[::2], y[::2], epochs=1,
                                                           batch_size=len(X), progress=False)
    np.testing.assert_allclose(a.state["coef"], b.state["coef"], rtol=1e-5)


# -- errors --------------------------------------------------------------------------------------


def test_divergence_raises_and_keeps_the_last_good_weights(data):
    X, y = data
    trainer = lossgraph.Trainer(linear_program(optimizer=SGD(1e6)))
    with pytest.raises(ConvergenceError, match="epoch 0, batch \\d+.*smaller learning rate"):
        trainer.fit(X * 1e3, y, epochs=1, batch_size=10, shuffle=False, progress=False)
    assert all(np.isfinite(v).all() for v in trainer.state.values())


def test_divergence_in_a_fused_epoch_restores_the_epoch_start(data):
    X, y = data
    trainer = lossgraph.Trainer(linear_program("epoch", SGD(1e6)))
    before = trainer.state
    with pytest.raises(ConvergenceError, match="start of the failing epoch"):
        trainer.fit(X * 1e3, y, epochs=1, batch_size=10, shuffle=False, progress=False)
    np.testing.assert_array_equal(trainer.state["coef"], before["coef"])


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_divergence_keeps_the_last_state_whose_loss_was_finite(data, mode):
    """Full-batch steps: the failing step's loss is computed at the state the step before
    made, so that state diverged already; the one before it is kept, scores a finite
    loss, is named in the message, and training resumes from it."""
    X, y = data
    X = X * 30
    trainer = lossgraph.Trainer(linear_program(mode, SGD(0.5)))
    with pytest.raises(ConvergenceError) as error:
        trainer.fit(X, y, epochs=50, batch_size=len(X), shuffle=False, progress=False)
    kept = trainer.steps_
    assert f"before step {kept + 1} (epoch {kept}, batch 0), the last whose loss was finite" \
        in str(error.value)
    assert np.isfinite(trainer.evaluate(X, y))
    again = lossgraph.Trainer(linear_program(mode, SGD(0.5))).fit(
        X, y, epochs=kept, batch_size=len(X), shuffle=False, progress=False)
    for name, value in again.state.items():
        np.testing.assert_array_equal(trainer.state[name], value)
    trainer.fit(X, y, epochs=2, batch_size=len(X), warm_start=True, progress=False,
                epoch_learning_rate=lambda epoch: 1e-6)
    assert trainer.steps_ == kept + 2 and np.isfinite(trainer.train_losses_[-1])


@pytest.mark.parametrize("mode", ["separate", "step"])
def test_without_the_previous_state_divergence_keeps_the_failing_steps_input(data, mode):
    """Two buffer sets (a large model's default): the state before the last step is gone,
    so the weights kept are those the failing step read, and the message says so."""
    X = data[0] * 30
    trainer = lossgraph.Trainer(linear_program(mode, SGD(0.5)), keep_previous_state=False)
    with pytest.raises(ConvergenceError, match="those the failing step read.*"
                       "keep_previous_state=True"):
        trainer.fit(X, data[1], epochs=50, batch_size=len(X), shuffle=False, progress=False)
    again = lossgraph.Trainer(linear_program(mode, SGD(0.5))).fit(
        X, data[1], epochs=trainer.steps_, batch_size=len(X), shuffle=False, progress=False)
    for name, value in again.state.items():
        np.testing.assert_array_equal(trainer.state[name], value)


def test_nan_in_the_data_is_named_by_row(data):
    X, y = data
    X = X.copy()
    X[37, 2] = np.nan
    with pytest.raises(InvalidDataError, match="row 37"):
        lossgraph.Trainer(linear_program()).fit(X, y, batch_size=10, shuffle=False, progress=False)


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"X": "overflowing"}, InvalidDataError, "row 3, column 1, beyond the range of float32"),
    ({"X": "text"}, DTypeMismatchError, "not numbers"),
    ({"X": "wide"}, ShapeMismatchError, "\\(N, 4\\)"),
    ({"y": "short"}, ShapeMismatchError, "different numbers of rows"),
    ({"sample_weight": True}, UnsupportedOptionError, "weight_name"),
    ({"batch_size": 0}, UnsupportedOptionError, "batch_size"),
    ({"X": "empty"}, InvalidDataError, "no rows"),
])
def test_bad_data_is_rejected_before_any_work(data, kwargs, error, pattern):
    X, y = data
    overflowing = X.astype(np.float64)
    overflowing[3, 1] = 1e39
    variants = {"overflowing": overflowing, "text": X.astype(str),
                "wide": np.ones((len(X), 5), np.float32),
                "empty": X[:0], "short": y[:-1]}
    call = {"X": X, "y": y, "batch_size": 10}
    for key, value in kwargs.items():
        call[key] = variants.get(value, value) if isinstance(value, str) else value
    if call.get("sample_weight") is True:
        call["sample_weight"] = np.ones(len(X), np.float32)
    if kwargs.get("X") == "empty":
        call["y"] = y[:0]
    trainer = lossgraph.Trainer(linear_program())
    before = trainer.state
    with pytest.raises(error, match=pattern):
        trainer.fit(progress=False, **call)
    np.testing.assert_array_equal(trainer.state["coef"], before["coef"])
    assert trainer.steps_ == 0


def test_set_state_checks_names_and_shapes():
    trainer = lossgraph.Trainer(linear_program())
    with pytest.raises(UnknownNameError, match="Did you mean 'coef'"):
        trainer.set_state({"cof": np.zeros((4, 1), np.float32)})
    with pytest.raises(ShapeMismatchError, match="float32\\[4, 1\\]"):
        trainer.set_state({"coef": np.zeros(4, np.float32)})
    trainer.set_state({"coef": np.ones((4, 1), np.float32)})
    np.testing.assert_array_equal(trainer.state["coef"], np.ones((4, 1)))


def test_progress_bar_runs(data, capsys):
    X, y = data
    lossgraph.Trainer(linear_program()).fit(X, y, epochs=2, progress=True)
    assert "lossgraph" in capsys.readouterr().err


@pytest.mark.training
@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_ort_gradient_backend_trains_like_the_onnx_backend(data, mode):
    X, y = data
    ours = lossgraph.Trainer(linear_program(mode, Adam(0.01))).fit(X, y, epochs=2, random_state=0,
                                                            progress=False)
    theirs = lossgraph.Trainer(linear_program(mode, Adam(0.01), backend="ort")).fit(
        X, y, epochs=2, random_state=0, progress=False)
    np.testing.assert_allclose(theirs.state["coef"], ours.state["coef"], rtol=1e-5, atol=1e-6)
