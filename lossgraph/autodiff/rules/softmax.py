"""Softmax and the losses built on it (opset 13 semantics: one axis).

    Softmax(x; axis) = y        dx = y (dy - ReduceSum(dy y, axis)); when a Where reads y
                                (through casts and reshapes), y with NaN as 0: a row of -inf
                                has NaN for y, which the Where masks (ONNX attention does);
                                its dy is 0 and its gradient 0, not 0 * NaN
    LogSoftmax(x; axis) = y     dx = dy - exp(y) ReduceSum(dy, axis); where dy is zeros but
                                one value a row (a cross entropy's pick: rows at index),
                                dx = ScatterElements(-exp(y) rows, index, rows, add)
    NegativeLogLikelihoodLoss(p, t, w)
                                loss_i = -w[t_i] p[i, t_i] (0 where t_i = ignore_index)
                                dp = -onehot(t) w v c, where v = (t != ignore_index) and
                                c = dy_i (none), dy (sum), dy / sum_i(w[t_i] v_i) (mean)
    SoftmaxCrossEntropyLoss(s, t, w) = (loss, log_prob)
                                log_prob = LogSoftmax(s, axis=1), loss = NLL(log_prob, t, w)
                                dlog_prob = (the NLL gradient above) + dlog_prob_out
                                ds = dlog_prob - softmax(s) ReduceSum(dlog_prob, axis=1)

The labels ``t`` get no gradient; the class weights ``w`` get

    dw_c = sum over all axes but 1 of -P (p + [mean] loss) c,   P = onehot(t) v

but are never trained (``NON_TRAINABLE_INPUTS``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import numpy_helper

from ..context import Pick
from ..registry import grad_rule


def _axis(g, node) -> int:
    return node.attr("axis", -1) % g.rank(node.inputs[0])


@grad_rule("Softmax", since=13, notes="a row of -inf (NaN forward, masked by a later Where, "
                                        "as attention does) gets zeros, not NaN")
def softmax(g, node, dy):
    y = node.outputs[0]
    if _selected_by_where(g, y):
        y = g.Where(g.IsNaN(y), g.const_like(0, y, "zero"), y, hint="finite_softmax")
    axis = _axis(g, node)
    dot = g.reduce("ReduceSum", g.Mul(dy, y), [axis], keepdims=1)
    return g.Mul(y, g.Sub(dy, dot))


#: ops that pass a value on elementwise or as a view: NaN stays NaN, a Where after them
#: still selects from it
_PASS_ON = frozenset({"Cast", "CastLike", "Identity", "Reshape", "Transpose", "Squeeze",
                      "Unsqueeze", "Flatten", "Expand"})


def _selected_by_where(g, y: str, depth: int = 4) -> bool:
    """Whether a Where reads ``y`` (through ops that pass it on): only then can a NaN
    row of y leave the forward finite, and only then is cleaning it worth a kernel."""
    readers = g.readers(y)
    return any(op == "Where" for op, _ in readers) or depth > 0 and any(
        _selected_by_where(g, outputs[0], depth - 1) for op, outputs in readers
        if op in _PASS_ON)


@grad_rule("LogSoftmax", since=13, notes="a cross entropy's pick (one value a row) added "
                                           "into -exp(y) dy, with no zeros of y's size")
def log_softmax(g, node, dy):
    y = node.outputs[0]
    axis = _axis(g, node)
    pick = g.picks.get(dy)
    if pick is not None and pick.axis == axis:
        # dy is zeros but rows at index: ReduceSum(dy) is rows, and dy - exp(y) rows is
        # rows added at index into -exp(y) rows (the same values, the sign of a zero aside)
        return g.ScatterElements(g.Mul(g.Exp(y), g.Neg(_row_totals(g, pick, y))),
                                 pick.index, pick.rows, axis=axis, reduction="add")
    total = g.reduce("ReduceSum", dy, [axis], keepdims=1)
    return g.Sub(dy, g.Mul(g.Exp(y), total))


def _row_totals(g, pick: Pick, y: str) -> str:
    """``ReduceSum(dy, axis)`` of the pick ``dy`` over ``y``'s rows: its rows, where shape
    inference shows that they cover every row of ``y``; else they are written into zeros of
    ``y``'s shape but 1 along the axis (rows past the picked ones total 0)."""
    shape, axis = g.shape(y), pick.axis
    if shape is not None and all(a == b for k, (a, b) in enumerate(zip(shape, pick.shape))
                                 if k != axis):
        return pick.rows
    zeros = g.filled(g.shape_around(y, axis, g.ints([1], "one")), 0, y, hint="zeros")
    first = g.ConstantOfShape(g.Shape(pick.index), hint="first",
                              value=numpy_helper.from_array(np.zeros(1, np.int64), "value"))
    return g.ScatterElements(zeros, first, pick.rows, axis=axis)


def _class_ids(g, scores: str, labels: str) -> str:
    """The class index along axis 1, shaped ``[1, C, 1, ...]``, in the labels' type."""
    rank = g.rank(scores)
    shape = g.shape(scores)
    label_type = g.dtype(labels)
    if shape is not None and isinstance(shape[1], int):
        ids = np.arange(shape[1]).reshape([1, shape[1]] + [1] * (rank - 2))
        return g.const(ids, label_type, "class_ids")
    depth = g.Gather(g.Shape(scores), g.const(1, np.int64, "one"), axis=0)
    ids = g.Range(g.const(0, label_type, "zero"), g.Cast(depth, to=g.elem_type(labels)),
                  g.const(1, label_type, "one"))
    return g.unsqueeze(ids, [0] + list(range(2, rank)))


def _nll_grads(g, node, dy: str, scores: str, log_prob: Callable[[], str]
               ) -> tuple[str, str | None]:
    """(d input, d weights) of the NLL loss output for a node whose input is shaped like
    ``scores``; ``log_prob()`` gives the NLL's input, needed for the weights only.

    With P the one-hot of the kept labels, w the class weights, coefficient c per
    reduction (dy_i, dy, or dy / W with W = sum(P w) for mean) and the loss ``out``:
    d input = -P w c, d w = sum over all axes but 1 of -P (log_prob + out [mean]) c.
    """
    labels, weights = node.inputs[1], node.input(2)
    rank = g.rank(scores)
    dtype = g.elem_type(scores)
    label = g.unsqueeze(labels, [1])  # [N, 1, d...]
    picked = g.Cast(g.Equal(label, _class_ids(g, scores, labels)), to=dtype)  # one-hot
    ignore = node.attr("ignore_index")
    if ignore is not None:
        kept = g.Not(g.Equal(label, g.const(ignore, g.dtype(labels), "ignore_index")))
        picked = g.Mul(picked, g.Cast(kept, to=dtype))
    weighted = picked
    if weights is not None:
        weighted = g.Mul(picked, g.Reshape(weights, g.ints([1, -1] + [1] * (rank - 2), "shape")))
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        coefficient = g.unsqueeze(dy, [1])
    elif reduction == "sum":
        coefficient = dy
    else:  # mean: divided by the total weight of the kept labels
        coefficient = g.Div(dy, g.reduce("ReduceSum", weighted, None, keepdims=0))
    d_input = g.Neg(g.Mul(weighted, coefficient))
    if weights is None or weights not in node.wanted:
        return d_input, None
    shifted = log_prob() if reduction != "mean" else g.Add(log_prob(), node.outputs[0])
    per_class = g.Neg(g.Mul(g.Mul(picked, shifted), coefficient))
    return d_input, g.reduce("ReduceSum", per_class, [0, *range(2, rank)], keepdims=0)


@grad_rule("NegativeLogLikelihoodLoss", since=13, nondiff=(1,), constant=(2,),
           notes="class weights get gradients but are not trained")
def negative_log_likelihood_loss(g, node, dy):
    p = node.inputs[0]
    d_input, d_weights = _nll_grads(g, node, dy, p, lambda: p)
    return node.grads(d_input, None, d_weights)


@grad_rule("SoftmaxCrossEntropyLoss", since=13, nondiff=(1,), constant=(2,),
           notes="class weights get gradients but are not trained")
def softmax_cross_entropy_loss(g, node, dy, dlog_prob=None):
    scores = node.inputs[0]
    log_prob = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] else None
    terms, d_weights = [], None
    if dy is not None:
        d_nll, d_weights = _nll_grads(g, node, dy, scores,
                                      lambda: log_prob or g.LogSoftmax(scores, axis=1))
        terms.append(d_nll)
    if dlog_prob is not None:
        terms.append(dlog_prob)
    grad = g.sum_of(terms)
    probabilities = g.Exp(log_prob) if log_prob else g.Softmax(scores, axis=1)
    total = g.reduce("ReduceSum", grad, [1], keepdims=1)
    d_scores = g.Sub(grad, g.Mul(probabilities, total))
    if d_weights is None and node.input(2) in node.wanted:  # only log_prob carries dy
        d_weights = g.zeros_like(node.input(2))
    return node.grads(d_scores, None, d_weights)
