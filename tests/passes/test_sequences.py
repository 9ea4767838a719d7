"""SequencesToTensors: a SplitToSequence read at constant positions is a Split.

The rewrite is exact (the same forward values, bit for bit), its gradient equals float64
finite differences, it runs in the training graphs only (the inference model keeps the
user's ops), and a sequence it cannot rewrite is left alone, for compile_program to name
(tests/test_blocked_weights.py). torch's dynamo export of ``Tensor.split`` with
``optimize=False`` trains like torch.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients, cotangent, finite_differences, loss_model
from support.models import model

import lossgraph
from lossgraph.compat import OrtGradientForwardBackward
from lossgraph.errors import NoGradientError, UnsupportedModelError
from lossgraph.passes import SequencesToTensors
from lossgraph.runtime.session import create_session

SEQUENCE_OPS = {"SplitToSequence", "SequenceAt", "SequenceLength", "ConcatFromSequence"}
#: h = x @ W is (N, 7): the split axis 1 is static, the batch axis 0 is not
SIGNATURE = "(double[N, 3] x, double[3, 7] W) => (OUTPUTS) <int64 zero = {0}, int64 one = {1}>"

#: name -> (outputs, body): each splits h along axis 1 and reads the pieces
CASES = {
    "scalar split, a shorter last piece, negative position": (
        "double[N, 4] y",
        """h = MatMul(x, W)  three = Constant<value = int64 {3}>()
           s = SplitToSequence<axis = 1>(h, three)
           a = SequenceAt(s, zero)  b = SequenceAt(s, one)
           last = Constant<value_int = -1>()  c = SequenceAt(s, last)
           p = Mul(a, b)  y = Concat<axis = 1>(p, c)"""),
    "1-D split, negative axis": (
        "double[N, 7] y",
        """h = MatMul(x, W)  sizes = Constant<value = int64[2] {2, 5}>()
           s = SplitToSequence<axis = -1>(h, sizes)
           a = SequenceAt(s, one)  b = SequenceAt(s, zero)
           t = Tanh(a)  q = Mul(b, b)  y = Concat<axis = 1>(q, t)"""),
    "no split, keepdims=0: pieces without the axis": (
        "double[N] y",
        """h = MatMul(x, W)  s = SplitToSequence<axis = 1, keepdims = 0>(h)
           six = Constant<value = int64 {6}>()
           a = SequenceAt(s, one)  b = SequenceAt(s, six)  y = Mul(a, b)"""),
    "no split, keepdims=1": (
        "double[N, 1] y",
        """h = MatMul(x, W)  s = SplitToSequence<axis = 1>(h)
           a = SequenceAt(s, one)  b = SequenceAt(s, zero)  e = Exp(b)  y = Div(a, e)"""),
    "one piece read twice, the count, everything stacked": (
        "double[N, 7] y",
        """h = MatMul(x, W)  s = SplitToSequence<axis = 1, keepdims = 0>(h)
           minus7 = Constant<value = int64 {-7}>()
           a = SequenceAt(s, zero)  b = SequenceAt(s, minus7)
           n = SequenceLength(s)  count = Cast<to = 11>(n)
           c = ConcatFromSequence<axis = 1, new_axis = 1>(s)
           axes = Constant<value = int64[1] {1}>()
           ab = Mul(a, b)  u = Unsqueeze(ab, axes)  cc = Mul(c, count)  y = Add(cc, u)"""),
    "concatenated along the split axis": (
        "double[N, 7] y",
        """h = MatMul(x, W)  two = Constant<value = int64 {2}>()
           s = SplitToSequence<axis = 1>(h, two)  c = ConcatFromSequence<axis = 1>(s)
           y = Sin(c)"""),
}


def _case(name: str) -> onnx.ModelProto:
    outputs, body = CASES[name]
    return model(SIGNATURE.replace("OUTPUTS", outputs), body)


def _inputs(rows: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(rows, 3)), "W": rng.normal(size=(3, 7))}


def _ops(graph_model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in graph_model.graph.node}


def _with_weight(given: onnx.ModelProto) -> onnx.ModelProto:
    """``given`` with its input ``W`` an initializer: a weight compile_program trains."""
    result = onnx.ModelProto()
    result.CopyFrom(given)
    (w,) = [i for i in result.graph.input if i.name == "W"]
    result.graph.input.remove(w)
    result.graph.initializer.append(onnx.numpy_helper.from_array(_inputs()["W"], "W"))
    return result


@pytest.mark.parametrize("name", CASES)
def test_the_rewrite_is_exact_and_its_gradient_equals_finite_differences(name):
    given = _case(name)
    result = SequencesToTensors()(given)
    assert result.changed and result.report == ("s",)
    assert not _ops(result.model) & SEQUENCE_OPS
    assert "Split" in _ops(result.model)
    inputs = _inputs()
    before = create_session(given).run(None, inputs)
    after = create_session(result.model).run(None, inputs)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_array_equal(old, new)
    # finite differences are the reference: onnxruntime-training 1.19's builder concatenates
    # the gradients of the Split's used outputs only, a graph that fails when one is unused
    check_gradients(result.model, inputs, ["x", "W"], ort=False)


#: name -> body: a SplitToSequence the rewrite leaves alone, each for one reason
LEFT_ALONE = {
    "the number of pieces depends on the batch": """
        h = MatMul(x, W)  two = Constant<value = int64 {2}>()
        s = SplitToSequence<axis = 0>(h, two)  a = SequenceAt(s, zero)
        axes = Constant<value = int64[1] {0}>()  r = ReduceSum<keepdims = 0>(a, axes)
        ends = Constant<value = int64[1] {3}>()  q = Slice(r, axes, ends)  y = Mul(x, q)""",
    "a position computed at run time": """
        h = MatMul(x, W)  s = SplitToSequence<axis = 1, keepdims = 0>(h)
        k = Shape<start = 1, end = 2>(x)  p = ReduceMax<keepdims = 0>(k)  a = SequenceAt(s, p)
        axes = Constant<value = int64[1] {1}>()  u = Unsqueeze(a, axes)  y = Mul(x, u)""",
    "a reader that is not SequenceAt, SequenceLength or ConcatFromSequence": """
        h = MatMul(x, W)  s = SplitToSequence<axis = 1, keepdims = 0>(h)
        e = SequenceErase(s, zero)  a = SequenceAt(e, zero)
        axes = Constant<value = int64[1] {1}>()  u = Unsqueeze(a, axes)  y = Mul(x, u)""",
}


@pytest.mark.parametrize("name", LEFT_ALONE)
def test_a_sequence_that_is_no_static_split_is_left_alone_and_its_weight_named(name):
    given = model(SIGNATURE.replace("OUTPUTS", "double[N, 3] y"), LEFT_ALONE[name])
    result = SequencesToTensors()(given)
    assert not result.changed and result.report == ()
    assert result.model.graph == given.graph
    weighted = _with_weight(given)
    assert lossgraph.trainable_initializers(weighted) == []
    with pytest.raises(UnsupportedModelError, match=r"(?s)'W' influences 'loss'.*"
                       r"\[SplitToSequence\].*SequencesToTensors rewrites a SplitToSequence "
                       r"into a Split only when"):
        lossgraph.compile_program(weighted)


def test_trainable_initializers_read_the_model_as_compile_program_differentiates_it():
    """A weight before a static split is trainable; lossgraph.gradient differentiates the
    graph as written and says what to run first."""
    weighted = _with_weight(_case("1-D split, negative axis"))
    assert lossgraph.trainable_initializers(weighted) == ["W"]
    assert lossgraph.analysis.blocked_initializers(weighted) == []
    loss_model = lossgraph.add_loss_output(weighted)
    with pytest.raises(NoGradientError, match="SequencesToTensors rewrites this "
                                              "SplitToSequence into a Split.*run it first"):
        lossgraph.gradient(loss_model, ["W"])
    with pytest.raises(UnsupportedModelError, match="SequencesToTensors rewrites this"):
        lossgraph.gradient(loss_model)  # no default weights around a blocked one
    rewritten = SequencesToTensors()(loss_model).model
    assert [o.name for o in lossgraph.gradient(rewritten).graph.output][-1] == "W_grad"


def test_compile_program_runs_it_in_the_training_graphs_only():
    weighted = _with_weight(_case("scalar split, a shorter last piece, negative position"))
    plan = lossgraph.describe_plan(weighted, fuse="separate")
    assert "-> InferenceMode -> SequencesToTensors -> StabilizeNumerics ->" in plan  # evaluate
    gradient = next(line for line in plan.splitlines() if line.startswith("gradient "))
    assert "= forward model -> WeightsToInputs(weights=('W',)) -> SequencesToTensors" \
           " -> StabilizeNumerics -> Gradient(" in gradient
    assert "SequencesToTensors" not in lossgraph.describe_plan(model(
        "(double[N, 3] x) => (double[N, 3] y) <double[3] W = {1, 2, 3}>", "y = Mul(x, W)"))
    for fuse in ("step", "epoch", "separate"):
        program = lossgraph.compile_program(weighted, fuse=fuse)
        assert program.weights == ["W"]
        for name, graph in program.graphs.items():  # predict: from the inference model
            assert bool(_ops(graph) & SEQUENCE_OPS) == (name == "predict"), (fuse, name)
        assert {"SplitToSequence", "SequenceAt"} <= _ops(program.inference_model)
        X = _inputs(6)["x"]
        assert np.array_equal(lossgraph.Trainer(program).predict(X),
                              create_session(weighted).run(None, {"x": X})[0])


def test_the_forward_backward_function_of_the_reference_documents_differentiates_it():
    """OrtGradientForwardBackward (and so lossgraph.torch's layer) trains the weight before
    the split: its gradient equals finite differences of the model as given."""
    given = _case("1-D split, negative axis")
    fb = OrtGradientForwardBackward(_with_weight(given))
    assert fb.weights_to_train == ["W"]
    inputs = _inputs()
    function = fb.new_instance()
    (y,) = function.forward([inputs["x"], inputs["W"]], training=True)
    grads = dict(zip(fb.grad_input_names, function.backward([cotangent(y.shape, y.dtype)])))
    with_loss = loss_model(given, inputs)
    for name in ("x", "W"):
        np.testing.assert_allclose(grads[name], finite_differences(with_loss, inputs, name, 1e-6),
                                   rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.torch
def test_torch_split_exported_by_dynamo_without_its_optimizer_trains_like_torch():
    torch = pytest.importorskip("torch")
    from support.torch_steps import assert_steps_like_torch

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 12)

        def forward(self, x):
            q, k, v = self.proj(x).split(4, dim=-1)
            return q * k + v

    torch.manual_seed(0)
    net = Split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings
        exported = torch.onnx.export(
            net, (torch.randn(3, 4),), dynamo=True, optimize=False, verbose=False,
            dynamic_shapes=({0: torch.export.Dim("N", min=2)},)).model_proto
    assert "SplitToSequence" in _ops(exported)
    assert lossgraph.trainable_initializers(exported) == ["proj.weight", "proj.bias"]
    program = lossgraph.compile_program(exported, optimizer=lossgraph.optim.SGD(0.05))
    rng = np.random.default_rng(1)
    X = rng.normal(size=(12, 4)).astype(np.float32)
    y = rng.normal(size=(12, 4)).astype(np.float32)
    assert_steps_like_torch(lossgraph.Trainer(program), net,
                            torch.optim.SGD(net.parameters(), lr=0.05), X, y, steps=3, rows=4)
