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

and checks that both give the same specialized graph, byte for byte. Each cell runs in a
fresh process (``--worker``), which also gives its peak memory (the peak resident set less
the resident set before the fit, ``VmHWM`` - ``VmRSS``); onnx's data propagation holds each
propagated value as a message of its own, so a worker whose resident set passes
``--memory-limit`` (GiB, 6 by default) is killed and its cell reads "over 6 GiB" rather
than the machine running out of memory. Models (10 classes, 32 x 32 images, random
weights, exported by torch's legacy exporter at opset 17, a free batch axis):
torchvision's ResNet-18 and ConvNeXt-Tiny, and timm's ConvNeXt-Atto (ConvNeXt's blocks,
3.4 million parameters); ``--quick``: a two-layer CNN (torch alone), measured in this
process. Without torch, nothing runs; without torchvision or timm, their models are
skipped.

Run from the repository root:
      python -m benchmarks.first_fit [--quick] [--models resnet18,convnext_atto,convnext_tiny]
          [--repeat 1] [--memory-limit 6] [--json out.json]
See docs/benchmarks.md#the-first-fit-of-an-epoch-graph.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from benchmarks.machine import process_memory_mb, reset_peak_memory, run_capped_worker

BENCHMARK_MARK = "lossgraph benchmarks/first_fit.py"  # in every file the run writes
ROOT = Path(__file__).resolve().parents[1]
MODELS, MODELS_QUICK = ("resnet18", "convnext_atto", "convnext_tiny"), ("small_cnn",)
FUSES = ("step", "epoch")
VARIANTS = ("before", "after")
ROWS, BATCH, CLASSES, SIDE = 64, 16, 10, 32
#: the graph a first fit of 64 rows in batches of 16 runs, by fuse mode
GRAPH = {"step": "train_step", "epoch": "train_epoch"}


# -- the models -------------------------------------------------------------------------
def network(name: str) -> Any:
    """The torch module of ``name``, seeded (ImportError without its library)."""
    import torch

    torch.manual_seed(0)
    if name == "small_cnn":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * (SIDE // 2) ** 2, CLASSES))
    if name.startswith("convnext_atto"):
        import timm

        return timm.create_model(name, pretrained=False, num_classes=CLASSES)
    import torchvision

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
    reset_peak_memory()
    resident = process_memory_mb("VmRSS")
    with variant(name):
        special, specialize_s, specialize_cpu = _timed(
            lambda: SpecializeBatch(BATCH)(program.graphs[GRAPH[fuse]]).model)
        trainer = lossgraph.Trainer(program)
        _, fit_s, fit_cpu = _timed(lambda: trainer.fit(X, y, epochs=1, batch_size=BATCH,
                                                       shuffle=False, progress=False))
    return {"fit_s": fit_s, "fit_cpu_s": fit_cpu, "specialize_s": specialize_s,
            "specialize_cpu_s": specialize_cpu, "loss": float(trainer.train_losses_[-1]),
            "graph": hashlib.sha256(special.SerializeToString()).hexdigest()[:16],
            "peak_added_mb": process_memory_mb("VmHWM") - resident}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell in this fresh process: the model of ``spec["file"]``, its fuse mode and
    variant."""
    return measure(onnx.load(spec["file"]), spec["fuse"], spec["variant"])


def run_worker(file: Path, fuse: str, which: str, limit_gib: float) -> dict[str, Any]:
    """:func:`worker` in a fresh interpreter, killed once its resident set passes
    ``limit_gib``; a failure is the cell's ``error``."""
    spec = {"file": str(file), "fuse": fuse, "variant": which}
    return run_capped_worker("benchmarks.first_fit", spec, limit_gib)


# -- the run ----------------------------------------------------------------------------
def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def _variant_text(record: dict[str, Any]) -> tuple[str, str, str]:
    """(first fit, SpecializeBatch, peak memory) of one variant's record."""
    if "error" in record:
        return record["error"], "-", "-"
    return (f"{_seconds(record['fit_s'])} ({record['fit_cpu_s']:.2f})",
            f"{_seconds(record['specialize_s'])} ({record['specialize_cpu_s']:.2f})",
            f"{record['peak_added_mb']:,.0f} MiB")


def report(cells: dict[str, dict[str, dict[str, Any]]]) -> None:
    """The table: each model and fuse mode, before and after, side by side."""
    print("\n| model | fuse | first fit, before | first fit, after | SpecializeBatch, before "
          "| SpecializeBatch, after | peak memory, before | peak memory, after | same graph |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, pair in cells.items():
        model, fuse = key.split("/")
        before, after = (_variant_text(pair[which]) for which in VARIANTS)
        same = ("-" if "graph" not in pair["before"] or "graph" not in pair["after"] else
                "yes" if pair["before"]["graph"] == pair["after"]["graph"] else "NO")
        print(f"| {model} | {fuse} | {before[0]} | {after[0]} | {before[1]} | {after[1]} "
              f"| {before[2]} | {after[2]} | {same} |")
    print("(wall seconds, CPU seconds of the process in brackets; peak memory: the peak "
          "resident set less the resident set before the fit)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: a two-layer CNN")
    parser.add_argument("--models", help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--repeat", type=int, default=1,
                        help="first fits per cell and variant, alternating (the least counts)")
    parser.add_argument("--memory-limit", type=float, default=6.0, metavar="GIB",
                        help="stop a cell whose process holds more than this (default 6)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--worker", metavar="SPEC", help="internal: one cell, printed as JSON")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from benchmarks.machine import cpu_seconds, machine_facts, report_run
    from benchmarks.output import check_targets, save_figures, written_by

    check_targets(parser, [args.json], written_by(BENCHMARK_MARK))
    names = args.models.split(",") if args.models else (MODELS_QUICK if args.quick else MODELS)
    facts = machine_facts()
    print("lossgraph's first fit of a conv net: SpecializeBatch's shape inference before and "
          "after it kept the packed weights out of onnx's data propagation")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    cells: dict[str, dict[str, Any]] = {}
    skipped = []
    with tempfile.TemporaryDirectory(prefix="lossgraph_first_fit_") as folder:
        for name in names:
            try:
                model = export(name)
            except ImportError as exc:
                skipped.append(f"{name}: skipped ({exc})")
                continue
            file = Path(folder) / f"{name}.onnx"
            onnx.save(model, file)
            for fuse in FUSES:
                runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
                for _ in range(args.repeat):  # alternating, so that load falls on both alike
                    for which in VARIANTS:
                        runs[which].append(measure(model, fuse, which) if args.quick else
                                           run_worker(file, fuse, which, args.memory_limit))
                cells[f"{name}/{fuse}"] = {
                    which: min(found, key=lambda r: r.get("fit_s", float("inf")))
                    for which, found in runs.items()}
                print(f"  {name} {fuse}: done", flush=True)
    report(cells)
    report_run(started, cpu_before, facts, skipped)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "rows": ROWS,
                   "batch": BATCH, "memory_limit_gib": args.memory_limit, "cells": cells,
                   "skipped": skipped}
        save_figures(figures, args.json, written_by(BENCHMARK_MARK))
    return 0


if __name__ == "__main__":
    sys.exit(main())
