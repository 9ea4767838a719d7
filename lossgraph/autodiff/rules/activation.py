"""Activations.

    Relu(x)   dx = dy * (x > 0)      (Mul by a Cast mask: Where is slow in onnxruntime 1.19)
"""

from __future__ import annotations

from ..registry import grad_rule


@grad_rule("Relu")
def relu(g, node, dy):
    (x,) = node.inputs
    mask = g.Cast(g.Greater(x, g.const_like(0, x, "zero")), to=g.elem_type(x))
    return g.Mul(dy, mask)
