"""End-to-end demo: train a scikit-learn MLP as ONNX with lossgraph, compare with scikit-learn.

1. scikit-learn builds an MLPRegressor (one hidden layer of 32) and skl2onnx converts it
   to ONNX right after its first step, so both trainings start from the same weights;
2. lossgraph checks its loss and gradients against scikit-learn's own on that model;
3. lossgraph compiles a training program (squared error, an L2 penalty, SGD with
   Nesterov momentum) and trains it in onnxruntime, while scikit-learn trains its copy
   with the same settings;
4. both are scored on held-out data, and the trained ONNX model is exported.

Run: python docs/examples/demo.py
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime
from skl2onnx import to_onnx
from sklearn.metrics import mean_squared_error, r2_score
from sklearn.neural_network import MLPRegressor

import lossgraph
from lossgraph.optim import Momentum

EPOCHS, BATCH, LEARNING_RATE, ALPHA = 40, 50, 0.01, 1e-3


def make_data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(5000, 8)).astype(np.float32)
    y = np.sin(2 * X[:, 0]) + X[:, 1] * X[:, 2] + 0.5 * X[:, 3] ** 2 - X[:, 4]
    y = (y + 0.1 * rng.normal(size=len(X))).astype(np.float32)
    return X[:4000], y[:4000], X[4000:], y[4000:]


def sklearn_mlp():
    return MLPRegressor(hidden_layer_sizes=(32,), solver="sgd", learning_rate_init=LEARNING_RATE,
                        momentum=0.9, nesterovs_momentum=True, batch_size=BATCH, alpha=ALPHA,
                        shuffle=True, random_state=0, max_iter=EPOCHS, tol=0,
                        n_iter_no_change=10**9)


def check_gradients(onx, X, y) -> None:
    """lossgraph's loss and gradients on the converted model equal scikit-learn's."""
    estimator = sklearn_mlp().partial_fit(X, y)
    onx = to_onnx(estimator, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    n = len(X)
    # scikit-learn backpropagates MSE/2 + alpha/(2n) |W|^2: half of this loss.
    with_loss = lossgraph.add_loss_output(
        onx, "squared_error", penalty={"coefficient": ALPHA / n, "coefficient1": ALPHA / n})
    weights = lossgraph.trainable_initializers(with_loss)
    graph = lossgraph.gradient(with_loss)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(graph.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    ours = session.run([f"{w}_grad" for w in weights], {"X": X, "label": y.reshape(-1, 1)})
    units = [X.shape[1], 32, 1]
    coef_grads = [np.empty((a, b)) for a, b in zip(units[:-1], units[1:])]
    intercept_grads = [np.empty(b) for b in units[1:]]
    _, coef_grads, intercept_grads = estimator._backprop(
        X.astype(np.float64), y.reshape(-1, 1).astype(np.float64), None,
        [X.astype(np.float64), None, None], [None, None], coef_grads, intercept_grads)
    theirs = [coef_grads[0], intercept_grads[0], coef_grads[1], intercept_grads[1]]
    error = max(float(np.abs(o / 2 - t.reshape(o.shape)).max()) for o, t in zip(ours, theirs))
    print(f"gradient graph: {len(graph.graph.node)} standard ONNX nodes; "
          f"max |lossgraph - scikit-learn backprop| = {error:.1e}")
    assert error < 1e-4


def main() -> None:
    X, y, X_test, y_test = make_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = sklearn_mlp().partial_fit(X, y)  # one step: the shared starting point
    onx = to_onnx(start, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    print("inference model:", sorted({n.op_type for n in onx.graph.node}),
          "weights:", lossgraph.trainable_initializers(onx))
    check_gradients(onx, X, y)

    # scikit-learn: the same architecture and settings, from its own first step onwards
    began = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = sklearn_mlp().fit(X, y)
    sklearn_seconds = time.perf_counter() - began
    sklearn_r2 = r2_score(y_test, reference.predict(X_test))

    # lossgraph minimizes MSE + l2 |W|^2 per batch: twice scikit-learn's MSE/2 +
    # alpha/(2 batch) |W|^2 when l2 = alpha/batch, so half the learning rate takes the
    # same steps.
    penalty = {"coefficient": ALPHA / BATCH, "coefficient1": ALPHA / BATCH}
    program = lossgraph.compile_program(onx, loss="squared_error", penalty=penalty, fuse="epoch",
                                optimizer=Momentum(LEARNING_RATE / 2, nesterov=True))
    trainer = lossgraph.Trainer(program)
    began = time.perf_counter()
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, random_state=0,
                validation_data=(X_test, y_test), progress=False)
    lossgraph_seconds = time.perf_counter() - began
    prediction = trainer.predict(X_test).ravel()
    lossgraph_r2 = r2_score(y_test, prediction)

    print(f"\n{'':12s} {'held-out R2':>12s} {'held-out MSE':>13s} {'seconds':>8s}")
    print(f"{'scikit-learn':12s} {sklearn_r2:12.4f} "
          f"{mean_squared_error(y_test, reference.predict(X_test)):13.4f} {sklearn_seconds:8.2f}")
    print(f"{'lossgraph':12s} {lossgraph_r2:12.4f} {mean_squared_error(y_test, prediction):13.4f}"
          f" {lossgraph_seconds:8.2f}")
    print(f"lossgraph train loss by epoch: {trainer.train_losses_[0]:.3f} -> "
          f"{trainer.train_losses_[-1]:.3f}; validation {trainer.validation_losses_[-1]:.3f}")

    with tempfile.TemporaryDirectory() as folder:
        exported = trainer.to_inference_model()
        path = Path(folder) / "trained.onnx"
        path.write_bytes(exported.SerializeToString())
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(str(path), options,
                                               providers=["CPUExecutionProvider"])
        deployed = session.run(None, {"X": X_test})[0].ravel()
        print(f"exported trained model: {path.name}, {path.stat().st_size} bytes, "
              f"inputs {[i.name for i in session.get_inputs()]}")
        assert np.allclose(deployed, prediction, rtol=1e-5, atol=1e-5)
    # the same network and settings, shuffled differently: near, not equal
    assert abs(lossgraph_r2 - sklearn_r2) < 0.01, (lossgraph_r2, sklearn_r2)
    print("OK: lossgraph trains the ONNX model as well as scikit-learn trains its own")


if __name__ == "__main__":
    main()
