"""WidenScalarConstants (lossgraph/speed/widen_scalars.py): scalar constants take the rank of
what they broadcast against, in a tiny graph and in a compiled epoch graph's Scan."""

from __future__ import annotations

import numpy as np
import onnx
from support.linear import LINEAR
from support.models import model
from support.rewrites import scan_body

import lossgraph
from lossgraph.optim import Momentum
from lossgraph.speed import WidenScalarConstants

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
    given = onnx.parser.parse_model(SCALARS)
    result = WidenScalarConstants()(given)
    assert result.changed
    shapes = {t.name: list(t.dims) for t in result.model.graph.initializer}
    a, b, c = result.model.graph.node
    assert shapes[a.input[1]] == [1, 1] and shapes[c.input[0]] == [1, 1]
    assert b.input[1] == "two"  # against a vector a scalar is fast: left alone
    feeds = {"column": np.arange(6, dtype=np.float32).reshape(6, 1),
             "row": np.arange(6, dtype=np.float32)}
    expected = run_model(given, feeds)
    for name, value in run_model(result.model, feeds).items():
        assert value.shape == expected[name].shape
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_widening_nothing_to_widen_says_it_changed_nothing():
    given = model("(float[N, 3] x) => (float[N, 3] y) <float[1, 3] k = {1, 2, 3}>",
                  "y = Mul(x, k)")
    result = WidenScalarConstants()(given)
    assert not result.changed
    assert result.model.graph.node[0].input[1] == "k"


def test_compiled_epoch_graphs_have_their_scalars_widened_in_the_scan():
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.05),
                                fuse="epoch")
    body = scan_body(program.graphs["train_epoch_ordered"])  # compile widens every graph
    assert any(t.name.endswith("_rank2") and list(t.dims) == [1, 1] for t in body.initializer)
