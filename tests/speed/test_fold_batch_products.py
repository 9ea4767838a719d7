"""FoldBatchIntoProducts (lossgraph/speed/fold_batch_products.py): a sequence weight's gradient,
a batched product, becomes one product over all rows (a Gemm) and computes the same, also
where the batch of one operand is not known to be the other's; a product whose batch dims
agree only after broadcasting keeps its form, or, where shape inference cannot tell, is
refused by onnxruntime rather than summed wrong."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.rewrites import plain_and_rewritten, same_outputs

from lossgraph.runtime.session import create_session
from lossgraph.speed import FoldBatchIntoProducts

F32 = np.float32

SEQUENCE_LINEAR = """<ir_version: 8, opset_import: ["" : 17]>
g ({x_type} x, float[{d}, 3] w, float[3] b) => (float loss) {{
    h = MatMul(x, w)  y = Add(h, b)  s = Sin(y)  loss = ReduceSum<keepdims=0>(s)
}}"""


@pytest.mark.parametrize("x_type, shape", [("float[N, 5, 4]", (6, 5, 4)),
                                           ("float[2, 3, 5, 4]", (2, 3, 5, 4)),
                                           ("float[N, S, 4]", (3, 7, 4))])
def test_a_sequence_weight_gradient_is_one_product_over_all_rows(rng, x_type, shape):
    plain, result = plain_and_rewritten(SEQUENCE_LINEAR.format(x_type=x_type, d=4),
                                         ["w", "b", "x"], FoldBatchIntoProducts())
    assert result.changed
    assert "Gemm" in {n.op_type for n in result.model.graph.node}
    feeds = {"x": rng.normal(size=shape).astype(F32), "w": rng.normal(size=(4, 3)).astype(F32),
             "b": rng.normal(size=3).astype(F32)}
    same_outputs(plain, result.model, feeds)


def test_a_broadcast_batched_product_keeps_its_form():
    """``x[2, 5, 4] @ w[1, 4, 3]``: w's gradient sums over x's batch, a's and b's leading
    dims agree only after broadcasting."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 5, 4] x, float[1, 4, 3] w) => (float loss) {
        y = MatMul(x, w)  s = Sin(y)  loss = ReduceSum<keepdims=0>(s) }"""
    _, result = plain_and_rewritten(text, ["w"], FoldBatchIntoProducts())
    assert not result.changed


def test_a_hidden_state_reshaped_to_an_unknown_batch_is_still_folded(rng):
    """As torch's exporter writes GPT-2's last hidden state: ``Reshape(h, [-1, S, D])`` from
    the shape of the input, whose ``-1`` shape inference leaves an unknown dim, beside the
    gradient of logits declared with batch ``N``. GPT-2's vocabulary-sized batched product
    was 4x the weight it sums to."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 5, 4] x, float[4, 3] w) => (float loss, float[N, 5, 3] y)
      <int64[1] one = {1}, int64[1] three = {3}, int64[1] minus = {-1}> {
        dims = Shape(x)  tail = Slice(dims, one, three)  target = Concat<axis=0>(minus, tail)
        h = Reshape(x, target)  y = MatMul(h, w)  s = Sin(y)
        loss = ReduceSum<keepdims=0>(s) }"""
    plain, result = plain_and_rewritten(text, ["w"], FoldBatchIntoProducts())
    assert result.changed
    assert "Gemm" in {n.op_type for n in result.model.graph.node}
    feeds = {"x": rng.normal(size=(6, 5, 4)).astype(F32),
             "w": rng.normal(size=(4, 3)).astype(F32)}
    same_outputs(plain, result.model, feeds)


SUMMED_PRODUCT = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{a}, 5, 4] a, float[{b}, 5, 3] b) => (float[4, 3] product)
  <int64[{axes_count}] axes = {{{axes}}}> {{
    t = Transpose<perm=[{swap}]>(a)  p = MatMul(t, b)  product = ReduceSum<keepdims=0>(p, axes)
}}"""


def test_a_broadcast_one_unknown_axis_hides_is_refused_not_summed_wrong(rng):
    """``a`` of batch 1 broadcast against ``b`` of batch 2, both batches unknown: the fold
    gives products of different row counts, which onnxruntime refuses."""
    text = SUMMED_PRODUCT.format(a="A", b="B", swap="0, 2, 1", axes_count=1, axes="0")
    model = onnx.parser.parse_model(text)
    result = FoldBatchIntoProducts()(model)
    assert result.changed
    same = {"a": rng.normal(size=(2, 5, 4)).astype(F32),
            "b": rng.normal(size=(2, 5, 3)).astype(F32)}
    same_outputs(model, result.model, same)
    broadcast = {"a": same["a"][:1], "b": same["b"]}
    create_session(model).run(None, broadcast)  # the product broadcasts
    with pytest.raises(Exception, match="(?i)dim|shape|match"):
        create_session(result.model).run(None, broadcast)


def test_two_unknown_leading_axes_keep_their_form():
    """``(1, 2)`` against ``(2, 1)`` broadcasts to the same row count with the rows paired
    wrong: two leading axes not known equal are never folded."""
    text = SUMMED_PRODUCT.format(a="A, C", b="B, D", swap="0, 1, 3, 2", axes_count=2,
                                 axes="0, 1").replace("[{a}, 5", "[A, C, 5")
    result = FoldBatchIntoProducts()(onnx.parser.parse_model(text))
    assert not result.changed
