"""``ai.onnx.preview.training``'s optimizer ops are declared not differentiable.

An ``Adagrad``, ``Adam`` or ``Momentum`` node is an optimizer's update step: lossgraph emits
its own updates after the gradient and does not differentiate through one (that would be
meta-learning).
"""

from __future__ import annotations

from ..registry import not_differentiable

for _op in ("Adagrad", "Adam", "Momentum"):
    not_differentiable(_op, "an optimizer's update step: lossgraph emits its own updates after "
                            "the gradient and does not differentiate through one "
                            "(meta-learning)", domain="ai.onnx.preview.training")
