"""split_gradient cuts a vector-Jacobian graph in two halves that give its numbers
exactly, the forward pass computed once; the separate-mode Trainer runs them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import GOLDEN_MODELS

import lossgraph
from lossgraph.optim import update_graph
from lossgraph.runtime.packed import packed_update
from lossgraph.speed import SpecializeBatch, WidenScalarConstants
from lossgraph.surgery import chain_graphs, split_gradient

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
        or "cnn" in name else "squared_error", fuse="separate")
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


@pytest.mark.parametrize("optimizer", [lossgraph.optim.Momentum(0.01, nesterov=True),
                                       lossgraph.optim.Adam(0.01)], ids=["nesterov", "adam"])
@pytest.mark.parametrize("penalty", [None, {"coefficient": {"l1": 0.01, "l2": 0.02}}])
@pytest.mark.parametrize(("name", "runs"), [("skl_mlp_regressor", 1),
                                            ("hand_mlp_tanh_double", 3)])
def test_separate_step_with_bound_buffers_equals_the_step_binding_as_it_goes(name, runs,
                                                                             penalty, optimizer):
    """A full batch runs the graphs specialized to it with every exchanged value in a
    preallocated buffer, the forward half, the loss and the backward half in one run (in
    three where the model's opset is not the loss graph's), and (where the Trainer packs
    the state) the update of every weight at once; a last, smaller batch the general
    graphs one by one. All give the same numbers, bit for bit."""
    from lossgraph.runtime.separate_step import SeparateStep

    model = onnx.load(GOLDEN_MODELS / f"{name}.onnx")
    weight = next(i.name for i in model.graph.initializer if i.dims)
    program = lossgraph.compile_program(model, fuse="separate", optimizer=optimizer,
                                        penalty=penalty and {weight: penalty["coefficient"]})
    dtype = program.state[weight].dtype
    rng = np.random.default_rng(0)
    feature = program.io("gradient", "feature")[0]
    X = rng.normal(size=(8, 5)).astype(dtype)
    y = rng.normal(size=(8, 1)).astype(dtype)
    states, kinds = [], []
    for batch, packs in ((8, True), (8, False), (None, True)):
        engine = lossgraph.runtime.Engine(program)
        assert engine.packed is not None
        step = SeparateStep(program, engine.ring, engine.new_session, engine.runner,
                            batch, engine.packed if packs else None)
        kinds.append((step.static, step.static and step.runs,
                      ("packed update", None) in engine.open_sessions))
        losses = []
        for number in range(1, 4):
            engine.set_scalars(number, 0.01)
            losses.append(step.run({feature: X, program.io("loss", "label")[0]: y}))
            engine.apply(1, f"step {number}")
        states.append((losses, engine.state))
    # (bound buffers, runs for forward, loss and backward, packed update)
    assert kinds == [(True, runs, True), (True, runs, False), (False, False, False)]
    for losses, state in states[1:]:
        assert losses == states[0][0]
        for name_, value in state.items():
            np.testing.assert_array_equal(value, states[0][1][name_], err_msg=name_)
    assert not np.array_equal(states[0][1][weight], program.state[weight])


WEIGHTS_OF_ANY_RANK = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
                       "s": np.array(0.5, np.float32), "b": np.array([[-1.0, 2.0]], np.float32),
                       "c": np.ones((2, 1, 3), np.float32)}


@pytest.mark.parametrize("optimizer", [
    lossgraph.optim.SGD(0.1), lossgraph.optim.Momentum(0.1, momentum=0.8),
    lossgraph.optim.Momentum(0.1, nesterov=True), lossgraph.optim.Adam(0.1),
    lossgraph.optim.AdamW(0.1, weight_decay=0.3)], ids=lambda o: repr(o).split("(")[0])
def test_the_packed_update_gives_the_per_weight_update_bit_for_bit(optimizer, run_model):
    weights = WEIGHTS_OF_ANY_RANK
    states = {w: optimizer.state_names(w) for w in weights}
    update = WidenScalarConstants()(update_graph(optimizer, weights)).model
    packed = packed_update(update, optimizer, weights)
    assert packed is not None
    assert len(packed.model.graph.node) < len(update.graph.node) / 2
    rng = np.random.default_rng(1)
    feeds = {"learning_rate": np.array(0.1, np.float32), "step": np.array(3, np.int64)}
    for weight, value in weights.items():
        feeds[weight] = np.asarray(value + rng.normal(size=value.shape), np.float32)
        feeds[f"{weight}_grad"] = np.asarray(rng.normal(size=value.shape), np.float32)
        feeds.update({s: np.asarray(np.abs(rng.normal(size=value.shape)), np.float32)
                      for s in states[weight]})
    expected = run_model(update, feeds)
    flat = {name: np.concatenate([feeds[n].ravel() for n in block])
            for name, block in packed.inputs.items()}
    flat[packed.gradient] = np.concatenate([feeds[f"{w}_grad"].ravel() for w in weights])
    got = run_model(packed.model, {**flat, "learning_rate": feeds["learning_rate"],
                                   "step": feeds["step"]})
    for output, block in packed.outputs.items():
        parts = np.split(got[output], np.cumsum([feeds[n].size for n in block])[:-1])
        for name, part in zip(block, parts):
            np.testing.assert_array_equal(part.reshape(feeds[name].shape),
                                          expected[f"{name}_new"], err_msg=name)


def test_the_packed_update_is_made_only_from_the_update_graph_it_would_build():
    """A program's update graph changed by hand runs as it is (no packed form), as do
    weights of several float types."""
    optimizer = lossgraph.optim.Momentum(0.1)
    weights = WEIGHTS_OF_ANY_RANK
    update = WidenScalarConstants()(update_graph(optimizer, weights)).model
    edited = onnx.ModelProto()
    edited.CopyFrom(update)
    edited.graph.node[0].op_type = "Add" if edited.graph.node[0].op_type != "Add" else "Mul"
    assert packed_update(edited, optimizer, weights) is None
    assert packed_update(update, lossgraph.optim.Momentum(0.1, momentum=0.5), weights) is None
    mixed = {**weights, "s": np.array(0.5, np.float64)}
    assert packed_update(update, optimizer, mixed) is None


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


def test_the_separate_loss_graph_proves_prediction_and_label_alike():
    """The prediction's unnamed batch axis gets a name the label shares: the loss gradient
    needs no run-time broadcast reduction (Equal, Not, And, Compress on shapes)."""
    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    program = lossgraph.compile_program(model, fuse="separate")
    ops = {node.op_type for node in program.graphs["loss"].graph.node}
    assert not ops & {"Compress", "Equal", "And"}, ops


# -- found by the fuzzer (tests/test_fuzz.py) --------------------------------------------------

#: An output whose column dimension is named N while the batch has no name: fuse="separate"
#: named the batch of its loss graph N too, and chaining its graphs failed (an InternalError).
COLUMN_NAMED_N = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[?, 4] x) => (float[?, N] y)
    <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5}>
    { h = MatMul(x, coef)
      y = Add(h, intercept) }
"""


def test_an_output_dimension_named_n_trains_alike_in_every_fuse_mode():
    from linear_data import linear_data

    X, y = linear_data(40, seed=3)
    states = {}
    for fuse in ("separate", "step", "epoch"):
        program = lossgraph.compile_program(onnx.parser.parse_model(COLUMN_NAMED_N), fuse=fuse)
        trainer = lossgraph.Trainer(program).fit(X, y[:, None], epochs=2, batch_size=10,
                                                 shuffle=False, progress=False)
        states[fuse] = trainer.state
    for fuse in ("separate", "epoch"):
        for name in ("coef", "intercept"):
            np.testing.assert_allclose(states[fuse][name], states["step"][name], rtol=1e-5,
                                       atol=1e-6, err_msg=f"{fuse} {name}")
