"""Reductions and cumulative sums.

Below ``dy~`` and ``y~`` are ``dy`` and ``y`` with the reduced axes kept (unsqueezed
back when ``keepdims=0``), so they broadcast against ``x``; ``n`` is the number of
elements reduced into each output.

    ReduceSum(x)        dx = Expand(dy~, Shape(x))   (all axes: Expand(dy, Shape(x)))
    ReduceMean(x)       dx = Expand(dy~ / n, Shape(x))
    ReduceMax(x)        dx = dy~ m / ReduceSum(m)    with m = Cast(Equal(x, y~))
    ReduceMin(x)        (same: ties share the gradient evenly, as torch.amax/amin do)
    ReduceProd(x)       dx = dy~ p / x' * Cast(Equal(k, z))    zero-safe, where
                            z = Cast(x == 0), x' = x + z, p = ReduceProd(x'), k = ReduceSum(z)
                        (with no zero: dy~ y~ / x; with one zero: only that element gets
                        dy~ times the product of the others; with more: zero)
    ReduceL1(x)         dx = dy~ Sign(x)
    ReduceL2(x)         dx = dy~ x / y~        (0 where y = 0)
    ReduceSumSquare(x)  dx = 2 dy~ x
    ReduceLogSum(x)     dx = Expand(dy~ / Exp(y~), Shape(x))
    ReduceLogSumExp(x)  dx = dy~ Exp(x - y~)
    CumSum(x, axis)     dx = CumSum(dy, axis, exclusive, reverse = 1 - reverse)

Axes come from the ``axes`` attribute (opset < 18, ReduceSum < 13) or the ``axes``
input, constant or computed at run time. Computed axes stay computed: dy~ = dy with
``keepdims=1``, else Unsqueeze(dy, axes); the sums and products over the reduced axes
take the same axes input (and ``noop_with_empty_axes``); n = Size(x) / Size(y). With
empty axes and ``noop_with_empty_axes=1`` each rule is that of its reduction over no
axes, elementwise: ReduceSum/Mean/Max/Min/Prod/LogSumExp pass ``dy`` through, ReduceL1/L2
give ``dy Sign(x)``, ReduceSumSquare ``2 dy x`` and ReduceLogSum ``dy / x`` (the ONNX
reference semantics; onnxruntime 1.19 instead reduces over all axes there for L1, L2
and LogSum, and returns ``x`` for SumSquare).

``ArgMax`` and ``ArgMin`` return positions: no gradient reaches their input.
"""

from __future__ import annotations

import functools

import numpy as np

from ..registry import grad_rule, no_gradient

no_gradient("ArgMax", "ArgMin")


def reduced_axes(g, node) -> list[int] | None:
    """The normalized axes a Reduce* node reduces (``None``: it is the identity)."""
    x = node.inputs[0]
    rank = g.rank(x)
    axes = node.attr("axes")
    if axes is None and node.input(1) is not None:
        axes = g.ints_value(node.input(1), "the reduction axes")
    if not axes:
        return None if node.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


def reduces_everything(g, node) -> bool:
    """True for a reduction over all axes of an input of possibly unknown rank."""
    explicit = node.attr("axes") is not None or node.input(1) is not None
    return not explicit and not node.attr("noop_with_empty_axes", 0)


def keep_dims(g, node, value: str, axes: list[int]) -> str:
    """A reduced value (``dy`` or ``y``) with the reduced axes present, size 1."""
    return value if node.attr("keepdims", 1) else g.unsqueeze(value, axes)


def _count(g, node, axes: list[int] | None) -> str:
    """The number of elements reduced into each output, as a scalar of x's type
    (``axes=None``: axes known at run time only)."""
    x = node.inputs[0]
    shape = g.shape(x)
    dims = [shape[a] for a in axes] if axes is not None else [None]
    if all(isinstance(d, int) and d > 0 for d in dims):
        return g.const_like(float(np.prod(dims)), x, "count")
    to = g.elem_type(x)
    return g.Div(g.Cast(g.Size(x), to=to), g.Cast(g.Size(node.outputs[0]), to=to), hint="count")


def _reduction_rule(op_type: str, notes: str = ""):
    """Register ``dx = rule(g, node, dy)`` for ``op_type``, whose axes input (1) is ``nondiff``."""

    def register(rule):
        @functools.wraps(rule)
        def per_input(g, node, dy):
            return node.grads(rule(g, node, dy))

        grad_rule(op_type, notes=notes, nondiff=(1,))(per_input)
        return rule

    return register


def over_computed_axes(g, node) -> bool:
    """True for axes computed at run time (an ``axes`` input that is not constant)."""
    axes = node.input(1)
    return axes is not None and g.value(axes) is None


def kept(g, node, value: str) -> str:
    """``value`` (``dy`` or ``y``, the reduced shape) with the reduced axes present, size 1,
    whatever the form of the axes: static, none (the identity), or computed at run time,
    where it is ``Unsqueeze(value, axes)`` (the same axes, of x's rank) without
    ``keepdims``. Empty computed axes give ``value`` back, right for both their meanings
    (all axes reduced to a scalar, or none with ``noop_with_empty_axes``)."""
    if over_computed_axes(g, node):
        return value if node.attr("keepdims", 1) else g.Unsqueeze(value, node.inputs[1])
    axes = reduced_axes(g, node)
    return value if axes is None else keep_dims(g, node, value, axes)


def reduced_like(g, node, op_type: str, value: str, hint: str) -> str:
    """``op_type`` over the axes ``node`` reduces, dims kept (``value`` itself where the
    node is the identity); computed axes are passed on with ``noop_with_empty_axes``, so
    that empty ones mean what they mean to the node."""
    if over_computed_axes(g, node):
        noop = node.attr("noop_with_empty_axes", 0)
        return g.op(op_type, value, node.inputs[1], keepdims=1,
                    noop_with_empty_axes=noop or None, hint=hint)
    axes = reduced_axes(g, node)
    return value if axes is None else g.reduce(op_type, value, axes, keepdims=1, hint=hint)


def _is_identity(g, node) -> bool:
    """True for static empty axes with ``noop_with_empty_axes``: dx = dy."""
    return not over_computed_axes(g, node) and reduced_axes(g, node) is None


@_reduction_rule("ReduceSum")
def reduce_sum(g, node, dy):
    if reduces_everything(g, node):
        return g.Expand(dy, g.Shape(node.inputs[0]))  # dy broadcasts as it is
    return dy if _is_identity(g, node) else g.Expand(kept(g, node, dy), g.Shape(node.inputs[0]))


@_reduction_rule("ReduceMean")
def reduce_mean(g, node, dy):
    x, y = node.inputs[0], node.outputs[0]
    if reduces_everything(g, node):
        count = g.Cast(g.Size(x), to=g.elem_type(y), hint="count")
        return g.Expand(g.Div(dy, count), g.Shape(x))
    if _is_identity(g, node):
        return dy
    axes = None if over_computed_axes(g, node) else reduced_axes(g, node)
    return g.Expand(kept(g, node, g.Div(dy, _count(g, node, axes))), g.Shape(x))


def _extremum(g, node, dy):
    if _is_identity(g, node):
        return dy
    x = node.inputs[0]
    mask = g.mask(g.Equal(x, kept(g, node, node.outputs[0])), x, hint="argmax_mask")
    ties = reduced_like(g, node, "ReduceSum", mask, hint="ties")
    return g.Mul(mask, g.Div(kept(g, node, dy), ties))


_reduction_rule("ReduceMax", notes="ties share the gradient evenly")(_extremum)
_reduction_rule("ReduceMin", notes="ties share the gradient evenly")(_extremum)


@_reduction_rule("ReduceProd", notes="zero-safe: no division by zero")
def reduce_prod(g, node, dy):
    if _is_identity(g, node):
        return dy
    x = node.inputs[0]
    zeros = g.mask(g.Equal(x, g.const_like(0, x, "zero")), x, hint="is_zero")
    safe = g.Add(x, zeros, hint="zeros_as_ones")
    product = reduced_like(g, node, "ReduceProd", safe, hint="nonzero_product")
    count = reduced_like(g, node, "ReduceSum", zeros, hint="zero_count")
    # 1 where (no zeros and x != 0) or (one zero and x == 0), else 0
    keep = g.mask(g.Equal(count, zeros), x, hint="prod_mask")
    scaled = g.Mul(kept(g, node, dy), product)
    return g.Mul(g.Div(scaled, safe), keep)


@_reduction_rule("ReduceL1")
def reduce_l1(g, node, dy):
    return g.Mul(kept(g, node, dy), g.Sign(node.inputs[0]))


@_reduction_rule("ReduceL2", notes="zero gradient where the norm is 0")
def reduce_l2(g, node, dy):
    x = node.inputs[0]
    dy, y = kept(g, node, dy), kept(g, node, node.outputs[0])
    is_zero = g.mask(g.Equal(y, g.const_like(0, x, "zero")), x)
    return g.Mul(g.Div(dy, g.Add(y, is_zero)), x)


@_reduction_rule("ReduceSumSquare")
def reduce_sum_square(g, node, dy):
    x = node.inputs[0]
    return g.Mul(g.Mul(kept(g, node, dy), g.const_like(2, x, "two")), x)


@_reduction_rule("ReduceLogSum")
def reduce_log_sum(g, node, dy):
    x = node.inputs[0]
    if _is_identity(g, node):
        return g.Div(dy, x)
    return g.Expand(kept(g, node, g.Div(dy, g.Exp(node.outputs[0]))), g.Shape(x))


@_reduction_rule("ReduceLogSumExp")
def reduce_log_sum_exp(g, node, dy):
    if _is_identity(g, node):
        return dy
    x = node.inputs[0]
    softmax = g.Exp(g.Sub(x, kept(g, node, node.outputs[0])), hint="softmax")
    return g.Mul(kept(g, node, dy), softmax)


@grad_rule("CumSum", nondiff=(1,), notes="reverse cumulative sum of dy")
def cum_sum(g, node, dy):
    reverse = node.attr("reverse", 0)
    exclusive = node.attr("exclusive", 0)
    dx = g.CumSum(dy, node.inputs[1], exclusive=exclusive or None,
                  reverse=None if reverse else 1)
    return dx, None
