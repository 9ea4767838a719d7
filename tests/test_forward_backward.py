"""split_gradient cuts a vector-Jacobian graph in two halves that give its numbers
exactly, the forward pass computed once; the separate-mode Trainer runs them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import GOLDEN_MODELS

import lossgraph
from lossgraph.optimize import SpecializeBatch
from lossgraph.separate import split_gradient

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


@pytest.mark.parametrize("penalty", [None, {"coefficient": {"l1": 0.01, "l2": 0.02}}])
def test_separate_step_with_bound_buffers_equals_the_step_binding_as_it_goes(penalty):
    """A full batch runs the graphs specialized to it with every exchanged value in a
    preallocated buffer; a last, smaller batch the general graphs. Both give the numbers
    of the other, bit for bit."""
    from lossgraph.runtime.forward_backward import SeparateStep

    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    program = lossgraph.compile_program(model, fuse="separate", penalty=penalty,
                                        optimizer=lossgraph.optim.Momentum(0.01, nesterov=True))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8, 5)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    states, kinds = [], []
    for batch in (8, None):
        trainer = lossgraph.Trainer(program)
        step = SeparateStep(program, trainer._buffers, trainer._new_session, trainer._runner,
                            batch)
        kinds.append(step._static)
        losses = []
        for _ in range(3):
            losses.append(step.run({"X": X, "label": y}))
            trainer._buffers.swap()
        states.append((losses, trainer.state))
    assert kinds == [True, False]
    assert states[0][0] == states[1][0]
    for name, value in states[0][1].items():
        np.testing.assert_array_equal(value, states[1][1][name])


def test_the_separate_loss_graph_proves_prediction_and_label_alike():
    """The prediction's unnamed batch axis gets a name the label shares: the loss gradient
    needs no run-time broadcast reduction (Equal, Not, And, Compress on shapes)."""
    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    program = lossgraph.compile_program(model, fuse="separate")
    ops = {node.op_type for node in program.graphs["loss"].graph.node}
    assert not ops & {"Compress", "Equal", "And"}, ops
