"""GeneralizeBatch (lossgraph/passes/fixed_batch.py): a fixed-batch export freed where the
graph proves which shape constants hold the batch.

The freed model computes, at any batch size, what the exported one computes on each run
of its own batch size; a constant that merely equals the batch (a hidden width of 2 at a
batch of 2) is left alone; where nothing proves it the batch stays, with the reason, or
``strict`` refuses it with the export calls that free it. What compile, the runtime and
the command line do with a fixed batch is in tests/test_fixed_batch.py, torch's own
exports in tests/test_torch_fixed_batch.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.fixed_batch import (
    batch_merged,
    by_runs,
    concat_token,
    constant_mask,
    expanded,
    flatten_to_linear,
    hidden_width_two,
    parse,
    per_row_constant,
    run,
    split_batch,
    unflatten,
    unsqueezed_one,
)

from lossgraph.errors import UnsupportedModelError
from lossgraph.passes import GeneralizeBatch
from lossgraph.passes.fixed_batch import export_calls, fixed_batch


def target(model: onnx.ModelProto, node: int) -> list[int]:
    graph = model.graph
    name = graph.node[node].input[1]
    return onnx.numpy_helper.to_array(next(t for t in graph.initializer if t.name == name)
                                      ).tolist()


def free_dims(model: onnx.ModelProto) -> list:
    return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)]


@pytest.mark.parametrize("build, batch, rewrites", [
    (hidden_width_two, 2, ["Reshape 'r' [2, 2, 2] -> [0, 2, 2]"]),
    (hidden_width_two, 1, ["Reshape 'r' [1, 2, 2] -> [0, 2, 2]"]),
    (lambda b: flatten_to_linear(b, allowzero=1), 2, ["Reshape 'h' [2, 6] -> [-1, 6]"]),
    (lambda b: flatten_to_linear(b, allowzero=0), 2, ["Reshape 'h' [2, 6] -> [0, 6]"]),
    # at a batch of 1, [1, 6] also reads as one row of all the rows' values: the axis
    # that holds the batch alone is the batch's
    (lambda b: flatten_to_linear(b, allowzero=1), 1, ["Reshape 'h' [1, 6] -> [-1, 6]"]),
    (unflatten, 2, ["Reshape 'r' [2, 4, 3] -> [-1, 4, 3]"]),
    (expanded, 2, ["Expand 'e' [2, 4, 3] -> [1, 4, 3]"]),
    (constant_mask, 2, ["ConstantOfShape 'ones' [2, 3] -> [1, 3]"]),
    (concat_token, 2, ["Concat 's' reads 'token' of shape [2, 1, 3] as its one row "
                       "[1, 1, 3], expanded to the rows of 'x'"]),
    (concat_token, 1, ["Concat 's' reads 'token' expanded to the rows of 'x'"]),
])
def test_a_proven_batch_is_freed_and_computes_what_each_run_of_the_export_does(
        build, batch, rewrites):
    model = build(batch)
    given = model.SerializeToString()
    result = GeneralizeBatch()(model)
    assert model.SerializeToString() == given
    assert result.report.freed and result.report.batch == batch
    assert [str(r) for r in result.report.rewrites] == rewrites
    assert all(dims[0] == "batch" for dims in free_dims(result.model))
    X = np.random.default_rng(0).standard_normal(
        (6, *[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]])
    ).astype(np.float32)
    np.testing.assert_allclose(run(result.model, X), by_runs(model, X, batch), rtol=1e-6,
                               atol=1e-6)


def test_a_constant_equal_to_the_batch_elsewhere_is_not_rewritten():
    """The hidden width 2 at a batch of 2 stays: only the view's batch axis reads it."""
    freed = GeneralizeBatch()(hidden_width_two(2)).model
    reshape = next(i for i, n in enumerate(freed.graph.node) if n.op_type == "Reshape")
    assert target(freed, reshape) == [0, 2, 2]


def test_the_exporters_stale_shapes_are_dropped_and_the_rest_kept():
    model = flatten_to_linear(2)
    model.graph.value_info.extend([
        onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [2, 6]),
        onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [6, 3])])
    freed = GeneralizeBatch()(model).model
    assert [v.name for v in freed.graph.value_info] == ["w"]


@pytest.mark.parametrize("build, reason", [
    (per_row_constant, "Mul 'y'"),
    (split_batch, "splits the batch across axes"),
    (batch_merged, "Reshape 'y' splits the batch across axes ([8, 2] -> [2, 8])"),
    (unsqueezed_one, "Reshape 'y' fits the batch at 2 of its axes ([1, 6] -> [1, 1, 6])"),
])
def test_an_unproven_batch_is_kept_with_the_reason_or_refused_when_strict(build, reason):
    model = build()
    result = GeneralizeBatch()(model)
    assert not result.changed and not result.report.freed
    assert reason in result.report.reason
    assert result.model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == \
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
    with pytest.raises(UnsupportedModelError, match="cannot free it") as error:
        GeneralizeBatch(strict=True)(model)
    for call in export_calls(["x"], ["y"]):
        assert call in str(error.value)


def test_a_free_batch_is_left_alone():
    model = parse("""g (float[N, 2] x) => (float[N, 2] y) { y = Relu(x) }""")
    result = GeneralizeBatch()(model)
    assert result.report is None and not result.changed
    assert fixed_batch(model) is None
