"""Gradient clipping by global norm and an EMA of the weights (lossgraph.update_options),
against torch's ``clip_grad_norm_`` and ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn)``
step for step in every fusion mode; carried like optimizer states (manifest, save and load,
checkpoints, reset); the graphs they emit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import lossgraph
from lossgraph.optim import SGD, Adam, Momentum
from lossgraph.update_options import UpdateOptions

RNG = np.random.default_rng(0)
W1, B1 = RNG.normal(size=(3, 4)).astype(np.float32), RNG.normal(size=4).astype(np.float32)
W2, B2 = RNG.normal(size=(4, 2)).astype(np.float32), RNG.normal(size=2).astype(np.float32)
#: 14 rows: batches of 4, then one of 2 (the epoch graph runs the first three, the step
#: graph the last); large targets, so that the norm is clipped at most steps, not all
X = (RNG.normal(size=(14, 3)) * 2).astype(np.float32)
Y = (RNG.normal(size=(14, 2)) * 3).astype(np.float32)
PENALTY = {"w1": {"l2": 0.05}}


def mlp() -> onnx.ModelProto:
    """3 -> 4 (tanh) -> 2, the weights above."""
    nodes = [helper.make_node(op, inputs, [output]) for op, inputs, output in (
        ("MatMul", ["x", "w1"], "a"), ("Add", ["a", "b1"], "z"), ("Tanh", ["z"], "h"),
        ("MatMul", ["h", "w2"], "o"), ("Add", ["o", "b2"], "y"))]
    weights = [numpy_helper.from_array(v, n) for v, n in ((W1, "w1"), (B1, "b1"), (W2, "w2"),
                                                          (B2, "b2"))]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", 1, ["N", 3])],
                              [helper.make_tensor_value_info("y", 1, ["N", 2])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def torch_run(optimizer: str, epochs: int, max_norm: float | None, decay: float | None):
    """torch's run of the same MLP: per epoch the net's and the average's predictions on X,
    and the norm clip_grad_norm_ returns at every step."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for layer, w, b in ((net[0], W1, B1), (net[2], W2, B2)):
            layer.weight.copy_(torch.from_numpy(w.T))
            layer.bias.copy_(torch.from_numpy(b))
    average = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(decay)) if decay else None
    step = (torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) if optimizer == "momentum"
            else torch.optim.Adam(net.parameters(), lr=0.05))
    norms, predictions = [], []
    inputs = torch.from_numpy(X)
    for _ in range(epochs):
        for start in range(0, len(X), 4):
            step.zero_grad()
            batch = slice(start, start + 4)
            loss = ((net(inputs[batch]) - torch.from_numpy(Y[batch])) ** 2).mean()
            loss = loss + PENALTY["w1"]["l2"] * (net[0].weight ** 2).sum()
            loss.backward()
            if max_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
            step.step()
            if average is not None:
                average.update_parameters(net)
        with torch.no_grad():
            predictions.append((net(inputs).numpy(),
                                average(inputs).numpy() if average is not None else None))
    return predictions, norms


def optimizer_of(name: str):
    return Momentum(0.05, momentum=0.9) if name == "momentum" else Adam(0.05)


@pytest.mark.torch
@pytest.mark.parametrize(("fuse", "optimizer", "max_norm", "decay"), [
    ("step", "momentum", 3.5, 0.8), ("epoch", "momentum", 3.5, 0.8),
    ("separate", "momentum", 3.5, 0.8), ("epoch", "adam", 3.5, None),
    ("separate", "momentum", None, 0.9)],
    ids=["step", "epoch", "separate", "epoch-adam-clip", "separate-ema"])
def test_clipping_and_the_average_equal_torch_step_for_step(fuse, optimizer, max_norm, decay):
    """The loss's and the penalty's gradients clipped together, the average updated after
    each step (its first update a copy): the norm of every step, the weights and their
    average after every epoch, as torch's, to float32 rounding."""
    program = lossgraph.compile_program(mlp(), loss="squared_error", penalty=PENALTY,
                                        optimizer=optimizer_of(optimizer), fuse=fuse,
                                        max_grad_norm=max_norm, ema_decay=decay)
    trainer = lossgraph.Trainer(program)
    expected, norms = torch_run(optimizer, 2, max_norm, decay)
    for epoch, (weights, average) in enumerate(expected):
        trainer.fit(X, Y, batch_size=4, shuffle=False, progress=False, warm_start=epoch > 0)
        np.testing.assert_allclose(trainer.predict(X), weights, rtol=1e-5, atol=1e-5)
        if decay is not None:
            np.testing.assert_allclose(trainer.predict(X, ema=True), average, rtol=1e-5,
                                       atol=1e-5)
    np.testing.assert_allclose(trainer.grad_norms_, norms, rtol=1e-5)
    assert max_norm is None or min(norms) < max_norm < max(norms)  # clipped, and not always


def test_the_first_update_copies_the_weights_and_reset_restarts_the_average():
    """AveragedModel's first update_parameters copies the weights: after one step the
    average is the weights themselves; before any, the initial weights."""
    trainer = lossgraph.Trainer(lossgraph.compile_program(mlp(), optimizer=SGD(0.1),
                                                          ema_decay=0.99))
    state = trainer.state
    for w in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(state[f"{w}_ema"], state[w])
    trainer.fit(X[:4], Y[:4], batch_size=4, progress=False)
    state = trainer.state
    for w in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(state[f"{w}_ema"], state[w])
        assert not np.array_equal(state[w], trainer.program.state[w])
    trainer.fit(X, Y, batch_size=4, progress=False, warm_start=True)
    assert not np.allclose(trainer.state["w1_ema"], trainer.state["w1"])
    trainer.reset()
    np.testing.assert_array_equal(trainer.state["w1_ema"], W1)


def test_the_average_is_what_evaluate_predict_and_the_inference_export_use(run_model):
    trainer = lossgraph.Trainer(lossgraph.compile_program(mlp(), optimizer=SGD(0.1),
                                                          ema_decay=0.5))
    trainer.fit(X, Y, epochs=2, batch_size=4, progress=False)
    state = trainer.state
    averages = {w: state[f"{w}_ema"] for w in ("w1", "b1", "w2", "b2")}
    by_average = lossgraph.Trainer(trainer.program)
    by_average.set_state(averages)
    assert trainer.evaluate(X, Y, ema=True) == pytest.approx(by_average.evaluate(X, Y))
    assert trainer.evaluate(X, Y, ema=True) != pytest.approx(trainer.evaluate(X, Y))
    np.testing.assert_array_equal(trainer.predict(X, ema=True), by_average.predict(X))
    for exported in (trainer.to_inference_model(ema=True),
                     trainer.program.to_inference_model(state, ema=True),
                     lossgraph.export.to_inference_model(trainer, ema=True)):
        initializers = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
        for w, value in averages.items():
            np.testing.assert_array_equal(initializers[w], value)
        np.testing.assert_allclose(run_model(exported, {"x": X})["y"], by_average.predict(X),
                                   rtol=1e-6)


@pytest.mark.parametrize("fuse", ["epoch", "separate"])
def test_a_saved_program_and_a_checkpoint_train_the_same(tmp_path, fuse):
    """The manifest records both options and each weight's average; a loaded program trains
    to the same state and norms, and a checkpoint resumes the average with the weights."""
    program = lossgraph.compile_program(mlp(), optimizer=Adam(0.05), fuse=fuse,
                                        max_grad_norm=0.5, ema_decay=0.9)
    assert program.manifest["update"] == {"max_grad_norm": 0.5, "ema_decay": 0.9}
    assert program.manifest["ema"] == {w: f"{w}_ema" for w in ("w1", "b1", "w2", "b2")}
    assert program.optimizer_states[:3] == ["w1_m", "w1_v", "w1_ema"]
    program.save(tmp_path / "p")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "p")
    assert loaded.update_options == UpdateOptions(0.5, 0.9)
    fitted = [lossgraph.Trainer(p).fit(X, Y, epochs=2, batch_size=4, shuffle=False,
                                       progress=False) for p in (program, loaded)]
    for name, value in fitted[0].state.items():
        np.testing.assert_array_equal(fitted[1].state[name], value, err_msg=name)
    assert fitted[0].grad_norms_ == fitted[1].grad_norms_ and len(fitted[0].grad_norms_) == 8

    resumed = lossgraph.Trainer(program).fit(X, Y, batch_size=4, shuffle=False, progress=False)
    resumed.save_checkpoint(tmp_path / "c")
    resumed = lossgraph.Trainer.load_checkpoint(tmp_path / "c")
    resumed.fit(X, Y, batch_size=4, shuffle=False, progress=False, warm_start=True)
    for name, value in fitted[0].state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)


def test_the_packed_update_clips_by_one_reduction_over_the_flat_gradient():
    """fuse='separate' runs the update of every weight at once on flat vectors: the norm is
    one ReduceSumSquare, the average one more flat state."""
    program = lossgraph.compile_program(mlp(), optimizer=Momentum(0.05), fuse="separate",
                                        max_grad_norm=1.0, ema_decay=0.9)
    trainer = lossgraph.Trainer(program).fit(X, Y, batch_size=7, progress=False)
    packed = trainer.engine.packed
    assert ("packed update", None) in trainer.engine.open_sessions
    assert [n.op_type for n in packed.model.graph.node].count("ReduceSumSquare") == 1
    assert list(packed.inputs) == ["weights", "weights_velocity", "weights_ema"]
    assert np.isfinite(trainer.grad_norms_).all() and len(trainer.grad_norms_) == 2


def test_the_graphs_output_the_norm_and_carry_the_averages():
    """Each graph's roles: the norm an output (grad_norm; grad_norms, one per batch, from the
    epoch graph), each average a state; without the options, neither."""
    program = lossgraph.compile_program(mlp(), fuse="epoch", max_grad_norm=1.0,
                                        ema_decay=0.9)
    io = program.io
    assert io("train_step", "grad_norm") == ["grad_norm"]
    assert io("train_epoch", "grad_norms") == ["grad_norms"]
    assert "w1_ema" in io("train_epoch", "state") and "w1_ema_new" in io("train_step",
                                                                          "new_state")
    epoch = program.manifest["graphs"]["train_epoch"]["outputs"]
    assert {"name": "grad_norms", "role": "grad_norms", "dtype": "float32",
            "shape": ["batches"]} in epoch
    plain = lossgraph.compile_program(mlp(), fuse="epoch")
    assert not plain.io("train_step", "grad_norm") and "update" not in plain.manifest
    assert lossgraph.Trainer(plain).fit(X, Y, progress=False).grad_norms_ == []
    ops = [n.op_type for n in program.graphs["train_step"].graph.node]
    assert ops.count("ReduceSumSquare") == 4  # one per weight; packed in the epoch graph:
    body = next(n for n in program.graphs["train_epoch"].graph.node if n.op_type == "Scan")
    assert [n.op_type for n in body.attribute[0].g.node].count("ReduceSumSquare") == 1


def test_describe_plan_shows_the_options():
    text = lossgraph.describe_plan(mlp(), max_grad_norm=1.0, ema_decay=0.99)
    assert "StepGraph(optimizer=SGD, options=UpdateOptions(max_grad_norm=1.0, ema_decay=0.99))" \
        in text
