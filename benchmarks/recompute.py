"""Activation recomputation: training peak memory and step time, against torch eager.

    python -m benchmarks.recompute [--size small|base] [--batch 8] [--tokens 128]

Model: ``BertForSequenceClassification`` (transformers) with random weights, exported by
torch's legacy exporter at opset 17 with a free batch axis, in eval mode (no Dropout: the
same function in torch and in lossgraph), trained 3 SGD steps on random tokens with a
cross-entropy loss on the logits, float32. ``--size small``: 4 layers, 256 wide, 4 heads,
ffn 1024, vocabulary 8000; ``base``: ``BertConfig()`` (12 layers, 768 wide, 110M weights).

Each cell runs in a fresh process (``--cell``). The **baseline** is its resident set after
the imports, the model (torch's module, or the ONNX file loaded) and the data; lossgraph's
cells then compile, and start the peak over (``VmHWM`` reset through
``/proc/self/clear_refs``), so that the **step peak** is the peak resident set during the
session's creation and 3 training steps, less the baseline: what training adds, compile
aside (``benchmarks.compile_cost`` measures compile). The **step time** is the median of
steps 2 and 3 (torch: 2 and 3 as well), wall clock and the process's CPU time (less
sensitive to a busy machine). Cells:

- ``torch``: torch eager, ``loss.backward()`` then ``SGD.step()``;
- ``none``: ``compile_program(fuse="step")``, every activation kept;
- ``layers``: ``recompute=[the output of each encoder layer]``, HF's
  ``gradient_checkpointing`` boundaries;
- ``activations``: ``recompute="activations"``;
- ``elementwise``: ``recompute="elementwise"``;
- ``auto``: ``recompute="auto"``;
- a number, ``0.5``: ``recompute=0.5``, a budget (``"auto"`` within that fraction of the
  activations the backward reads).

``--session`` runs lossgraph's ``train_step`` graph in a plain onnxruntime session instead
of the Trainer (its peak: the session and its runs, without the Trainer's state buffers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

CELLS = ("torch", "none", "activations", "elementwise", "layers", "auto", "0.5")
STEPS = 3


def config(size: str) -> Any:
    from transformers import BertConfig

    if size == "base":
        return BertConfig()
    return BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=1024, vocab_size=8000)


def build(size: str, tokens: int, batch: int) -> tuple[Any, Any, Any]:
    """The torch module (random weights, nudged so that the exporter ties none), the
    token ids and the labels of ``STEPS`` batches."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    net = BertForSequenceClassification(config(size)).eval()
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    ids = torch.randint(0, net.config.vocab_size, (STEPS * batch, tokens))
    labels = torch.randint(0, net.config.num_labels, (STEPS * batch,))
    return net, ids, labels


def export(size: str, tokens: int, path: Path) -> None:
    import torch

    net, ids, _ = build(size, tokens, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (ids[:2],), str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}})


def layer_outputs(model: Any) -> list[str]:
    """The output of each encoder layer (its last LayerNorm's) in the legacy export."""
    outputs = []
    for node in model.graph.node:
        name = node.name
        if "/encoder/layer." in name and "/output/LayerNorm/" in name and \
                "/attention/" not in name:
            layer = name.split("/encoder/layer.")[1].split("/")[0]
            outputs.append((int(layer), node.output[0]))
    last: dict[int, str] = {}
    for layer, output in outputs:
        last[layer] = output
    return [last[k] for k in sorted(last)]


def cell(name: str, size: str, tokens: int, batch: int, path: Path,
         session: bool = False) -> dict[str, Any]:
    """One cell, in this process (module docstring); ``session``: lossgraph's train_step
    graph run in a plain onnxruntime session instead of the Trainer."""
    import numpy as np
    import onnx
    import torch

    from benchmarks.machine import process_memory_mb, reset_peak_memory

    torch.set_num_threads(2)
    net, ids, labels = build(size, tokens, batch)
    times, cpus = [], []
    if name == "torch":
        net.train()
        for module in net.modules():  # no Dropout: the function lossgraph trains
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        baseline = process_memory_mb("VmRSS")
        reset_peak_memory()
        for step in range(STEPS):
            start, cpu = time.perf_counter(), time.process_time()
            rows = slice(step * batch, (step + 1) * batch)
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(ids[rows]).logits, labels[rows])
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        return {"cell": name, "peak_mb": process_memory_mb("VmHWM") - baseline,
                "step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpus[1:])}
    import lossgraph
    from lossgraph.optim import SGD
    from lossgraph.passes.recompute import PLANS

    model = onnx.load(str(path))
    X, y = ids.numpy().astype(np.int64), labels.numpy().astype(np.int64)
    del net
    baseline = process_memory_mb("VmRSS")
    recompute = (layer_outputs(model) if name == "layers" else name if name in PLANS
                 else float(name))
    start = time.perf_counter()
    program = lossgraph.compile_program(model, loss="multiclass_log_loss",
                                        loss_options={"from_logits": True},
                                        optimizer=SGD(0.01), recompute=recompute)
    compile_s = time.perf_counter() - start
    plan = program.manifest.get("recompute", {}).get("train_step")
    del model
    if session:  # the train_step graph alone in a plain session: the activations' part
        graph = program.graphs["train_step"].SerializeToString()
        state = {**program.state, "learning_rate": np.array(0.01, np.float32),
                 "step": np.array(1, np.int64)}
        del program
        import onnxruntime

        from lossgraph.runtime.session import default_session_options

        options = default_session_options()  # lossgraph's: no memory pattern
        reset_peak_memory()
        run = onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        feeds = [i.name for i in run.get_inputs()]
        for step in range(STEPS):
            rows = slice(step * batch, (step + 1) * batch)
            given = {**state, "input_ids": X[rows], "label": y[rows]}
            start, cpu = time.perf_counter(), time.process_time()
            run.run(None, {name: given[name] for name in feeds})
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
    else:
        reset_peak_memory()
        trainer = lossgraph.Trainer(program)
        for step in range(STEPS):
            rows = slice(step * batch, (step + 1) * batch)
            start, cpu = time.perf_counter(), time.process_time()
            trainer.fit(X[rows], y[rows], batch_size=batch, epochs=1, warm_start=step > 0,
                        shuffle=False, progress=False)
            times.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
    return {"cell": name, "peak_mb": process_memory_mb("VmHWM") - baseline,
            "step_s": statistics.median(times[1:]), "cpu_s": statistics.median(cpus[1:]),
            "compile_s": compile_s,
            "kept": len(plan["kept"]) if plan else None,
            "recomputed": len(plan["recomputed"]) if plan else None,
            "boundaries": len(plan["boundaries"]) if plan else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=("small", "base"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--session", action="store_true",
                        help="run lossgraph's train_step graph in a plain onnxruntime session "
                             "(the activations' part of the peak), not the Trainer")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(cell(args.cell, args.size, args.tokens, args.batch,
                              Path(args.model), args.session)))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bert.onnx"
        export(args.size, args.tokens, path)
        rows = []
        for name in args.cells.split(","):
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.recompute", "--cell", name, "--size",
                 args.size, "--tokens", str(args.tokens), "--batch", str(args.batch),
                 "--model", str(path), *(["--session"] if args.session else [])],
                capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    torch_row = next((r for r in rows if r["cell"] == "torch"), None)
    print(f"BERT {args.size}, batch {args.batch} x {args.tokens} tokens, float32, SGD, "
          f"{STEPS} steps, fuse='step'{', session alone' if args.session else ''}")
    print("| cell | step peak (MiB) | vs torch | step (s) | vs torch | step CPU (s) | vs torch "
          "| boundaries | recomputed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = ([f"{row[k] / torch_row[k]:.2f}x" for k in ("peak_mb", "step_s", "cpu_s")]
                 if torch_row else ["", "", ""])
        print(f"| {row['cell']} | {row['peak_mb']:,.0f} | {ratio[0]} | {row['step_s']:.3f} | "
              f"{ratio[1]} | {row['cpu_s']:.3f} | {ratio[2]} | {row.get('boundaries') or ''} "
              f"| {row.get('recomputed') or ''} |")


if __name__ == "__main__":
    main()
