"""Recompute: the backward reads the kept values only, and trains exactly as without it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import gelu_mlp, residual_stack, tower

from lossgraph import Trainer, add_loss_output, compile_program, gradient
from lossgraph.errors import UnsupportedModelError, UnsupportedOptionError
from lossgraph.passes import Recompute
from lossgraph.passes import recompute as recompute_module
from lossgraph.passes.recompute import UpdatesInBackwardOrder, default_recompute
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
@pytest.mark.parametrize("recompute", ["auto", "activations", "elementwise", ["h1"],
                                       ["h1", "h2"]])
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
    elif recompute == "activations":  # the residual sum and its sigmoid, from h1 and t2
        assert all(plan["kept"][:2] == ["h1", "t2"] and {"h2", "s"} <= set(plan["recomputed"])
                   for plan in plans.values())
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
    assert set(plans[0]["recomputed"]) <= set(auto["recomputed"])
    for smaller, larger in zip(plans, plans[1:]):
        assert set(larger["recomputed"]) <= set(smaller["recomputed"])
    assert len(plans[2]["recomputed"]) < len(plans[0]["recomputed"])
    assert plans[-1]["recomputed"] == []


def test_auto_keeps_the_segment_after_its_last_boundary_whole():
    """The backward reads the last segment first, while the forward's values are still
    there: it is kept, not computed twice (a wide output layer, a language model's, and
    its loss). A tail of less than half a segment joins the segment before it, which is
    then kept whole too (a one-column head after the last layer)."""
    wide = compile_program(residual_stack(outputs=64), loss="squared_error",
                           recompute="auto").manifest["recompute"]["train_step"]
    assert wide["boundaries"][-1] == "h7"
    assert {"y", "diff"} & set(wide["recomputed"]) == set()
    assert {"a6", "t6", "h6", "a7", "t7"} <= set(wide["recomputed"])
    narrow = _plan("auto")
    assert narrow["boundaries"] == ["h1", "h3", "h5"]
    assert not {"a6", "t6", "h6", "a7", "t7", "y", "diff"} & set(narrow["recomputed"])
    assert {"a0", "a4", "t5"} <= set(narrow["recomputed"])


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("budget", ["auto", 0.5, 0.8])
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
                       r"still holds 47% .* raise the budget to 0.48 or more"):
        _plan(0.3)
    _plan(0.48)


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_activations_recomputes_a_gelus_intermediates_from_its_input(fuse):
    """A decomposed GELU: the backward reads its input ``a`` and three of its
    intermediates without recomputation; with ``"activations"`` it keeps ``a`` alone and
    computes the rest again from it, to the same weights bit for bit."""
    model = gelu_mlp()
    plain = compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam")
    program = compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam",
                              recompute="activations")
    for graph, plan in program.manifest["recompute"].items():
        assert {"u", "b", "g"} <= set(plan["recomputed"]), graph
        assert "a" in plan["kept"] and not {"u", "b", "g"} & set(plan["kept"]), graph
    expected = _trained(plain)
    for name, value in _trained(program).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize("fuse", ["step", "separate"])
def test_activations_recomputes_a_view_of_what_it_recomputes(fuse):
    """The product reads the GELU's output through a ``Reshape`` by ``Shape(a)``: the view
    is recomputed with the GELU's intermediates, its shape kept (two numbers), so that only
    ``a`` is kept of the block's activations, to the same weights bit for bit."""
    model = gelu_mlp(viewed=True)
    plain = compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam")
    program = compile_program(model, loss="squared_error", fuse=fuse, optimizer="adam",
                              recompute="activations")
    for graph, plan in program.manifest["recompute"].items():
        assert {"u", "b", "g", "f"} <= set(plan["recomputed"]), graph
        assert {"a", "s"} <= set(plan["kept"]), graph
        assert not {"u", "b", "g", "m", "f"} & set(plan["kept"]), graph
    expected = _trained(plain)
    for name, value in _trained(program).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_activations_recomputes_nothing_whose_input_is_not_kept():
    """``relu(x W + b) W2``: the backward reads the Relu's output, not the sum it is
    computed from, so recomputing it would keep as much: it is kept (only the loss's
    square, which the backward reads for its shape, is computed again from the residual)."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        mlp (float[N, 3] x, float[3, 4] W, float[4] b, float[4, 1] W2) => (float[N, 1] y) {
            p = MatMul(x, W)  a = Add(p, b)  r = Relu(a)  y = MatMul(r, W2) }""")
    graph = gradient(add_loss_output(model, "squared_error"), weights=["W", "b", "W2"])
    result = Recompute("activations")(graph)
    assert "r" in result.report.kept
    assert result.report.recomputed == ("squared_error",)


def test_a_large_model_recomputes_activations_by_default(monkeypatch):
    """compile's recompute=None: "activations" for a model of ACTIVATIONS_MIN_BYTES of
    initializers or more (here lowered to the GELU model's), "none" below."""
    model = gelu_mlp()
    assert default_recompute(model) == "none"
    assert "recompute" not in compile_program(model, loss="squared_error").manifest
    held = sum(t.ByteSize() for t in model.graph.initializer)
    monkeypatch.setattr(recompute_module, "ACTIVATIONS_MIN_BYTES", held // 2)
    assert default_recompute(model) == "activations"
    plans = compile_program(model, loss="squared_error").manifest["recompute"]
    assert {"u", "b", "g"} <= set(plans["train_step"]["recomputed"])
    none = compile_program(model, loss="squared_error", recompute="none")
    assert "recompute" not in none.manifest


def test_the_default_counts_the_initializers_dims_not_their_data():
    """64 MiB of weights declared by dims (the data held elsewhere, as a light model's)."""
    big = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[16, 2**20])
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [], [big]))
    assert default_recompute(model) == "activations"
    model.graph.initializer[0].dims[:] = [16, 2**20 - 1]
    assert default_recompute(model) == "none"
