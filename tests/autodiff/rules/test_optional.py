"""Gradient of the optional ops (lossgraph/autodiff/rules/optional.py)."""

from __future__ import annotations

import numpy as np
from support.gradcheck import check_gradients, cotangent
from support.models import model

F64 = np.float64


def test_optional_get_element_of_a_tensor_is_the_identity(rng):
    x = rng.normal(size=(4,))
    net = model("(double[4] x) => (double[4] y)", "e = OptionalGetElement(x) y = Sin(e)",
                opset=18)
    check_gradients(net, {"x": x}, reference={"x": np.cos(x) * cotangent(x.shape, F64)})
