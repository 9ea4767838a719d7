"""``ai.onnx.ml`` ops that remain after :class:`~lossgraph.passes.LowerMlOps`.

    ArrayFeatureExtractor(X, i)   y = X[..., i] (i flattened; a 1-D X gives one row):
                                  dX = dy' M, dy' the gradient as (rows, k), M the (k, F)
                                  one-hot matrix of i (repeated indices add up)
    Binarizer(X; threshold)       y = [X > threshold]: dX = 0 (piecewise constant; no
                                  derivative at the threshold)

TreeEnsemble (and the older TreeEnsembleRegressor/Classifier) are piecewise constant in
X too, but are declared not differentiable instead (:func:`not_differentiable`): their
parameters, the leaf values, are attributes that no gradient can train, and a zero
gradient would let the weights before a tree train on nothing, silently.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..registry import grad_rule, not_differentiable, zero_gradient

not_differentiable("TreeEnsemble", "piecewise constant in X, and its leaf values are attributes, "
                                   "not tensors a gradient could train", domain="ai.onnx.ml")
for _legacy in ("TreeEnsembleRegressor", "TreeEnsembleClassifier"):
    not_differentiable(_legacy, "piecewise constant in X, and its leaf values are attributes",
                       domain="ai.onnx.ml")


@grad_rule("ArrayFeatureExtractor", domain="ai.onnx.ml", nondiff=(1,),
           notes="a gather along the last axis; repeated indices add up")
def array_feature_extractor(g, node, dy):
    x, indices = node.inputs
    shape = g.shape(x)
    width = shape[-1] if shape else None
    depth = (g.const(width, np.int64, "features") if isinstance(width, int)
             else g.Gather(g.Shape(x), g.const(-1, np.int64, "last"), axis=0))
    flat = g.Reshape(indices, g.ints([-1], "flat"))
    if g.elem_type(indices) != onnx.TensorProto.INT64:
        flat = g.Cast(flat, to=onnx.TensorProto.INT64)
    one_hot = g.OneHot(flat, depth, g.const([0, 1], np.float32, "off_on"), axis=-1)
    if g.elem_type(x) != onnx.TensorProto.FLOAT:
        one_hot = g.Cast(one_hot, to=g.elem_type(x))
    rows = g.Reshape(dy, g.Concat(g.ints([-1], "rows"), g.Shape(flat), axis=0))
    return node.grads(g.Reshape(g.MatMul(rows, one_hot), g.Shape(x), hint="afe_dx"))


zero_gradient("Binarizer", domain="ai.onnx.ml")
