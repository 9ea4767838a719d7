"""lossgraph.compat's learning rates (lossgraph/compat/learning_rate.py) against onnxcustom's
schedules, scikit-learn's SGDOptimizer and lossgraph.optim."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.neural_network._stochastic_optimizers import SGDOptimizer
from support.estimators import run_onnx

from lossgraph.compat import BaseLearningRate, LearningRateSGD, LearningRateSGDNesterov
from lossgraph.errors import UnsupportedOptionError
from lossgraph.optim import SGD, Momentum, update_graph


def test_invscaling_matches_sklearn_sgd_optimizer_per_epoch():
    rate = LearningRateSGD(eta0=0.1, power_t=0.5)
    reference = SGDOptimizer([np.zeros(1)], learning_rate_init=0.1, lr_schedule="invscaling",
                             power_t=0.5)
    for epoch in range(1, 6):
        reference.iteration_ends(epoch)
        assert rate.value(epoch) == pytest.approx(reference.learning_rate, rel=1e-15)
    assert rate.value(0) == 0.1


def onnxcustom_rates(eta0, alpha, power_t, schedule, n):
    """onnxcustom's LearningRateSGD.loop(n), transcribed: init_learning_rate, then
    update_learning_rate(i + 1) after each value."""
    values, eta = [], eta0
    if schedule == "optimal":
        typw = np.sqrt(1.0 / np.sqrt(alpha))
        optimal_init = 1.0 / (typw / max(1.0, (1 + typw) * 2) * alpha)
        optimal_fact = eta0 / (1.0 / (alpha * optimal_init))
    for i in range(n):
        values.append(eta)
        t = i + 1
        if schedule == "optimal":
            eta = optimal_fact / (alpha * (optimal_init + t))
        elif schedule == "invscaling":
            eta = eta0 / np.power(t + 1, power_t)
    return values


@pytest.mark.parametrize("alpha", [1e-4, 0.01, 0.5, 3.0])
@pytest.mark.parametrize("eta0", [0.01, 0.3])
def test_optimal_is_onnxcustoms_schedule_starting_at_eta0(eta0, alpha):
    """onnxcustom rescaled scikit-learn's optimal schedule to start at eta0 (scikit-learn's
    starts at alpha**-0.25, 10 by default, and diverges on the documents' examples)."""
    rate = LearningRateSGD(eta0=eta0, alpha=alpha, learning_rate="optimal")
    expected = onnxcustom_rates(eta0, alpha, 0.25, "optimal", 50)
    assert rate.value(0) == eta0
    np.testing.assert_allclose([rate.value(t) for t in range(50)], expected, rtol=1e-12)
    nesterov = LearningRateSGDNesterov(eta0=eta0, alpha=alpha, learning_rate="optimal")
    np.testing.assert_allclose([nesterov.value(t) for t in range(50)], expected, rtol=1e-12)
    # lossgraph.optim.SGD keeps scikit-learn's (tests/test_optim.py)
    assert SGD(learning_rate_schedule="optimal", alpha=alpha).schedule(1) == pytest.approx(
        alpha ** -0.25)


@pytest.mark.parametrize("schedule", ["invscaling", "optimal", "constant"])
def test_loop_yields_onnxcustoms_rates(schedule):
    """onnxcustom's own test_learning_rate.py, and its loop's values exactly."""
    rate = LearningRateSGD(learning_rate=schedule)
    values = list(rate.loop())
    assert len(values) == 1000 and values[0] == 0.01
    if schedule == "constant":
        assert values == [0.01] * 1000
    else:
        assert all(b < a for a, b in zip(values, values[1:]))
        assert values[-1] > (0.009 if schedule == "optimal" else 0.001)
    np.testing.assert_allclose(values, onnxcustom_rates(0.01, 1e-4, 0.25, schedule, 1000),
                               rtol=1e-12)
    assert values == [rate.value(t) for t in range(1000)]


def test_loop_of_every_learning_rate():
    nesterov = LearningRateSGDNesterov(eta0=0.1, power_t=0.5)
    assert list(nesterov.loop(4)) == [0.1, 0.1 / 2 ** 0.5, 0.1 / 3 ** 0.5, 0.05]
    assert list(BaseLearningRate.select("SGD").loop(0)) == []
    loop = LearningRateSGD().loop(2)
    assert iter(loop) is loop  # a generator, as onnxcustom's
    with pytest.raises(UnsupportedOptionError, match="n=-1"):
        list(LearningRateSGD().loop(-1))


def test_constant_rate_and_optimizers():
    rate = LearningRateSGD(eta0=0.05, learning_rate="constant")
    assert [rate.value(t) for t in range(3)] == [0.05] * 3
    assert rate.to_optimizer() == SGD(learning_rate=0.05)
    nesterov = LearningRateSGDNesterov(momentum=0.5)
    assert nesterov.to_optimizer() == Momentum(learning_rate=0.01, momentum=0.5, nesterov=True)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_momentum_update_graph_matches_sklearn_sgd_optimizer(nesterov, dtype):
    """lossgraph's Momentum graph with velocity_scale between epochs gives scikit-learn's
    SGDOptimizer weights with an invscaling rate."""
    rate = LearningRateSGDNesterov(eta0=0.1, power_t=0.5, momentum=0.8, nesterov=nesterov)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3,))
    reference = SGDOptimizer([w0.copy()], learning_rate_init=0.1, lr_schedule="invscaling",
                             momentum=0.8, nesterov=nesterov, power_t=0.5)
    params = [w0.copy()]
    graph = rate.build_onnx_function({"w": w0.astype(dtype)})
    assert graph.SerializeToString() == update_graph(
        rate.to_optimizer(), {"w": w0.astype(dtype)}).SerializeToString()
    w, velocity = w0.astype(dtype), np.zeros(3, dtype)
    step = 1
    for epoch in range(3):
        velocity = (velocity * rate.velocity_scale(epoch)).astype(dtype)
        for _ in range(2):
            g = rng.normal(size=(3,))
            reference.update_params(params, [g])
            w, velocity = run_onnx(graph, {"learning_rate": np.array(rate.value(epoch), dtype),
                                      "step": np.array(step), "w": w,
                                      "w_grad": g.astype(dtype), "w_velocity": velocity})
            step += 1
        reference.iteration_ends(epoch + 1)
        tolerance = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(w, params[0], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("alias,kind", [("SGD", LearningRateSGD),
                                        ("LearningRateSGD", LearningRateSGD),
                                        ("SGDNesterov", LearningRateSGDNesterov),
                                        ("Nesterov", LearningRateSGDNesterov),
                                        ("LearningRateSGDNesterov", LearningRateSGDNesterov)])
def test_learning_rate_aliases(alias, kind):
    assert type(BaseLearningRate.select(alias)) is kind
    assert LearningRateSGD.select(alias) == kind()


def test_float_learning_rate_is_invscaling_as_in_onnxcustom():
    """onnxcustom's select(1e-3) is LearningRateSGD(eta0=1e-3): invscaling (a decision,
    docs/reference/errors.md); learning_rate="constant" keeps the rate."""
    assert BaseLearningRate.select(0.2) == LearningRateSGD(eta0=0.2)
    assert BaseLearningRate.select(0.2).learning_rate == "invscaling"
    assert "learning_rate='invscaling'" in repr(BaseLearningRate.select(1e-3))
    assert BaseLearningRate.select(1).eta0 == 1.0
    assert BaseLearningRate.select(np.float32(0.5)) == LearningRateSGD(eta0=0.5)


@pytest.mark.parametrize("bad", ["Nesterof", "adam", True, None])
def test_bad_learning_rate_names_raise_with_suggestion(bad):
    with pytest.raises(UnsupportedOptionError, match="Unknown learning rate"):
        BaseLearningRate.select(bad)
    with pytest.raises(UnsupportedOptionError, match="Did you mean 'Nesterov'"):
        BaseLearningRate.select("Nesterof")


@pytest.mark.parametrize("options", [{"learning_rate": "optimel"}, {"eta0": -1.0},
                                     {"learning_rate": "optimal", "alpha": 0.0}])
def test_bad_learning_rate_options(options):
    with pytest.raises(UnsupportedOptionError):
        LearningRateSGD(**options)
    with pytest.raises(UnsupportedOptionError):
        LearningRateSGDNesterov(momentum=1.5)
    with pytest.raises(UnsupportedOptionError):
        LearningRateSGD().value(-1)
