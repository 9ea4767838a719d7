"""Matrix products.

    MatMul(a, b)                 da = dy b^T      db = a^T dy    (batched: summed to each
                                 operand's batch shape; 1-D operands promoted then squeezed;
                                 2-D: as Gemm with transA/transB)
    Gemm(A, B, C, alpha, beta)   Y = alpha op(A) op(B) + beta C
                                 dA = alpha dy op(B)^T (transposed back if transA)
                                 dB = alpha op(A)^T dy (transposed back if transB)
                                 dC = beta dy, summed to C's shape
"""

from __future__ import annotations

import onnx

from ..registry import grad_rule


def _swap_last(g, x: str, rank: int) -> str:
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return g.Transpose(x, perm=perm)


@grad_rule("MatMul")
def matmul(g, node, dy):
    a, b = node.inputs
    ra, rb = g.rank(a), g.rank(b)
    out_rank = max(ra, rb, 2)
    # Promote 1-D operands to matrices, as MatMul does, and dy to match.
    a2 = g.unsqueeze(a, [0]) if ra == 1 else a
    b2 = g.unsqueeze(b, [1]) if rb == 1 else b
    dy2 = dy
    if ra == 1 and rb == 1:
        dy2 = g.Reshape(dy, g.ints([1, 1]))
    elif ra == 1:
        dy2 = g.unsqueeze(dy, [g.rank(node.outputs[0]) - 1])
    elif rb == 1:
        dy2 = g.unsqueeze(dy, [g.rank(node.outputs[0])])
    if max(ra, 2) == max(rb, 2) == 2:
        # Gemm transposes for free; Transpose + MatMul would be fused by onnxruntime into
        # com.microsoft.FusedMatMul, which has no double kernel.
        da = g.Gemm(dy2, b2, transB=1)
        db = g.Gemm(a2, dy2, transA=1)
    elif g.elem_type(a) == onnx.TensorProto.DOUBLE:  # same reason, batched
        # Einsum's shape inference wants equal ranks under the ellipsis.
        a3 = g.unsqueeze(a2, list(range(out_rank - max(ra, 2)))) if max(ra, 2) < out_rank else a2
        b3 = g.unsqueeze(b2, list(range(out_rank - max(rb, 2)))) if max(rb, 2) < out_rank else b2
        da = g.Einsum(dy2, b3, equation="...ik,...jk->...ij")
        db = g.Einsum(a3, dy2, equation="...ki,...kj->...ij")
    else:
        da = g.MatMul(dy2, _swap_last(g, b2, max(rb, 2)))
        db = g.MatMul(_swap_last(g, a2, max(ra, 2)), dy2)
    # Sum broadcast batch axes away and undo the promotion.
    da = _to_operand(g, da, a, ra, out_rank, squeeze_axis=-2)
    db = _to_operand(g, db, b, rb, out_rank, squeeze_axis=-1)
    return da, db


def _to_operand(g, grad: str, operand: str, rank: int, out_rank: int, squeeze_axis: int) -> str:
    if rank == 1:
        if out_rank > 2:
            grad = g.reduce("ReduceSum", grad, list(range(out_rank - 2)), keepdims=0)
        return g.squeeze(grad, [squeeze_axis + 2])
    shape = g.shape(operand)
    lead = out_rank - rank
    if lead > 0:
        grad = g.reduce("ReduceSum", grad, list(range(lead)), keepdims=0)
    batch_ones = [i for i, d in enumerate(shape[:-2]) if d == 1]
    if batch_ones and out_rank > 2:
        grad = g.reduce("ReduceSum", grad, batch_ones, keepdims=1)
    return grad


@grad_rule("Gemm")
def gemm(g, node, dy):
    a, b = node.inputs[:2]
    c = node.input(2)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    trans_a, trans_b = node.attr("transA", 0), node.attr("transB", 0)
    alpha_attr = None if alpha == 1.0 else alpha
    # Y = op(A) op(B): d op(A) = alpha dy op(B)^T, d op(B) = alpha op(A)^T dy
    if trans_a:  # dA = (d op(A))^T = alpha op(B) dy^T
        da = g.Gemm(b, dy, transA=trans_b, transB=1, alpha=alpha_attr)
    else:
        da = g.Gemm(dy, b, transB=0 if trans_b else 1, alpha=alpha_attr)
    if trans_b:  # dB = (d op(B))^T = alpha dy^T op(A)
        db = g.Gemm(dy, a, transA=1, transB=trans_a, alpha=alpha_attr)
    else:
        db = g.Gemm(a, dy, transA=0 if trans_a else 1, alpha=alpha_attr)
    dc = None
    if c is not None:
        dc = dy if beta == 1.0 else g.Mul(dy, g.const_like(beta, c, "beta"))
        dc = g.unbroadcast(dc, c, node.outputs[0])
    return da, db, dc
