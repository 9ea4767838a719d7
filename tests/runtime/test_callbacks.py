"""Callbacks at every step and epoch, max_steps and the loggers (lossgraph/runtime/callbacks.py),
against a numpy reference run of the same minibatch SGD, in every fusion mode."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from support.linear import COEF, INTERCEPT, linear_data, linear_program

import lossgraph
from lossgraph.errors import UnsafeWriteError, UnsupportedOptionError
from lossgraph.optim import SGD
from lossgraph.runtime.callbacks import Callback, CSVLogger, Loop, as_callbacks

MODES = ["step", "epoch", "separate"]
RATE, BATCH, SEED = 0.05, 50, 3


@pytest.fixture(scope="module")
def data():
    return linear_data(230, seed=7)  # 4 full batches of 50 and one of 30 an epoch


def reference_steps(X, y, steps: int, shuffle: bool = True):
    """Each step's loss (mean squared error) and the weights after ``steps`` updates of
    SGD(RATE) on the linear model, in float64, with the Trainer's shuffling: one
    permutation an epoch from ``default_rng(SEED)``."""
    coef = np.array(COEF, np.float64).reshape(-1, 1)
    intercept = np.array([INTERCEPT], np.float64)
    rng, losses = np.random.default_rng(SEED), []
    while len(losses) < steps:
        order = rng.permutation(len(X)) if shuffle else np.arange(len(X))
        for lo in range(0, len(X), BATCH):
            if len(losses) == steps:
                break
            xb = X[order[lo:lo + BATCH]].astype(np.float64)
            d = xb @ coef + intercept - y[order[lo:lo + BATCH]].reshape(-1, 1)
            losses.append(float((d**2).mean()))
            coef = coef - RATE * 2 * xb.T @ d / len(xb)
            intercept = intercept - RATE * 2 * d.sum(axis=0) / len(xb)
    return np.array(losses), coef, intercept


class Recorder(Callback):
    """Every hook's call, in order."""

    def __init__(self, stop_at_step: int | None = None) -> None:
        self.events: list[tuple] = []
        self.steps: dict[int, dict] = {}
        self.stop_at_step = stop_at_step

    def on_train_begin(self, trainer, logs):
        self.events.append(("begin", trainer.steps_))

    def on_step_end(self, trainer, step, logs):
        self.steps[step] = logs
        self.events.append(("step", step))
        return step == self.stop_at_step

    def on_epoch_end(self, trainer, epoch, logs):
        self.events.append(("epoch", epoch, trainer.steps_))

    def on_train_end(self, trainer, logs):
        self.events.append(("end", trainer.steps_))


def fit(mode: str, X, y, callbacks=(), **options) -> lossgraph.Trainer:
    options = {"batch_size": BATCH, "random_state": SEED, "progress": False, **options}
    return lossgraph.Trainer(linear_program(mode, SGD(RATE))).fit(X, y, callbacks=list(callbacks),
                                                                  **options)


@pytest.mark.parametrize("mode", MODES)
def test_step_callbacks_see_every_steps_loss_of_a_reference_run(data, mode):
    """Two shuffled epochs: each step's loss, rate, epoch and batch; in fuse="epoch" the
    epoch graph's per-step losses, handed to the hooks after its run."""
    X, y = data
    recorder = Recorder()
    trainer = fit(mode, X, y, [recorder], epochs=2)
    expected, _, _ = reference_steps(X, y, 10)
    assert sorted(recorder.steps) == list(range(1, 11))
    losses = [recorder.steps[s]["loss"] for s in range(1, 11)]
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    assert {s["learning_rate"] for s in recorder.steps.values()} == {RATE}
    assert [(s["epoch"], s["batch"]) for s in recorder.steps.values()] == [
        (e, b) for e in range(2) for b in range(5)]
    sizes = np.array([50, 50, 50, 50, 30])
    np.testing.assert_allclose(trainer.train_losses_,
                               np.reshape(losses, (2, 5)) @ sizes / sizes.sum(), rtol=1e-12)
    assert recorder.events == [("begin", 0), *[("step", s) for s in range(1, 6)], ("epoch", 0, 5),
                               *[("step", s) for s in range(6, 11)], ("epoch", 1, 10),
                               ("end", 10)]


@pytest.mark.parametrize("mode", MODES)
def test_max_steps_stops_at_exactly_that_update(data, mode):
    """Seven updates: one epoch and two batches of the next (in fuse="epoch", a run of the
    epoch graph over two batches), the weights those of seven reference steps."""
    X, y = data
    recorder = Recorder()
    trainer = fit(mode, X, y, [recorder], max_steps=7)
    expected, coef, intercept = reference_steps(X, y, 7)
    assert trainer.steps_ == 7 and trainer.epochs_ == 2 and sorted(recorder.steps) == [*range(1, 8)]
    np.testing.assert_allclose([recorder.steps[s]["loss"] for s in range(1, 8)], expected,
                               rtol=2e-5)
    np.testing.assert_allclose(trainer.state["coef"], coef, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.state["intercept"], intercept, rtol=2e-5, atol=1e-6)
    assert trainer.train_losses_[1] == pytest.approx(np.mean(expected[5:]), rel=2e-5)
    assert recorder.events[-2:] == [("epoch", 1, 7), ("end", 7)]


def test_epochs_and_max_steps_stop_at_whichever_comes_first(data):
    X, y = data
    assert fit("step", X, y, epochs=1, max_steps=100).steps_ == 5
    assert fit("epoch", X, y, epochs=3, max_steps=12).steps_ == 12
    assert fit("step", X, y, max_steps=0).epochs_ == 0
    trainer = fit("step", X, y, max_steps=3)
    trainer.fit(X, y, max_steps=3, warm_start=True)  # counts this fit's updates
    assert trainer.steps_ == 6


@pytest.mark.parametrize("mode, stopped", [("step", 2), ("separate", 2), ("epoch", 4)])
def test_a_step_callback_stops_training(data, mode, stopped):
    """A step hook returning True stops at once where steps run one by one; in fuse="epoch"
    after the epoch graph's run (its four full batches), every step of which the hooks
    saw, and before the epoch's last, short batch."""
    X, y = data
    recorder = Recorder(stop_at_step=2)
    trainer = fit(mode, X, y, [recorder], epochs=3)
    assert trainer.steps_ == stopped and trainer.epochs_ == 1
    assert sorted(recorder.steps) == list(range(1, stopped + 1))
    assert recorder.events[-2:] == [("epoch", 0, stopped), ("end", stopped)]


def test_callbacks_without_a_step_hook_build_no_step_logs():
    """The fast path: plain functions, epoch-only callbacks and an epoch CSV log watch no
    step, so the loop builds nothing per step."""

    class EpochOnly(Callback):
        def on_epoch_end(self, trainer, epoch, logs):
            return None

    assert not Loop(as_callbacks([print, EpochOnly()])).watches_steps
    assert Loop(as_callbacks([print, Recorder()])).watches_steps


def read_csv(path) -> list[dict]:
    with open(path, newline="") as stream:
        return list(csv.DictReader(stream))


def test_csv_logger_writes_every_epoch_and_every_step(data, tmp_path):
    X, y = data
    recorder = Recorder()
    epochs, steps = tmp_path / "epochs.csv", tmp_path / "steps.csv"
    trainer = fit("epoch", X[:200], y[:200], [recorder, CSVLogger(epochs),
                                              CSVLogger(steps, per="step")],
                  epochs=2, validation_data=(X[200:], y[200:]))
    rows = read_csv(epochs)
    assert list(rows[0]) == ["epoch", "steps", "loss", "validation_loss"]
    assert [(int(r["epoch"]), int(r["steps"])) for r in rows] == [(0, 4), (1, 8)]
    assert [float(r["loss"]) for r in rows] == trainer.train_losses_  # exactly: repr
    assert [float(r["validation_loss"]) for r in rows] == trainer.validation_losses_
    rows = read_csv(steps)
    assert list(rows[0]) == ["step", "loss", "learning_rate", "epoch", "batch"]
    assert [float(r["loss"]) for r in rows] == [recorder.steps[s]["loss"] for s in range(1, 9)]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    # its own log is replaced, appended to on request; another file is never touched
    fit("step", X, y, [CSVLogger(epochs)], epochs=1)
    assert len(read_csv(epochs)) == 1
    fit("step", X, y, [CSVLogger(epochs, append=True)], epochs=2)
    assert [r["epoch"] for r in read_csv(epochs)] == ["0", "0", "1"]
    foreign = tmp_path / "mine.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(UnsafeWriteError, match="not written by lossgraph"):
        CSVLogger(foreign)
    assert foreign.read_text() == "a,b\n1,2\n"
    with pytest.raises(UnsupportedOptionError, match="per='batch'"):
        CSVLogger(tmp_path / "x.csv", per="batch")


def test_tensorboard_writes_each_steps_and_epochs_scalars(data, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    X, y = data
    recorder = Recorder()
    trainer = fit("epoch", X, y, [recorder, lossgraph.TensorBoard(tmp_path / "runs")], epochs=2)
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    steps = events.Scalars("step/loss")
    assert [e.step for e in steps] == list(range(1, 11))
    np.testing.assert_array_equal([e.value for e in steps], np.float32(
        [recorder.steps[s]["loss"] for s in range(1, 11)]))
    assert [e.value for e in events.Scalars("step/learning_rate")] == [np.float32(RATE)] * 10
    np.testing.assert_array_equal([e.value for e in events.Scalars("epoch/loss")],
                                  np.float32(trainer.train_losses_))
