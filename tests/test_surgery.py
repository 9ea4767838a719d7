"""Graph surgery (lossgraph/surgery.py): split_gradient cuts a vector-Jacobian graph in two
halves that give its numbers exactly, the forward pass computed once; chain_graphs runs two
graphs as one, clashing names renamed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph
from lossgraph.errors import InternalError
from lossgraph.speed import SpecializeBatch
from lossgraph.surgery import chain_graphs, giving_only, split_gradient

GOLDEN = ["hand_linear", "hand_mlp_tanh_double", "hand_broadcast_reuse", "skl_mlp_regressor",
          "skl_mlp_classifier", "skl_logistic_multiclass", "torch_cnn"]


def _feeds(model: onnx.ModelProto, rng: np.random.Generator, rows: int) -> dict:
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = [rows if not d.HasField("dim_value") else d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        feeds[value.name] = rng.normal(size=shape).astype(dtype)
    return feeds


@pytest.mark.parametrize("name", GOLDEN)
@pytest.mark.parametrize("batch", [None, 4])
def test_split_halves_equal_the_gradient_graph_and_share_no_node(name, batch, ort_session):
    model = onnx.load(GOLDEN_MODELS / f"{name}.onnx")
    program = lossgraph.compile_program(
        model, loss="multiclass_log_loss" if "classifier" in name or "multiclass" in name
        or "cnn" in name else "squared_error", fuse="separate",
        loss_options={"from_logits": True} if "cnn" in name else None)  # the CNN's logits
    gradient = program.graphs["gradient"]
    if batch is not None:
        gradient = SpecializeBatch(batch)(gradient).model
    prediction = program.io("gradient", "prediction")
    seeds = program.io("gradient", "prediction_grad")
    split = split_gradient(gradient, prediction, seeds)

    feeds = _feeds(gradient, np.random.default_rng(0), batch or 3)
    expected = dict(zip([o.name for o in gradient.graph.output],
                        ort_session(gradient).run(None, feeds)))
    forward = ort_session(split.forward)
    values = dict(zip([o.name for o in split.forward.graph.output],
                      forward.run(None, {i.name: feeds[i.name]
                                         for i in split.forward.graph.input})))
    backward_feeds = {**{r: values[r] for r in split.residuals},
                      **{n: feeds[n] for n in (*split.reused, *split.seeds)}}
    assert [i.name for i in split.backward.graph.input] == list(backward_feeds)
    grads = ort_session(split.backward).run(None, backward_feeds)
    for name_, value in [*zip(split.gradients, grads), *((o, values[o]) for o in prediction)]:
        np.testing.assert_array_equal(value, expected[name_])
    forward_outputs = {o for n in split.forward.graph.node for o in n.output}
    assert not forward_outputs & {o for n in split.backward.graph.node for o in n.output}
    assert not set(split.seeds) & {i.name for i in split.forward.graph.input}


def test_split_gradient_is_deterministic():
    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    program = lossgraph.compile_program(model, fuse="separate")
    args = (program.graphs["gradient"], program.io("gradient", "prediction"),
            program.io("gradient", "prediction_grad"))
    first, second = split_gradient(*args), split_gradient(*args)
    assert first.forward.SerializeToString() == second.forward.SerializeToString()
    assert first.backward.SerializeToString() == second.backward.SerializeToString()


def _parsed(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


FIRST = """<ir_version: 8, opset_import: ["" : 18]>
first (float[2, 3] x, float[3, 1] w) => (float[2, 1] y, float[2, 3] t) {
    t = Mul(x, x)
    y = MatMul(t, w)
}"""
SECOND = """<ir_version: 8, opset_import: ["" : 18]>
second (float[2, 1] y, float[2, 1] label, float[2, 3] x) => (float[2, 1] t, float[1, 1] loss) {
    d = Sub(y, label)
    t = Mul(d, d)
    loss = ReduceSum(t)
}"""


def test_chain_graphs_runs_two_graphs_as_one_with_clashing_names_renamed(run_model):
    first, second = _parsed(FIRST), _parsed(SECOND)
    chained, renamed = chain_graphs(first, second)
    assert renamed == {"t": "t_1"}  # the second's own t; its y and x read the first's
    assert [i.name for i in chained.graph.input] == ["x", "w", "label"]
    rng = np.random.default_rng(2)
    feeds = {"x": rng.normal(size=(2, 3)).astype(np.float32),
             "w": rng.normal(size=(3, 1)).astype(np.float32),
             "label": rng.normal(size=(2, 1)).astype(np.float32)}
    ahead = run_model(first, {n: feeds[n] for n in ("x", "w")})
    after = run_model(second, {"y": ahead["y"], "label": feeds["label"], "x": feeds["x"]})
    got = run_model(chained, feeds)
    for name, value in [*ahead.items(), *((renamed.get(n, n), v) for n, v in after.items())]:
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_chain_graphs_declines_graphs_of_different_opset_versions():
    older = _parsed(SECOND.replace('"" : 18', '"" : 17').replace("ReduceSum(t)",
                                                                 "ReduceSum <keepdims = 1> (t)"))
    assert chain_graphs(_parsed(FIRST), older) is None


def test_giving_only_keeps_the_outputs_named_and_leaves_the_model_as_it_was():
    first, second = _parsed(FIRST), _parsed(SECOND)
    chained, _ = chain_graphs(first, second)
    before = chained.SerializeToString()
    outputs = [o.name for o in chained.graph.output]
    given = giving_only(chained, [outputs[-1]])
    assert [o.name for o in given.graph.output] == [outputs[-1]]
    assert chained.SerializeToString() == before
    with pytest.raises(InternalError, match="nowhere"):
        giving_only(chained, ["nowhere"])
