"""Gradients of the ai.onnx.ml ops ArrayFeatureExtractor and Binarizer
(lossgraph/autodiff/rules/ml.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import cotangent, finite_differences, loss_model
from support.models import dims, model

import lossgraph
from lossgraph.runtime.session import create_session

F32, F64 = np.float32, np.float64


def _check_with_foreign_forward(net: onnx.ModelProto, feeds: dict, reference: dict,
                                eps: float = 1e-6, rtol: float = 1e-6,
                                atol: float = 1e-7) -> dict[str, np.ndarray]:
    """The gradient of sum(y R) against central differences and ``reference``, for a
    forward of another domain (gradcheck.check_gradients wants every node standard;
    the gradient's own nodes are)."""
    with_loss = loss_model(net, feeds)
    graph = lossgraph.gradient(with_loss, weights=list(reference), loss_name="gradcheck_loss")
    forward_nodes = len(with_loss.graph.node)
    assert all(n.domain in ("", "ai.onnx") for n in graph.graph.node[forward_nodes:])
    got = dict(zip(reference, create_session(graph).run([f"{w}_grad" for w in reference],
                                                          feeds)))
    for w, expected in reference.items():
        numeric = finite_differences(with_loss, feeds, w, eps)
        np.testing.assert_allclose(got[w], numeric, rtol=rtol, atol=atol, err_msg=w)
        np.testing.assert_allclose(got[w], expected, rtol=rtol, atol=atol, err_msg=w)
    return got


@pytest.mark.parametrize("shape, indices", [((3, 5), [4, 0, 4]), ((2, 2, 4), [1]),
                                            ((5,), [3, 3, 0])])
def test_array_feature_extractor_gradient_gathers_back(rng, shape, indices):
    x = rng.normal(size=shape)
    out = (*shape[:-1], len(indices)) if len(shape) > 1 else (1, len(indices))
    net = model(f"(double[{dims(shape)}] x) => (double[{dims(out)}] y) "
                f"<int64[{len(indices)}] i = {{{', '.join(map(str, indices))}}}>",
                "y = ai.onnx.ml.ArrayFeatureExtractor(x, i)", opset=18, domains={"ai.onnx.ml": 3})
    r = cotangent(out, F64).reshape(*shape[:-1], len(indices))
    expected = np.zeros(shape)
    for k, index in enumerate(indices):
        expected[..., index] += r[..., k]
    _check_with_foreign_forward(net, {"x": x}, {"x": expected})


def test_binarizer_gradient_is_zero(rng):
    """onnxruntime's Binarizer is float32 only."""
    x = rng.normal(size=(3, 4)).astype(F32)
    x[np.abs(x - 0.1) < 0.05] = 0.5  # away from the threshold
    net = model("(float[3, 4] x) => (float[3, 4] y)",
                "y = ai.onnx.ml.Binarizer <threshold = 0.1> (x)", opset=18,
                domains={"ai.onnx.ml": 3})
    _check_with_foreign_forward(net, {"x": x}, {"x": np.zeros_like(x)}, eps=1e-3)
