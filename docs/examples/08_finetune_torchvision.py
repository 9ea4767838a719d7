"""08: fine-tune a torchvision ResNet-18 with a new head, exported to ONNX.

The model is ``torchvision.models.resnet18()`` from its constructor (random weights: nothing
is downloaded) standing in for a pretrained network: its batch-norm statistics are
measured on a few images and every weight is moved off its initial value, as a checkpoint's
are (a fresh model's equal batch-norm scales would be merged into one initializer by the
exporter). Its 1000-class head is replaced by a new 2-class ``Linear``.

The task is synthetic but learnable: 16x16 noise images whose top half (class 0) or bottom
half (class 1) is brighter. The usual recipe for a small data set: batch norm in inference
mode (its statistics frozen), the early layers frozen, the last residual block
(``layer4.1``) and the new head trained, with SGD and momentum. The network is exported with
``torch.onnx.export``; lossgraph compiles it (cross entropy of the logits) and trains the
ONNX model, while torch trains its own copy from the same weights on the same batches.
The losses fall alike, and the trained inference model (``Trainer.to_inference_model()``)
predicts the held-out images as torch's trained network does.

Needs torch and torchvision (``pip install torch==2.13.0 torchvision==0.28.0``); without
them the script says so and stops.
Run: python docs/examples/08_finetune_torchvision.py
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import numpy as np
import onnx
import onnxruntime

import lossgraph
from lossgraph.optim import Momentum

SIZE, ROWS, BATCH, EPOCHS, LEARNING_RATE = 16, 48, 16, 3, 0.003
TRAINED = ("layer4.1.", "fc.")  # fine-tuned: the last residual block and the new head


def images(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noise images, the top half brighter for class 0, the bottom half for class 1."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, rows)
    X = rng.normal(size=(rows, 3, SIZE, SIZE)).astype(np.float32)
    X[y == 0, :, : SIZE // 2] += 1.0
    X[y == 1, :, SIZE // 2 :] += 1.0
    return X, y


def main() -> None:
    if any(importlib.util.find_spec(m) is None for m in ("torch", "torchvision")):
        print("SKIPPED: this example needs torch and torchvision "
              "(pip install torch==2.13.0 torchvision==0.28.0)")
        return
    import torch
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18()
    net.fc = torch.nn.Linear(net.fc.in_features, 2)  # the new head
    with torch.no_grad():  # stand in for a pretrained checkpoint
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.reset_running_stats()
                module.momentum = None  # a plain average over the calibration batch
        net.train()(torch.from_numpy(images(64, seed=9)[0]))
    net.eval()  # batch norm uses its statistics, as in the exported model
    weights = [name for name, _ in net.named_parameters() if name.startswith(TRAINED)]
    X, y = images(ROWS, seed=0)
    X_test, y_test = images(128, seed=1)

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(X[:2]),), buffer, dynamo=False,
                          opset_version=17, do_constant_folding=False,
                          input_names=["image"], output_names=["logits"],
                          dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}})
    onx = onnx.load_from_string(buffer.getvalue())
    print(f"exported: {len(onx.graph.node)} nodes, {len(onx.graph.initializer)} initializers; "
          f"fine-tuning {len(weights)} of them ({', '.join(TRAINED)})")

    program = lossgraph.compile_program(
        onx, weights=weights, loss="multiclass_log_loss", loss_options={"from_logits": True},
        optimizer=Momentum(LEARNING_RATE, momentum=0.9))
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False)

    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in weights)
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad],
                                lr=LEARNING_RATE, momentum=0.9)
    torch_losses = []
    for _ in range(EPOCHS):
        losses = []
        for start in range(0, ROWS, BATCH):
            optimizer.zero_grad()
            rows = slice(start, start + BATCH)
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(X[rows])),
                                                     torch.from_numpy(y[rows]))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch_losses.append(float(np.mean(losses)))

    print("epoch  train loss (lossgraph)  train loss (torch)")
    for epoch, (ours, theirs) in enumerate(zip(trainer.train_losses_, torch_losses)):
        print(f"{epoch:5d}  {ours:22.4f}  {theirs:18.4f}")
    assert trainer.train_losses_[-1] < trainer.train_losses_[0] / 2
    np.testing.assert_allclose(trainer.train_losses_, torch_losses, rtol=1e-3)

    # The trained inference model, in a plain onnxruntime session, against torch's network.
    session = onnxruntime.InferenceSession(trainer.to_inference_model().SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    (ours,) = session.run(None, {"image": X_test})
    with torch.no_grad():
        theirs = net(torch.from_numpy(X_test)).numpy()
    gap = float(np.abs(ours - theirs).max())
    accuracy = {"lossgraph": (ours.argmax(1) == y_test).mean(),
                "torch": (theirs.argmax(1) == y_test).mean()}
    print(f"held-out accuracy: lossgraph {accuracy['lossgraph']:.3f}, "
          f"torch {accuracy['torch']:.3f} (chance 0.5)")
    print(f"held-out logits: max |lossgraph - torch| = {gap:.1e} "
          f"(logits up to {np.abs(theirs).max():.1f})")
    assert gap < 1e-3 * np.abs(theirs).max(), gap
    assert accuracy["lossgraph"] > 0.8
    print("OK: the fine-tuned ONNX model predicts as torch's fine-tuned network does")


if __name__ == "__main__":
    main()
