"""Reductions.

    ReduceSum(x, axes)   dx = Expand(Unsqueeze(dy, axes) unless keepdims, Shape(x))
"""

from __future__ import annotations

from ..registry import grad_rule


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


def expand_back(g, node, dy: str, axes: list[int]) -> str:
    """``dy`` (the reduced shape) broadcast back to the shape of the reduced input."""
    if not node.attr("keepdims", 1):
        dy = g.unsqueeze(dy, axes)
    return g.Expand(dy, g.Shape(node.inputs[0]))


@grad_rule("ReduceSum")
def reduce_sum(g, node, dy):
    axes = reduced_axes(g, node)
    return dy if axes is None else expand_back(g, node, dy, axes)
