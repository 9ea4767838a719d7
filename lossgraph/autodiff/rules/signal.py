"""Signal processing: the DFT is linear, its gradient is the adjoint transform.

Along ``axis``, with ``n`` the DFT length (``dft_length``, default the input's length
``L``; its one-sided inverse: ``2 (L - 1)``), ``F`` the n-point DFT matrix
(``F_kt = exp(-2 pi i k t / n)``) and ``P`` the input zero-padded or cut to ``n``::

    DFT(x)                          y = F P x             dx = P^T F^H dy
    DFT(x; onesided=1)              y = S F P x           dx = P^T F^H S^T dy
    DFT(x; inverse=1)               y = F^H P x / n       dx = P^T F dy / n
    DFT(x; inverse=1, onesided=1)   y = Re(F^H E P x) / n dx = P^T (c / n) S F dy

``F^H w = n IDFT(w)`` and ``F w = DFT(w)``, so each gradient is one DFT node of the
other direction (same ``axis`` and ``n``). ``S`` keeps the first ``n // 2 + 1``
frequencies (``S^T`` pads with zeros); for the one-sided inverse (``irfft``) ``E``
extends a half spectrum by conjugate symmetry, whose adjoint weighs frequency ``k`` by
``c_k = 2`` except ``c_0 = 1`` and, for even ``n``, ``c_{n/2} = 1`` (the imaginary parts
the forward ignores get zero). A real input (last dim 1) takes the real part of its
gradient. The DFT length and the signal's length along ``axis`` must be static.

``MelWeightMatrix`` is declared not differentiable.
"""

from __future__ import annotations

import numpy as np

from ...errors import UnsupportedModelError
from ..registry import grad_rule, not_differentiable

not_differentiable("MelWeightMatrix", "piecewise constant in the edge frequencies: the "
                                      "triangles' corners are rounded to whole DFT bins")


def _static_length(g, node, x: str, axis: int) -> int:
    shape = g.shape(x)
    size = shape[axis] if shape is not None else None
    if not isinstance(size, int):
        raise UnsupportedModelError(
            f"The gradient of DFT node {node.name or '<unnamed>'!r} needs the static length of "
            f"{x!r} along axis {axis}; shape inference found {shape}. Give the signal a static "
            "length.")
    return size


def _fit(g, value: str, axis: int, have: int, want: int, rank: int) -> str:
    """``value`` cut or zero-padded along ``axis`` from ``have`` to ``want`` entries."""
    if want < have:
        return g.Slice(value, g.ints([0], "starts"), g.ints([want], "ends"),
                       g.ints([axis], "axes"))
    if want > have:
        pads = [0] * (2 * rank)
        pads[rank + axis] = want - have
        return g.Pad(value, g.ints(pads, "pads"), mode="constant")
    return value


@grad_rule("DFT", since=17, nondiff=(1, 2),
           notes="the adjoint DFT; forward, inverse, one-sided (rfft, irfft), dft_length; "
                 "static signal length")
def dft(g, node, dy):
    x = node.inputs[0]
    rank = g.rank(x)
    if node.opset >= 20:
        axis_input = node.input(2)
        axis = g.ints_value(axis_input, "the DFT axis")[0] if axis_input else -2
    else:
        axis = node.attr("axis", 1)
    axis %= rank
    inverse, onesided = node.attr("inverse", 0), node.attr("onesided", 0)
    length = _static_length(g, node, x, axis)
    if node.input(1):
        n = g.ints_value(node.input(1), "the DFT length (dft_length)")[0]
    else:
        n = 2 * (length - 1) if inverse and onesided else length
    half = n // 2 + 1
    real_input = (g.shape(x) or [None])[-1] == 1
    dft_length = g.const(np.array(n), np.int64, "dft_length")
    axis_args = ({"axis": axis} if node.opset < 20 else {})
    axis_input = [g.const(np.array(axis), np.int64, "dft_axis")] if node.opset >= 20 else []

    def transform(value: str, inverse_flag: int, onesided_flag: int = 0) -> str:
        return g.DFT(value, dft_length, *axis_input, inverse=inverse_flag,
                     onesided=onesided_flag or None, hint="dft_grad", **axis_args)

    if inverse and onesided:  # y real, length n; x a half spectrum
        weights = np.full(half, 2.0)
        weights[0] = 1.0
        if n % 2 == 0:
            weights[-1] = 1.0
        shape = [1] * rank
        shape[axis] = half
        spectrum = transform(dy, 0, 1)  # (..., half, ..., 2)
        grad = g.Mul(spectrum, g.const_like((weights / n).reshape(shape), x, "irfft_weights"))
        grad_length = half
    elif inverse:  # y = F^H P x / n
        grad = g.Div(transform(dy, 0), g.const_like(n, x, "dft_length_f"))
        grad_length = n
    else:  # y = [S] F P x
        padded = _fit(g, dy, axis, half, n, rank) if onesided else dy
        grad = g.Mul(transform(padded, 1), g.const_like(n, x, "dft_length_f"))
        grad_length = n
    if real_input:
        grad = g.Slice(grad, g.ints([0], "starts"), g.ints([1], "ends"),
                       g.ints([rank - 1], "axes"), hint="real_part")
    return node.grads(_fit(g, grad, axis, grad_length, length, rank))
