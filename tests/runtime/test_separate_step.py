"""The separate mode's step (lossgraph/runtime/separate_step.py): a full batch runs the graphs
specialized to it with every exchanged value in a preallocated buffer, a last, smaller batch
the general graphs one by one; all give the same numbers, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS
from support.models import model

import lossgraph


@pytest.mark.parametrize("optimizer", [lossgraph.optim.SGD(0.01),
                                       lossgraph.optim.Momentum(0.01, nesterov=True),
                                       lossgraph.optim.Adam(0.01)], ids=["sgd", "nesterov", "adam"])
@pytest.mark.parametrize("penalty", [None, {"coefficient": {"l1": 0.01, "l2": 0.02}}])
@pytest.mark.parametrize(("name", "runs"), [("skl_mlp_regressor", 1),
                                            ("hand_mlp_tanh_double", 1),
                                            ("hand_mlp_tanh_double", 3)])
def test_separate_step_with_bound_buffers_equals_the_step_binding_as_it_goes(name, runs,
                                                                             penalty, optimizer):
    """A full batch runs the graphs specialized to it with every exchanged value in a
    preallocated buffer, the forward half, the loss and the backward half in one run (in
    three where the model's opset is not the loss graph's: a program an older lossgraph
    compiled, its loss graph at opset 18 whatever the model's), and (where the Trainer
    packs the state) the update of every weight at once; a last, smaller batch the general
    graphs one by one. All give the same numbers, bit for bit."""
    from lossgraph.runtime.separate_step import SeparateStep

    model = onnx.load(GOLDEN_MODELS / f"{name}.onnx")
    weight = next(i.name for i in model.graph.initializer if i.dims)
    program = lossgraph.compile_program(model, fuse="separate", optimizer=optimizer,
                                        penalty=penalty and {weight: penalty["coefficient"]})
    if runs == 3:
        program = _with_loss_graph_at_opset_18(program)
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


def _with_loss_graph_at_opset_18(program):
    """``program`` as an older lossgraph compiled it: its loss graph at opset 18 (the
    model's is another)."""
    from lossgraph.passes.loss import program_loss_graph
    from lossgraph.speed import WidenScalarConstants

    roles = program.manifest["roles"]
    prediction = next(o for o in program.light_graphs["gradient"].graph.output
                      if o.name == roles["prediction"])
    loss = program_loss_graph(prediction, roles["label"], "squared_error", {}, "onnx",
                              opset=18).model
    loss = WidenScalarConstants()(loss).model
    loss.ir_version = program.light_graphs["loss"].ir_version
    assert [o.version for o in program.light_graphs["loss"].opset_import] != [18]
    assert [o.name for o in loss.graph.output] == [
        o.name for o in program.light_graphs["loss"].graph.output]
    return lossgraph.TrainingProgram({**program.light_graphs, "loss": loss}, program.manifest,
                                     program.state, program.inference_model)


def _steps(program, batch: int | None, X, y) -> tuple[bool, list[float], dict, set]:
    """Three separate steps on ``(X, y)`` with graphs specialized to ``batch`` (None: the
    general ones): whether every exchanged value lived in a preallocated buffer, the losses,
    the state after, and the ids of the gradient arrays each step handed out."""
    from lossgraph.runtime.separate_step import SeparateStep

    engine = lossgraph.runtime.Engine(program)
    step = SeparateStep(program, engine.ring, engine.new_session, engine.runner, batch,
                        engine.packed)
    feeds = {program.io("gradient", "feature")[0]: X, program.io("loss", "label")[0]: y}
    losses, arrays = [], set()
    for number in range(1, 4):
        engine.set_scalars(number, 0.01)
        loss, gradients = step.gradients(feeds)
        arrays |= {id(array) for array in gradients.values()}
        losses.append(loss + step.update(gradients, loss))
        engine.apply(1, f"step {number}")
    return step.static, losses, engine.state, arrays


def test_a_free_axis_besides_the_batch_and_a_general_step_allocate_no_state_sized_value():
    """A model exported with a free axis besides the batch (GPT-2's sequence) runs its full
    batches with every exchanged value preallocated, once the loss graph takes the sizes the
    forward half computes; a general step (a last, smaller batch) writes the gradients into
    arrays allocated once, as the update reads them, and holds nothing of a step after it
    (issue 27: the separate mode's memory grew step after step). Same numbers, bit for bit."""
    net = model("(float[N, 5, 3] x) => (float[N, T, 2] y)",  # as torch exports GPT-2
                "w = Constant <value = float[3, 2] {0.1, -0.2, 0.3, 0.4, -0.5, 0.6}> () "
                "y = MatMul(x, w)")
    program = lossgraph.compile_program(net, fuse="separate", loss="squared_error",
                                        optimizer=lossgraph.optim.Momentum(0.01),
                                        weights=["w"], penalty={"w": 0.01})
    rng = np.random.default_rng(0)
    X, y = (rng.normal(size=(4, 5, n)).astype(np.float32) for n in (3, 2))
    static, general = _steps(program, 4, X, y), _steps(program, None, X, y)
    assert (static[0], general[0]) == (True, False)
    assert len(general[3]) == 1  # one gradient array, the same every step
    assert static[1] == general[1]
    for name, value in static[2].items():
        np.testing.assert_array_equal(value, general[2][name], err_msg=name)


def test_a_chained_run_gives_the_loss_and_gradients_and_holds_no_activation():
    """The forward half, the loss and the backward half chained into one session give only
    what the step reads: the loss, the gradients (and a model's new buffers). The
    activations the forward half hands over to the backward half, the prediction and its
    gradient are none of its outputs, since onnxruntime holds every output to the end of
    a run (issue 27: the 2-layer transformer's separate step 107 -> 61 MiB, BERT-base's
    1,710 -> 1,550)."""
    from lossgraph.runtime.separate_step import SeparateStep

    program = lossgraph.compile_program(onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx"),
                                        fuse="separate", optimizer=lossgraph.optim.SGD(0.01))
    engine = lossgraph.runtime.Engine(program)
    made = []

    def recording(model, *args, **kwargs):
        made.append(model)
        return engine.new_session(model, *args, **kwargs)

    step = SeparateStep(program, engine.ring, recording, engine.runner, 8, engine.packed)
    assert step.runs == 1
    chained = next(m for m in made if any(o.name == program.io("loss", "loss")[0]
                                          for o in m.graph.output))
    gradients = program.io("update", "gradient")
    outputs = [o.name for o in chained.graph.output]
    assert sorted(outputs) == sorted([program.io("loss", "loss")[0], *gradients])
    read = {name for node in chained.graph.node for name in node.input}
    handed_over = [o.name for o in program.light_graphs["gradient"].graph.output
                   if o.name in read]
    assert handed_over  # the forward's values the backward reads, the prediction among them
    assert not set(outputs) & read
