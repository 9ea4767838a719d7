"""One name where a list of names is expected is a list of one, never its letters, in
every public function that takes names (docs/reference/errors.md, Decisions)."""

from __future__ import annotations

from collections.abc import Callable

import onnx
import pytest
from support.linear import LINEAR

import lossgraph
from lossgraph.parallel import ParallelProgram
from lossgraph.passes import Gradient, WeightsToInputs


def linear() -> onnx.ModelProto:
    """The linear model, its output named ``score`` (a name of several letters)."""
    return onnx.parser.parse_model(LINEAR.replace(" y", " score"))


def loss_model() -> onnx.ModelProto:
    return lossgraph.add_loss_output(linear())


def graph_outputs(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


#: each entry point, called with names: what it gives
CALLS: dict[str, Callable[[object], object]] = {
    "compile_program(weights=)": lambda names: lossgraph.compile_program(
        linear(), weights=names).weights,
    "describe_plan(weights=)": lambda names: lossgraph.describe_plan(linear(), weights=names),
    "gradient(weights=)": lambda names: graph_outputs(
        lossgraph.gradient(loss_model(), weights=names)),
    "gradient(outputs=)": lambda names: [i.name for i in lossgraph.gradient(
        linear(), outputs=names, weights=["coef"]).graph.input],
    "Gradient(weights=)": lambda names: Gradient(weights=names)(loss_model()).report,
    "WeightsToInputs(weights=)": lambda names: sorted(WeightsToInputs(names)(linear()).report),
    "alphabetize_initializers(weights=)": lambda names: lossgraph.alphabetize_initializers(
        linear(), weights=names)[1],
    "OrtGradientForwardBackward(weights_to_train=)": lambda names: (
        lossgraph.OrtGradientForwardBackward(linear(), weights_to_train=names)
        .weights_to_train),
    "ParallelProgram.compile(weights=)": lambda names: ParallelProgram.compile(
        linear(), weights=names).program.weights,
}
SINGLE = {"gradient(outputs=)": "score"}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_one_name_is_the_list_of_that_name(call):
    name = SINGLE.get(call, "coef")
    assert CALLS[call](name) == CALLS[call]([name])
