"""Gradient of Det (lossgraph/autodiff/rules/linalg.py): dX = dy C, C the cofactors.

onnxruntime has a float Det kernel only: checked in float32 with the harness's float
tolerances, against finite differences, torch and the closed form ``dy det(X) X^-T``.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import check_gradients, cotangent
from support.models import model, signature

from lossgraph import gradient
from lossgraph.errors import UnsupportedModelError

F32 = np.float32


def _det_model(x: np.ndarray, opset: int = 18):
    out = ", ".join(str(d) for d in x.shape[:-2])
    return model(signature({"x": x}, f"float[{out}] y" if out else "float y"), "y = Det(x)",
                 opset=opset)


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 3), (2, 1, 2, 2)])
def test_det_gradient_is_the_cofactor_matrix(rng, shape):
    x = rng.normal(size=shape).astype(F32)
    y_shape = shape[:-2]
    r = cotangent(y_shape, np.float64)
    x64 = x.astype(np.float64)
    # d det(X) = det(X) X^-T where X is invertible
    expected = (np.asarray(r) * np.linalg.det(x64))[..., None, None] \
        * np.swapaxes(np.linalg.inv(x64), -1, -2)
    check_gradients(_det_model(x), {"x": x}, eps=1e-2, reference={"x": expected.astype(F32)})


def test_det_gradient_of_a_singular_matrix_is_finite(rng):
    """The adjugate exists where the inverse does not: a rank-1 3x3 matrix has a nonzero
    cofactor matrix (rank 2 has, rank 1 gives zeros); dy det X X^-T would be NaN."""
    u, v = rng.normal(size=(3, 1)), rng.normal(size=(1, 3))
    w = rng.normal(size=(3, 1))
    x = (u @ v + w @ rng.normal(size=(1, 3))).astype(F32)  # rank 2
    grads = check_gradients(_det_model(x), {"x": x}, eps=1e-2)
    assert np.all(np.isfinite(grads["x"])) and np.abs(grads["x"]).max() > 1e-3


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4)])
def test_det_gradient_matches_torch(rng, shape):
    import torch

    x = rng.normal(size=shape).astype(F32)
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.linalg.det(tx)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_gradients(_det_model(x), {"x": x}, eps=1e-2,
                    reference={"x": tx.grad.numpy().astype(F32)})


def test_det_of_an_unknown_matrix_size_is_a_named_error():
    net = model("(float[N, M, M] x) => (float[N] y)", "y = Det(x)")
    with pytest.raises(UnsupportedModelError, match="static matrix size"):
        gradient(net, weights=["x"], outputs=["y"])
