"""A dense layer with each output head a model ends in, for the tests of metrics and early
stopping (``runtime/test_metrics.py``, ``runtime/test_early_stopping.py``,
``compat/test_optimizers.py``).

:func:`head_model` is ``x (N, 4) -> MatMul -> Add -> head`` with ``C`` outputs; :data:`HEADS`
names the heads: ``values`` (a regression, ``C`` columns), ``probability`` (one Sigmoid),
``score`` (one raw score, trained with ``logistic``), ``softmax`` (probabilities per class),
``logits`` (raw class scores, ``multiclass_log_loss`` with ``from_logits``).
:func:`head_program` compiles one, :func:`head_data` draws features and labels for it.
"""

from __future__ import annotations

import numpy as np
import onnx

import lossgraph

#: head -> (columns, body after ``z = Add(MatMul(x, w), b)``, loss, loss options)
HEADS = {
    "values": (2, "y = Identity(z)", "squared_error", {}),
    "probability": (1, "y = Sigmoid(z)", "binary_log_loss", {}),
    "score": (1, "y = Identity(z)", "logistic", {}),
    "softmax": (3, "y = Softmax(z)", "multiclass_log_loss", {}),
    "logits": (4, "y = Identity(z)", "multiclass_log_loss", {"from_logits": True}),
}


def _numbers(values: np.ndarray) -> str:
    return "{" + ", ".join(repr(round(float(v), 3)) for v in values.ravel()) + "}"


def head_model(head: str, seed: int = 0) -> onnx.ModelProto:
    """The dense layer with ``head`` (module docstring), its weights drawn from ``seed``."""
    columns, body, _, _ = HEADS[head]
    rng = np.random.default_rng(seed)
    w, b = rng.normal(size=(4, columns)), rng.normal(size=columns)
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        net (float[N, 4] x) => (float[N, {columns}] y)
        <float[4, {columns}] w = {_numbers(w)}, float[{columns}] b = {_numbers(b)}>
        {{
            h = MatMul(x, w)
            z = Add(h, b)
            {body}
        }}""")


def head_program(head: str, weighted: bool = False, **options) -> lossgraph.TrainingProgram:
    """``head_model(head)`` compiled with its loss (with a ``sample_weight`` input when
    ``weighted``; options: compile_program's)."""
    _, _, loss, loss_options = HEADS[head]
    if weighted:
        loss_options = {**loss_options, "weight_name": "sample_weight"}
    return lossgraph.compile_program(head_model(head), loss=loss, loss_options=loss_options,
                                     **options)


def head_data(head: str, rows: int = 24, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels for ``head``: class indices (two classes for a single column)
    related to the features, or float targets of both columns."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 4)).astype(np.float32)
    columns = HEADS[head][0]
    if head == "values":
        return X, (X[:, :2] * [1.5, -0.5] + rng.normal(0, 0.3, (rows, 2))).astype(np.float32)
    classes = max(columns, 2)
    signal = X[:, 0] + 0.5 * X[:, 1] + rng.normal(0, 0.5, rows)
    return X, np.digitize(signal, np.quantile(signal, np.linspace(0, 1, classes + 1)[1:-1]))
