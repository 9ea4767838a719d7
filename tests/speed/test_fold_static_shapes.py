"""FoldStaticShapes (lossgraph/speed/fold_static_shapes.py): shapes of static values fold to
constants until nothing changes, and what computed only for them goes; a symbolic batch's
are left to run time."""

from __future__ import annotations

import numpy as np
from support.models import model
from support.rewrites import ops

from lossgraph.speed import FoldStaticShapes


def test_shapes_of_static_values_fold_to_constants_until_nothing_changes(run_model):
    given = model("(float[4, 3] x) => (float[4, 3] y, int64 n, int64[1] last)",
                  """s = Shape(x)
                     n = Size(x)
                     last = Shape <start = -1> (x)
                     e = Expand(x, s)
                     y = Reshape(e, s)""")
    result = FoldStaticShapes()(given)
    assert result.changed
    assert ops(result.model.graph) == ["Constant", "Constant", "Constant", "Expand", "Identity"]
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = run_model(given, {"x": x})
    for name, value in run_model(result.model, {"x": x}).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert not FoldStaticShapes()(result.model).changed


def test_what_computed_only_for_a_folded_shape_goes_with_it(run_model):
    given = model("(float[4, 3] x) => (float[4, 3] y, int64[2] s)",
                  """t = Tanh(x)
                     s = Shape(t)
                     u = Exp(x)
                     k = Shape(u)
                     y = Reshape(x, k)""")
    result = FoldStaticShapes()(given)
    assert ops(result.model.graph) == ["Constant", "Identity"]
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = run_model(given, {"x": x})
    for name, value in run_model(result.model, {"x": x}).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_shapes_of_a_symbolic_batch_are_left_to_run_time():
    given = model("(float[N, 3] x) => (int64[2] s)", "s = Shape(x)")
    result = FoldStaticShapes()(given)
    assert not result.changed and ops(result.model.graph) == ["Shape"]
