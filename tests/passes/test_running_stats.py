"""A training-mode BatchNormalization in training programs: RunningStatistics writes it as one
node of the model-local function ``lossgraph.BatchNormalizationTraining`` (its body the
batch-statistics normalization in standard ops, which it outputs too), and the gradient pass
differentiates that node in closed form, reading the forward's statistics. Its gradients
equal float64 finite differences (through ``y`` and through the running statistics' update),
the chain rule through the body's ops that programs took before (to float rounding), and
torch autograd in every fusion mode and in the forward/backward object; the evaluate and
predict graphs and the exported inference model have nothing of it.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.inliner
import pytest
from onnx import helper, numpy_helper
from support.gradcheck import finite_differences, loss_model
from support.models import model_of_graph
from support.torch_steps import assert_gradients_close, make_distinct, torch_gradients

import lossgraph
from lossgraph.autodiff.rules.nn import TRAINING_BATCH_NORM, TRAINING_BATCH_NORM_DOMAIN
from lossgraph.export import to_inference_model
from lossgraph.graphs import all_graphs
from lossgraph.optim import SGD
from lossgraph.passes import RunningStatistics, WeightsToInputs
from lossgraph.runtime.session import create_session

MODES = ("step", "epoch", "separate")
STATISTICS = ("scale", "B", "mean", "var")


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node of every graph of ``model`` (subgraphs included; not function bodies)."""
    return [node for graph in all_graphs(model.graph) for node in graph.node]


def _is_training_batch_norm(node: onnx.NodeProto) -> bool:
    return (node.domain, node.op_type) == (TRAINING_BATCH_NORM_DOMAIN, TRAINING_BATCH_NORM)


def _assert_statistics_not_recomputed(model: onnx.ModelProto) -> None:
    """The node's rule, not the chain rule through its body (which recomputes the body's
    values): the input x of each node is read by the node and by the rule's one
    ``x - mean`` only (``Shape`` and ``Size`` aside)."""
    for graph in all_graphs(model.graph):
        for node in filter(_is_training_batch_norm, graph.node):
            readers = sorted(n.op_type for n in graph.node
                             if node.input[0] in n.input and n.op_type not in ("Shape", "Size"))
            assert readers == sorted([TRAINING_BATCH_NORM, "Sub"]), readers


def _batch_norm(opset: int, shape: tuple[int, ...], dtype=np.float64) -> tuple[onnx.ModelProto,
                                                                                 dict]:
    """``y = BatchNormalization(x, scale, B, mean, var)`` in training mode (``training_mode=1``
    from opset 14, five outputs before), momentum 0.7 and epsilon 0.001, lifted and rewritten
    by RunningStatistics: inputs x and the four (C,) tensors, outputs y, ``mean_new`` and
    ``var_new``; and the feeds."""
    rng = np.random.default_rng(opset)
    channels = shape[1]
    feeds = {"x": rng.normal(1.0, 2.0, shape), "scale": rng.normal(1.0, 0.5, channels),
             "B": rng.normal(size=channels), "mean": rng.normal(size=channels),
             "var": rng.uniform(0.5, 1.5, channels)}
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    extra = {"training_mode": 1} if opset >= 14 else {}
    outputs = ["y", "running_mean", "running_var", *([] if opset >= 14 else ["saved", "saved_v"])]
    node = helper.make_node("BatchNormalization", ["x", *STATISTICS], outputs, name="bn",
                            momentum=0.7, epsilon=1e-3, **extra)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, shape)],
        [numpy_helper.from_array(feeds[name], name) for name in STATISTICS])
    lifted = WeightsToInputs(STATISTICS)(model_of_graph(graph, opset=opset)).model
    return RunningStatistics()(lifted).model, feeds


def _gradients(model: onnx.ModelProto, feeds: dict, output: str, wrt: list[str]) -> dict:
    """lossgraph's gradient of ``sum(output * R)`` (R gradcheck's cotangent) by input."""
    with_loss = loss_model(model, feeds, output)
    graph = lossgraph.gradient(with_loss, weights=wrt, loss_name="gradcheck_loss")
    values = create_session(graph).run([f"{w}_grad" for w in wrt], feeds)
    return dict(zip(wrt, values))


@pytest.mark.parametrize("opset, shape", [(13, (6, 3)), (15, (4, 3, 5)), (18, (3, 2, 3, 2))])
@pytest.mark.parametrize("output, wrt", [("y", ["x", "scale", "B"]),
                                         ("mean_new", ["x", "mean"]),
                                         ("var_new", ["x", "var"])])
def test_the_function_gradient_equals_float64_finite_differences(opset, shape, output, wrt):
    """Through y (the closed form) and through the running statistics' update (the batch
    statistics outputs), at each form of the node (five outputs; ReduceMean's axes an
    attribute, then an input) and ranks 2 to 4."""
    model, feeds = _batch_norm(opset, shape)
    (node,) = [n for n in model.graph.node if _is_training_batch_norm(n)]
    grads = _gradients(model, feeds, output, wrt)
    with_loss = loss_model(model, feeds, output)
    for name in wrt:
        numeric = finite_differences(with_loss, feeds, name, 1e-6)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d/d{name} of {output}, opset {opset}")
    graph = lossgraph.gradient(with_loss, weights=wrt, loss_name="gradcheck_loss")
    _assert_statistics_not_recomputed(graph)
    assert {n.domain for n in graph.graph.node} <= {"", TRAINING_BATCH_NORM_DOMAIN}
    assert node.name == "bn"


def test_the_closed_form_equals_the_chain_rule_through_the_body():
    """The gradients the chain rule gives through the function's body inlined (the standard
    ops programs differentiated before: the inference-mode rule, then ReduceMean, Sub, Mul),
    to float32 rounding; and the same forward values."""
    model, feeds = _batch_norm(17, (8, 4, 3, 3), np.float32)
    inlined = onnx.inliner.inline_local_functions(model)
    assert not inlined.functions
    assert not any(_is_training_batch_norm(n) for n in inlined.graph.node)
    for output, wrt in (("y", ["x", "scale", "B"]), ("var_new", ["x"])):
        ours = _gradients(model, feeds, output, wrt)
        chain = _gradients(inlined, feeds, output, wrt)
        for name in wrt:
            scale = float(np.abs(chain[name]).max())
            assert scale > 0
            np.testing.assert_allclose(ours[name], chain[name], rtol=1e-5, atol=1e-6 * scale,
                                       err_msg=f"d/d{name} of {output}")
    names = ["y", "mean_new", "var_new"]
    for ours, before in zip(create_session(model).run(names, feeds),
                            create_session(inlined).run(names, feeds)):
        np.testing.assert_allclose(ours, before, rtol=1e-6, atol=1e-7)


CONV_BN = """<ir_version: 8, opset_import: ["" : 17]>
net (float[N, 2, 5] x) => (float[N, 2] y)
<float[3, 2, 1] W = {0.5, -0.3, 0.2, 0.8, -0.6, 0.4}, float[3] scale = {1.0, 0.5, 2.0},
 float[3] shift = {0.1, -0.2, 0.3}, float[3] mean = {0.5, -0.5, 1.0},
 float[3] var = {1.0, 2.0, 0.5}, float[15, 2] V = {0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8,
 0.9, -1.0, 0.2, 0.4, -0.1, 0.3, 0.6, -0.5, 0.8, -0.7, 0.2, 0.1, -0.3, 0.5, 0.4, -0.2, 0.1,
 0.6, -0.4, 0.3, 0.7, -0.1}>
{
  h = Conv(x, W)
  n, running_mean, running_var = BatchNormalization <training_mode: int = 1>
      (h, scale, shift, mean, var)
  f = Flatten(n)
  y = MatMul(f, V)
}"""


@pytest.mark.parametrize("fuse", MODES)
def test_training_graphs_differentiate_the_function_and_nothing_else_holds_it(fuse):
    """Every training graph (a Scan body included) runs the node and differentiates it by its
    rule (no BatchNormalization outside the function, no recomputed statistics); the
    evaluate and predict graphs and the inference export have no lossgraph-domain node."""
    program = lossgraph.compile_program(onnx.parser.parse_model(CONV_BN), fuse=fuse)
    training = {"step": ["train_step"],
                "epoch": ["train_step", "train_epoch", "train_epoch_ordered"],
                "separate": ["gradient"]}[fuse]
    for name in training:
        graph = program.graphs[name]
        nodes = _nodes(graph)
        assert sum(map(_is_training_batch_norm, nodes)) == 1, name
        assert [(f.domain, f.name) for f in graph.functions] == [
            (TRAINING_BATCH_NORM_DOMAIN, TRAINING_BATCH_NORM)]
        assert not any(n.op_type == "BatchNormalization" for n in nodes), name
        _assert_statistics_not_recomputed(graph)
    trainer = lossgraph.Trainer(program)
    X = np.random.default_rng(0).normal(size=(16, 2, 5)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(16, 2)).astype(np.float32)
    trainer.fit(X, y, epochs=1, batch_size=8, shuffle=False, progress=False)
    for name, model in (("evaluate", program.graphs["evaluate"]),
                        ("predict", program.graphs["predict"]),
                        ("export", to_inference_model(trainer))):
        assert not model.functions, name
        assert {n.domain for n in _nodes(model)} <= {"", "ai.onnx"}, name
        assert all(o.domain in ("", "ai.onnx") for o in model.opset_import), name


# -- against torch, every fusion mode --------------------------------------------------------


def _torch_net(torch):
    """Conv, BatchNorm2d, ReLU, Conv, BatchNorm2d (torch momentum 0.3), Linear: the first
    BatchNormalization's gradient reaches a weight through the second."""
    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
                        nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4, momentum=0.3),
                        nn.Flatten(), nn.Linear(4 * 2 * 2, 2))
    make_distinct(net)
    return net.train()


def _export(torch, net) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.zeros((4, 2, 6, 6)),), buffer, dynamo=False,
                          opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    net.train()
    return onnx.load_from_string(buffer.getvalue())


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return (rng.normal(size=(8, 2, 6, 6)).astype(np.float32),
            rng.normal(size=(8, 2)).astype(np.float32))


@pytest.mark.torch
@pytest.mark.parametrize("fuse", MODES)
def test_one_step_has_torchs_gradients_and_running_statistics(fuse):
    """One SGD step of learning rate 1 on one batch: the weights move by torch autograd's
    float64 gradient, and the running statistics are torch's after that batch."""
    import torch

    net = _torch_net(torch)
    program = lossgraph.compile_program(_export(torch, net), optimizer=SGD(1.0), fuse=fuse)
    X, y = _data()
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=len(X), shuffle=False,
                                             progress=False)
    ours = {w: program.state[w] - trainer.state[w] for w in program.weights}
    assert_gradients_close(ours, torch_gradients(net, X, y), rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        net(torch.from_numpy(X))  # torch's running statistics take this batch
    buffers = dict(net.named_buffers())
    assert program.buffers
    for name in program.buffers:
        np.testing.assert_allclose(trainer.state[name], buffers[name].numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


@pytest.mark.torch
def test_the_forward_backward_object_has_torchs_gradients():
    """OrtGradientForwardBackward (and so lossgraph.torch) differentiates the function too."""
    import torch

    net = _torch_net(torch)
    fb = lossgraph.OrtGradientForwardBackward(_export(torch, net))
    assert sum(map(_is_training_batch_norm, _nodes(fb.gradient_onnx))) == 2
    assert not any(n.op_type == "BatchNormalization" for n in _nodes(fb.gradient_onnx))
    _assert_statistics_not_recomputed(fb.gradient_onnx)
    weights = {name: fb.get_initializer(name) for name in fb.weights_to_train}
    X, y = _data()
    function = fb.new_instance()
    (prediction,) = function.forward([X, *weights.values()], training=True)
    grad_y = 2 * (prediction - y) / prediction.size  # of torch's mean squared error
    ours = dict(zip(weights, function.backward([grad_y])[1:]))
    assert_gradients_close(ours, torch_gradients(net, X, y), rtol=1e-3, atol=1e-4)
