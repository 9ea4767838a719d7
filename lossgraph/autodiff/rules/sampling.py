"""Sampling an input at computed positions: GridSample, RoiAlign, DeformConv.

GridSample(X, grid; mode, padding_mode, align_corners) reads X (N, C, d_1..d_r) at the
positions grid (N, o_1..o_r, r) gives, normalized to [-1, 1] and listed last dim first.
Per spatial dim i (with L = d_i, g the grid's coordinate for it):

    x  = a g + (L - 1) / 2,   a = (L - 1) / 2 (align_corners) or L / 2
    x  = Round(x)                                 (nearest: half to even, before padding)
    x' = pad(x): outside [lo, hi] ([0, L - 1] with align_corners, else [-0.5, L - 0.5]),
         border: clamped to [0, L - 1]            slope s = 0 there
         reflection: folded back into [lo, hi]    slope s = +-1 (the parity of the folds)
         zeros: x                                 slope s = 1
    taps j = Floor(x') + k, t = x' - Floor(x'), weight w_k(t):
         nearest k = 0, w = 1;  linear k = 0, 1, w = 1 - |t - k|;
         cubic k = -1..2, w = Keys' cubic kernel (A = -0.75) of |t - k|
    each tap reads X at j: zeros: 0 outside [0, L); border: clamped; reflection: folded
    (cubic with border padding is a named error: onnxruntime and torch clamp the taps only,
    the ONNX reference implementation the position first; their forwards differ)

so Y[n, c, p] = sum over tap combinations T of W_T X[n, c, J_T] with W_T = prod_i w_i.
Then

    dX = ScatterElements(0, J, dy W, reduction=add)       (over every tap of every position)
    dgrid_i = a s_i sum_c sum_T dy X[J_T] dW_T/dt_i,   dW_T/dt_i = w_i' prod_(j != i) w_j
                                                        (nearest: 0, piecewise constant)

The tap positions are piecewise constant in the grid (their jumps are a measure-zero
set, where the sampled function is continuous for linear and cubic modes).

RoiAlign(X, rois, batch_indices) samples each bin of each region on a (g_h, g_w) grid
(sampling_ratio, or ceil(region size / output size) per region), bilinearly, with the
reference implementation's border rules (a sample past [-1, size] reads 0, positions
clamped at 0 and size - 1). Every sample reads 4 corners with weights w (products of
the per-axis weights, 0 for samples that do not exist in the region), so

    avg:  Y[r, c, bin] = sum over samples and corners of w X[b_r, c, pos] / count_r
          dX = ScatterElements(0, pos, dy w / count, reduction=add)
    max:  Y[r, c, bin] = max over samples and corners of w X[b_r, c, pos] (the reference
          implementation's and onnxruntime's definition), dX = dy w* at the first maximal
          (sample, corner), in the reference's order

DeformConv(X, W, offset, B, mask), 2-D: each kernel tap k of output position p reads X
bilinearly (zero outside the image) at q = p's window origin + k's dilated place +
offset[n, o(c), k, :, p], for every channel c of offset group o(c):

    S[n, c, k, p] = bilinear(X[n, c], q),   cols = S mask[n, o(c), k, p]
    Y[n, (g, j), p] = B + sum over (c, k) in group g of W[(g, j), c, k] cols[n, (g, c), k, p]
    dB = sum_(n, p) dy,  dW = sum_(n, p) dy cols,  dcols = W^T dy (per group, Einsum)
    dmask = sum over the group's channels of dcols S,  dS = dcols mask
    dX = ScatterElements(0, corners, dS w, reduction=add)
    doffset_d = sum over the group's channels and corners of dS X[corner] dw/dq_d
    (a sample exactly on the pixel grid sits on a kink of the interpolation: there dw/dq_d
    is the mean of the two neighbouring cells' slopes, the central difference, so the
    directional derivative along any direction is the mean of its one-sided ones; the
    taps are Floor(q) - 1 .. Floor(q) + 1 per axis for that)

``rois`` and ``batch_indices`` are ``nondiff``: the regions are constants of the
sampling, as torchvision's roi_align treats them (a weight that reaches the loss only
through them is a :class:`~lossgraph.errors.NoGradientError` that says so). The sample
grids are built in the graph for any rois when sampling_ratio > 0, and sized at build
time from constant rois when it is 0 (adaptive: one more sample per unit of region size).

``RandomNormalLike`` and ``RandomUniformLike`` take only their input's shape (no
gradient); ``Bernoulli`` is declared not differentiable.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...errors import UnsupportedModelError
from ..registry import grad_rule, no_gradient, not_differentiable

no_gradient("RandomNormalLike", "RandomUniformLike")
not_differentiable("Bernoulli", "a random draw of 0 or 1, piecewise constant in the "
                                "probabilities")

_MODES = {"linear": "linear", "bilinear": "linear", "cubic": "cubic", "bicubic": "cubic",
          "nearest": "nearest"}
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75
#: per mode: tap offsets k, and whether |t - k| lies in [0, 1] (else [1, 2], cubic only)
_TAPS = {"nearest": ([0], [True]), "linear": ([0, 1], [True, True]),
         "cubic": ([-1, 0, 1, 2], [False, True, True, False])}


def _reflect(g, x: str, low: float, high: float, like: str) -> tuple[str, str]:
    """(x folded back into [low, high] as the reference implementation folds it, the
    slope +-1 of the fold): m = (x - low) mod 2R, R = high - low; low + m where m <= R,
    low + 2R - m past it."""
    span = high - low
    if span == 0:  # a single position: everything folds onto it
        zero = g.const_like(0.0, like, "zero")
        return g.Add(g.Mul(x, zero), g.const_like(low, like, "low")), zero
    shifted = g.Sub(x, g.const_like(low, like, "low"))
    period = g.const_like(2 * span, like, "period")
    m = g.Sub(shifted, g.Mul(g.Floor(g.Div(shifted, period)), period))
    back = g.mask(g.Greater(m, g.const_like(span, like, "span")), like, hint="folded")
    # low + m + back (2R - 2m); slope 1 - 2 back
    folded = g.Add(g.Add(g.const_like(low, like, "low"), m),
                   g.Mul(back, g.Sub(period, g.Add(m, m))))
    return folded, g.Sub(g.const_like(1.0, like, "one"), g.Add(back, back))


def _pad_coordinate(g, x: str, length: int, padding: str, align: bool, like: str
                    ) -> tuple[str, str | None]:
    """(the coordinate after padding, its slope; None for slope 1)."""
    if padding == "zeros":
        return x, None
    low, high = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    if padding == "reflection":
        return _reflect(g, x, low, high, like)
    # border: clamped to [0, L - 1] where outside [low, high] only
    below = g.mask(g.Less(x, g.const_like(low, like, "low")), like, hint="below")
    above = g.mask(g.Greater(x, g.const_like(high, like, "high")), like, hint="above")
    inside = g.Sub(g.const_like(1.0, like, "one"), g.Add(below, above))
    clamped = g.Add(g.Mul(x, inside), g.Mul(above, g.const_like(length - 1.0, like, "last")))
    return clamped, inside


def _tap_index(g, j: str, length: int, padding: str, align: bool, like: str
               ) -> tuple[str, str | None]:
    """(the int64 index a tap at integer position ``j`` reads, its validity mask for zeros
    padding, else None)."""
    zero, last = g.const_like(0.0, like, "zero"), g.const_like(length - 1.0, like, "last")
    valid = None
    if padding == "zeros":
        valid = g.mask(g.And(g.Not(g.Less(j, zero)), g.Not(g.Greater(j, last))), like,
                       hint="inside")
    elif padding == "reflection":
        low, high = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
        j, _ = _reflect(g, j, low, high, like)
        j = g.Floor(j)  # an integer reflected about a (half-)integer border stays one
    index = g.Cast(g.Max(g.Min(j, last), zero), to=onnx.TensorProto.INT64, hint="tap_index")
    return index, valid


def _horner(g, d: str, coefficients: list[float], like: str) -> str:
    """c0 d^(n-1) + ... + c(n-1), by Horner's rule."""
    result = g.const_like(coefficients[0], like, "coefficient")
    for c in coefficients[1:]:
        result = g.Add(g.Mul(result, d), g.const_like(c, like, "coefficient"))
    return result


def _kernel(g, t: str, mode: str, like: str) -> tuple[str, str]:
    """(w_k(t), w_k'(t)) for every tap k, shaped like ``t`` with the taps last."""
    offsets, near = _TAPS[mode]
    signs = [1.0 if k <= 0 else -1.0 for k in offsets]  # d = |t - k| = sign (t - k)
    sign = g.const_like(signs, like, "tap_signs")
    d = g.Mul(g.Sub(t, g.const_like(offsets, like, "tap_offsets")), sign)
    if mode == "linear":  # 1 - d, slope -sign (shaped to broadcast like t)
        return g.Sub(g.const_like(1.0, like, "one"), d), \
            g.const_like(np.array([-s for s in signs]).reshape(1, 1, -1), like, "slopes")
    a = _CUBIC_A
    near, far = (g.const_like([1.0 if n == side else 0.0 for n in near], like, "taps")
                 for side in (True, False))
    # Keys: (a + 2) d^3 - (a + 3) d^2 + 1 on [0, 1], a d^3 - 5a d^2 + 8a d - 4a on [1, 2]
    w = g.Add(g.Mul(_horner(g, d, [a + 2, -(a + 3), 0.0, 1.0], like), near),
              g.Mul(_horner(g, d, [a, -5 * a, 8 * a, -4 * a], like), far))
    slope = g.Add(g.Mul(_horner(g, d, [3 * (a + 2), -2 * (a + 3), 0.0], like), near),
                  g.Mul(_horner(g, d, [3 * a, -10 * a, 8 * a], like), far))
    dw = g.Mul(slope, sign)
    return w, dw


@grad_rule("GridSample", since=16,
           notes="modes (bi)linear, nearest, (bi)cubic; padding zeros, border, reflection; "
                 "align_corners; static spatial dims of X")
def grid_sample(g, node, dy):
    x, grid = node.inputs
    name = node.name or "<unnamed>"
    mode = _MODES.get(node.attr("mode", "bilinear" if node.opset < 20 else "linear"))
    padding = node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    if mode is None or padding not in _PADDINGS:
        raise UnsupportedModelError(
            f"No gradient for GridSample node {name!r} with mode {node.attr('mode')!r} and "
            f"padding_mode {padding!r} (modes linear/bilinear, nearest, cubic/bicubic; "
            f"padding {', '.join(_PADDINGS)}).")
    if mode == "cubic" and padding == "border":
        raise UnsupportedModelError(
            f"No gradient for GridSample node {name!r} with mode {node.attr('mode')!r} and "
            "padding_mode 'border': onnxruntime (like torch) clamps each cubic tap to the "
            "image, the ONNX reference implementation clamps the sampling position first, so "
            "their forwards differ wherever the grid leaves the image. Use padding_mode "
            "'zeros' or 'reflection', or mode 'linear'.")
    shape = g.shape(x)
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        raise UnsupportedModelError(
            f"The gradient of GridSample node {name!r} needs the static spatial dims of "
            f"{x!r}; shape inference found {shape}.")
    lengths = [int(d) for d in shape[2:]]
    r = len(lengths)
    offsets, _ = _TAPS[mode]
    k = len(offsets)
    taps = k ** r
    like = grid
    points = g.Reshape(grid, g.ints([0, -1, r], "shape"))  # (N, P, r)
    indices, weights, slopes, scales, derivatives = [], [], [], [], []
    for i, length in enumerate(lengths):
        coordinate = g.squeeze(g.Gather(points, g.const([r - 1 - i], np.int64, "coordinate"),
                                        axis=2), [2])  # (N, P)
        a = (length - 1) / 2 if align else length / 2
        position = g.Add(g.Mul(coordinate, g.const_like(a, like, "half_size")),
                         g.const_like((length - 1) / 2, like, "center"))
        if mode == "nearest":
            position = g.Round(position)
        position, slope = _pad_coordinate(g, position, length, padding, align, like)
        base = g.Floor(position)
        j = g.Add(g.unsqueeze(base, [2]), g.const_like(offsets, like, "tap_offsets"))
        index, valid = _tap_index(g, j, length, padding, align, like)  # (N, P, K)
        if mode == "nearest":
            w = dw = None
        else:
            w, dw = _kernel(g, g.unsqueeze(g.Sub(position, base), [2]), mode, like)
        if valid is not None:
            w = valid if w is None else g.Mul(w, valid)
            dw = None if dw is None else g.Mul(dw, valid)
        # the tap axis of dim i at position 2 + i of (N, P, K, ..., K)
        spread = [2 + j for j in range(r) if j != i]
        indices.append(g.unsqueeze(index, spread) if spread else index)
        weights.append(None if w is None else g.unsqueeze(w, spread) if spread else w)
        derivatives.append(None if dw is None else g.unsqueeze(dw, spread) if spread else dw)
        slopes.append(slope)
        scales.append(a)
    stride, flat = 1, None
    for i in reversed(range(r)):
        term = indices[i] if stride == 1 else g.Mul(indices[i], g.const(stride, np.int64,
                                                                          "stride"))
        flat = term if flat is None else g.Add(flat, term)
        stride *= lengths[i]
    flat = g.Reshape(flat, g.ints([0, 1, -1], "shape"))  # (N, 1, P T)
    present = [w for w in weights if w is not None]
    weight = _product(g, present)  # (N, P, K..K) broadcast, or None: all 1
    x_flat = g.Reshape(x, g.ints([0, 0, -1], "shape"))  # (N, C, S)
    dy_rows = g.Reshape(dy, g.ints([0, 0, -1, 1], "shape"))  # (N, C, P, 1)
    wide = g.Concat(g.dims(x, 0, 2), g.dims(flat, 2, 3), axis=0)
    index = g.Expand(flat, wide)  # (N, C, P T)
    grads = [None, None]
    if x in node.wanted:
        if weight is None:
            per_tap = g.Expand(dy_rows, g.Concat(g.dims(x, 0, 2), g.ints([-1, taps], "shape"),
                                                 axis=0)) if taps > 1 else dy_rows
        else:
            full = g.Expand(weight, g.Concat(g.dims(weight, 0, 2), g.ints([k] * r, "taps"),
                                             axis=0)) if len(present) < r else weight
            per_tap = g.Mul(dy_rows, _like(g, g.Reshape(full, g.ints([0, 1, -1, taps], "shape")),
                                           like, x))
        updates = g.Reshape(per_tap, g.ints([0, 0, -1], "shape"))
        zeros = g.Reshape(g.zeros_like(x, (index, updates)), g.ints([0, 0, -1], "shape"))
        dx = g.ScatterElements(zeros, index, updates, axis=2, reduction="add")
        grads[0] = g.Reshape(dx, g.Shape(x))
    if grid in node.wanted:
        if mode == "nearest":
            grads[1] = g.zeros_like(grid)
        else:
            values = g.Reshape(g.GatherElements(x_flat, index, axis=2),
                               g.ints([0, 0, -1, taps], "shape"))  # (N, C, P, T)
            seen = g.reduce("ReduceSum", g.Mul(dy_rows, values), [1], keepdims=0)  # (N, P, T)
            seen = _like(g, seen, x, like)
            parts = []
            for i in reversed(range(r)):  # the grid lists the last spatial dim first
                factors = [derivatives[i]] + [weights[j] for j in range(r) if j != i]
                d_weight = g.Reshape(_product(g, factors), g.ints([0, 0, -1], "shape"))
                d_position = g.reduce("ReduceSum", g.Mul(seen, d_weight), [2], keepdims=1)
                d_position = g.Mul(d_position, g.const_like(scales[i], like, "half_size"))
                if slopes[i] is not None:
                    d_position = g.Mul(d_position, g.unsqueeze(slopes[i], [2]))
                parts.append(d_position)
            grads[1] = g.Reshape(g.Concat(*parts, axis=2), g.Shape(grid))
    return grads


def _product(g, factors: list[str | None]) -> str | None:
    present = [f for f in factors if f is not None]
    if not present:
        return None
    result = present[0]
    for factor in present[1:]:
        result = g.Mul(result, factor)
    return result


def _like(g, value: str, source: str, target: str) -> str:
    """``value`` (in the element type of ``source``) in the element type of ``target``."""
    if g.elem_type(source) == g.elem_type(target):
        return value
    return g.Cast(value, to=g.elem_type(target))


# ---------------------------------------------------------------------- RoiAlign
def _roi_extents(rois: np.ndarray, index: int, scale: float, offset: float, size: int,
                 half_pixel: bool, bins: int) -> int:
    """The largest sample grid along one axis over the constant ``rois``: the in-graph
    arithmetic (the rois' type) replayed in numpy."""
    dtype = rois.dtype
    start = rois[:, index] * dtype.type(scale) - dtype.type(offset)
    end = rois[:, index + 2] * dtype.type(scale) - dtype.type(offset)
    extent = end - start
    if not half_pixel:
        extent = np.maximum(extent, dtype.type(1))
    counts = np.ceil(extent / dtype.type(bins))
    return max(int(counts.max(initial=0)), 1)


def _roi_axis(g, rois: str, index: int, size: int, bins: int, grid: int, sampling: int,
              scale: float, half_pixel: bool, like: str) -> tuple[str, str, str]:
    """Per region, along one axis (y: index 1, x: index 0): (corner indices (R, bins, G,
    2) int64, corner weights (R, bins, G, 2) with the sample's existence and the border
    rule folded in, the sample count g_r (R,))."""
    offset = 0.5 if half_pixel else 0.0

    def coordinate(k: int) -> str:
        value = g.squeeze(g.Gather(rois, g.const([k], np.int64, "roi_column"), axis=1), [1])
        return g.Sub(g.Mul(value, g.const_like(scale, like, "spatial_scale")),
                     g.const_like(offset, like, "offset"))

    start = coordinate(index)
    extent = g.Sub(coordinate(index + 2), start)
    if not half_pixel:  # malformed regions forced to 1
        extent = g.Max(extent, g.const_like(1.0, like, "one"))
    bin_size = g.Div(extent, g.const_like(float(bins), like, "bins"))
    if sampling > 0:
        count = g.Expand(g.const_like(float(sampling), like, "sampling_ratio"), g.Shape(start))
    else:
        count = g.Ceil(bin_size)
    safe = g.Max(count, g.const_like(1.0, like, "one"))
    column = [1, 1, 1]

    def along(values, axis: int, hint: str) -> str:
        shape = list(column)
        shape[axis] = -1
        return g.const_like(np.asarray(values, np.float64).reshape(shape), like, hint)

    # start + b bin + (i + 0.5) bin / g, shaped (R, bins, G)
    r3 = g.unsqueeze(start, [1, 2])
    bin3 = g.unsqueeze(bin_size, [1, 2])
    position = g.Add(g.Add(r3, g.Mul(along(np.arange(bins), 1, "bin_index"), bin3)),
                     g.Div(g.Mul(along(np.arange(grid) + 0.5, 2, "sample_index"), bin3),
                           g.unsqueeze(safe, [1, 2])))
    exists = g.mask(g.Less(along(np.arange(grid), 2, "sample_index"),
                           g.unsqueeze(count, [1, 2])), like, hint="sample_exists")
    zero, last = g.const_like(0.0, like, "zero"), g.const_like(size - 1.0, like, "last")
    inside = g.And(g.Not(g.Less(position, g.const_like(-1.0, like, "minus_one"))),
                   g.Not(g.Greater(position, g.const_like(float(size), like, "size"))))
    keep = g.Mul(exists, g.mask(inside, like, hint="sample_inside"))
    position = g.Max(position, zero)
    low = g.Min(g.Floor(position), last)
    at_end = g.mask(g.Not(g.Less(g.Floor(position), last)), like, hint="at_end")
    high = g.Min(g.Add(low, g.const_like(1.0, like, "one")), last)
    fraction = g.Mul(g.Sub(position, low), g.Sub(g.const_like(1.0, like, "one"), at_end))
    weights = g.Concat(g.unsqueeze(g.Sub(g.const_like(1.0, like, "one"), fraction), [3]),
                       g.unsqueeze(fraction, [3]), axis=3)
    weights = g.Mul(weights, g.unsqueeze(keep, [3]))
    corners = g.Cast(g.Concat(g.unsqueeze(low, [3]), g.unsqueeze(high, [3]), axis=3),
                     to=onnx.TensorProto.INT64)
    return corners, weights, count


@grad_rule("RoiAlign", since=16,
           nondiff={1: "the regions of interest are constants of the sampling, as in "
                       "torchvision's roi_align: lossgraph does not differentiate the sample "
                       "points' positions with respect to the regions' corners",
                    2: "the batch index of each region"},
           notes="gradient with respect to X (avg and max modes); rois are constants; "
                 "sampling_ratio 0 needs constant rois")
def roi_align(g, node, dy):
    x, rois, batch = node.inputs
    name = node.name or "<unnamed>"
    mode = node.attr("mode", "avg")
    transform = node.attr("coordinate_transformation_mode", "half_pixel")
    if mode not in ("avg", "max") or transform not in ("half_pixel", "output_half_pixel"):
        raise UnsupportedModelError(
            f"No gradient for RoiAlign node {name!r} with mode {mode!r} and "
            f"coordinate_transformation_mode {transform!r}.")
    half_pixel = transform == "half_pixel"
    shape = g.shape(x)
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[2:]):
        raise UnsupportedModelError(
            f"The gradient of RoiAlign node {name!r} needs the static height and width of "
            f"{x!r}; shape inference found {shape}.")
    height, width = int(shape[2]), int(shape[3])
    out_h, out_w = node.attr("output_height", 1), node.attr("output_width", 1)
    sampling = node.attr("sampling_ratio", 0)
    scale = node.attr("spatial_scale", 1.0)
    if sampling > 0:
        grid_h = grid_w = sampling
    else:
        constant = g.value(rois)
        if constant is None:
            raise UnsupportedModelError(
                f"The gradient of RoiAlign node {name!r} with sampling_ratio=0 needs "
                f"constant rois ({rois!r} is computed at run time): the number of samples "
                "per bin depends on each region's size. Give the node a sampling_ratio > 0.")
        constant = np.asarray(constant).reshape(-1, 4)
        grid_h = _roi_extents(constant, 1, scale, 0.5 if half_pixel else 0.0, height,
                              half_pixel, out_h)
        grid_w = _roi_extents(constant, 0, scale, 0.5 if half_pixel else 0.0, width,
                              half_pixel, out_w)
    like = x
    rows, row_w, count_h = _roi_axis(g, rois, 1, height, out_h, grid_h, sampling, scale,
                                     half_pixel, like)
    cols, col_w, count_w = _roi_axis(g, rois, 0, width, out_w, grid_w, sampling, scale,
                                     half_pixel, like)
    # (R, out_h, out_w, grid_h, grid_w, 2, 2): bins, samples, corners (y, x) as the
    # reference implementation orders them
    rows, row_w = (g.unsqueeze(v, [2, 4, 6]) for v in (rows, row_w))
    cols, col_w = (g.unsqueeze(v, [1, 3, 5]) for v in (cols, col_w))
    image = g.Mul(g.Cast(batch, to=onnx.TensorProto.INT64),
                  g.const(height * width, np.int64, "image_size"))
    positions = g.Add(g.Add(g.Mul(rows, g.const(width, np.int64, "width")), cols),
                      g.unsqueeze(image, [1, 2, 3, 4, 5, 6]))
    weights = g.Mul(row_w, col_w)
    planes = g.Transpose(x, perm=[1, 0, 2, 3])  # (C, N, H, W)
    flat_x = g.Reshape(planes, g.ints([0, -1], "shape"))  # (C, N H W)
    dy_t = g.Transpose(dy, perm=[1, 0, 2, 3])  # (C, R, out_h, out_w)
    if mode == "avg":
        count = g.Max(g.Mul(count_h, count_w), g.const_like(1.0, like, "one"))
        weights = g.Div(weights, g.unsqueeze(count, [1, 2, 3, 4, 5, 6]))
        updates = g.Mul(g.unsqueeze(dy_t, [4, 5, 6, 7]), g.unsqueeze(weights, [0]))
        index = g.Reshape(positions, g.ints([1, -1], "shape"))
    else:
        full = g.Concat(g.dims(dy_t, 0, 4), g.ints([grid_h * grid_w * 4], "samples"), axis=0)

        def per_bin(value: str) -> str:  # (R, out_h, out_w, ...) -> (C, R, out_h, out_w, S)
            flat = g.unsqueeze(g.Reshape(value, g.ints([0, 0, 0, -1], "shape")), [0])
            return g.Expand(flat, full)

        index_all, weight_all = per_bin(positions), per_bin(weights)
        values = g.Reshape(g.GatherElements(flat_x, g.Reshape(index_all, g.ints([0, -1],
                                                                               "shape")),
                                            axis=1), full)
        # samples past a region's own grid do not exist: they never win the max
        iy = g.const_like(np.arange(grid_h).reshape(1, 1, 1, -1, 1, 1, 1), x, "sample_index")
        ix = g.const_like(np.arange(grid_w).reshape(1, 1, 1, 1, -1, 1, 1), x, "sample_index")
        exists = g.And(g.Less(iy, g.unsqueeze(count_h, [1, 2, 3, 4, 5, 6])),
                       g.Less(ix, g.unsqueeze(count_w, [1, 2, 3, 4, 5, 6])))
        exists = per_bin(g.Expand(exists, g.Shape(positions)))
        values = g.Where(exists, g.Mul(values, weight_all),
                         g.const_like(-np.inf, like, "minus_inf"))
        best = g.ArgMax(values, axis=4, keepdims=1)
        index = g.GatherElements(index_all, best, axis=4)
        updates = g.Mul(g.unsqueeze(dy_t, [4]), g.GatherElements(weight_all, best, axis=4))
        index = g.Reshape(index, g.ints([0, -1], "shape"))
    updates = g.Reshape(updates, g.ints([0, -1], "shape"))
    index = g.Expand(index, g.Shape(updates))
    zeros = g.filled(g.Shape(flat_x), 0, x, hint="zeros", run_time=(index, updates))
    scattered = g.ScatterElements(zeros, index, updates, axis=1, reduction="add")
    dx = g.Transpose(g.Reshape(scattered, g.Shape(planes)), perm=[1, 0, 2, 3])
    return node.grads(dx)


# -------------------------------------------------------------------- DeformConv
def _bilinear_taps(g, position: str, size: int, like: str) -> tuple[str, str, str]:
    """Along one axis, for positions (..): (indices (.., 3) int64 of the taps Floor - 1,
    Floor and Floor + 1, clamped into the image; their weights (0, 1 - t, t), zero for
    taps outside it; their slopes d w / d position: (0, -1, 1), and at a position exactly
    on the grid (t = 0, a kink) the mean of the two cells' slopes, (-1/2, 0, 1/2))."""
    base = g.Floor(position)
    fraction = g.unsqueeze(g.Sub(position, base), [-1])
    taps = g.Add(g.unsqueeze(base, [-1]), g.const_like([-1.0, 0.0, 1.0], like, "tap_offsets"))
    zero, last = g.const_like(0.0, like, "zero"), g.const_like(size - 1.0, like, "last")
    valid = g.mask(g.And(g.Not(g.Less(taps, zero)), g.Not(g.Greater(taps, last))), like,
                   hint="inside")
    one = g.const_like(1.0, like, "one")
    weights = g.Mul(g.Concat(g.Mul(fraction, zero), g.Sub(one, fraction), fraction, axis=-1),
                    valid)
    on_grid = g.mask(g.Equal(fraction, zero), like, hint="on_grid")
    slopes = g.Add(g.const_like([0.0, -1.0, 1.0], like, "tap_slopes"),
                   g.Mul(on_grid, g.const_like([-0.5, 1.0, -0.5], like, "kink_slopes")))
    index = g.Cast(g.Max(g.Min(taps, last), zero), to=onnx.TensorProto.INT64)
    return index, weights, g.Mul(slopes, valid)


@grad_rule("DeformConv", since=19, notes="2-D; every input: X, W, offset, B and mask")
def deform_conv(g, node, dy):
    x, w, offset = node.inputs[:3]
    bias, mask = node.input(3), node.input(4)
    y = node.outputs[0]
    name = node.name or "<unnamed>"
    x_shape, w_shape, y_shape = g.shape(x), g.shape(w), g.shape(y)
    if x_shape is None or len(x_shape) != 4:
        raise UnsupportedModelError(
            f"No gradient for DeformConv node {name!r} on {x!r} of shape {x_shape}: only "
            "2-D images (N, C, H, W).")
    static = [x_shape[1:], w_shape, y_shape[2:] if y_shape else None]
    if any(s is None or not all(isinstance(d, int) for d in s) for s in static):
        raise UnsupportedModelError(
            f"The gradient of DeformConv node {name!r} needs static channels and spatial "
            f"dims of {x!r}, a static {w!r} and static output dims (found {x_shape}, "
            f"{w_shape}, {y_shape}).")
    channels, height, width = (int(d) for d in x_shape[1:])
    out_channels = int(w_shape[0])
    kernel = list(node.attr("kernel_shape", list(w_shape[2:])))
    taps = kernel[0] * kernel[1]
    out_h, out_w = (int(d) for d in y_shape[2:])
    positions = out_h * out_w
    strides = list(node.attr("strides", [1, 1]))
    dilations = list(node.attr("dilations", [1, 1]))
    pads = list(node.attr("pads", [0, 0, 0, 0]))
    group, offset_group = node.attr("group", 1), node.attr("offset_group", 1)
    per_offset = channels // offset_group
    per_group, out_per_group = channels // group, out_channels // group
    like = x
    # the sampling positions (N, offset groups, taps, positions) per axis
    moves = g.Reshape(offset, g.ints([0, offset_group, taps, 2, positions], "shape"))
    rows_of_taps = np.repeat(np.arange(kernel[0]), kernel[1])
    cols_of_taps = np.tile(np.arange(kernel[1]), kernel[0])
    out_rows = np.repeat(np.arange(out_h), out_w)
    out_cols = np.tile(np.arange(out_w), out_h)
    bases = [-pads[0] + strides[0] * out_rows[None, :] + dilations[0] * rows_of_taps[:, None],
             -pads[1] + strides[1] * out_cols[None, :] + dilations[1] * cols_of_taps[:, None]]
    indices, weights, slopes = [], [], []
    for axis, (base, size) in enumerate(zip(bases, (height, width))):
        move = g.squeeze(g.Gather(moves, g.const([axis], np.int64, "axis"), axis=3), [3])
        index, weight, slope = _bilinear_taps(
            g, g.Add(move, g.const_like(base, like, "tap_origin")), size, like)
        spread = [5] if axis == 0 else [4]  # corners as (row tap, column tap)
        indices.append(g.unsqueeze(index, spread))
        weights.append(g.unsqueeze(weight, spread))
        slopes.append(g.unsqueeze(slope, spread))
    corner_shape = g.ints([0, offset_group, taps, positions, 9], "shape")

    def corners(value: str) -> str:  # (N, G_o, K, P, 3, 3) -> (N, G_o, K, P, 9)
        return g.Reshape(value, corner_shape)

    index = corners(g.Add(g.Mul(indices[0], g.const(width, np.int64, "width")), indices[1]))
    weight = corners(g.Mul(weights[0], weights[1]))
    d_weight = [corners(g.Mul(slopes[0], weights[1])), corners(g.Mul(weights[0], slopes[1]))]

    def per_channel(value: str) -> str:  # (N, G_o, ...) -> (N, C, K P 9): each channel
        spread = g.unsqueeze(value, [2])      # reads its offset group's positions
        shape = g.Concat(g.dims(value, 0, 2), g.ints([per_offset, taps, positions, 9],
                                                     "shape"), axis=0)
        return g.Reshape(g.Expand(spread, shape), g.ints([0, channels, -1], "shape"))

    flat_x = g.Reshape(x, g.ints([0, channels, -1], "shape"))  # (N, C, H W)
    channel_index = per_channel(index)
    channel_weight = per_channel(weight)
    values = g.GatherElements(flat_x, channel_index, axis=2)  # (N, C, K P 9)
    by_corner = g.ints([0, channels, taps, positions, 9], "shape")
    sampled = g.reduce("ReduceSum", g.Reshape(g.Mul(values, channel_weight), by_corner), [4],
                       keepdims=0)  # S: (N, C, K, P)
    masks = None
    if mask is not None:  # (N, G_o, K, P) -> (N, C, K, P)
        masks = g.Reshape(g.Expand(g.unsqueeze(g.Reshape(mask, g.ints(
            [0, offset_group, taps, positions], "shape")), [2]), g.Concat(
            g.dims(x, 0, 1), g.ints([offset_group, per_offset, taps, positions], "shape"),
            axis=0)), g.ints([0, channels, taps, positions], "shape"))
    columns = sampled if masks is None else g.Mul(sampled, masks)
    w_groups = g.Reshape(w, g.ints([group, out_per_group, per_group * taps], "shape"))
    dy_groups = g.Reshape(dy, g.ints([0, group, out_per_group, positions], "shape"))
    grads: list[str | None] = [None] * len(node.inputs)
    if w in node.wanted:
        col_groups = g.Reshape(columns, g.ints([0, group, per_group * taps, positions],
                                               "shape"))
        dw = g.Einsum(dy_groups, col_groups, equation="ngop,ngcp->goc")
        grads[1] = g.Reshape(dw, g.ints(list(w_shape), "shape"))
    if bias is not None and bias in node.wanted:
        grads[3] = g.reduce("ReduceSum", dy, [0, 2, 3], keepdims=0)
    d_columns = g.Reshape(g.Einsum(w_groups, dy_groups, equation="goc,ngop->ngcp"),
                          g.ints([0, channels, taps, positions], "shape"))
    if mask is not None and mask in node.wanted:
        d_mask = g.Reshape(g.Mul(d_columns, sampled),
                           g.ints([0, offset_group, per_offset, taps, positions], "shape"))
        grads[4] = g.Reshape(g.reduce("ReduceSum", d_mask, [2], keepdims=0), g.Shape(mask))
    d_sampled = d_columns if masks is None else g.Mul(d_columns, masks)  # (N, C, K, P)
    d_rows = g.unsqueeze(d_sampled, [4])
    if x in node.wanted:
        updates = g.Reshape(g.Mul(d_rows, g.Reshape(channel_weight, by_corner)),
                            g.ints([0, channels, -1], "shape"))
        zeros = g.Reshape(g.zeros_like(x, (channel_index, updates)),
                          g.ints([0, channels, -1], "shape"))
        dx = g.ScatterElements(zeros, channel_index, updates, axis=2, reduction="add")
        grads[0] = g.Reshape(dx, g.Shape(x))
    if offset in node.wanted:
        seen = g.Reshape(g.Mul(d_rows, g.Reshape(values, by_corner)),
                         g.ints([0, offset_group, per_offset, taps, positions, 9], "shape"))
        seen = g.reduce("ReduceSum", seen, [2], keepdims=0)  # (N, G_o, K, P, 9)
        per_axis = [g.reduce("ReduceSum", g.Mul(seen, d), [4], keepdims=0) for d in d_weight]
        d_offset = g.Concat(*(g.unsqueeze(d, [3]) for d in per_axis), axis=3)  # (.., K, 2, P)
        grads[2] = g.Reshape(d_offset, g.Shape(offset))
    return grads
