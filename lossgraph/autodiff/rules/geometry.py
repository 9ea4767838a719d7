"""Geometric maps: rotary position embeddings and affine sampling grids.

Both are linear in their float input, and each gradient reuses the op itself::

    RotaryEmbedding(x, C, S, p)    each rotated pair (x1, x2) of a head, at position p:
                                   (y1, y2) = (c x1 - s x2, s x1 + c x2), c = C[p], s = S[p]
                                   dx = RotaryEmbedding(dy, C, -S, p)    (the inverse
                                        rotation: the transpose of a rotation)
                                   dc = sum over heads of dy1 x1 + dy2 x2
                                      = pairs(dy * x)
                                   ds = sum over heads of dy2 x1 - dy1 x2
                                      = pairs(dy * RotaryEmbedding(x, 0, 1, p))
                                   where pairs() adds the two entries of each rotated pair
                                   (halves, or even and odd entries when interleaved) and
                                   sums the heads; the caches' gradients are those (B, S,
                                   rot/2) sums scattered (added) to the rows p index, or
                                   the caches themselves without position_ids
    AffineGrid(theta, size)        grid[n, p] = theta[n] (g_p, 1), g_p the identity grid's
                                   point p (the op with theta = [I 0] and N = 1):
                                   dtheta[n] = [dgrid[n]^T G, sum_p dgrid[n, p]]
                                   (G the identity grid as a (points, dims) matrix)
"""

from __future__ import annotations

import numpy as np

from ...errors import UnsupportedModelError
from ...graphs import attribute_values
from ..registry import grad_rule
from .indexing import scatter_add_rows


# ------------------------------------------------------------------ RotaryEmbedding
def _head_size(g, node, x: str) -> int:
    """The static head size D of ``x`` ((B, H, S, D), or (B, S, H D) with num_heads)."""
    shape = g.shape(x) or ()
    if len(shape) == 4 and isinstance(shape[3], int):
        return shape[3]
    heads = node.attr("num_heads", 0)
    if len(shape) == 3 and isinstance(shape[2], int) and heads:
        return shape[2] // heads
    raise UnsupportedModelError(
        f"The gradient of RotaryEmbedding node {node.name or '<unnamed>'!r} with respect to "
        f"its caches needs the static head size of {x!r} (shape {shape or 'unknown'}), or "
        "the rotary_embedding_dim attribute.")


def _pair_sums(g, node, t: str, x: str, rot: int) -> str:
    """(B, S, rot/2): ``t`` (shaped like x) in (B, S, H, D) layout, the two entries of each
    rotated pair added, summed over the heads."""
    if g.rank(x) == 4:
        t = g.Transpose(t, perm=[0, 2, 1, 3])
    else:
        t = g.Reshape(t, g.ints([0, 0, node.attr("num_heads"), -1], "bshd"))
    axes = g.ints([3], "axes")
    if node.attr("interleaved", 0):
        first = g.Slice(t, g.ints([0], "starts"), g.ints([rot], "ends"), axes, g.ints([2], "steps"))
        second = g.Slice(t, g.ints([1], "starts"), g.ints([rot], "ends"), axes,
                         g.ints([2], "steps"))
    else:
        first = g.Slice(t, g.ints([0], "starts"), g.ints([rot // 2], "ends"), axes)
        second = g.Slice(t, g.ints([rot // 2], "starts"), g.ints([rot], "ends"), axes)
    return g.reduce("ReduceSum", g.Add(first, second), [2], keepdims=0)


def _to_cache(g, node, sums: str, cache: str) -> str:
    """The (B, S, rot/2) gradient in the cache's shape: added to the rows position_ids
    index, or the cache's own shape without position_ids."""
    positions = node.input(3)
    if positions is None:
        return sums
    zeros = g.filled(g.Shape(cache), 0, cache, hint="zeros")
    # (B, S) positions, repeated across the batch: rows added in order (indexing's
    # scatter_add_rows), not by ScatterND(add), which onnxruntime runs with a race
    count = g.Reshape(g.Size(positions), g.ints([1], hint="shape"))
    half = g.Slice(g.Shape(sums), g.ints([2], hint="starts"), g.ints([3], hint="ends"))
    rows = g.Reshape(sums, g.Concat(count, half, axis=0))
    return scatter_add_rows(g, zeros, g.Reshape(positions, count), rows, 2)


@grad_rule("RotaryEmbedding", since=23, nondiff=(3,),
           notes="dx by the inverse rotation (the op with -sin); the caches' gradients "
                 "added to the rows position_ids index")
def rotary_embedding(g, node, dy):
    x, cos, sin = node.inputs[:3]
    positions = node.input(3)
    attributes = attribute_values(node.proto)
    extra = [positions] if positions else []
    dx = dcos = dsin = None
    if x in node.wanted:
        dx = g.RotaryEmbedding(dy, cos, g.Neg(sin), *extra, hint="rotary_dx", **attributes)
    if cos in node.wanted or sin in node.wanted:
        rot = node.attr("rotary_embedding_dim", 0) or _head_size(g, node, x)
        if cos in node.wanted:
            dcos = _to_cache(g, node, _pair_sums(g, node, g.Mul(dy, x), x, rot), cos)
        if sin in node.wanted:
            quarter = g.RotaryEmbedding(x, g.filled(g.Shape(cos), 0, cos, hint="zeros"),
                                        g.filled(g.Shape(sin), 1, sin, hint="ones"), *extra,
                                        hint="rotated_quarter", **attributes)
            dsin = _to_cache(g, node, _pair_sums(g, node, g.Mul(dy, quarter), x, rot), sin)
    if cos == sin and cos in node.wanted:  # one value in both places: one sum
        return node.grads(dx, g.Add(dcos, dsin), None)
    return node.grads(dx, dcos, dsin)


# ----------------------------------------------------------------------- AffineGrid
def _spatial_dims(g, node, theta: str, size: str) -> int:
    for shape, offset in ((g.shape(theta), 1), (g.shape(size), 0)):
        if shape is not None and len(shape) > offset and isinstance(shape[offset], int):
            return shape[offset] if offset else shape[0] - 2
    raise UnsupportedModelError(
        f"The gradient of AffineGrid node {node.name or '<unnamed>'!r} needs to know whether "
        f"it is 2-D or 3-D: the shapes of {theta!r} and {size!r} are unknown.")


@grad_rule("AffineGrid", since=20, nondiff=(1,),
           notes="linear in theta: the identity grid (the op itself) times the grid gradient")
def affine_grid(g, node, dy):
    theta, size = node.inputs
    dims = _spatial_dims(g, node, theta, size)
    identity = g.const_like(np.eye(dims, dims + 1)[None], theta, "identity_theta")
    one_batch = g.Concat(g.ints([1], "one"), g.Slice(size, g.ints([1], "starts"),
                                                     g.ints([dims + 2], "ends")), axis=0)
    grid = g.AffineGrid(identity, one_batch, hint="identity_grid",
                        **attribute_values(node.proto))
    points = g.Reshape(grid, g.ints([-1, dims], "points"))  # (P, dims)
    per_point = g.Transpose(g.Reshape(dy, g.ints([0, -1, dims], "per_point")),
                            perm=[0, 2, 1])  # (N, dims, P)
    linear = g.MatMul(per_point, points)
    offset = g.reduce("ReduceSum", per_point, [2], keepdims=1)
    return node.grads(g.Concat(linear, offset, axis=2, hint="dtheta"))
