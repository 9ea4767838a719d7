"""The weights' float type (lossgraph/graphs/types.py): a program trains weights of one float
type, and a model of mixed ones is refused, naming each weight's type."""

from __future__ import annotations

import onnx
import pytest

import lossgraph


def test_compile_rejects_weights_of_mixed_float_types():
    mixed = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y)
        <float[2] a = {1, 2}, double[2] c = {3, 4}>
        {
            d = Cast <to = 1> (c)
            t = Mul(x, a)
            y = Add(t, d)
        }
    """)
    with pytest.raises(lossgraph.errors.UnsupportedModelError,
                       match="one float type, but 'a' is float32, 'c' is float64"):
        lossgraph.compile_program(mixed)
