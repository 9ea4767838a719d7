"""Train the scikit-learn golden models from scratch with lossgraph; compare with scikit-learn.

Each golden ONNX file (``golden_models/``) is compiled into a training program, its
weights are re-initialized (zeros for the linear models, small seeded random values
for the MLPs) so that everything it knows comes from lossgraph's training, and it is
trained on the recipe's 200 training rows. The held-out metric on the 50 test rows
is printed next to that of scikit-learn's own fit of the same estimator:

- regressors: R^2 (higher is better) and mean squared error;
- classifiers: accuracy and log loss.

The linear models are skl2onnx ``LinearRegressor``/``LinearClassifier`` nodes; the
exported model is their lowered standard-op form (``lower_ml_ops``).

"seconds" covers compiling the training graphs, creating the onnxruntime sessions
and training.

Run from the repository root: python docs/examples/train_golden_models.py
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.metrics import accuracy_score, log_loss, mean_squared_error, r2_score

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT, ROOT / "golden_models"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


@dataclass(frozen=True)
class Setup:
    """How one golden model is trained with lossgraph."""

    name: str
    loss: str
    optimizer: str  # "adam" or "momentum"
    learning_rate: float
    epochs: int
    batch_size: int
    init: str  # "zeros" or "random"


SETUPS = [
    Setup("skl_linear_regression", "squared_error", "adam", 0.1, 30, 20, "zeros"),
    Setup("skl_sgd_regressor", "squared_error", "momentum", 0.02, 30, 20, "zeros"),
    # full batches, like MLPRegressor's own Adam (batch_size=min(200, n), 300 iterations)
    Setup("skl_mlp_regressor", "squared_error", "adam", 0.01, 300, 200, "random"),
    Setup("skl_logistic_binary", "binary_log_loss", "adam", 0.1, 30, 20, "zeros"),
    Setup("skl_logistic_multiclass", "multiclass_log_loss", "adam", 0.1, 30, 20, "zeros"),
    Setup("skl_mlp_classifier", "multiclass_log_loss", "adam", 0.01, 30, 20, "random"),
]


def optimizer(setup: Setup):
    import lossgraph

    if setup.optimizer == "adam":
        return lossgraph.optim.Adam(setup.learning_rate)
    return lossgraph.optim.Momentum(setup.learning_rate, momentum=0.9)


def initial_weights(program, init: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Zeros, or He-scaled normal matrices and zero biases drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name in program.weights:
        value = program.state[name]
        if init == "random" and value.ndim == 2 and min(value.shape) > 1:
            scale = np.sqrt(2.0 / value.shape[0])
            weights[name] = (scale * rng.normal(size=value.shape)).astype(value.dtype)
        else:
            weights[name] = np.zeros_like(value)
    return weights


def metrics(kind: str, y: np.ndarray, prediction: np.ndarray) -> dict[str, float]:
    """R^2 and MSE for regressors; accuracy and log loss for classifiers (probability rows)."""
    if kind == "regressor":
        prediction = prediction.reshape(-1)
        return {"r2": float(r2_score(y, prediction)),
                "mse": float(mean_squared_error(y, prediction))}
    if prediction.shape[1] == 2:  # the binary loss reads column 1 only
        prediction = np.stack([1 - prediction[:, 1], prediction[:, 1]], axis=1)
    return {"accuracy": float(accuracy_score(y, prediction.argmax(axis=1))),
            "log_loss": float(log_loss(y, prediction, labels=range(prediction.shape[1])))}


def train(setup: Setup, fuse: str = "epoch", epochs: int | None = None) -> dict[str, Any]:
    """Train one golden model with lossgraph; the trainer, its metrics and timing."""
    import recipes

    import lossgraph

    recipe = recipes.RECIPES[setup.name]
    X_train, y_train, X_test, y_test = recipes.dataset(setup.name)
    start = time.perf_counter()
    program = lossgraph.compile_program(recipe.path, loss=setup.loss, optimizer=optimizer(setup),
                                fuse=fuse)
    trainer = lossgraph.Trainer(program)
    trainer.set_state(initial_weights(program, setup.init))
    trainer.fit(X_train, y_train, epochs=setup.epochs if epochs is None else epochs,
                batch_size=setup.batch_size, random_state=0, warm_start=True, progress=False)
    seconds = time.perf_counter() - start
    return {"trainer": trainer, "seconds": seconds,
            "metrics": metrics(recipe.kind, y_test, trainer.predict(X_test))}


def sklearn_metrics(name: str) -> dict[str, float]:
    import recipes

    _, _, X_test, y_test = recipes.dataset(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = recipes.fit_estimator(name)
    if recipes.RECIPES[name].kind == "regressor":
        return metrics("regressor", y_test, est.predict(X_test))
    return metrics("classifier", y_test, est.predict_proba(X_test))


def main() -> None:
    import onnxruntime  # noqa: F401 - imported here so that its start-up is not timed

    def text(values: dict[str, float]) -> str:
        return "  ".join(f"{key}={value:.4f}" for key, value in values.items())

    print(f"{'model':<24} {'scikit-learn (test)':<34} {'lossgraph (test)':<34} "
          f"{'epochs':>6} {'seconds':>8}")
    for setup in SETUPS:
        result = train(setup)
        print(f"{setup.name:<24} {text(sklearn_metrics(setup.name)):<34} "
              f"{text(result['metrics']):<34} {setup.epochs:>6} {result['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
