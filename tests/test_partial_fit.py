"""partial_fit on lossgraph.compat's estimators (incremental learning, as scikit-learn's MLP
does it): each call is one epoch over the data it is given, continuing the weights, the
momentum, the learning-rate schedule and the shuffling. Calls over the same data equal
fit's epochs; calls over parts equal a numpy run over the same parts; pickling between calls
changes nothing; ``classes`` is checked against the model's labels."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from test_compat_estimators import (
    ESTIMATORS,
    FB,
    START,
    START_STATE,
    MomentumReference,
    assert_states_close,
    classification,
    half_square_grad,
    linear_onnx,
    small_linear,
    square_grad,
)

from lossgraph.compat import LearningRateSGD, LearningRateSGDNesterov
from lossgraph.errors import InvalidDataError, LossgraphError, UnsupportedOptionError

#: Momentum and a decaying rate: both must carry over from one call to the next.
RATE = LearningRateSGDNesterov(eta0=0.02, power_t=0.5, nesterov=True)
GRADIENTS = {"forward_backward": half_square_grad, "whole_graph": square_grad}


def weighted_parts(sizes=(50, 40, 30)):
    """The small linear problem with uneven row weights, cut into parts of ``sizes`` rows."""
    X, y, _ = small_linear()
    w = np.random.default_rng(3).uniform(0.2, 2.0, len(y)).astype(np.float32)
    cuts = np.cumsum(sizes)[:-1]
    return list(zip(*(np.split(a, cuts) for a in (X, y, w))))


def numpy_partial_fits(parts, grad, batch_size, rate, random_state):
    """The numpy run partial_fit must equal: one generator for the whole run, each part a
    permutation of its rows then batches of ``batch_size``, every update of part t at
    ``rate.value(t)``, scikit-learn's momentum carried from part to part."""
    rng = np.random.default_rng(random_state)
    state = {k: np.asarray(v, np.float64) for k, v in START_STATE.items()}
    optimizer = MomentumReference(getattr(rate, "momentum", 0.0), getattr(rate, "nesterov", False))
    for t, (X, y, w) in enumerate(parts):
        order = rng.permutation(len(X))
        for lo in range(0, len(X), batch_size):
            rows = order[lo:lo + batch_size]
            state = optimizer.step(state, grad(state, X[rows], y[rows], w[rows]), rate.value(t))
    return state


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_partial_fit_calls_on_the_same_data_equal_fits_epochs(kind):
    """The t-th call leaves the weights and losses of fit(max_iter=t): same batches, same
    rate, same momentum, epoch after epoch (120 rows, batches of 16: a last one of 8)."""
    X, y, w = (np.concatenate(a) for a in zip(*weighted_parts()))
    settings = dict(batch_size=16, random_state=0, learning_rate=RATE)
    incremental = ESTIMATORS[kind](**settings)
    for epochs in (1, 2, 3):
        assert incremental.partial_fit(X, y, w) is incremental
        whole = ESTIMATORS[kind](max_iter=epochs, **settings).fit(X, y, w)
        assert_states_close(incremental.get_state(), whole.get_state(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(incremental.train_losses_, whole.train_losses_, rtol=1e-6)
    assert incremental.validation_losses_ is None


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_partial_fit_over_parts_equals_numpy_over_the_same_parts(kind):
    """Parts of 50, 40 and 30 weighted rows, one call each: numpy's minibatch updates, the
    third part at the third epoch's rate with the momentum of the first two."""
    parts = weighted_parts()
    est = ESTIMATORS[kind](batch_size=16, random_state=7, learning_rate=RATE)
    for X, y, w in parts:
        est.partial_fit(X, y, w)
    reference = numpy_partial_fits(parts, GRADIENTS[kind], 16, RATE, random_state=7)
    assert_states_close(est.get_state(), reference, rtol=1e-5)
    assert len(est.train_losses_) == len(parts)
    # the control: the same parts with a rate that does not decay between calls differ
    flat = numpy_partial_fits(parts, GRADIENTS[kind], 16, LearningRateSGDNesterov(
        eta0=0.02, learning_rate="constant"), random_state=7)
    assert not np.allclose(flat["coef"], reference["coef"], rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_pickling_between_partial_fit_calls_continues_identically(kind):
    """An estimator pickled before its first call and between calls (sessions dropped and
    made again) trains as the one never pickled: weights, momentum, schedule, shuffling
    and losses."""
    parts = weighted_parts()
    kept = ESTIMATORS[kind](batch_size=16, random_state=0, learning_rate=RATE)
    moved = pickle.loads(pickle.dumps(kept))
    for X, y, w in parts:
        kept.partial_fit(X, y, w)
        moved = pickle.loads(pickle.dumps(moved.partial_fit(X, y, w)))
        assert "train_session_" in moved.__dict__  # the progress travels with it
        assert_states_close(moved.get_state(), kept.get_state(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(moved.train_losses_, kept.train_losses_, rtol=1e-6)
    np.testing.assert_allclose(moved.predict(parts[0][0]), kept.predict(parts[0][0]),
                               rtol=1e-6)


def test_sample_weights_from_a_later_call_continue_the_training():
    """The forward/backward optimizer without weight_name gets a sample-weight input once
    weights come: that recompiles, and the momentum, schedule and shuffling carry over
    (the first part weighs every row 1)."""
    parts = weighted_parts()
    est = FB(linear_onnx(*START), batch_size=16, random_state=1, learning_rate=RATE)
    est.partial_fit(*parts[0][:2])
    for X, y, w in parts[1:]:
        est.partial_fit(X, y, w)
    ones = [(parts[0][0], parts[0][1], np.ones_like(parts[0][2])), *parts[1:]]
    reference = numpy_partial_fits(ones, half_square_grad, 16, RATE, random_state=1)
    assert_states_close(est.get_state(), reference, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_partial_fit_continues_a_fit_and_a_fit_restarts(kind):
    """A fit then partial_fit calls: the calls continue the fit (its epoch count sets the
    rate); a later fit without warm_start starts from the model's weights again."""
    X, y, w = (np.concatenate(a) for a in zip(*weighted_parts()))
    settings = dict(batch_size=16, random_state=0, learning_rate=RATE)
    est = ESTIMATORS[kind](max_iter=2, **settings).fit(X, y, w)
    est.partial_fit(X, y, w)
    whole = ESTIMATORS[kind](max_iter=3, **settings).fit(X, y, w)
    assert_states_close(est.get_state(), whole.get_state(), rtol=1e-6, atol=1e-7)
    est.fit(X, y, w)
    assert_states_close(est.get_state(), ESTIMATORS[kind](max_iter=2, **settings).fit(
        X, y, w).get_state(), rtol=1e-6, atol=1e-7)


def test_classes_must_be_the_models_class_indices():
    """A logistic model's labels are 0 and 1: classes, when given, holds each once; other
    classes are a lossgraph error before any training; a regressor takes none."""
    X, y = classification()
    est = FB(linear_onnx(np.full(10, 0.01), 0.0), learning_loss="log", batch_size=20,
             learning_rate=LearningRateSGD(eta0=0.1), random_state=0)
    est.partial_fit(X, y, classes=[0, 1])
    est.partial_fit(X, y, classes=np.array([1, 0]))  # any order
    est.partial_fit(X, y)  # classes may be left out: the model fixes them
    trained = est.get_state()
    for classes, match in (([0, 1, 2], r"each of 0\.\.1 once"), ([1, 2], "0..1"),
                           (["no", "yes"], "LabelEncoder"), ([0], "0..1"),
                           ([[0, 1]], "0..1"), ([0.0, 1.0], "0..1"), ([], "0..1")):
        with pytest.raises(InvalidDataError, match=match):
            est.partial_fit(X, y, classes=classes)
    assert_states_close(est.get_state(), trained, rtol=0, atol=0)  # nothing trained
    assert len(est.train_losses_) == 3
    X, y, _ = small_linear()
    with pytest.raises(UnsupportedOptionError, match="regressor"):
        FB(linear_onnx(*START)).partial_fit(X, y, classes=[0, 1])
    assert issubclass(InvalidDataError, LossgraphError)
    assert issubclass(UnsupportedOptionError, LossgraphError)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_partial_fit_checks_its_arguments_as_fit_does(kind):
    X, y, _ = small_linear()
    with pytest.raises(LossgraphError, match="numbers of rows"):
        ESTIMATORS[kind]().partial_fit(X, y[:-1])
    with pytest.raises(UnsupportedOptionError, match="batch_size"):
        ESTIMATORS[kind](batch_size=0).partial_fit(X, y)
