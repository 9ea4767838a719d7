"""SplitRowProducts (lossgraph/speed/split_row_products.py): a long one-row product, or a long
weight gradient's product, becomes a sum of batched parts of a measured size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import model
from support.rewrites import ops

from lossgraph.speed import SplitRowProducts
from lossgraph.speed.split_row_products import gradient_product_parts, row_product_parts


@pytest.mark.parametrize("rows, parts", [(1000, 4), (2000, 8), (1009, None), (500, None),
                                         (100, None)])
def test_row_product_parts_are_the_most_that_keep_250_rows_each(rows, parts):
    assert row_product_parts(rows) == parts


@pytest.mark.parametrize("rows, parts", [(1000, 4), (500, None)])
def test_a_long_one_row_product_is_a_sum_of_batched_parts(run_model, rows, parts):
    given = model(f"(float[1, {rows}] row, float[{rows}, 3] m) => (float[1, 3] y)",
                  "y = MatMul(row, m)")
    result = SplitRowProducts()(given)
    assert result.changed == bool(parts)
    if parts:
        assert ops(result.model.graph) == ["Reshape", "Reshape", "MatMul", "ReduceSum"]
        shapes = [onnx.numpy_helper.to_array(t).tolist() for t in result.model.graph.initializer]
        assert [parts, 1, rows // parts] in shapes and [parts, rows // parts, 3] in shapes
    rng = np.random.default_rng(0)
    feeds = {"row": rng.normal(size=(1, rows)).astype(np.float32),
             "m": rng.normal(size=(rows, 3)).astype(np.float32)}
    np.testing.assert_allclose(run_model(result.model, feeds)["y"], feeds["row"] @ feeds["m"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, parts", [(10000, 4), (5000, 2), (7500, 3), (20000, 4),
                                         (4999, None), (1000, None), (100, None)])
def test_gradient_product_parts_keep_2500_rows_each_at_most_4(rows, parts):
    assert gradient_product_parts(rows) == parts


@pytest.mark.parametrize("rows, attributes, parts", [
    (5000, "transA = 1", 2), (10000, "transA = 1, transB = 0, alpha = 1.0", 4),
    (5000, "transA = 1, alpha = 2.0", None), (1000, "transA = 1", None)])
def test_a_long_weight_gradient_product_is_a_sum_of_batched_parts(run_model, rows, attributes,
                                                                  parts):
    given = model(f"(float[{rows}, 5] a, float[{rows}, 3] b) => (float[5, 3] y)",
                  f"y = Gemm <{attributes}> (a, b)")
    result = SplitRowProducts()(given)
    assert result.changed == bool(parts)
    if parts:
        assert ops(result.model.graph) == ["Reshape", "Transpose", "Reshape", "MatMul",
                                           "ReduceSum"]
    rng = np.random.default_rng(0)
    feeds = {"a": rng.normal(size=(rows, 5)).astype(np.float32),
             "b": rng.normal(size=(rows, 3)).astype(np.float32)}
    alpha = 2.0 if "alpha = 2.0" in attributes else 1.0
    np.testing.assert_allclose(run_model(result.model, feeds)["y"],
                               alpha * feeds["a"].T @ feeds["b"], rtol=1e-4, atol=1e-4)


def test_a_row_of_ones_from_a_constant_shape_is_split_too(run_model):
    """SumRowsByProduct's ``ones`` comes from ConstantOfShape(Concat(...)): its shape is
    known only by propagating the constant's value."""
    given = model("(float[1000, 3] m) => (float[1, 3] y) <int64[1] one = {1}, "
                  "int64[1] n = {1000}>",
                  """shape = Concat <axis = 0> (one, n)
                     ones = ConstantOfShape <value = float[1] {1.0}> (shape)
                     y = MatMul(ones, m)""")
    result = SplitRowProducts()(given)
    assert result.changed and "ReduceSum" in ops(result.model.graph)
    m = np.random.default_rng(0).normal(size=(1000, 3)).astype(np.float32)
    np.testing.assert_allclose(run_model(result.model, {"m": m})["y"], m.sum(0, keepdims=True),
                               rtol=1e-4, atol=1e-4)
