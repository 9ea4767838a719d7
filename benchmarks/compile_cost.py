"""How does lossgraph's compile cost grow with the model?

Times ``lossgraph.compile_program`` (SGD with Nesterov momentum, squared error) in each fuse
mode, and ``lossgraph.gradient`` alone, on

- MLPs of 4, 16, 64 and 256 layers (``Gemm`` + ``Relu`` each, 64 wide, then one output
  column), built here with onnx's helper: the growth with the number of nodes;
- a BERT-base-size transformer: ``transformers``' ``BertForSequenceClassification`` with
  ``BertConfig()`` (12 layers, 768 wide, 12 heads, ffn 3072, vocabulary 30522, 110M
  parameters), random weights (nudged, so that the exporter ties none), exported with
  torch's legacy exporter (opset 17, 128 tokens, free batch axis, one 440 MB file: the
  protobuf limit is 2 GB), trained on its logits with the multiclass log loss. Without
  ``transformers``, the BERT-base-size torch.nn encoder of ``graph_library.py``; without
  torch, no BERT row.

Each cell runs in a fresh subprocess (``--worker``): it builds or loads the model, warms
up on a one-layer MLP (lazy imports), then compiles once while measuring memory, then
``--repeat`` times more for the time (the cell is their median wall time; the median CPU
time of the process, less disturbed by other processes on a busy machine, is reported
beside the growth). Memory is the peak resident set during that first compile less the
resident set before it (``VmHWM`` less ``VmRSS``), so it counts protobuf's own memory,
which tracemalloc does not see.

Run from the repository root:
      python -m benchmarks.compile_cost [--quick] [--layers 4,16,64,256]
          [--modes gradient,step,epoch,separate] [--bert base|tiny|none] [--repeat 5]
          [--cache DIR] [--json out.json] [--plot out.png]
See docs/benchmarks.md#compile-cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks.output import check_targets, save_figure, save_figures, written_by

BENCHMARK_MARK = "lossgraph benchmarks/compile_cost.py"  # in every file the run writes
ROOT = Path(__file__).resolve().parents[1]
MODES = ("gradient", "step", "epoch", "separate")
LAYERS, LAYERS_QUICK = (4, 16, 64, 256), (1, 4)
WIDTH = 64
#: Targets (issue 17): the 256-layer compile within this factor of the 64-layer one
#: (4x the layers: linear growth), and BERT-base compiled within this many seconds.
GROWTH_TARGET, BERT_TARGET_S = 4.5, 10.0
BERT_TOKENS = 128


# -- the models -------------------------------------------------------------------------
def mlp_model(layers: int, width: int = WIDTH) -> onnx.ModelProto:
    """``X`` (N, width) -> ``layers`` x (Gemm, Relu) -> MatMul -> ``variable`` (N, 1)."""
    rng = np.random.default_rng(layers)
    nodes, weights, x = [], [], "X"
    for i in range(layers):
        weights += [rng.standard_normal((width, width), np.float32) / np.float32(math.sqrt(width)),
                    rng.standard_normal(width, np.float32) / np.float32(10)]
        nodes += [helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [f"h{i}"]),
                  helper.make_node("Relu", [f"h{i}"], [f"a{i}"])]
        x = f"a{i}"
    weights.append(rng.standard_normal((width, 1), np.float32) / np.float32(math.sqrt(width)))
    nodes.append(helper.make_node("MatMul", [x, "W_out"], ["variable"]))
    names = [n for i in range(layers) for n in (f"W{i}", f"b{i}")] + ["W_out"]
    graph = helper.make_graph(
        nodes, f"mlp{layers}",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("variable", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w, n) for n, w in zip(names, weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _bert_config(size: str):
    from transformers import BertConfig

    if size == "base":
        return BertConfig()
    return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=BERT_TOKENS)


def export_bert(path: Path, size: str = "base") -> str:
    """Write the BERT model of ``size`` (``base``, or ``tiny`` for smoke tests) to ``path``;
    return its loss (an ImportError names what is missing)."""
    import torch

    try:
        from transformers import BertForSequenceClassification
    except ImportError:
        if size != "base":
            raise
        from benchmarks.graph_library import export_bert as export_torch_nn_bert

        export_torch_nn_bert(path)  # BERT-base's shapes from torch.nn modules
        return "squared_error"
    torch.manual_seed(0)
    net = BertForSequenceClassification(_bert_config(size)).eval()
    with torch.no_grad():  # random weights; nudged, or the exporter ties equal initializers
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    ids = torch.randint(0, net.config.vocab_size, (2, BERT_TOKENS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (ids,), str(path), dynamo=False, opset_version=17,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}})
    return "multiclass_log_loss"


@dataclass(frozen=True)
class Subject:
    """One model of the table: how the worker gets it, and its loss."""

    name: str
    layers: int | None = None  # an MLP's layers
    path: str | None = None  # an exported model's file
    loss: str = "squared_error"

    def model(self) -> onnx.ModelProto:
        return mlp_model(self.layers) if self.path is None else onnx.load(self.path)

    @property
    def loss_options(self) -> dict[str, Any]:
        return {"from_logits": True} if self.loss == "multiclass_log_loss" else {}


# -- one measurement (in a fresh process) -----------------------------------------------
def _work(mode: str, subject: Subject, model: onnx.ModelProto) -> Callable[[], onnx.ModelProto]:
    """What is timed for ``mode``: ``lossgraph.gradient`` of the model with its loss (added
    beforehand), or ``compile_program``; the function returns the main graph it built."""
    import lossgraph
    from lossgraph.optim import Momentum

    if mode == "gradient":
        with_loss = lossgraph.add_loss_output(model, subject.loss, **subject.loss_options)
        return lambda: lossgraph.gradient(with_loss)
    main_graph = {"step": "train_step", "epoch": "train_epoch", "separate": "gradient"}[mode]
    optimizer = Momentum(0.01, momentum=0.9, nesterov=True)
    return lambda: lossgraph.compile_program(
        model, loss=subject.loss, loss_options=subject.loss_options or None,
        optimizer=optimizer, fuse=mode).graphs[main_graph]


def measure(subject: Subject, mode: str, repeat: int) -> dict[str, Any]:
    """One cell, in this process: the first run's memory, then ``repeat`` timed runs;
    ``built_nodes`` counts the main graph's nodes, its Scan bodies' included."""
    from benchmarks.machine import process_memory_mb
    from lossgraph.graphs import all_graphs

    _work(mode, Subject("warm-up", layers=1), mlp_model(1))()
    model = subject.model()
    work = _work(mode, subject, model)
    rss_before = process_memory_mb("VmRSS")
    start = time.perf_counter()
    built = work()
    first = time.perf_counter() - start
    peak_added = process_memory_mb("VmHWM") - rss_before
    samples, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        samples.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"first_ms": first * 1000, "samples_ms": [s * 1000 for s in samples],
            "median_ms": statistics.median(samples) * 1000,
            "cpu_median_ms": statistics.median(cpu) * 1000, "peak_added_mb": peak_added,
            "rss_before_mb": rss_before, "nodes": len(model.graph.node),
            "weights_mb": sum(t.ByteSize() for t in model.graph.initializer) / 2**20,
            "built_nodes": sum(len(g.node) for g in all_graphs(built.graph))}


def run_worker(subject: Subject, mode: str, repeat: int) -> dict[str, Any]:
    """:func:`measure` in a fresh interpreter; a failure is the cell's ``error``."""
    spec = json.dumps({"subject": asdict(subject), "mode": mode, "repeat": repeat})
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_cost", "--worker", spec],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker exited {done.returncode}: {last[:300]}"}
    return json.loads(lines[-1])


# -- the report -------------------------------------------------------------------------
def growth(cells: dict[str, dict[str, dict]], mode: str
           ) -> tuple[float, float, float] | None:
    """(wall time ratio, CPU time ratio, layers ratio) of the largest MLP to the one 4x
    smaller, medians."""
    sizes = sorted(int(name.split()[1]) for name in cells if name.startswith("MLP"))
    pairs = [(small, large) for small in sizes for large in sizes if large == 4 * small]
    if not pairs:
        return None
    small, large = pairs[-1]
    a, b = cells[f"MLP {small} layers"].get(mode, {}), cells[f"MLP {large} layers"].get(mode, {})
    if "median_ms" not in a or "median_ms" not in b:
        return None
    return (b["median_ms"] / a["median_ms"], b["cpu_median_ms"] / a["cpu_median_ms"],
            large / small)


def _cell(record: dict[str, Any] | None) -> str:
    if not record:
        return "-"
    if "error" in record:
        return "n/a"
    ms = record["median_ms"]
    time_text = f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"
    return f"{time_text} / {record['peak_added_mb']:.0f} MiB"


def report(cells: dict[str, dict[str, dict]], modes: list[str], repeat: int) -> list[dict]:
    """Prints the table, the growth and the targets; returns the verdicts."""
    print(f"\nmedian wall time of {repeat} run(s) / peak resident memory added by the first "
          "run, a fresh process per cell")
    print(f"{'model':18s} {'nodes':>6s} {'weights':>9s}" + "".join(f"{m:>20s}" for m in modes))
    for name, row in cells.items():
        some = next((r for r in row.values() if "nodes" in r), {})
        weights = f"{some['weights_mb']:.1f} MiB" if some else "-"
        print(f"{name:18s} {some.get('nodes', '-')!s:>6s} {weights:>9s}"
              + "".join(f"{_cell(row.get(m)):>20s}" for m in modes))
    for name, row in cells.items():
        for mode, record in row.items():
            if "error" in record:
                print(f"  {name}, {mode}: n/a -- {record['error']}")
    verdicts = []
    for mode in modes:
        found = growth(cells, mode)
        if found is None:
            continue
        ratio, cpu_ratio, layers = found
        target = GROWTH_TARGET if layers == 4 else None
        verdict = "-" if target is None else ("PASS" if ratio <= target else "MISS")
        exponent = math.log(ratio) / math.log(layers)
        print(f"  {mode}: {layers:.0f}x the layers, {ratio:.2f}x the time (log-log slope "
              f"{exponent:.2f}; CPU time {cpu_ratio:.2f}x)"
              f"{'' if target is None else f'; target <= {target}x: {verdict}'}")
        verdicts.append({"mode": mode, "ratio": ratio, "cpu_ratio": cpu_ratio,
                         "layers_ratio": layers, "slope": exponent, "target": target,
                         "verdict": verdict})
    for name, row in cells.items():
        if not name.startswith("BERT-base"):
            continue
        for mode, record in row.items():
            if mode == "gradient" or "median_ms" not in record:
                continue
            seconds = record["median_ms"] / 1000
            verdict = "PASS" if seconds < BERT_TARGET_S else "MISS"
            print(f"  {name} {mode}: {seconds:.1f} s (target < {BERT_TARGET_S:g} s): {verdict}")
            verdicts.append({"mode": mode, "model": name, "seconds": seconds,
                             "target": BERT_TARGET_S, "verdict": verdict})
    return verdicts


#: True for a file this benchmark wrote (its JSON or PNG carries BENCHMARK_MARK)
is_benchmark_output = written_by(BENCHMARK_MARK)


def plot(cells: dict[str, dict[str, dict]], modes: list[str], path: str) -> None:
    """Time and memory against the model's nodes, log-log (needs matplotlib)."""

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n--plot {path}: matplotlib is not installed, no plot written")
        return
    figure, (times, memory) = plt.subplots(1, 2, figsize=(12, 4.8))
    for index, mode in enumerate(modes):
        color = f"C{index}"
        for kind, marker, style in (("MLP", "o", "-"), ("BERT", "*", "none")):
            names = [name for name in cells if name.startswith(kind)]
            points = sorted((r["nodes"], r["median_ms"], r["peak_added_mb"])
                            for name in names for m, r in cells[name].items()
                            if m == mode and "median_ms" in r)
            if not points:
                continue
            nodes, ms, mib = zip(*points)
            label = f"{mode} ({'MLPs' if kind == 'MLP' else names[0]})"
            times.plot(nodes, ms, marker=marker, linestyle=style, color=color, label=label,
                       markersize=12 if kind == "BERT" else 6)
            memory.plot(nodes, [max(m, 0.1) for m in mib], marker=marker, linestyle=style,
                        color=color, label=label, markersize=12 if kind == "BERT" else 6)
    mlp = sorted(r["nodes"] for name, row in cells.items() if name.startswith("MLP")
                 for r in row.values() if "nodes" in r)
    step = [r for name, row in cells.items() if name.startswith("MLP")
            for m, r in row.items() if m == "step" and "median_ms" in r]
    if mlp and step:  # linear growth, through the smallest MLP's step compile
        start = min(step, key=lambda r: r["nodes"])
        xs = [mlp[0], mlp[-1]]
        times.plot(xs, [start["median_ms"] * x / start["nodes"] for x in xs], color="gray",
                   linestyle=":", label="linear growth")
    times.set(ylabel="median wall time (ms)", title="compile time")
    memory.set(ylabel="peak resident memory added (MiB)", title="compile memory")
    for axis in (times, memory):
        axis.set(xscale="log", yscale="log", xlabel="nodes of the inference model")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path, BENCHMARK_MARK, dpi=110)
    print(f"\nplot written to {path}")


# -- the command line -------------------------------------------------------------------
def _subjects(layers: list[int], bert: str, cache: Path) -> tuple[list[Subject], list[str]]:
    """The MLPs and the BERT model (exported into ``cache`` unless there already), and
    why a model is missing."""
    subjects = [Subject(f"MLP {n} layers", layers=n) for n in layers]
    if bert == "none":
        return subjects, []
    path, loss_file = cache / f"bert-{bert}.onnx", cache / f"bert-{bert}.loss"
    if not (path.exists() and loss_file.exists()):
        try:
            start = time.perf_counter()
            loss_file.write_text(export_bert(path, bert))
            print(f"BERT-{bert} exported to {path} in {time.perf_counter() - start:.0f} s")
        except ImportError as error:
            return subjects, [f"BERT-{bert}: skipped ({error})"]
    return [*subjects, Subject(f"BERT-{bert}", path=str(path), loss=loss_file.read_text())], []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: MLPs of 1 and 4 layers, BERT tiny, one repeat")
    parser.add_argument("--layers", help="comma-separated MLP depths (default 4,16,64,256)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of "
                        + ", ".join(MODES))
    parser.add_argument("--bert", choices=("base", "tiny", "none"),
                        help="the BERT model (default base; tiny with --quick)")
    parser.add_argument("--repeat", type=int, help="timed runs per cell (default 5; 1 --quick)")
    parser.add_argument("--cache", type=Path, help="folder that keeps the BERT export")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (needs matplotlib)")
    parser.add_argument("--worker", metavar="SPEC", help="internal: one cell, printed as JSON")
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure(Subject(**spec["subject"]), spec["mode"], spec["repeat"])))
        return 0
    from benchmarks.machine import cpu_seconds, machine_facts, report_run

    layers = ([int(n) for n in args.layers.split(",")] if args.layers
              else list(LAYERS_QUICK if args.quick else LAYERS))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {', '.join(sorted(set(modes) - set(MODES)))}")
    repeat = args.repeat or (1 if args.quick else 5)
    bert = args.bert or ("tiny" if args.quick else "base")
    check_targets(parser, [args.json, args.plot], is_benchmark_output)
    facts = machine_facts()
    print("lossgraph's compile cost: compile_program (Nesterov momentum, fuse modes) and "
          "gradient alone")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    with contextlib.ExitStack() as stack:
        cache = args.cache or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="lossgraph_compile_cost_")))
        cache.mkdir(parents=True, exist_ok=True)
        subjects, skipped = _subjects(layers, bert, cache)
        cells = {s.name: {mode: run_worker(s, mode, repeat) for mode in modes}
                 for s in subjects}
    verdicts = report(cells, modes, repeat)
    report_run(started, cpu_before, facts, skipped)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "repeat": repeat,
                   "width": WIDTH, "memory": "peak resident set of the first run less the "
                   "resident set before it (VmHWM - VmRSS), MiB", "cells": cells,
                   "verdicts": verdicts, "skipped": skipped}
        save_figures(figures, args.json, is_benchmark_output)
    if args.plot:
        plot(cells, modes, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
