"""OrtGradientOptimizer and OrtGradientForwardBackwardOptimizer (lossgraph.compat) proven
against scikit-learn and numpy.

- The reference documents' examples, on their data shapes: a linear regression (two
  features) against LinearRegression and SGDRegressor; an MLPRegressor converted by skl2onnx
  and trained with SGD, with Nesterov momentum (constant and decaying rates) and with
  sample weights and an L2 penalty: the weights of scikit-learn's own MLPRegressor trained
  with the same settings on full batches; an elastic loss and penalty against numpy;
  binary classification with the log loss against MLPClassifier (same weights),
  LogisticRegression (same probabilities) and numpy; the forward/backward object's
  gradients against scikit-learn's backpropagation.
- scikit-learn's conventions: get_params/set_params, clone, pickling with the trained
  state (and a warm start after unpickling equal to one without), GridSearchCV.
- What the reference got wrong, done right: the initial weights, warm starts, the penalty
  scaled by the learning rate, the signs of the absolute and elastic gradients, class
  names as strings, validation with max_iter < 10, batches without replacement, sample
  weights of shape (N,), the progress bar, exc=False.
- Files and errors: saved_gradient, save_onnx_graph, get_trained_onnx, lossgraph errors.
- partial_fit: each call is one epoch over the data it is given, continuing the weights, the
  momentum, the learning-rate schedule and the shuffling. Calls over the same data equal
  fit's epochs; calls over parts equal a numpy run over the same parts; pickling between
  calls changes nothing; ``classes`` is checked against the model's labels.

scikit-learn computes in float32 here (float32 data) and lossgraph in float32: weights are
compared with rtol 1e-4, never bytes. Numpy references compute in float64.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from sklearn import metrics as sklearn_metrics
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.datasets import make_regression
from sklearn.exceptions import ConvergenceWarning as SklearnConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression, SGDRegressor
from sklearn.model_selection import GridSearchCV
from sklearn.neural_network import MLPClassifier, MLPRegressor
from support.estimators import (
    ESTIMATORS,
    FB,
    START,
    assert_states_close,
    classification,
    linear_onnx,
    regression,
    run_onnx,
    small_linear,
    whole_graph_model,
)

import lossgraph
from lossgraph import OrtGradientOptimizer
from lossgraph.compat import (
    AbsoluteLearningLoss,
    ConvergenceError,
    ConvergenceWarning,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    EvaluationError,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    NoLearningPenalty,
    NotFittedError,
    OrtGradientForwardBackward,
    ProviderError,
    SquareLearningLoss,
)
from lossgraph.errors import (
    InvalidDataError,
    LossgraphError,
    ShapeMismatchError,
    UnknownNameError,
    UnsafeWriteError,
    UnsupportedOptionError,
)

OPSETS = {"": 18, "ai.onnx.ml": 3}


def constant(eta0: float) -> LearningRateSGD:
    """A constant rate (a float alone is onnxcustom's invscaling from eta0)."""
    return LearningRateSGD(eta0=eta0, learning_rate="constant")


# -- models --------------------------------------------------------------------------------


def to_onnx(model, X, **options) -> onnx.ModelProto:
    skl2onnx = pytest.importorskip("skl2onnx")
    return skl2onnx.to_onnx(model, X[:1], target_opset=OPSETS, **options)


def mlp_state(mlp) -> dict[str, np.ndarray]:
    """A fitted scikit-learn MLP's weights by the names skl2onnx gives them."""
    state = {}
    for i, (coef, intercept) in enumerate(zip(mlp.coefs_, mlp.intercepts_)):
        suffix = str(i) if i else ""
        state[f"coefficient{suffix}"] = np.asarray(coef, np.float32)
        state[f"intercepts{suffix}"] = np.asarray(intercept, np.float32).reshape(1, -1)
    return state


def sgd_mlp(kind, hidden, rows, **settings):
    """scikit-learn's MLP on full batches of ``rows`` (shuffling is then irrelevant), with
    no penalty or early stop unless ``settings`` say so."""
    options = dict(hidden_layer_sizes=hidden, solver="sgd", batch_size=rows, alpha=0.0,
                   learning_rate="constant", learning_rate_init=0.01, momentum=0.0,
                   nesterovs_momentum=False, n_iter_no_change=10**6, tol=0.0, max_iter=1,
                   random_state=0)
    options.update(settings)
    return kind(**options)


def quiet_fit(model, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SklearnConvergenceWarning)
        return model.fit(*args, **kwargs)


def start_and_continue(mlp, X, y, epochs, sample_weight=None, convert=None):
    """Fit ``mlp`` one epoch (scikit-learn's random initial weights) and convert it to ONNX
    (``convert``, default skl2onnx), then train ``epochs`` more epochs from there with
    ``warm_start`` (a new SGDOptimizer: fresh velocities, the initial rate). Returns the
    ONNX model, holding the weights lossgraph starts from."""
    quiet_fit(mlp, X, y, sample_weight=sample_weight)
    onx = (convert or to_onnx)(mlp, X)
    start = mlp_state(mlp)
    weights = {k: v for k, v in initializers(onx).items() if k in start}
    assert_states_close(weights, start, rtol=0, atol=0)
    mlp.set_params(warm_start=True, max_iter=epochs)
    quiet_fit(mlp, X, y, sample_weight=sample_weight)
    return onx


def raw_score_onnx(classifier, X) -> onnx.ModelProto:
    """The classifier's network without its sigmoid: skl2onnx's graph of an MLPRegressor
    carrying the classifier's weights (output: the raw score, (N, 1))."""
    regressor = quiet_fit(MLPRegressor(hidden_layer_sizes=classifier.hidden_layer_sizes,
                                       activation=classifier.activation, max_iter=1),
                          X, np.zeros(len(X), np.float32))
    regressor.coefs_ = [c.copy() for c in classifier.coefs_]
    regressor.intercepts_ = [b.copy() for b in classifier.intercepts_]
    return to_onnx(regressor, X)


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


# -- numpy references ----------------------------------------------------------------------


def relu_mlp(state, X):
    """Forward pass of skl2onnx's MLPRegressor graph (relu hidden layers) in float64: the
    layers' inputs and the prediction."""
    layers = len(state) // 2
    acts = [X.astype(np.float64)]
    for i in range(layers):
        suffix = str(i) if i else ""
        z = acts[-1] @ state[f"coefficient{suffix}"] + state[f"intercepts{suffix}"]
        acts.append(np.maximum(z, 0) if i < layers - 1 else z)
    return acts


def relu_mlp_grads(state, acts, prediction_grad):
    """Backpropagation of ``prediction_grad`` through :func:`relu_mlp`: weight gradients and
    the input's gradient."""
    layers = len(state) // 2
    grads, delta = {}, prediction_grad
    for i in reversed(range(layers)):
        suffix = str(i) if i else ""
        grads[f"coefficient{suffix}"] = acts[i].T @ delta
        grads[f"intercepts{suffix}"] = delta.sum(axis=0, keepdims=True)
        delta = delta @ state[f"coefficient{suffix}"].T
        if i:
            delta = delta * (acts[i] > 0)
    return grads, delta


def sigmoid(s):
    return 1.0 / (1.0 + np.exp(-s))


class MomentumReference:
    """scikit-learn's SGDOptimizer update: ``u' = m u - eta g``, ``w' = w + u'`` or, with
    Nesterov, ``w' = w + m u' - eta g``."""

    def __init__(self, momentum=0.0, nesterov=False):
        self.momentum, self.nesterov, self.velocity = momentum, nesterov, {}

    def step(self, state, grads, eta):
        new = {}
        for name, g in grads.items():
            u = self.momentum * self.velocity.get(name, 0.0) - eta * g
            self.velocity[name] = u
            new[name] = state[name] + (self.momentum * u - eta * g if self.nesterov else u)
        return new


def numpy_fit(state, X, y, grad_fn, epochs, batch_size, rate, momentum=0.0, nesterov=False,
              random_state=0, shuffle=True, sample_weight=None):
    """Minibatch training as lossgraph's Trainer orders it: each epoch a permutation of
    ``numpy.random.default_rng(random_state)``, batches of consecutive rows of it, every
    update of epoch t at ``rate(t)``. ``grad_fn(state, X, y, w)`` is the batch gradient."""
    rng = np.random.default_rng(random_state)
    state = {k: np.asarray(v, np.float64) for k, v in state.items()}
    optimizer = MomentumReference(momentum, nesterov)
    rows = len(X)
    for epoch in range(epochs):
        order = rng.permutation(rows) if shuffle else np.arange(rows)
        for lo in range(0, rows, batch_size):
            index = order[lo:lo + batch_size]
            w = None if sample_weight is None else sample_weight[index]
            state = optimizer.step(state, grad_fn(state, X[index], y[index], w), rate(epoch))
    return state


def linear_grads(state, X, prediction_grad):
    grads = {"coef": X.astype(np.float64).T @ prediction_grad}
    if "intercept" in state:
        grads["intercept"] = prediction_grad.sum(axis=0)
    return grads


def linear_predict(state, X):
    return X.astype(np.float64) @ state["coef"] + state.get("intercept", 0.0)


# ==========================================================================================
# The reference documents' examples
# ==========================================================================================


def linear_problem():
    """The documents' linear regression: make_regression(n_features=2, bias=2), float32, and
    skl2onnx's graph of a LinearRegression as MatMul + Add (weights 'coef', 'intercept')."""
    X, y = make_regression(200, n_features=2, bias=2.0, noise=5.0, random_state=0)
    X, y = X.astype(np.float32), y.astype(np.float32)
    start = LinearRegression().fit(X[:5], y[:5])  # a poor start, far from the solution
    onx = to_onnx(start, X, black_op={"LinearRegressor"})
    return X, y, onx


def test_linear_regression_whole_graph_matches_scikit_learn():
    X, y, onx = linear_problem()
    onx_loss = lossgraph.add_loss_output(onx, weight_name="weight")
    est = OrtGradientOptimizer(onx_loss, ["intercept", "coef"], learning_rate=1e-2,
                               max_iter=60, batch_size=10, random_state=0)
    assert est.fit(X, y) is est
    exact = assert_like_scikit_learn_linear_regression(est, X, y)
    best = float(np.mean((exact.predict(X) - y) ** 2))  # the loss is the mean squared error
    assert est.train_losses_[0] > 10 * best and est.train_losses_[-1] < 1.1 * best


def assert_like_scikit_learn_linear_regression(est, X, y) -> LinearRegression:
    """The estimator's weights are LinearRegression's and its predictions SGDRegressor's
    (to what 60 epochs of minibatch SGD allow); LinearRegression's fit."""
    state = est.get_state()
    exact = LinearRegression().fit(X, y)
    np.testing.assert_allclose(state["coef"].ravel(), exact.coef_, rtol=2e-3)
    np.testing.assert_allclose(state["intercept"], [exact.intercept_], atol=0.1)
    sgd = SGDRegressor(alpha=0.0, penalty=None, max_iter=60, tol=None, random_state=0).fit(X, y)
    np.testing.assert_allclose(est.predict(X).ravel(), sgd.predict(X), atol=0.05 * np.std(y))
    return exact


def test_linear_regression_forward_backward_matches_scikit_learn():
    X, y, onx = linear_problem()
    est = FB(onx, ["coef", "intercept"], learning_rate=LearningRateSGD(
        eta0=1e-2, learning_rate="constant"), max_iter=60, batch_size=10, random_state=0)
    # SGDRegressor's loss is 0.5 (p - y)^2 per row, the forward/backward optimizer's
    assert_like_scikit_learn_linear_regression(est.fit(X, y), X, y)


def test_documents_elastic_whole_graph_example_equals_numpy():
    """add_loss_output(onx, weight_name='weight', score_name='elastic', l1_weight=0.1,
    l2_weight=0.9, penalty={'coef': {'l2': 0.01}}) trained with OrtGradientOptimizer(...,
    learning_rate=1e-3) on weighted rows: numpy's minibatch SGD, batch for batch, at
    onnxcustom's rate for a float, 1e-3 / (t + 1) ** 0.25 in epoch t."""
    X, y, onx = linear_problem()
    w = np.random.default_rng(1).uniform(0.5, 2.0, len(y)).astype(np.float32)
    onx_loss = lossgraph.add_loss_output(onx, weight_name="weight", score_name="elastic",
                                         l1_weight=0.1, l2_weight=0.9,
                                         penalty={"coef": {"l2": 0.01}})
    est = OrtGradientOptimizer(onx_loss, ["intercept", "coef"], learning_rate=1e-3,
                               max_iter=4, batch_size=50, random_state=3)
    est.fit(X, y, w)

    def grad(state, Xb, yb, wb):
        d = linear_predict(state, Xb) - yb[:, None]
        g = wb[:, None] * (0.1 * np.sign(d) + 1.8 * d) / wb.sum()
        grads = linear_grads(state, Xb, g)
        grads["coef"] = grads["coef"] + 0.02 * state["coef"]
        return grads

    start = initializers(onx)
    reference = numpy_fit({"coef": start["coef"], "intercept": start["intercept"]}, X, y, grad,
                          epochs=4, batch_size=50, rate=lambda t: 1e-3 / (t + 1) ** 0.25,
                          random_state=3,
                          sample_weight=w)
    assert_states_close(est.get_state(), reference, rtol=1e-5)


def test_mlp_regressor_sgd_equals_scikit_learn():
    X, y = regression()
    mlp = sgd_mlp(MLPRegressor, (10,), len(X), learning_rate_init=0.01)
    onx = start_and_continue(mlp, X, y, epochs=10)
    est = FB(onx, learning_rate=LearningRateSGD(eta0=0.01, learning_rate="constant"),
             max_iter=10, batch_size=len(X), random_state=0)
    est.fit(X, y)
    assert_states_close(est.get_state(), mlp_state(mlp))
    # the losses are scikit-learn's too: mean 0.5 (p - y)^2 before each epoch's update
    np.testing.assert_allclose(est.train_losses_, mlp.loss_curve_[1:], rtol=1e-4)


def test_tol_and_n_iter_no_change_stop_as_scikit_learns_mlp():
    """Without early_stopping, the training loss: an epoch whose loss is above the best
    minus tol counts, and training stops once the count exceeds n_iter_no_change, after the
    epoch scikit-learn's MLPRegressor stops after, with its weights."""
    X, y = regression()
    mlp = sgd_mlp(MLPRegressor, (10,), len(X), learning_rate_init=0.01, tol=0.01,
                  n_iter_no_change=2)
    onx = start_and_continue(mlp, X, y, epochs=200)
    est = FB(onx, learning_rate=constant(0.01), max_iter=200, batch_size=len(X),
             random_state=0, tol=0.01, n_iter_no_change=2)
    est.fit(X, y)
    assert est.n_iter_ == len(mlp.loss_curve_) - 1 < 100  # the first epoch made the model
    assert est.best_loss_ == pytest.approx(mlp.best_loss_, rel=1e-4)
    assert_states_close(est.get_state(), mlp_state(mlp))


def sklearn_no_improvement(scores: list[float], tol: float, n_iter_no_change: int
                           ) -> tuple[int, int]:
    """scikit-learn's MLP rule on validation scores: (epochs run, the best epoch)."""
    best, best_epoch, count = -np.inf, 0, 0
    for epoch, score in enumerate(scores):
        count = count + 1 if score < best + tol else 0
        if score > best:
            best, best_epoch = score, epoch
        if count > n_iter_no_change:
            return epoch + 1, best_epoch
    return len(scores), best_epoch


@pytest.mark.parametrize("kind", ["regressor", "classifier"])
def test_early_stopping_holds_out_scikit_learns_rows_and_keeps_the_best_weights(kind):
    """early_stopping=True holds out validation_fraction of the rows (ShuffleSplit's, or
    StratifiedShuffleSplit's for a classifier, seeded by random_state), scores them after
    every epoch (R2, or accuracy: scikit-learn's score), stops by the MLP's rule and keeps
    the best epoch's weights: those of a fit of that many epochs on the rows trained on."""
    from lossgraph.data import split_rows

    X, y = regression(rows=120, features=4, seed=1) if kind == "regressor" else \
        classification(rows=120)
    if kind == "regressor":
        onx, options = linear_onnx(*START), {}
    else:
        onx = linear_onnx(np.zeros(10), 0.0)
        options = {"learning_loss": NegLogLearningLoss()}
    settings = dict(learning_rate=constant(0.05), batch_size=10, random_state=3, **options)
    est = FB(onx, max_iter=60, early_stopping=True, validation_fraction=0.2, tol=0.01,
             n_iter_no_change=2, **settings).fit(X, y)
    train, held = split_rows(len(y), 0.2, 3, y if kind == "classifier" else None)
    epochs, best = sklearn_no_improvement(est.validation_scores_, 0.01, 2)
    assert est.n_iter_ == epochs < 60 and len(est.validation_scores_) == epochs
    assert est.best_validation_score_ == max(est.validation_scores_)
    reference = FB(onx, max_iter=best + 1, **settings).fit(X[train], y[train])
    assert_states_close(est.get_state(), reference.get_state(), rtol=0, atol=0)
    p = reference.predict(X[held])
    expected = (sklearn_metrics.r2_score(y[held], p) if kind == "regressor" else
                sklearn_metrics.accuracy_score(y[held], (p[:, 0] > 0).astype(int)))
    assert est.best_validation_score_ == pytest.approx(expected, rel=1e-6)


@dataclasses.dataclass(frozen=True)
class MLPInvScaling(LearningRateSGDNesterov):
    """scikit-learn's MLP invscaling schedule, a learning rate lossgraph's classes take as
    any other: the MLP steps its rate at the end of each epoch with the number of samples
    seen, ``eta0 / (t_ + 1) ** power_t``, where ``t_`` starts at ``seen`` (a warm start
    keeps it) and grows by ``rows`` an epoch; the first epoch of a fit runs at ``eta0``."""

    seen: int = 0
    rows: int = 1

    def value(self, epoch: int) -> float:
        if epoch == 0:
            return float(self.eta0)
        return self.eta0 / (self.seen + epoch * self.rows + 1) ** self.power_t


@pytest.mark.parametrize("schedule", ["constant", "invscaling"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_mlp_regressor_momentum_equals_scikit_learn(nesterov, schedule):
    """Momentum and Nesterov's momentum give scikit-learn's SGDOptimizer's weights, the
    velocities carried across epochs whose rates differ (invscaling: the rate drops about
    twenty-fold after the first epoch)."""
    X, y = regression()
    rows, epochs = len(X), 8
    mlp = sgd_mlp(MLPRegressor, (50, 10), rows, learning_rate_init=0.02, momentum=0.9,
                  nesterovs_momentum=nesterov, learning_rate=schedule, power_t=0.5)
    onx = start_and_continue(mlp, X, y, epochs=epochs)
    if schedule == "constant":
        rate = LearningRateSGDNesterov(eta0=0.02, momentum=0.9, nesterov=nesterov,
                                       learning_rate="constant")
    else:
        rate = MLPInvScaling(eta0=0.02, momentum=0.9, nesterov=nesterov, power_t=0.5,
                             seen=rows, rows=rows)
    est = FB(onx, learning_rate=rate, max_iter=epochs, batch_size=rows, random_state=0)
    est.fit(X, y)
    assert_states_close(est.get_state(), mlp_state(mlp))
    np.testing.assert_allclose(est.train_losses_, mlp.loss_curve_[1:], rtol=1e-4)


def test_mlp_regressor_with_sample_weights_and_l2_equals_scikit_learn():
    """scikit-learn's alpha (its L2 on the coefficients, divided by the weights' sum) is an
    ElasticLearningPenalty on the coefficients only, with l2 = alpha / (2 sum w) on full
    batches; the weighted mean loss is the MLP's."""

    @dataclasses.dataclass(frozen=True)
    class CoefficientsOnly(ElasticLearningPenalty):
        def penalty(self, weights):
            return super().penalty([w for w in weights if w.startswith("coefficient")])

    X, y = regression()
    w = np.random.default_rng(2).uniform(0.2, 3.0, len(y)).astype(np.float32)
    alpha, epochs = 0.5, 6
    mlp = sgd_mlp(MLPRegressor, (10,), len(X), learning_rate_init=0.02, alpha=alpha)
    onx = start_and_continue(mlp, X, y, epochs=epochs, sample_weight=w)
    est = FB(onx, learning_rate=LearningRateSGD(eta0=0.02, learning_rate="constant"),
             learning_penalty=CoefficientsOnly(l1=0.0, l2=alpha / (2 * float(w.sum()))),
             weight_name="weight", max_iter=epochs, batch_size=len(X), random_state=0)
    est.fit(X, y, w)
    assert_states_close(est.get_state(), mlp_state(mlp))
    np.testing.assert_allclose(est.train_losses_, mlp.loss_curve_[1:], rtol=1e-4)


def test_documents_nesterov_elastic_loss_and_penalty_equal_numpy():
    """The documents' forward/backward example: LearningRateSGDNesterov(),
    ElasticLearningLoss(l1_weight=0.1, l2_weight=0.9), ElasticLearningPenalty(l1=0.1,
    l2=0.9) on an MLPRegressor, in minibatches: numpy's training, batch for batch."""
    X, y = regression()
    mlp = quiet_fit(MLPRegressor(hidden_layer_sizes=(10,), max_iter=1, random_state=0), X, y)
    onx = to_onnx(mlp, X)
    rate = LearningRateSGDNesterov()
    est = FB(onx, learning_rate=rate,
             learning_loss=ElasticLearningLoss(l1_weight=0.1, l2_weight=0.9),
             learning_penalty=ElasticLearningPenalty(l1=0.1, l2=0.9), max_iter=5,
             batch_size=40, random_state=7)
    est.fit(X, y)

    def grad(state, Xb, yb, wb):
        acts = relu_mlp(state, Xb)
        d = acts[-1] - yb[:, None]
        grads, _ = relu_mlp_grads(state, acts, (0.1 * np.sign(d) + 1.8 * d) / len(Xb))
        return {k: g + 0.1 * np.sign(state[k]) + 1.8 * state[k] for k, g in grads.items()}

    reference = numpy_fit(mlp_state(mlp), X, y, grad, epochs=5, batch_size=40, rate=rate.value,
                          momentum=0.9, nesterov=True, random_state=7)
    assert_states_close(est.get_state(), reference)


def test_mlp_classifier_log_loss_equals_scikit_learn():
    """NegLogLearningLoss on the raw score of a binary MLPClassifier's network (its weights
    in an MLPRegressor's graph) trains it as MLPClassifier does: the log loss's gradient
    with respect to the raw score is sigmoid(s) - y, scikit-learn's last delta."""
    X, y = classification()
    clf = sgd_mlp(MLPClassifier, (10,), len(X), learning_rate_init=0.1, momentum=0.9,
                  nesterovs_momentum=True)
    onx = start_and_continue(clf, X, y, epochs=10, convert=raw_score_onnx)
    est = FB(onx, learning_loss=NegLogLearningLoss(), max_iter=10, batch_size=len(X),
             learning_rate=LearningRateSGDNesterov(eta0=0.1, learning_rate="constant"),
             random_state=0)
    assert is_classifier(est)
    est.fit(X, y)
    assert_states_close(est.get_state(), mlp_state(clf))
    # scikit-learn clips probabilities at float32's eps in its loss; no row is near that here
    np.testing.assert_allclose(est.train_losses_, clf.loss_curve_[1:], rtol=1e-4)
    proba = sigmoid(est.predict(X).astype(np.float64).ravel())
    np.testing.assert_allclose(proba, clf.predict_proba(X)[:, 1], atol=1e-5)


def test_logistic_regression_with_log_loss_equals_numpy_and_scikit_learn():
    """A raw-score linear model (MatMul + Add) trained with NegLogLearningLoss: numpy's full
    batch gradient descent exactly, and, trained to convergence with LogisticRegression's
    L2 (1 / (2 C N) on the coefficients), LogisticRegression's probabilities."""
    X, y = classification()
    rows = len(X)
    coef = np.random.default_rng(3).normal(scale=0.1, size=10)
    onx = linear_onnx(coef, 0.1)

    def grad(state, Xb, yb, wb):
        return linear_grads(state, Xb, (sigmoid(linear_predict(state, Xb)) - yb[:, None]) / len(Xb))

    est = FB(onx, learning_loss="log", learning_rate=constant(0.5), max_iter=20,
             batch_size=rows)
    est.fit(X, y)
    start = {"coef": coef.reshape(-1, 1), "intercept": np.array([0.1])}
    reference = numpy_fit(start, X, y, grad, epochs=20, batch_size=rows, rate=lambda t: 0.5)
    assert_states_close(est.get_state(), reference, rtol=1e-4)

    @dataclasses.dataclass(frozen=True)
    class CoefOnly(ElasticLearningPenalty):
        def penalty(self, weights):
            return super().penalty(["coef"])

    C = 1.0
    est.set_params(max_iter=300, learning_rate=constant(1.0),
                   learning_penalty=CoefOnly(l1=0.0, l2=1 / (2 * C * rows)))
    est.fit(X, y)
    logistic = LogisticRegression(C=C, tol=1e-10, max_iter=1000).fit(X, y)
    state = est.get_state()
    np.testing.assert_allclose(state["coef"].ravel(), logistic.coef_.ravel(), atol=1e-3)
    np.testing.assert_allclose(state["intercept"], logistic.intercept_, atol=1e-3)
    proba = sigmoid(est.predict(X).astype(np.float64).ravel())
    np.testing.assert_allclose(proba, logistic.predict_proba(X)[:, 1], atol=1e-3)
    assert np.mean((proba > 0.5) == y) == pytest.approx(logistic.score(X, y), abs=0.01)


def test_log_loss_trains_a_zero_initialized_logistic_regression():
    """The usual start of a logistic regression, all weights 0, where every raw score is 0:
    the first update is the one of sigmoid(0) - y = 0.5 - y."""
    X, y = classification()
    est = FB(linear_onnx(np.zeros(10), 0.0), learning_loss="log", learning_rate=0.5,
             max_iter=1, batch_size=len(X)).fit(X, y)
    residual = (0.5 - y)[:, None] / len(X)
    expected = {"coef": -0.5 * X.T.astype(np.float64) @ residual,
                "intercept": -0.5 * residual.sum(axis=0)}
    assert_states_close(est.get_state(), expected, rtol=1e-5)


# -- the forward/backward object against scikit-learn's backpropagation ---------------------


@pytest.mark.parametrize("backend", ["onnx", pytest.param("ort", marks=pytest.mark.training)])
def test_forward_backward_gradients_equal_mlp_regressor_backprop(backend):
    X, y = regression(rows=64)
    mlp = quiet_fit(MLPRegressor(hidden_layer_sizes=(16, 8), max_iter=5, random_state=0), X, y)
    fb = OrtGradientForwardBackward(to_onnx(mlp, X), backend=backend)
    state = mlp_state(mlp)
    assert sorted(fb.weights_to_train) == sorted(state)
    fn = fb.new_instance()
    (prediction,) = fn.forward([X, *(state[w] for w in fb.weights_to_train)], training=True)
    np.testing.assert_allclose(prediction.ravel(), mlp.predict(X), rtol=1e-5, atol=1e-6)
    # scikit-learn's backpropagation of its loss, mean 0.5 (p - y)^2: the output's
    # gradient is (p - y) / N
    grads = fn.backward([(prediction - y[:, None]) / np.float32(len(X))])
    layers = len(mlp.coefs_)
    activations = [X] + [None] * layers
    deltas = [None] * layers
    coef_grads = [np.empty_like(c) for c in mlp.coefs_]
    intercept_grads = [np.empty_like(b) for b in mlp.intercepts_]
    mlp._backprop(X, y[:, None], None, activations, deltas, coef_grads, intercept_grads)
    expected = {}
    for i in range(layers):
        suffix = str(i) if i else ""
        expected[f"coefficient{suffix}"] = coef_grads[i]
        expected[f"intercepts{suffix}"] = intercept_grads[i].reshape(1, -1)
    ours = dict(zip(fb.grad_input_names, grads))
    assert_states_close({w: ours[w] for w in state}, expected, rtol=1e-4, atol=1e-5)
    # the input's gradient, which scikit-learn does not compute: deltas[0] @ coefs_[0].T / N
    np.testing.assert_allclose(ours["X"], deltas[0] @ mlp.coefs_[0].T / len(X), rtol=1e-4,
                               atol=1e-7)


@pytest.mark.parametrize("backend", ["onnx", pytest.param("ort", marks=pytest.mark.training)])
def test_forward_backward_gradients_equal_mlp_classifier_backprop(backend):
    """skl2onnx's graph of a binary MLPClassifier (probabilities, no ZipMap): the gradient
    of the mean log loss, seeded on the probabilities (-1 / (N P[i, y_i]) at the true
    class), is scikit-learn's backpropagation of its binary log loss."""
    X, y = classification(rows=64)
    clf = quiet_fit(MLPClassifier(hidden_layer_sizes=(16, 8), max_iter=5, random_state=0), X, y)
    onx = to_onnx(clf, X, options={"zipmap": False})
    fb = OrtGradientForwardBackward(onx, output_names=["probabilities"], backend=backend)
    state = mlp_state(clf)
    assert sorted(fb.weights_to_train) == sorted(state)
    fn = fb.new_instance()
    (proba,) = fn.forward([X, *(state[w] for w in fb.weights_to_train)], training=True)
    np.testing.assert_allclose(proba, clf.predict_proba(X), rtol=1e-5, atol=1e-6)
    seed = np.zeros_like(proba)
    rows = np.arange(len(X))
    seed[rows, y] = -1.0 / (len(X) * proba[rows, y])
    grads = dict(zip(fb.grad_input_names, fn.backward([seed])))
    layers = len(clf.coefs_)
    activations = [X] + [None] * layers
    deltas = [None] * layers
    coef_grads = [np.empty_like(c) for c in clf.coefs_]
    intercept_grads = [np.empty_like(b) for b in clf.intercepts_]
    clf._backprop(X, y[:, None].astype(np.float32), None, activations, deltas, coef_grads,
                  intercept_grads)
    expected = {}
    for i in range(layers):
        suffix = str(i) if i else ""
        expected[f"coefficient{suffix}"] = coef_grads[i]
        expected[f"intercepts{suffix}"] = intercept_grads[i].reshape(1, -1)
    # float32 both sides, the seed's 1 / P rounded before the sigmoid's P (1 - P) cancels it
    assert_states_close({w: grads[w] for w in state}, expected, rtol=1e-4, atol=5e-5)
    np.testing.assert_allclose(grads["X"], deltas[0] @ clf.coefs_[0].T / len(X), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.torch
def test_forward_backward_gradients_equal_torch_autograd():
    """The same MLPRegressor's gradients from torch's autograd, a second reference."""
    import torch

    X, y = regression(rows=64)
    mlp = quiet_fit(MLPRegressor(hidden_layer_sizes=(16, 8), max_iter=5, random_state=0), X, y)
    fb = OrtGradientForwardBackward(to_onnx(mlp, X))
    state = mlp_state(mlp)
    fn = fb.new_instance()
    (prediction,) = fn.forward([X, *(state[w] for w in fb.weights_to_train)], training=True)
    seed = np.random.default_rng(0).normal(size=prediction.shape).astype(np.float32)
    grads = dict(zip(fb.grad_input_names, fn.backward([seed])))
    tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for k, v in {"X": X, **state}.items()}
    h = torch.relu(tensors["X"] @ tensors["coefficient"] + tensors["intercepts"])
    h = torch.relu(h @ tensors["coefficient1"] + tensors["intercepts1"])
    out = h @ tensors["coefficient2"] + tensors["intercepts2"]
    out.backward(torch.tensor(seed, dtype=torch.float64))
    expected = {k: t.grad.numpy() for k, t in tensors.items()}
    assert_states_close({k: grads[k] for k in expected}, expected, rtol=1e-4, atol=1e-5)


# ==========================================================================================
# scikit-learn's conventions
# ==========================================================================================


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_get_params_set_params_and_clone(kind):
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](max_iter=3, random_state=0, learning_rate=0.05)
    params = est.get_params()
    assert params["max_iter"] == 3 and params["random_state"] == 0
    assert params["learning_rate"] == 0.05
    assert est.set_params(max_iter=4, batch_size=16) is est
    assert est.get_params()["max_iter"] == 4 and est.get_params()["batch_size"] == 16
    with pytest.raises(UnsupportedOptionError, match="no parameter 'max_iters'"):
        est.set_params(max_iters=4)
    est.fit(X, y)
    twin = clone(est)
    assert twin is not est and twin.get_params().keys() == est.get_params().keys()
    assert all(twin.get_params()[k] is v or twin.get_params()[k] == v
               for k, v in est.get_params().items() if k != "model_onnx")
    with pytest.raises(NotFittedError):
        twin.predict(X)  # a clone is not fitted
    twin.fit(X, y)  # same parameters, same random_state: the same training
    assert_states_close(twin.get_state(), est.get_state(), rtol=0, atol=0)
    assert len(est.train_losses_) == 4
    # a changed parameter recompiles: a new learning rate trains differently
    est.set_params(learning_rate=0.01).fit(X, y)
    assert not np.allclose(est.get_state()["coef"], twin.get_state()["coef"])
    assert is_regressor(est) and not is_classifier(est)


def test_learning_objects_are_resolved_on_construction_and_get_params_keeps_the_given_values():
    """The tutorial's attributes are objects (isinstance(opt.learning_rate,
    LearningRateSGDNesterov)); get_params gives what the constructor was given, so clone and
    GridSearchCV rebuild the same estimator."""
    est = FB(linear_onnx(*START), learning_rate="Nesterov", learning_loss="square_error",
             max_iter=2)
    assert isinstance(est.learning_rate, LearningRateSGDNesterov)
    assert isinstance(est.learning_loss, SquareLearningLoss)
    assert isinstance(est.learning_penalty, NoLearningPenalty)
    whole = OrtGradientOptimizer(whole_graph_model(), None, learning_rate="SGD")
    assert isinstance(whole.learning_rate, LearningRateSGD)
    params = est.get_params()
    assert (params["learning_rate"], params["learning_loss"], params["learning_penalty"]) == (
        "Nesterov", "square_error", None)
    twin = clone(est)
    assert twin.get_params()["learning_rate"] == "Nesterov"
    assert twin.learning_rate == est.learning_rate and twin.learning_loss == est.learning_loss
    # set_params and assignment resolve as the constructor does
    est.set_params(learning_loss="elastic_error", learning_penalty="l1l2")
    assert isinstance(est.learning_loss, ElasticLearningLoss)
    assert isinstance(est.learning_penalty, ElasticLearningPenalty)
    assert est.get_params()["learning_loss"] == "elastic_error"
    est.learning_rate = "SGD"
    assert isinstance(est.learning_rate, LearningRateSGD)
    assert est.get_params()["learning_rate"] == "SGD"
    X, y, _ = small_linear()
    est.fit(X, y)
    copy = pickle.loads(pickle.dumps(est))
    assert copy.get_params()["learning_loss"] == "elastic_error"
    assert isinstance(copy.learning_loss, ElasticLearningLoss)
    np.testing.assert_array_equal(copy.predict(X), est.predict(X))
    # a bad name is named at once
    with pytest.raises(UnsupportedOptionError, match="Did you mean 'Nesterov'"):
        FB(linear_onnx(*START), learning_rate="Nesterof")
    with pytest.raises(UnsupportedOptionError, match="Unknown learning loss"):
        est.set_params(learning_loss="squared")
    grid = GridSearchCV(FB(linear_onnx(*START), max_iter=3, random_state=0),
                        {"learning_loss": ["square_error", "absolute_error"],
                         "learning_rate": ["SGD", "Nesterov"]}, cv=2).fit(X, y)
    assert grid.best_params_["learning_loss"] in ("square_error", "absolute_error")
    assert isinstance(grid.best_estimator_.learning_loss, (SquareLearningLoss,
                                                           AbsoluteLearningLoss))


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_pickling_keeps_the_trained_state_and_a_warm_start_continues(kind):
    """Unpickled, an estimator predicts as before; a warm-started fit then continues as the
    original's would: same weights, momentum velocities, rate schedule, shuffling and loss
    history."""
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](max_iter=3, batch_size=16, random_state=0, warm_start=True,
                           learning_rate=LearningRateSGDNesterov(eta0=0.02, power_t=0.5))
    est.fit(X, y)
    copy = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(est))))  # twice: kept through
    np.testing.assert_array_equal(copy.predict(X), est.predict(X))
    assert_states_close(copy.get_state(), est.get_state(), rtol=0, atol=0)
    assert copy.train_losses_ == est.train_losses_
    assert copy.get_params().keys() == est.get_params().keys()
    est.fit(X, y)
    copy.fit(X, y)
    assert len(copy.train_losses_) == 6
    np.testing.assert_allclose(copy.train_losses_, est.train_losses_, rtol=1e-6)
    assert_states_close(copy.get_state(), est.get_state(), rtol=1e-6)
    # an unfitted estimator stays unfitted
    with pytest.raises(NotFittedError):
        pickle.loads(pickle.dumps(ESTIMATORS[kind]())).predict(X)


def test_grid_search_over_learning_rates_and_losses_for_regression():
    X, y, _ = small_linear()
    est = FB(linear_onnx(*START), max_iter=15, batch_size=20, random_state=0)
    grid = GridSearchCV(est, {"learning_rate": [1e-5, LearningRateSGDNesterov(eta0=0.02)],
                              "learning_loss": ["square_error", AbsoluteLearningLoss(),
                                                "ElasticLearningLoss"]},
                        scoring="neg_mean_squared_error", cv=3)
    grid.fit(X, y)
    scores = grid.cv_results_["mean_test_score"]
    assert len(scores) == 6 and np.isfinite(scores).all()
    assert grid.best_params_["learning_rate"] == LearningRateSGDNesterov(eta0=0.02)
    assert grid.best_score_ > -0.1  # a trained linear model on a nearly linear target
    np.testing.assert_allclose(grid.predict(X), grid.best_estimator_.predict(X))


def test_grid_search_over_learning_rates_and_penalties_for_classification():
    X, y = classification()
    est = FB(linear_onnx(np.full(10, 0.01), 0.0), learning_loss="NegLogLearningLoss",
             max_iter=20, batch_size=20, random_state=0)
    assert is_classifier(est)
    grid = GridSearchCV(est, {"learning_rate": [1e-6, 0.1],
                              "learning_loss": ["log", NegLogLearningLoss(eps=1e-3)],
                              "learning_penalty": [None, ElasticLearningPenalty(0.0, 1e-3)]},
                        cv=3)  # the estimators' score: the negated mean log loss
    grid.fit(X, y)
    assert len(grid.cv_results_["mean_test_score"]) == 8
    assert grid.best_params_["learning_rate"] == 0.1
    # an untrained model's log loss is about log(2) = 0.69
    assert grid.best_score_ > -0.65 and grid.cv_results_["mean_test_score"].min() < -0.68
    proba = sigmoid(grid.predict(X).ravel())
    logistic = LogisticRegression().fit(X, y)
    assert np.mean((proba > 0.5) == y) > logistic.score(X, y) - 0.05


# ==========================================================================================
# Where the reference was wrong
# ==========================================================================================


def half_square_grad(state, Xb, yb, wb):
    """The batch gradient of SquareLearningLoss, mean 0.5 (p - y)^2 (weighted when wb)."""
    d = linear_predict(state, Xb) - yb[:, None]
    g = d / len(Xb) if wb is None else wb[:, None] * d / wb.sum()
    return linear_grads(state, Xb, g)


def square_grad(state, Xb, yb, wb):
    """The whole-graph default loss's batch gradient, mean (p - y)^2 (weighted when wb)."""
    return {k: 2 * v for k, v in half_square_grad(state, Xb, yb, wb).items()}


START_STATE = {"coef": START[0].reshape(-1, 1), "intercept": np.array([START[1]])}


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_training_starts_from_the_models_initializers(kind):
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](max_iter=1, learning_rate=0.0).fit(X, y)
    assert_states_close(est.get_state(), {k: v.astype(np.float32) for k, v in
                                          START_STATE.items()}, rtol=0, atol=0)
    est.set_params(max_iter=2, learning_rate=constant(0.05), batch_size=30,
                   random_state=4).fit(X, y)
    grad = half_square_grad if kind == "forward_backward" else square_grad
    reference = numpy_fit(START_STATE, X, y, grad, epochs=2, batch_size=30,
                          rate=lambda t: 0.05, random_state=4)
    assert_states_close(est.get_state(), reference, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_warm_start_continues_the_last_fit_and_a_cold_fit_restarts(kind):
    X, y, _ = small_linear()
    rate = LearningRateSGDNesterov(eta0=0.02, power_t=0.5)
    whole = ESTIMATORS[kind](max_iter=5, batch_size=16, random_state=0, learning_rate=rate)
    whole.fit(X, y)
    parts = ESTIMATORS[kind](max_iter=3, batch_size=16, random_state=0, learning_rate=rate,
                             warm_start=True)
    parts.fit(X, y)
    parts.set_params(max_iter=2).fit(X, y)
    assert_states_close(parts.get_state(), whole.get_state(), rtol=1e-6)
    np.testing.assert_allclose(parts.train_losses_, whole.train_losses_, rtol=1e-6)
    cold = ESTIMATORS[kind](max_iter=5, batch_size=16, random_state=0, learning_rate=rate)
    cold.fit(X, y)
    cold.fit(X, y)  # warm_start=False: the second fit starts over, as the first did
    assert_states_close(cold.get_state(), whole.get_state(), rtol=0, atol=0)
    assert cold.train_losses_ == whole.train_losses_


@pytest.mark.parametrize("eta", [0.1, 0.01])
def test_the_penalty_update_is_scaled_by_the_learning_rate(eta):
    """w' = w - eta (loss gradient + l1 sign(w) + 2 l2 w): the penalty's gradient joins the
    loss's before the rate applies (the reference subtracted it unscaled)."""
    X, y, onx = small_linear()
    est = FB(onx, learning_rate=constant(eta),
             learning_penalty=ElasticLearningPenalty(l1=0.3, l2=0.2), max_iter=2,
             batch_size=len(X)).fit(X, y)

    def grad(state, Xb, yb, wb):
        grads = half_square_grad(state, Xb, yb, wb)
        return {k: g + 0.3 * np.sign(state[k]) + 0.4 * state[k] for k, g in grads.items()}

    reference = numpy_fit(START_STATE, X, y, grad, epochs=2, batch_size=len(X),
                          rate=lambda t: eta)
    assert_states_close(est.get_state(), reference, rtol=1e-5)


@pytest.mark.parametrize("loss", [AbsoluteLearningLoss(), ElasticLearningLoss(0.5, 0.5),
                                  ElasticLearningLoss(1.0, 0.0), SquareLearningLoss()])
def test_every_loss_descends(loss):
    """The absolute and elastic losses' gradients have the square loss's sign convention
    (d loss / d p with d = p - y): training reduces each loss, and the first update is
    numpy's."""
    X, y, onx = small_linear()
    l1, l2 = {AbsoluteLearningLoss: (1.0, 0.0), SquareLearningLoss: (0.0, 0.5)}.get(
        type(loss), (getattr(loss, "l1_weight", 0), getattr(loss, "l2_weight", 0)))
    est = FB(onx, learning_loss=loss, learning_rate=0.05, max_iter=1, batch_size=len(X))
    est.fit(X, y)

    def grad(state, Xb, yb, wb):
        d = linear_predict(state, Xb) - yb[:, None]
        return linear_grads(state, Xb, (l1 * np.sign(d) + 2 * l2 * d) / len(Xb))

    reference = numpy_fit(START_STATE, X, y, grad, epochs=1, batch_size=len(X),
                          rate=lambda t: 0.05)
    assert_states_close(est.get_state(), reference, rtol=1e-5)
    est.set_params(max_iter=30, batch_size=20, random_state=0).fit(X, y)
    losses = est.train_losses_
    assert losses[-1] < 0.5 * losses[0]
    d = START_STATE["intercept"] + X @ START_STATE["coef"] - y[:, None]
    start_loss = np.mean(l1 * np.abs(d) + l2 * d**2)
    assert -est.score(X, y) < 0.5 * start_loss


def test_class_names_are_accepted_as_strings():
    X, y, onx = small_linear()
    by_name = FB(onx, learning_rate="LearningRateSGDNesterov", learning_loss="ElasticLearningLoss",
                 learning_penalty="ElasticLearningPenalty", max_iter=3, batch_size=16,
                 random_state=0).fit(X, y)
    by_instance = FB(onx, learning_rate=LearningRateSGDNesterov(),
                     learning_loss=ElasticLearningLoss(), learning_penalty=ElasticLearningPenalty(),
                     max_iter=3, batch_size=16, random_state=0).fit(X, y)
    plain = FB(onx, max_iter=3, batch_size=16, random_state=0).fit(X, y)
    assert_states_close(by_name.get_state(), by_instance.get_state(), rtol=0, atol=0)
    assert not np.allclose(by_name.get_state()["coef"], plain.get_state()["coef"])
    assert by_name.get_params()["learning_loss"] == "ElasticLearningLoss"  # kept as given
    assert clone(by_name).get_params()["learning_rate"] == "LearningRateSGDNesterov"
    whole = OrtGradientOptimizer(whole_graph_model(), None, learning_rate="LearningRateSGDNesterov",
                                 max_iter=3, batch_size=16, random_state=0).fit(X, y)
    twin = OrtGradientOptimizer(whole_graph_model(), None, learning_rate=LearningRateSGDNesterov(),
                                max_iter=3, batch_size=16, random_state=0).fit(X, y)
    assert_states_close(whole.get_state(), twin.get_state(), rtol=0, atol=0)
    with pytest.raises(UnsupportedOptionError, match="LearningRateSGDNesterov"):
        FB(onx, learning_rate="LearningRateSGDNesterof").fit(X, y)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
@pytest.mark.parametrize(("max_iter", "every", "count"), [(5, 0.1, 5), (3, 0.5, 3), (7, 2, 3),
                                                           (20, 0.1, 10)])
def test_validation_every_with_few_epochs(kind, max_iter, every, count):
    """validation_every below 1 is a fraction of max_iter, at least one epoch (the reference
    divided by zero for max_iter < 10); a number >= 1 is a number of epochs."""
    X, y, _ = small_linear()
    X, y, X_val, y_val = X[:90], y[:90], X[90:], y[90:]
    est = ESTIMATORS[kind](max_iter=max_iter, validation_every=every, batch_size=20,
                           learning_rate=0.02, random_state=0)
    est.fit(X, y, X_val=X_val, y_val=y_val)
    assert len(est.validation_losses_) == count and len(est.train_losses_) == max_iter
    period = max(1, int(max_iter * every)) if every < 1 else every
    if max_iter % period == 0:  # the last one is the loss of the final weights
        d = est.predict(X_val) - y_val[:, None]
        expected = np.mean(0.5 * d**2 if kind == "forward_backward" else d**2)
        assert est.validation_losses_[-1] == pytest.approx(expected, rel=1e-5)
    assert np.all(np.diff(est.validation_losses_) < 0)  # a descending fit
    assert est.fit(X, y).validation_losses_ is None  # no validation data, no losses


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_each_row_is_used_exactly_once_an_epoch(kind):
    """One-hot rows and no intercept: the update of weight j comes from row j alone, so
    after one epoch from zero each weight shows how often, and in which batch size, its
    row was used. 20 rows in batches of 6: three batches of 6 (the whole-graph optimizer
    runs them in one graph, its permutation an input) and one of the last 2 rows of
    default_rng(random_state).permutation(20)."""
    rows, eta = 20, 0.3
    X = np.eye(rows, dtype=np.float32)
    y = np.ones(rows, np.float32)
    onx = linear_onnx(np.zeros(rows))
    if kind == "forward_backward":
        est, scale = FB(onx, learning_rate=eta, max_iter=1, batch_size=6, random_state=5), 1
    else:
        est = OrtGradientOptimizer(lossgraph.add_loss_output(onx), None, learning_rate=eta,
                                   max_iter=1, batch_size=6, random_state=5)
        scale = 2  # (p - y)^2
    est.fit(X, y)
    coef = est.get_state()["coef"].ravel()
    last = np.random.default_rng(5).permutation(rows)[18:]
    expected = np.full(rows, scale * eta / 6)
    expected[last] = scale * eta / 2
    np.testing.assert_allclose(coef, expected, rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_minibatches_follow_the_trainers_permutations(kind):
    """Several epochs of uneven minibatches (120 rows in batches of 50: 50, 50, 20) equal
    numpy's run over default_rng(random_state).permutation(rows) epoch after epoch."""
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](max_iter=4, batch_size=50, random_state=11,
                           learning_rate=constant(0.05))
    est.fit(X, y)
    grad = half_square_grad if kind == "forward_backward" else square_grad
    reference = numpy_fit(START_STATE, X, y, grad, epochs=4, batch_size=50,
                          rate=lambda t: 0.05, random_state=11)
    assert_states_close(est.get_state(), reference, rtol=1e-5)
    other = numpy_fit(START_STATE, X, y, grad, epochs=4, batch_size=50,
                      rate=lambda t: 0.05, random_state=12)
    assert not np.allclose(other["coef"], reference["coef"], rtol=1e-4)  # the order matters


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_a_float_learning_rate_is_onnxcustoms_invscaling_and_the_repr_says_so(kind):
    """onnxcustom's select(0.05) is LearningRateSGD(eta0=0.05): every update of epoch t at
    0.05 / (t + 1) ** 0.25 (a decision, docs/reference/errors.md)."""
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](max_iter=4, batch_size=50, random_state=11, learning_rate=0.05)
    assert est.learning_rate == LearningRateSGD(eta0=0.05)
    assert "learning_rate=LearningRateSGD(eta0=0.05" in repr(est)
    assert "learning_rate='invscaling'" in repr(est)
    assert est.get_params()["learning_rate"] == 0.05
    est.fit(X, y)
    grad = half_square_grad if kind == "forward_backward" else square_grad
    reference = numpy_fit(START_STATE, X, y, grad, epochs=4, batch_size=50,
                          rate=lambda t: 0.05 / (t + 1) ** 0.25, random_state=11)
    assert_states_close(est.get_state(), reference, rtol=1e-5)
    # onnxcustom's own tests: the default shows as the object too, and is invscaling
    default = repr(ESTIMATORS[kind]())
    assert default.startswith(f"{type(est).__name__}(model_onnx=<ModelProto")
    assert "learning_rate=LearningRateSGD(eta0=0.01" in default
    assert "learning_rate='invscaling'" in default and "max_iter" not in default


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_sample_weights_of_shape_n_weigh_rows_without_broadcasting(kind):
    """A weight vector (N,) against a prediction (N, 1) never broadcasts to (N, N): the
    loss is the weighted mean, sum w l / sum w, and the updates are numpy's."""
    X, y, onx = small_linear()
    w = np.random.default_rng(6).uniform(0.0, 3.0, len(y)).astype(np.float32)
    if kind == "forward_backward":
        est = FB(onx, weight_name="weight", learning_rate=0.05, max_iter=1,
                 batch_size=len(X), random_state=0)
        grad, per_row = half_square_grad, (lambda d: 0.5 * d**2)
    else:
        est = OrtGradientOptimizer(whole_graph_model(), None, learning_rate=0.05, max_iter=1,
                                   batch_size=len(X), random_state=0)
        grad, per_row = square_grad, (lambda d: d**2)
    est.fit(X, y, w)
    d = linear_predict(START_STATE, X).ravel() - y
    assert est.train_losses_[0] == pytest.approx(np.sum(w * per_row(d)) / np.sum(w), rel=1e-5)
    reference = numpy_fit(START_STATE, X, y, grad, epochs=1, batch_size=len(X),
                          rate=lambda t: 0.05, sample_weight=w)
    assert_states_close(est.get_state(), reference, rtol=1e-5)
    d = est.predict(X).ravel().astype(np.float64) - y
    assert -est.score(X, y, w) == pytest.approx(np.sum(w * per_row(d)) / np.sum(w), rel=1e-5)
    if kind == "forward_backward":
        losses = est.losses(X, y, w)
        assert losses.shape == (len(X),)
        np.testing.assert_allclose(losses, w * per_row(d), rtol=1e-5, atol=1e-7)
    with pytest.raises(LossgraphError):
        est.fit(X, y, np.ones((len(X), len(X)), np.float32))  # an (N, N) weight is refused


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_sample_weights_in_one_column_as_onnxcustoms_tests_pass_them(kind):
    """onnxcustom's tests call fit(X, y.reshape((-1, 1)), w.reshape((-1, 1))): one column of
    weights is the (N,) row weights (lossgraph's Trainer keeps refusing it, catalogued)."""
    X, y, _ = small_linear()
    w = np.random.default_rng(6).uniform(0.5, 2.0, len(y)).astype(np.float32)
    kw = {"weight_name": "weight"} if kind == "forward_backward" else {}
    flat = ESTIMATORS[kind](max_iter=2, random_state=0, **kw).fit(X, y, w)
    column = ESTIMATORS[kind](max_iter=2, random_state=0, **kw).fit(
        X, y.reshape(-1, 1), w.reshape(-1, 1))
    assert column.train_losses_ == flat.train_losses_
    assert column.score(X, y, w.reshape(-1, 1)) == flat.score(X, y, w)
    column.partial_fit(X, y, w.reshape(-1, 1))
    if kind == "forward_backward":
        np.testing.assert_array_equal(column.losses(X, y, w.reshape(-1, 1)),
                                      column.losses(X, y, w))
    with pytest.raises(ShapeMismatchError, match="sample_weight has shape"):
        column.fit(X, y, np.ones((len(y), 2), np.float32))


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_verbose_shows_a_progress_bar(kind, capsys):
    X, y, _ = small_linear()
    ESTIMATORS[kind](max_iter=4, verbose=1, learning_rate=0.01).fit(X, y)
    err = capsys.readouterr().err
    assert "lossgraph" in err and "4/4" in err and "epoch" in err
    ESTIMATORS[kind](max_iter=4, verbose=0, learning_rate=0.01).fit(X, y)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
@pytest.mark.parametrize("eta", [1e3, 1e36])
def test_exc_false_turns_divergence_into_a_warning_with_finite_weights(kind, eta):
    """With eta = 1e36 an update overflows the weights to infinity one step before the loss
    becomes NaN: the weights before the failing step are not finite, so exc=False goes back
    to the last finite ones."""
    X, y, _ = small_linear()
    y = y * 1e3
    est = ESTIMATORS[kind](max_iter=50, learning_rate=eta, batch_size=20, random_state=0)
    with pytest.raises(ConvergenceError):
        est.fit(X, y)
    # the fitted attributes say what the trainer holds: the state from before the failure
    assert len(est.train_losses_) < 50
    for name, value in est.get_state().items():
        np.testing.assert_array_equal(est.trained_coef_[name], value)
    if kind == "whole_graph":
        return  # exc is the forward/backward optimizer's parameter
    est.set_params(exc=False)
    with pytest.warns(ConvergenceWarning, match="diverged"):
        est.fit(X, y)
    state = est.get_state()
    assert all(np.isfinite(v).all() for v in state.values())
    assert len(est.train_losses_) < 50 and np.isfinite(est.train_losses_).all()
    assert np.isfinite(est.predict(X)).all()


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_a_non_finite_validation_loss_raises_evaluation_error(kind):
    """onnxcustom raised EvaluationError when the validation loss was NaN or infinite; the
    fitted attributes then hold what was trained until that epoch."""
    X, y, _ = small_linear()
    X_val = np.full((10, 4), 1e30, np.float32)  # finite data whose loss overflows float32
    y_val = np.zeros(10, np.float32)
    est = ESTIMATORS[kind](max_iter=3, learning_rate=constant(0.01), random_state=0)
    with pytest.raises(EvaluationError, match=r"validation loss is inf after epoch 0"):
        est.fit(X, y, X_val=X_val, y_val=y_val)
    assert len(est.train_losses_) == 1 and est.validation_losses_ == []
    assert_states_close(est.get_state(), ESTIMATORS[kind](max_iter=1, learning_rate=constant(
        0.01), random_state=0).fit(X, y).get_state(), rtol=0, atol=0)
    est.fit(X, y, X_val=X, y_val=y)  # finite: recorded as before
    assert len(est.validation_losses_) == 3 and np.isfinite(est.validation_losses_).all()
    if kind == "whole_graph":
        return  # exc is the forward/backward optimizer's parameter
    est.set_params(exc=False)  # onnxcustom's forward/backward optimizer warned then
    with pytest.warns(ConvergenceWarning, match="validation loss is inf after epoch") as caught:
        est.fit(X, y, X_val=X_val, y_val=y_val)
    assert [f"epoch {t}:" in str(w.message) for t, w in enumerate(caught)] == [True] * 3
    assert len(est.train_losses_) == 3 and est.validation_losses_ == [np.inf] * 3


# ==========================================================================================
# The whole-graph optimizer's momentum, files, exported models and errors
# ==========================================================================================


@pytest.mark.parametrize("nesterov", [True, False])
def test_whole_graph_optimizer_takes_nesterov_momentum(nesterov):
    """LearningRateSGDNesterov in the fused epoch graph: scikit-learn's SGDOptimizer update,
    the invscaling rate stepped once an epoch, minibatches in the trainer's order."""
    X, y, _ = small_linear()
    rate = LearningRateSGDNesterov(eta0=0.01, power_t=0.5, momentum=0.8, nesterov=nesterov)
    est = OrtGradientOptimizer(whole_graph_model(), ["coef", "intercept"], learning_rate=rate,
                               max_iter=4, batch_size=50, random_state=2).fit(X, y)
    reference = numpy_fit(START_STATE, X, y, square_grad, epochs=4, batch_size=50,
                          rate=rate.value, momentum=0.8, nesterov=nesterov, random_state=2)
    assert_states_close(est.get_state(), reference, rtol=1e-5)


def test_saved_gradient_writes_the_training_graph_and_never_over_a_foreign_file(tmp_path):
    X, y, _ = small_linear()
    path = tmp_path / "gradient.onnx"
    est = OrtGradientOptimizer(whole_graph_model(), None, max_iter=1, saved_gradient=path)
    est.fit(X, y)
    graph = onnx.load(path)
    onnx.checker.check_model(graph)
    assert {i.name for i in graph.graph.input} >= {"X", "label", "coef", "intercept"}
    # lossgraph wrote that file: another estimator may replace it
    OrtGradientOptimizer(whole_graph_model(), None, max_iter=1, saved_gradient=str(path),
                         learning_rate="Nesterov").fit(X, y)
    assert onnx.load(path).graph != graph.graph
    foreign = tmp_path / "mine.onnx"
    foreign.write_bytes(b"a file lossgraph did not write")
    with pytest.raises(UnsafeWriteError):
        OrtGradientOptimizer(whole_graph_model(), None, max_iter=1,
                             saved_gradient=foreign).fit(X, y)
    assert foreign.read_bytes() == b"a file lossgraph did not write"


def test_save_onnx_graph_writes_files_and_bytes_and_never_over_a_foreign_file(tmp_path):
    X, y, onx = small_linear()
    est = FB(onx, learning_penalty="l1l2", learning_rate="Nesterov", max_iter=2).fit(X, y)
    paths = est.save_onnx_graph(tmp_path)
    assert set(paths) == {"model_onnx", "forward", "backward", "gradient", "predict", "evaluate",
                          "learning_loss", "learning_rate", "learning_penalty"}
    assert set(paths["learning_loss"]) == {"loss_grad_onnx"}
    assert set(paths["learning_rate"]) == {"update_onnx"}
    assert set(paths["learning_penalty"]) == {"penalty_onnx"}
    flat = [paths[k] for k in ("model_onnx", "forward", "backward", "gradient", "predict",
                               "evaluate")] + [
        paths["learning_loss"]["loss_grad_onnx"], paths["learning_rate"]["update_onnx"],
        paths["learning_penalty"]["penalty_onnx"]]
    assert len(set(flat)) == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        str(p).rsplit("/", 1)[-1] for p in flat)
    for path in flat:
        onnx.checker.check_model(onnx.load(path))
    # the predict graph predicts like the estimator, with the trained weights fed
    predict = onnx.load(paths["predict"])
    feeds = {"X": X, **{k: v for k, v in est.get_state().items()
                       if k in {i.name for i in predict.graph.input}}}
    np.testing.assert_allclose(run_onnx(predict, feeds)[0], est.predict(X), rtol=1e-6, atol=1e-6)
    assert est.save_onnx_graph(tmp_path) == paths  # its own files: replaced
    serialized = est.save_onnx_graph(bytes)
    assert set(serialized) == set(paths) and set(serialized["learning_rate"]) == {"update_onnx"}
    update = onnx.load_model_from_string(serialized["learning_rate"]["update_onnx"])
    assert update.graph == onnx.load(paths["learning_rate"]["update_onnx"]).graph
    # a foreign file at one of the names: nothing is written
    other = tmp_path / "other"
    other.mkdir()
    name = str(paths["gradient"]).rsplit("/", 1)[-1]
    (other / name).write_text("not lossgraph's")
    with pytest.raises(UnsafeWriteError):
        est.save_onnx_graph(other)
    assert [p.name for p in other.iterdir()] == [name]
    assert (other / name).read_text() == "not lossgraph's"
    prefixed = est.save_onnx_graph(other, prefix="run1_", suffix="_b")
    assert str(prefixed["gradient"]).rsplit("/", 1)[-1].startswith("run1_")


def test_save_onnx_graph_into_a_missing_folder_is_a_file_not_found_error(tmp_path):
    """onnxcustom raised FileNotFoundError; lossgraph's error is also one (and still the
    UnsafeWriteError a missing folder has always been), before anything is written."""
    X, y, onx = small_linear()
    est = FB(onx, max_iter=1).fit(X, y)
    for missing in (tmp_path / "missing", str(tmp_path / "missing")):
        with pytest.raises(FileNotFoundError, match="does not exist") as caught:
            est.save_onnx_graph(missing)
        assert isinstance(caught.value, LossgraphError)
        assert isinstance(caught.value, UnsafeWriteError)
    # TrainingProgram.save_onnx_graph makes its folder, but not a missing parent
    with pytest.raises(FileNotFoundError, match="does not exist") as caught:
        est.train_session_.program.save_onnx_graph(tmp_path / "no" / "graphs")
    assert isinstance(caught.value, LossgraphError)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("mine")
    with pytest.raises(UnsupportedOptionError, match="existing folder"):
        est.save_onnx_graph(tmp_path / "file")  # there, but not a folder


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_get_trained_onnx_predicts_like_the_estimator(kind):
    X, y, onx = small_linear()
    est = ESTIMATORS[kind](max_iter=3, learning_rate=0.05, random_state=0).fit(X, y)
    trained = est.get_trained_onnx(onx)
    assert set(initializers(trained)) == set(initializers(onx))
    assert_states_close(initializers(trained), est.get_state(), rtol=0, atol=0)
    (prediction,) = run_onnx(trained, {"X": X})
    np.testing.assert_allclose(prediction, est.predict(X), rtol=1e-6, atol=1e-6)
    assert not np.allclose(run_onnx(onx, {"X": X})[0], prediction)  # trained, not the start
    default = est.get_trained_onnx()  # the model given to the constructor
    assert_states_close({k: v for k, v in initializers(default).items() if k in START_STATE},
                        est.get_state(), rtol=0, atol=0)
    if kind == "forward_backward":
        np.testing.assert_allclose(run_onnx(default, {"X": X})[0], est.predict(X), rtol=1e-6,
                                   atol=1e-6)
    else:  # the model carrying its loss: its loss is the estimator's
        outputs = run_onnx(default, {"X": X, "label": y[:, None],
                                     "weight": np.ones(len(y), np.float32)})
        assert float(outputs[0]) == pytest.approx(-est.score(X, y), rel=1e-5)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_errors_are_lossgraph_errors(kind):
    X, y, _ = small_linear()
    est = ESTIMATORS[kind]()
    for call in (lambda: est.predict(X), est.get_state, est.get_trained_onnx,
                 lambda: est.score(X, y)):
        with pytest.raises(NotFittedError, match="not fitted"):
            call()
    with pytest.raises(UnsupportedOptionError, match="SGDOptimizer"):
        ESTIMATORS[kind](training_optimizer_name="AdamOptimizer").fit(X, y)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ProviderError, match="CUDAExecutionProvider"):
            ESTIMATORS[kind](device="cuda").fit(X, y)
        fitted = ESTIMATORS[kind](max_iter=1).fit(X, y)
        with pytest.raises(ProviderError):  # not silently on the CPU sessions compiled before
            fitted.set_params(device="cuda").fit(X, y)
    if kind == "whole_graph":
        with pytest.raises(UnknownNameError, match="loss_output_name='loss'"):
            OrtGradientOptimizer(whole_graph_model(), None, loss_output_name="score").fit(X, y)
    for error in (NotFittedError, UnknownNameError, UnsupportedOptionError, ProviderError,
                  ConvergenceError, UnsafeWriteError):
        assert issubclass(error, LossgraphError)


def test_sample_weights_without_weight_name_weigh_rows_as_the_documents_call_it():
    """The reference documents call fit(X, y, w) on the forward/backward optimizer without a
    weight_name: the loss graph gets a 'weight' input, and the fit equals the named one."""
    X, y, onx = small_linear()
    w = np.linspace(0.5, 2.0, len(X)).astype(np.float32)
    unnamed = FB(onx, max_iter=3, random_state=0).fit(X, y, w)
    named = FB(onx, weight_name="weight", max_iter=3, random_state=0).fit(X, y, w)
    unweighted = FB(onx, max_iter=3, random_state=0).fit(X, y)
    for name, value in named.get_state().items():
        np.testing.assert_array_equal(unnamed.get_state()[name], value)
    assert not np.allclose(unweighted.get_state()["coef"], named.get_state()["coef"])
    np.testing.assert_allclose(unnamed.losses(X, y, w), named.losses(X, y, w))


def test_enable_logging_logs_each_epoch_to_the_lossgraph_logger(caplog):
    X, y, onx = small_linear()
    with caplog.at_level("INFO", logger="lossgraph"):
        est = FB(onx, enable_logging=True, max_iter=3, learning_rate=0.01,
                 random_state=0).fit(X, y)
    lines = [r.getMessage() for r in caplog.records if r.name == "lossgraph"]
    assert len(lines) == 3 and lines[0].startswith("[OrtGradientForwardBackwardOptimizer.fit]")
    assert f"loss={est.train_losses_[2]:g}" in lines[2]
    assert f"learning_rate={0.01 / 3 ** 0.25:g}" in lines[2]  # a float is invscaling
    caplog.clear()
    FB(onx, max_iter=2).fit(X, y)
    assert not [r for r in caplog.records if r.name == "lossgraph"]


# ==========================================================================================
# partial_fit (incremental learning, as scikit-learn's MLP does it): each call is one epoch
# over the data it is given, continuing the weights, the momentum, the learning-rate schedule
# and the shuffling
# ==========================================================================================

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
