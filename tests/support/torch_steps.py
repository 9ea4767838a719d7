"""Training a lossgraph Trainer and a torch network side by side, step for step: the
check the torch-export tests share, and torch's legacy export they start from."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

import lossgraph
from lossgraph.runtime.session import create_session


def assert_sgd_steps_like_torch(trainer: lossgraph.Trainer, net, learning_rate: float,
                                X: np.ndarray, y: np.ndarray, steps: int = 4,
                                rows: int | tuple[int, ...] = 8) -> None:
    """``steps`` minibatch SGD steps of ``rows`` rows (a tuple: one step of each size in
    turn, a model with a free batch axis fed batches of differing sizes) on consecutive
    rows of ``X``, mean squared error, with the trainer and with ``torch.optim.SGD`` on
    ``net``: after each, the trainer predicts what the net does on all of ``X`` (float32
    rounding)."""
    import torch

    sizes = (rows,) * steps if isinstance(rows, int) else rows
    theirs = torch.optim.SGD(net.parameters(), lr=learning_rate)
    for step, (size, end) in enumerate(zip(sizes, np.cumsum(sizes))):
        batch = slice(end - size, end)
        trainer.fit(X[batch], y[batch], epochs=1, batch_size=size, shuffle=False,
                    progress=False, warm_start=step > 0)
        theirs.zero_grad()
        loss = ((net(torch.from_numpy(X[batch])) - torch.from_numpy(y[batch])) ** 2).mean()
        loss.backward()
        theirs.step()
        with torch.no_grad():
            expected = net(torch.from_numpy(X)).numpy()
        np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-4, atol=1e-5,
                                   err_msg=f"after step {step}")


def torch_mse(prediction, target):
    """torch's mean squared error: lossgraph's default loss, ``squared_error``."""
    return ((prediction - target) ** 2).mean()


def _as_torch(data, dtype=None):
    """``data`` (an array, or a dict of arrays by input name) as torch tensors; float arrays
    cast to ``dtype`` when given."""
    import torch

    def one(array: np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    return {k: one(v) for k, v in data.items()} if isinstance(data, dict) else one(data)


def _rows(data, batch: slice):
    return {k: v[batch] for k, v in data.items()} if isinstance(data, dict) else data[batch]


def _call(net, inputs):
    return net(**inputs) if isinstance(inputs, dict) else net(inputs)


def assert_steps_like_torch(trainer: lossgraph.Trainer, net, optimizer, X, y: np.ndarray,
                            steps: int = 3, rows: int = 8, loss=torch_mse, forward=_call,
                            rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """``steps`` minibatch steps of ``rows`` rows with the trainer and with the torch
    ``optimizer`` (built on ``net``'s parameters), ``loss(net output, target)`` in torch
    being the trainer's loss: after each, the trainer's loss is torch's, and the trainer
    predicts what the net does in eval mode on all of ``X`` (an array, or a dict of arrays
    by input name; ``forward(net, inputs)`` gives the net's output). The predictions move
    by far more than the tolerance: the comparison is not vacuous."""
    import torch

    modes = {layer: layer.training for layer in net.modules()}  # layers may differ

    def eval_prediction() -> np.ndarray:
        net.eval()
        with torch.no_grad():
            prediction = forward(net, _as_torch(X)).numpy()
        for layer, training in modes.items():
            layer.train(training)
        return prediction

    initial = eval_prediction()
    for step in range(steps):
        batch = slice(rows * step, rows * (step + 1))
        trainer.fit(_rows(X, batch), y[batch], epochs=1, batch_size=rows, shuffle=False,
                    progress=False, warm_start=step > 0)
        optimizer.zero_grad()
        theirs = loss(forward(net, _as_torch(_rows(X, batch))), _as_torch(y[batch]))
        theirs.backward()
        optimizer.step()
        assert trainer.train_losses_[-1] == pytest.approx(theirs.item(), rel=rtol, abs=atol), \
            f"the loss of step {step}"
        expected = eval_prediction()
        np.testing.assert_allclose(trainer.predict(X), expected, rtol=rtol, atol=atol,
                                   err_msg=f"the prediction after step {step}")
    assert np.abs(expected - initial).max() > 100 * atol, "training hardly moved the net"


def lossgraph_gradients(model: onnx.ModelProto, weights: list[str], X, y: np.ndarray,
                        loss: str = "squared_error", fetch: tuple[str, ...] = (),
                        **loss_options) -> dict[str, np.ndarray]:
    """lossgraph's gradient of ``loss`` on ``model`` (``lossgraph.gradient`` of
    ``add_loss_output``) with respect to ``weights`` at ``X`` (an array, or a dict of arrays
    by input name) and ``y``, by weight name; and the values of the outputs ``fetch`` of the
    same run."""
    loss_model = lossgraph.add_loss_output(model, loss, **loss_options)
    label = lossgraph.get_roles(loss_model)["label"]
    session = create_session(lossgraph.gradient(loss_model, weights))
    feeds = dict(X) if isinstance(X, dict) else {model.graph.input[0].name: X}
    names = [*(f"{w}_grad" for w in weights), *fetch]
    values = session.run(names, {**feeds, label: y})
    return {**dict(zip(weights, values)), **dict(zip(fetch, values[len(weights):]))}


def torch_gradients(net, X, y: np.ndarray, torch_loss=torch_mse,
                    forward=_call) -> dict[str, np.ndarray]:
    """torch autograd's gradient of ``torch_loss`` in float64, on a float64 copy of ``net``
    in its mode, by parameter name."""
    import copy

    import torch

    reference = copy.deepcopy(net).double()
    reference.zero_grad()
    torch_loss(forward(reference, _as_torch(X, torch.float64)),
               _as_torch(y, torch.float64)).backward()
    return {name: p.grad.numpy() for name, p in reference.named_parameters()}


def assert_gradients_close(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray],
                           rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Each of ``theirs`` (float64) equals ``ours`` (float32) within ``rtol``, and ``atol``
    times the parameter's largest gradient element (float32 rounding), or a thousandth of
    the largest of all parameters when that is larger (a gradient that is 0 in exact
    arithmetic, such as an attention key bias's, is float32 noise)."""
    largest = max(float(np.abs(g).max()) for g in theirs.values()) or 1.0
    for name, expected in theirs.items():
        scale = max(float(np.abs(expected).max()), 1e-3 * largest)
        np.testing.assert_allclose(ours[name], expected, rtol=rtol, atol=atol * scale,
                                   err_msg=f"d loss / d {name}: lossgraph vs torch float64")


def assert_gradients_like_torch(model: onnx.ModelProto, net, X, y: np.ndarray,
                                loss: str = "squared_error", torch_loss=torch_mse,
                                forward=_call, rtol: float = 1e-4, atol: float = 1e-5,
                                **loss_options) -> None:
    """``model``'s trainable initializers are exactly ``net``'s parameters (by name), and
    lossgraph's gradient of ``loss`` with respect to each equals torch autograd's of
    ``torch_loss`` in float64 (:func:`assert_gradients_close`)."""
    names = [name for name, _ in net.named_parameters()]
    ours = lossgraph_gradients(model, names, X, y, loss, **loss_options)
    assert sorted(lossgraph.trainable_initializers(model)) == sorted(names)
    assert_gradients_close(ours, torch_gradients(net, X, y, torch_loss, forward), rtol, atol)


def legacy_export(net, example: np.ndarray, **options) -> onnx.ModelProto:
    """``net`` exported by torch's legacy (TorchScript) exporter at opset 17 from the
    float ``example``, input ``x`` and output ``y``, its batch axis free (``N``);
    ``options``: more of ``torch.onnx.export``'s."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(example),), buffer, dynamo=False,
                          opset_version=17, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, **options)
    return onnx.load_from_string(buffer.getvalue())


def make_distinct(net) -> None:
    """Make every parameter and running statistic of ``net`` differ from every other, in
    place (torch's exporters merge equal initializers): running means drawn normal,
    running variances in [0.5, 1.5], parameters nudged by 0.1 x normal noise."""
    import torch

    with torch.no_grad():
        for name, buffer in net.named_buffers():
            if name.endswith("running_mean"):
                buffer.normal_()
            elif name.endswith("running_var"):
                buffer.uniform_(0.5, 1.5)
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
