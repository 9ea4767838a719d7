"""Activations (elementwise; masks are Mul by Cast(Greater) -- Where is slow in onnxruntime 1.19).

    Relu(x) = y              dx = dy (y > 0)   (y > 0 iff x > 0; reading y leaves x with one
                                                consumer, so runtimes can fuse MatMul/Gemm + Relu)
    Sigmoid(x) = y           dx = dy y (1 - y)
    HardSigmoid(x; a, b)     dx = dy a (0 < y < 1)
    LeakyRelu(x; a)          dx = dy (a + (1 - a)(x > 0))
    PRelu(x, s)              dx = dy (s + (1 - s)(x > 0))     ds = dy min(x, 0)
    ThresholdedRelu(x; a)    dx = dy (x > a)
    Shrink(x; l, b)          dx = dy (|x| > l)
    Elu(x; a) = y            dx = dy ((x > 0) + (x <= 0)(y + a))
    Selu(x; a, g) = y        dx = dy (g (x > 0) + (x <= 0)(y + g a))
    Celu(x; a) = y           dx = dy ((x > 0) + (x <= 0)(y / a + 1))
    Softplus(x)              dx = dy sigmoid(x)
    Softsign(x)              dx = dy / (1 + |x|)^2
    HardSwish(x)             dx = dy ((x > 3) + (|x| < 3)(x/3 + 1/2))
    Gelu(x), none            dx = dy (Phi(x) + x phi(x)),  Phi(x) = (1 + erf(x / sqrt 2)) / 2,
                                  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    Gelu(x), tanh            t = tanh(k (x + c x^3)), k = sqrt(2 / pi), c = 0.044715
                             dx = dy (1/2 (1 + t) + 1/2 x (1 - t^2) k (1 + 3 c x^2))
    Mish(x)                  t = tanh(softplus(x))
                             dx = dy (t + x (1 - t^2) sigmoid(x))
    Dropout(x, r, training)  inference (training absent or constant false): dx = dy
                             otherwise: dx = dy mask / (1 - r training), from the node's
                             mask output (in inference the mask is all true)
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import UnsupportedModelError
from ..registry import grad_rule


def _mask(g, x: str, op: str = "Greater", threshold: float = 0.0) -> str:
    """``Cast(op(x, threshold))`` in the type of ``x``: 1 where the comparison holds."""
    compare = getattr(g, op)(x, g.const_like(threshold, x, "threshold"))
    return g.mask(compare, x)


def _piecewise(g, x: str, positive: str, negative: str) -> str:
    """``positive`` where x > 0, else ``negative``: ``negative + mask (positive - negative)``."""
    mask = _mask(g, x)
    return g.Add(negative, g.Mul(mask, g.Sub(positive, negative)))


@grad_rule("Relu")
def relu(g, node, dy):
    return g.Mul(dy, _mask(g, node.outputs[0]))


@grad_rule("Sigmoid")
def sigmoid(g, node, dy):
    y = node.outputs[0]
    one = g.const_like(1, y, "one")
    return g.Mul(dy, g.Mul(y, g.Sub(one, y)))


@grad_rule("HardSigmoid")
def hard_sigmoid(g, node, dy):
    y = node.outputs[0]
    alpha = node.attr("alpha", 0.2)
    inside = g.And(g.Greater(y, g.const_like(0, y, "zero")), g.Less(y, g.const_like(1, y, "one")))
    scale = g.Mul(g.mask(inside, y), g.const_like(alpha, y, "alpha"))
    return g.Mul(dy, scale)


@grad_rule("LeakyRelu")
def leaky_relu(g, node, dy):
    (x,) = node.inputs
    alpha = node.attr("alpha", 0.01)
    slope = g.Add(g.Mul(_mask(g, x), g.const_like(1 - alpha, x, "one_minus_alpha")),
                  g.const_like(alpha, x, "alpha"))
    return g.Mul(dy, slope)


@grad_rule("PRelu", broadcast=True,
           notes="slope broadcasts unidirectionally; its gradient is summed to its shape")
def prelu(g, node, dy):
    x, slope = node.inputs
    one = g.const_like(1, x, "one")
    factor = g.Add(slope, g.Mul(_mask(g, x), g.Sub(one, slope)))
    dslope = g.Mul(dy, g.Min(x, g.const_like(0, x, "zero")))
    return g.Mul(dy, factor), dslope


@grad_rule("ThresholdedRelu")
def thresholded_relu(g, node, dy):
    (x,) = node.inputs
    return g.Mul(dy, _mask(g, x, threshold=node.attr("alpha", 1.0)))


@grad_rule("Shrink")
def shrink(g, node, dy):
    (x,) = node.inputs
    outside = g.Greater(g.Abs(x), g.const_like(node.attr("lambd", 0.5), x, "lambd"))
    return g.Mul(dy, g.mask(outside, x))


@grad_rule("Elu")
def elu(g, node, dy):
    (x,), y = node.inputs, node.outputs[0]
    negative = g.Add(y, g.const_like(node.attr("alpha", 1.0), x, "alpha"))
    return g.Mul(dy, _piecewise(g, x, g.const_like(1, x, "one"), negative))


@grad_rule("Selu")
def selu(g, node, dy):
    (x,), y = node.inputs, node.outputs[0]
    alpha = node.attr("alpha", 1.67326319217681884765625)
    gamma = node.attr("gamma", 1.05070102214813232421875)
    negative = g.Add(y, g.const_like(alpha * gamma, x, "gamma_alpha"))
    return g.Mul(dy, _piecewise(g, x, g.const_like(gamma, x, "gamma"), negative))


@grad_rule("Celu")
def celu(g, node, dy):
    (x,), y = node.inputs, node.outputs[0]
    alpha = node.attr("alpha", 1.0)
    negative = g.Add(g.Mul(y, g.const_like(1 / alpha, x, "inv_alpha")),
                     g.const_like(1, x, "one"))
    return g.Mul(dy, _piecewise(g, x, g.const_like(1, x, "one"), negative))


@grad_rule("Softplus")
def softplus(g, node, dy):
    (x,) = node.inputs
    return g.Mul(dy, g.Sigmoid(x))


@grad_rule("Softsign")
def softsign(g, node, dy):
    (x,) = node.inputs
    denominator = g.Add(g.Abs(x), g.const_like(1, x, "one"))
    return g.Div(dy, g.Mul(denominator, denominator))


@grad_rule("HardSwish")
def hard_swish(g, node, dy):
    (x,) = node.inputs
    three = g.const_like(3, x, "three")
    above = _mask(g, x, threshold=3.0)
    inside = g.mask(g.Less(g.Abs(x), three), x)
    ramp = g.Add(g.Mul(x, g.const_like(1 / 3, x, "third")), g.const_like(0.5, x, "half"))
    return g.Mul(dy, g.Add(above, g.Mul(inside, ramp)))


@grad_rule("Gelu", since=20, notes="approximate none and tanh (onnxruntime has no double Erf, "
                                    "so none runs in float only)")
def gelu(g, node, dy):
    (x,) = node.inputs
    one, half = g.const_like(1, x, "one"), g.const_like(0.5, x, "half")
    if node.attr("approximate", "none") == "tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        x2 = g.Mul(x, x)
        inner = g.Mul(x, g.Add(g.Mul(x2, g.const_like(k * c, x, "kc")), g.const_like(k, x, "k")))
        t = g.Tanh(inner)
        # d inner / dx = k (1 + 3 c x^2)
        dinner = g.Add(g.Mul(x2, g.const_like(3 * k * c, x, "three_kc")), g.const_like(k, x, "k"))
        left = g.Mul(half, g.Add(one, t))
        right = g.Mul(g.Mul(g.Mul(half, x), g.Sub(one, g.Mul(t, t))), dinner)
        return g.Mul(dy, g.Add(left, right))
    scaled = g.Mul(x, g.const_like(1 / math.sqrt(2), x, "inv_sqrt2"))
    cdf = g.Mul(half, g.Add(one, g.Erf(scaled)))
    pdf = g.Mul(g.Exp(g.Mul(g.Mul(x, x), g.const_like(-0.5, x, "minus_half"))),
                g.const_like(1 / math.sqrt(2 * math.pi), x, "inv_sqrt_2pi"))
    return g.Mul(dy, g.Add(cdf, g.Mul(x, pdf)))


@grad_rule("Mish", since=18)
def mish(g, node, dy):
    (x,) = node.inputs
    # softplus(x) = relu(x) + log(1 + exp(-|x|)): Softplus has no double kernel at every opset
    softplus = g.Add(g.Relu(x), g.Log(g.Add(g.Exp(g.Neg(g.Abs(x))), g.const_like(1, x, "one"))))
    t = g.Tanh(softplus)
    one = g.const_like(1, x, "one")
    slope = g.Add(t, g.Mul(g.Mul(x, g.Sub(one, g.Mul(t, t))), g.Sigmoid(x)))
    return g.Mul(dy, slope)


def _is_false(value) -> bool:
    return value is not None and not bool(np.asarray(value).reshape(-1)[0])


@grad_rule("Dropout", since=13, nondiff=(1, 2),
           notes="training mode: dy * mask / (1 - ratio) from the node's mask output (the "
                 "gradient pass gives a node without one its mask output); inference mode: "
                 "identity")
def dropout(g, node, dy, *_):
    x = node.inputs[0]
    ratio, training = node.input(1), node.input(2)
    if training is None or _is_false(g.value(training)):
        return node.grads(dy)
    ratio_value = g.value(ratio) if ratio is not None else np.array(0.5)
    if ratio_value is not None and float(np.asarray(ratio_value).reshape(-1)[0]) == 0.0:
        return node.grads(dy)
    mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] else None
    if mask is None:
        raise UnsupportedModelError(
            f"Dropout node {node.name or '<unnamed>'!r} may run in training mode but has no "
            "mask output; the gradient needs the mask. Give the node its second output."
        )
    dtype = g.elem_type(x)
    if ratio is None:
        ratio = g.const_like(0.5, x, "ratio")
    elif g.elem_type(ratio) != dtype:
        ratio = g.Cast(ratio, to=dtype)
    train = g.value(training)
    if train is not None:  # constant true
        drop = ratio
    else:
        drop = g.Mul(ratio, g.Cast(training, to=dtype))
    scale = g.Div(g.const_like(1, x, "one"), g.Sub(g.const_like(1, x, "one"), drop))
    return node.grads(g.Mul(g.Mul(dy, g.Cast(mask, to=dtype)), scale))
