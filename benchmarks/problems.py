"""The two training problems every implementation solves, and what an implementation is.

Data: ``X`` (N, 100) standard normal, ``y = X @ coef + noise`` (N, 1), float32, fixed
seed. Models: an MLP 100-50-1 (relu), ``variable = relu(X W1 + b1) W2 + b2``, and
linear regression, ``variable = X w + b``. Training: minibatch SGD with Nesterov
momentum on the mean squared error, ``v = m v + g;  w -= lr (g + m v)``.

An implementation is a pair ``(epoch, weights)``: ``epoch()`` trains one epoch from the
current state, ``weights()`` returns the current weights in the Problem's order, or None
when they cannot be compared with numpy's (another update, or no training).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

N_FEATURES, HIDDEN = 100, 50
LEARNING_RATE, MOMENTUM, SEED = 0.01, 0.9, 0
MLP_NAMES = ["coefficient", "intercepts", "coefficient1", "intercepts1"]  # skl2onnx's names

Epoch = Callable[[], None]
Weights = list[np.ndarray]  # MLP: W1 (100, 50), b1 (50,), W2 (50, 1), b2 (1,); linear: w, b
Implementation = tuple[Epoch, Callable[[], Weights | None]]


def not_compared() -> None:
    """The weights of an implementation that cannot be compared with numpy's: none."""
    return None


class Unavailable(Exception):
    """This implementation cannot run here; the message says why."""


@dataclass
class Problem:
    """One model to train: data, the shared initial weights and its ONNX form."""

    name: str  # "mlp" or "linear"
    X: np.ndarray  # (N, 100) float32
    y: np.ndarray  # (N, 1) float32
    weights: Weights  # initial weights, shared by every implementation that can take them
    onnx_model: onnx.ModelProto  # the inference model lossgraph compiles
    weight_names: list[str]  # the ONNX initializers holding `weights`, in the same order
    notes: list[str] = field(default_factory=list)


def make_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of features and targets, the same for every seed-0 run."""
    rng = np.random.default_rng(SEED)
    X = rng.standard_normal((n, N_FEATURES), dtype=np.float32)
    coef = rng.standard_normal((N_FEATURES, 1), dtype=np.float32) / np.float32(10)
    noise = rng.standard_normal((n, 1), dtype=np.float32) / np.float32(10)
    return X, np.ascontiguousarray(X @ coef + noise, dtype=np.float32)


def sklearn_mlp(batch: int, max_iter: int = 1):
    """scikit-learn's MLPRegressor set up for this problem's Nesterov SGD."""
    from sklearn.neural_network import MLPRegressor

    return MLPRegressor(hidden_layer_sizes=(HIDDEN,), activation="relu", solver="sgd",
                        nesterovs_momentum=True, momentum=MOMENTUM,
                        learning_rate_init=LEARNING_RATE, learning_rate="constant",
                        batch_size=batch, max_iter=max_iter, shuffle=False, alpha=0.0,
                        random_state=SEED)


def mlp_problem(X: np.ndarray, y: np.ndarray) -> Problem:
    """Initial weights: a scikit-learn MLPRegressor after one epoch (batch 1000)."""
    try:
        from skl2onnx import to_onnx
        from sklearn.exceptions import ConvergenceWarning
    except ImportError:
        rng = np.random.default_rng(SEED + 1)
        bound1, bound2 = np.sqrt(6 / (N_FEATURES + HIDDEN)), np.sqrt(6 / (HIDDEN + 1))
        weights = [rng.uniform(-bound1, bound1, (N_FEATURES, HIDDEN)),
                   rng.uniform(-bound1, bound1, (HIDDEN,)),
                   rng.uniform(-bound2, bound2, (HIDDEN, 1)), rng.uniform(-bound2, bound2, (1,))]
        weights = [w.astype(np.float32) for w in weights]
        return Problem("mlp", X, y, weights, _mlp_by_hand(weights), MLP_NAMES,
                       ["scikit-learn/skl2onnx missing: Glorot-uniform weights, ONNX by hand"])
    estimator = sklearn_mlp(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator.fit(X, y.ravel())
    weights = [np.array(a, dtype=np.float32) for pair in
               zip(estimator.coefs_, estimator.intercepts_) for a in pair]
    model = to_onnx(estimator, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    if {i.name for i in model.graph.initializer} >= set(MLP_NAMES):
        return Problem("mlp", X, y, weights, model, MLP_NAMES)
    return Problem("mlp", X, y, weights, _mlp_by_hand(weights), MLP_NAMES,
                   ["skl2onnx named the weights differently: ONNX written by hand"])


def _mlp_by_hand(weights: Weights) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["X", "coefficient"], ["h0"]),
             helper.make_node("Add", ["h0", "intercepts"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "coefficient1"], ["p0"]),
             helper.make_node("Add", ["p0", "intercepts1"], ["variable"])]
    return _inference_model(nodes, MLP_NAMES, weights)


def linear_problem(X: np.ndarray, y: np.ndarray) -> Problem:
    """Initial weights: zeros (SGDRegressor's start). ONNX: MatMul + Add."""
    weights = [np.zeros((N_FEATURES, 1), np.float32), np.zeros((1,), np.float32)]
    nodes = [helper.make_node("MatMul", ["X", "coef"], ["product"]),
             helper.make_node("Add", ["product", "intercept"], ["variable"])]
    names = ["coef", "intercept"]
    return Problem("linear", X, y, weights, _inference_model(nodes, names, weights), names)


def _inference_model(nodes: list[onnx.NodeProto], names: list[str],
                     weights: Weights) -> onnx.ModelProto:
    """``X`` (N, 100) -> ``variable`` (N, 1) through ``nodes``, the weights as initializers."""
    graph = helper.make_graph(
        nodes, "benchmark",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", N_FEATURES])],
        [helper.make_tensor_value_info("variable", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w, n) for n, w in zip(names, weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


PROBLEMS: dict[str, Callable[[np.ndarray, np.ndarray], Problem]] = {
    "mlp": mlp_problem, "linear": linear_problem}
