"""Early stopping (lossgraph.runtime.early_stopping) and validation_fraction in Trainer.fit.

- The rule: a hand-computed sequence stops where Keras's rule says (min_delta, patience,
  NaN, a metric to maximize).
- A fit in every fusion mode stops at the epoch the same rule gives on an uninterrupted
  fit's validation losses, and ends on that fit's state of the best epoch, weights and
  momentum velocities bit for bit (the packed state of the fused modes included).
- A checkpoint saved before the stop, loaded and continued, stops at the same epoch with
  the same state.
- validation_fraction holds out scikit-learn's ShuffleSplit / StratifiedShuffleSplit rows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.heads import head_data, head_program
from support.linear import COEF, INTERCEPT, linear_data, linear_program

import lossgraph
from lossgraph import EarlyStopping
from lossgraph.data import split_rows
from lossgraph.runtime.early_stopping import StoppingRecord

TARGET = np.array([1.0, -2.0, 0.5, 3.0])  # the function linear_data draws from


def keras_stop(values: list[float], patience: int, min_delta: float, maximize: bool = False
               ) -> tuple[int | None, int]:
    """Keras's EarlyStopping on a sequence: (the epoch it stops after or None, the best)."""
    best, best_epoch, wait = None, 0, 0
    for epoch, value in enumerate(values):
        if not math.isnan(value) and (best is None or (
                value > best + min_delta if maximize else value < best - min_delta)):
            best, best_epoch, wait = value, epoch, 0
            continue
        wait += 1
        if wait >= patience:
            return epoch, best_epoch
    return None, best_epoch


def run(record: StoppingRecord, rule: EarlyStopping, values: list[float]) -> int | None:
    for epoch, value in enumerate(values):
        if record.update(rule, epoch, {rule.monitor: value}, dict):
            return epoch
    return None


def test_the_rule_on_a_hand_computed_sequence():
    """min_delta 0.02, patience 3: 0.79 is no improvement on 0.8; 0.7 is (the best, epoch
    4); 0.71, 0.72 and 0.69 (not below 0.68) are three epochs without: stop after 7."""
    values = [1.0, 0.8, 0.79, 0.85, 0.7, 0.71, 0.72, 0.69, 0.5]
    rule = EarlyStopping(monitor="loss", patience=3, min_delta=0.02)
    record = StoppingRecord("loss")
    assert run(record, rule, values) == 7
    assert (record.best, record.best_epoch, record.stopped_epoch) == (0.7, 4, 7)
    assert keras_stop(values, 3, 0.02) == (7, 4)
    # a NaN never improves; accuracy is maximized (inferred), mode="min" overrides it
    assert run(StoppingRecord("loss"), EarlyStopping("loss", patience=2), [1.0, math.nan, 2.0]) == 2
    accuracy = [0.5, 0.6, 0.55, 0.58, 0.61]
    assert run(StoppingRecord("accuracy"), EarlyStopping("accuracy", patience=3), accuracy) is None
    assert run(StoppingRecord("accuracy"), EarlyStopping("accuracy", 2, mode="min"), accuracy) == 2
    # Keras's val_ spelling reads the logs' validation_ value, as fit(monitor=...) does
    assert EarlyStopping("val_accuracy").key == "validation_accuracy"
    assert EarlyStopping("val_accuracy").maximize and not EarlyStopping("val_loss").maximize


def _data():
    """Training data of linear_data's function, and validation targets of a function 80% of
    the way there from the model's start: the validation loss falls, then rises."""
    X, y = linear_data(60, seed=3)
    Xv = np.random.default_rng(4).normal(size=(20, 4)).astype(np.float32)
    middle = np.array(COEF) + 0.8 * (TARGET - COEF)
    return X, y, Xv, (Xv @ middle + INTERCEPT + 0.8 * (1 - INTERCEPT)).astype(np.float32)


@pytest.mark.parametrize("mode", ["step", "epoch", "separate"])
def test_a_fit_stops_where_the_rule_says_and_restores_the_best_state(mode, tmp_path):
    X, y, Xv, yv = _data()
    program = linear_program(mode, lossgraph.optim.Momentum(0.003))
    fit = dict(batch_size=10, random_state=0, validation_data=(Xv, yv), progress=False)
    states = []
    full = lossgraph.Trainer(program).fit(X, y, epochs=12, **fit,
                                          callbacks=[lambda t, e, logs: states.append(t.state)])
    stop, best = keras_stop(full.validation_losses_, patience=3, min_delta=0.05)
    assert stop is not None and 0 < best < stop < 11  # the data make a real case of it
    rule = EarlyStopping(patience=3, min_delta=0.05)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=12, early_stopping=rule, **fit)
    assert trainer.epochs_ == stop + 1
    assert trainer.validation_losses_ == full.validation_losses_[:stop + 1]
    assert (trainer.early_stopping_.best_epoch, trainer.early_stopping_.stopped_epoch) == (
        best, stop)
    assert sorted(trainer.state) == sorted(states[best]) and program.optimizer_states
    for name, value in trainer.state.items():  # weights and velocities, bit for bit
        np.testing.assert_array_equal(value, states[best][name], err_msg=name)
    # a checkpoint before the stop, loaded and continued, stops there with the same state
    first = lossgraph.Trainer(program).fit(X, y, epochs=best + 2, early_stopping=rule, **fit)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt")
    assert resumed.early_stopping_.best_epoch == best
    resumed.fit(X, y, epochs=12 - best - 2, early_stopping=rule, warm_start=True, **fit)
    assert resumed.epochs_ == stop + 1 and resumed.history_ == trainer.history_
    for name, value in trainer.state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)


def test_validation_fraction_holds_out_scikit_learns_rows():
    """Regression targets: ShuffleSplit's rows; class labels: StratifiedShuffleSplit's.
    Early stopping on the validation accuracy (maximized) of those rows."""
    model_selection = pytest.importorskip("sklearn.model_selection")
    for y in (np.arange(30.0), np.repeat([0, 1, 2], 10)):
        splitter = (model_selection.ShuffleSplit if y.dtype.kind == "f"
                    else model_selection.StratifiedShuffleSplit)
        expected = next(splitter(test_size=0.2, random_state=7).split(np.zeros((30, 1)), y))
        for got, want in zip(split_rows(30, 0.2, 7, None if y.dtype.kind == "f" else y),
                             expected):
            np.testing.assert_array_equal(got, want)
    X, y = head_data("softmax", rows=40)
    trainer = lossgraph.Trainer(head_program("softmax")).fit(
        X, y, epochs=3, batch_size=8, random_state=7, progress=False, metrics=["accuracy"],
        validation_fraction=0.2, early_stopping=EarlyStopping("validation_accuracy", 5))
    train, held = split_rows(40, 0.2, 7, y)
    assert trainer.early_stopping_.best is not None and trainer.early_stopping_.best_epoch == 0
    assert trainer.history_["validation_accuracy"][-1] == trainer.evaluate(
        X[held], y[held], metrics=["accuracy"])["accuracy"]
