"""Metrics (lossgraph.runtime.metrics): a graph over the predictions, equal to scikit-learn.

Every metric on every output head (regression values, one probability, one score,
probabilities per class, logits per class), with sample weights, against scikit-learn's
function on the predictions ``Trainer.predict`` gives; ties in top-k accuracy broken as
scikit-learn breaks them; R2 of a constant target; the metrics of a fit in ``history_``,
the logs, a checkpoint and a pickle.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from support.heads import head_data, head_model, head_program

import lossgraph
from lossgraph.runtime.callbacks import Monitor

sklearn_metrics = pytest.importorskip("sklearn.metrics")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-z))


def reference(head: str, name: str, y: np.ndarray, p: np.ndarray, w: np.ndarray) -> float:
    """scikit-learn's ``name`` of the prediction ``p`` of ``head`` (float64 throughout,
    probabilities rounded to the prediction's float32 before the log loss)."""
    m = sklearn_metrics
    p64 = p.astype(np.float64)
    if name == "mae":
        return m.mean_absolute_error(y, p64, sample_weight=w)
    if name == "rmse":
        return m.root_mean_squared_error(y, p64, sample_weight=w)
    if name == "r2":
        return m.r2_score(y, p64, sample_weight=w)
    single = p.shape[1] == 1
    if head == "probability":
        probabilities, classes = p64[:, 0], (p64[:, 0] > 0.5).astype(int)
    elif head == "score":
        probabilities, classes = _sigmoid(p64[:, 0]), (p64[:, 0] > 0).astype(int)
    else:
        probabilities = p64 if head == "softmax" else _softmax(p64)
        classes = p64.argmax(axis=1)
    labels = list(range(2 if single else p.shape[1]))
    if name == "accuracy":
        return m.accuracy_score(y, classes, sample_weight=w)
    if name == "f1":
        return m.f1_score(y, classes, sample_weight=w)
    if name == "log_loss":
        return m.log_loss(y, probabilities.astype(np.float32), sample_weight=w, labels=labels)
    k = int(name.split("_")[1])
    return m.top_k_accuracy_score(y, p64, k=k, sample_weight=w, labels=labels)


HEAD_METRICS = {
    "values": ["mae", "rmse", "r2"],
    "probability": ["accuracy", "f1", "log_loss"],
    "score": ["accuracy", "f1", "log_loss"],
    "softmax": ["accuracy", "top_2_accuracy", "log_loss"],
    "logits": ["accuracy", "top_1_accuracy", "top_3_accuracy", "log_loss"],
}


@pytest.mark.parametrize("head", list(HEAD_METRICS))
def test_each_metric_equals_scikit_learn(head):
    """The metric graph's value of each metric equals scikit-learn's on the predictions,
    with sample weights and without."""
    program = head_program(head, weighted=True, optimizer=lossgraph.optim.SGD(0.1))
    trainer = lossgraph.Trainer(program).fit(*head_data(head), epochs=2, batch_size=8,
                                             random_state=0, progress=False)
    X, y = head_data(head, rows=40, seed=5)
    w = np.random.default_rng(3).uniform(0.2, 2.0, len(X)).astype(np.float32)
    p = trainer.predict(X)
    names = HEAD_METRICS[head]
    for weights in (None, w):
        scores = trainer.evaluate(X, y, weights, metrics=names)
        for name in names:
            expected = reference(head, name, y, p, weights)
            assert scores[name] == pytest.approx(expected, rel=1e-6, abs=1e-9), name


def test_top_k_breaks_ties_as_scikit_learn():
    """With every score equal, scikit-learn's reversed stable sort ranks the last class
    first: top-1 counts the labels C-1, top-2 those C-1 and C-2; the graph agrees."""
    trainer = lossgraph.Trainer(head_program("logits"))
    trainer.set_state({"w": np.zeros((4, 4), np.float32), "b": np.array([0, 1, 1, 0], np.float32)})
    X, y = head_data("logits", rows=30)
    scores = trainer.evaluate(X, y, metrics=["top_1_accuracy", "top_2_accuracy", "accuracy"])
    p = trainer.predict(X)
    for k in (1, 2):
        assert scores[f"top_{k}_accuracy"] == pytest.approx(
            sklearn_metrics.top_k_accuracy_score(y, p, k=k, labels=range(4)))
    assert scores["top_1_accuracy"] == pytest.approx(np.mean(y == 2))  # ties: the later class
    assert scores["accuracy"] == pytest.approx(np.mean(y == 1))  # argmax: the first largest


def test_r2_of_a_constant_target_is_scikit_learns_finite_value():
    trainer = lossgraph.Trainer(head_program("values"))
    X, _ = head_data("values", rows=10)
    p = trainer.predict(X)
    constant = np.ones_like(p)
    exact = np.concatenate([p[:, :1], np.ones_like(p[:, :1])], axis=1)
    for y in (constant, exact):
        assert trainer.evaluate(X, y, metrics=["r2"])["r2"] == pytest.approx(
            sklearn_metrics.r2_score(y, p.astype(np.float64)))


def test_a_fit_logs_its_metrics_on_training_and_validation_data(tmp_path):
    """Each epoch's metrics are in the callbacks' logs and ``history_`` under their name and
    ``validation_<name>``; the last epoch's equal ``evaluate``'s; a checkpoint and a pickle
    keep them."""
    X, y = head_data("softmax", rows=48)
    seen = []
    trainer = lossgraph.Trainer(head_program("softmax", optimizer=lossgraph.optim.SGD(0.2)))
    trainer.fit(X[:36], y[:36], epochs=3, batch_size=6, random_state=0, progress=False,
                metrics=["accuracy", "log_loss"], validation_data=(X[36:], y[36:]),
                callbacks=[lambda t, epoch, logs: seen.append(sorted(logs))])
    names = ["accuracy", "log_loss", "loss", "validation_accuracy", "validation_log_loss",
             "validation_loss"]
    assert seen == [names] * 3
    assert sorted(trainer.history_) == names and all(len(v) == 3 for v in trainer.history_.values())
    assert trainer.history_["loss"] is trainer.train_losses_
    final = trainer.evaluate(X[36:], y[36:], metrics=["accuracy", "log_loss"])
    assert trainer.history_["validation_accuracy"][-1] == final["accuracy"]
    assert trainer.history_["validation_log_loss"][-1] == pytest.approx(final["log_loss"])
    assert trainer.history_["accuracy"][-1] == trainer.evaluate(
        X[:36], y[:36], metrics=["accuracy"])["accuracy"]
    trainer.save_checkpoint(tmp_path / "ckpt")
    for other in (lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt"),
                  pickle.loads(pickle.dumps(trainer))):
        assert other.history_ == trainer.history_


def test_which_metrics_are_better_larger():
    """The monitor's rule (early stopping, the best checkpoint) reads every metric right."""
    larger = ("accuracy", "top_5_accuracy", "f1", "r2", "validation_accuracy", "val_r2")
    assert [Monitor(n).mode for n in larger] == ["max"] * len(larger)
    smaller = ("mae", "rmse", "log_loss", "validation_log_loss", "loss")
    assert [Monitor(n).mode for n in smaller] == ["min"] * len(smaller)


def test_rows_whose_label_the_loss_ignores_are_left_out():
    """A label equal to the loss's ignore_index leaves its row out of every metric."""
    program = lossgraph.compile_program(head_model("softmax"), loss="multiclass_log_loss",
                                        loss_options={"ignore_index": -100})
    trainer = lossgraph.Trainer(program)
    X, y = head_data("softmax", rows=30)
    ignored = y.copy()
    ignored[::4] = -100
    kept = ignored != -100
    scores = trainer.evaluate(X, ignored, metrics=["accuracy", "top_2_accuracy", "log_loss"])
    expected = trainer.evaluate(X[kept], y[kept], metrics=["accuracy", "top_2_accuracy",
                                                           "log_loss"])
    assert scores == pytest.approx(expected, rel=1e-12)
