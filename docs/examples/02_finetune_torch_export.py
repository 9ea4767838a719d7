"""02: fine-tune a model exported from PyTorch.

A small torch MLP is exported with ``torch.onnx.export``; lossgraph compiles the ONNX model
(squared error, plain SGD) and trains it for 10 epochs. torch trains its own copy with
the same batches in the same order, and both end with the same weights (to float32
rounding): lossgraph's training graph computes what torch's autograd computes. Both
score the same R2 on rows held out.

Needs torch (``pip install torch``); without it the script says so and stops.
Run: python docs/examples/02_finetune_torch_export.py
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import numpy as np
import onnx

import lossgraph
from lossgraph.optim import SGD

LEARNING_RATE, BATCH, EPOCHS = 0.1, 32, 10


def main() -> None:
    if importlib.util.find_spec("torch") is None:
        print("SKIPPED: this example needs torch (pip install torch)")
        return
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(1280, 4)).astype(np.float32)
    y = np.sin(X[:, :1]) + X[:, 1:2] * X[:, 2:3]
    X, y, X_test, y_test = X[:1024], y[:1024], X[1024:], y[1024:]

    # Export with a free batch axis, in eval mode, keeping every weight an initializer.
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(X[:2]),), buffer, dynamo=False,
                          opset_version=18, input_names=["X"], output_names=["y"],
                          dynamic_axes={"X": {0: "N"}, "y": {0: "N"}})
    onx = onnx.load_from_string(buffer.getvalue())
    print("exported weights:", lossgraph.trainable_initializers(onx))

    # lossgraph: SGD on the ONNX model, batches in order.
    trainer = lossgraph.Trainer(lossgraph.compile_program(onx, optimizer=SGD(LEARNING_RATE)))
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False)

    # torch: the same epochs on its own copy (MSELoss is lossgraph's squared error).
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
    for _ in range(EPOCHS):
        for start in range(0, len(X), BATCH):
            optimizer.zero_grad()
            rows = slice(start, start + BATCH)
            prediction = net(torch.from_numpy(X[rows]))
            torch.nn.functional.mse_loss(prediction, torch.from_numpy(y[rows])).backward()
            optimizer.step()

    for name, value in net.state_dict().items():
        gap = float(np.abs(trainer.state[name] - value.numpy()).max())
        print(f"{name:10s} max |lossgraph - torch| = {gap:.1e}")
        assert gap < 1e-5, (name, gap)

    def r2(prediction: np.ndarray) -> float:
        return float(1 - ((prediction - y_test) ** 2).mean() / y_test.var())

    with torch.no_grad():
        theirs = r2(net(torch.from_numpy(X_test)).numpy())
    ours = r2(trainer.predict(X_test))
    print(f"train loss by epoch: {trainer.train_losses_[0]:.4f} -> {trainer.train_losses_[-1]:.4f}")
    print(f"held-out R2: lossgraph {ours:.4f}, torch {theirs:.4f}")
    assert abs(ours - theirs) < 1e-4 and ours > 0.9, (ours, theirs)
    print("OK: lossgraph fine-tunes the exported model exactly as torch trains its own")


if __name__ == "__main__":
    main()
