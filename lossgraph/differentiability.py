"""Which inputs of an op carry gradients, and which weights are trainable.

A tensor influences a loss *differentiably* when a chain of float tensors links
them and every link enters its node through a differentiable input. Shape, index,
axis, condition and count inputs never do. For an op with a gradient rule, its
registration says which (``@grad_rule("Gather", nondiff=(1,))``, see
:mod:`lossgraph.autodiff.registry`); :data:`NON_DIFFERENTIABLE_INPUTS` says it for
the ops without one. :func:`differentiable_inputs` answers for both, for
:func:`~lossgraph.trainable_initializers`, the analyses and the gradient walker.
"""

from __future__ import annotations

__all__ = ["NON_DIFFERENTIABLE_INPUTS", "NON_TRAINABLE_INPUTS", "differentiable_inputs"]

_ALL = frozenset(range(64))

#: op type -> input positions that never carry a gradient, for ops without a gradient
#: rule (the rules declare their own).
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    # shape-like and count inputs
    "Upsample": frozenset({1}),
    "ConstantOfShape": _ALL,
    "Range": _ALL,
    "Loop": frozenset({0, 1}),
    # ops whose outputs are not differentiable in their inputs at all
    "Shape": _ALL,
    "Size": _ALL,
    "ArgMax": _ALL,
    "ArgMin": _ALL,
    "NonZero": _ALL,
    "RandomNormalLike": _ALL,
    "RandomUniformLike": _ALL,
    "EyeLike": _ALL,
}

#: op type -> float inputs that carry a gradient but are not weights: statistics
#: (BatchNormalization's running mean and variance are updated, never trained) and
#: constants (class weights, one-hot values). The gradient pass differentiates them
#: when asked; ``trainable_initializers`` skips them.
NON_TRAINABLE_INPUTS: dict[str, frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),
    # class weights and one-hot values are constants of the loss or the encoding
    "SoftmaxCrossEntropyLoss": frozenset({2}),
    "NegativeLogLikelihoodLoss": frozenset({2}),
    "OneHot": frozenset({2}),
}


def differentiable_inputs(op_type: str, domain: str, arity: int, trainable: bool = False,
                          opset: int | None = None) -> list[int]:
    """Positions of the inputs of an ``op_type`` node (of ``domain``, at ``opset``) that
    may carry a gradient (``trainable``: and may be trained, which excludes
    :data:`NON_TRAINABLE_INPUTS`). Ops of other domains without a rule: every input."""
    # imported here: the autodiff package's walker imports the analyses built on this module
    from .autodiff.registry import nondiff_inputs

    skipped = nondiff_inputs(op_type, domain, opset)
    if skipped is None:
        standard = domain in ("", "ai.onnx")
        skipped = NON_DIFFERENTIABLE_INPUTS.get(op_type, frozenset()) if standard else frozenset()
    if trainable and domain in ("", "ai.onnx"):
        skipped = skipped | NON_TRAINABLE_INPUTS.get(op_type, frozenset())
    return [i for i in range(arity) if i not in skipped]
