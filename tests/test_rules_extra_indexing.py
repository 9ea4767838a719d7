"""Gradients of Compress, and of ScatterND / ScatterElements with the reductions mul, max
and min (lossgraph/autodiff/rules/indexing.py)."""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import check_gradients, cotangent, loss_model
from support.models import model

from lossgraph import gradient


def rand(rng, *shape):
    return rng.normal(size=shape)


def _lossgraph_grads(net, feeds, wrt, run_model) -> dict[str, np.ndarray]:
    """lossgraph's gradients of sum(y R), without finite differences (for ties, where the
    one-sided slopes of a three-way max do not average to the even share)."""
    graph = gradient(loss_model(net, feeds), weights=list(wrt), loss_name="gradcheck_loss")
    out = run_model(graph, feeds)
    return {w: out[f"{w}_grad"] for w in wrt}


# -------------------------------------------------------------------------- Compress
@pytest.mark.parametrize("axis, condition", [
    (0, [True, False, True]),
    (1, [False, True, True, False]),
    (-1, [True, False]),            # shorter than the axis: the rest is dropped
    (None, [False, True, True, False, False, True, True]),  # on the flattened input
    (0, [False, False, False]),     # nothing selected: a zero gradient
])
def test_compress_gradient_scatters_dy_back_to_the_selected_positions(rng, axis, condition):
    x = rand(rng, 3, 4)
    c = np.array(condition)
    y = np.compress(c, x, axis=axis)
    attrs = "" if axis is None else f"<axis = {axis}>"
    out = ", ".join(str(d) for d in y.shape)
    net = model(f"(double[3, 4] x, bool[{len(c)}] c) => (double[{out}] y)",
                f"y = Compress {attrs} (x, c)", opset=13)
    r = cotangent(y.shape, np.float64)
    expected = np.zeros(x.size if axis is None else x.shape)
    if axis is None:
        expected[np.flatnonzero(c)] = r
        expected = expected.reshape(x.shape)
    else:
        index = [slice(None)] * 2
        index[axis] = np.flatnonzero(c)
        expected[tuple(index)] = r
    check_gradients(net, {"x": x, "c": c}, wrt=["x"], reference={"x": expected})


def test_compress_gradient_with_a_condition_computed_at_run_time(rng):
    x = rand(rng, 2, 5)
    net = model("(double[2, 5] x, double[5] t) => (double[2, N] y)",
                "zero = Constant <value = double {0.0}> ()\n"
                "c = Greater(t, zero)\n y = Compress <axis = 1> (x, c)", opset=13)
    t = np.array([1.0, -1.0, 2.0, 3.0, -2.0])
    check_gradients(net, {"x": x, "t": t}, wrt=["x"])


# --------------------------------------------------------------------------- Scatter
# ort=False: onnxruntime-training's GradientGraphBuilder ignores the reduction (its dx
# for max and mul is that of reduction="none", which finite differences refute)
SCATTER_ND = "(double[4, 3] x, int64[3, 1] i, double[3, 3] u) => (double[4, 3] y)"


@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_nd_reduction_gradients_with_duplicate_indices(rng, reduction):
    x, u = rand(rng, 4, 3), rand(rng, 3, 3)
    i = np.array([[3], [1], [3]], dtype=np.int64)  # row 3 gets two updates
    net = model(SCATTER_ND, f'y = ScatterND <reduction = "{reduction}"> (x, i, u)', opset=18)
    check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"], ort=False)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_elements_reduction_gradients_with_duplicate_indices(rng, axis, reduction):
    x, u = rand(rng, 3, 4), rand(rng, 2, 3)
    i = np.array([[2, 0, 1], [2, 0, 2]], dtype=np.int64) if axis == 0 else \
        np.array([[3, 3, 1], [0, 2, 2]], dtype=np.int64)
    net = model("(double[3, 4] x, int64[2, 3] i, double[2, 3] u) => (double[3, 4] y)",
                f'y = ScatterElements <axis = {axis}, reduction = "{reduction}"> (x, i, u)',
                opset=18)
    check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"], ort=False)


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_scatter_max_and_min_share_a_two_way_tie_evenly(reduction):
    """At a tie of two factors the central difference is 1/2 for each: the even share."""
    x = np.array([1.0, 5.0, 3.0, -5.0])
    u = np.array([5.0 if reduction == "max" else -5.0, 2.0, 0.0])
    i = np.array([1 if reduction == "max" else 3, 0, 2])
    net = model("(double[4] x, int64[3] i, double[3] u) => (double[4] y)",
                f'y = ScatterElements <reduction = "{reduction}"> (x, i, u)', opset=18)
    grads = check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"], ort=False)
    r = cotangent((4,), np.float64)
    tied = 1 if reduction == "max" else 3
    np.testing.assert_allclose(grads["x"][tied], r[tied] / 2)
    np.testing.assert_allclose(grads["u"][0], r[tied] / 2)


def test_scatter_mul_gradient_is_zero_safe(rng):
    """Zero factors: with one zero at a position only the zero factor gets a gradient (the
    product of the others); with two, none does. Never NaN."""
    x = np.array([2.0, 0.0, 3.0, 0.0])
    u = np.array([0.0, 4.0, 0.5, 0.0])
    i = np.array([0, 1, 2, 3])  # position 0: one zero (u); 1: one zero (x); 3: two zeros
    net = model("(double[4] x, int64[4] i, double[4] u) => (double[4] y)",
                'y = ScatterElements <reduction = "mul"> (x, i, u)', opset=18)
    grads = check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"], ort=False)
    r = cotangent((4,), np.float64)
    np.testing.assert_allclose(grads["x"], [0.0, r[1] * 4.0, r[2] * 0.5, 0.0])
    np.testing.assert_allclose(grads["u"], [r[0] * 2.0, 0.0, r[2] * 3.0, 0.0])


@pytest.mark.torch
@pytest.mark.parametrize("reduction", ["amax", "amin", "prod"])
def test_scatter_elements_reduction_gradients_match_torch_with_three_way_ties(
        run_model, reduction):
    import torch

    onnx_reduction = {"amax": "max", "amin": "min", "prod": "mul"}[reduction]
    x = np.array([[1.0, 2.0, 2.0], [0.5, -1.0, 3.0]])
    u = np.array([[2.0, 2.0, 7.0], [-3.0, 0.25, 3.0]])
    i = np.array([[1, 1, 0], [0, 0, 2]])
    net = model("(double[2, 3] x, int64[2, 3] i, double[2, 3] u) => (double[2, 3] y)",
                f'y = ScatterElements <axis = 1, reduction = "{onnx_reduction}"> (x, i, u)',
                opset=18)
    feeds = {"x": x, "i": i, "u": u}
    got = _lossgraph_grads(net, feeds, ["x", "u"], run_model)
    tx = torch.tensor(x, requires_grad=True)
    tu = torch.tensor(u, requires_grad=True)
    y = tx.scatter_reduce(1, torch.tensor(i), tu, reduce=reduction, include_self=True)
    (y * torch.from_numpy(cotangent((2, 3), np.float64))).sum().backward()
    np.testing.assert_allclose(got["x"], tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["u"], tu.grad.numpy(), rtol=1e-12, atol=1e-12)
