"""The compiler (lossgraph/compiler.py): describe_plan prints every graph a program will hold and
the pipeline that builds it, as compile_program builds them; its passes work on light models,
a large weight's data held apart."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS
from support.models import large_weights_model

import lossgraph
from lossgraph import compiler
from lossgraph.graphs import HeldWeights, stored_tensors
from lossgraph.graphs.held import HOLD_MIN_BYTES
from lossgraph.passes import Pass, PassResult


@pytest.fixture
def linear() -> onnx.ModelProto:
    return onnx.load(GOLDEN_MODELS / "hand_linear.onnx")


def test_describe_plan_prints_every_graph_of_a_separate_program(linear):
    """Every graph separate mode emits has a declared plan: the model's gradient from the
    forward model, the loss, update and penalty graphs from their builders' options."""
    text = lossgraph.describe_plan(linear, fuse="separate", penalty={"W": 0.1},
                                   optimizer=lossgraph.optim.Momentum(0.05))
    lines = {name.strip(): passes for name, passes in
             (line.split(" = ", 1) for line in text.splitlines())}
    assert list(lines) == ["loss model", "inference model", "forward model", "evaluate",
                           "predict", "gradient", "loss", "update", "penalty"]
    assert lines["forward model"] == "model -> ConvertOpset -> LowerMlOps"
    assert lines["gradient"].endswith("-> Gradient(weights=('W', 'B'), outputs=('Y',)) -> "
                                      "FoldBatchIntoProducts -> SumRowsByProduct -> "
                                      "ConcatScatteredSlabs -> UnfoldConvWeightGradients -> "
                                      "SumRowsByProduct -> UpdatesInBackwardOrder -> "
                                      "WidenScalarConstants")
    assert lines["loss"] == "LossGraph(loss='squared_error') -> WidenScalarConstants"
    assert lines["update"] == ("UpdateGraph(optimizer=Momentum(learning_rate=0.05)) -> "
                               "WidenScalarConstants")
    assert lines["penalty"] == "PenaltyGraph(penalty={'W': 0.1}) -> WidenScalarConstants"


def test_describe_plan_prints_the_pipelines_compile_program_runs(linear):
    text = lossgraph.describe_plan(linear, fuse="epoch", weights=["W"])
    lines = {name.strip(): passes for name, passes in
             (line.split(" = ", 1) for line in text.splitlines())}
    assert list(lines) == ["loss model", "inference model", "evaluate", "predict", "train_step",
                           "train_epoch_ordered", "train_epoch"]
    # the start models first: what compile makes of the model given, the loss it chose
    assert lines["loss model"] == ("model -> ConvertOpset -> LowerMlOps -> "
                                   "AddLossOutput(loss='squared_error', output_index='Y')")
    assert lines["inference model"] == "model -> ConvertOpset -> LowerMlOps -> StripTraining"
    assert lines["train_epoch"].startswith("loss model -> WeightsToInputs(weights=('W',)) -> "
                                           "StabilizeNumerics -> Gradient(weights=('W',)) -> "
                                           "FoldBatchIntoProducts -> SumRowsByProduct -> "
                                           "ConcatScatteredSlabs -> UnfoldConvWeightGradients "
                                           "-> PackWeights(")
    assert lines["train_epoch"].endswith(
        "-> StepGraph(optimizer=SGD) -> UpdatesInBackwardOrder -> EpochGraph -> "
        "WidenScalarConstants")
    assert lines["train_epoch_ordered"].endswith(
        "-> UpdatesInBackwardOrder -> EpochGraph(shuffle=False) -> WidenScalarConstants")
    # options off default only; the updates in the backward's order without recomputation
    assert lines["train_step"].endswith(
        "-> StepGraph(optimizer=SGD) -> UpdatesInBackwardOrder -> WidenScalarConstants")
    momentum = lossgraph.describe_plan(linear, optimizer=lossgraph.optim.Momentum(0.05))
    assert "StepGraph(optimizer=Momentum(learning_rate=0.05))" in momentum
    program = lossgraph.compile_program(linear, fuse="epoch", weights=["W"])
    assert list(program.graphs) == list(lines)[2:]


@pytest.mark.parametrize(("fuse", "weights", "copied"), [
    ("step", None, True),  # C a copy of W: compile warns it is one (read from the store)
    ("separate", None, False), ("epoch", None, False),
    ("epoch", ["S"], False),  # W frozen: an initializer of the epoch's Scan body
])
def test_compile_passes_never_copy_a_large_weights_data(monkeypatch, fuse, weights, copied):
    """Every pass of compile works on a light model (the large weight's data held apart,
    lossgraph.graphs.HeldWeights), and the program (and what compile warns) is byte for
    byte the one compiled with every weight's data in its models."""
    model = large_weights_model(copied=copied)
    seen: list[str] = []
    run = Pass.run

    def recording(step: Pass, given: onnx.ModelProto, **options: Any) -> PassResult:
        result = run(step, given, **options)
        seen.extend(f"{step.name}: {t.name}" for m in (given, result.model)
                    if isinstance(m, onnx.ModelProto) for t in stored_tensors(m)
                    if t.HasField("raw_data") and len(t.raw_data) >= HOLD_MIN_BYTES)
        return result

    monkeypatch.setattr(Pass, "run", recording)
    with warnings.catch_warnings(record=True) as light_warnings:
        warnings.simplefilter("always")
        program = lossgraph.compile_program(model, fuse=fuse, weights=weights)
    assert seen == []
    monkeypatch.setattr(Pass, "run", run)
    monkeypatch.setattr(compiler, "HeldWeights", lambda: HeldWeights(min_bytes=1 << 62))
    with warnings.catch_warnings(record=True) as whole_warnings:
        warnings.simplefilter("always")
        whole = lossgraph.compile_program(model, fuse=fuse, weights=weights)
    told = [str(w.message) for w in light_warnings]
    assert told == [str(w.message) for w in whole_warnings]
    assert any("a copy of 'W'" in message for message in told) == copied
    for graph in whole.graphs:
        assert program.graphs[graph].SerializeToString() == \
            whole.graphs[graph].SerializeToString()
    assert program.inference_model.SerializeToString() == \
        whole.inference_model.SerializeToString()
    assert program.state.keys() == whole.state.keys()
    for name, value in whole.state.items():
        np.testing.assert_array_equal(program.state[name], value)
