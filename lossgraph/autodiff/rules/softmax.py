"""Softmax and the losses built on it (opset 13 semantics: one axis).

    Softmax(x; axis) = y        dx = y (dy - ReduceSum(dy y, axis))
    LogSoftmax(x; axis) = y     dx = dy - exp(y) ReduceSum(dy, axis)
    NegativeLogLikelihoodLoss(p, t, w)
                                loss_i = -w[t_i] p[i, t_i] (0 where t_i = ignore_index)
                                dp = -onehot(t) w[t] v c, where v = (t != ignore_index) and
                                c = dy_i (none), dy (sum), dy / sum_i(w[t_i] v_i) (mean)
    SoftmaxCrossEntropyLoss(s, t, w) = (loss, log_prob)
                                log_prob = LogSoftmax(s, axis=1), loss = NLL(log_prob, t, w)
                                dlog_prob = (the NLL gradient above) + dlog_prob_out
                                ds = dlog_prob - softmax(s) ReduceSum(dlog_prob, axis=1)

The class weights ``w`` (and the labels ``t``) get no gradient.
"""

from __future__ import annotations

import numpy as np

from ..registry import grad_rule


def _axis(g, node) -> int:
    return node.attr("axis", -1) % g.rank(node.inputs[0])


@grad_rule("Softmax", since=13)
def softmax(g, node, dy):
    y = node.outputs[0]
    axis = _axis(g, node)
    dot = g.reduce("ReduceSum", g.Mul(dy, y), [axis], keepdims=1)
    return g.Mul(y, g.Sub(dy, dot))


@grad_rule("LogSoftmax", since=13)
def log_softmax(g, node, dy):
    y = node.outputs[0]
    axis = _axis(g, node)
    total = g.reduce("ReduceSum", dy, [axis], keepdims=1)
    return g.Sub(dy, g.Mul(g.Exp(y), total))


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


def _nll_input_grad(g, node, dy: str, scores: str) -> str:
    """The gradient of the NLL loss output with respect to its (log-probability) input."""
    labels, weights = node.inputs[1], node.input(2)
    rank = g.rank(scores)
    dtype = g.elem_type(scores)
    label = g.unsqueeze(labels, [1])  # [N, 1, d...]
    picked = g.Cast(g.Equal(label, _class_ids(g, scores, labels)), to=dtype)  # one-hot
    if weights is not None:
        shape = [1, -1] + [1] * (rank - 2)
        picked = g.Mul(picked, g.Reshape(weights, g.ints(shape, "shape")))
    ignore = node.attr("ignore_index")
    if ignore is not None:
        kept = g.Not(g.Equal(label, g.const(ignore, g.dtype(labels), "ignore_index")))
        picked = g.Mul(picked, g.Cast(kept, to=dtype))
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        coefficient = g.unsqueeze(dy, [1])
    elif reduction == "sum":
        coefficient = dy
    else:  # mean: divided by the total weight of the kept labels
        total = g.reduce("ReduceSum", picked, None, keepdims=0)
        coefficient = g.Div(dy, total)
    return g.Neg(g.Mul(picked, coefficient))


@grad_rule("NegativeLogLikelihoodLoss", since=13,
           notes="gradient wrt the input only; class weights are treated as constants")
def negative_log_likelihood_loss(g, node, dy):
    return node.grads(_nll_input_grad(g, node, dy, node.inputs[0]))


@grad_rule("SoftmaxCrossEntropyLoss", since=13,
           notes="gradient wrt the scores only; class weights are treated as constants")
def softmax_cross_entropy_loss(g, node, dy, dlog_prob=None):
    scores = node.inputs[0]
    terms = []
    if dy is not None:
        terms.append(_nll_input_grad(g, node, dy, scores))
    if dlog_prob is not None:
        terms.append(dlog_prob)
    grad = g.sum_of(terms)
    log_prob = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1] else None
    probabilities = g.Exp(log_prob) if log_prob else g.Softmax(scores, axis=1)
    total = g.reduce("ReduceSum", grad, [1], keepdims=1)
    return node.grads(g.Sub(grad, g.Mul(probabilities, total)))
