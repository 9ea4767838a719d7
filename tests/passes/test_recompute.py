"""Recompute: the backward reads the kept values only, and trains exactly as without it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import residual_stack, tower

from lossgraph import Trainer, add_loss_output, compile_program, gradient
from lossgraph.errors import UnsupportedModelError, UnsupportedOptionError
from lossgraph.passes import Recompute
from lossgraph.passes.recompute import UpdatesInBackwardOrder
from lossgraph.program import TrainingProgram


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(12, 3)).astype(np.float32), rng.normal(size=(12, 1)).astype(
        np.float32)


def _trained(program: TrainingProgram) -> dict[str, np.ndarray]:
    """The weights after 3 steps of 4 rows, in order."""
    X, y = _data()
    trainer = Trainer(program).fit(X, y, batch_size=4, epochs=1, shuffle=False, progress=False)
    return trainer.state


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("recompute", ["auto", "elementwise", ["h1"], ["h1", "h2"]])
def test_trains_as_without_recomputation(fuse, recompute):
    model = tower()
    plain = _trained(compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam"))
    program = compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam",
                              recompute=recompute)
    again = _trained(program)
    for name, value in plain.items():  # bit for bit: the same kernels on the same values
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    plans = program.manifest["recompute"]
    assert plans and all(plan["recomputed"] for plan in plans.values())
    if recompute == "elementwise":  # the products kept, the rest recomputed
        assert all(plan["kept"][:2] == ["a1", "a2"] and {"h1", "t2", "h2", "s"}
                   <= set(plan["recomputed"]) for plan in plans.values())
    elif recompute != "auto":
        assert all(plan["boundaries"] == recompute for plan in plans.values())


def test_saved_program_trains_the_same(tmp_path):
    program = compile_program(tower(), loss="squared_error", recompute=["h1"])
    program.save(tmp_path / "program")
    loaded = TrainingProgram.load(tmp_path / "program")
    assert loaded.manifest["recompute"] == program.manifest["recompute"]
    expected = _trained(program)
    for name, value in _trained(loaded).items():
        np.testing.assert_array_equal(value, expected[name])


def _forward_values(model: onnx.ModelProto) -> set[str]:
    return {o for node in model.graph.node for o in node.output}


def test_backward_reads_only_what_the_plan_keeps():
    with_loss = add_loss_output(tower(), "squared_error")
    graph = gradient(with_loss)
    forward = _forward_values(with_loss)
    result = Recompute(("h1",))(graph)
    plan = result.report
    assert plan.boundaries == ("h1",)
    assert "h1" in plan.kept and "h2" not in plan.kept
    assert {"a2", "h2", "s"} <= set(plan.recomputed)
    backward = [n for n in result.model.graph.node if not set(n.output) <= forward]
    read = {v for n in backward for v in n.input} & forward
    activations = read - {"x", "label", "loss"} - {t.name for t in graph.graph.initializer}
    assert activations == set(plan.kept)
    # each recomputed value has one copy, placed before the backward node reading it first
    copies = [o for n in result.model.graph.node for o in n.output if o.endswith("_recomputed")]
    assert len(copies) == len(set(copies)) >= len(plan.recomputed)


def test_unchanged_without_recomputation():
    program = compile_program(tower(), loss="squared_error")
    assert "recompute" not in program.manifest
    assert not any("_recomputed" in o for n in program.graphs["train_step"].graph.node
                   for o in n.output)


def test_random_nodes_are_kept_not_drawn_again():
    program = compile_program(tower(dropout=True), loss="squared_error", recompute="auto")
    step = program.graphs["train_step"]
    assert [n.op_type for n in step.graph.node].count("Dropout") == 1
    plan = program.manifest["recompute"]["train_step"]
    assert "d1" not in plan["recomputed"]
    _trained(program)  # runs


def test_updates_ordered_keeps_values():
    program = compile_program(tower(), loss="squared_error")
    step = program.graphs["train_step"]
    ordered = UpdatesInBackwardOrder()(step).model
    assert sorted(n.SerializeToString() for n in ordered.graph.node) == sorted(
        n.SerializeToString() for n in step.graph.node)
    last = ordered.graph.node[-1].output[0]
    assert last.startswith("W3")  # the weight the forward reads last is updated first


def test_needs_a_gradient_model():
    with pytest.raises(UnsupportedModelError, match="Recompute needs a gradient model"):
        Recompute(("h1",))(tower())


def test_onnxruntime_keeps_the_copies(tmp_path):
    """The fences keep onnxruntime's common-subexpression elimination from merging the
    copies back into the forward (which would keep the activations alive again)."""
    import onnxruntime

    program = compile_program(tower(), loss="squared_error", recompute=["h1"])
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    onnxruntime.InferenceSession(program.graphs["train_step"].SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
    optimized = onnx.load(tmp_path / "optimized.onnx")
    computed = {o for n in optimized.graph.node for o in n.output}
    assert {"a2", "a2_recomputed"} <= computed  # the forward's product and its copy


def test_accumulating_graphs_recompute_too():
    X, y = _data()
    trained = []
    for recompute in ("none", ["h1"]):
        program = compile_program(tower(), loss="squared_error", recompute=recompute,
                                  accumulation_steps=2)
        trainer = Trainer(program).fit(X, y, batch_size=3, epochs=1, shuffle=False,
                                       progress=False)
        trained.append(trainer.state)
    assert set(program.manifest["recompute"]) >= {"train_accumulate", "train_step_accumulated"}
    for name, value in trained[0].items():
        np.testing.assert_array_equal(trained[1][name], value, err_msg=name)


def _plan(recompute: str | float) -> dict[str, list[str]]:
    program = compile_program(residual_stack(), loss="squared_error", recompute=recompute)
    return program.manifest["recompute"]["train_step"]


def test_a_budget_recomputes_fewer_layers_as_it_grows():
    """From "auto" (the least memory) to 1.0 (nothing recomputed): the same boundaries,
    each larger budget recomputing a subset of what a smaller one does."""
    auto = _plan("auto")
    plans = [_plan(budget) for budget in (0.5, 0.6, 0.8, 1.0)]
    assert all(plan["boundaries"] == auto["boundaries"] for plan in plans)
    assert set(plans[0]["recomputed"]) < set(auto["recomputed"])
    for smaller, larger in zip(plans, plans[1:]):
        assert set(larger["recomputed"]) <= set(smaller["recomputed"])
    assert len(plans[2]["recomputed"]) < len(plans[0]["recomputed"])
    assert plans[-1]["recomputed"] == []


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("budget", [0.5, 0.8])
def test_a_budget_trains_as_without_recomputation(fuse, budget):
    model = residual_stack()
    rng = np.random.default_rng(2)
    X = rng.normal(size=(12, 16)).astype(np.float32)
    y = rng.normal(size=(12, 1)).astype(np.float32)
    trained = [Trainer(compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam",
                                       recompute=recompute))
               .fit(X, y, batch_size=4, epochs=1, shuffle=False, progress=False).state
               for recompute in ("none", budget)]
    for name, value in trained[0].items():
        np.testing.assert_array_equal(trained[1][name], value, err_msg=name)


def test_a_budget_recomputation_cannot_reach_is_refused_with_the_least_it_can():
    with pytest.raises(UnsupportedOptionError, match=r"recompute=0.3 keeps at most 30% .* "
                       r"still holds 47% .* raise the budget to 0.47 or more"):
        _plan(0.3)
    _plan(0.47)
