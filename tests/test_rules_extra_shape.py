"""Gradient of CenterCropPad (lossgraph/autodiff/rules/shape.py): pad what was cropped,
crop what was padded."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients, cotangent
from support.models import dims, model


def rand(rng, *shape):
    return rng.normal(size=shape)


CASES = [  # x shape, target sizes, axes
    ((5, 6), [3, 6], None),           # crop, even difference
    ((5, 6), [2, 6], None),           # crop, odd difference: the window starts left
    ((3, 4), [6, 4], None),           # pad, odd difference: the extra zero is right
    ((3, 4), [7, 2], None),           # pad one axis, crop the other
    ((2, 5, 4, 3), [2, 7], [1, 2]),   # axes
    ((4, 5, 3), [3, 4], [-3, -2]),    # negative axes (an HWC image)
]


@pytest.mark.parametrize("shape, sizes, axes", CASES)
def test_center_crop_pad_gradient_is_its_adjoint(rng, shape, sizes, axes):
    x = rand(rng, *shape)
    attrs = "" if axes is None else f"<axes = [{dims(axes)}]>"
    evaluator_model = model(
        f"(double[{dims(shape)}] x, int64[{len(sizes)}] s) => (double y)",
        f"y = CenterCropPad {attrs} (x, s)")
    s = np.array(sizes, dtype=np.int64)
    y = ReferenceEvaluator(evaluator_model).run(None, {"x": x, "s": s})[0]
    net = model(f"(double[{dims(shape)}] x, int64[{len(sizes)}] s) => "
                f"(double[{dims(y.shape)}] y)", f"y = CenterCropPad {attrs} (x, s)")
    # the adjoint of a linear map: <dy, A e_k> for every unit vector e_k of x
    r = cotangent(y.shape, np.float64)
    evaluator = ReferenceEvaluator(evaluator_model)
    expected = np.zeros(x.shape)
    for k in np.ndindex(x.shape):
        unit = np.zeros(x.shape)
        unit[k] = 1
        expected[k] = np.sum(r * evaluator.run(None, {"x": unit, "s": s})[0])
    check_gradients(net, {"x": x, "s": s}, wrt=["x"], reference={"x": expected})


def test_center_crop_pad_gradient_with_dims_known_at_run_time_only(rng):
    x = rand(rng, 3, 6)
    net = model("(double[N, M] x, int64[2] s) => (double[P, Q] y)",
                "y = CenterCropPad (x, s)")
    check_gradients(net, {"x": x, "s": np.array([6, 3])}, wrt=["x"])
