"""Gradients through If: both branches, captured values, nesting."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients

from lossgraph import gradient

TWO_BRANCHES = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (double[3, 4] x, double[4] w, double[4] v, bool c) => (double[3, 4] y) {
        t = Mul(x, w)
        y = If(c) <
            then_branch = g1 () => (double[3, 4] a) {
                s = Tanh(t)
                a = Mul(s, v)
            },
            else_branch = g2 () => (double[3, 4] b) { b = Sub(t, x) }
        >
    }
"""


@pytest.fixture
def values(rng):
    return {"x": rng.normal(size=(3, 4)), "w": rng.normal(size=(4,)),
            "v": rng.normal(size=(4,))}


@pytest.mark.parametrize("flag", [True, False])
def test_if_gradient_follows_the_branch_taken(values, flag):
    grads = check_gradients(TWO_BRANCHES, {**values, "c": np.array(flag)}, wrt=["x", "w", "v"])
    if not flag:  # v is only used by the then-branch
        np.testing.assert_array_equal(grads["v"], np.zeros(4))


@pytest.mark.parametrize("outer, inner", [(True, True), (True, False), (False, True)])
def test_nested_if_gradients(rng, outer, inner):
    check_gradients("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[2, 3] x, double[3] w, bool c, bool d) => (double[2, 3] y) {
            y = If(c) <
                then_branch = g1 () => (double[2, 3] a) {
                    a = If(d) <
                        then_branch = h1 () => (double[2, 3] p) { p = Mul(x, w) },
                        else_branch = h2 () => (double[2, 3] q) {
                            e = Exp(w)
                            q = Add(x, e)
                        }
                    >
                },
                else_branch = g2 () => (double[2, 3] b) { b = Sin(x) }
            >
        }
    """, {"x": rng.normal(size=(2, 3)), "w": rng.normal(size=(3,)),
          "c": np.array(outer), "d": np.array(inner)}, wrt=["x", "w"])


def test_if_with_two_outputs_one_unused(rng):
    check_gradients("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[5] x, double[5] w, bool c) => (double[5] y) {
            y, z = If(c) <
                then_branch = g1 () => (double[5] a, double[5] b) {
                    a = Mul(x, w)
                    b = Neg(w)
                },
                else_branch = g2 () => (double[5] a2, double[5] b2) {
                    a2 = Div(x, w)
                    b2 = Identity(x)
                }
            >
        }
    """, {"x": rng.normal(size=5), "w": rng.uniform(1, 2, size=5), "c": np.array(False)},
        wrt=["x", "w"])


def test_weights_captured_by_branches_are_trained_by_default(run_model, rng):
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x, bool c) => (float loss)
        <float[2] a = {1, 2}>
        {
            y = If(c) <
                then_branch = g1 () => (float[N, 2] t) { t = Mul(x, a) },
                else_branch = g2 () => (float[N, 2] e) { e = Identity(x) }
            >
            loss = ReduceSum <keepdims = 0> (y)
        }
    """)
    result = gradient(model)
    x = rng.normal(size=(3, 2)).astype(np.float32)
    taken = run_model(result, {"x": x, "c": np.array(True)})["a_grad"]
    skipped = run_model(result, {"x": x, "c": np.array(False)})["a_grad"]
    np.testing.assert_allclose(taken, x.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(skipped, np.zeros(2, np.float32))
