"""Gradient rules of the arithmetic ops Add, Sub, Mul, Div, Neg and Identity
(lossgraph/autodiff/rules/arithmetic.py): sums back over broadcast axes, static or known at
run time only."""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import away_from_zero, check_gradients, cotangent, reduce_to
from support.models import dims, model, signature

F64 = np.float64

ARITH_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 3, 4), ()),
                ((4,), (2, 3, 4))]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("shapes", ARITH_SHAPES, ids=str)
def test_binary_arithmetic_gradients_sum_back_over_broadcast_axes(op, shapes, rng):
    a = rng.normal(size=shapes[0])
    b = away_from_zero(rng, shapes[1])
    out = np.broadcast_shapes(*shapes)
    net = model(signature({"a": a, "b": b}, f"double[{dims(out)}] y"), f"y = {op}(a, b)")
    r = cotangent(out, F64)
    a_b = np.broadcast_to(a, out)
    b_b = np.broadcast_to(b, out)
    local = {"Add": (r, r), "Sub": (r, -r), "Mul": (r * b_b, r * a_b),
             "Div": (r / b_b, -r * a_b / b_b**2)}[op]
    expected = {"a": reduce_to(local[0], a.shape).reshape(a.shape),
                "b": reduce_to(local[1], b.shape).reshape(b.shape)}
    check_gradients(net, {"a": a, "b": b}, reference=expected, ort=True)


@pytest.mark.parametrize("rows", [1, 3])
def test_broadcast_over_a_dim_unknown_until_run_time_is_summed_at_run_time(rows, rng):
    """b's first dim M is 1 or 3 only at run time: its gradient is summed over the rows
    exactly when it broadcasts (symbolic dims are not assumed to match)."""
    a, b = rng.normal(size=(3, 4)), rng.normal(size=(rows, 4))
    net = model("(double[N, 4] a, double[M, 4] b) => (double[N, 4] y)", "y = Mul(a, b)")
    r = cotangent((3, 4), F64)
    grads = check_gradients(net, {"a": a, "b": b}, ort=False,
                            reference={"b": (r * a).sum(axis=0, keepdims=True) if rows == 1
                                       else r * a})
    assert grads["b"].shape == (rows, 4)


def test_same_input_on_both_sides_accumulates(rng):
    x = away_from_zero(rng, (3, 4))
    net = model(signature({"x": x}, "double[3, 4] y"), "p = Mul(x, x)\n y = Div(p, x)")
    check_gradients(net, {"x": x}, reference={"x": cotangent(x.shape, F64)}, ort=True)


@pytest.mark.parametrize("op,sign", [("Neg", -1.0), ("Identity", 1.0)])
@pytest.mark.parametrize("opset", [13, 21])
def test_neg_and_identity_gradients(op, sign, opset, rng):
    x = rng.normal(size=(2, 3))
    net = model(signature({"x": x}, "double[2, 3] y"), f"y = {op}(x)", opset=opset)
    check_gradients(net, {"x": x}, reference={"x": sign * cotangent(x.shape, F64)}, ort=True)
