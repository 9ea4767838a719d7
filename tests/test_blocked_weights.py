"""A weight whose effect on the loss passes a value lossgraph does not differentiate (a
sequence, an optional) is never left out of the default weights in silence, nor given
part of its gradient: compile_program, lossgraph.gradient, the reference documents'
estimators and the command line name it, the node that blocks it and the ways out;
``trainable_initializers`` and ``lossgraph inspect`` still list what can be trained, and
``blocked_initializers`` what cannot.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import lossgraph
from lossgraph.analysis import blocked_initializers
from lossgraph.cli import main
from lossgraph.compat import OrtGradientForwardBackward, OrtGradientForwardBackwardOptimizer
from lossgraph.errors import NoGradientError, UnsupportedModelError
from lossgraph.runtime.session import create_session

#: W, and the BatchNormalization's scale and shift, reach the loss through a sequence only;
#: V and B after it. Not weights: the scalar k, the running mean and variance.
HEADER = """<ir_version: 8, opset_import: ["" : 18]>
    net (double[N, 3] x) => (double[N, 2] y)
    <double[3, 4] W = {0.1, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9, 1.0, 0.1, 0.2},
     double[4, 2] V = {0.3, -0.1, 0.2, 0.5, -0.4, 0.6, 0.1, -0.2}, double[2] B = {0.1, -0.1},
     double k = {2.0}, double[4] scale = {1, 2, 1, 2}, double[4] shift = {0, 1, 0, 1},
     double[4] mean = {0, 0.5, 0, 0.5}, double[4] var = {1, 2, 1, 2}>
"""
SEQUENCE = HEADER + """{
    h = MatMul(x, W)  hk = Mul(h, k)  n = BatchNormalization(hk, scale, shift, mean, var)
    s = SequenceConstruct(n)  c = ConcatFromSequence<axis = 1>(s)
    z = MatMul(c, V)  y = Add(z, B) }"""
OPTIONAL = HEADER + """{
    h = MatMul(x, W)  o = Optional(h)  e = OptionalGetElement(o)
    z = MatMul(e, V)  y = Add(z, B) }"""
#: W reaches the loss through the sequence and through tensors alone
BOTH = HEADER + """{
    h = MatMul(x, W)  s = SequenceConstruct(h)  c = ConcatFromSequence<axis = 1>(s)
    z = MatMul(c, V)  d = MatMul(h, V)  t = Add(z, d)  y = Add(t, B) }"""


def _model(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


def test_trainable_and_blocked_initializers_tell_the_two_apart():
    sequence = _model(SEQUENCE)
    assert lossgraph.trainable_initializers(sequence) == ["V", "B"]
    blocked, *others = blocked_initializers(sequence)
    assert [b.name for b in others] == ["scale", "shift"]
    assert (blocked.name, blocked.value, blocked.node.op_type) == ("W", "s", "SequenceConstruct")
    assert (blocked.kind, blocked.partial) == ("a sequence", False)
    assert blocked.describe() == (
        "'W' -> [MatMul] -> 'h' -> [Mul] -> 'hk' -> [BatchNormalization] -> 'n' -> "
        "[SequenceConstruct] -> 's' (a sequence)")
    (optional,) = blocked_initializers(_model(OPTIONAL))
    assert (optional.name, optional.kind, optional.node.op_type) == ("W", "an optional",
                                                                     "Optional")
    (both,) = blocked_initializers(_model(BOTH))
    assert both.name == "W" and both.partial
    assert lossgraph.trainable_initializers(_model(BOTH)) == ["W", "V", "B"]


@pytest.mark.parametrize("text, names, what", [
    (SEQUENCE, "Weights 'W', 'scale', 'shift' influence", "SequenceConstruct"),
    (OPTIONAL, "Weight 'W' influences", "Optional"), (BOTH, "Weight 'W' influences", "partial")])
def test_compile_program_chooses_no_default_weights_around_a_blocked_one(text, names, what):
    model = _model(text)
    with pytest.raises(UnsupportedModelError) as error:
        lossgraph.compile_program(model)
    message = str(error.value)
    assert message.startswith(f"{names} 'loss' through values lossgraph does not "
                              "differentiate")
    assert what in message
    assert "weights=[...] (those whose gradient is complete: 'V', 'B')" in message
    with pytest.raises(UnsupportedModelError, match="'W'"):  # the previous release's name
        with pytest.warns(lossgraph.errors.LossgraphDeprecationWarning):
            lossgraph.compile(model)


def test_named_weights_train_without_the_blocked_one():
    model = _model(SEQUENCE)
    program = lossgraph.compile_program(model, weights=["V", "B"], optimizer="adam")
    assert program.weights == ["V", "B"]
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(16, 3)), rng.normal(size=(16, 2))
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=3, batch_size=4, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def test_a_partial_gradient_is_refused_never_returned():
    """W's gradient through tensors alone would leave out its effect through the
    sequence: a wrong number, so lossgraph.gradient refuses it; a weight past the sequence
    gets its complete gradient."""
    loss_model = lossgraph.add_loss_output(_model(BOTH))
    with pytest.raises(UnsupportedModelError, match=r"(?s)its gradient would be partial.*"
                                                    r"a wrong number"):
        lossgraph.gradient(loss_model, ["W"])
    with pytest.raises(UnsupportedModelError, match="chooses no default weights"):
        lossgraph.gradient(loss_model)
    graph = lossgraph.gradient(loss_model, ["V"])
    assert create_session(graph).run(["V_grad"], {"x": np.ones((2, 3)),
                                                  "label": np.ones((2, 2))})[0].shape == (4, 2)


def test_a_weight_named_that_no_gradient_reaches_is_named_with_its_block():
    with pytest.raises(NoGradientError, match=r"node \[SequenceConstruct\] blocks it: its "
                                              r"output 's' is a sequence, and lossgraph "
                                              r"differentiates tensors only"):
        lossgraph.gradient(lossgraph.add_loss_output(_model(SEQUENCE)), ["W"])


def test_the_reference_documents_classes_name_it_too():
    model = _model(OPTIONAL)
    with pytest.raises(UnsupportedModelError, match="'W' influences 'y'"):
        OrtGradientForwardBackward(model)
    estimator = OrtGradientForwardBackwardOptimizer(model, max_iter=1)
    with pytest.raises(UnsupportedModelError, match="'W' influences 'y'"):
        estimator.fit(np.ones((4, 3)), np.ones((4, 2)))


def test_the_command_line_names_it_and_inspect_shows_it(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save(_model(SEQUENCE), path)
    assert main(["compile", str(path), "-o", str(tmp_path / "program")]) == 2
    assert "'W', 'scale', 'shift' influence 'loss'" in capsys.readouterr().err
    assert not (tmp_path / "program").exists()
    assert main(["compile", str(path), "-o", str(tmp_path / "program"), "--weights", "V",
                 "B"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trainable"] == ["V", "B"]
    assert report["blocked"][0] == {
        "name": "W", "kind": "a sequence", "partial": False,
        "path": ["W", "MatMul", "h", "Mul", "hk", "BatchNormalization", "n",
                 "SequenceConstruct", "s"]}
    assert [b["name"] for b in report["blocked"]] == ["W", "scale", "shift"]
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "compile chooses no default weights around them" in text
    assert "every op between the trainable weights" not in text
