"""The estimators of lossgraph.compat as their tests build them: data shaped as in
scikit-learn's examples, the small linear model (:mod:`support.linear`) under scikit-learn's
names (input ``X``, output ``score``), one estimator of each kind, and a closeness check of
trained states; a model run by onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from sklearn.datasets import make_classification, make_regression

import lossgraph
from lossgraph import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

from .linear import COEF, INTERCEPT, linear_model

FB = OrtGradientForwardBackwardOptimizer

#: The linear model's weights: not zeros, not random.
START = np.array(COEF), INTERCEPT


# -- data ----------------------------------------------------------------------------------


def regression(rows: int = 200, features: int = 10, seed: int = 0):
    """make_regression as the documents use it, float32, the target scaled to unit spread."""
    X, y = make_regression(rows, n_features=features, bias=2.0, noise=5.0, random_state=seed)
    return X.astype(np.float32), (y / np.std(y)).astype(np.float32)


def classification(rows: int = 200, seed: int = 0):
    X, y = make_classification(rows, n_features=10, n_informative=4, n_redundant=0, flip_y=0.1,
                               random_state=seed)
    return X.astype(np.float32), y.astype(np.int64)


def small_linear():
    """120 rows of four features, and the linear model at :data:`START`."""
    X, y = regression(rows=120, features=4, seed=1)
    return X, y, linear_onnx(*START)


# -- models --------------------------------------------------------------------------------


def linear_onnx(coef, intercept=None) -> onnx.ModelProto:
    """``score = X @ coef (+ intercept)``: a raw score of shape (N, 1)."""
    coef = np.asarray(coef, np.float32).ravel()
    return linear_model(coef, None if intercept is None else np.float32(intercept), x="X",
                        y="score")


def whole_graph_model():
    """The linear model carrying its loss, mean (p - y)^2, with a sample-weight input."""
    return lossgraph.add_loss_output(linear_onnx(*START), weight_name="weight")


ESTIMATORS = {
    "forward_backward": lambda **kw: FB(linear_onnx(*START), **kw),
    "whole_graph": lambda **kw: OrtGradientOptimizer(whole_graph_model(), None, **kw),
}


def run_onnx(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    """Every output of ``model`` run by onnxruntime on the CPU."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_states_close(ours, theirs, rtol=1e-4, atol=1e-6):
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        scale = float(np.abs(theirs[name]).max()) or 1.0
        np.testing.assert_allclose(ours[name], theirs[name], rtol=rtol, atol=atol * scale,
                                   err_msg=name)
