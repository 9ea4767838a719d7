"""11: fine-tune a transformers classifier with LoRA adapters, then ship it two ways.

LoRA trains small low-rank adapters beside frozen weights: for each targeted product
``Y = X @ W`` the graph computes ``Y + (alpha / rank) * (X @ A) @ B``, ``A`` and ``B`` the
only weights that train (``B`` starts at zero, so the model's output is unchanged before
training). lossgraph inserts them into the ONNX model as a graph pass:
``compile_program(model, adapters=lossgraph.LoRA(rank, alpha, targets))``.

The model is a small ``BertForSequenceClassification`` built from a ``BertConfig`` (random
weights moved off their initial values, as 09 explains; nothing is downloaded), exported
with ``torch.onnx.export``, its task 09's synthetic one. The adapters go on the attention's
query and value projections and every ``dense`` layer (the pooler's among them): the head
stays frozen, so on a random base the adapters must carry the whole fine-tuning.

torch + PEFT trains the same adapters in the same run: PEFT loads lossgraph's initial
adapters from the file ``export_adapters`` writes (PEFT's names and layout, with its
``adapter_config.json``), so both start equal, and both take the same AdamW steps on the
same batches: the losses agree step for step. Then the fine-tuned model leaves training
two ways:

- **merged**: ``Trainer.to_inference_model(merge=True)`` folds ``W + (alpha / rank) A B``
  into each weight: the exported graph, node for node, run in a plain onnxruntime session;
  its held-out logits equal PEFT's ``merge_and_unload()`` network's;
- **the adapter file**: ``export_adapters(trainer, "adapter_model.safetensors")`` writes
  the adapters alone, a small fraction of the model; PEFT loads it onto the base network,
  and ``load_adapters`` onto a fresh Trainer of the same program: both predict as the
  merged model does.

What it saves at real sizes, measured by ``benchmarks/lora.py`` (3 AdamW steps, rank 8 on
PEFT's default targets; peak memory above the baseline, step time on a 2-core machine,
every run in one benchmark run; docs/benchmarks.md#lora-adapters):

    model, run                          trained      optimizer state  peak       step
    BERT-base (batch 8 x 128)
      lossgraph full fine-tuning        109,483,778  835 MiB          2,104 MiB   6.8 s
      lossgraph LoRA                        294,912  2.25 MiB         1,047 MiB   4.3 s
      torch + PEFT LoRA                     294,912  2.25 MiB           733 MiB   3.9 s
    GPT-2 small (batch 4 x 128)
      lossgraph full fine-tuning        163,037,184  1,244 MiB        3,441 MiB   5.3 s
      lossgraph LoRA                        294,912  2.25 MiB         1,377 MiB   2.9 s
      torch + PEFT LoRA                     294,912  2.25 MiB           927 MiB   3.4 s

LoRA's peak is 0.50x and 0.40x of full fine-tuning's (the aim: at most half): the program
holds the frozen base weights once, and the Trainer's sessions are fed them from that one
copy. Its step is 1.10x PEFT's on BERT-base and 0.86x on GPT-2 (the benchmark's page
tells where the peak and the time go).

Needs torch, transformers and peft (``pip install torch==2.13.0 transformers peft``);
without them the script says so and stops. Files go to the folder given as the first
argument, or a temporary folder by default.
Run: python docs/examples/11_finetune_with_lora.py [output folder]
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

VOCABULARY, LENGTH, ROWS, BATCH, EPOCHS = 100, 12, 96, 16, 4
RANK, ALPHA, TARGETS = 8, 16, ["query", "value", "dense"]
LEARNING_RATE, EPSILON = 1e-2, 1e-6  # EPSILON: see 09's note
INPUTS = ("input_ids", "attention_mask")
#: the agreement asserted, relative (logits: to the largest): lossgraph's losses and held-out
#: logits against PEFT's after 24 AdamW steps (Adam's first steps move a weight whose
#: gradient is within rounding of zero by about the learning rate, whichever way rounding
#: tips it: the two libraries drift apart by that much), and the same trained adapters
#: run two ways (merged, or loaded from the file): float32 rounding
LOSS_RTOL, PEFT_RTOL, SAME_RTOL = 1e-3, 5e-3, 1e-5


def sequences(rows: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """09's task: token ids and attention masks (0 pads the end), and the class of each
    row (half its tokens come from the vocabulary's upper half for class 1, lower for 0)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, rows)
    ids = rng.integers(1, VOCABULARY, size=(rows, LENGTH))
    half = VOCABULARY // 2
    signal = rng.random((rows, LENGTH)) < 0.5
    ids = np.where(signal & (y[:, None] == 1), rng.integers(half, VOCABULARY, ids.shape), ids)
    ids = np.where(signal & (y[:, None] == 0), rng.integers(1, half, ids.shape), ids)
    mask = (np.arange(LENGTH) < rng.integers(LENGTH // 2, LENGTH + 1, rows)[:, None])
    return {"input_ids": ids * mask, "attention_mask": mask.astype(np.int64)}, y


def kib(path: Path) -> str:
    return f"{path.stat().st_size / 1024:,.1f} KiB"


def main(folder: Path) -> None:
    if any(importlib.util.find_spec(m) is None for m in ("torch", "transformers", "peft")):
        print("SKIPPED: this example needs torch, transformers and peft "
              "(pip install torch==2.13.0 transformers peft)")
        return
    import peft
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
    base = Logits(transformers.BertForSequenceClassification(config)).eval()
    with torch.no_grad():  # stand in for a checkpoint: no two weights equal
        for parameter in base.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    X, y = sequences(ROWS, seed=0)
    X_test, y_test = sequences(256, seed=1)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(base, tuple(torch.from_numpy(X[name][:2]) for name in INPUTS),
                          buffer, dynamo=False, opset_version=17, input_names=list(INPUTS),
                          output_names=["logits"],
                          dynamic_axes={**{name: {0: "batch", 1: "sequence"} for name in INPUTS},
                                        "logits": {0: "batch"}})
    onx = onnx.load_from_string(buffer.getvalue())
    (folder / "model.onnx").write_bytes(buffer.getvalue())

    # The adapters, compiled into the training graphs: only A and B train.
    program = lossgraph.compile_program(
        onx, adapters=lossgraph.LoRA(rank=RANK, alpha=ALPHA, targets=TARGETS),
        loss="multiclass_log_loss", loss_options={"from_logits": True},
        optimizer=AdamW(LEARNING_RATE, epsilon=EPSILON, weight_decay=0.0))
    trained = sum(program.state[w].size for w in program.weights)
    total = sum(p.numel() for p in base.parameters())
    moments = sum(program.state[s].nbytes for s in program.optimizer_states)
    print(f"{len(program.adapters)} adapters (rank {RANK}) on "
          f"{', '.join(sorted({a.module.rsplit('.', 1)[-1] for a in program.adapters}))}: "
          f"training {trained:,} of {total:,} parameters ({trained / total:.1%}), "
          f"AdamW's moments {moments / 1024:.1f} KiB (every weight: {8 * total / 1024:.1f} KiB)")

    # PEFT starts from lossgraph's initial adapters, read from the file lossgraph writes.
    start = folder / "initial_adapters"
    start.mkdir()
    lossgraph.export_adapters(program, start / "adapter_model.safetensors", peft_config=True)
    peft_net = peft.PeftModel.from_pretrained(copy.deepcopy(base), start, is_trainable=True)

    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, progress=False)
    optimizer = torch.optim.AdamW([p for p in peft_net.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE, eps=EPSILON, weight_decay=0.0)
    peft_losses = []
    for _ in range(EPOCHS):
        losses = []
        for first in range(0, ROWS, BATCH):
            optimizer.zero_grad()
            batch = {name: torch.from_numpy(X[name][first:first + BATCH]) for name in INPUTS}
            loss = torch.nn.functional.cross_entropy(
                peft_net(**batch), torch.from_numpy(y[first:first + BATCH]))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        peft_losses.append(float(np.mean(losses)))
    print("epoch  train loss (lossgraph LoRA)  train loss (torch + PEFT)")
    for epoch, (ours, theirs) in enumerate(zip(trainer.train_losses_, peft_losses)):
        print(f"{epoch:5d}  {ours:27.4f}  {theirs:25.4f}")
    np.testing.assert_allclose(trainer.train_losses_, peft_losses, rtol=LOSS_RTOL)
    assert trainer.train_losses_[-1] < 0.8 * trainer.train_losses_[0]

    # Out of training, 1: the adapters merged into the weights, the exported graph again.
    merged = trainer.to_inference_model(merge=True)
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in onx.graph.node]
    onnx.save(merged, folder / "merged.onnx")
    session = onnxruntime.InferenceSession(merged.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    (ours,) = session.run(None, X_test)
    test = {name: torch.from_numpy(X_test[name]) for name in INPUTS}
    with torch.no_grad():
        theirs = copy.deepcopy(peft_net).merge_and_unload()(**test).numpy()
    scale = np.abs(theirs).max()
    print(f"merged model: {len(merged.graph.node)} nodes, as exported; held-out logits: "
          f"max |lossgraph - PEFT merge_and_unload()| = {np.abs(ours - theirs).max():.1e} "
          f"(logits up to {scale:.1f}); accuracy {(ours.argmax(1) == y_test).mean():.3f} "
          "(chance 0.5)")
    np.testing.assert_allclose(ours, theirs, atol=PEFT_RTOL * scale)
    assert (ours.argmax(1) == y_test).mean() > 0.6

    # Out of training, 2: the adapters alone, loaded by PEFT and by lossgraph.
    path = lossgraph.export_adapters(trainer, folder / "adapter_model.safetensors",
                                     peft_config=True)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder)
    with torch.no_grad():
        from_file = loaded(**test).numpy()
    resumed = lossgraph.Trainer(program)
    lossgraph.load_adapters(resumed, path)
    print(f"saved to {folder}: model.onnx {kib(folder / 'model.onnx')} (the base), "
          f"merged.onnx {kib(folder / 'merged.onnx')}, {path.name} {kib(path)} "
          "(the adapters alone)")
    np.testing.assert_allclose(from_file, ours, atol=SAME_RTOL * scale)
    np.testing.assert_allclose(resumed.predict(X_test), ours, atol=SAME_RTOL * scale)
    print("OK: LoRA trained as PEFT does; the merged model and the adapter file predict alike")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as temporary:
            main(Path(temporary))
