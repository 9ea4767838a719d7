"""Quantization: the gradient of a dequantization with respect to its scale.

    DequantizeLinear(x, s, z; axis, block_size) = y = (x - z) s    (s broadcast per tensor,
                             per axis or per block, as the op's granularity says)
                             ds = sum of dy (x - z) over the elements each scale multiplies:
                                  (x - z) = DequantizeLinear(x, ones like s, z) (exactly the
                                  forward's difference, in y's type); per tensor: summed over
                                  all axes; per axis: over all axes but ``axis``; blocked: the
                                  axis split into (blocks, block_size), zero-padded to whole
                                  blocks, summed over block_size
                             dx, dz: none (``nondiff``): x and z are integers (or 8-bit
                                  floats); no derivative exists

**No straight-through estimator.** In a quantized model a float weight ``w`` reaches
DequantizeLinear through ``QuantizeLinear`` (y = saturate(round(w / s) + z)), whose
output is an integer: the derivative with respect to ``w`` is zero almost everywhere and
undefined at the rounding steps. Quantization-aware fine-tuning instead treats the
pair ``DequantizeLinear(QuantizeLinear(w))`` as the identity on ``w`` (a straight-through
estimator, usually masked to the representable range). That is a modelling choice, not
the gradient, so lossgraph does not make it silently: a weight that reaches the loss only
through a QuantizeLinear is a :class:`~lossgraph.errors.NoGradientError` naming it. The
scales get their exact gradient.
"""

from __future__ import annotations

from ...errors import UnsupportedModelError
from ...graphs import attribute_values
from ..registry import grad_rule


@grad_rule("DequantizeLinear", nondiff=(0, 2),
           notes="the scale's exact gradient (per tensor, per axis, blocked); the integer "
                 "input and zero point have none (no straight-through estimator)")
def dequantize_linear(g, node, dy):
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    ones = g.filled(g.Shape(scale), 1, scale, hint="unit_scale")
    attributes = attribute_values(node.proto)
    difference = g.DequantizeLinear(x, ones, *([node.input(2)] if node.input(2) else []),
                                    hint="x_minus_zero_point", **attributes)  # x - z
    product = g.Mul(dy, difference)
    rank, scale_rank = g.rank(x), g.rank(scale)
    axis = node.attr("axis", 1) % max(rank, 1)
    block = node.attr("block_size", 0) or 0
    if scale_rank == 0:  # per tensor
        grad = g.reduce("ReduceSum", product, None, keepdims=0)
    elif block == 0:  # per axis (a 1-D scale; a 1-element one per tensor)
        size = (g.shape(scale) or [None])[0]
        if rank == 0 or (size == 1 and (g.shape(x) or [None] * (axis + 1))[axis] != 1):
            grad = g.Reshape(g.reduce("ReduceSum", product, None, keepdims=0),
                             g.ints([1], "shape"))
        else:
            axes = [a for a in range(rank) if a != axis]
            grad = g.reduce("ReduceSum", product, axes, keepdims=0) if axes else product
    else:
        grad = _sum_blocks(g, node, product, x, axis, block)
    if g.elem_type(y) != g.elem_type(scale):
        grad = g.Cast(grad, to=g.elem_type(scale))
    return node.grads(None, grad)


def _sum_blocks(g, node, product: str, x: str, axis: int, block: int) -> str:
    """``product`` (shaped like x) summed over each block of ``block`` elements along
    ``axis``: the last block zero-padded to whole, the axis split in (blocks, block)."""
    size = (g.shape(x) or [None] * (axis + 1))[axis]
    if not isinstance(size, int):
        raise UnsupportedModelError(
            f"The gradient of blocked DequantizeLinear node {node.name or '<unnamed>'!r} "
            f"needs the static size of axis {axis} of {x!r}; shape inference found "
            f"{g.shape(x)}.")
    rank = g.rank(x)
    blocks = -(-size // block)
    if blocks * block != size:
        pads = [0] * (2 * rank)
        pads[rank + axis] = blocks * block - size
        product = g.Pad(product, g.ints(pads, "pads"), mode="constant")
    parts = [g.ints([blocks, block], "shape")]
    if axis > 0:
        parts.insert(0, g.dims(x, 0, axis))
    if axis < rank - 1:
        parts.append(g.dims(x, axis + 1, rank))
    split = g.Reshape(product, g.Concat(*parts, axis=0) if len(parts) > 1 else parts[0])
    return g.reduce("ReduceSum", split, [axis + 1], keepdims=0)
