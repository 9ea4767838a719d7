"""The checks of compile's options and of the model, done before any work
(lossgraph/validation.py): each a named error, or a warning, saying what to do."""

from __future__ import annotations

import onnx
import pytest
from support.linear import linear_program
from support.models import ROUNDED

import lossgraph
from lossgraph.errors import UnsupportedModelError, UnsupportedOptionError
from lossgraph.optim import Momentum
from lossgraph.validation import (
    check_penalized,
    check_trainable_model,
    compile_options,
    no_weights_error,
)


def test_compile_rejects_unknown_fusion_modes_and_weightless_models():
    with pytest.raises(UnsupportedOptionError, match="fuse='scan'"):
        linear_program("scan")
    weightless = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y) { y = Relu(x) }
    """)
    with pytest.raises(lossgraph.LossgraphError, match="no trainable weights"):
        lossgraph.compile_program(weightless)


def test_compiling_stuck_weights_warns_and_refuses_when_none_can_learn():
    import pytest

    import lossgraph
    from lossgraph.errors import NoGradientError, StuckWeightWarning

    model = onnx.parser.parse_model(ROUNDED)
    with pytest.warns(StuckWeightWarning, match="'w', 'v' reach the loss 'loss' only"):
        lossgraph.compile_program(model)
    with pytest.raises(NoGradientError, match="No weight can learn: 'v' reaches the loss"):
        lossgraph.compile_program(model, weights=["v"])


# -- the functions themselves, apart from compile_program -----------------------------------


def test_compile_options_come_back_in_the_form_the_pipeline_uses():
    options = compile_options("coef", "squared_error", None, None, "momentum", "onnx", "step")
    assert options.weights == ["coef"]  # one name is a list of one, never its letters
    assert options.loss_options == {}
    assert isinstance(options.optimizer, Momentum)
    assert (options.backend, options.fuse) == ("onnx", "step")


@pytest.mark.parametrize("loss, loss_options, penalty, pattern", [
    ("squared_error", {"reduction": "none"}, None, "a loss per row"),
    ("squared_error", {"delta": 1.0}, None, "no key 'delta' for loss='squared_error'"),
    ("squared_error", {"loss": "huber"}, None, "pass it to compile itself as loss="),
    ("squared_error", [1], None, "must be a dict of add_loss_output options"),
    (None, {"reduction": "sum"}, None, "has no effect with loss=None"),
    (None, None, {"W": 0.1}, "penalty= needs lossgraph to add the loss"),
], ids=["reduction none", "unknown key", "loss in the options", "not a dict",
        "options without a loss", "penalty without a loss"])
def test_loss_options_and_penalty_are_checked_against_the_loss(loss, loss_options, penalty,
                                                               pattern):
    with pytest.raises(UnsupportedOptionError, match=pattern):
        compile_options(None, loss, loss_options, penalty, None, "onnx", "step")


def test_a_penalty_on_a_weight_not_trained_is_refused_with_the_weights_trained():
    with pytest.raises(UnsupportedOptionError, match="penalty names 'W', which is not trained"):
        check_penalized({"W": 0.1}, ["B"])
    check_penalized({"B": 0.1}, ["B"])


@pytest.mark.parametrize("signature, body, pattern", [
    ("(float[N, 2] x) => (float[N, 2] x2)", "", "has no nodes"),
    ("(float x) => (float y)", "y = Mul(x, w)", "Input 'x' is a scalar"),
    ("(float[3, 2] x, float[N, 2] z) => (float[3, 2] y)", "y = Add(x, z)",
     "Input 'x' has a fixed batch dimension of 3, but input 'z''s is free"),
    ("(float[3, 2] x) => (float[1, 2] y)", "y = ReduceSum <keepdims: int = 1> (x, zero)",
     "the inputs' batch is fixed at 3 rows"),
    ("(float[N, 2] x) => (float[3, 2] y)", "y = Mul(x, w)",
     "Output 'y' has a fixed batch dimension of 3"),
], ids=["no nodes", "a scalar input", "a fixed input batch beside a free one",
        "an output not of the fixed batch", "a fixed output batch"])
def test_what_makes_a_valid_model_untrainable_is_named(signature, body, pattern):
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 18]>
        g {signature} <float[2] w = {{1, 2}}, int64[1] zero = {{0}}> {{ {body} }}""")
    with pytest.raises(UnsupportedModelError, match=pattern):
        check_trainable_model(model)


def test_a_fixed_batch_alone_is_trainable():
    """torch's default export fixes the batch: compile frees or keeps it (GeneralizeBatch)."""
    check_trainable_model(onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[3, 2] x) => (float[3, 2] y) <float[2] w = {1, 2}> { y = Mul(x, w) }"""))


def test_a_model_without_trainable_weights_is_told_where_its_weights_are():
    constants = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y) {
            c = Constant <value = float[2] {1, 2}> ()
            y = Mul(x, c) }""")
    assert "seem to be Constant nodes ('c')" in str(no_weights_error(constants))
    integers = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y) <int64[1] k = {1}> { y = Identity(x) }""")
    assert "its initializers: 'k' (int64[1])" in str(no_weights_error(integers))
