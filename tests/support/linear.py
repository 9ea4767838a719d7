"""The small linear regression problem the training tests share."""

from __future__ import annotations

import numpy as np

#: y = x @ coef + intercept, four features, weights with a non-zero start.
LINEAR = """
    <ir_version: 8, opset_import: ["" : 18]>
    linear (float[N, 4] x) => (float[N, 1] y)
    <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5}>
    {
        h = MatMul(x, coef)
        y = Add(h, intercept)
    }
"""


def linear_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and noisy targets of a known linear function, float32."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (X @ [1.0, -2.0, 0.5, 3.0] + 1.0 + 0.1 * rng.normal(size=rows)).astype(np.float32)
    return X, y
