"""Property: random compositions of supported ops have gradients equal to finite differences.

Each example builds a float64 graph: a chain of smooth ops over an input ``x`` (3, 4)
and weights ``w`` (4,), ``m`` (4, 4), where every step may reuse any earlier value
(so gradients must accumulate) and binary steps broadcast. Chains whose output grows past
1e3 (``x`` to the twelfth) are left out: the central differences of a loss that large lose
more to rounding (about 1e-16 of the loss over a step of 1e-6) than the tolerance allows.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients

UNARY = ["Tanh", "Sigmoid", "Sin", "Neg", "Softmax", "Transpose2", "Square", "Softplus"]
BINARY = ["Add", "Sub", "Mul", "DivSafe", "MatMul"]


def _unary(op: str, out: str, a: str) -> list[str]:
    if op == "Softmax":
        return [f"{out} = Softmax <axis = 1> ({a})"]
    if op == "Transpose2":  # a transpose and back keeps the shape, exercising both rules
        return [f"{out}_t = Transpose <perm = [1, 0]> ({a})",
                f"{out} = Transpose <perm = [1, 0]> ({out}_t)"]
    if op == "Square":
        return [f"{out} = Mul({a}, {a})"]
    if op == "Softplus":  # ReduceLogSumExp-free smooth op built from Exp and Log
        return [f"{out}_e = Exp({a})", f"{out}_o = Add({out}_e, one)", f"{out} = Log({out}_o)"]
    return [f"{out} = {op}({a})"]


def _binary(op: str, out: str, a: str, b: str) -> list[str]:
    if op == "DivSafe":  # a / (1 + sigmoid(b)): smooth, never divides by ~0
        return [f"{out}_s = Sigmoid({b})", f"{out}_d = Add({out}_s, one)",
                f"{out} = Div({a}, {out}_d)"]
    if op == "MatMul":
        return [f"{out} = MatMul({a}, m)"]
    return [f"{out} = {op}({a}, {b})"]


def _read_by(lines: list[str], output: str) -> set[str]:
    """The names ``output`` depends on, through the lines ``out = Op(...)`` that make it."""
    needed = {output}
    for line in reversed(lines):
        out, _, expression = line.partition("=")
        if out.strip() in needed:
            needed.update(re.findall(r"[A-Za-z_]\w*", expression))
    return needed


@st.composite
def programs(draw):
    values = ["x"]
    lines = []
    for step in range(draw(st.integers(1, 6))):
        out = f"v{step}"
        a = draw(st.sampled_from(values))
        if draw(st.booleans()):
            lines += _unary(draw(st.sampled_from(UNARY)), out, a)
        else:
            b = draw(st.sampled_from([*values, "w"]))
            lines += _binary(draw(st.sampled_from(BINARY)), out, a, b)
        values.append(out)
    uses_w = draw(st.booleans())
    last = values[-1]
    lines.append(f"y = Mul({last}, w)" if uses_w else f"y = Add({last}, {values[0]})")
    return lines


@settings(max_examples=60, deadline=None)
@given(lines=programs(), seed=st.integers(0, 2**16))
def test_random_op_chains_match_finite_differences(lines, seed):
    body = "\n            ".join(lines)
    text = f"""
        <ir_version: 8, opset_import: ["" : 18]>
        chain (double[3, 4] x, double[4] w, double[4, 4] m) => (double[3, 4] y)
        <double one = {{1.0}}>
        {{
            {body}
        }}
    """
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.normal(size=(3, 4)), "w": rng.normal(size=(4,)),
              "m": rng.normal(size=(4, 4)) / 2}
    model = onnx.parser.parse_model(text)
    feeds = {i.name: inputs[i.name] for i in model.graph.input}
    (y,) = ReferenceEvaluator(model).run(None, feeds)
    assume(np.isfinite(y).all() and np.abs(y).max() < 1e3)
    # Only the inputs y depends on have a gradient: asking for another one is an error
    # (NoGradientError, tested in tests/passes/test_gradient.py), not zeros.
    used = [name for name in ("x", "w", "m") if name in _read_by(lines, "y")]
    # Basic optimizations: onnxruntime would fuse x * Sigmoid(x) into com.microsoft's
    # QuickGelu, which has no double kernel (a runtime limit, not lossgraph's graph).
    check_gradients(text, inputs, wrt=used, ort=False, rtol=1e-5, atol=1e-6,
                    basic_optimizations=True)
