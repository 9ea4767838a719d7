"""Convolutions, pooling and normalizations.

    Conv(x, W, b)            dx = ConvTranspose(dy, W) (same strides, pads, dilations, group;
                                  output_padding from static shapes; spatial dims known at
                                  run time only: no end pads, s - 1 output padding, cut to
                                  x's size)
                             dW = Conv(x^T, dy^T) with strides and dilations swapped, batch as
                                  channels (grouped: x reshaped to (C/G, G*N, ...)), cropped
                                  to the kernel and transposed back
                             db = ReduceSum(dy, all axes but 1)
                             (auto_pad SAME_* with a stride above 1 on dims known at run time
                             only: its pads computed at run time, dx sliced from the uncropped
                             transpose, dW from x padded explicitly)
    ConvTranspose(x, W, b)   y = the full output ((in - 1) s + (k - 1) d + 1 + output_padding)
                                  cropped by the pads; auto_pad SAME_* (out = in s) and
                                  output_shape give the pads as onnxruntime resolves them
                                  (an output_shape past the full output appends zeros)
                             dx = Conv(dy, W) (same attributes: it is Conv's adjoint), cut to
                                  x's size where output padding or zeros reach a stride
                             dW = the Conv weight gradient with input dy and output grad x
                             db = ReduceSum(dy, all axes but 1)
    MaxPool(x)               dx = ScatterElements(0, Indices, dy, reduction=add), Indices
                                  from MaxPool(x) recomputed with its second output;
                                  windows that tile x (kernel = strides, no pads): dy to
                                  each window's first maximum (ArgMax over the window laid
                                  out as a last axis, the node's Indices where it outputs
                                  them) by MaxUnpool
    AveragePool(x)           dx = ConvTranspose(dy / count, ones kernel), per channel
                                  (count = the taps of each window inside x, or with
                                  count_include_pad=1 inside x and its pads: prod(kernel)
                                  but for a ceil_mode window past the end pad, as the
                                  specification, torch and onnxruntime 1.32 divide; spatial
                                  dims known at run time only: counted by a Conv of ones)
    GlobalAveragePool(x)     dx = Expand(dy, Shape(x)) / (number of spatial elements)
    GlobalMaxPool(x)         dx = dy * (x == y)
    BatchNormalization       inference: y = scale xh + B, xh = (x - mean) inv,
                                        inv = (var + eps)^-1/2
                                        dx = dy scale inv
                                        dmean = -sum(dy) scale inv
                                        dvar = -sum(dy xh) scale inv^2 / 2
                             training (training_mode=1; before opset 14, more than one
                             output):
                                        dx = inv (dxh - mean(dxh) - xh mean(dxh xh)),
                                        dxh = dy scale, xh = (x - mu) inv, batch statistics
                                        mu and s2 (biased), recomputed from x;
                                        running_mean = m mean + (1 - m) mu and
                                        running_var = m var + (1 - m) s2 add
                                        dx += (1 - m) (drm + 2 drv (x - mu)) / n,
                                        dmean = m drm, dvar = m drv
                             dscale = sum(dy xh), dB = sum(dy) over all axes but 1
    lossgraph.BatchNormalizationTraining(x, scale, B) -> (y, mu, s2)
                             a training-mode BatchNormalization as training programs run it
                             (lossgraph.passes.RunningStatistics, a model-local function):
                             dx, dscale, dB as in training mode, with the forward's mu and
                             s2; dx += (dmu + 2 ds2 (x - mu)) / n
    InstanceNormalization    as training BatchNormalization, statistics over spatial axes
    LayerNormalization       as above, statistics over axes [axis, rank);
                             dScale = sum(dy xh), dB = sum(dy) summed to their shapes;
                             outputs Mean and InvStdDev (= inv) add
                             dx += (dMean - dInvStdDev inv^2 xh) / n
    GroupNormalization       as above, statistics over (C/G, spatial) of each group
                             (opset 21: scale and bias per channel)
    LpNormalization(x)       y = x / n, n = ||x||_p along axis:
                             dx = (dy - s sum(dy y)) / n, s = sign(x) (p=1) or y (p=2)
    MaxUnpool(x, I)          y.flat[I_j] = x_j (zeros elsewhere): dx_j = dy.flat[I_j], to the
                             element whose write survives where I repeats (the last one, as
                             the reference implementation and onnxruntime write in order:
                             found by ScatterElements(positions, reduction=max), or before
                             opset 18 by a plain ScatterElements, which onnxruntime applies
                             in order too)
    Col2Im(x, image, block)  y sums the columns of x onto the image (torch's fold); its
                             adjoint cuts the image into the columns again (unfold):
                             dx[n, c K + k, l] = dy[n, c, p(k, l)], p(k, l) the image position
                             of offset k in block l (a constant index map for constant image
                             and block shapes; 0 where it falls in the padding)
    LpPool(x; p)             y = (sum over the window of |x|^p)^(1/p):
                             dx = W^T(dy y^(1-p)) |x|^(p-1) sign(x), W^T the windows' adjoint
                                  (ConvTranspose with a ones kernel, per channel; ceil_mode
                                  by longer end pads); 0 where y = 0 (a subgradient of the
                                  norm at the origin, instead of 0 * inf)
    LRN(x; a, b, k, n)       y = x d^-b, d = k + a/n S, S = B(x^2) the sum of squares over the
                             channel window (B a constant band matrix, static C):
                             dx = dy d^-b - 2 a b / n x B^T(dy x d^(-b-1))
"""

from __future__ import annotations

import math
import re

import numpy as np
from onnx import numpy_helper

from ...errors import InvalidModelError, UnsupportedModelError
from ...graphs import attribute_values
from ..registry import grad_rule

__all__ = ["TRAINING_BATCH_NORM", "TRAINING_BATCH_NORM_DOMAIN"]

#: The domain and name of the model-local function that
#: :class:`~lossgraph.passes.RunningStatistics` writes for a training-mode
#: BatchNormalization: ``y, mean, var = lossgraph.BatchNormalizationTraining(x, scale, B)``.
TRAINING_BATCH_NORM_DOMAIN = "lossgraph"
TRAINING_BATCH_NORM = "BatchNormalizationTraining"


# ----------------------------------------------------------------------- helpers
def _static(g, name: str, what: str) -> tuple[int, ...]:
    """The static spatial dims (axes 2 and on) of ``name``."""
    shape = g.shape(name)
    if shape is None or not all(isinstance(d, int) and d > 0 for d in shape[2:]):
        raise UnsupportedModelError(
            f"The gradient of {what} needs the static spatial shape of {name!r}; shape "
            f"inference found {shape}. Give the model's inputs static spatial dims."
        )
    return tuple(shape[2:])


def _spatial(g, name: str, what: str) -> list[int | None]:
    """The spatial dims (axes 2 and on) of ``name``: an int where shape inference found
    one, ``None`` where only the run time knows it."""
    shape = g.shape(name)
    if shape is None:
        raise UnsupportedModelError(
            f"The gradient of {what} needs the rank of {name!r}; shape inference found "
            "none. Give the model's inputs static ranks.")
    return [d if isinstance(d, int) and d > 0 else None for d in shape[2:]]


def _known(*dims: list[int | None]) -> bool:
    return all(d is not None for sizes in dims for d in sizes)


def _channels(g, name: str, what: str) -> int:
    shape = g.shape(name)
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        raise UnsupportedModelError(
            f"The gradient of {what} needs the static channel count of {name!r} (got {shape})."
        )
    return shape[1]


def _check_channels(g, node, x: str, w: str, axis: int, group: int) -> None:
    """``x``'s channels are what weight ``w`` takes (its dim ``axis`` times ``group`` for a
    Conv, its dim 0 for a ConvTranspose), where both are static: onnx's checker does not
    compare them, and onnxruntime refuses to run the node otherwise."""
    x_shape, w_shape = g.shape(x), g.shape(w)
    if not x_shape or len(x_shape) < 2 or not w_shape or len(w_shape) <= axis:
        return
    channels, taken = x_shape[1], w_shape[axis]
    if isinstance(channels, int) and isinstance(taken, int) \
            and channels != taken * (group if axis == 1 else 1):
        per = f" x group {group}" if axis == 1 and group != 1 else ""
        raise InvalidModelError(
            f"{node.op_type} node {node.name or node.outputs[0]!r} reads {x!r} with "
            f"{channels} channels, but its weight {w!r} of shape {tuple(w_shape)} takes "
            f"{taken}{per}: the model is not valid ONNX, and onnxruntime refuses to run it. "
            "Fix the input's declared shape or the weight.")


def _window(g, node, x: str, kernel: list[int], at_run_time: bool = False
            ) -> tuple[list[int], list[int] | None, list[int]]:
    """Explicit (strides, pads, dilations) of a sliding-window node, auto_pad resolved.

    SAME_* pads by ``total = (ceil(size / s) - 1) s + (k - 1) d + 1 - size`` (at least 0),
    the odd one at the end (UPPER) or the beginning (LOWER); with stride 1 that is
    ``(k - 1) d`` whatever the size, so only strides above 1 need static sizes; where they
    are not static, the pads are ``None`` for a caller that computes them ``at_run_time``
    (:func:`_same_pads`), an error otherwise."""
    n = len(kernel)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        pads = list(node.attr("pads", [0] * 2 * n))
    elif auto_pad == "VALID":
        pads = [0] * 2 * n
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        sizes = _spatial(g, x, node.op_type)
        begin, end = [], []
        for size, k, s, d in zip(sizes, kernel, strides, dilations):
            if s == 1:
                total = (k - 1) * d
            elif size is None and at_run_time:
                return strides, None, dilations
            elif size is None:
                raise UnsupportedModelError(
                    f"The gradient of {node.op_type} node {node.name or '<unnamed>'!r} with "
                    f"auto_pad {auto_pad} and stride {s} needs the static spatial dims of "
                    f"{x!r}: its pads depend on them; shape inference found {g.shape(x)}. "
                    "Give the model's inputs static spatial dims, or pad explicitly.")
            else:
                total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else large)
            end.append(large if auto_pad == "SAME_UPPER" else small)
        pads = begin + end
    else:
        raise UnsupportedModelError(f"Unknown auto_pad {auto_pad!r} on {node.op_type}.")
    return strides, pads, dilations


def _same_pads(g, node, x: str, kernel: list[int], strides: list[int], dilations: list[int]
               ) -> str:
    """auto_pad SAME_*'s pads of x's spatial dims, computed at run time: an int64 tensor
    ``[0, 0, begins..., 0, 0, ends...]`` (the form Pad takes)."""
    n = len(kernel)
    sizes = g.dims(x, 2, 2 + n)
    step = g.ints(strides, "strides")
    out = g.Div(g.Sub(g.Add(sizes, step), g.ints([1] * n, "one")), step)  # ceil(size / s)
    reach = g.ints([(k - 1) * d + 1 for k, d in zip(kernel, dilations)], "reach")
    total = g.Max(g.Sub(g.Add(g.Mul(g.Sub(out, g.ints([1] * n, "one")), step), reach), sizes),
                  g.ints([0] * n, "zero"))
    small = g.Div(total, g.ints([2] * n, "two"))
    large = g.Sub(total, small)
    begin, end = (small, large) if node.attr("auto_pad") == "SAME_UPPER" else (large, small)
    none = g.ints([0, 0], "no_pads")
    return g.Concat(none, begin, none, end, axis=0, hint="same_pads")


def _conv_grads_with_pads_at_run_time(g, node, dy: str, kernel, strides, dilations, group
                                      ) -> tuple[str, str]:
    """(dx, dW) of a Conv whose pads are known at run time only (auto_pad SAME_* with a
    stride above 1 on dims known at run time). dx: the uncropped transpose, with ``s - 1``
    output padding (at least ``begin + size`` long), sliced from the begin pads; dW: the
    weight gradient of x padded explicitly."""
    x, w = node.inputs[:2]
    n = len(kernel)
    pads = _same_pads(g, node, x, kernel, strides, dilations)
    padding = [s - 1 for s in strides]
    full = g.ConvTranspose(dy, w, strides=strides, dilations=dilations,
                           group=group if group != 1 else None,
                           output_padding=padding if any(padding) else None, hint="conv_dx")
    begin = g.Slice(pads, g.ints([2], "start"), g.ints([2 + n], "end"))
    dx = g.Slice(full, begin, g.Add(begin, g.dims(x, 2, 2 + n)), g.ints(list(range(2, n + 2))))
    padded = g.Pad(x, pads, mode="constant")
    w_shape = [g.shape(w)[0], g.shape(w)[1], *kernel]
    channels = _channels(g, x, "Conv") if group != 1 else None
    dw = _conv_weight_grad(g, padded, dy, w_shape, [None] * n, [None] * n, channels, strides,
                           [0] * 2 * n, dilations, group)
    return dx, dw


def _transpose_pads(g, node, x: str, kernel: list[int], strides: list[int],
                    dilations: list[int]) -> list[int]:
    """The pads a ConvTranspose node crops its full output by, auto_pad and output_shape
    resolved as onnxruntime (1.19 and 1.32, measured) and the specification resolve them.

    The full output is ``F = (in - 1) s + (k - 1) d + 1 + output_padding`` long; a
    requested size ``out`` (output_shape, or ``in s`` for auto_pad SAME_*) crops
    ``total = F - out``: ``total // 2`` at the beginning for SAME_UPPER, ``total - total //
    2`` otherwise, the rest at the end. A negative total (an output_shape past the full
    output) appends zeros: begin pad 0, end pad ``total`` (below 0)."""
    n = len(kernel)
    name = node.name or "<unnamed>"
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    output_shape = node.attr("output_shape")
    padding = list(node.attr("output_padding", [0] * n))
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise UnsupportedModelError(f"Unknown auto_pad {auto_pad!r} on ConvTranspose.")
    if output_shape is None:
        if auto_pad == "NOTSET":
            return list(node.attr("pads", [0] * 2 * n))
        if auto_pad == "VALID":
            return [0] * 2 * n
    full = [(k - 1) * d + 1 + p for k, d, p in zip(kernel, dilations, padding)]
    if output_shape is not None:
        requested = list(output_shape)[-n:]
        sizes = _spatial(g, x, "ConvTranspose")
        if not _known(sizes):
            raise UnsupportedModelError(
                f"The gradient of ConvTranspose node {name!r} with output_shape "
                f"{list(output_shape)} needs the static spatial dims of {x!r}: the pads it "
                f"implies depend on them; shape inference found {g.shape(x)}.")
        totals = [(size - 1) * s + f - out
                  for size, s, f, out in zip(sizes, strides, full, requested)]
        if any(-t >= s for t, s in zip(totals, strides)):
            raise UnsupportedModelError(
                f"No gradient for ConvTranspose node {name!r} with output_shape "
                f"{list(output_shape)}: it lies a stride or more past the full output "
                f"({[(size - 1) * s + f for size, s, f in zip(sizes, strides, full)]}), "
                "which onnxruntime 1.32 rejects and onnxruntime 1.19 fills in scrambled "
                "order. Request at most stride - 1 more than the full output.")
    else:  # auto_pad SAME_*: out = in s, whatever in is
        totals = [f - s for f, s in zip(full, strides)]
        if any(padding) or any(t < 0 for t in totals):
            raise UnsupportedModelError(
                f"No gradient for ConvTranspose node {name!r} with auto_pad {auto_pad}, "
                f"strides {strides} and output_padding {padding}: its output is not input "
                "size times stride in onnxruntime (the full output, uncropped), while the "
                "specification and onnx's shape inference say it is; their shapes differ. "
                "Give the node explicit pads, or an output_shape.")
    begin = [0 if t < 0 else t // 2 if auto_pad == "SAME_UPPER" else t - t // 2
             for t in totals]
    return [*begin, *(t - b for t, b in zip(totals, begin))]


def _output_padding(sizes, out_sizes, kernel, strides, pads, dilations) -> list[int]:
    """ConvTranspose output_padding that maps ``out_sizes`` back onto ``sizes`` exactly."""
    n = len(kernel)
    return [
        sizes[i] - ((out_sizes[i] - 1) * strides[i] - pads[i] - pads[n + i]
                    + (kernel[i] - 1) * dilations[i] + 1)
        for i in range(n)
    ]


def _all_but_channel(g, x: str) -> list[int]:
    return [0, *range(2, g.rank(x))]


def _with_spatial(g, lead: list[int], like: str, sizes: list[int | None]) -> str:
    """The shape ``lead`` followed by the spatial dims of ``like`` (``sizes``, from the
    run time where unknown)."""
    if _known(sizes):
        return g.ints([*lead, *sizes], "shape")
    return g.Concat(g.ints(lead, "shape"), g.dims(like, 2, 2 + len(sizes)), axis=0)


def _crop(g, value: str, like: str, sizes: list[int | None]) -> str:
    """``value`` cut to the spatial dims of ``like`` (``sizes``), from the start."""
    n = len(sizes)
    ends = g.ints(sizes, "ends") if _known(sizes) else g.dims(like, 2, 2 + n)
    return g.Slice(value, g.ints([0] * n, "starts"), ends, g.ints(list(range(2, n + 2))))


def _conv_input_grad(g, dy: str, w: str, x: str, sizes, out_sizes, kernel, strides, pads,
                     dilations, group) -> str:
    """dx of Conv(x, W): ConvTranspose(dy, W) with the Conv's strides, pads and dilations.

    Static sizes give the output_padding that lands on x's size exactly. Sizes known at
    run time only: the end pads dropped and ``s - 1`` output padding make the transpose at
    least as long as x (x's size is at most ``(out - 1) s + (k - 1) d + 1 - begin + s -
    1``); it is cut to x's."""
    n = len(kernel)
    common = dict(strides=strides, dilations=dilations, group=group if group != 1 else None,
                  hint="conv_dx")
    if _known(sizes, out_sizes):
        padding = _output_padding(sizes, out_sizes, kernel, strides, pads, dilations)
        return g.ConvTranspose(dy, w, pads=pads,
                               output_padding=padding if any(padding) else None, **common)
    padding = [s - 1 for s in strides]
    longer = g.ConvTranspose(dy, w, pads=[*pads[:n], *[0] * n],
                             output_padding=padding if any(padding) else None, **common)
    return _crop(g, longer, x, sizes)


def _conv_weight_grad(g, x: str, dy: str, w_shape, sizes, out_sizes, channels, strides, pads,
                      dilations, group) -> str:
    """dW of Conv(x, W) (W shaped ``w_shape``) for the output gradient ``dy``.

    ``sizes``/``out_sizes`` are the spatial dims of x and dy (``None`` where known at run
    time only), ``channels`` x's channels; every end pad at least 0.
    """
    n = len(w_shape) - 2
    kernel = list(w_shape[2:])
    spatial = list(range(2, n + 2))
    if group == 1:
        xt = g.Transpose(x, perm=[1, 0, *spatial])
    else:
        cg = channels // group
        xt = g.Reshape(x, _with_spatial(g, [0, group, cg], x, sizes))
        xt = g.Transpose(xt, perm=[2, 1, 0, *range(3, n + 3)])
        xt = g.Reshape(xt, _with_spatial(g, [cg, -1], x, sizes))
    dyt = g.Transpose(dy, perm=[1, 0, *spatial])
    grad = g.Conv(xt, dyt, strides=dilations, dilations=strides, pads=pads,
                  group=group if group != 1 else None, hint="conv_dw")
    got = [(sizes[i] + pads[i] + pads[n + i] - ((out_sizes[i] - 1) * strides[i] + 1))
           // dilations[i] + 1 for i in range(n)] if _known(sizes, out_sizes) else None
    if got != kernel:  # at least the kernel: the forward's windows fit
        grad = g.Slice(grad, g.ints([0] * n, "starts"), g.ints(kernel, "ends"),
                       g.ints(spatial, "axes"))
    return g.Transpose(grad, perm=[1, 0, *spatial])


def _bias_grad(g, dy: str, like: str) -> str:
    return g.reduce("ReduceSum", dy, _all_but_channel(g, like), keepdims=0)


def _kernel(g, node, w: str) -> list[int]:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        shape = g.shape(w)
        if shape is None or not all(isinstance(d, int) for d in shape[2:]):
            raise UnsupportedModelError(f"The kernel shape of {node.op_type} is unknown.")
        kernel = shape[2:]
    return list(kernel)


# ------------------------------------------------------------------ convolutions
@grad_rule("Conv")
def conv(g, node, dy):
    x, w = node.inputs[:2]
    group = node.attr("group", 1)
    _check_channels(g, node, x, w, 1, group)
    kernel = _kernel(g, node, w)
    strides, pads, dilations = _window(g, node, x, kernel, at_run_time=True)
    if pads is None:
        dx, dw = _conv_grads_with_pads_at_run_time(g, node, dy, kernel, strides, dilations,
                                                   group)
        return node.grads(dx, dw, _bias_grad(g, dy, x) if node.input(2) else None)
    sizes, out_sizes = _spatial(g, x, "Conv"), _spatial(g, node.outputs[0], "Conv")
    dx = _conv_input_grad(g, dy, w, x, sizes, out_sizes, kernel, strides, pads, dilations,
                          group)
    w_shape = [g.shape(w)[0], g.shape(w)[1], *kernel]
    channels = _channels(g, x, "Conv") if group != 1 else None
    dw = _conv_weight_grad(g, x, dy, w_shape, sizes, out_sizes, channels, strides, pads,
                           dilations, group)
    return node.grads(dx, dw, _bias_grad(g, dy, x) if node.input(2) else None)


@grad_rule("ConvTranspose", notes="auto_pad and output_shape resolved as onnxruntime does "
                                  "(output_shape: static spatial dims)")
def conv_transpose(g, node, dy):
    x, w = node.inputs[:2]
    y = node.outputs[0]
    _check_channels(g, node, x, w, 0, node.attr("group", 1))
    kernel = _kernel(g, node, w)
    n = len(kernel)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = _transpose_pads(g, node, x, kernel, strides, dilations)
    # appended zeros (an end pad below 0) carry no gradient: Conv reads no pad there
    conv_pads = [*pads[:n], *(max(p, 0) for p in pads[n:])]
    group = node.attr("group", 1)
    sizes, out_sizes = _spatial(g, x, "ConvTranspose"), _spatial(g, y, "ConvTranspose")
    # ConvTranspose(x, W) is the adjoint of Conv(., W): dx = Conv(dy, W), which is
    # (output_padding + appended zeros) // stride longer than x where those reach a stride
    dx = g.Conv(dy, w, strides=strides, pads=conv_pads, dilations=dilations,
                group=group if group != 1 else None, hint="convt_dx")
    padding = list(node.attr("output_padding", [0] * n))
    if any((padding[i] + max(-pads[n + i], 0)) // strides[i] for i in range(n)):
        dx = _crop(g, dx, x, sizes)
    w_shape = g.shape(w)
    # dW is Conv's weight gradient with dy as the input and x as the output gradient
    channels = _channels(g, y, "ConvTranspose") if group != 1 else None
    dw = _conv_weight_grad(g, dy, x, [w_shape[0], w_shape[1], *kernel], out_sizes, sizes,
                           channels, strides, conv_pads, dilations, group)
    return node.grads(dx, dw, _bias_grad(g, dy, x) if node.input(2) else None)


# ----------------------------------------------------------------------- pooling
@grad_rule("MaxPool", notes="gradient to the argmax (MaxPool Indices); overlapping windows "
                            "need opset 16+")
def max_pool(g, node, dy, *_):
    (x,) = node.inputs
    attrs = attribute_values(node.proto)
    attrs.pop("storage_order", None)  # row-major indices
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * len(kernel)))
    dilations = list(attrs.get("dilations", [1] * len(kernel)))
    overlapping = any((k - 1) * d + 1 > s for k, s, d in zip(kernel, strides, dilations))
    if overlapping and g.opset < 16:
        raise UnsupportedModelError(
            "The gradient of MaxPool with overlapping windows needs ScatterElements "
            f"reduction='add' (opset 16+); the model's opset is {g.opset}.")
    tiled = _tiled_windows(g, x, attrs)
    if tiled is not None:
        return _max_pool_tiled_grad(g, x, dy, tiled, node)
    _, indices = g.MaxPool(x, outputs=2, hint="maxpool_argmax", **attrs)
    flat = g.ints([-1], "flat")
    zeros = g.filled(g.Reshape(g.Size(x), g.ints([1], "one_dim")), 0, x, hint="zeros",
                     run_time=(indices, dy))
    dx = g.ScatterElements(zeros, g.Reshape(indices, flat), g.Reshape(dy, flat), axis=0,
                           reduction="add" if g.opset >= 16 else None, hint="maxpool_dx")
    return g.Reshape(dx, g.Shape(x))


def _tiled_windows(g, x: str, attrs: dict) -> tuple[list[int], list[int]] | None:
    """(kernel, x's spatial dims) when the MaxPool's windows tile x without overlap or
    padding (kernel = strides, no dilation, no pads, floor mode: a remainder at the end of
    an axis is in no window), x's spatial dims are static and x is float or double; else
    None."""
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    if (list(attrs.get("strides", [1] * n)) != kernel
            or any(d != 1 for d in attrs.get("dilations", [1] * n))
            or any(attrs.get("pads", [0] * 2 * n)) or attrs.get("ceil_mode", 0)
            or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "", "VALID")
            or g.dtype(x) not in (np.float32, np.float64)):
        return None
    sizes = _spatial(g, x, "MaxPool")
    if not _known(sizes) or any(s < k for s, k in zip(sizes, kernel)):
        return None
    return kernel, sizes


def _max_pool_tiled_grad(g, x: str, dy: str, tiled: tuple[list[int], list[int]], node) -> str:
    """dx of a MaxPool whose windows tile x (:func:`_tiled_windows`): ``dy`` written to the
    first maximum of each window in row-major order (torch's choice among ties, and
    onnxruntime's MaxPool Indices'), zeros elsewhere.

    Where the node outputs its Indices (storage_order 0), ``MaxUnpool`` writes through them.
    Else each window's elements are laid out as a last axis (``Reshape``, ``Transpose``),
    ``ArgMax`` finds the first maximum of each (it takes the first of equal values),
    ``MaxUnpool`` writes ``dy`` there in that layout (the position of element ``a`` of
    window ``w`` is ``w K + a``: no index arithmetic), and the layout is transposed back.
    Measured (64x16x28x28 -> 14x14, one thread, onnxruntime 1.19 and 1.32): about 1.8 ms
    against 4.3 ms for the MaxPool Indices and ``ScatterElements`` form, which onnxruntime
    computes 7x slower than the pooling itself (3.2 ms against 0.46 ms); positions in x's
    layout instead (a ``Gather`` of each offset) took 0.3 ms more, one-hot masks
    (``OneHot``, or ``Equal`` and ``Cast``) 3.7-4.7x as long as ``MaxUnpool``. Double,
    which onnxruntime's MaxUnpool lacks, writes by ``ScatterElements``.
    """
    kernel, sizes = tiled
    n = len(kernel)
    if len(node.outputs) > 1 and node.outputs[1] and node.attr("storage_order", 0) == 0:
        return _write_at(g, dy, node.outputs[1], g.Shape(x), kernel, x)
    counts = [s // k for s, k in zip(sizes, kernel)]
    covered = [c * k for c, k in zip(counts, kernel)]
    elements = int(np.prod(kernel))
    inside = x
    if covered != sizes:  # floor mode: the remainder of each axis is in no window
        inside = g.Slice(x, g.ints([0] * n, "starts"), g.ints(covered, "ends"),
                         g.ints(list(range(2, n + 2)), "axes"))
    split = [d for c, k in zip(counts, kernel) for d in (c, k)]
    windows = g.Reshape(inside, g.ints([0, 0, *split], "windows"))
    windows = g.Transpose(windows, perm=[0, 1, *range(2, 2 + 2 * n, 2), *range(3, 3 + 2 * n, 2)])
    windows = g.Reshape(windows, g.ints([0, 0, -1, elements], "windows"))
    first = g.ArgMax(windows, axis=-1, keepdims=0, hint="window_argmax")  # (N, C, windows)
    starts = g.Mul(g.Range(g.const(0, np.int64, "zero"), g.Size(first),
                           g.const(1, np.int64, "one")),
                   g.const(elements, np.int64, "window_size"))
    positions = g.Add(g.Reshape(starts, g.Shape(first)), first, hint="maxpool_positions")
    layout = g.Concat(g.dims(x, 0, 2), g.ints([int(np.prod(counts)) * elements], "size"),
                      axis=0)  # (N, C, windows K): the windows' elements, window by window
    flat_dy = g.Reshape(dy, g.ints([0, 0, -1], "windows"))
    written = _write_at(g, flat_dy, positions, layout, [elements], x)
    written = g.Reshape(written, g.ints([0, 0, *counts, *kernel], "windows"))
    interleaved = [0, 1, *(axis for i in range(n) for axis in (2 + i, 2 + n + i))]
    dx = g.Reshape(g.Transpose(written, perm=interleaved), g.ints([0, 0, *covered], "shape"))
    if covered != sizes:
        ends = [s - c for s, c in zip(sizes, covered)]
        dx = g.Pad(dx, g.ints([0] * (n + 2) + [0, 0, *ends], "pads"))
    return dx


def _write_at(g, values: str, positions: str, shape: str, kernel: list[int], like: str
              ) -> str:
    """Zeros of ``shape`` with ``values`` written at the flat ``positions`` (each once), for
    a MaxPool of ``kernel`` over a tensor of ``like``'s element type: ``MaxUnpool`` (float),
    or ``ScatterElements`` (double: onnxruntime's MaxUnpool has no double kernel)."""
    if g.dtype(like) == np.float32:
        written = g.MaxUnpool(values, positions, shape, kernel_shape=kernel, strides=kernel,
                              hint="maxpool_dx")
    else:
        flat = g.ints([-1], "flat")
        zeros = g.filled(g.Reshape(g.ReduceProd(shape, keepdims=1), g.ints([1], "one_dim")),
                         0, like, hint="zeros", run_time=(positions, values))
        written = g.ScatterElements(zeros, g.Reshape(positions, flat),
                                    g.Reshape(values, flat), axis=0, hint="maxpool_dx")
    return g.Reshape(written, shape)  # the shape for shape inference (no copy)


#: Plain onnxruntime from this minor release on averages a ceil_mode window that runs past
#: the end pad as the specification and torch do, with count_include_pad=1 (measured: 1.32.0
#: does; 1.19.2, training build and plain, divides it by the whole kernel).
_SPECIFIED_CEIL_AVERAGE_SINCE = 32


def _target_averages_ceil_windows_as_specified(g) -> bool:
    match = re.fullmatch(r"onnxruntime-1\.(\d+)", g.target.name)
    return match is not None and int(match[1]) >= _SPECIFIED_CEIL_AVERAGE_SINCE


def _window_divisors(sizes, out_sizes, kernel, strides, pads, dilations, include_pad: bool
                     ) -> tuple[np.ndarray, bool, bool]:
    """(each pooling window's divisor, whether a window starts in the end pad, whether a
    window runs past the end pad).

    The divisor counts the window's taps inside x; with ``include_pad`` inside x and its
    pads, so that a ceil_mode window running past the end pad counts only the taps before
    it (the specification, torch and onnxruntime 1.32; onnxruntime 1.19 divides that one
    by the whole kernel)."""
    n = len(kernel)
    counts = np.ones((), dtype=np.float64)
    in_pad = past_end = False
    for i, (size, out, k, s, d) in enumerate(zip(sizes, out_sizes, kernel, strides, dilations)):
        begin, end = pads[i], pads[n + i]
        starts = np.arange(out) * s - begin
        taps = starts[:, None] + np.arange(k)[None, :] * d
        low, high = (-begin, size + end) if include_pad else (0, size)
        counts = np.multiply.outer(counts, ((taps >= low) & (taps < high)).sum(axis=1))
        in_pad = in_pad or bool((starts >= size).any())
        past_end = past_end or bool((taps >= size + end).any())
    return counts, in_pad, past_end


@grad_rule("AveragePool", notes="ceil_mode and count_include_pad as the specification and "
                                "torch average (count_include_pad=1 with a window past the "
                                "end pad: target onnxruntime-1.32 or later)")
def average_pool(g, node, dy):
    (x,) = node.inputs
    y = node.outputs[0]
    name = node.name or "<unnamed>"
    kernel = list(node.attr("kernel_shape"))
    strides, pads, dilations = _window(g, node, x, kernel)
    ceil = bool(node.attr("ceil_mode", 0))
    include_pad = bool(node.attr("count_include_pad", 0))
    sizes, out_sizes = _spatial(g, x, "AveragePool"), _spatial(g, y, "AveragePool")
    if _known(sizes, out_sizes):
        counts, in_pad, past_end = _window_divisors(sizes, out_sizes, kernel, strides, pads,
                                                    dilations, include_pad)
        if ceil and in_pad:
            raise UnsupportedModelError(
                f"No gradient for AveragePool node {name!r} (ceil_mode=1, input "
                f"{list(sizes)}, output {list(out_sizes)}): its last window starts in the end "
                "pad. onnx's shape inference before opset 22 and onnxruntime 1.19 keep that "
                "window (it averages no element of the input: NaN with count_include_pad=0), "
                "onnxruntime 1.32, torch and opset 22 drop it: the output shapes differ. Use "
                "pads that end within a stride of the last window, or ceil_mode=0.")
        if past_end and include_pad and not _target_averages_ceil_windows_as_specified(g):
            raise UnsupportedModelError(
                f"No gradient for AveragePool node {name!r} (ceil_mode=1, count_include_pad=1, "
                f"input {list(sizes)}, output {list(out_sizes)}) for {g.target}: its "
                "last windows run past the end pad, which onnxruntime 1.19 divides by the "
                "whole kernel, and the specification, torch and onnxruntime 1.32 by the taps "
                "inside the input and its pads: no one gradient is right on every runtime of "
                "the target. Compile for target='onnxruntime-1.32' (or later) to run there "
                "only, or use count_include_pad=0, or pad the input explicitly and use "
                "ceil_mode=0.")
        inverse = 1.0 / np.maximum(counts, 1)  # a window of pads only reads no x
        scale = inverse.flat[0] if np.all(inverse == inverse.flat[0]) else inverse[None, None]
        scaled = g.Mul(dy, g.const_like(scale, x, "inv_counts"))
    elif ceil:
        raise UnsupportedModelError(
            f"The gradient of AveragePool node {name!r} with ceil_mode=1 needs the static "
            f"spatial dims of {x!r} and {y!r}: which windows run past the input depends on "
            f"them; shape inference found {g.shape(x)} and {g.shape(y)}.")
    elif include_pad or not any(pads):
        scaled = g.Mul(dy, g.const_like(1.0 / math.prod(kernel), x, "inv_window"))
    else:  # the taps of each window inside x, at run time: a Conv of ones
        ones = g.filled(_with_spatial(g, [1, 1], x, sizes), 1, x, hint="ones")
        counts = g.Conv(ones, g.const_like(np.ones([1, 1, *kernel]), x, "ones_kernel"),
                        strides=strides, pads=pads, dilations=dilations, hint="window_counts")
        scaled = g.Div(dy, counts)
    return _window_sum_adjoint(g, scaled, x, sizes, out_sizes, kernel, strides, pads, dilations)


@grad_rule("GlobalAveragePool")
def global_average_pool(g, node, dy):
    (x,) = node.inputs
    shape = g.shape(x)
    spatial = shape[2:] if shape is not None else None
    if spatial is not None and all(isinstance(d, int) for d in spatial):
        scale = g.const_like(1.0 / math.prod(spatial), x, "inv_count")
    else:
        to = g.elem_type(x)
        scale = g.Div(g.Cast(g.Size(dy), to=to), g.Cast(g.Size(x), to=to))
    return g.Expand(g.Mul(dy, scale), g.Shape(x))


@grad_rule("GlobalMaxPool", notes="ties: every maximal element gets the gradient")
def global_max_pool(g, node, dy):
    (x,) = node.inputs
    mask = g.mask(g.Equal(x, node.outputs[0]), x)
    return g.Mul(dy, mask)


def _window_sum_adjoint(g, values: str, x: str, sizes, out_sizes, kernel, strides, pads,
                        dilations) -> str:
    """The adjoint of summing each pooling window of ``x``: every window's value in
    ``values`` (shaped like the pooled output) added back onto the positions of x it
    covered. A ones-kernel ConvTranspose per channel. With static sizes, a window past the
    end of x (ceil_mode) gets a longer end pad, which the ConvTranspose crops, and the
    positions past the last window get zeros (output padding, or a Pad past a stride);
    sizes known at run time only: no end pad and ``s - 1`` output padding, which covers
    x, cut to x's size."""
    n = len(kernel)
    begin = pads[:n]
    planes = g.Reshape(values, _with_spatial(g, [-1, 1], values, out_sizes))
    ones = g.const_like(np.ones([1, 1, *kernel]), x, "ones_kernel")
    common = dict(strides=strides, dilations=dilations, hint="window_sum_dx")
    if _known(sizes, out_sizes):
        end = [(out - 1) * s + (k - 1) * d + 1 - b - size
               for size, out, k, s, d, b in zip(sizes, out_sizes, kernel, strides, dilations,
                                                 begin)]
        short = [max(-e, 0) for e in end]  # positions past the last window: zeros
        padding = [m if m < max(s, d) else 0 for m, s, d in zip(short, strides, dilations)]
        summed = g.ConvTranspose(planes, ones, pads=[*begin, *(max(e, 0) for e in end)],
                                 output_padding=padding if any(padding) else None, **common)
        rest = [m - p for m, p in zip(short, padding)]
        if any(rest):
            summed = g.Pad(summed, g.ints([0, 0, *[0] * n, 0, 0, *rest], "pads"),
                           mode="constant")
    else:
        padding = [s - 1 for s in strides]
        summed = g.ConvTranspose(planes, ones, pads=[*begin, *[0] * n],
                                 output_padding=padding if any(padding) else None, **common)
        summed = _crop(g, summed, x, sizes)
    return g.Reshape(summed, g.Shape(x))


# ---------------------------------------------------------------- normalizations
def _normalized_grad(g, x: str, xhat: str, inv: str, dxhat: str, axes: list[int]) -> str:
    """dx of xhat = (x - mean) inv, statistics (biased) over ``axes``, given d xhat."""
    mean_d = g.reduce("ReduceMean", dxhat, axes, keepdims=1)
    mean_dx = g.reduce("ReduceMean", g.Mul(dxhat, xhat), axes, keepdims=1)
    return g.Mul(g.Sub(g.Sub(dxhat, mean_d), g.Mul(xhat, mean_dx)), inv)


def _standardize(g, x: str, axes: list[int], eps: float, like: str | None = None
                 ) -> tuple[str, str]:
    """(xhat, inv) with batch statistics over ``axes`` (``like``: a forward value of x's type)."""
    centered = g.Sub(x, g.reduce("ReduceMean", x, axes, keepdims=1))
    var = g.reduce("ReduceMean", g.Mul(centered, centered), axes, keepdims=1)
    inv = g.Reciprocal(g.Sqrt(g.Add(var, g.const_like(eps, like or x, "eps"))))
    return g.Mul(centered, inv), inv


def _per_channel(g, v: str, x: str) -> str:
    """A (C,) tensor shaped (C, 1, ..., 1) to broadcast against x (N, C, ...)."""
    rank = g.rank(x)
    return g.unsqueeze(v, list(range(1, rank - 1))) if rank > 2 else v


def _count(g, x: str, axes: list[int]) -> str:
    """The number of elements of ``x`` over ``axes``, as a scalar of x's type."""
    shape = g.shape(x)
    dims = [shape[a] for a in axes] if shape is not None else [None]
    if all(isinstance(d, int) for d in dims):
        return g.const_like(float(math.prod(dims)), x, "count")
    sizes = g.Gather(g.Shape(x), g.ints(axes, "axes"), axis=0)
    return g.Cast(g.reduce("ReduceProd", sizes, keepdims=0), to=g.elem_type(x), hint="count")


@grad_rule("BatchNormalization", constant=(3, 4),
           notes="inference and training mode (training_mode=1, or before opset 14 more than "
                 "one output: batch statistics, and the running statistics outputs); mean and "
                 "var get gradients but are not trained")
def batch_normalization(g, node, *dys):
    # before opset 14, training mode is the form with the statistics outputs
    # (y, running_mean, running_var, saved_mean, saved_var), as torch's export writes it
    training = node.attr("training_mode", 0) if node.opset >= 14 else any(node.outputs[1:])
    if any(d is not None for d in dys[3:5]):
        raise UnsupportedModelError(
            f"No gradient through the saved_mean or saved_var output of BatchNormalization node "
            f"{node.name!r} (opset {node.opset}): runtimes disagree on what they hold. Read the "
            "batch statistics from a ReduceMean of the node's input instead.")
    dy = g.or_zeros(dys[0], node.outputs[0])
    return (_batch_norm_training if training else _batch_norm_inference)(g, node, dy, dys[1:3])


def _batch_norm_inference(g, node, dy: str, _) -> tuple[str, ...]:
    x, scale, _, mean, var = node.inputs[:5]
    axes = _all_but_channel(g, x)
    inv = _inverse_std(g, var, node, x)
    scale_inv = g.Mul(scale, inv)
    xhat = g.Mul(g.Sub(x, _per_channel(g, mean, x)), _per_channel(g, inv, x))
    dscale = g.reduce("ReduceSum", g.Mul(dy, xhat), axes, keepdims=0)
    dbias = g.reduce("ReduceSum", dy, axes, keepdims=0)
    dmean = g.Neg(g.Mul(dbias, scale_inv))
    dvar = g.Mul(g.Mul(dscale, g.Mul(scale_inv, inv)), g.const_like(-0.5, x, "minus_half"))
    return g.Mul(dy, _per_channel(g, scale_inv, x)), dscale, dbias, dmean, dvar


def _batch_norm_training(g, node, dy: str, d_running: list[str | None]) -> tuple[str, ...]:
    """The batch statistics recomputed from x (the node outputs the running ones), then
    :func:`_batch_statistics_grad`; a gradient of the running statistics outputs reaches x
    through the batch statistics, times ``1 - m``, and the running inputs times ``m``."""
    x, scale, _, mean, var = node.inputs[:5]
    momentum = node.attr("momentum", 0.9)
    axes = _all_but_channel(g, x)
    count = _count(g, x, axes)
    centered = g.Sub(x, g.reduce("ReduceMean", x, axes, keepdims=1))
    batch_var = g.Div(g.reduce("ReduceSumSquare", centered, axes, keepdims=1), count)
    inv = _inverse_std(g, batch_var, node, x)
    dx, dscale, dbias = _batch_statistics_grad(g, x, scale, dy, centered, inv, count, axes)
    outputs, d_running = [*node.outputs[1:3], "", ""][:2], [*d_running, None, None][:2]
    drm, drv = (g.or_zeros(d, o) if o else g.zeros_like(stat)
                for d, o, stat in zip(d_running, outputs, (mean, var)))
    if any(d is not None for d in d_running):
        share = g.Div(g.const_like(1 - momentum, x, "one_minus_momentum"), count)
        dx = g.Add(dx, _through_statistics(g, x, centered, _per_channel(g, drm, x),
                                           _per_channel(g, drv, x), share))
    m = g.const_like(momentum, x, "momentum")
    return dx, dscale, dbias, g.Mul(drm, m), g.Mul(drv, m)


@grad_rule(TRAINING_BATCH_NORM, domain=TRAINING_BATCH_NORM_DOMAIN,
           notes="a training-mode BatchNormalization as training programs run it "
                 "(lossgraph.passes.RunningStatistics): the batch statistics are its outputs")
def training_batch_normalization(g, node, dy, dmean=None, dvar=None):
    """y, mean, var = BatchNormalizationTraining(x, scale, B): :func:`_batch_statistics_grad`
    with the forward's batch statistics (the mean with its axes kept, the biased variance per
    channel; not recomputed); gradients of the mean and variance outputs reach x as
    ``(dmean + 2 dvar (x - mean)) / n``."""
    x, scale = node.inputs[:2]
    y, mean, var = node.outputs[:3]
    axes = _all_but_channel(g, x)
    count = _count(g, x, axes)
    # the body's own x - mean: onnxruntime inlines the body and its common-subexpression
    # elimination merges the two (1.19 and 1.32)
    centered = g.Sub(x, mean)
    inv = _per_channel(g, _inverse_std(g, var, node, x), x)
    dx, dscale, dbias = _batch_statistics_grad(g, x, scale, g.or_zeros(dy, y), centered, inv,
                                               count, axes)
    if dmean is not None or dvar is not None:
        dmean, dvar = g.or_zeros(dmean, mean), _per_channel(g, g.or_zeros(dvar, var), x)
        dx = g.Add(dx, _through_statistics(g, x, centered, dmean, dvar, g.Reciprocal(count)))
    return node.grads(dx, dscale, dbias)


def _inverse_std(g, var: str, node, x: str) -> str:
    """``1 / sqrt(var + epsilon)``, the node's epsilon."""
    return g.Reciprocal(g.Sqrt(g.Add(var, g.const_like(node.attr("epsilon", 1e-5), x, "eps"))))


def _batch_statistics_grad(g, x: str, scale: str, dy: str, centered: str, inv: str, count: str,
                           axes: list[int]) -> tuple[str, str, str]:
    """dx, dscale and dB of ``y = scale c inv + B``, ``c = x - mean`` and ``inv = 1 /
    sqrt(var + eps)`` with the batch statistics (biased variance) of x over ``axes``, their
    dependence on x included. With k = scale inv (per channel) and n the count per channel,
    in six full-size kernels (c included) and two reductions::

        dscale = inv sum(dy c)         dbias = sum(dy)
        dx     = k (dy - sum(dy) / n) - c (k inv^2 sum(dy c) / n)

    which is ``inv (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`` with ``dxhat = scale dy``
    and ``xhat = c inv`` written out, so that neither xhat nor dxhat is materialized (the
    per-channel factors are (C,) tensors): two-thirds the memory traffic of the textbook
    form, which dominates a convolutional net's batch norms. ``inv`` broadcasts against x."""
    sum_dy = g.reduce("ReduceSum", dy, axes, keepdims=1)
    sum_dyc = g.reduce("ReduceSum", g.Mul(dy, centered), axes, keepdims=1)
    k = g.Mul(_per_channel(g, scale, x), inv)
    slope = g.Mul(g.Mul(k, g.Mul(inv, inv)), g.Div(sum_dyc, count))
    dx = g.Sub(g.Mul(g.Sub(dy, g.Div(sum_dy, count)), k), g.Mul(centered, slope))
    to_channels = g.ints([-1], "shape")
    return dx, g.Reshape(g.Mul(sum_dyc, inv), to_channels), g.Reshape(sum_dy, to_channels)


def _through_statistics(g, x: str, centered: str, dmean: str, dvar: str, share: str) -> str:
    """What reaches x through its batch mean and biased variance, given their gradients
    (per channel, shaped to broadcast against x): ``share (dmean + 2 dvar c)``, ``share`` a
    scalar (1 / n, or (1 - m) / n through a running statistic)."""
    two_dvar = g.Mul(dvar, g.const_like(2.0, x, "two"))
    return g.Mul(g.Add(dmean, g.Mul(two_dvar, centered)), share)


@grad_rule("InstanceNormalization")
def instance_normalization(g, node, dy):
    x, scale, _ = node.inputs
    eps = node.attr("epsilon", 1e-5)
    spatial = list(range(2, g.rank(x)))
    xhat, inv = _standardize(g, x, spatial, eps)
    dx = _normalized_grad(g, x, xhat, inv, g.Mul(dy, _per_channel(g, scale, x)), spatial)
    axes = _all_but_channel(g, x)
    dscale = g.reduce("ReduceSum", g.Mul(dy, xhat), axes, keepdims=0)
    return dx, dscale, g.reduce("ReduceSum", dy, axes, keepdims=0)


@grad_rule("LayerNormalization", since=17,
           notes="also through the Mean and InvStdDev outputs")
def layer_normalization(g, node, dy, dmean=None, dinv=None):
    x, scale = node.inputs[:2]
    bias = node.input(2)
    rank = g.rank(x)
    axes = list(range(node.attr("axis", -1) % rank, rank))
    xhat, inv = _standardize(g, x, axes, node.attr("epsilon", 1e-5))
    y = node.outputs[0]
    dy = g.or_zeros(dy, y)
    dx = _normalized_grad(g, x, xhat, inv, g.Mul(dy, scale), axes)
    if dmean is not None or dinv is not None:
        # Mean = mean(x), InvStdDev = inv: dx += (dMean - dInv inv^2 xh) / n
        dmean, dinv = (_like(g, d, stat, x) for d, stat in zip((dmean, dinv), node.outputs[1:3]))
        terms = [] if dmean is None else [dmean]
        if dinv is not None:
            terms.append(g.Neg(g.Mul(g.Mul(dinv, g.Mul(inv, inv)), xhat)))
        dx = g.Add(dx, g.Div(g.sum_of(terms), _count(g, x, axes)))
    dscale = g.unbroadcast(g.Mul(dy, xhat), scale, y)
    return node.grads(dx, dscale, g.unbroadcast(dy, bias, y) if bias else None)


def _like(g, d: str | None, output: str, x: str) -> str | None:
    """``d``, the gradient of ``output``, in the element type of ``x`` (statistics may be
    stashed in another type)."""
    if d is None or g.elem_type(output) == g.elem_type(x):
        return d
    return g.Cast(d, to=g.elem_type(x))


@grad_rule("GroupNormalization", since=21,
           notes="opset 21 (per-channel scale); version 18 is deprecated by the checker")
def group_normalization(g, node, dy):
    x, scale, _ = node.inputs
    groups = node.attr("num_groups")
    shape = g.shape(x)
    by_group = g.ints([0, groups, -1], "shape")
    grouped = g.Reshape(x, by_group)
    xhat_g, inv = _standardize(g, grouped, [2], node.attr("epsilon", 1e-5), like=x)
    static = shape is not None and all(isinstance(d, int) for d in shape[1:])
    full = g.ints([0, *shape[1:]], "shape") if static else g.Shape(x)
    xhat = g.Reshape(xhat_g, full)
    dxhat = g.Reshape(g.Mul(dy, _per_channel(g, scale, x)), by_group)
    dx = g.Reshape(_normalized_grad(g, grouped, xhat_g, inv, dxhat, [2]), full)
    axes = _all_but_channel(g, x)
    dscale = g.reduce("ReduceSum", g.Mul(dy, xhat), axes, keepdims=0)
    return dx, dscale, g.reduce("ReduceSum", dy, axes, keepdims=0)


@grad_rule("LpNormalization", notes="p = 1 or 2")
def lp_normalization(g, node, dy):
    (x,) = node.inputs
    y = node.outputs[0]
    p = node.attr("p", 2)
    axes = [node.attr("axis", -1) % g.rank(x)]
    if p == 2:
        norm, slope = g.reduce("ReduceL2", x, axes, keepdims=1), y
    elif p == 1:
        norm, slope = g.reduce("ReduceL1", x, axes, keepdims=1), g.Sign(x)
    else:
        raise UnsupportedModelError(f"LpNormalization with p={p} is not 1 or 2.")
    dot = g.reduce("ReduceSum", g.Mul(dy, y), axes, keepdims=1)
    return g.Div(g.Sub(dy, g.Mul(slope, dot)), norm)


# ------------------------------------------------------------------ Lp pooling
@grad_rule("LpPool", notes="zero gradient where a window's norm is 0")
def lp_pool(g, node, dy):
    (x,) = node.inputs
    y = node.outputs[0]
    kernel = list(node.attr("kernel_shape"))
    p = node.attr("p", 2)
    if p < 1:
        raise UnsupportedModelError(
            f"No gradient for LpPool node {node.name or '<unnamed>'!r} with p={p}: the "
            "p-norm needs p >= 1.")
    strides, pads, dilations = _window(g, node, x, kernel)
    sizes, out_sizes = _spatial(g, x, "LpPool"), _spatial(g, y, "LpPool")
    if p == 1:
        back = _window_sum_adjoint(g, dy, x, sizes, out_sizes, kernel, strides, pads,
                                   dilations)
        return g.Mul(back, g.Sign(x))
    zero = g.mask(g.Equal(y, g.const_like(0, y, "zero")), y, hint="zero_norm")
    safe = g.Add(y, zero)  # 1 where the norm is 0; its dy is masked out below
    scale = g.Pow(safe, g.const_like(1 - p, y, "one_minus_p"))
    coefficient = g.Mul(g.Mul(dy, scale), g.Sub(g.const_like(1, y, "one"), zero))
    back = _window_sum_adjoint(g, coefficient, x, sizes, out_sizes, kernel, strides, pads,
                               dilations)
    if p == 2:
        return g.Mul(back, x)
    slope = g.Mul(g.Pow(g.Abs(x), g.const_like(p - 1, x, "p_minus_one")), g.Sign(x))
    return g.Mul(back, slope)


# ------------------------------------------------------------------------- LRN
@grad_rule("LRN", notes="static channel count")
def lrn(g, node, dy):
    (x,) = node.inputs
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    channels = _channels(g, x, "LRN")
    # the band matrix B: (v B)_c = sum of v_i over max(0, c - lo) <= i <= min(C - 1, c + hi)
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    i, c = np.arange(channels)[:, None], np.arange(channels)[None, :]
    band = ((i >= c - lo) & (i <= c + hi)).astype(np.float64)
    # (N, C, P) with the channels in the middle: B^T (x^2) sums each channel's window
    flat = g.ints([0, 0, -1], "shape")
    x3, dy3 = g.Reshape(x, flat), g.Reshape(dy, flat)
    squares = g.MatMul(g.const_like(band.T, x, "lrn_band_t"), g.Mul(x3, x3))
    d = g.Add(g.Mul(squares, g.const_like(alpha / size, x, "alpha_over_size")),
              g.const_like(bias, x, "bias"))
    direct = g.Mul(dy3, g.Pow(d, g.const_like(-beta, x, "minus_beta")))  # dy d^-b
    through = g.MatMul(g.const_like(band, x, "lrn_band"), g.Div(g.Mul(direct, x3), d))
    dx = g.Sub(direct, g.Mul(g.Mul(x3, through),
                             g.const_like(2 * alpha * beta / size, x, "two_alpha_beta")))
    return g.Reshape(dx, g.Shape(x))


# -------------------------------------------------------------------- MaxUnpool
@grad_rule("MaxUnpool", nondiff=(1, 2),
           notes="output_shape only where it equals the inferred shape (onnxruntime and the "
                 "specification's reference place the values differently otherwise)")
def max_unpool(g, node, dy):
    x, indices = node.inputs[:2]
    y = node.outputs[0]
    kernel = list(node.attr("kernel_shape"))
    n = len(kernel)
    strides = list(node.attr("strides", [1] * n))
    pads = list(node.attr("pads", [0] * 2 * n))
    sizes, out_sizes = _static(g, x, "MaxUnpool"), _static(g, y, "MaxUnpool")
    inferred = [(sizes[i] - 1) * strides[i] - pads[i] - pads[n + i] + kernel[i]
                for i in range(n)]
    if list(out_sizes) != inferred:
        raise UnsupportedModelError(
            f"No gradient for MaxUnpool node {node.name or '<unnamed>'!r} with an "
            f"output_shape ({list(out_sizes)}) other than the inferred one ({inferred}): the "
            "ONNX reference implementation writes into the inferred shape and pads it, "
            "onnxruntime indexes the larger output directly, so their forwards differ.")
    flat = g.ints([-1], "flat")
    index = g.Reshape(indices, flat)
    picked = g.Gather(g.Reshape(dy, flat), index, axis=0)
    value = g.value(indices)
    if value is None or len(np.unique(value)) != np.asarray(value).size:
        # several writes to one place: only the last one's value survives
        positions = g.Range(g.const(0, np.int64, "zero"), g.Size(x), g.const(1, np.int64, "one"))
        size = g.Reshape(g.Size(y), g.ints([1], "one_dim"))
        nobody = g.ConstantOfShape(size, value=numpy_helper.from_array(np.zeros(1, np.int64)))
        owners = g.ScatterElements(nobody, index, positions, axis=0,
                                   reduction="max" if g.opset >= 18 else None, hint="owners")
        kept = g.mask(g.Equal(g.Gather(owners, index, axis=0), positions), x, hint="survives")
        picked = g.Mul(picked, kept)
    return node.grads(g.Reshape(picked, g.Shape(x)))


# ------------------------------------------------------------------------ Col2Im
def _unfold_positions(image: list[int], block: list[int], strides: list[int],
                      pads: list[int], dilations: list[int]) -> np.ndarray:
    """(K, L) flat image positions that Col2Im adds column entry (k, l) to; prod(image)
    (one past the last position) where it falls in the padding."""
    n = len(image)
    counts = [(image[i] + pads[i] + pads[n + i] - dilations[i] * (block[i] - 1) - 1)
              // strides[i] + 1 for i in range(n)]
    offsets = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"),
                       -1).reshape(-1, n)  # (K, n), row-major over the block
    starts = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"),
                      -1).reshape(-1, n)  # (L, n), row-major over the blocks
    coords = (starts[None, :, :] * np.array(strides) - np.array(pads[:n])
              + offsets[:, None, :] * np.array(dilations))  # (K, L, n)
    inside = np.all((coords >= 0) & (coords < np.array(image)), axis=-1)
    flat = np.ravel_multi_index(tuple(np.clip(coords, 0, np.array(image) - 1).transpose(2, 0, 1)),
                                image)
    return np.where(inside, flat, int(np.prod(image)))


@grad_rule("Col2Im", since=18, nondiff=(1, 2), notes="constant image_shape and block_shape")
def col2im(g, node, dy):
    image = g.ints_value(node.inputs[1], "Col2Im's image_shape")
    block = g.ints_value(node.inputs[2], "Col2Im's block_shape")
    n = len(image)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = list(node.attr("pads", [0] * 2 * n))
    positions = _unfold_positions(image, block, strides, pads, dilations)
    size = int(np.prod(image))
    planes = g.Reshape(dy, g.ints([0, 0, size], "shape"))  # (N, C, P)
    with_zero = g.Pad(planes, g.ints([0, 0, 0, 0, 0, 1], "pads"), mode="constant")  # P + 1
    columns = g.Gather(with_zero, g.const(positions, np.int64, "unfold_positions"), axis=2)
    return node.grads(g.Reshape(columns, g.ints([0, -1, positions.shape[1]], "shape")))
