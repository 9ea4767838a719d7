"""SumRowsByProduct (lossgraph/speed/sum_rows.py): a sum over leading axes becomes a product
with a row of ones, shared by the sums of one batch, bit for bit what ones times rows computes;
other sums are left as they are."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import model
from support.rewrites import ops

import lossgraph
from lossgraph.optim import Momentum
from lossgraph.speed import SumRowsByProduct


def sum_model(x_type: str, axes: str, target: str, out_type: str, *, keepdims: int = 0,
              opset: int = 18) -> onnx.ModelProto:
    """``y = Reshape(ReduceSum(x, axes, keepdims), target)``: the sum a bias gradient is."""
    return model(f"({x_type} x) => ({out_type} y) <int64[{axes.count(',') + 1}] axes = {{{axes}}},"
                 f" int64[{target.count(',') + 1 if target else 0}] target = {{{target}}}>",
                 f"""t = ReduceSum <keepdims = {keepdims}> (x, axes)
                     y = Reshape(t, target)""", opset=opset)


@pytest.mark.parametrize("x_shape, axes, target, expected_ops", [
    ((7, 3), "0", "3", ["Shape", "Concat", "ConstantOfShape", "MatMul", "Reshape"]),
    ((7, 3), "0", "1, 3", ["Shape", "Concat", "ConstantOfShape", "MatMul"]),
    ((7, 5, 2), "0, 1", "2", ["Reshape", "Shape", "ReduceProd", "Concat", "ConstantOfShape",
                              "MatMul", "Reshape"]),
    ((7, 4, 3), "0", "4, 3", ["Reshape", "Shape", "Concat", "ConstantOfShape", "MatMul",
                              "Reshape"]),
    ((7, 1), "0", "1", ["ReduceSum", "Reshape"]),
    ((7,), "0", "", ["ReduceSum"]),
])
def test_a_sum_over_leading_axes_becomes_a_product_with_a_row_of_ones(run_model, x_shape, axes,
                                                                       target, expected_ops):
    x_type = f"float[N, {', '.join(map(str, x_shape[1:]))}]" if len(x_shape) > 1 else "float[N]"
    out_type = f"float[{target}]" if target else "float"
    given = sum_model(x_type, axes, target, out_type)
    result = SumRowsByProduct()(given)
    assert result.changed
    assert ops(result.model.graph) == expected_ops
    assert {t.name for t in result.model.graph.initializer}.isdisjoint({"axes", "target"})
    x = np.random.default_rng(1).normal(size=x_shape).astype(np.float32)
    got = run_model(result.model, {"x": x})["y"]
    leading = len(axes.split(","))
    want = x.sum(axis=tuple(range(leading))).reshape([int(d) for d in target.split(",")]
                                                     if target else [])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_product_computes_bit_for_bit_what_ones_times_rows_does(run_model):
    """The rewrite is exactly the bias-sum form: a row of ones times the rows."""
    rewritten = SumRowsByProduct()(sum_model("float[N, 3]", "0", "3", "float[3]")).model
    by_hand = model("(float[N, 3] x) => (float[3] y) <int64[1] one = {1}, int64[1] three = {3}>",
                    """n = Shape <start = 0, end = 1> (x)
                       size = Concat <axis = 0> (one, n)
                       ones = ConstantOfShape <value = float[1] {1}> (size)
                       total = MatMul(ones, x)
                       y = Reshape(total, three)""")
    x = np.random.default_rng(2).normal(size=(1000, 3)).astype(np.float32)
    np.testing.assert_array_equal(run_model(rewritten, {"x": x})["y"],
                                  run_model(by_hand, {"x": x})["y"])


def test_sums_of_rows_of_the_same_batch_share_their_row_of_ones():
    given = model("(float[N, 3] x, float[N, 2] z) => (float[3] a, float[2] b) "
                  "<int64[1] axes = {0}, int64[1] three = {3}, int64[1] two = {2}>",
                  """s = ReduceSum <keepdims = 0> (x, axes)
                     a = Reshape(s, three)
                     t = ReduceSum <keepdims = 0> (z, axes)
                     b = Reshape(t, two)""")
    rewritten = SumRowsByProduct()(given).model
    assert ops(rewritten.graph).count("ConstantOfShape") == 1
    assert ops(rewritten.graph).count("MatMul") == 2


@pytest.mark.parametrize("why, signature, body", [
    ("keepdims=1", "(float[N, 3] x) => (float[3] y)",
     "t = ReduceSum <keepdims = 1> (x, axes)\n y = Reshape(t, target)"),
    ("not the leading axes", "(float[N, 3] x) => (float[N] y)",
     "t = ReduceSum <keepdims = 0> (x, last)\n y = Reshape(t, rows)"),
    ("no Reshape after it", "(float[N, 3] x) => (float[3] y)",
     "y = ReduceSum <keepdims = 0> (x, axes)"),
    ("read twice", "(float[N, 3] x) => (float[3] y, float[3] t)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, target)"),
    ("shape computed at run time", "(float[N, 3] x, int64[1] shape) => (float[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, shape)"),
    ("a -1 in the shape", "(float[N, 3] x) => (float[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, any)"),
    ("integers", "(int64[N, 3] x) => (int64[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, target)"),
])
def test_other_sums_are_left_as_they_are(why, signature, body):
    given = model(f"{signature} <int64[1] axes = {{0}}, int64[1] last = {{1}}, "
                  "int64[1] target = {3}, int64[1] rows = {-1}, int64[1] any = {-1}>", body)
    result = SumRowsByProduct()(given)
    assert not result.changed, why
    assert ops(result.model.graph) == ops(given.graph)


@pytest.mark.parametrize("outputs, fast_ops", [
    (3, ["Shape", "Concat", "ConstantOfShape", "MatMul", "Reshape"]),
    (1, ["ReduceSum", "Reshape"]),  # one column: summed whole
])
def test_a_bias_gradient_is_a_plain_sum_until_the_pass_rewrites_it(run_model, outputs,
                                                                   fast_ops):
    """The rule emits the mathematics, ``Reshape(ReduceSum(dy, axes=0), b's shape)``;
    the pass turns it into the form onnxruntime runs fastest, which compile applies."""
    w = ", ".join(str(v) for v in range(4 * outputs))
    b = ", ".join(str(v / 10) for v in range(outputs))
    given = model(f"(float[N, 4] x) => (float[N, {outputs}] y) "
                  f"<float[4, {outputs}] w = {{{w}}}, float[{outputs}] b = {{{b}}}>",
                  "h = MatMul(x, w)\n y = Add(h, b)")
    plain = lossgraph.gradient(given, outputs=["y"], weights=["b"])
    assert ops(plain.graph) == ["MatMul", "Add", "ReduceSum", "Reshape"]
    reduce_sum = plain.graph.node[2]
    assert reduce_sum.input[0] == "y_grad"
    assert onnx.helper.get_attribute_value(reduce_sum.attribute[0]) == 0  # keepdims
    fast = SumRowsByProduct()(plain).model
    assert ops(fast.graph) == ["MatMul", "Add", *fast_ops]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.normal(size=(50, 4)).astype(np.float32),
             "y_grad": rng.normal(size=(50, outputs)).astype(np.float32)}
    np.testing.assert_allclose(run_model(fast, feeds)["b_grad"], feeds["y_grad"].sum(axis=0),
                               rtol=1e-5, atol=1e-5)
    compiled = lossgraph.compile_program(given, optimizer=Momentum(0.1)).graphs["train_step"]
    assert ("ConstantOfShape" in ops(compiled.graph)) == (outputs > 1)  # compile runs the pass
