"""06: an ONNX graph as a torch layer.

The partial-training document's network: a first layer in torch, a second layer that is
an ONNX model, trained together by a torch optimizer. ``lossgraph.torch.OnnxModule``
turns the ONNX model into an ``nn.Module`` whose initializers are ``nn.Parameter``
objects; its backward pass runs lossgraph's gradient graphs in onnxruntime.

The ONNX layer here is a torch MLP exported with ``torch.onnx.export``, so the same
network can also be trained in pure torch: 50 steps of SGD with momentum give the same
losses and the same weights in both, step for step, and the same R2 on rows held out.
``to_onnx()`` then returns the ONNX layer with its trained weights, for any onnxruntime.

Needs torch (``pip install torch==2.13.0``); without it the script says so and stops.
Run: python docs/examples/06_torch_layer.py
"""

from __future__ import annotations

import copy
import importlib.util
import io
import warnings

import numpy as np
import onnx
import onnxruntime

STEPS, BATCH, HELD_OUT = 50, 32, 512


def main() -> None:
    if importlib.util.find_spec("torch") is None:
        print("SKIPPED: this example needs torch (pip install torch==2.13.0)")
        return
    import torch

    from lossgraph.torch import OnnxModule

    F = torch.nn.functional

    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU())
    second = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    # The second layer as an ONNX model (random weights: the exporter would merge equal ones).
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(second, (torch.zeros(2, 16),), buffer, dynamo=False,
                          opset_version=18, input_names=["h"], output_names=["y"],
                          dynamic_axes={"h": {0: "N"}, "y": {0: "N"}})
    onnx_layer = OnnxModule(onnx.load_from_string(buffer.getvalue()))
    print(onnx_layer)
    print("ONNX initializer -> torch parameter:", onnx_layer.parameter_names)

    # torch first layer + ONNX second layer, and the same network in pure torch.
    hybrid = torch.nn.Sequential(copy.deepcopy(first), onnx_layer)
    reference = torch.nn.Sequential(first, second)
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
                  for net in (hybrid, reference)]

    rng = np.random.default_rng(0)
    X = torch.from_numpy(rng.normal(size=(STEPS * BATCH + HELD_OUT, 4)).astype(np.float32))
    y = X[:, :1] - 2 * X[:, 1:2] + torch.relu(X[:, 2:3])
    X, y, X_test, y_test = X[:-HELD_OUT], y[:-HELD_OUT], X[-HELD_OUT:], y[-HELD_OUT:]
    print("step  loss (torch + ONNX)  loss (pure torch)")
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        losses = []
        for net, optimizer in zip((hybrid, reference), optimizers):
            optimizer.zero_grad()
            loss = F.mse_loss(net(X[rows]), y[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if step % 10 == 0 or step == STEPS - 1:
            print(f"{step:4d}  {losses[0]:19.6f}  {losses[1]:17.6f}")
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), (step, losses)

    # The ONNX weights are named after their initializers; torch's after its modules.
    with torch.no_grad():
        gaps = {"first layer": max(float((a - b).abs().max()) for a, b in
                                   zip(hybrid[0].parameters(), first.parameters()))}
        ours = onnx_layer.onnx_parameters()
        for name, parameter in second.named_parameters():
            gaps[name] = float((ours[name] - parameter).abs().max())
    for name, gap in gaps.items():
        print(f"{name:12s} max |torch+ONNX - torch| = {gap:.1e}")
        assert gap < 1e-5, (name, gap)
    with torch.no_grad():
        ours, theirs = (float(1 - F.mse_loss(net(X_test), y_test) / y_test.var())
                        for net in (hybrid, reference))
    print(f"held-out R2: torch + ONNX {ours:.4f}, pure torch {theirs:.4f}")
    assert abs(ours - theirs) < 1e-4 and ours > 0.9, (ours, theirs)

    # The trained ONNX layer, back as a plain inference model.
    trained = onnx_layer.to_onnx()
    session = onnxruntime.InferenceSession(trained.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    with torch.no_grad():  # no_grad: the prediction graph, nothing kept for backward
        h = hybrid[0](X[:BATCH])
        expected = onnx_layer(h).numpy()
    (served,) = session.run(None, {"h": h.numpy()})
    print(f"to_onnx(): max |onnxruntime - module| = {np.abs(served - expected).max():.1e}")
    np.testing.assert_allclose(served, expected, rtol=1e-6, atol=1e-7)
    print("OK: the torch network with an ONNX layer trains exactly as the pure-torch one")


if __name__ == "__main__":
    main()
