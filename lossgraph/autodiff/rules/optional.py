"""Optional values: unwrapping one is the identity on its element.

    OptionalGetElement(x)   y = x, a tensor (opset 18 takes tensors too):   dx = dy

A gradient cannot reach a value of optional type (the walker differentiates tensors),
so an ``Optional`` wrapping a weight blocks it, named as such.
"""

from __future__ import annotations

from ..registry import grad_rule


@grad_rule("OptionalGetElement", since=15, notes="identity on a tensor")
def optional_get_element(g, node, dy):
    return g.Identity(dy, hint="element_grad")
