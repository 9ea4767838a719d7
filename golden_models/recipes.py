"""Deterministic recipes for the golden models: data, fitted estimators, registry.

Every golden ``.onnx`` file in this directory is rebuilt from a recipe here by
``generate.py``. A recipe names a dataset (generated from a fixed seed, never
stored) and an estimator fitted on it with fixed seeds, so a test can refit the
very estimator a golden file came from and compare numbers with it (for
example ``MLPRegressor._backprop`` against a gradient graph).

This module depends only on numpy and scikit-learn; torch is imported lazily,
inside the functions that need it, so the module imports without torch.

Typical use from a test::

    sys.path.insert(0, str(repo_root / "golden_models"))
    import recipes
    X_train, y_train, X_test, y_test = recipes.dataset("skl_mlp_regressor")
    est = recipes.fit_estimator("skl_mlp_regressor")
    expected = recipes.expected_outputs("skl_mlp_regressor", X_test)
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN_DIR = Path(__file__).resolve().parent
"""The directory that holds the golden ``.onnx`` files."""

N_TRAIN = 200
N_TEST = 50


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DatasetSpec:
    """A synthetic dataset: its seed, feature count, target kind."""

    name: str
    seed: int
    n_features: int
    target: str  # "linear", "nonlinear", "binary", "multiclass", "digits"
    description: str


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("regression", 1, 6, "linear", "y = X @ w + 0.5 + noise(0.1)"),
        DatasetSpec(
            "regression_nonlinear",
            2,
            5,
            "nonlinear",
            "y = sin(2 x0) + x1 * x2 + 0.5 x3^2 - x4 + noise(0.05)",
        ),
        DatasetSpec("binary", 3, 4, "binary", "y = [X @ w + noise(0.5) > 0]"),
        DatasetSpec("multiclass", 4, 7, "multiclass", "y = argmax(X @ W + noise(0.5)), 3 classes"),
        DatasetSpec(
            "digits3",
            5,
            64,
            "digits",
            "scikit-learn digits 0, 1, 2 as (N, 1, 8, 8) images scaled to [0, 1]",
        ),
    )
}


def _make_dataset(spec: DatasetSpec) -> tuple[np.ndarray, np.ndarray]:
    """All rows of a dataset (train then test), features float32."""
    rng = np.random.default_rng(spec.seed)
    n = N_TRAIN + N_TEST
    if spec.target == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        keep = digits.target < 3
        images = (digits.images[keep] / 16.0).astype(np.float32)[:, None, :, :]
        labels = digits.target[keep].astype(np.int64)
        order = rng.permutation(len(labels))[:n]
        return images[order], labels[order]
    X = rng.normal(size=(n, spec.n_features)).astype(np.float32)
    Xd = X.astype(np.float64)
    if spec.target == "linear":
        w = rng.normal(size=spec.n_features)
        y = Xd @ w + 0.5 + 0.1 * rng.normal(size=n)
        return X, y.astype(np.float32)
    if spec.target == "nonlinear":
        y = (
            np.sin(2 * Xd[:, 0])
            + Xd[:, 1] * Xd[:, 2]
            + 0.5 * Xd[:, 3] ** 2
            - Xd[:, 4]
            + 0.05 * rng.normal(size=n)
        )
        return X, y.astype(np.float32)
    if spec.target == "binary":
        w = rng.normal(size=spec.n_features)
        y = (Xd @ w + 0.5 * rng.normal(size=n) > 0).astype(np.int64)
        return X, y
    if spec.target == "multiclass":
        W = rng.normal(size=(spec.n_features, 3))
        y = np.argmax(Xd @ W + 0.5 * rng.normal(size=(n, 3)), axis=1).astype(np.int64)
        return X, y
    raise ValueError(f"unknown target kind {spec.target!r} in dataset {spec.name!r}")


# ------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Recipe:
    """How one golden model is made, and what it contains."""

    name: str
    kind: str  # "regressor", "classifier", "torch", "hand"
    source: str  # library and estimator or architecture
    dataset: str  # key of DATASETS
    dtype: str  # input (and weight) dtype: "float32" or "float64"
    input_name: str
    input_shape: tuple[str | int, ...]  # "?" = unnamed dynamic dim
    outputs: tuple[str, ...]
    ops: tuple[str, ...]  # sorted op types of the graph's nodes
    opset: int  # ai.onnx opset
    loss: str  # the loss lossgraph trains it with, and on which output
    trainable: tuple[str, ...]  # trainable initializers (names in the file)
    estimator_params: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    @property
    def file(self) -> str:
        """The golden file's name in this directory."""
        return f"{self.name}.onnx"

    @property
    def path(self) -> Path:
        """The golden file's path."""
        return GOLDEN_DIR / self.file


_SGD_REG = {"random_state": 0, "max_iter": 1000, "tol": 1e-4}
_MLP = {
    "hidden_layer_sizes": (16,),
    "activation": "relu",
    "solver": "adam",
    "alpha": 1e-4,
    "learning_rate_init": 0.01,
    "max_iter": 300,
    "random_state": 0,
}
_MLP_INIT = ("coefficient", "intercepts", "coefficient1", "intercepts1")
_SKL_REG_OUT = ("variable",)
_SKL_CLS_OUT = ("label", "probabilities")
_LINEAR_NOTE = (
    "coefficients live in the ai.onnx.ml node's attributes; lossgraph's lower_ml "
    "pass turns them into initializers"
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="skl_linear_regression",
            kind="regressor",
            source="scikit-learn LinearRegression via skl2onnx",
            dataset="regression",
            dtype="float32",
            input_name="X",
            input_shape=("?", 6),
            outputs=_SKL_REG_OUT,
            ops=("LinearRegressor",),
            opset=18,
            loss="squared_error on variable",
            trainable=(),
            notes=_LINEAR_NOTE,
        ),
        Recipe(
            name="skl_linear_regression_double",
            kind="regressor",
            source="scikit-learn LinearRegression via skl2onnx, double input",
            dataset="regression",
            dtype="float64",
            input_name="X",
            input_shape=("?", 6),
            outputs=_SKL_REG_OUT,
            ops=("Add", "MatMul", "Reshape"),
            opset=18,
            loss="squared_error on variable",
            trainable=("coef", "intercept"),
            notes="skl2onnx writes MatMul + Add for double inputs",
        ),
        Recipe(
            name="skl_sgd_regressor",
            kind="regressor",
            source="scikit-learn SGDRegressor via skl2onnx",
            dataset="regression",
            dtype="float32",
            input_name="X",
            input_shape=("?", 6),
            outputs=_SKL_REG_OUT,
            ops=("LinearRegressor",),
            opset=18,
            loss="squared_error on variable",
            trainable=(),
            estimator_params=_SGD_REG,
            notes=_LINEAR_NOTE,
        ),
        Recipe(
            name="skl_logistic_binary",
            kind="classifier",
            source="scikit-learn LogisticRegression (2 classes) via skl2onnx",
            dataset="binary",
            dtype="float32",
            input_name="X",
            input_shape=("?", 4),
            outputs=_SKL_CLS_OUT,
            ops=("LinearClassifier",),
            opset=18,
            loss="log loss (negative log) on probabilities",
            trainable=(),
            estimator_params={"max_iter": 1000},
            notes=_LINEAR_NOTE + "; post_transform LOGISTIC",
        ),
        Recipe(
            name="skl_logistic_multiclass",
            kind="classifier",
            source="scikit-learn LogisticRegression (3 classes, multinomial) via skl2onnx",
            dataset="multiclass",
            dtype="float32",
            input_name="X",
            input_shape=("?", 7),
            outputs=_SKL_CLS_OUT,
            ops=("LinearClassifier", "Normalizer"),
            opset=18,
            loss="log loss (negative log) on probabilities",
            trainable=(),
            estimator_params={"max_iter": 1000},
            notes=_LINEAR_NOTE + "; post_transform SOFTMAX then an L1 Normalizer",
        ),
        Recipe(
            name="skl_sgd_classifier",
            kind="classifier",
            source='scikit-learn SGDClassifier(loss="log_loss", 3 classes, one-vs-rest) '
            "via skl2onnx",
            dataset="multiclass",
            dtype="float32",
            input_name="X",
            input_shape=("?", 7),
            outputs=_SKL_CLS_OUT,
            ops=(
                "Add",
                "ArgMax",
                "ArrayFeatureExtractor",
                "Cast",
                "Div",
                "Exp",
                "MatMul",
                "Mul",
                "Not",
                "Reciprocal",
                "ReduceSum",
                "Reshape",
            ),
            opset=18,
            loss="log loss (negative log) on probabilities",
            trainable=("coef", "intercept"),
            estimator_params={"loss": "log_loss", "random_state": 0, "max_iter": 1000, "tol": 1e-4},
            notes="probabilities are one-vs-rest sigmoids normalized to sum 1, "
            "written in standard ops",
        ),
        Recipe(
            name="skl_mlp_regressor",
            kind="regressor",
            source="scikit-learn MLPRegressor(hidden_layer_sizes=(16,), relu) via skl2onnx",
            dataset="regression_nonlinear",
            dtype="float32",
            input_name="X",
            input_shape=("?", 5),
            outputs=_SKL_REG_OUT,
            ops=("Add", "Cast", "MatMul", "Relu", "Reshape"),
            opset=18,
            loss="squared_error on variable",
            trainable=_MLP_INIT,
            estimator_params=_MLP,
        ),
        Recipe(
            name="skl_mlp_regressor_double",
            kind="regressor",
            source="scikit-learn MLPRegressor(hidden_layer_sizes=(16,), relu) via skl2onnx, "
            "double input",
            dataset="regression_nonlinear",
            dtype="float64",
            input_name="X",
            input_shape=("?", 5),
            outputs=_SKL_REG_OUT,
            ops=("Add", "Cast", "MatMul", "Relu", "Reshape"),
            opset=18,
            loss="squared_error on variable",
            trainable=_MLP_INIT,
            estimator_params=_MLP,
        ),
        Recipe(
            name="skl_mlp_classifier",
            kind="classifier",
            source="scikit-learn MLPClassifier(hidden_layer_sizes=(16,), relu, 3 classes) "
            "via skl2onnx",
            dataset="multiclass",
            dtype="float32",
            input_name="X",
            input_shape=("?", 7),
            outputs=_SKL_CLS_OUT,
            ops=(
                "Add",
                "ArgMax",
                "ArrayFeatureExtractor",
                "Cast",
                "Identity",
                "MatMul",
                "Relu",
                "Reshape",
                "Softmax",
            ),
            opset=18,
            loss="log loss (negative log) on probabilities (= cross-entropy of the softmax)",
            trainable=_MLP_INIT,
            estimator_params=_MLP,
        ),
        Recipe(
            name="torch_cnn",
            kind="torch",
            source="PyTorch Conv2d(1,4,3,pad 1)-BatchNorm2d-ReLU-MaxPool2d(2)-Flatten-"
            "Linear(64,3), torch.onnx.export (TorchScript exporter, eval mode)",
            dataset="digits3",
            dtype="float32",
            input_name="input",
            input_shape=("N", 1, 8, 8),
            outputs=("logits",),
            ops=("BatchNormalization", "Conv", "Flatten", "Gemm", "MaxPool", "Relu"),
            opset=18,
            loss="cross_entropy (softmax cross-entropy) on logits",
            trainable=("conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"),
            notes="bn.running_mean and bn.running_var are initializers but not trainable; "
            "weights are the seeded initialization, not trained",
        ),
        Recipe(
            name="hand_linear",
            kind="hand",
            source="hand-written ONNX text: MatMul + Add",
            dataset="regression",
            dtype="float32",
            input_name="X",
            input_shape=("N", 6),
            outputs=("Y",),
            ops=("Add", "MatMul"),
            opset=13,
            loss="squared_error on Y",
            trainable=("W", "B"),
        ),
        Recipe(
            name="hand_mlp_tanh_double",
            kind="hand",
            source="hand-written ONNX text: Gemm-Tanh-MatMul-Add, float64",
            dataset="regression_nonlinear",
            dtype="float64",
            input_name="X",
            input_shape=("N", 5),
            outputs=("Y",),
            ops=("Add", "Gemm", "MatMul", "Tanh"),
            opset=17,
            loss="squared_error on Y",
            trainable=("W1", "B1", "W2", "B2"),
        ),
        Recipe(
            name="hand_broadcast_reuse",
            kind="hand",
            source="hand-written ONNX text: broadcasting, one tensor used several times, "
            "shared weight",
            dataset="regression_nonlinear",
            dtype="float32",
            input_name="X",
            input_shape=("N", 5),
            outputs=("Y",),
            ops=("Add", "Constant", "Mul", "ReduceSum", "Sigmoid"),
            opset=18,
            loss="squared_error on Y",
            trainable=("scale", "shift", "gain"),
            notes="X feeds two nodes, z1 feeds two nodes, scale feeds two nodes; "
            "(N,5)*(5), (N,5)+(1,5), (N,1)*() broadcasts",
        ),
    )
}


def recipe(name: str) -> Recipe:
    """The recipe called ``name``, with a helpful error for unknown names."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"no golden model {name!r}; known: {sorted(RECIPES)}") from None


def dataset(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X_train, y_train, X_test, y_test)`` for a model or a dataset name.

    For a model name the features come in the model's input dtype (float64 for
    the double models) and regression targets in the same dtype; for a dataset
    name everything is as generated (float32 features). Class labels are int64.
    """
    if name in RECIPES:
        r = RECIPES[name]
        X_train, y_train, X_test, y_test = dataset(r.dataset)
        dtype = np.dtype(r.dtype)
        if y_train.dtype.kind == "f":
            y_train, y_test = y_train.astype(dtype), y_test.astype(dtype)
        return X_train.astype(dtype), y_train, X_test.astype(dtype), y_test
    try:
        spec = DATASETS[name]
    except KeyError:
        raise KeyError(f"no dataset or golden model {name!r}") from None
    X, y = _make_dataset(spec)
    return X[:N_TRAIN], y[:N_TRAIN], X[N_TRAIN:], y[N_TRAIN:]


# ----------------------------------------------------------------------- estimators

_SKLEARN_CLASSES: dict[str, tuple[str, str]] = {
    "skl_linear_regression": ("sklearn.linear_model", "LinearRegression"),
    "skl_linear_regression_double": ("sklearn.linear_model", "LinearRegression"),
    "skl_sgd_regressor": ("sklearn.linear_model", "SGDRegressor"),
    "skl_logistic_binary": ("sklearn.linear_model", "LogisticRegression"),
    "skl_logistic_multiclass": ("sklearn.linear_model", "LogisticRegression"),
    "skl_sgd_classifier": ("sklearn.linear_model", "SGDClassifier"),
    "skl_mlp_regressor": ("sklearn.neural_network", "MLPRegressor"),
    "skl_mlp_regressor_double": ("sklearn.neural_network", "MLPRegressor"),
    "skl_mlp_classifier": ("sklearn.neural_network", "MLPClassifier"),
}


def make_estimator(name: str) -> Any:
    """An unfitted scikit-learn estimator with the recipe's parameters."""
    import importlib

    if name not in _SKLEARN_CLASSES:
        raise KeyError(f"{name!r} is not a scikit-learn golden model")
    module, cls = _SKLEARN_CLASSES[name]
    return getattr(importlib.import_module(module), cls)(**RECIPES[name].estimator_params)


@dataclass(frozen=True)
class HandModel:
    """Parameters of a hand-written graph and its numpy reference forward."""

    parameters: dict[str, np.ndarray]
    forward: Callable[[dict[str, np.ndarray], np.ndarray], np.ndarray]

    def predict(self, X: np.ndarray) -> np.ndarray:
        """The graph's output ``Y`` computed by numpy."""
        return self.forward(self.parameters, X)


def _hand_linear_forward(p: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    return X @ p["W"] + p["B"]


def _hand_mlp_tanh_forward(p: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    return np.tanh(X @ p["W1"] + p["B1"]) @ p["W2"] + p["B2"]


def _hand_broadcast_forward(p: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    z1 = X * p["scale"] + p["shift"]
    silu = z1 / (1 + np.exp(-z1))
    res = silu * X + p["scale"]
    return res.sum(axis=1, keepdims=True) * p["gain"]


def hand_model(name: str) -> HandModel:
    """The seeded parameters and numpy forward of a hand-written golden model."""
    r = recipe(name)
    dtype = np.dtype(r.dtype)
    rng = np.random.default_rng(100 + list(RECIPES).index(name))
    n_in = int(r.input_shape[1])

    def draw(*shape: int, scale: float = 1.0, loc: float = 0.0) -> np.ndarray:
        return (loc + scale * rng.normal(size=shape)).astype(dtype)

    if name == "hand_linear":
        params = {"W": draw(n_in, 1, scale=0.5), "B": draw(1, scale=0.1)}
        return HandModel(params, _hand_linear_forward)
    if name == "hand_mlp_tanh_double":
        hidden = 8
        params = {
            "W1": draw(n_in, hidden, scale=1 / np.sqrt(n_in)),
            "B1": draw(hidden, scale=0.1),
            "W2": draw(hidden, 1, scale=1 / np.sqrt(hidden)),
            "B2": draw(1, scale=0.1),
        }
        return HandModel(params, _hand_mlp_tanh_forward)
    if name == "hand_broadcast_reuse":
        params = {
            "scale": draw(n_in, loc=1.0, scale=0.2),
            "shift": draw(1, n_in, scale=0.1),
            "gain": np.asarray(0.5 + 0.1 * rng.normal(), dtype=dtype),
        }
        return HandModel(params, _hand_broadcast_forward)
    raise KeyError(f"{name!r} is not a hand-written golden model")


def make_cnn() -> Any:
    """The golden CNN (a ``torch.nn.Sequential``) with its seeded weights, in eval mode.

    Conv and Linear keep torch's default initialization under
    ``torch.manual_seed(0)``; BatchNorm's weight, bias and running statistics are
    drawn from the same seed so that no two parameters are equal (the TorchScript
    exporter merges initializers with equal values into one plus Identity nodes).
    The caller's global torch RNG state is left untouched.
    """
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(
            OrderedDict(
                [
                    ("conv", nn.Conv2d(1, 4, kernel_size=3, padding=1)),
                    ("bn", nn.BatchNorm2d(4)),
                    ("relu", nn.ReLU()),
                    ("pool", nn.MaxPool2d(2)),
                    ("flat", nn.Flatten()),
                    ("fc", nn.Linear(4 * 4 * 4, 3)),
                ]
            )
        )
        with torch.no_grad():
            bn = net.bn
            bn.weight.copy_(1.0 + 0.1 * torch.randn(4))
            bn.bias.copy_(0.1 * torch.randn(4))
            bn.running_mean.copy_(0.1 * torch.randn(4))
            bn.running_var.copy_(0.5 + torch.rand(4))
    return net.eval()


def fit_estimator(name: str) -> Any:
    """The fitted model behind a golden file.

    A fitted scikit-learn estimator (regressor, classifier), the torch module
    (torch), or a ``HandModel`` (hand). Deterministic: same result on every call.
    """
    r = recipe(name)
    if r.kind == "torch":
        return make_cnn()
    if r.kind == "hand":
        return hand_model(name)
    X_train, y_train, _, _ = dataset(name)
    est = make_estimator(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning on the small budgets
        est.fit(X_train, y_train)
    return est


def expected_outputs(name: str, X: np.ndarray, estimator: Any = None) -> dict[str, np.ndarray]:
    """What the golden graph should output for ``X``, keyed by output name.

    Regressors: ``variable`` = ``predict`` as a column; classifiers: ``label`` =
    ``predict`` and ``probabilities`` = ``predict_proba``; torch: ``logits`` =
    the module's forward; hand: ``Y`` = the numpy forward. Pass ``estimator``
    to reuse one already fitted.
    """
    r = recipe(name)
    est = fit_estimator(name) if estimator is None else estimator
    if r.kind == "regressor":
        return {"variable": np.asarray(est.predict(X)).reshape(-1, 1)}
    if r.kind == "classifier":
        return {"label": est.predict(X), "probabilities": est.predict_proba(X)}
    if r.kind == "torch":
        import torch

        with torch.no_grad():
            logits = est(torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)))
        return {"logits": logits.numpy()}
    return {"Y": est.predict(X)}
