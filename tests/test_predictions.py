"""What an output holds, read from the nodes that compute it (lossgraph.predictions), the loss
compile picks for it (loss="auto"), and the loss it refuses (naming the one that fits). A
ZipMap output trained through the tensor it zips: tests/passes/test_zipmap.py."""

from __future__ import annotations

import pytest
from support.models import model

import lossgraph
from lossgraph.errors import UnsupportedOptionError
from lossgraph.passes.loss import choose_loss
from lossgraph.predictions import default_loss, output_kind

W3 = "float[4, 3] w = {0.1, 0, 0, 0, 0.1, 0, 0, 0, 0.1, 0.1, 0.1, 0.1}"
W1 = "float[4, 1] w = {0.1, -0.1, 0.2, 0}"

#: name -> (signature, body, what the output y holds, the loss "auto" picks, its options)
OUTPUTS = {
    "softmax": (f"(float[N, 4] x) => (float[N, 3] y) <{W3}>",
                "z = MatMul(x, w)  y = Softmax <axis = 1> (z)",
                "probabilities", "multiclass_log_loss", {}),
    "sigmoid column": (f"(float[N, 4] x) => (float[N, 1] y) <{W1}>",
                       "z = MatMul(x, w)  y = Sigmoid(z)", "probabilities", "binary_log_loss", {}),
    "one minus p, p": (f"(float[N, 4] x) => (float[N, 2] y) <{W1}, float one = {{1}}>",
                       "z = MatMul(x, w)  p = Sigmoid(z)  q = Sub(one, p) "
                       "y = Concat <axis = 1> (q, p)", "probabilities", "binary_log_loss", {}),
    "spelled-out sigmoid": (f"(float[N, 4] x) => (float[N, 1] y) <{W1}, float one = {{1}}>",
                            "z = MatMul(x, w)  n = Neg(z)  e = Exp(n)  d = Add(one, e) "
                            "y = Reciprocal(d)", "probabilities", "binary_log_loss", {}),
    "normalized rows": (f"(float[N, 4] x) => (float[N, 3] y) <{W3}, int64[1] axes = {{1}}>",
                        "z = MatMul(x, w)  p = Sigmoid(z) "
                        "s = ReduceSum <keepdims = 1> (p, axes)  y = Div(p, s)",
                        "probabilities", "multiclass_log_loss", {}),
    "scores an ArgMax reads": (f"(float[N, 4] x) => (float[N, 3] y, int64[N] label) <{W3}>",
                               "y = MatMul(x, w)  label = ArgMax <axis = 1, keepdims = 0> (y)",
                               "scores", "multiclass_log_loss", {"from_logits": True}),
    "one score compared with 0": (
        f"(float[N, 4] x) => (float[N, 1] y, bool[N, 1] label) <{W1}, float zero = {{0}}>",
        "y = MatMul(x, w)  label = Greater(y, zero)", "scores", "logistic", {}),
    "regression": (f"(float[N, 4] x) => (float[N, 1] y) <{W1}, float[1] b = {{0.5}}>",
                   "z = MatMul(x, w)  y = Add(z, b)", "values", "squared_error", {}),
    "tanh": (f"(float[N, 4] x) => (float[N, 1] y) <{W1}>", "z = MatMul(x, w)  y = Tanh(z)",
             "unknown", "squared_error", {}),
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_what_an_output_holds_and_the_loss_auto_picks(name):
    signature, body, holds, loss, options = OUTPUTS[name]
    net = model(signature, body)
    kind = output_kind(net, "y")
    assert kind.kind == holds
    assert default_loss(kind) == (loss, options)
    choice = choose_loss(net, "auto", "y")
    assert (choice.loss, dict(choice.options), choice.picked) == (loss, options, True)
    program = lossgraph.compile_program(net, loss_options={"output_index": "y"})
    assert program.notes.loss == choice


#: A loss given against what the output holds: (output, loss, options, the loss named).
MISFITS = [
    ("softmax", "squared_error", {}, "Use loss='multiclass_log_loss'"),
    ("one minus p, p", "huber", {}, "Use loss='binary_log_loss'"),
    ("scores an ArgMax reads", "absolute_error", {},
     "Use loss='multiclass_log_loss', from_logits=True"),
    ("scores an ArgMax reads", "multiclass_log_loss", {},
     "would clip them into [eps, 1 - eps]. Use loss='multiclass_log_loss', from_logits=True"),
    ("one score compared with 0", "binary_log_loss", {}, "Use loss='logistic'"),
    ("regression", "binary_log_loss", {}, "for a regression loss='squared_error'"),
    ("regression", "multiclass_log_loss", {}, "For class scores (logits) use loss='logistic'"),
    ("sigmoid column", "logistic", {}, "would apply a sigmoid or softmax to them again"),
    ("softmax", "multiclass_log_loss", {"from_logits": True}, "Use loss='multiclass_log_loss'"),
]


@pytest.mark.parametrize("name,loss,options,named", MISFITS,
                         ids=[f"{loss}-on-{name}" for name, loss, _, _ in MISFITS])
def test_a_loss_that_does_not_fit_the_output_is_refused_naming_the_one_that_does(
        name, loss, options, named):
    signature, body, _, fitting, fitting_options = OUTPUTS[name]
    net = model(signature, body)
    with pytest.raises(UnsupportedOptionError) as caught:
        lossgraph.compile_program(net, loss=loss,
                                  loss_options={"output_index": "y", **options})
    assert named in str(caught.value)
    assert "output 'y' holds" in str(caught.value)
    # and the loss it names fits
    lossgraph.compile_program(net, loss=fitting,
                              loss_options={"output_index": "y", **fitting_options})


def test_a_loss_on_an_output_of_unknown_kind_is_taken_as_given():
    """A log loss on a graph input or an op not read (Tanh here) is the user's call."""
    signature, body, *_ = OUTPUTS["tanh"]
    program = lossgraph.compile_program(model(signature, body), loss="binary_log_loss")
    assert program.notes.loss.loss == "binary_log_loss" and not program.notes.loss.picked
    identity = lossgraph.add_loss_output(model("(float[N, 3] p) => (float[N, 3] y)",
                                               "y = Identity(p)"), "multiclass_log_loss")
    assert lossgraph.get_roles(identity)["prediction"] == "y"


def test_add_loss_output_picks_the_same_loss_with_auto_and_keeps_its_own_default():
    signature, body, *_ = OUTPUTS["softmax"]
    net = model(signature, body)
    picked = lossgraph.add_loss_output(net, "auto")
    assert any(n.op_type == "GatherElements" for n in picked.graph.node)  # multiclass log loss
    with pytest.raises(UnsupportedOptionError, match="Use loss='multiclass_log_loss'"):
        lossgraph.add_loss_output(net)  # onnxcustom's default, squared_error


def test_the_choice_is_shown_by_describe_plan():
    signature, body, *_ = OUTPUTS["one minus p, p"]
    text = lossgraph.describe_plan(model(signature, body))
    assert ("loss model      = model -> ConvertOpset -> LowerMlOps -> "
            "AddLossOutput(loss='binary_log_loss', output_index='y')") in text
