"""How long does the first fit of a convolutional net take, fuse="step" against "epoch"?

The first ``Trainer.fit`` specializes the graph it runs to the fit's batch size
(``lossgraph.speed.SpecializeBatch``: shapes folded, long products split), then opens its
session. ``SpecializeBatch`` infers shapes with onnx's data propagation three times; onnx
holds every static 1-D tensor it propagates element by element, and an epoch graph carries
the weights packed in one vector (ResNet-18: 11 million values), so the epoch graph's first
fit took seconds to a minute. ``lossgraph.graphs.infer_shapes_with_data`` keeps the long
float vectors out of the data propagation (they hold no shape).

For each model and fuse mode the benchmark times the first fit of a fresh ``Trainer`` (one
epoch, 64 rows, batches of 16: every batch full) and ``SpecializeBatch`` of the graph it
runs alone, side by side:

- **before**: shapes inferred by ``onnx.shape_inference.infer_shapes(..., data_prop=True)``
  over the whole graph, as SpecializeBatch did (``lossgraph.speed.scopes`` patched back);
- **after**: ``infer_shapes_with_data``, as it does now;

and checks that both give the same specialized graph, byte for byte. Models: torchvision's
ResNet-18 and ConvNeXt-Tiny (10 classes, 32 x 32 images, random weights), exported by
torch's legacy exporter (opset 17, a free batch axis); ``--quick``: a two-layer CNN (torch
alone). Without torch, nothing runs; without torchvision, the quick CNN only.

Run from the repository root:
      python -m benchmarks.first_fit [--quick] [--models resnet18,convnext_tiny]
          [--repeat 1] [--json out.json]
See docs/benchmarks.md#the-first-fit-of-an-epoch-graph.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx

BENCHMARK_MARK = "lossgraph benchmarks/first_fit.py"  # in every file the run writes
MODELS, MODELS_QUICK = ("resnet18", "convnext_tiny"), ("small_cnn",)
FUSES = ("step", "epoch")
VARIANTS = ("before", "after")
ROWS, BATCH, CLASSES, SIDE = 64, 16, 10, 32
#: the graph a first fit of 64 rows in batches of 16 runs, by fuse mode
GRAPH = {"step": "train_step", "epoch": "train_epoch"}


# -- the models -------------------------------------------------------------------------
def _torchvision() -> Any:
    """torchvision, or None when it is not installed."""
    try:
        import torchvision
    except ImportError:
        return None
    return torchvision


def network(name: str) -> Any:
    """The torch module of ``name``, seeded."""
    import torch

    torch.manual_seed(0)
    if name == "small_cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * (SIDE // 2) ** 2, CLASSES))
    torchvision = _torchvision()
    if torchvision is None:
        raise ImportError("torchvision is not installed (pip install torchvision==0.28.0)")
    return getattr(torchvision.models, name)(num_classes=CLASSES)


def export(name: str) -> onnx.ModelProto:
    """``name`` in eval mode, exported by torch's legacy exporter, its batch free."""
    import torch

    net = network(name).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.zeros(2, 3, SIDE, SIDE),), buffer, dynamo=False,
                          opset_version=17, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


# -- one measurement --------------------------------------------------------------------
@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """Within, SpecializeBatch infers shapes as ``name`` says (module doc)."""
    import lossgraph.speed.scopes as scopes

    real = scopes.infer_shapes_with_data
    if name == "before":
        scopes.infer_shapes_with_data = lambda m: onnx.shape_inference.infer_shapes(
            m, data_prop=True)
    try:
        yield
    finally:
        scopes.infer_shapes_with_data = real


def _timed(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """``work()``, its wall and CPU seconds."""
    start, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, time.perf_counter() - start, time.process_time() - cpu


def measure(model: onnx.ModelProto, fuse: str, name: str) -> dict[str, Any]:
    """The first fit of a fresh Trainer and SpecializeBatch alone, under variant ``name``;
    the specialized graph's digest."""
    import lossgraph
    from lossgraph.optim import Momentum
    from lossgraph.speed import SpecializeBatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fresh nets' tied weights (TiedWeightWarning)
        program = lossgraph.compile_program(model, loss="multiclass_log_loss",
                                            loss_options={"from_logits": True},
                                            optimizer=Momentum(0.01), fuse=fuse)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, 3, SIDE, SIDE)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=ROWS)
    with variant(name):
        special, specialize_s, specialize_cpu = _timed(
            lambda: SpecializeBatch(BATCH)(program.graphs[GRAPH[fuse]]).model)
        trainer = lossgraph.Trainer(program)
        _, fit_s, fit_cpu = _timed(lambda: trainer.fit(X, y, epochs=1, batch_size=BATCH,
                                                       shuffle=False, progress=False))
    return {"fit_s": fit_s, "fit_cpu_s": fit_cpu, "specialize_s": specialize_s,
            "specialize_cpu_s": specialize_cpu, "loss": float(trainer.train_losses_[-1]),
            "graph": hashlib.sha256(special.SerializeToString()).hexdigest()[:16]}


# -- the run ----------------------------------------------------------------------------
def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def report(cells: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The table: each model and fuse mode, before and after, side by side."""
    print("\n| model | fuse | first fit, before | first fit, after | SpecializeBatch, before "
          "| SpecializeBatch, after | same graph |")
    print("|---|---|---|---|---|---|---|")
    for key, pair in cells.items():
        model, fuse = key.split("/")
        if "error" in pair:
            print(f"| {model} | {fuse} | {pair['error']} | | | | |")
            continue
        before, after = pair["before"], pair["after"]
        same = "yes" if before["graph"] == after["graph"] else "NO"
        print(f"| {model} | {fuse} | {_seconds(before['fit_s'])} ({before['fit_cpu_s']:.2f}) "
              f"| {_seconds(after['fit_s'])} ({after['fit_cpu_s']:.2f}) "
              f"| {_seconds(before['specialize_s'])} ({before['specialize_cpu_s']:.2f}) "
              f"| {_seconds(after['specialize_s'])} ({after['specialize_cpu_s']:.2f}) "
              f"| {same} |")
    print("(wall seconds, CPU seconds of this process in brackets)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a two-layer CNN")
    parser.add_argument("--models", help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="first fits per cell and variant, alternating (the least counts)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    from benchmarks.machine import cpu_seconds, machine_facts, report_load
    from benchmarks.output import written_by
    from lossgraph.errors import UnsafeWriteError
    from lossgraph.fileio import check_file_target, write_file

    if args.json:
        try:
            check_file_target(args.json, owned=written_by(BENCHMARK_MARK))
        except UnsafeWriteError:
            parser.error(f"{args.json} is in the way: it is not a file this benchmark wrote.")
    names = args.models.split(",") if args.models else (MODELS_QUICK if args.quick else MODELS)
    facts = machine_facts()
    print("lossgraph's first fit of a conv net: SpecializeBatch's shape inference before and "
          "after it kept the packed weights out of onnx's data propagation")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    cells: dict[str, dict[str, Any]] = {}
    skipped = []
    for name in names:
        try:
            model = export(name)
        except ImportError as exc:
            skipped.append(f"{name}: skipped ({exc})")
            continue
        for fuse in FUSES:
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for _ in range(args.repeat):  # alternating, so that load falls on both alike
                for which in VARIANTS:
                    runs[which].append(measure(model, fuse, which))
            cells[f"{name}/{fuse}"] = {which: min(found, key=lambda r: r["fit_s"])
                                       for which, found in runs.items()}
    report(cells)
    for line in skipped:
        print(f"  {line}")
    wall = time.perf_counter() - started
    print(f"\ntotal wall time {wall:.0f} s")
    report_load(cpu_before, wall, facts)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "rows": ROWS,
                   "batch": BATCH, "cells": cells, "skipped": skipped}
        write_file(args.json, json.dumps(figures, indent=2).encode(),
                   owned=written_by(BENCHMARK_MARK))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
