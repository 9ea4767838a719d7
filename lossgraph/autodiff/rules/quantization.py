"""Quantization: the gradient of a dequantization with respect to its scale, and of a
fake quantization (quantization-aware training) with the straight-through estimator.

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

**No straight-through estimator by default.** In a quantized model a float weight ``w``
reaches DequantizeLinear through ``QuantizeLinear`` (q = saturate(round(w / s) + z)), whose
output is an integer: the derivative with respect to ``w`` is zero almost everywhere and
undefined at the rounding steps. Quantization-aware fine-tuning instead treats the pair
``DequantizeLinear(QuantizeLinear(w))`` as the identity on ``w`` inside the representable
range (a straight-through estimator). That is a modelling choice, not the gradient, so
lossgraph makes it only when asked: a weight that reaches the loss only through a
QuantizeLinear is a :class:`~lossgraph.errors.NoGradientError` naming it, and
:class:`~lossgraph.passes.StraightThroughQuantization` rewrites each pair into one node of
the model-local function ``lossgraph.FakeQuantizeLinear`` (its body the pair itself), whose
rule is the estimator torch's FakeQuantize uses::

    FakeQuantizeLinear(w, s, z) = y = DequantizeLinear(QuantizeLinear(w, s, z), s, z)
        inside = qmin <= round(w / s) + z <= qmax        (per element, s and z broadcast
                                                          as the pair's granularity says;
                                                          qmin, qmax of z's integer type)
        dw = dy inside                                   (torch.fake_quantize_per_tensor_affine
                                                          and ..._per_channel_affine)
        ds = sum of dy (y - w inside) / s over the elements each scale multiplies:
             round(w / s) - w / s inside, (qmin - z) or (qmax - z) outside (torch's learnable
             fake quantization, LSQ, with grad_factor 1)
        dz: none (an integer)

The scales get their exact gradient.

``QuantizeLinear`` alone is declared not differentiable (its output is rounded).
"""

from __future__ import annotations

import onnx

from ...errors import UnsupportedModelError
from ...graphs import attribute_values, elem_type_name
from ..registry import grad_rule, not_differentiable

not_differentiable("QuantizeLinear", "its output is rounded; to train through a QuantizeLinear "
                   "-> DequantizeLinear pair, use the straight-through estimator: "
                   "lossgraph.passes.straight_through_quantization(model)")

__all__ = ["FAKE_QUANTIZE_DOMAIN", "FAKE_QUANTIZE", "INTEGER_RANGES"]

#: The domain and name of the fake quantization that
#: :class:`~lossgraph.passes.StraightThroughQuantization` writes (a model-local function).
FAKE_QUANTIZE_DOMAIN = "lossgraph"
FAKE_QUANTIZE = "FakeQuantizeLinear"

#: (qmin, qmax) of the integer types a QuantizeLinear produces.
INTEGER_RANGES: dict[int, tuple[int, int]] = {
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT4: (-8, 7),
    onnx.TensorProto.UINT4: (0, 15),
}


@grad_rule("DequantizeLinear", nondiff=(0, 2),
           notes="the scale's exact gradient (per tensor, per axis, blocked); the integer "
                 "input and zero point have none (straight-through: "
                 "lossgraph.passes.StraightThroughQuantization)")
def dequantize_linear(g, node, dy):
    x, scale = node.inputs[:2]
    ones = g.filled(g.Shape(scale), 1, scale, hint="unit_scale")
    attributes = attribute_values(node.proto)
    difference = g.DequantizeLinear(x, ones, *([node.input(2)] if node.input(2) else []),
                                    hint="x_minus_zero_point", **attributes)  # x - z
    return node.grads(None, _sum_per_scale(g, node, g.Mul(dy, difference), x, scale))


@grad_rule(FAKE_QUANTIZE, domain=FAKE_QUANTIZE_DOMAIN, nondiff=(2,), constant=(1,),
           notes="straight-through estimator: dw = dy inside the representable range, the "
                 "scale's gradient as torch's learnable fake quantization (LSQ)")
def fake_quantize_linear(g, node, dy):
    w, scale = node.inputs[:2]
    zero_point = node.input(2)
    y = node.outputs[0]
    name = node.name or "<unnamed>"
    elem_type = g.elem_type(zero_point) if zero_point else node.attr(
        "output_dtype", onnx.TensorProto.UINT8) or onnx.TensorProto.UINT8
    if elem_type not in INTEGER_RANGES:
        raise UnsupportedModelError(
            f"No straight-through gradient for {FAKE_QUANTIZE} node {name!r}: it quantizes "
            f"to {elem_type_name(elem_type)}, not to an integer type "
            f"({', '.join(elem_type_name(t) for t in INTEGER_RANGES)}).")
    qmin, qmax = INTEGER_RANGES[elem_type]
    attributes = {k: v for k, v in attribute_values(node.proto).items()
                  if k in ("axis", "block_size")}
    # s and z per element of w, broadcast by the ops themselves (per tensor, axis, block):
    # DequantizeLinear(1, s) = s, QuantizeLinear(0, s, z) = z
    ones = g.filled(g.Shape(w), 1, w, hint="ones")
    unit = g.Cast(ones, to=onnx.TensorProto.INT32, hint="unit")
    scales = g.DequantizeLinear(unit, scale, hint="scale_per_element", **attributes)
    scales = g.Cast(scales, to=g.elem_type(w)) if g.elem_type(scale) != g.elem_type(w) \
        else scales
    level = g.Round(g.Div(w, scales), hint="level")  # round(w / s), half to even
    if zero_point:
        zeros = g.filled(g.Shape(w), 0, w, hint="zeros")
        points = g.QuantizeLinear(zeros, scale, zero_point, hint="zero_point_per_element",
                                  **attributes)
        level = g.Add(level, g.Cast(points, to=g.elem_type(w)))
    inside = g.mask(g.And(g.Not(g.Less(level, g.const_like(qmin, w, "qmin"))),
                          g.Not(g.Greater(level, g.const_like(qmax, w, "qmax")))), w,
                    hint="inside")
    dw = g.Mul(dy, inside, hint="straight_through")
    ds = None
    if scale in node.wanted:
        # LSQ: (y - w) / s inside, (q - z) = y / s outside
        steps = g.Div(g.Sub(y, g.Mul(w, inside)), scales)
        ds = _sum_per_scale(g, node, g.Mul(dy, steps), w, scale)
    return node.grads(dw, ds)


def _sum_per_scale(g, node, product: str, x: str, scale: str) -> str:
    """``product`` (shaped like ``x``) summed over the elements each scale of ``scale``
    multiplies (the node's granularity: per tensor, per axis, blocked), in the scale's
    type."""
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
    if g.elem_type(node.outputs[0]) != g.elem_type(scale):
        grad = g.Cast(grad, to=g.elem_type(scale))
    return grad


def _sum_blocks(g, node, product: str, x: str, axis: int, block: int) -> str:
    """``product`` (shaped like x) summed over each block of ``block`` elements along
    ``axis``: the last block zero-padded to whole, the axis split in (blocks, block)."""
    size = (g.shape(x) or [None] * (axis + 1))[axis]
    if not isinstance(size, int):
        raise UnsupportedModelError(
            f"The gradient of blocked {node.op_type} node {node.name or '<unnamed>'!r} "
            f"needs the static size of axis {axis} of {x!r}; shape inference found "
            f"{g.shape(x)}.")
    rank = g.rank(x)
    blocks = -(-size // block)
    if blocks * block != size:
        pads = [0] * (2 * rank)
        pads[rank + axis] = blocks * block - size
        product = g.Pad(product, g.ints(pads, "pads"), mode="constant")
    split = g.Reshape(product, g.shape_around(x, axis, g.ints([blocks, block], "shape")))
    return g.reduce("ReduceSum", split, [axis + 1], keepdims=0)
