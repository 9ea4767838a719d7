"""10: fine-tune a transformers classifier the way Hugging Face's Trainer does by default.

The fine-tuning toolkit together, on a small ``BertForSequenceClassification`` built from a
``BertConfig`` (random weights moved off their initial values as 09 explains; nothing is
downloaded) and exported to ONNX:

    AdamW, weight decay 0.01 on all but biases and norms   AdamW(exclude_from_weight_decay="auto")
    linear warmup, then linear decay to 0                  lossgraph.schedules.Linear
    gradients clipped to a global norm of 1.0              compile_program(max_grad_norm=1.0)
    gradient accumulation, 2 micro-batches an update        fit(accumulation_steps=2)
    early stopping on validation accuracy, best restored   EarlyStopping("validation_accuracy")
    accuracy each epoch, training and validation           fit(metrics=["accuracy"])

torch runs the same recipe by hand from the same weights on the same batches, as the
Trainer does it: ``torch.optim.AdamW`` with two parameter groups (no decay for biases and
LayerNorm weights), ``transformers.get_linear_schedule_with_warmup`` stepped per update,
each micro-batch's loss divided by the accumulation steps before ``backward``,
``clip_grad_norm_`` before each ``optimizer.step()``, and the same stopping rule (stop
after PATIENCE epochs without a better validation accuracy, go back to the best epoch's
weights). The two runs are printed side by side and asserted equal: losses and every
update's gradient norm within LOSS_RTOL (relative), accuracies exactly (the same
predictions: no row of this data lies within rounding of a tie between two classes), the
same epoch stopped at, and the restored models' held-out logits within LOGIT_RTOL of the
largest. The loss and accuracy curves of both are drawn into a PNG (needs matplotlib) in
the folder given as the first argument, or a temporary folder by default.

The task (synthetic, learnable): sequences of 6 to 12 tokens (padding masked), the class
being which third of the vocabulary most of the tokens come from.

Needs torch and transformers (``pip install torch==2.13.0 transformers``); without them
the script says so and stops.
Run: python docs/examples/10_finetune_like_hugging_face.py [output folder]
"""

from __future__ import annotations

import copy
import importlib.util
import io
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

import lossgraph
from lossgraph.optim import AdamW
from lossgraph.runtime.early_stopping import EarlyStopping
from lossgraph.schedules import Linear

VOCABULARY, LENGTH, CLASSES = 99, 12, 3
ROWS, VALIDATION_ROWS, BATCH, ACCUMULATION = 96, 48, 8, 2
EPOCHS, PATIENCE, WARMUP_STEPS = 16, 2, 6
UPDATES = EPOCHS * ROWS // (BATCH * ACCUMULATION)  # the schedule's total steps
PEAK_RATE, WEIGHT_DECAY, EPSILON = 3e-3, 0.01, 1e-6  # EPSILON: see 09's note
MAX_GRAD_NORM = 1.0
INPUTS = ("input_ids", "attention_mask")
#: the agreement asserted: training and validation losses, and the restored model's logits
LOSS_RTOL, LOGIT_RTOL = 1e-3, 1e-3


def sequences(rows: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Token ids and attention masks (0 pads the end), and the class of each row: most of
    its tokens come from that class's third of the vocabulary."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, rows)
    third = VOCABULARY // CLASSES
    ids = rng.integers(1, VOCABULARY, size=(rows, LENGTH))
    own = y[:, None] * third + rng.integers(1, third, size=(rows, LENGTH))
    ids = np.where(rng.random((rows, LENGTH)) < 0.7, own, ids)
    mask = (np.arange(LENGTH) < rng.integers(LENGTH // 2, LENGTH + 1, rows)[:, None])
    return {"input_ids": ids * mask, "attention_mask": mask.astype(np.int64)}, y


def no_decay(name: str) -> bool:
    """Hugging Face's rule: no weight decay for biases and LayerNorm weights."""
    return name.endswith("bias") or "LayerNorm" in name


def torch_run(net, X, y, validation):
    """The recipe in torch, as the Trainer runs it: per-epoch mean training loss, training
    and validation accuracy and loss, the epoch early stopping ended on, and the network
    with the best epoch's weights."""
    import torch
    import transformers

    torch.set_num_threads(1)  # a network this small gains nothing from more, on a busy machine
    F = torch.nn.functional
    parameters = list(net.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in parameters if not no_decay(n)], "weight_decay": WEIGHT_DECAY},
         {"params": [p for n, p in parameters if no_decay(n)], "weight_decay": 0.0}],
        lr=PEAK_RATE, eps=EPSILON)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, WARMUP_STEPS, UPDATES)

    def tensors(data, rows=slice(None)):
        return {name: torch.from_numpy(data[name][rows]) for name in INPUTS}

    def scores(data, labels):
        with torch.no_grad():
            logits = net(**tensors(data))
            return (F.cross_entropy(logits, torch.from_numpy(labels)).item(),
                    float((logits.argmax(1).numpy() == labels).mean()))

    history = {key: [] for key in ("loss", "accuracy", "validation_loss", "validation_accuracy",
                                   "grad_norm")}
    best, best_state, waited = -np.inf, None, 0
    for _ in range(EPOCHS):
        losses = []
        for start in range(0, ROWS, BATCH * ACCUMULATION):
            optimizer.zero_grad()
            for lo in range(start, start + BATCH * ACCUMULATION, BATCH):
                rows = slice(lo, lo + BATCH)
                loss = F.cross_entropy(net(**tensors(X, rows)), torch.from_numpy(y[rows]))
                (loss / ACCUMULATION).backward()
                losses.append(loss.item())
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_GRAD_NORM)
            history["grad_norm"].append(norm.item())
            optimizer.step()
            scheduler.step()
        history["loss"].append(float(np.mean(losses)))
        _, accuracy = scores(X, y)
        validation_loss, validation_accuracy = scores(*validation)
        history["accuracy"].append(accuracy)
        history["validation_loss"].append(validation_loss)
        history["validation_accuracy"].append(validation_accuracy)
        if validation_accuracy > best:
            best, best_state, waited = validation_accuracy, copy.deepcopy(net.state_dict()), 0
        else:
            waited += 1
            if waited >= PATIENCE:
                break
    net.load_state_dict(best_state)
    return history, net


def draw(histories: dict[str, dict[str, list[float]]], path: Path) -> None:
    """The loss and accuracy curves of each run, into a PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.5), dpi=100)
    for column, metric in enumerate(("loss", "accuracy")):
        axes = figure.add_subplot(1, 2, column + 1)
        for run, style in (("lossgraph", "-"), ("torch", ":")):
            for key in (metric, f"validation_{metric}"):
                values = histories[run][key]
                axes.plot(range(1, len(values) + 1), values, style, marker="o", markersize=3,
                          label=f"{run} {key.replace('_', ' ')}")
        axes.set_xlabel("epoch")
        axes.set_title(metric)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def main(folder: Path) -> None:
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
        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    net = Logits(transformers.BertForSequenceClassification(config)).eval()
    with torch.no_grad():  # stand in for a checkpoint: no two weights equal
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    X, y = sequences(ROWS, seed=0)
    validation = sequences(VALIDATION_ROWS, seed=1)
    X_test, _ = sequences(64, seed=2)

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, tuple(torch.from_numpy(X[name][:2]) for name in INPUTS), buffer,
                          dynamo=False, opset_version=17, input_names=list(INPUTS),
                          output_names=["logits"],
                          dynamic_axes={**{name: {0: "batch", 1: "sequence"} for name in INPUTS},
                                        "logits": {0: "batch"}})
    onx = onnx.load_from_string(buffer.getvalue())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the export's transposed Linear weights (09)
        program = lossgraph.compile_program(
            onx, loss="multiclass_log_loss", loss_options={"from_logits": True},
            optimizer=AdamW(Linear(PEAK_RATE, total_steps=UPDATES, warmup_steps=WARMUP_STEPS),
                            epsilon=EPSILON, weight_decay=WEIGHT_DECAY,
                            exclude_from_weight_decay="auto"),
            accumulation_steps=ACCUMULATION, max_grad_norm=MAX_GRAD_NORM, fuse="epoch")
    # "auto" found in the graph what Hugging Face excludes by name
    excluded = set(program.optimizer.exclude_from_weight_decay)
    expected = {n for n, _ in net.named_parameters() if no_decay(n)}
    print(f"no weight decay for {len(excluded)} weights (biases and LayerNorm scales/shifts)")
    assert excluded == expected & set(lossgraph.trainable_initializers(onx)), excluded ^ expected

    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False,
                validation_data=validation, metrics=["accuracy"],
                early_stopping=EarlyStopping("validation_accuracy", patience=PATIENCE))
    ours = {key: list(trainer.history_[key])
            for key in ("loss", "accuracy", "validation_loss", "validation_accuracy")}
    theirs, net = torch_run(net, X, y, validation)
    clipped = sum(norm > MAX_GRAD_NORM for norm in trainer.grad_norms_)
    print(f"gradient norm above {MAX_GRAD_NORM} (clipped) in {clipped} of "
          f"{len(trainer.grad_norms_)} updates")
    assert clipped > 0
    np.testing.assert_allclose(trainer.grad_norms_, theirs["grad_norm"], rtol=LOSS_RTOL)

    print("epoch  loss (lossgraph / torch)  val loss (lossgraph / torch)  "
          "accuracy  val accuracy")
    for epoch in range(len(theirs["loss"])):
        cells = [f"{ours[k][epoch]:.4f} / {theirs[k][epoch]:.4f}"
                 for k in ("loss", "validation_loss")]
        cells += [f"{ours[k][epoch]:.3f} / {theirs[k][epoch]:.3f}"
                  for k in ("accuracy", "validation_accuracy")]
        print(f"{epoch + 1:5d}  {cells[0]:>24}  {cells[1]:>28}  {cells[2]}  {cells[3]}")
    record = trainer.early_stopping_
    print(f"early stopping: best epoch {record.best_epoch + 1}, stopped after epoch "
          f"{len(ours['loss'])} of {EPOCHS} (torch: {len(theirs['loss'])})")
    assert len(ours["loss"]) == len(theirs["loss"]) < EPOCHS  # it stopped, at the same epoch
    for key in ("loss", "validation_loss"):
        np.testing.assert_allclose(ours[key], theirs[key], rtol=LOSS_RTOL, err_msg=key)
    for key in ("accuracy", "validation_accuracy"):
        assert ours[key] == theirs[key], key
    assert max(ours["validation_accuracy"]) > 0.8

    # the restored best model, in a plain onnxruntime session, against torch's restored one
    session = onnxruntime.InferenceSession(trainer.to_inference_model().SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, X_test)
    with torch.no_grad():
        expected_logits = net(**{name: torch.from_numpy(X_test[name]) for name in INPUTS}).numpy()
    gap = float(np.abs(logits - expected_logits).max())
    print(f"restored best model, held-out logits: max |lossgraph - torch| = {gap:.1e}")
    assert gap < LOGIT_RTOL * np.abs(expected_logits).max(), gap

    if importlib.util.find_spec("matplotlib") is None:
        print("(no curves: pip install matplotlib to draw them)")
    else:
        path = folder / "finetune_curves.png"
        draw({"lossgraph": ours, "torch": theirs}, path)
        print(f"curves: {path}")
    print("OK: Hugging Face's fine-tuning recipe trains the ONNX model as it trains torch's")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as temporary:
            main(Path(temporary))
