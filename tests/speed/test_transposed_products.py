"""TransposedProducts (lossgraph/speed/transposed_products.py): ``Transpose(Gemm(a, b))`` is
``Gemm(b, a)`` with the operands' transposes swapped, to float rounding; a product read
elsewhere, with a ``C`` input or transposed otherwise stays; a specialized step of a layer
that reads ``Transpose(W)`` keeps no such ``Transpose``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import model
from support.rewrites import ops, specialized_step

import lossgraph
from lossgraph.optim import Momentum
from lossgraph.speed import TransposedProducts


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_a_transposed_product_is_the_product_of_the_transposes(run_model, trans_a, trans_b):
    a_shape = [5, 3] if trans_a else [3, 5]
    b_shape = [4, 5] if trans_b else [5, 4]
    given = model(f"(float[{a_shape[0]}, {a_shape[1]}] a, float[{b_shape[0]}, {b_shape[1]}] b)"
                  " => (float[4, 3] y)",
                  f"""p = Gemm <transA = {trans_a}, transB = {trans_b}, alpha = 0.5> (a, b)
                      y = Transpose <perm = [1, 0]> (p)""")
    result = TransposedProducts()(given)
    assert result.changed and ops(result.model.graph) == ["Gemm"]
    (gemm,) = result.model.graph.node
    assert list(gemm.input) == ["b", "a"]
    rng = np.random.default_rng(2)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32),
             "b": rng.standard_normal(b_shape).astype(np.float32)}
    np.testing.assert_allclose(run_model(result.model, feeds)["y"],
                               run_model(given, feeds)["y"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("body", [
    "p = Gemm <transA = 1> (a, b)  y = Transpose <perm = [1, 0]> (p)  z = Neg(p)",
    "p = Gemm <transA = 1> (a, b, c)  y = Transpose <perm = [1, 0]> (p)  z = Neg(p)",
], ids=["read_elsewhere", "with_c"])
def test_a_product_read_elsewhere_or_with_a_c_input_stays(body):
    given = model("(float[5, 3] a, float[5, 4] b, float[4] c) => (float[4, 3] y, float[3, 4] z)",
                  body)
    assert not TransposedProducts()(given).changed


def test_a_layer_reading_its_transposed_weight_trains_without_the_gradients_transpose(run_model):
    """``x @ Transpose(W)``, as torch's legacy exporter writes a Linear without constant
    folding: the specialized step's weight gradient is one ``Gemm``, no ``Transpose`` of a
    product, and computes the general graph's numbers to float rounding."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 3] x) => (float[N, 2] y)
        <float[2, 3] W = {0.1, -0.2, 0.3, 0.05, -0.1, 0.2}, float[2] b = {0.1, -0.1}> {
            t = Transpose <perm = [1, 0]> (W)  p = MatMul(x, t)  y = Add(p, b) }"""
    program = lossgraph.compile_program(onnx.parser.parse_model(text), loss="squared_error",
                                        optimizer=Momentum(0.05), fuse="step")
    rng = np.random.default_rng(4)
    data = {"x": rng.standard_normal((16, 3)).astype(np.float32),
            "label": rng.standard_normal((16, 2)).astype(np.float32)}
    specialized = specialized_step(program, 16, data, run_model, rtol=1e-6, atol=1e-7)

    def transposed_products(graph: onnx.GraphProto) -> list[str]:
        made = {o: n.op_type for n in graph.node for o in n.output}
        return [n.name for n in graph.node
                if n.op_type == "Transpose" and made.get(n.input[0]) in ("Gemm", "MatMul")]

    assert transposed_products(program.graphs["train_step"].graph)
    assert not transposed_products(specialized.graph)
