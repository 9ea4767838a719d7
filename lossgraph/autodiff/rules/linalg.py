"""Matrix products.

    MatMul(a, b)                 da = dy b^T      db = a^T dy    (batched: summed to each
                                 operand's batch shape, over the batch axes it broadcasts,
                                 found at run time where not static; 1-D operands promoted
                                 then squeezed;
                                 2-D: as Gemm with transA/transB; db of a column b as
                                 the row-times-matrix product dy^T a, reshaped)
    Gemm(A, B, C, alpha, beta)   Y = alpha op(A) op(B) + beta C
                                 dA = alpha dy op(B)^T (transposed back if transA)
                                 dB = alpha op(A)^T dy (transposed back if transB)
                                 dC = beta dy, summed to C's shape
    Einsum(x1, ..., xn)          dxk = Einsum(dy, x1, ..., xn without xk) onto xk's subscripts:
                                 letters of xk found nowhere else are broadcast back (Expand);
                                 a letter repeated in xk (a diagonal) pairs with an identity
                                 matrix (static sizes only); ellipses become explicit letters,
                                 and size-1 ellipsis dims that broadcast are squeezed out first
                                 (their gradient is summed, then unsqueezed back); ellipsis
                                 dims of unknown size are summed where 1 at run time
    Det(X), X [*, M, M]          dX = dy C, C the cofactor matrix: C_ij = (-1)^(i+j) Det(X
                                 without row i and column j) (the adjugate transposed; exact
                                 for singular X too, unlike dy Det(X) X^-T); the (M, M)
                                 minors are gathered with constant row and column indices
                                 (static M); M = 1: dX = dy
"""

from __future__ import annotations

import string

import numpy as np
import onnx

from ...errors import UnsupportedModelError
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
        if rb == 1 or (g.shape(b) or [None, None])[-1] == 1:
            # b is a column (k, 1), as in a linear model: db = (dy^T a)^T, with dy^T and
            # the transposes back as free reshapes. onnxruntime's transposed-A Gemm with
            # one column is about 1.8x slower than this row-times-matrix product.
            db = g.Reshape(g.MatMul(g.Reshape(dy2, g.ints([1, -1])), a2), g.ints([-1, 1]))
        else:
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
    y = node.outputs[0]
    da = _to_operand(g, da, a, ra, out_rank, squeeze_axis=-2, output=y, batched=rb > 2)
    db = _to_operand(g, db, b, rb, out_rank, squeeze_axis=-1, output=y, batched=ra > 2)
    return da, db


def _to_operand(g, grad: str, operand: str, rank: int, out_rank: int, squeeze_axis: int,
                output: str, batched: bool) -> str:
    """``grad`` (shaped like the product's batch dims and ``operand``'s matrix dims) summed
    to ``operand``'s shape: over the leading batch axes it lacks and those it broadcasts
    (a static 1, or, where the dims are not static, a 1 found at run time). ``batched``:
    the other operand has batch dims too, so that ``output`` has ``out_rank`` dims."""
    if rank == 1:
        if out_rank > 2:
            grad = g.reduce("ReduceSum", grad, list(range(out_rank - 2)), keepdims=0)
        return g.squeeze(grad, [squeeze_axis + 2])
    shape = g.shape(operand)
    lead = out_rank - rank
    batch_ones = [lead + i for i, d in enumerate(shape[:-2]) if d == 1]
    if batch_ones and out_rank > 2:
        grad = g.reduce("ReduceSum", grad, batch_ones, keepdims=1)
    if batched and rank > 2:
        full = g.shape(output) or [None] * out_rank
        unknown = [lead + i for i, d in enumerate(shape[:-2]) if not isinstance(d, int)
                   and full[lead + i] != 1 and not (isinstance(d, str) and full[lead + i] == d)]
        if unknown:
            grad = g.sum_where_broadcast(grad, operand, output, unknown, lead)
    if lead > 0:
        grad = g.reduce("ReduceSum", grad, list(range(lead)), keepdims=0)
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
    return node.grads(da, db, dc)


def _terms(side: str) -> list[list[str]]:
    """Subscript terms as letter lists, ``...`` kept as one token."""
    return [list(t.replace("...", ".")) for t in side.split(",")]


@grad_rule("Einsum", notes="diagonals (repeated letters) need static sizes")
def einsum(g, node, dy):
    equation = node.attr("equation").replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = _terms(lhs)
    operands = node.inputs
    if len(terms) != len(operands):
        raise UnsupportedModelError(f"Einsum equation {equation!r} does not match its inputs.")
    # Ellipses become explicit letters, right-aligned as broadcasting aligns them.
    spare = iter(c for c in string.ascii_letters if c not in equation)
    ranks = [g.rank(x) for x in operands]  # a clear error when shape inference found none
    ellipsis_ranks = [r - (len(t) - 1) if "." in t else 0 for r, t in zip(ranks, terms)]
    batch = [next(spare) for _ in range(max(ellipsis_ranks, default=0))]

    def expand(term: list[str], rank: int) -> list[str]:
        if "." not in term:
            return term
        at = term.index(".")
        return term[:at] + batch[len(batch) - rank:] + term[at + 1:]

    terms = [expand(t, e) for t, e in zip(terms, ellipsis_ranks)]
    if arrow:
        out = expand(_terms(rhs)[0], len(batch))
    else:  # implicit output: the ellipsis, then letters used once, sorted
        letters = [c for t in _terms(lhs) for c in t if c != "."]
        out = batch + sorted(c for c in set(letters) if letters.count(c) == 1)

    # A size-1 ellipsis dim that broadcasts against a larger one is squeezed away:
    # a letter missing from an operand broadcasts the same way.
    sizes = [dict(zip(t, g.shape(x))) for t, x in zip(terms, operands)]
    squeezed, values = [], []
    for k, (x, term) in enumerate(zip(operands, terms)):
        axes = [i for i, c in enumerate(term) if c in batch and sizes[k][c] == 1
                and any(c in other and other[c] != 1 for other in sizes)]
        squeezed.append(axes)
        values.append(g.squeeze(x, axes) if axes else x)
        terms[k] = [c for i, c in enumerate(term) if i not in axes]

    grads = []
    for k, x in enumerate(operands):
        if g.elem_type(x) not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                                  onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            grads.append(None)
            continue
        grads.append(_einsum_operand_grad(g, node, dy, out, values, terms, k, spare, sizes[k]))
        unknown = _broadcast_at_run_time(terms[k], sizes, k, batch)
        if unknown:  # dims not static that may be 1 against a larger one: found at run time
            grads[k] = g.sum_where_broadcast(grads[k], values[k], grads[k], unknown, 0)
        if squeezed[k]:
            grads[k] = g.unsqueeze(grads[k], squeezed[k])
    return grads


def _broadcast_at_run_time(term: list[str], sizes: list[dict], k: int,
                           batch: list[str]) -> list[int]:
    """The axes of operand ``k`` (letters ``term``) that are ellipsis dims of unknown size
    which another operand may broadcast them against (its size there not 1, nor the same
    symbol)."""
    mine = sizes[k]
    return [i for i, c in enumerate(term) if c in batch and not isinstance(mine[c], int)
            and any(c in other and other[c] != 1
                    and not (isinstance(mine[c], str) and other[c] == mine[c])
                    for j, other in enumerate(sizes) if j != k)]


def _einsum_operand_grad(g, node, dy, out, values, terms, k, spare, sizes) -> str:
    x = node.inputs[k]
    inputs = [(dy, out)] + [(v, t) for j, (v, t) in enumerate(zip(values, terms)) if j != k]
    # Repeated letters (a diagonal): each repeat gets a fresh letter tied by an identity.
    target, seen = [], set()
    for c in terms[k]:
        if c in seen:
            size = sizes[c]
            if not isinstance(size, int):
                raise UnsupportedModelError(
                    f"The gradient of Einsum {node.attr('equation')!r} with respect to {x!r} "
                    f"needs the static size of its repeated subscript {c!r} (a diagonal); "
                    "shape inference found none.")
            fresh = next(spare)
            inputs.append((g.const(np.eye(size), g.dtype(x), "eye"), [c, fresh]))
            target.append(fresh)
        else:
            seen.add(c)
            target.append(c)
    scalars = [v for v, t in inputs if not t]
    inputs = [(v, t) for v, t in inputs if t]
    available = {c for _, t in inputs for c in t}
    kept = [c for c in target if c in available]
    if not inputs:
        grad = scalars.pop(0)
    elif len(inputs) == 1 and inputs[0][1] == kept:
        grad = inputs[0][0]
    else:
        equation = ",".join("".join(t) for _, t in inputs) + "->" + "".join(kept)
        grad = g.Einsum(*(v for v, _ in inputs), equation=equation)
    for scalar in scalars:
        grad = g.Mul(grad, scalar)
    missing = [i for i, c in enumerate(target) if c not in available]
    if missing:  # letters summed within this operand alone: broadcast back
        grad = g.Expand(g.unsqueeze(grad, missing), g.Shape(values[k]))
    return grad


@grad_rule("Det", notes="static matrix size; cofactors from the minors' determinants "
                        "(onnxruntime has float Det only)")
def det(g, node, dy):
    (x,) = node.inputs
    rank = g.rank(x)
    size = (g.shape(x) or [None])[-1]
    if not isinstance(size, int) or size < 1:
        raise UnsupportedModelError(
            f"The gradient of Det node {node.name or '<unnamed>'!r} needs the static matrix "
            f"size of {x!r}; shape inference found {g.shape(x)}. Give the model's inputs "
            "static shapes.")
    scattered = g.unsqueeze(dy, [rank - 2, rank - 1])  # [*, 1, 1]
    if size == 1:  # det of a 1 x 1 matrix is its element
        return scattered
    others = g.const([[k for k in range(size) if k != i] for i in range(size)], np.int64,
                     "minor_index")
    # Gather with the (M, M - 1) index: [*, M, M] -> [*, M, M - 1, M] -> [*, M, M-1, M, M-1]
    both = g.Gather(g.Gather(x, others, axis=rank - 2), others, axis=rank)
    b = rank - 2
    minors = g.Transpose(both, perm=[*range(b), b, b + 2, b + 1, b + 3])  # [*, i, j, minor]
    signs = (-1.0) ** np.add.outer(np.arange(size), np.arange(size))
    cofactors = g.Mul(g.Det(minors), g.const_like(signs, x, "cofactor_signs"))
    return g.Mul(cofactors, scattered)
