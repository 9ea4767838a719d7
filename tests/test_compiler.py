"""The compiler (lossgraph/compiler.py): describe_plan prints every graph a program will hold and
the pipeline that builds it, and compile_program runs a prefix that pipelines share once."""

from __future__ import annotations

import onnx
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph
from lossgraph.passes import WeightsToInputs


def golden(name: str) -> onnx.ModelProto:
    return onnx.load(GOLDEN_MODELS / f"{name}.onnx")


@pytest.fixture
def linear() -> onnx.ModelProto:
    return golden("hand_linear")


def test_describe_plan_prints_every_graph_of_a_separate_program(linear):
    """Every graph separate mode emits has a declared plan: the model's gradient from the
    forward model, the loss, update and penalty graphs from their builders' options."""
    text = lossgraph.describe_plan(linear, fuse="separate", penalty={"W": 0.1},
                                   optimizer=lossgraph.optim.Momentum(0.05))
    lines = dict(line.split(" = ", 1) for line in text.splitlines())
    assert [name.strip() for name in lines] == ["evaluate", "predict", "gradient", "loss",
                                                "update", "penalty"]
    assert lines["gradient"].endswith("-> Gradient(weights=('W', 'B'), outputs=('Y',)) -> "
                                      "SumRowsByProduct -> SumRowsByProduct -> "
                                      "WidenScalarConstants")
    assert lines["loss    "] == "LossGraph(loss='squared_error') -> WidenScalarConstants"
    assert lines["update  "] == ("UpdateGraph(optimizer=Momentum(learning_rate=0.05)) -> "
                                 "WidenScalarConstants")
    assert lines["penalty "] == "PenaltyGraph(penalty={'W': 0.1}) -> WidenScalarConstants"


def test_describe_plan_prints_the_pipelines_compile_program_runs(linear):
    text = lossgraph.describe_plan(linear, fuse="epoch", weights=["W"])
    lines = {name.strip(): passes for name, passes in
             (line.split(" = ", 1) for line in text.splitlines())}
    assert list(lines) == ["evaluate", "predict", "train_step", "train_epoch_ordered",
                           "train_epoch"]
    assert lines["train_epoch"].startswith("loss model -> WeightsToInputs(weights=('W',)) -> "
                                           "StabilizeNumerics -> Gradient(weights=('W',)) -> "
                                           "FoldBatchIntoProducts -> SumRowsByProduct -> "
                                           "ConcatScatteredSlabs -> UnfoldConvWeightGradients "
                                           "-> PackWeights(")
    assert lines["train_epoch"].endswith("-> EpochGraph -> WidenScalarConstants")
    assert lines["train_epoch_ordered"].endswith(
        "-> EpochGraph(shuffle=False) -> WidenScalarConstants")
    assert "-> StepGraph(optimizer=SGD) ->" in lines["train_step"]  # options off default only
    momentum = lossgraph.describe_plan(linear, optimizer=lossgraph.optim.Momentum(0.05))
    assert "StepGraph(optimizer=Momentum(learning_rate=0.05))" in momentum
    program = lossgraph.compile_program(linear, fuse="epoch", weights=["W"])
    assert list(program.graphs) == list(lines)


def test_compile_runs_a_prefix_shared_by_equal_passes_once(monkeypatch):
    """Pipelines built apart share the passes they have in common (equal options): the
    epoch program lifts the weights of the loss model once for its four training and
    evaluation graphs, and the inference model's once."""
    calls = []
    real = WeightsToInputs.call
    monkeypatch.setattr(WeightsToInputs, "call", lambda self, model: calls.append(1)
                        or real(self, model))
    lossgraph.compile_program(golden("hand_linear"), fuse="epoch")
    assert len(calls) == 2
