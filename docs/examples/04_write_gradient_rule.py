"""04: write a gradient rule for your own op, and check it against finite differences.

The op is ``example.ops::Softsign``, y = x / (1 + |x|), defined as a model-local ONNX
function so that onnxruntime can run it. Its rule returns the vector-Jacobian product

    dL/dx = dL/dy / (1 + |x|)^2

built from standard ONNX ops; lossgraph's walker does the rest (the chain through
``Mul``, the sum over the batch into the weight's gradient). The gradient graph's
``w_grad`` is then compared with central finite differences of the loss in float64.
The rule is registered inside ``scoped_rules()``, so it is gone once the block ends.

Run: python docs/examples/04_write_gradient_rule.py
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime

import lossgraph
from lossgraph.autodiff import scoped_rules

MODEL = """
    <ir_version: 8, opset_import: ["" : 18, "example.ops" : 1]>
    net (double[N, 3] x) => (double loss)
    <double[3] w = {0.5, -1.0, 2.0}>
    {
        h = Mul(x, w)
        y = example.ops.Softsign(h)
        loss = ReduceSum <keepdims = 0> (y)
    }
    <domain: "example.ops", opset_import: ["" : 18]>
    Softsign (x) => (y) {
        one = Constant <value_float = 1.0> ()
        one_like_x = CastLike(one, x)
        magnitude = Abs(x)
        denominator = Add(magnitude, one_like_x)
        y = Div(x, denominator)
    }
"""


def session(model: onnx.ModelProto) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"])


model = onnx.parser.parse_model(MODEL)
x = np.random.default_rng(0).normal(size=(6, 3))
w = np.array([0.5, -1.0, 2.0])

# scoped_rules() undoes the registration when the block ends (for a trial or a test);
# a rule registered outside such a block stays for the rest of the process.
with scoped_rules():

    @lossgraph.grad_rule("Softsign", domain="example.ops", notes="x / (1 + |x|)")
    def softsign(g, node, dy):
        """dx = dy / (1 + |x|)^2: one gradient per input of the node (Softsign has one)."""
        (x,) = node.inputs
        denominator = g.Add(g.Abs(x), g.const_like(1.0, x))
        return g.Div(dy, g.Mul(denominator, denominator))

    graph = lossgraph.gradient(model, weights=["w"])  # the loss is the model's scalar output

assert not lossgraph.supported_ops("example.ops")  # the scope ended: the rule is gone
print("gradient graph outputs:", [o.name for o in graph.graph.output])
# The forward Softsign stays; every node the gradient added is a standard ONNX op.
assert [node.op_type for node in graph.graph.node if node.domain] == ["Softsign"]
_, w_grad = session(graph).run(["loss", "w_grad"], {"x": x})


def loss_at(weights: np.ndarray) -> float:
    """The loss with ``w`` replaced by ``weights`` (the forward model in onnxruntime)."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(weights, "w"))
    return float(session(changed).run(["loss"], {"x": x})[0])


eps = 1e-6
numeric = np.array([(loss_at(w + eps * e) - loss_at(w - eps * e)) / (2 * eps)
                    for e in np.eye(len(w))])
print("rule:               ", w_grad)
print("finite differences: ", numeric)
np.testing.assert_allclose(w_grad, numeric, rtol=1e-7, atol=1e-9)
print("OK: the registered rule's gradient matches finite differences")
