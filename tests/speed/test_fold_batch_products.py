"""FoldBatchIntoProducts (lossgraph/speed/fold_batch_products.py): a sequence weight's gradient,
a batched product, becomes one product over all rows (a Gemm) and computes the same; a
product whose batch dims agree only after broadcasting keeps its form."""

from __future__ import annotations

import numpy as np
import pytest
from support.rewrites import plain_and_rewritten, same_outputs

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
