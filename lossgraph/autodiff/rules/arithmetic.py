"""Elementwise arithmetic (the walker sums each result back to its input's shape).

    Add(a, b)   da = dy            db = dy
    Sub(a, b)   da = dy            db = -dy
    Mul(a, b)   da = dy b          db = dy a         (Mul(a, a): da = 2 a dy)
    Div(a, b)   da = dy / b        db = -dy a / b^2 = -(da) y
    Neg(x)      dx = -dy
    Identity(x) dx = dy
"""

from __future__ import annotations

from ..registry import grad_rule


@grad_rule("Add", broadcast=True)
def add(g, node, dy):
    return dy, dy


@grad_rule("Sub", broadcast=True)
def sub(g, node, dy):
    return dy, g.Neg(dy)


@grad_rule("Mul", broadcast=True)
def mul(g, node, dy):
    a, b = node.inputs
    if a == b:  # a square: d(a^2) = 2 a da, so da = (2 dy) a; 2 dy first, so that a
        # constant dy (a mean's 1/n, shapes static) folds with the 2 into one constant
        return g.Mul(g.Mul(dy, g.const_like(2.0, a, "two")), a), None
    return g.Mul(dy, b), g.Mul(dy, a)


@grad_rule("Div", broadcast=True)
def div(g, node, dy):
    _, b = node.inputs
    da = g.Div(dy, b)
    return da, g.Neg(g.Mul(da, node.outputs[0]))


@grad_rule("Neg")
def neg(g, node, dy):
    return g.Neg(dy)


@grad_rule("Identity")
def identity(g, node, dy):
    return dy
