"""End-to-end demo: a scikit-learn model becomes an ONNX graph with a loss and its gradients.

1. fit an MLPRegressor with scikit-learn and convert it with skl2onnx;
2. add a squared-error loss with an L2 penalty (add_loss_output);
3. evaluate the loss in onnxruntime and compare it with scikit-learn's metric;
4. differentiate it (lossgraph's own autodiff, standard ONNX ops only) and compare the
   gradients with scikit-learn's own backpropagation.

Run: python docs/examples/demo.py
"""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime
from skl2onnx import to_onnx
from sklearn.metrics import mean_squared_error
from sklearn.neural_network import MLPRegressor

import lossgraph


def session(model):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"])


def main() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 8)).astype(np.float32)
    y = (np.sin(X[:, 0]) + X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=500)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlp = MLPRegressor(hidden_layer_sizes=(32,), max_iter=200, random_state=0).fit(X, y)
    onx = to_onnx(mlp, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    print("inference model ops:", sorted({n.op_type for n in onx.graph.node}))

    weights = lossgraph.trainable_initializers(onx)
    print("trainable weights:", weights)
    with_loss = lossgraph.add_loss_output(onx, "squared_error",
                                          penalty={"coefficient": 1e-3, "coefficient1": 1e-3})
    loss, prediction = session(with_loss).run(["loss", "variable"],
                                               {"X": X, "label": y.reshape(-1, 1)})
    penalty = 1e-3 * sum(float((c**2).sum()) for c in mlp.coefs_)
    expected = mean_squared_error(y, mlp.predict(X)) + penalty
    print(f"loss in onnxruntime: {float(loss):.6f}   scikit-learn: {expected:.6f}")
    assert np.isclose(loss, expected, rtol=1e-4)

    grads = lossgraph.gradient(with_loss)
    domains = {n.domain or "ai.onnx" for n in grads.graph.node}
    print(f"gradient graph: {len(grads.graph.node)} nodes, domains {sorted(domains)}")
    outputs = session(grads).run([f"{w}_grad" for w in weights],
                                 {"X": X, "label": y.reshape(-1, 1)})
    # scikit-learn backpropagates MSE/2 + alpha/(2n) |W|^2: half our loss when alpha = 1e-3 n.
    mlp.alpha = 1e-3 * len(X)
    units = [X.shape[1], *mlp.hidden_layer_sizes, 1]
    coef_grads = [np.empty((a, b)) for a, b in zip(units[:-1], units[1:])]
    intercept_grads = [np.empty(b) for b in units[1:]]
    _, coef_grads, intercept_grads = mlp._backprop(
        X.astype(np.float64), y.reshape(-1, 1).astype(np.float64), None,
        [X.astype(np.float64), None, None], [None, None], coef_grads, intercept_grads)
    reference = [coef_grads[0], intercept_grads[0], coef_grads[1], intercept_grads[1]]
    for name, ours, theirs in zip(weights, outputs, reference):
        error = np.abs(ours / 2 - theirs.reshape(ours.shape)).max()
        print(f"  d loss / d {name:13s} shape {str(ours.shape):9s} max |lossgraph - sklearn| = "
              f"{error:.2e}")
        assert np.allclose(ours / 2, theirs.reshape(ours.shape), rtol=1e-3, atol=1e-5)
    print("OK: loss and gradients match scikit-learn")


if __name__ == "__main__":
    main()
