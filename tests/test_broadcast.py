"""widen_scalar_constants: one-element constants take the rank they broadcast against."""

from __future__ import annotations

import numpy as np
import onnx
from linear_data import LINEAR

import lossgraph
from lossgraph.optim import Momentum
from lossgraph.passes.broadcast import widen_scalar_constants

SCALARS = """
    <ir_version: 8, opset_import: ["" : 18]>
    scalars (float[N, 1] column, float[N] row) => (float[N, 1] a, float[N] b, float[N, 1] c)
    <float two = {2.0}, float[1] three = {3.0}>
    {
        a = Mul(column, two)
        b = Mul(row, two)
        c = Add(three, column)
    }
"""


def test_scalar_constants_take_the_rank_of_what_they_broadcast_against(run_model):
    model = onnx.parser.parse_model(SCALARS)
    widened = widen_scalar_constants(model)
    onnx.checker.check_model(widened, full_check=True)
    shapes = {t.name: list(t.dims) for t in widened.graph.initializer}
    a, b, c = widened.graph.node
    assert shapes[a.input[1]] == [1, 1] and shapes[c.input[0]] == [1, 1]
    assert b.input[1] == "two"  # against a vector a scalar is fast: left alone
    assert [n.input[:] for n in model.graph.node][0] == ["column", "two"]  # input untouched
    feeds = {"column": np.arange(6, dtype=np.float32).reshape(6, 1),
             "row": np.arange(6, dtype=np.float32)}
    expected = run_model(model, feeds)
    for name, value in run_model(widened, feeds).items():
        assert value.shape == expected[name].shape
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_compiled_epoch_graphs_have_their_scalars_widened_in_the_scan():
    program = lossgraph.compile(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.05),
                                fuse="epoch")
    widened = program.graphs["train_epoch_ordered"]  # compile widens every graph
    body = next(n for n in widened.graph.node if n.op_type == "Scan").attribute[0].g
    assert any(t.name.endswith("_rank2") and list(t.dims) == [1, 1] for t in body.initializer)
