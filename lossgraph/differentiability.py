"""Which inputs of an op carry gradients, and which weights are trainable.

A tensor influences a loss *differentiably* when a chain of float tensors links
them and every link enters its node through a differentiable input. Shape, index,
axis, condition and count inputs never do. For an op with a gradient rule, its
registration says which (``@grad_rule("Gather", nondiff=(1,))``, see
:mod:`lossgraph.autodiff.registry`); :data:`NON_DIFFERENTIABLE_INPUTS` says it for
the ops without one, and :data:`NOT_DIFFERENTIABLE` names the ops (of any domain)
whose outputs have no derivative worth having, with the reason.
:func:`differentiable_inputs` answers for all of them, for
:func:`~lossgraph.trainable_initializers`, the analyses and the gradient walker.
"""

from __future__ import annotations

__all__ = ["NON_DIFFERENTIABLE_INPUTS", "NON_TRAINABLE_INPUTS", "NOT_DIFFERENTIABLE",
           "differentiable_inputs", "not_differentiable_reason", "zero_gradient_op"]

_ALL = frozenset(range(64))

#: op type -> input positions that never carry a gradient, for ops without a gradient
#: rule (the rules declare their own).
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    # shape-like and count inputs
    "Upsample": frozenset({1}),
    "ConstantOfShape": _ALL,
    "Range": _ALL,
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

#: (domain, op type) -> why no input of the op carries a gradient: ops without a rule
#: whose outputs have no derivative worth having (any domain; "" is ai.onnx).
NOT_DIFFERENTIABLE: dict[tuple[str, str], str] = {
    ("", "Unique"): "its outputs change shape when a repeated value moves (the values "
                    "split); a derivative exists only without repeats, where Unique merely "
                    "sorts (use TopK or Gather there)",
    ("", "Bernoulli"): "a random draw of 0 or 1, piecewise constant in the probabilities",
    ("", "MelWeightMatrix"): "piecewise constant in the edge frequencies: the triangles' "
                             "corners are rounded to whole DFT bins",
    ("ai.onnx.ml", "TreeEnsemble"): "piecewise constant in X, and its leaf values are "
                                    "attributes, not tensors a gradient could train",
    ("ai.onnx.ml", "TreeEnsembleRegressor"): "piecewise constant in X, and its leaf values "
                                             "are attributes",
    ("ai.onnx.ml", "TreeEnsembleClassifier"): "piecewise constant in X, and its leaf values "
                                              "are attributes",
    ("", "QuantizeLinear"): "its output is rounded; to train through a QuantizeLinear -> "
                            "DequantizeLinear pair, use the straight-through estimator: "
                            "lossgraph.passes.straight_through_quantization(model)",
    **{("ai.onnx.preview.training", op): "an optimizer's update step: lossgraph emits its "
                                          "own updates after the gradient and does not "
                                          "differentiate through one (meta-learning)"
       for op in ("Adagrad", "Adam", "Momentum")},
}

#: op type (of ai.onnx; (domain, op type) for others) -> float inputs that carry a
#: gradient but are not weights: statistics (BatchNormalization's running mean and
#: variance are updated, never trained), constants (class weights, one-hot values) and
#: the scales of a fake quantization (fixed, as torch's FakeQuantize keeps them). The
#: gradient pass differentiates them when asked; ``trainable_initializers`` skips them.
NON_TRAINABLE_INPUTS: dict[str | tuple[str, str], frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),
    # class weights and one-hot values are constants of the loss or the encoding
    "SoftmaxCrossEntropyLoss": frozenset({2}),
    "NegativeLogLikelihoodLoss": frozenset({2}),
    "OneHot": frozenset({2}),
    # lossgraph.passes.StraightThroughQuantization's fake quantization
    ("lossgraph", "FakeQuantizeLinear"): frozenset({1}),
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
        if not_differentiable_reason(op_type, domain) is not None:
            skipped = _ALL
    if trainable:
        key = op_type if domain in ("", "ai.onnx") else (domain, op_type)
        skipped = skipped | NON_TRAINABLE_INPUTS.get(key, frozenset())
    return [i for i in range(arity) if i not in skipped]


def not_differentiable_reason(op_type: str, domain: str = "", position: int | None = None,
                              opset: int | None = None) -> str | None:
    """Why input ``position`` of ``domain::op_type`` (at ``opset``) carries no gradient,
    where its rule's ``nondiff`` declaration says; else why no input of the op does
    (:data:`NOT_DIFFERENTIABLE`); else ``None``."""
    from .autodiff.registry import find_rule

    if position is not None:
        info = find_rule(op_type, domain, opset) if opset is not None else None
        reason = info.nondiff_reason(position) if info is not None else None
        if reason is not None:
            return reason
    return NOT_DIFFERENTIABLE.get(("" if domain == "ai.onnx" else domain, op_type))


def zero_gradient_op(op_type: str, domain: str = "", opset: int | None = None) -> bool:
    """True when ``domain::op_type`` (at ``opset``) has a derivative that is zero wherever it
    exists (declared with :func:`lossgraph.autodiff.registry.zero_gradient`)."""
    from .autodiff.registry import find_rule

    info = find_rule(op_type, domain, opset) if opset is not None else None
    return info is not None and info.zero
