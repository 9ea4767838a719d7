"""Gradient of TensorScatter (lossgraph/autodiff/rules/cache.py), a key-value cache's update.

TensorScatter is of opset 24, which loads only in onnxruntime 1.20 and later: checked
against finite differences there (skipped with the training build)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator
from support.environment import newer_runtime
from support.gradcheck import check_gradients
from support.models import dims, model, signature

F64 = np.float64

SCATTER_CASES = [
    ((2, 6, 3), (2, 2, 3), "linear", -2, [1, 4]),
    ((2, 5, 3), (2, 3, 3), "circular", -2, [3, 0]),
    ((2, 3, 6), (2, 3, 4), "circular", 2, [5, 1]),  # wraps around
    ((2, 2, 5, 3), (2, 2, 2, 3), "linear", 2, None),  # no write indices: from 0
]


@pytest.mark.parametrize("cache, update, mode, axis, writes", SCATTER_CASES)
def test_tensor_scatter_gradient_matches_finite_differences(rng, cache, update, mode, axis,
                                                            writes):
    feeds = {"past": rng.normal(size=cache), "u": rng.normal(size=update)}
    args = "past, u"
    sig = signature(feeds, f"double[{dims(cache)}] y")
    if writes is not None:
        sig += f" <int64[2] w = {{{', '.join(map(str, writes))}}}>"
        args += ", w"
    net = model(sig, f'y = TensorScatter <mode = "{mode}", axis = {axis}> ({args})', opset=24)
    with newer_runtime():
        grads = check_gradients(net, feeds)
    ones = {"past": np.ones(cache), "u": np.zeros(update)}
    written = np.asarray(ReferenceEvaluator(net).run(None, ones)[0]) == 0
    np.testing.assert_array_equal(grads["past"][written], 0)  # overwritten: no gradient
    assert np.all(grads["past"][~written] != 0)
