"""Indexing ops: their gradients scatter ``dy`` back to the positions it was read from.

    Slice(x, s, e, a, t)      dx = Pad(dy, (s, dim - e)) for constant unit steps and a static
                              shape; otherwise dy is scattered into zeros at the flat positions
                              Slice(Reshape(Range(0, Size(x)), Shape(x)), s, e, a, t)
    Pad(x, p, c), constant    dx = Pad(dy, -p)  (crops what was padded, pads what was cropped)
                              dc = ReduceSum(dy) - ReduceSum(dx)
    Gather(x, i, axis)        dx[.., i[j], ..] += dy[.., j, ..]  (duplicates accumulate):
                              ScatterND(reduction=add) along axis moved first (opset 16+),
                              OneHot(i)^T @ dy before opset 16
    GatherElements(x, i, a)   dx = ScatterElements(zeros, i, dy, a, reduction=add) (opset 16+),
                              ReduceSum(OneHot(i) * dy, a) before opset 16
    GatherND(x, i)            dx = ScatterND(zeros, i, dy, reduction=add)  (opset 16+)
    ScatterND(x, i, u)        dx = ScatterND(dy, i, zeros)   du = GatherND(dy, i)
    ScatterElements(x, i, u)  dx = ScatterElements(dy, i, zeros, a)   du = GatherElements(dy, i, a)
                              (reduction=add: dx = dy)
                              reduction=max/min, y_p = max(x_p, u_k: i_k = p): the gradient
                              goes to the factors equal to y_p, ties share it evenly (as
                              ReduceMax, and torch's scatter_reduce amax/amin):
                              n_p = (x_p == y_p) + sum_k (u_k == y_p) (a scatter with add)
                              dx = dy (x == y) / n,  du_k = (dy / n)[i_k] (u_k == y[i_k])
                              reduction=mul, y_p = x_p prod u_k: zero-safe as ReduceProd:
                              with f' = f + (f == 0), P = x'_p prod u'_k and Z the count of
                              zero factors at p, df = dy P / f' (Z == (f == 0))
    Compress(x, c, axis)      dx = ScatterElements(zeros, j, dy, axis), j the selected
                              positions Compress(Range(dim), c) broadcast like dy (no axis:
                              on the flattened x)
    OneHot(i, d, (off, on))   y = off + (on - off) H, H = OneHot(i, d, (0, 1)):
                              don = sum(dy H), doff = sum(dy) - don
    TopK(x, k) -> (v, i)      dx = ScatterElements(zeros, i, dv, axis)
    Trilu(x, k)               dx = Trilu(dy, k, upper)
    ReverseSequence(x, n)     dx = GatherElements(dy, i, time axis), i = n - 1 - t inside a
                              sequence and t past its end (a reversal is its own adjoint)
    Resize(x)                 dx = dy contracted with the constant interpolation matrix of each
                              resized axis (computed at build time with onnx.reference on unit
                              vectors: the exact adjoint of every mode). align_corners with
                              scales whose product with the size is not whole: an error
                              (onnxruntime and the specification disagree on the forward)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import UnsupportedModelError
from ..registry import grad_rule
from .shape import shape_of, static_shape


def _normalize(g, indices: str, dims: str) -> str:
    """Non-negative indices: Mod(i, dims) maps -1 to dims - 1."""
    return g.Mod(indices, dims)


def _dim(g, x: str, axis: int, scalar: bool = False) -> str:
    """Size of ``x`` along ``axis`` as a 1-element int64 tensor (or a scalar)."""
    shape = g.shape(x)
    if shape is not None and isinstance(shape[axis], int):
        return g.const(shape[axis] if scalar else [shape[axis]], np.int64, "dim")
    if scalar:
        return g.Gather(g.Shape(x), g.const(axis, np.int64, "axis"), axis=0)
    return g.dims(x, axis, axis + 1)


def _one_hot(g, indices: str, depth: str, like: str, axis: int) -> str:
    """OneHot in the type of ``like`` (onnxruntime's OneHot has float but no double values)."""
    hot = g.OneHot(indices, depth, g.const([0, 1], np.float32, "off_on"), axis=axis)
    if g.elem_type(like) != onnx.TensorProto.FLOAT:
        hot = g.Cast(hot, to=g.elem_type(like))
    return hot


def _as_index_type(g, indices: str) -> str:
    return indices if g.elem_type(indices) == onnx.TensorProto.INT64 else g.Cast(
        indices, to=onnx.TensorProto.INT64)


# ----------------------------------------------------------------------------- Slice
def _slice_params(g, node):
    x = node.inputs[0]
    rank = g.rank(x)
    starts = g.ints_value(node.inputs[1], "Slice's starts")
    ends = g.ints_value(node.inputs[2], "Slice's ends")
    axes = g.ints_value(node.input(3), "Slice's axes") or list(range(len(starts)))
    steps = g.ints_value(node.input(4), "Slice's steps") or [1] * len(starts)
    return starts, ends, [a % rank for a in axes], steps


@grad_rule("Slice", since=13, nondiff=(1, 2, 3, 4))
def slice_(g, node, dy):
    x = node.inputs[0]
    shape = static_shape(g, x)
    constant = all(g.value(n) is not None for n in node.inputs[1:] if n)
    if shape is not None and constant:
        starts, ends, axes, steps = _slice_params(g, node)
        if all(s == 1 for s in steps):
            begin, end = [0] * len(shape), [0] * len(shape)
            for start, stop, axis in zip(starts, ends, axes):
                first, last, _ = slice(start, stop).indices(shape[axis])
                begin[axis] = first
                end[axis] = shape[axis] - max(last, first)
            return node.grads(g.Pad(dy, g.ints(begin + end, hint="pads"), mode="constant"))
        index = [slice(None)] * len(shape)
        for start, stop, axis, step in zip(starts, ends, axes, steps):
            index[axis] = slice(start, stop, step)
        positions = np.arange(int(np.prod(shape))).reshape(shape)[tuple(index)].reshape(-1)
        flat_positions = g.ints(positions, hint="positions")
        total = g.ints([int(np.prod(shape))], hint="size")
    else:  # run the same Slice over the flat positions at run time
        size = g.Size(x)
        zero, one = g.const(0, np.int64, "zero"), g.const(1, np.int64, "one")
        grid = g.Reshape(g.Range(zero, size, one), g.Shape(x))
        flat_positions = g.Reshape(g.Slice(grid, *node.inputs[1:]), g.ints([-1], hint="shape"))
        total = g.Reshape(size, g.ints([1], hint="shape"))
    flat_dy = g.Reshape(dy, g.ints([-1], hint="shape"))
    zeros = g.filled(total, 0, x, hint="zeros")
    scattered = g.ScatterElements(zeros, flat_positions, flat_dy, axis=0)
    return node.grads(g.Reshape(scattered, shape_of(g, x)))


# ------------------------------------------------------------------------------- Pad
@grad_rule("Pad", since=13, nondiff=(1, 3), notes="constant mode only")
def pad(g, node, dy):
    mode = node.attr("mode", "constant")
    if mode != "constant":
        raise UnsupportedModelError(
            f"No gradient for Pad node {node.name!r} in mode {mode!r}: lossgraph differentiates "
            "constant padding only.")
    pads = node.inputs[1]
    value = g.value(pads)
    negated = g.ints([-int(p) for p in value]) if value is not None else g.Neg(pads)
    axes = node.input(3)
    dx = g.Pad(dy, negated, *(["", axes] if axes else []), mode="constant")
    constant = node.input(2)
    dc = None
    if constant is not None:
        total = g.Sub(g.reduce("ReduceSum", dy, None, keepdims=0),
                      g.reduce("ReduceSum", dx, None, keepdims=0))
        dc = g.Reshape(total, g.Shape(constant))
    return node.grads(dx, None, dc)


# ---------------------------------------------------------------------------- Gather
@grad_rule("Gather", since=13, nondiff=(1,),
           notes="duplicate indices accumulate; ScatterND(add) from opset 16, OneHot+Gemm before")
def gather(g, node, dy):
    x, indices = node.inputs
    rank, q = g.rank(x), g.rank(indices)
    axis = node.attr("axis", 0) % rank
    idx = _normalize(g, _as_index_type(g, indices), _dim(g, x, axis, scalar=True))
    # x with `axis` moved first; dy with the index axes moved first.
    perm_x = [axis, *range(axis), *range(axis + 1, rank)]
    perm_dy = [*range(axis, axis + q), *range(axis), *range(axis + q, rank - 1 + q)]
    dy_t = dy if axis == 0 else g.Transpose(dy, perm=perm_dy)
    shape = static_shape(g, x)
    if shape is not None:
        shape_t = g.ints([shape[p] for p in perm_x], hint="shape")
    else:
        shape_t = g.Gather(g.Shape(x), g.ints(perm_x, hint="perm"), axis=0)
    if g.opset >= 16:
        dx_t = g.ScatterND(g.filled(shape_t, 0, x, hint="zeros"), g.unsqueeze(idx, [q]), dy_t,
                           reduction="add")
    else:
        depth = _dim(g, x, axis)
        one_hot = _one_hot(g, g.unsqueeze(idx, [0]) if q == 0 else idx, depth, x, axis=-1)
        flat_hot = g.Reshape(one_hot, g.Concat(g.ints([-1]), depth, axis=0))
        flat_dy = g.Reshape(dy_t, g.Concat(g.Reshape(g.Size(idx), g.ints([1], hint="shape")),
                                           g.ints([-1]), axis=0))
        dx_t = g.Reshape(g.Gemm(flat_hot, flat_dy, transA=1), shape_t)
    inverse = [0] * rank
    for i, p in enumerate(perm_x):
        inverse[p] = i
    return node.grads(dx_t if axis == 0 else g.Transpose(dx_t, perm=inverse))


@grad_rule("GatherElements", since=13, nondiff=(1,),
           notes="duplicate indices accumulate; ScatterElements(add) from opset 16, OneHot before")
def gather_elements(g, node, dy):
    x, indices = node.inputs
    rank = g.rank(x)
    axis = node.attr("axis", 0) % rank
    idx = _normalize(g, _as_index_type(g, indices), _dim(g, x, axis))
    if g.opset >= 16:
        return node.grads(g.ScatterElements(g.zeros_like(x), idx, dy, axis=axis, reduction="add"))
    one_hot = _one_hot(g, idx, _dim(g, x, axis), x, axis=axis + 1)
    dx = g.reduce("ReduceSum", g.Mul(one_hot, g.unsqueeze(dy, [axis + 1])), [axis], keepdims=0)
    x_shape, i_shape = g.shape(x), g.shape(indices)
    if x_shape is not None and i_shape is not None and all(
            a == b for k, (a, b) in enumerate(zip(x_shape, i_shape)) if k != axis):
        return node.grads(dx)
    extra = g.Sub(g.Shape(x), g.Shape(dx))
    return node.grads(g.Pad(dx, g.Concat(g.ints([0] * rank), extra, axis=0), mode="constant"))


@grad_rule("GatherND", since=13, nondiff=(1,),
           notes="opset 16+ (ScatterND reduction=add); batch_dims=0")
def gather_nd(g, node, dy):
    x, indices = node.inputs
    if node.attr("batch_dims", 0) != 0:
        raise UnsupportedModelError(
            f"No gradient for GatherND node {node.name!r} with batch_dims != 0.")
    if g.opset < 16:
        raise UnsupportedModelError(
            f"The gradient of GatherND node {node.name!r} needs ScatterND's reduction='add', "
            f"which needs opset 16; the model has opset {g.opset}. Convert the model to opset "
            "16 or later (onnx.version_converter).")
    k = (g.shape(indices) or [None])[-1]
    if not isinstance(k, int):
        raise UnsupportedModelError(
            f"The gradient of GatherND node {node.name!r} needs the last dim of {indices!r} to "
            "be static.")
    dims = g.Slice(g.Shape(x), g.ints([0]), g.ints([k]))
    idx = _normalize(g, indices, dims)
    return node.grads(g.ScatterND(g.zeros_like(x), idx, dy, reduction="add"))


# --------------------------------------------------------------------------- Scatter
_SCATTER_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _reduction(node) -> str:
    reduction = node.attr("reduction", "none")
    if reduction not in _SCATTER_REDUCTIONS:
        raise UnsupportedModelError(
            f"No gradient for {node.op_type} node {node.name!r} with reduction={reduction!r} "
            f"(only {', '.join(_SCATTER_REDUCTIONS)}).")
    return reduction


class _Scatter:
    """A ScatterND or ScatterElements node's scatter (with ``reduction``) and its gather."""

    def __init__(self, g, node) -> None:
        self.g, self.node = g, node
        x, self.indices, _ = node.inputs
        self.elements = node.op_type == "ScatterElements"
        self.axis = node.attr("axis", 0) % g.rank(x) if self.elements else None

    def scatter(self, data: str, updates: str, reduction: str | None = None) -> str:
        kwargs = {"axis": self.axis} if self.elements else {}
        return getattr(self.g, self.node.op_type)(data, self.indices, updates,
                                                  reduction=reduction, **kwargs)

    def gather(self, data: str) -> str:
        if self.elements:
            return self.g.GatherElements(data, self.indices, axis=self.axis)
        return self.g.GatherND(data, self.indices)


def _scatter_grads(g, node, dy) -> tuple[str, None, str]:
    x, _, updates = node.inputs
    y = node.outputs[0]
    op = _Scatter(g, node)
    reduction = _reduction(node)
    if reduction == "none":
        return op.scatter(dy, g.zeros_like(updates)), None, op.gather(dy)
    if reduction == "add":
        return dy, None, op.gather(dy)
    if reduction in ("max", "min"):  # the selected factors share dy evenly
        chosen_x = g.mask(g.Equal(x, y), x, hint="selected")
        chosen_u = g.mask(g.Equal(updates, op.gather(y)), x, hint="selected")
        ties = op.scatter(chosen_x, chosen_u, reduction="add")
        share = g.Div(dy, ties)  # ties >= 1: y_p is one of the factors
        return g.Mul(share, chosen_x), None, g.Mul(op.gather(share), chosen_u)
    # mul: zero-safe products of the other factors
    zero = g.const_like(0, x, "zero")
    zero_x = g.mask(g.Equal(x, zero), x, hint="is_zero")
    zero_u = g.mask(g.Equal(updates, zero), x, hint="is_zero")
    safe_x, safe_u = g.Add(x, zero_x), g.Add(updates, zero_u)
    product = op.scatter(safe_x, safe_u, reduction="mul")
    zeros = op.scatter(zero_x, zero_u, reduction="add")
    scaled = g.Mul(dy, product)
    dx = g.Mul(g.Div(scaled, safe_x), g.mask(g.Equal(zeros, zero_x), x))
    du = g.Mul(g.Div(op.gather(scaled), safe_u), g.mask(g.Equal(op.gather(zeros), zero_u), x))
    return dx, None, du


@grad_rule("ScatterND", since=13, nondiff=(1,),
           notes="reductions none, add, mul (zero-safe), max and min (ties share the "
                 "gradient evenly)")
def scatter_nd(g, node, dy):
    return _scatter_grads(g, node, dy)


@grad_rule("ScatterElements", since=13, nondiff=(1,),
           notes="reductions none, add, mul (zero-safe), max and min (ties share the "
                 "gradient evenly)")
def scatter_elements(g, node, dy):
    return _scatter_grads(g, node, dy)


# -------------------------------------------------------------------------- Compress
@grad_rule("Compress", nondiff=(1,), notes="dy scattered back to the selected positions")
def compress(g, node, dy):
    x, condition = node.inputs
    axis = node.attr("axis")
    zero, one = g.const(0, np.int64, "zero"), g.const(1, np.int64, "one")
    if axis is None:  # on the flattened input
        size = g.Size(x)
        positions = g.Compress(g.Range(zero, size, one), condition, axis=0)
        flat = g.filled(g.Reshape(size, g.ints([1], "shape")), 0, x, hint="zeros")
        dx = g.ScatterElements(flat, positions, dy, axis=0)
        return node.grads(g.Reshape(dx, shape_of(g, x)))
    rank = g.rank(x)
    axis %= rank
    positions = g.Compress(g.Range(zero, _dim(g, x, axis, scalar=True), one), condition,
                           axis=0)
    along = [1] * rank
    along[axis] = -1
    index = g.Expand(g.Reshape(positions, g.ints(along, "shape")), g.Shape(dy))
    return node.grads(g.ScatterElements(g.zeros_like(x), index, dy, axis=axis))


# ------------------------------------------------------------------------------ TopK
@grad_rule("TopK", nondiff=(1,), notes="the indices output has no gradient")
def topk(g, node, dvalues, dindices=None):
    x = node.inputs[0]
    axis = node.attr("axis", -1) % g.rank(x)
    return node.grads(g.ScatterElements(g.zeros_like(x), node.outputs[1], dvalues, axis=axis))


# ---------------------------------------------------------------------------- OneHot
@grad_rule("OneHot", nondiff=(0, 1),
           notes="the values (off, on) get gradients, but are not trained")
def one_hot(g, node, dy):
    indices, depth, values = node.inputs
    hot = _one_hot(g, _as_index_type(g, indices), _as_index_type(g, depth), values,
                   node.attr("axis", -1))
    on = g.reduce("ReduceSum", g.Mul(dy, hot), None, keepdims=1)
    off = g.Sub(g.reduce("ReduceSum", dy, None, keepdims=1), on)
    flat = g.ints([1], "shape")
    return node.grads(None, None, g.Concat(g.Reshape(off, flat), g.Reshape(on, flat), axis=0))


# ------------------------------------------------------------------- ReverseSequence
@grad_rule("ReverseSequence", nondiff=(1,),
           notes="as a gather (onnxruntime 1.19's ReverseSequence leaves rows of length 0 "
                 "unwritten)")
def reverse_sequence(g, node, dy):
    x, lengths = node.inputs
    time_axis = node.attr("time_axis", 0)  # the batch axis is the other of 0 and 1
    steps = g.Range(g.const(0, np.int64, "zero"), _dim(g, x, time_axis, scalar=True),
                    g.const(1, np.int64, "one"))
    lengths = _as_index_type(g, lengths)
    t, n = (g.unsqueeze(steps, [1]), g.unsqueeze(lengths, [0])) if time_axis == 0 else (
        g.unsqueeze(steps, [0]), g.unsqueeze(lengths, [1]))
    inside = g.Cast(g.Less(t, n), to=onnx.TensorProto.INT64)
    # n - 1 - t inside a sequence, t past its end: t + inside (n - 1 - 2 t)
    last = g.Sub(n, g.const(1, np.int64, "one"))
    index = g.Add(t, g.Mul(inside, g.Sub(last, g.Add(t, t))))
    if g.rank(x) > 2:
        index = g.unsqueeze(index, list(range(2, g.rank(x))))
    return g.GatherElements(dy, g.Expand(index, g.Shape(dy)), axis=time_axis), None


# ----------------------------------------------------------------------------- Trilu
@grad_rule("Trilu", nondiff=(1,))
def trilu(g, node, dy):
    k = node.input(1)
    return node.grads(g.Trilu(dy, *([k] if k else []), upper=node.attr("upper", 1)))


# ---------------------------------------------------------------------------- Resize
_RESIZE_ATTRIBUTES = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                      "exclude_outside", "antialias")


def _resize_matrix(node, size_in: int, scale: float | None, size_out: int) -> np.ndarray:
    """The (size_out, size_in) matrix of ``node``'s Resize along one axis.

    Column j is the forward Resize of the j-th unit vector, evaluated with onnx.reference
    on a 1-D input with the node's own attributes, so the gradient is its exact adjoint.
    """
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    attributes = {a: node.attr(a) for a in _RESIZE_ATTRIBUTES if node.attr(a) is not None}
    inputs = ["x", "", "scales"] if scale is not None else ["x", "", "", "sizes"]
    resize = helper.make_node("Resize", inputs, ["y"], **attributes)
    graph = helper.make_graph(
        [resize], "resize_axis",
        [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [size_in])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        [numpy_helper.from_array(np.array([scale], np.float32), "scales") if scale is not None
         else numpy_helper.from_array(np.array([size_out], np.int64), "sizes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", node.opset)])
    evaluator = ReferenceEvaluator(model)
    columns = [evaluator.run(None, {"x": np.eye(size_in)[j]})[0] for j in range(size_in)]
    return np.stack(columns, axis=1).reshape(size_out, size_in)


@grad_rule("Resize", since=13, nondiff=(1, 2, 3),
           notes="constant scales or sizes and static shapes; exact adjoint via constant "
                 "per-axis interpolation matrices (any mode but tf_crop_and_resize)")
def resize(g, node, dy):
    x, y = node.inputs[0], node.outputs[0]
    in_shape, out_shape = static_shape(g, x), static_shape(g, y)
    if in_shape is None or out_shape is None:
        raise UnsupportedModelError(
            f"The gradient of Resize node {node.name!r} needs static shapes for {x!r} and {y!r}.")
    if node.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise UnsupportedModelError(
            f"No gradient for Resize node {node.name!r} with coordinate_transformation_mode "
            "'tf_crop_and_resize'.")
    if node.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise UnsupportedModelError(
            f"No gradient for Resize node {node.name!r} with keep_aspect_ratio_policy "
            f"{node.attr('keep_aspect_ratio_policy')!r} (only 'stretch').")
    rank = len(in_shape)
    axes = [a % rank for a in node.attr("axes", list(range(rank)))]
    scales = node.input(2) and g.value(node.input(2))
    scales = None if scales is None or np.asarray(scales).size == 0 else np.asarray(scales)
    if scales is None and node.input(3) is None:
        raise UnsupportedModelError(
            f"The gradient of Resize node {node.name!r} needs constant scales or sizes.")
    grad = dy
    dtype = g.dtype(x)
    for position, axis in enumerate(axes):
        scale = float(scales.reshape(-1)[position]) if scales is not None else None
        if scale is not None and node.attr("coordinate_transformation_mode") == \
                "align_corners" and float(np.float32(in_shape[axis] * scale)) != out_shape[axis]:
            raise UnsupportedModelError(
                f"No gradient for Resize node {node.name!r} (align_corners) on axis {axis}: "
                f"{in_shape[axis]} x scale {scale:g} is not a whole number, and onnxruntime "
                "maps coordinates with the rounded output size where the ONNX specification "
                "uses the unrounded one, so their forwards differ. Give the Resize sizes "
                f"(here {out_shape[axis]}) instead of scales.")
        if in_shape[axis] == out_shape[axis] and scale in (None, 1.0) and node.attr(
                "coordinate_transformation_mode") != "tf_half_pixel_for_nn":
            continue  # the identity along this axis
        matrix = _resize_matrix(node, in_shape[axis], scale, out_shape[axis])
        if axis == rank - 1:
            grad = g.MatMul(grad, g.const(matrix, dtype, "resize_matrix"))
        elif axis == rank - 2:
            grad = g.MatMul(g.const(matrix.T, dtype, "resize_matrix"), grad)
        else:
            letters = "abcdefghijklmnop"[:rank]
            equation = f"{letters},{letters[axis].upper()}{letters[axis]}->" + \
                letters.replace(letters[axis], letters[axis].upper())
            grad = g.Einsum(grad, g.const(matrix.T, dtype, "resize_matrix"), equation=equation)
    return node.grads(grad)
