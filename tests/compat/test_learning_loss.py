"""lossgraph.compat's learning losses (lossgraph/compat/learning_loss.py): the loss graph's value
and gradient against numpy, the weighted mean, the aliases and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from support.estimators import run_onnx

from lossgraph.compat import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    ElasticLearningLoss,
    NegLogLearningLoss,
    SquareLearningLoss,
)
from lossgraph.errors import UnsupportedOptionError


def _expected(loss, p, y, w):
    d = p - y
    if isinstance(loss, SquareLearningLoss):
        value, grad = 0.5 * d ** 2, d
    elif isinstance(loss, AbsoluteLearningLoss):
        value, grad = np.abs(d), np.sign(d)
    elif isinstance(loss, ElasticLearningLoss):
        value = loss.l1_weight * np.abs(d) + loss.l2_weight * d ** 2
        grad = loss.l1_weight * np.sign(d) + 2 * loss.l2_weight * d
    else:
        s, label = p, y
        value = np.logaddexp(0, s) - label * s
        grad = 1 / (1 + np.exp(-s)) - label
    return (value[:, 0] * w).sum(), grad * w[:, None]


LOSSES = [SquareLearningLoss(), AbsoluteLearningLoss(), ElasticLearningLoss(0.1, 0.9),
          NegLogLearningLoss()]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: type(loss).__name__)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_graph_value_and_gradient_match_numpy(loss, dtype, weighted):
    rng = np.random.default_rng(1)
    p = rng.normal(size=(7, 1)).astype(dtype)
    classes = isinstance(loss, NegLogLearningLoss)
    y = rng.integers(0, 2, size=7) if classes else rng.normal(size=(7, 1)).astype(dtype)
    w = rng.uniform(0.5, 2, size=7).astype(dtype) if weighted else np.ones(7, dtype)
    graph = loss.build_onnx_function(weight_name="weight" if weighted else None, dtype=dtype)
    feeds = {"prediction": p, "label": y, **({"weight": w} if weighted else {})}
    value, grad = run_onnx(graph, feeds)
    expected_value, expected_grad = _expected(loss, p.astype(np.float64),
                                              y[:, None] if classes else y, w.astype(np.float64))
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    assert value.dtype == dtype and grad.dtype == dtype
    np.testing.assert_allclose(value, expected_value, rtol=tolerance)
    np.testing.assert_allclose(grad, expected_grad, rtol=tolerance, atol=tolerance)


def test_mean_reduction_divides_by_the_weights():
    graph = SquareLearningLoss().build_onnx_function(weight_name="weight", reduction="mean")
    p = np.array([[1.0], [3.0]], np.float32)
    y = np.zeros((2, 1), np.float32)
    w = np.array([1.0, 3.0], np.float32)
    value, grad = run_onnx(graph, {"prediction": p, "label": y, "weight": w})
    assert value == pytest.approx((0.5 * 1 + 3 * 0.5 * 9) / 4)
    np.testing.assert_allclose(grad[:, 0], [1 / 4, 9 / 4])


@pytest.mark.parametrize("alias,kind", [
    ("square_error", SquareLearningLoss), ("square", SquareLearningLoss),
    ("absolute", AbsoluteLearningLoss), ("elastic", ElasticLearningLoss),
    ("log", NegLogLearningLoss), ("neglog", NegLogLearningLoss),
    ("absolute_error", AbsoluteLearningLoss), ("elastic_error", ElasticLearningLoss),
    ("logloss", NegLogLearningLoss),
    ("SquareLearningLoss", SquareLearningLoss), ("AbsoluteLearningLoss", AbsoluteLearningLoss),
    ("ElasticLearningLoss", ElasticLearningLoss), ("NegLogLearningLoss", NegLogLearningLoss)])
def test_loss_aliases(alias, kind):
    assert type(BaseLearningLoss.select(alias)) is kind
    assert BaseLearningLoss.select(kind()) == kind()


def test_bad_loss_names_and_options_raise():
    with pytest.raises(UnsupportedOptionError, match="Did you mean 'square'"):
        BaseLearningLoss.select("squar")
    with pytest.raises(UnsupportedOptionError):
        BaseLearningLoss.select(None)
    with pytest.raises(UnsupportedOptionError):
        ElasticLearningLoss(l1_weight=-1)
    with pytest.raises(UnsupportedOptionError, match="sigmoid"):
        NegLogLearningLoss(probability_function="softmax")
    with pytest.raises(UnsupportedOptionError):
        SquareLearningLoss().build_onnx_function(device=0)
