"""A training-mode Dropout written without its mask output (torch's dynamo exporter writes
it so) trains: the gradient pass gives the node its mask output, under a fresh name, and
the gradient is ``dy * mask / (1 - ratio)`` with the mask that same forward pass drew."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

import lossgraph
from lossgraph.runtime.session import create_session

#: ``d_mask`` is taken already: the mask output gets another name
DROPOUT = """<ir_version: 10, opset_import: ["" : 17]>
net (double[N, 4] x) => (double[N, 2] y)
<double[4, 3] W1 = {0.3, -0.2, 0.5, 0.1, 0.4, -0.6, -0.3, 0.2, 0.7, 0.5, -0.1, 0.2},
 double[3, 2] W2 = {0.2, -0.4, 0.6, 0.1, -0.5, 0.3}, float ratio = {0.4}, bool on = {1},
 double d_mask = {1.5}>
{
  h = MatMul(x, W1)
  a = Tanh(h)
  d = Dropout(a, ratio, on)
  z = MatMul(d, W2)
  y = Mul(z, d_mask)
}"""


def _numeric(loss, weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Central differences of ``loss(weights)`` with respect to ``weights[name]``."""
    grad = np.zeros_like(weights[name])
    for index in np.ndindex(*grad.shape):
        shifted = {k: v.copy() for k, v in weights.items()}
        shifted[name][index] += 1e-6
        up = loss(shifted)
        shifted[name][index] -= 2e-6
        grad[index] = (up - loss(shifted)) / 2e-6
    return grad


def test_the_gradient_uses_the_mask_its_forward_drew_and_equals_finite_differences():
    model = lossgraph.add_loss_output(onnx.parser.parse_model(DROPOUT))
    graph = lossgraph.gradient(model, ["W1", "W2"])
    (dropout,) = [n for n in graph.graph.node if n.op_type == "Dropout"]
    assert list(dropout.output) == ["d", "d_mask_1"]
    graph.graph.output.append(helper.make_tensor_value_info("d_mask_1", onnx.TensorProto.BOOL,
                                                            None))
    session = create_session(graph)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
               if t.name in ("W1", "W2")}
    masks = set()
    for _ in range(3):  # a new mask every run; each run's gradient is the one of its mask
        mask, grad1, grad2 = session.run(["d_mask_1", "W1_grad", "W2_grad"],
                                         {"x": X, "label": y})
        masks.add(mask.tobytes())
        assert 0 < mask.mean() < 1

        def loss(w, mask=mask):
            d = np.tanh(X @ w["W1"]) * mask / (1 - np.float32(0.4))
            return np.mean((d @ w["W2"] * 1.5 - y) ** 2)

        for name, grad in (("W1", grad1), ("W2", grad2)):
            np.testing.assert_allclose(grad, _numeric(loss, weights, name), rtol=1e-6,
                                       atol=1e-9, err_msg=name)
    assert len(masks) > 1


def test_the_training_graphs_dropout_gets_the_mask_output_the_model_given_keeps_none():
    given = onnx.parser.parse_model(DROPOUT)
    program = lossgraph.compile_program(given)
    (dropout,) = [n for n in given.graph.node if n.op_type == "Dropout"]
    assert list(dropout.output) == ["d"]
    (trained,) = [n for n in program.graphs["train_step"].graph.node if n.op_type == "Dropout"]
    assert len(trained.output) == 2


@pytest.mark.torch
def test_torchs_dynamo_export_of_a_training_dropout_gets_torchs_gradient_with_its_mask():
    torch = pytest.importorskip("torch")
    from support.torch_steps import assert_gradients_close, lossgraph_gradients, torch_gradients

    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings
        exported = torch.onnx.export(
            net, (torch.randn(3, 4),), dynamo=True, optimize=False, verbose=False,
            dynamic_shapes=({0: torch.export.Dim("N", min=2)},)).model_proto
    (dropout,) = [n for n in exported.graph.node if n.op_type == "Dropout"]
    assert len(dropout.output) == 1
    exported.graph.output.append(helper.make_tensor_value_info(
        dropout.output[0], onnx.TensorProto.FLOAT, ("N", 4)))  # the dropped values
    rng = np.random.default_rng(1)
    X = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    names = [name for name, _ in net.named_parameters()]
    ours = lossgraph_gradients(exported, names, X, y, output_index=0,
                               fetch=(dropout.output[0],))
    kept = ours.pop(dropout.output[0]) != 0  # a Linear's output is never exactly 0
    assert 0.2 < kept.mean() < 0.8

    class FixedMask(nn.Module):
        def forward(self, x):
            return x * torch.from_numpy(kept.astype(np.float64) / 0.5)

    net[1] = FixedMask()
    assert_gradients_close(ours, torch_gradients(net, X, y))
    program = lossgraph.compile_program(exported, loss_options={"output_index": 0})
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=4, progress=False)
    assert np.isfinite(trainer.train_losses_).all()
