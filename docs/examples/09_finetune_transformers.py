"""09: fine-tune a transformers BERT sequence classifier, exported to ONNX.

The model is a small ``BertForSequenceClassification`` built from a ``BertConfig`` (random
weights: nothing is downloaded, no tokenizer either). Every weight is moved off its
initial value, as a checkpoint's are (a fresh model's equal LayerNorm scales and zero
biases would be merged into shared initializers by the exporter).

The token ids are synthetic but the task is learnable: sequences of 6 to 12 random tokens
(padding masked by ``attention_mask``), half of them drawn from the upper half of the
vocabulary for class 1 and from the lower half for class 0. The classifier is exported
with ``torch.onnx.export`` (``input_ids`` and ``attention_mask`` in, logits out, free
batch and sequence axes); lossgraph compiles it (cross entropy of the logits, AdamW) and
trains every weight of the ONNX model, while torch trains its own copy with
``torch.optim.AdamW`` (the same hyper-parameters) from the same weights on the same
batches. The losses fall alike, and the trained inference model
(``Trainer.to_inference_model()``) gives the held-out sequences torch's logits.

Needs torch and transformers (``pip install torch==2.13.0 transformers``); without them
the script says so and stops.
Run: python docs/examples/09_finetune_transformers.py
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import numpy as np
import onnx
import onnxruntime

import lossgraph
from lossgraph.optim import AdamW

VOCABULARY, LENGTH, ROWS, BATCH, EPOCHS, LEARNING_RATE = 100, 12, 128, 16, 4, 3e-3
INPUTS = ("input_ids", "attention_mask")
#: AdamW's epsilon, as RoBERTa's fine-tuning recipe: the attention key biases' gradient is
#: zero but for rounding (softmax ignores a constant added to every score), and the default
#: 1e-8 would turn each library's own rounding into full steps of those biases.
EPSILON = 1e-6


def sequences(rows: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Token ids and attention masks (0 pads the end), and the class of each row."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, rows)
    ids = rng.integers(1, VOCABULARY, size=(rows, LENGTH))
    half = VOCABULARY // 2
    signal = rng.random((rows, LENGTH)) < 0.5  # these tokens say the class
    ids = np.where(signal & (y[:, None] == 1), rng.integers(half, VOCABULARY, ids.shape), ids)
    ids = np.where(signal & (y[:, None] == 0), rng.integers(1, half, ids.shape), ids)
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, rows)
    mask = (np.arange(LENGTH) < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}, y


def main() -> None:
    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")):
        print("SKIPPED: this example needs torch and transformers "
              "(pip install torch==2.13.0 transformers)")
        return
    import torch
    import transformers

    class Logits(torch.nn.Module):
        """The classifier called with token ids and mask, returning its logits."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    net = Logits(transformers.BertForSequenceClassification(config)).eval()
    with torch.no_grad():  # stand in for a checkpoint: no two weights equal
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    X, y = sequences(ROWS, seed=0)
    X_test, y_test = sequences(256, seed=1)

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, tuple(torch.from_numpy(X[name][:2]) for name in INPUTS), buffer,
                          dynamo=False, opset_version=17, input_names=list(INPUTS),
                          output_names=["logits"],
                          dynamic_axes={**{name: {0: "batch", 1: "sequence"} for name in INPUTS},
                                        "logits": {0: "batch"}})
    onx = onnx.load_from_string(buffer.getvalue())
    weights = lossgraph.trainable_initializers(onx)
    print(f"exported: {len(onx.graph.node)} nodes; training {len(weights)} weights, "
          f"torch's {len(list(net.parameters()))} parameters")

    program = lossgraph.compile_program(
        onx, loss="multiclass_log_loss", loss_options={"from_logits": True},
        optimizer=AdamW(LEARNING_RATE, epsilon=EPSILON, weight_decay=0.01))
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False)

    optimizer = torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE, eps=EPSILON,
                                  weight_decay=0.01)
    torch_losses = []
    for _ in range(EPOCHS):
        losses = []
        for start in range(0, ROWS, BATCH):
            optimizer.zero_grad()
            batch = {name: torch.from_numpy(X[name][start:start + BATCH]) for name in INPUTS}
            loss = torch.nn.functional.cross_entropy(
                net(**batch), torch.from_numpy(y[start:start + BATCH]))
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
    (ours,) = session.run(None, X_test)
    with torch.no_grad():
        theirs = net(**{name: torch.from_numpy(X_test[name]) for name in INPUTS}).numpy()
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
