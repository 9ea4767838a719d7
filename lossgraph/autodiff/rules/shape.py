"""Shape and layout ops: their gradients move ``dy`` back into the input's layout.

    Reshape(x, s)          dx = Reshape(dy, Shape(x))
    Flatten(x)             dx = Reshape(dy, Shape(x))
    Squeeze(x, axes)       dx = Reshape(dy, Shape(x))
    Unsqueeze(x, axes)     dx = Reshape(dy, Shape(x))
    Transpose(x, perm)     dx = Transpose(dy, perm^-1)
    Expand(x, s)           dx = dy summed over the broadcast axes: the leading ones, and
                           those where x is 1 and y is not (picked at run time where the
                           static shapes cannot tell)
    Tile(x, r)             dx = ReduceSum(Reshape(dy, (r1, d1, r2, d2, ...)), axes=(0, 2, ...))
                           (the target interleaved at run time where r or x's shape is)
    Concat(x1..xn, axis)   dxi = Split(dy, (size1..sizen), axis)[i]
    Split(x, axis)         dx = Concat(dy1..dyn, axis)    (missing dyi: zeros)
    DepthToSpace(x, b)     DCR: dx = SpaceToDepth(dy, b)
                           CRD: dx = SpaceToDepth(dy, b) with channels regrouped
                                (N, b*b, C, HW) -> (N, C, b*b, HW)
    SpaceToDepth(x, b)     dx = DepthToSpace(dy, b, mode=DCR)
    CenterCropPad(x, s)    a centered window (crop) or a centered frame of zeros (pad) per
                           axis: its adjoint pads what was cropped and crops what was padded,
                           dx = Pad(dy, (b, d - b)) along the axes, d = dim - s and
                           b = floor(d / 2) (crop) or -floor(-d / 2) (pad, the odd pixel right)

Shapes, sizes and the ops that make tensors from them (``ConstantOfShape``, ``Range``,
``EyeLike``) pass no gradient to their inputs; nor does ``Upsample``'s scales input.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...errors import UnsupportedModelError
from ..registry import grad_rule, no_gradient

no_gradient("Shape", "Size", "ConstantOfShape", "Range", "EyeLike")
no_gradient("Upsample", inputs=(1,))


def static_shape(g, name: str) -> list[int] | None:
    """The shape of ``name`` as ints when every dim is known, else ``None``."""
    shape = g.shape(name)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return list(shape)


def shape_of(g, name: str) -> str:
    """The shape of forward value ``name``: a constant when static, else ``Shape(name)``."""
    shape = static_shape(g, name)
    return g.ints(shape, hint="shape") if shape is not None else g.Shape(name)


def reshape_back(g, dy: str, x: str) -> str:
    """``dy`` in the shape of ``x`` (an empty ``x``'s gradient is empty: a 0 in a Reshape
    target would copy the size of ``dy``'s dim instead)."""
    shape = static_shape(g, x)
    if shape is not None and 0 in shape:
        return g.zeros_like(x)
    return g.Reshape(dy, shape_of(g, x))


@grad_rule("Reshape", nondiff=(1,))
def reshape(g, node, dy):
    return node.grads(reshape_back(g, dy, node.inputs[0]))


@grad_rule("Flatten")
def flatten(g, node, dy):
    return reshape_back(g, dy, node.inputs[0])


@grad_rule("Squeeze", since=13, nondiff=(1,))
def squeeze(g, node, dy):
    return node.grads(reshape_back(g, dy, node.inputs[0]))


@grad_rule("Unsqueeze", since=13, nondiff=(1,))
def unsqueeze(g, node, dy):
    return node.grads(reshape_back(g, dy, node.inputs[0]))


@grad_rule("Transpose")
def transpose(g, node, dy):
    rank = g.rank(node.inputs[0])
    perm = node.attr("perm") or list(range(rank))[::-1]
    inverse = [0] * rank
    for i, p in enumerate(perm):
        inverse[p] = i
    if inverse == list(range(rank)):
        return dy
    return g.Transpose(dy, perm=inverse)


@grad_rule("Expand", nondiff=(1,), notes="broadcast axes found statically, or at run time")
def expand(g, node, dy):
    x, y = node.inputs[0], node.outputs[0]
    if g.shape(y) is None or g.shape(x) is None:
        raise UnsupportedModelError(
            f"The gradient of Expand node {node.name!r} needs the ranks of {x!r} and {y!r}; "
            "shape inference found none. Give the model's inputs static ranks.")
    return node.grads(g.unbroadcast(dy, x, y))


@grad_rule("Tile", nondiff=(1,), notes="repeats constant or computed at run time")
def tile(g, node, dy):
    x, repeats = node.inputs[:2]
    value = g.value(repeats)
    counts = None if value is None else [int(r) for r in np.asarray(value).reshape(-1)]
    if counts is not None and all(r == 1 for r in counts):
        return node.grads(dy)
    rank = len(counts) if counts is not None else g.rank(x)
    shape = static_shape(g, x)
    if counts is not None and shape is not None:
        target = g.ints([v for pair in zip(counts, shape) for v in pair], hint="shape")
    else:  # interleave the repeats with Shape(x) at run time
        column = (g.unsqueeze(repeats, [1]) if counts is None else
                  g.const(np.array(counts, np.int64).reshape(rank, 1), np.int64, "repeats"))
        pairs = g.Concat(column, g.unsqueeze(g.Shape(x), [1]), axis=1)
        target = g.Reshape(pairs, g.ints([2 * rank], hint="shape"))
    split = g.Reshape(dy, target)
    return node.grads(g.reduce("ReduceSum", split, list(range(0, 2 * rank, 2)), keepdims=0))


def axis_sizes(g, names: list[str], axis: int) -> str:
    """The sizes of ``names`` along ``axis`` as a 1-D int64 tensor."""
    dims = [(g.shape(n) or [None] * (axis + 1))[axis] for n in names]
    if all(isinstance(d, int) for d in dims):
        return g.ints(dims, hint="sizes")
    parts = [g.dims(n, axis, axis + 1) for n in names]
    return parts[0] if len(parts) == 1 else g.Concat(*parts, axis=0)


@grad_rule("Concat")
def concat(g, node, dy):
    inputs = node.inputs
    if len(inputs) == 1:
        return dy
    axis = node.attr("axis") % g.rank(inputs[0])
    parts = g.Split(dy, axis_sizes(g, inputs, axis), axis=axis, outputs=len(inputs),
                    hint="concat_grad")
    return list(parts)


@grad_rule("Split", since=13, nondiff=(1,), notes="outputs without a gradient contribute zeros")
def split(g, node, *dys):
    x = node.inputs[0]
    axis = node.attr("axis", 0) % g.rank(x)
    parts = [g.or_zeros(dy, out) for dy, out in zip(dys, node.outputs)]
    return node.grads(parts[0] if len(parts) == 1 else g.Concat(*parts, axis=axis))


@grad_rule("SpaceToDepth")
def space_to_depth(g, node, dy):
    return g.DepthToSpace(dy, blocksize=node.attr("blocksize"), mode="DCR")


@grad_rule("DepthToSpace", notes="CRD mode needs a static channel count")
def depth_to_space(g, node, dy):
    x = node.inputs[0]
    b = node.attr("blocksize")
    dx = g.SpaceToDepth(dy, blocksize=b)  # channels ordered (b, b, C/b^2)
    if node.attr("mode", "DCR") == "DCR":
        return dx
    channels = (g.shape(x) or (None, None))[1]
    if not isinstance(channels, int):
        raise UnsupportedModelError(
            f"The gradient of DepthToSpace node {node.name!r} (mode CRD) needs the channel "
            f"count of {x!r} to be static.")
    grouped = g.Reshape(dx, g.ints([0, b * b, channels // (b * b), -1], hint="shape"))
    regrouped = g.Transpose(grouped, perm=[0, 2, 1, 3])
    return reshape_back(g, regrouped, x)


@grad_rule("CenterCropPad", since=18, nondiff=(1,))
def center_crop_pad(g, node, dy):
    x, target = node.inputs
    rank = g.rank(x)
    axes = [a % rank for a in node.attr("axes", list(range(rank)))]
    shape, sizes = g.shape(x), g.value(target)
    dims = [shape[a] for a in axes] if shape is not None else [None]
    if sizes is not None and all(isinstance(d, int) for d in dims):
        diffs = [d - int(s) for d, s in zip(dims, np.asarray(sizes).reshape(-1))]
        # trunc(d / 2): floor for a crop (d > 0), -floor(-d / 2) for a pad (d < 0)
        begin = [int(np.sign(d)) * (abs(d) // 2) for d in diffs]
        pads = g.ints(begin + [d - b for d, b in zip(diffs, begin)], hint="pads")
    else:  # the same at run time: b = Sign(d) (|d| / 2), on non-negative integers
        dims = g.Gather(g.Shape(x), g.ints(axes, hint="axes"), axis=0)
        if g.elem_type(target) != onnx.TensorProto.INT64:
            target = g.Cast(target, to=onnx.TensorProto.INT64)
        diffs = g.Sub(dims, target)
        two = g.const(2, np.int64, "two")
        begin = g.Mul(g.Sign(diffs), g.Div(g.Abs(diffs), two))
        pads = g.Concat(begin, g.Sub(diffs, begin), axis=0)
    return node.grads(g.Pad(dy, pads, "", g.ints(axes, hint="axes"), mode="constant"))
