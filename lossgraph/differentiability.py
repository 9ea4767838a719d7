"""Which inputs of an op carry gradients, and which weights are trainable.

A tensor influences a loss *differentiably* when a chain of float tensors links
them and every link enters its node through a differentiable input. Shape, index,
axis, condition and count inputs never do. This table is the single source of
that knowledge for :func:`trainable_initializers` and the gradient pass.
"""

from __future__ import annotations

__all__ = ["NON_DIFFERENTIABLE_INPUTS", "NON_TRAINABLE_INPUTS", "differentiable_inputs"]

_ALL = frozenset(range(64))

#: op type -> input positions that never carry a gradient.
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    # shape-like, index-like and axis inputs
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Pad": frozenset({1, 3}),
    "Gather": frozenset({1}),
    "GatherElements": frozenset({1}),
    "GatherND": frozenset({1}),
    "ScatterElements": frozenset({1}),
    "ScatterND": frozenset({1}),
    "Split": frozenset({1}),
    "TopK": frozenset({1}),
    "CumSum": frozenset({1}),
    "Trilu": frozenset({1}),
    "Resize": frozenset({1, 2, 3}),
    "ReverseSequence": frozenset({1}),
    "Upsample": frozenset({1}),
    "OneHot": frozenset({0, 1}),
    "ConstantOfShape": _ALL,
    "Range": _ALL,
    "ReduceSum": frozenset({1}),
    "ReduceMean": frozenset({1}),
    "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}),
    "ReduceProd": frozenset({1}),
    "ReduceL1": frozenset({1}),
    "ReduceL2": frozenset({1}),
    "ReduceSumSquare": frozenset({1}),
    "ReduceLogSum": frozenset({1}),
    "ReduceLogSumExp": frozenset({1}),
    "SoftmaxCrossEntropyLoss": frozenset({1}),
    "NegativeLogLikelihoodLoss": frozenset({1}),
    "Where": frozenset({0}),
    "CastLike": frozenset({1}),
    "If": frozenset({0}),
    "Loop": frozenset({0, 1}),
    "Dropout": frozenset({1, 2}),
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


def differentiable_inputs(op_type: str, domain: str, arity: int,
                          trainable: bool = False) -> list[int]:
    """Positions of the inputs of an ``op_type`` node that may carry a gradient
    (``trainable``: and may be trained, which excludes :data:`NON_TRAINABLE_INPUTS`)."""
    if domain not in ("", "ai.onnx"):
        return list(range(arity))
    skipped = NON_DIFFERENTIABLE_INPUTS.get(op_type, frozenset())
    if trainable:
        skipped = skipped | NON_TRAINABLE_INPUTS.get(op_type, frozenset())
    return [i for i in range(arity) if i not in skipped]
