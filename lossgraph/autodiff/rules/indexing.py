"""Indexing ops: their gradients scatter ``dy`` back to the positions it was read from.

    Slice(x, s, e, a, t)      dx = Pad(dy, (s, dim - e)) for constant unit steps and a static
                              shape; otherwise dy is scattered into zeros at the flat positions
                              Slice(Reshape(Range(0, Size(x)), Shape(x)), s, e, a, t)
    Pad(x, p, c), constant    dx = Pad(dy, -p)  (crops what was padded, pads what was cropped)
                              dc = ReduceSum(dy) - ReduceSum(dx)
    Gather(x, i, axis)        dx[.., i[j], ..] += dy[.., j, ..]  (duplicates accumulate):
                              along axis moved first, the rows of dy added in order by
                              ScatterElements(zeros, i broadcast to dy, dy, 0, reduction=add)
                              (opset 16+; ScatterND(reduction=add) when no index can repeat),
                              OneHot(i)^T @ dy before opset 16
    GatherElements(x, i, a)   dx = ScatterElements(zeros, i, dy, a, reduction=add) (opset 16+),
                              ReduceSum(OneHot(i) * dy, a) before opset 16
    GatherND(x, i)            Gather's form on the flat positions sum_j i_j stride_j of x
                              flattened over the k axes i indexes (opset 16+: ScatterND(zeros,
                              i, dy, reduction=add) when no index tuple can repeat)
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
    Resize(x)                 dx = dy contracted with the interpolation matrix M_a of each
                              resized axis a (Resize is separable and linear in x): M_a^T is
                              the runtime's own Resize (the node's attributes, roi and scale or
                              size of a) of the identity EyeLike(n_a x n_a) along its second
                              axis, so dx is the exact adjoint of the forward the runtime
                              computes (onnxruntime folds it to a constant when shapes are
                              static); keep_aspect_ratio_policy: a 4-D probe that also holds the
                              axis setting the common scale. Axes with scale 1 (size kept, roi
                              0..1) cost nothing; where that is known at run time only, If.
                              align_corners or tf_crop_and_resize with scales whose output
                              size is not whole: an error (onnxruntime and the specification
                              disagree on the forward)

``NonZero`` returns positions (no gradient); ``Unique`` is declared not differentiable.

Why not ScatterND(reduction=add) for repeated indices: onnxruntime's CPU kernel (1.19
to 1.32) hands the index rows to its threads with no synchronisation, so two threads
adding into one row race and lose updates. An embedding's gradient (BERT's token ids,
its token type ids all 0) came out wrong and different on every run: 3 SGD steps of a
BERT-base classifier gave losses 1.1527, 1.1442, 1.1393 in three runs. ScatterElements
adds the rows in order (onnxruntime runs it serially, or splits it by columns, which
never share an element): the same sums as a one-thread ScatterND, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...builder import GraphBuilder
from ...errors import UnsupportedModelError
from ..context import Pick
from ..registry import grad_rule, no_gradient, not_differentiable
from .shape import shape_of, static_shape

no_gradient("NonZero")
not_differentiable("Unique", "its outputs change shape when a repeated value moves (the values "
                   "split); a derivative exists only without repeats, where Unique merely sorts "
                   "(use TopK or Gather there)")


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


def scatter_add_rows(g, zeros: str, positions: str, rows: str, rank: int) -> str:
    """``zeros[positions[j]] += rows[j]`` for ``j = 0, 1, ...`` in order (duplicates
    accumulate): ``positions`` int64 of shape (m,), ``rows`` of shape (m, ...) and rank
    ``rank``, along the first axis of ``zeros``. A ScatterElements with the positions
    broadcast to the rows' shape: deterministic in onnxruntime, where ScatterND(add) with
    repeated indices is not (module doc)."""
    if rank > 1:
        positions = g.Expand(g.unsqueeze(positions, list(range(1, rank))), g.Shape(rows),
                             hint="positions")
    return g.ScatterElements(zeros, positions, rows, axis=0, reduction="add")


def _distinct(g, indices: str, dims: list[int | str] | None, k: int = 1) -> bool:
    """Whether no index of ``indices`` can repeat (for GatherND, no tuple of its last ``k``
    entries): there is at most one, or they are constants all different once taken modulo
    the static ``dims`` they index. A ScatterND(add) over them then has no two threads
    writing one place."""
    shape = g.shape(indices)
    if shape is not None and all(isinstance(d, int) for d in shape) \
            and int(np.prod(shape)) // max(k, 1) <= 1:
        return True
    value = g.value(indices)
    if value is None or dims is None or not all(isinstance(d, int) and d > 0 for d in dims):
        return False
    tuples = np.mod(np.asarray(value, np.int64).reshape(-1, len(dims)), np.array(dims))
    return len(np.unique(tuples, axis=0)) == len(tuples)


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
    zeros = g.filled(total, 0, x, hint="zeros", run_time=dy)
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


def _sum_rows_by_one_hot(g, positions: str, depth: str, rows: str, like: str,
                         shape: str) -> str:
    """``dx[p] = sum of rows[j] where positions[j] = p`` (duplicates accumulate), for
    ``depth`` positions, reshaped to ``shape``: ``OneHot(positions)^T @ rows``, each
    flattened to a matrix. Needs no scatter with a reduction (opset 16)."""
    one_hot = _one_hot(g, positions, depth, like, axis=-1)
    flat_hot = g.Reshape(one_hot, g.Concat(g.ints([-1]), depth, axis=0))
    flat_rows = g.Reshape(rows, g.Concat(g.Reshape(g.Size(positions), g.ints([1], hint="shape")),
                                         g.ints([-1]), axis=0))
    return g.Reshape(g.Gemm(flat_hot, flat_rows, transA=1), shape)


# ---------------------------------------------------------------------------- Gather
@grad_rule("Gather", since=13, nondiff=(1,),
           notes="duplicate indices accumulate; ScatterElements(add) of the rows in order from "
                 "opset 16 (ScatterND(add) when no index repeats), OneHot+Gemm before")
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

    def zeros() -> str:  # a large table's made at each run, not stored (GradContext.filled)
        return g.filled(shape_t, 0, x, hint="zeros", run_time=(idx, dy))

    if g.opset >= 16 and _distinct(g, indices, [(g.shape(x) or [None] * rank)[axis]]):
        dx_t = g.ScatterND(zeros(), g.unsqueeze(idx, [q]), dy_t, reduction="add")
    elif g.opset >= 16:  # the rows of dy_t in index order, each added to its row of dx_t
        index_shape = static_shape(g, indices)
        count = (g.ints([int(np.prod(index_shape))], hint="shape") if index_shape is not None
                 else g.Reshape(g.Size(indices), g.ints([1], hint="shape")))
        if shape is not None:
            rest = g.ints([shape[p] for p in perm_x[1:]], hint="shape")
        else:
            rest = g.Slice(shape_t, g.ints([1], hint="starts"), g.ints([rank], hint="ends"))
        positions = idx if q == 1 else g.Reshape(idx, count)
        rows = dy_t if q == 1 else g.Reshape(dy_t, g.Concat(count, rest, axis=0))
        dx_t = scatter_add_rows(g, zeros(), positions, rows, rank)
    else:
        dx_t = _sum_rows_by_one_hot(g, g.unsqueeze(idx, [0]) if q == 0 else idx,
                                    _dim(g, x, axis), dy_t, x, shape_t)
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
        dx = g.ScatterElements(g.zeros_like(x, (idx, dy)), idx, dy, axis=axis, reduction="add")
        picked = g.shape(indices)
        if picked is not None and picked[axis] == 1:
            g.picks[dx] = Pick(idx, dy, axis, tuple(picked))
        return node.grads(dx)
    one_hot = _one_hot(g, idx, _dim(g, x, axis), x, axis=axis + 1)
    dx = g.reduce("ReduceSum", g.Mul(one_hot, g.unsqueeze(dy, [axis + 1])), [axis], keepdims=0)
    x_shape, i_shape = g.shape(x), g.shape(indices)
    if x_shape is not None and i_shape is not None and all(
            a == b for k, (a, b) in enumerate(zip(x_shape, i_shape)) if k != axis):
        return node.grads(dx)
    extra = g.Sub(g.Shape(x), g.Shape(dx))
    return node.grads(g.Pad(dx, g.Concat(g.ints([0] * rank), extra, axis=0), mode="constant"))


@grad_rule("GatherND", since=13, nondiff=(1,),
           notes="duplicate indices accumulate; the flat positions' rows added by "
                 "ScatterElements(add) from opset 16 (ScatterND(add) when no index repeats), "
                 "OneHot+Gemm before; batch_dims=0")
def gather_nd(g, node, dy):
    x, indices = node.inputs
    if node.attr("batch_dims", 0) != 0:
        raise UnsupportedModelError(
            f"No gradient for GatherND node {node.name!r} with batch_dims != 0.")
    k = (g.shape(indices) or [None])[-1]
    if not isinstance(k, int):
        raise UnsupportedModelError(
            f"The gradient of GatherND node {node.name!r} needs the last dim of {indices!r} to "
            "be static.")
    dims = g.dims(x, 0, k)
    idx = _normalize(g, indices, dims)
    if g.opset >= 16 and _distinct(g, indices, (g.shape(x) or [None] * k)[:k], k):
        return node.grads(g.ScatterND(g.zeros_like(x, (idx, dy)), idx, dy, reduction="add"))
    # the position of each index tuple in x flattened over its first k axes
    strides = [g.ints([1], "stride")]
    for axis in range(k - 1, 0, -1):
        strides.insert(0, g.Mul(strides[0], _dim(g, x, axis)))
    flat = g.reduce("ReduceSum", g.Mul(idx, g.Concat(*strides, axis=0)), [-1], keepdims=0)
    count = g.reduce("ReduceProd", dims, [0], keepdims=1)
    if g.opset < 16:
        positions = g.unsqueeze(flat, [0]) if g.rank(indices) == 1 else flat
        return node.grads(_sum_rows_by_one_hot(g, positions, count, dy, x, shape_of(g, x)))
    # x as (count, rest...) rows; dy as (tuples, rest...) rows, each added to its row
    rank, q = g.rank(x), g.rank(indices)
    tuples = g.reduce("ReduceProd", g.dims(indices, 0, q - 1), [0], keepdims=1)
    rest = [g.dims(x, k, rank)] if rank > k else []
    rows = g.Reshape(dy, g.Concat(tuples, *rest, axis=0) if rest else tuples)
    zeros = g.filled(g.Concat(count, *rest, axis=0) if rest else count, 0, x, hint="zeros",
                     run_time=(flat, dy))
    summed = scatter_add_rows(g, zeros, g.Reshape(flat, tuples), rows, rank - k + 1)
    return node.grads(g.Reshape(summed, shape_of(g, x)))


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
        return op.scatter(dy, g.zeros_like(updates, (node.inputs[1], dy))), None, op.gather(dy)
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
        flat = g.filled(g.Reshape(size, g.ints([1], "shape")), 0, x, hint="zeros",
                        run_time=(positions, dy))
        dx = g.ScatterElements(flat, positions, dy, axis=0)
        return node.grads(g.Reshape(dx, shape_of(g, x)))
    rank = g.rank(x)
    axis %= rank
    positions = g.Compress(g.Range(zero, _dim(g, x, axis, scalar=True), one), condition,
                           axis=0)
    along = [1] * rank
    along[axis] = -1
    index = g.Expand(g.Reshape(positions, g.ints(along, "shape")), g.Shape(dy))
    return node.grads(g.ScatterElements(g.zeros_like(x, (index, dy)), index, dy, axis=axis))


# ------------------------------------------------------------------------------ TopK
@grad_rule("TopK", nondiff=(1,), notes="the indices output has no gradient")
def topk(g, node, dvalues, dindices=None):
    x = node.inputs[0]
    axis = node.attr("axis", -1) % g.rank(x)
    chosen = node.outputs[1]
    return node.grads(g.ScatterElements(g.zeros_like(x, (chosen, dvalues)), chosen, dvalues,
                                        axis=axis))


# ---------------------------------------------------------------------------- OneHot
@grad_rule("OneHot", nondiff=(0, 1), constant=(2,),
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
#: The attributes a Resize along one axis shares with the node it differentiates.
_RESIZE_ATTRIBUTES = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                      "exclude_outside", "antialias")
_COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                     "asymmetric", "tf_crop_and_resize")
_KEPT, _RESIZED, _AT_RUN_TIME = "kept", "resized", "at run time"


class _Resize:
    """A Resize node seen one axis at a time.

    Resize is separable and linear in ``x``: along each resized axis ``a`` it multiplies
    by an interpolation matrix ``M_a`` (out_a x in_a), so ``dx`` is ``dy`` contracted with
    every ``M_a``. An axis is *kept* (its ``M_a`` is the identity: no work) when its scale
    is 1 or its size its input's, under ``keep_aspect_ratio_policy`` stretch and a full
    ``roi``; *resized* when it is not, or may not be; and decided *at run time* when its
    scale, size or roi is computed at run time (sizes from ``Shape(x)``, as torch's
    exporters write for ``F.interpolate(size=...)``, keep the batch axis).
    """

    def __init__(self, g, node) -> None:
        self.g, self.node, self.x = g, node, node.inputs[0]
        self.rank = g.rank(self.x)
        self.coordinates = node.attr("coordinate_transformation_mode", "half_pixel")
        self.policy = node.attr("keep_aspect_ratio_policy", "stretch")
        listed = node.attr("axes")
        self.axes = [a % self.rank for a in listed] if listed is not None else \
            list(range(self.rank))
        self.sizes = node.input(3)
        scales = node.input(2) if self.sizes is None else None
        if scales is not None and g.value(scales) is not None and g.value(scales).size == 0:
            scales = None
        if scales is None and self.sizes is None:
            raise UnsupportedModelError(
                f"Resize node {node.name!r} has neither scales nor sizes.")
        self.scales = scales
        self.region = node.input(1) if self.coordinates == "tf_crop_and_resize" else None
        self._refuse_what_has_no_gradient()

    # -- what is known before run time ------------------------------------------------
    def _position(self, axis: int) -> int:
        """The index of ``axis``'s entry in scales, sizes and each half of roi."""
        return self.axes.index(axis)

    def _entry(self, name: str | None, index: int):
        value = self.g.value(name)
        return None if value is None else np.asarray(value).reshape(-1)[index].item()

    def scale(self, axis: int) -> float | None:
        """The constant scale of ``axis`` (scales given), else ``None``."""
        return None if self.scales is None else self._entry(self.scales, self._position(axis))

    def size(self, axis: int) -> int | None:
        """The static size ``axis`` is resized to (sizes given, stretch), else ``None``."""
        if self.sizes is None or self.policy != "stretch":
            return None
        size = self._entry(self.sizes, self._position(axis))
        return size if size is not None else self._static_dim(self.node.outputs[0], axis)

    def roi(self, axis: int) -> tuple[float, float] | None:
        """The constant (start, end) of ``axis``'s region of interest, else ``None``."""
        value = self.g.value(self.region)
        if value is None:
            return None
        value = np.asarray(value, np.float64).reshape(-1)
        half = value.size // 2
        return float(value[self._position(axis)]), float(value[half + self._position(axis)])

    def _static_dim(self, name: str, axis: int) -> int | None:
        shape = self.g.shape(name)
        return shape[axis] if shape is not None and isinstance(shape[axis], int) else None

    def in_dim(self, axis: int) -> int | None:
        """The static size of ``x`` along ``axis``, else ``None``."""
        return self._static_dim(self.x, axis)

    def kind(self, axis: int) -> str:
        """_KEPT, _RESIZED or _AT_RUN_TIME (see the class)."""
        if axis not in self.axes:
            return _KEPT
        if self.policy != "stretch":
            return _RESIZED  # the common scale applies to every listed axis
        if self.scales is not None:
            scale = self.scale(axis)
            same = None if scale is None else scale == 1.0
        else:  # a known size and an input size unknown until run time: resized (M_a is
            # the identity where they happen to agree)
            size, dim = self.size(axis), self.in_dim(axis)
            same = None if size is None else dim is not None and size == dim
        if self.region is not None:
            roi = self.roi(axis)
            full = None if roi is None else roi == (0.0, 1.0)
            same = False if False in (same, full) else (None if None in (same, full) else True)
        return {True: _KEPT, False: _RESIZED, None: _AT_RUN_TIME}[same]

    def _refuse_what_has_no_gradient(self) -> None:
        """A mode of no opset lossgraph emits for; align_corners and tf_crop_and_resize
        with a constant scale whose output size is not whole (for the static input size,
        or for most input sizes): there onnxruntime's forward is not the specification's.
        (With a scale computed at run time, the gradient is that of onnxruntime's forward,
        as everywhere.)"""
        node = self.node
        if self.coordinates not in _COORDINATE_MODES:
            raise UnsupportedModelError(
                f"No gradient for Resize node {node.name!r} with coordinate_transformation_mode "
                f"{self.coordinates!r}, which is not one of opset 13 and later "
                f"({', '.join(_COORDINATE_MODES)}).")
        if self.coordinates not in ("align_corners", "tf_crop_and_resize") or \
                self.scales is None:
            return
        for axis in self.axes:
            scale, dim = self.scale(axis), self.in_dim(axis)
            if scale is None:  # computed at run time (torch: Concat of Constants): unknown
                continue
            if dim is None:  # a whole scale gives a whole size at every input size
                if scale == int(scale):
                    continue
                what, size = f"an input size unknown until run time and scale {scale:g}", ""
            else:
                product = float(np.float32(dim * scale))
                if product == int(product):
                    continue
                what = f"{dim} x scale {scale:g} is not a whole number"
                size = f" (here {int(product)})"
            raise UnsupportedModelError(
                f"No gradient for Resize node {node.name!r} ({self.coordinates}) on axis "
                f"{axis}: {what}, and where the output size is not whole onnxruntime maps "
                "coordinates with the rounded output size and the ONNX specification with the "
                f"unrounded one, so their forwards differ. Give the Resize sizes{size} instead "
                "of scales.")

    # -- the interpolation matrices ---------------------------------------------------
    def _vector(self, name: str, index: int, dtype) -> str:
        """Entry ``index`` of the input ``name`` as a 1-element tensor (a constant if it is)."""
        value = self._entry(name, index)
        if value is not None:
            return self.g.const([value], dtype, "entry")
        return self.g.Slice(name, self.g.ints([index], "start"), self.g.ints([index + 1], "end"))

    def _roi_pair(self, axis: int) -> tuple[str, str]:
        """(start, end) of ``axis``'s region of interest, 1-element tensors."""
        position, half = self._position(axis), len(self.axes)
        dtype = self.g.dtype(self.region)
        return (self._vector(self.region, position, dtype),
                self._vector(self.region, half + position, dtype))

    def run_time_matrix(self, b, axis: int) -> str:
        """``M_a^T`` (in_a x out_a) computed at run time, in ``b``: the runtime's own Resize
        (the node's attributes; extrapolated outputs are constants, so 0) of the identity
        matrix along its second axis, with this axis's scale or size and roi; under a
        ``keep_aspect_ratio_policy``, of a 4-D probe that also has the axis whose ratio sets
        the common scale, so that the runtime computes that scale and the rounded size
        itself."""
        g = self.g
        attributes = {a: self.node.attr(a) for a in _RESIZE_ATTRIBUTES
                      if self.node.attr(a) is not None}
        n = _dim(g, self.x, axis)
        zero = numpy_helper.from_array(np.zeros(1, g.dtype(self.x)), "value")
        eye = b.EyeLike(b.ConstantOfShape(b.Concat(n, n, axis=0), value=zero), hint="eye")
        if self.policy != "stretch":
            return self._aspect_probe(b, axis, eye, n, attributes)
        start_end = self._roi_pair(axis) if self.region is not None else None
        position = self._position(axis)
        if self.scales is not None:
            along = self._vector(self.scales, position, np.float32)
        else:
            along = self._vector(self.sizes, position, np.int64)
        if g.opset >= 18:  # the identity's first axis is left alone
            roi = b.Concat(*start_end, axis=0) if start_end else None
            resize_args = (along, None) if self.scales is not None else (None, along)
            return b.Resize(eye, roi, *resize_args, axes=[1], extrapolation_value=0.0,
                            hint="resize_matrix", **attributes)
        # before opset 18 every axis is resized: scale 1 (size n, roi 0..1) is the identity
        roi = None
        if start_end:
            dtype = g.dtype(self.region)
            roi = b.Concat(g.const([0], dtype, "start"), start_end[0],
                           g.const([1], dtype, "end"), start_end[1], axis=0)
        if self.scales is not None:
            resize_args = (b.Concat(g.const([1], np.float32, "scale"), along, axis=0), None)
        else:
            resize_args = (None, b.Concat(n, along, axis=0))
        return b.Resize(eye, roi, *resize_args, extrapolation_value=0.0, hint="resize_matrix",
                        **attributes)

    def _aspect_probe(self, b, axis: int, eye: str, n: str, attributes: dict) -> str:
        """Resize of P (n, 1, in_c, n), P[i, 0, j, k] = [i == k], along its last two axes
        with sizes (sizes_c, sizes_a) and the node's policy, c the axis whose ratio
        sizes/in is the smallest (not_larger) or largest (not_smaller): the runtime's
        common scale is the node's, and row 0 of the third axis (the interpolation of a
        constant: 1, to rounding) holds M_a^T."""
        g = self.g
        dims = g.Gather(g.Shape(self.x), g.ints(self.axes), axis=0)
        ratios = g.Div(g.Cast(self.sizes, to=onnx.TensorProto.FLOAT),
                       g.Cast(dims, to=onnx.TensorProto.FLOAT))
        pick = getattr(g, "ArgMin" if self.policy == "not_larger" else "ArgMax")(
            ratios, axis=0, keepdims=1)
        size_c, dim_c = g.Gather(self.sizes, pick, axis=0), g.Gather(dims, pick, axis=0)
        size_a = self._vector(self.sizes, self._position(axis), np.int64)
        one = g.ints([1], "one")
        probe = b.Expand(b.unsqueeze(eye, [1, 2]), b.Concat(n, one, dim_c, n, axis=0))
        roi = None
        if self.region is not None:
            start, end = self._roi_pair(axis)
            dtype = g.dtype(self.region)
            roi = b.Concat(g.const([0], dtype, "start"), start, g.const([1], dtype, "end"), end,
                           axis=0)
        resized = b.Resize(probe, roi, None, b.Concat(size_c, size_a, axis=0), axes=[2, 3],
                           keep_aspect_ratio_policy=self.policy, extrapolation_value=0.0,
                           **attributes)
        first = b.Slice(resized, g.ints([0], "start"), one, g.ints([2]))
        return b.squeeze(first, [1, 2], hint="resize_matrix")

    def kept_at_run_time(self, axis: int) -> str:
        """A 1-element bool: ``axis``'s scale is 1 (or its size its input's), and its roi
        is 0..1."""
        g = self.g
        position = self._position(axis)
        if self.scales is not None:
            kept = g.Equal(self._vector(self.scales, position, np.float32),
                           g.const([1], np.float32, "one"))
        else:
            kept = g.Equal(self._vector(self.sizes, position, np.int64), _dim(g, self.x, axis))
        if self.region is not None:
            start, end = self._roi_pair(axis)
            dtype = g.dtype(self.region)
            full = g.And(g.Equal(start, g.const([0], dtype, "zero")),
                         g.Equal(end, g.const([1], dtype, "one")))
            kept = g.And(kept, full)
        return kept

    # -- dx ----------------------------------------------------------------------------
    def contract(self, b, grad: str, axis: int, transposed: str) -> str:
        """``grad`` (out_a along ``axis``) contracted with ``M_a``, given as ``M_a^T``."""
        if axis == self.rank - 1:
            return b.MatMul(grad, b.Transpose(transposed, perm=[1, 0]))
        if axis == self.rank - 2:
            return b.MatMul(transposed, grad)
        letters = "abcdefghijklmnop"[:self.rank]
        equation = f"{letters},{letters[axis].upper()}{letters[axis]}->" + \
            letters.replace(letters[axis], letters[axis].upper())
        return b.Einsum(grad, transposed, equation=equation)

    def contract_at_run_time(self, grad: str, axis: int) -> str:
        """``If(axis kept) grad else grad contracted with M_a``: the matrix is built, and
        the product paid, only where the axis is resized."""
        g = self.g
        kept, resized = (GraphBuilder(g.names, g.opset, prefix=g.prefix) for _ in range(2))
        as_is = kept.Identity(grad)
        contracted = self.contract(resized, grad, axis, self.run_time_matrix(resized, axis))

        def branch(b: GraphBuilder, value: str, name: str) -> onnx.GraphProto:
            info = helper.make_tensor_value_info(value, g.elem_type(self.x), [None] * self.rank)
            return helper.make_graph(b.nodes, g.names.fresh(name), [], [info], b.initializers)

        return g.op("If", self.kept_at_run_time(axis), hint="resize_grad",
                    then_branch=branch(kept, as_is, "resize_axis_kept"),
                    else_branch=branch(resized, contracted, "resize_axis_resized"))


@grad_rule("Resize", since=13, nondiff=(1, 2, 3),
           notes="every mode, coordinate transformation, antialias, axes and "
                 "keep_aspect_ratio_policy, static or run-time shapes: per-axis matrices from "
                 "the runtime's own Resize of an identity; align_corners or tf_crop_and_resize "
                 "with a scale whose output size is not whole: an error")
def resize(g, node, dy):
    plan = _Resize(g, node)
    grad = dy
    kinds = {axis: plan.kind(axis) for axis in range(plan.rank)}
    for axis in (a for a, kind in kinds.items() if kind == _RESIZED):
        grad = plan.contract(g, grad, axis, plan.run_time_matrix(g, axis))
    for axis in (a for a, kind in kinds.items() if kind == _AT_RUN_TIME):
        grad = plan.contract_at_run_time(grad, axis)
    return node.grads(grad)
