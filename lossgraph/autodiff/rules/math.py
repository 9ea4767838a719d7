"""Elementwise math: unary functions, Pow, Clip, Cast, and the variadic Min/Max/Sum/Mean/Where.

Unary functions (y = f(x)):

    Abs(x)         dx = dy sign(x)
    Exp(x)         dx = dy y
    Log(x)         dx = dy / x
    Sqrt(x)        dx = dy / (2 y)
    Reciprocal(x)  dx = -dy y^2
    Sin(x)         dx = dy cos(x)          (double: cos(x) as sin(x + pi/2), since
                                            onnxruntime 1.19 has no double Cos kernel)
    Cos(x)         dx = -dy sin(x)
    Tan(x)         dx = dy (1 + y^2)
    Asin(x)        dx = dy / sqrt(1 - x^2)
    Acos(x)        dx = -dy / sqrt(1 - x^2)
    Atan(x)        dx = dy / (1 + x^2)
    Sinh(x)        dx = dy cosh(x)
    Cosh(x)        dx = dy sinh(x)
    Tanh(x)        dx = dy (1 - y^2)
    Asinh(x)       dx = dy / sqrt(x^2 + 1)
    Acosh(x)       dx = dy / sqrt(x^2 - 1)
    Atanh(x)       dx = dy / (1 - x^2)
    Erf(x)         dx = dy 2/sqrt(pi) exp(-x^2)
    Sign, Floor,
    Ceil, Round,
    Hardmax        dx = 0                  (piecewise constant: zeros, not "no gradient",
                                            so the path stays differentiable)
    Cast(x)        dx = Cast(dy, to=type(x))   (no gradient for a non-float x; CastLike too)

Broadcasting ops (the walker sums each result back to its input's shape):

    Pow(a, b)      da = dy b a^(b-1)       (constant b folded: b = 1, 2 need no Pow; 0
                                            where b = 0, also at a = 0)
                   db = dy y log(a)        (a > 0; 0 where a = 0 and y = 0, i.e. b > 0;
                                            float b only)
    Clip(x, lo, hi) = Min(Max(x, lo), hi)
                   dx  = dy (y == x)       (x passes where lo <= x <= hi)
                   dlo = dy (x < lo) (lo <= hi)      dhi = dy (Max(x, lo) > hi)
    Min/Max(x1..xn)
                   dxi = dy (xi == y) (no earlier xj == y): the gradient goes to the
                   selected input; on ties the first tied input gets all of it
    Sum(x1..xn)    dxi = dy
    Mean(x1..xn)   dxi = dy / n
    Where(c, a, b) da = dy c           db = dy - da        (c: no gradient)
    Mod(a, b), fmod = 1 (floats)
                   y = a - b trunc(a / b):  da = dy     db = -dy Round((a - y) / b)

Masks are Mul by a Cast of a comparison, not Where (slow in onnxruntime 1.19).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from ..registry import grad_rule, zero_gradient

_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                          TensorProto.BFLOAT16})


def _square(g, x: str) -> str:
    return g.Mul(x, x, hint="sq")


# -- unary functions ------------------------------------------------------------------
@grad_rule("Abs")
def abs_(g, node, dy):
    (x,) = node.inputs
    return g.Mul(dy, g.Sign(x))


@grad_rule("Exp")
def exp(g, node, dy):
    return g.Mul(dy, node.outputs[0])


@grad_rule("Log")
def log(g, node, dy):
    return g.Div(dy, node.inputs[0])


@grad_rule("Sqrt")
def sqrt(g, node, dy):
    y = node.outputs[0]
    return g.Div(g.Mul(dy, g.const_like(0.5, y, "half")), y)


@grad_rule("Reciprocal")
def reciprocal(g, node, dy):
    y = node.outputs[0]
    return g.Neg(g.Mul(dy, _square(g, y)))


def _cos(g, x: str) -> str:
    if g.elem_type(x) == TensorProto.DOUBLE:  # onnxruntime 1.19: no double Cos kernel
        return g.Sin(g.Add(x, g.const_like(math.pi / 2, x, "half_pi")))
    return g.Cos(x)


@grad_rule("Sin")
def sin(g, node, dy):
    return g.Mul(dy, _cos(g, node.inputs[0]))


@grad_rule("Cos")
def cos(g, node, dy):
    return g.Neg(g.Mul(dy, g.Sin(node.inputs[0])))


@grad_rule("Tan")
def tan(g, node, dy):
    y = node.outputs[0]
    return g.Mul(dy, g.Add(_square(g, y), g.const_like(1, y, "one")))


def _sqrt_one_minus_square(g, x: str) -> str:
    return g.Sqrt(g.Sub(g.const_like(1, x, "one"), _square(g, x)))


@grad_rule("Asin")
def asin(g, node, dy):
    return g.Div(dy, _sqrt_one_minus_square(g, node.inputs[0]))


@grad_rule("Acos")
def acos(g, node, dy):
    return g.Neg(g.Div(dy, _sqrt_one_minus_square(g, node.inputs[0])))


@grad_rule("Atan")
def atan(g, node, dy):
    (x,) = node.inputs
    return g.Div(dy, g.Add(_square(g, x), g.const_like(1, x, "one")))


@grad_rule("Sinh")
def sinh(g, node, dy):
    return g.Mul(dy, g.Cosh(node.inputs[0]))


@grad_rule("Cosh")
def cosh(g, node, dy):
    return g.Mul(dy, g.Sinh(node.inputs[0]))


@grad_rule("Tanh")
def tanh(g, node, dy):
    y = node.outputs[0]
    return g.Mul(dy, g.Sub(g.const_like(1, y, "one"), _square(g, y)))


@grad_rule("Asinh")
def asinh(g, node, dy):
    (x,) = node.inputs
    return g.Div(dy, g.Sqrt(g.Add(_square(g, x), g.const_like(1, x, "one"))))


@grad_rule("Acosh")
def acosh(g, node, dy):
    (x,) = node.inputs
    return g.Div(dy, g.Sqrt(g.Sub(_square(g, x), g.const_like(1, x, "one"))))


@grad_rule("Atanh")
def atanh(g, node, dy):
    (x,) = node.inputs
    return g.Div(dy, g.Sub(g.const_like(1, x, "one"), _square(g, x)))


@grad_rule("Erf")
def erf(g, node, dy):
    (x,) = node.inputs
    bell = g.Exp(g.Neg(_square(g, x)))
    return g.Mul(g.Mul(dy, g.const_like(2 / math.sqrt(math.pi), x, "two_over_sqrt_pi")), bell)


zero_gradient("Sign", "Floor", "Ceil", "Round", "Hardmax")


@grad_rule("Cast", notes="gradient cast back to the input's type; none for non-float inputs")
@grad_rule("CastLike", since=15, nondiff=(1,), notes="as Cast")
def cast(g, node, dy):
    x = node.inputs[0]
    to = g.elem_type(x)
    if to not in _FLOAT_TYPES:
        return node.grads(None)
    return node.grads(dy if g.elem_type(node.outputs[0]) == to else g.Cast(dy, to=to))


# -- broadcasting ops ------------------------------------------------------------------
@grad_rule("Pow", broadcast=True, notes="exponent gradient uses log(base): base > 0, or 0 "
                                         "where base = 0 and exponent > 0")
def pow_(g, node, dy):
    a, b = node.inputs
    y = node.outputs[0]
    exponent = g.value(b)
    if exponent is not None and np.asarray(exponent).size == 1:
        k = float(np.asarray(exponent).reshape(-1)[0])
        if k == 0:
            da = g.zeros_like(y)
        elif k == 1:
            da = dy
        elif k == 2:
            da = g.Mul(g.Mul(dy, g.const_like(2, a, "two")), a)  # as Mul's square
        else:
            da = g.Mul(dy, g.Mul(g.Pow(a, g.const_like(k - 1, a, "exponent")),
                                 g.const_like(k, a, "exponent")))
    else:  # b a^(b - 1 + (b == 0)): 0, not 0 * inf, where b = 0 and a = 0
        bf = b if g.elem_type(b) == g.elem_type(a) else g.Cast(b, to=g.elem_type(a))
        zero, one = g.const_like(0, a, "zero"), g.const_like(1, a, "one")
        exponent = g.Sub(bf, g.Sub(one, g.mask(g.Equal(bf, zero), a)))
        da = g.Mul(dy, g.Mul(bf, g.Pow(a, exponent)))
    db = None
    if g.elem_type(b) in _FLOAT_TYPES:  # y log(a + (a == 0)): 0, not 0 * -inf, where y = 0
        safe = g.Add(a, g.mask(g.Equal(a, g.const_like(0, a, "zero")), a))
        db = g.Mul(g.Mul(dy, y), g.Log(safe))
        if g.elem_type(b) != g.elem_type(a):
            db = g.Cast(db, to=g.elem_type(b))
    return da, db


@grad_rule("Clip", since=11, broadcast=True,
           notes="x gets the gradient where lo <= x <= hi; lo/hi where x is clipped to them "
                 "(all to hi when lo > hi)")
def clip(g, node, dy):
    x, y = node.inputs[0], node.outputs[0]
    lo, hi = node.input(1), node.input(2)
    dx = g.Mul(dy, g.mask(g.Equal(x, y), x))
    dlo = dhi = None
    if lo is not None:
        below = g.Less(x, lo) if hi is None else g.And(g.Less(x, lo), g.Not(g.Greater(lo, hi)))
        dlo = g.Mul(dy, g.mask(below, x))
    if hi is not None:
        dhi = g.Mul(dy, g.mask(g.Greater(x if lo is None else g.Max(x, lo), hi), x))
    return node.grads(dx, dlo, dhi)


def _select(g, node, dy):
    """Min/Max: dy goes to the first input equal to the result."""
    y = node.outputs[0]
    grads, remaining = [], dy
    for x in node.inputs[:-1]:
        taken = g.Mul(remaining, g.mask(g.Equal(x, y), y))
        grads.append(taken)
        remaining = g.Sub(remaining, taken)
    return [*grads, remaining]


grad_rule("Min", broadcast=True, notes="ties: the first tied input gets the gradient")(_select)
grad_rule("Max", broadcast=True, notes="ties: the first tied input gets the gradient")(_select)


@grad_rule("Sum", broadcast=True)
def sum_(g, node, dy):
    return [dy] * len(node.inputs)


@grad_rule("Mean", broadcast=True)
def mean(g, node, dy):
    n = len(node.inputs)
    share = dy if n == 1 else g.Mul(dy, g.const_like(1 / n, node.outputs[0], "inv_n"))
    return [share] * n


@grad_rule("Mod", broadcast=True, notes="fmod=1 (float inputs); zero-measure jumps ignored")
def mod(g, node, dy):
    a, b = node.inputs
    quotient = g.Round(g.Div(g.Sub(a, node.outputs[0]), b))  # trunc(a / b), exactly
    return dy, g.Neg(g.Mul(dy, quotient))


@grad_rule("Where", broadcast=True, nondiff=(0,))
def where(g, node, dy):
    c, a, _ = node.inputs
    da = g.Mul(dy, g.mask(c, a))
    return None, da, g.Sub(dy, da)
