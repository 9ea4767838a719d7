"""What LoRA saves: lossgraph's adapters against its full fine-tuning and torch + PEFT (issue 29).

For BERT-base and GPT-2 small (benchmarks/memory.py's models: transformers' configs, random
weights, torch's legacy export at opset 17 with a free batch axis), four ways of training
with AdamW (learning rate 1e-4, epsilon 1e-6, weight decay 0.01), the same few steps of the
same batches:

    torch        torch eager, every parameter trained
    peft         torch eager + PEFT: ``get_peft_model(LoraConfig(r=8, lora_alpha=16,
                 target_modules=..., lora_dropout=0))`` (GPT-2: ``fan_in_fan_out``), only the
                 adapters trained
    full         lossgraph: ``compile_program(optimizer=AdamW(...))``, every weight trained
    lora         lossgraph: ``compile_program(adapters=LoRA(rank=8, alpha=16,
                 targets=...))``, only the adapters trained

and two columns that tell what bounds lossgraph LoRA's figures:

    floor        the heavy kernels alone (the products) of ``lora``'s step graph, fed one
                 batch's values (benchmarks/kernel_floor.py): no graph of those forms
                 steps faster
    phases       ``lora``'s peak taken apart, each phase in turn: compile, the step graph
                 specialized to the batch (the Trainer's first fit), its
                 session made, one step run

The targets are PEFT's defaults for these architectures: ``query`` and ``value`` (BERT),
``c_attn`` (GPT-2, the fused query-key-value projection). Each cell runs in a fresh process
(``--worker``), capped (``--memory-limit``), and is measured as benchmarks/memory.py
measures (its machinery: the warm-up, the baseline after imports, model and data, the peak
resident set ``VmHWM`` above it, the step time as the mean of all steps but the first), and
says the parameters it trains and its optimizer's state after the steps. lossgraph's cells
include compile in their peak, and record what the process holds once compiled and its
peak once the Trainer is made.

The issue's goals, checked on each model: lossgraph LoRA's peak at most half of lossgraph's
full fine-tuning's, and its step time at most torch + PEFT's.

``--quick`` runs tiny configs (seconds a cell; the test suite runs its parts). ``--fuse``
chooses lossgraph's fuse mode (default ``step``); ``--threads`` sets torch's and
onnxruntime's intra-op threads alike.

Run from the repository root:
      python -m benchmarks.lora [--quick] [--models bert,gpt2]
          [--columns torch,peft,full,lora,floor,phases]
          [--fuse step] [--memory-limit 12] [--threads N] [--json out.json]
See docs/benchmarks.md#lora-adapters.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

BENCHMARK_MARK = "lossgraph benchmarks/lora.py"  # in every file the run writes
RANK, ALPHA = 8, 16
#: PEFT's default target modules for each model (its ``TRANSFORMERS_MODELS_TO_LORA_...``).
TARGETS = {"bert": ("query", "value"), "gpt2": ("c_attn",)}
#: AdamW's hyper-parameters, the same in torch and lossgraph.
LEARNING_RATE, EPSILON, WEIGHT_DECAY = 1e-4, 1e-6, 0.01
COLUMNS = {"torch": "torch full fine-tuning", "peft": "torch + PEFT LoRA",
           "full": "lossgraph full fine-tuning", "lora": "lossgraph LoRA",
           "floor": "lossgraph LoRA's heavy kernels alone",
           "phases": "lossgraph LoRA's peak, phase by phase"}
#: The issue's goals: lossgraph LoRA's peak against its full fine-tuning's, its step
#: against torch + PEFT's.
PEAK_GOAL, STEP_GOAL = 0.5, 1.0


# -- the cells --------------------------------------------------------------------------
def _torch_adamw(torch: Any, parameters: Any) -> Any:
    return torch.optim.AdamW(parameters, lr=LEARNING_RATE, eps=EPSILON,
                             weight_decay=WEIGHT_DECAY)


def peft_adapted(name: str) -> Any:
    """The function that wraps a network of model ``name`` in PEFT's LoRA (only the
    adapters require a gradient)."""

    def adapt(network: Any) -> Any:
        import peft

        return peft.get_peft_model(network, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS[name]), lora_dropout=0.0,
            fan_in_fan_out=name == "gpt2"))  # GPT-2's Conv1D holds its weight [in, out]

    return adapt


def lora_options(name: str) -> dict[str, Any]:
    """compile_program's ``adapters=`` for model ``name`` (the targets PEFT's take)."""
    import lossgraph

    return {"adapters": lossgraph.LoRA(rank=RANK, alpha=ALPHA, targets=list(TARGETS[name]))}


def cell(column: str, name: str, quick: bool, folder: Path, fuse: str = "step",
         threads: int | None = None) -> dict[str, Any]:
    """One cell in this process: ``column`` of :data:`COLUMNS` on model ``name`` (its export
    in ``folder``)."""
    from benchmarks import memory

    subject = memory.SUBJECTS[name]
    if column in ("torch", "peft"):
        return memory.torch_cell(subject, quick, threads, optimizer=_torch_adamw,
                                 adapt=peft_adapted(name) if column == "peft" else None)
    if column in ("floor", "phases"):
        return (floor_cell if column == "floor" else phases_cell)(subject, quick, folder,
                                                                  threads)
    options = lora_options(name) if column == "lora" else {}
    return memory.lossgraph_cell(subject, quick, fuse, folder, threads, _adamw(), None,
                                 **options)


def _adamw() -> Any:
    from lossgraph.optim import AdamW

    return AdamW(LEARNING_RATE, epsilon=EPSILON, weight_decay=WEIGHT_DECAY)


def lora_program(subject: Any, model: Any) -> Any:
    """lossgraph LoRA's program of ``subject``'s export ``model``."""
    import lossgraph
    from benchmarks import memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lossgraph.compile_program(model, optimizer=_adamw(),
                                         **memory.compile_loss(subject),
                                         **lora_options(subject.name))


def one_step(program: Any, data: dict[str, np.ndarray], rows: int
             ) -> tuple[Any, dict[str, np.ndarray]]:
    """``program``'s ``train_step`` specialized to ``rows`` rows, as the Trainer runs it, and
    the feeds of its first step (benchmarks/kernel_floor.py's ``step_graph``)."""
    from benchmarks.kernel_floor import step_graph

    return step_graph(program, {"feature": data["X"][:rows], "label": data["y"][:rows]},
                      LEARNING_RATE)


def floor_cell(subject: Any, quick: bool, folder: Path, threads: int | None) -> dict[str, Any]:
    """The heavy kernels alone (benchmarks/kernel_floor.py: the products) of lossgraph
    LoRA's ``train_step`` graph, fed one batch's values, in one onnxruntime session with
    its inputs and outputs bound once: any graph doing this step in these forms takes at
    least this long. Timed as the cells' steps are (the first run apart)."""
    from benchmarks import memory
    from benchmarks.kernel_floor import heavy_kernel_floor
    from benchmarks.model_speed import BoundRuns
    from lossgraph.runtime.session import create_session

    model, data = memory.load_export(subject, folder)
    program = lora_program(subject, model)
    floor = heavy_kernel_floor(*one_step(program, data, subject.rows(quick)))
    runs = BoundRuns(create_session(floor.model, session_options=memory.session_options(
        threads)), floor.feeds, 1)
    times = []
    for _ in range(memory.STEPS):
        start = time.perf_counter()
        runs()
        times.append(time.perf_counter() - start)
    return {"step_ms": 1000 * statistics.mean(times[1:]), "kernels": floor.describe()}


def phases_cell(subject: Any, quick: bool, folder: Path, threads: int | None
                ) -> dict[str, Any]:
    """lossgraph LoRA's peak taken apart, phase by phase in this process: the program
    compiled; its ``train_step`` specialized to the batch (what the Trainer's first fit
    does), the program alive; its onnxruntime session made, then held
    once the graph is dropped; one step run (the program alive throughout, as a Trainer
    keeps it: the session reads its frozen weights). Each phase's resident set after it and its
    peak (started over from the resident set before it), above the baseline."""
    from benchmarks import memory
    from benchmarks.machine import process_memory_mb, reset_peak_memory
    from lossgraph.memory import release_free_memory
    from lossgraph.runtime.session import create_session

    options = memory.session_options(threads)
    memory.lossgraph_warm_up("step", options)
    model, data = memory.load_export(subject, folder)
    base, phases = memory.baseline(), []

    def phase(name: str) -> None:
        gc.collect()
        release_free_memory()
        phases.append({"phase": name, "rss_mb": process_memory_mb("VmRSS") - base,
                       "peak_mb": process_memory_mb("VmHWM") - base})
        reset_peak_memory()

    program = lora_program(subject, model)
    phase("compiled: the program")
    graph, feeds = one_step(program, data, subject.rows(quick))
    phase("train_step specialized to the batch, the program alive")
    # the program stays alive, as the Trainer keeps it: its frozen weights are the ones
    # the graph and the session read
    session = create_session(graph, session_options=options)
    phase("its session made")
    del graph
    phase("the session, the graph dropped")
    session.run(None, feeds)
    phase("one step run")
    return {"phases": phases, "peak_mb": max(p["peak_mb"] for p in phases)}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell in this fresh process (``spec``: task, subject, quick, folder, fuse,
    threads)."""
    return cell(spec["task"], spec["subject"], spec["quick"], Path(spec["folder"]),
                spec["fuse"], spec.get("threads"))


def run_worker(spec: dict[str, Any], limit_gib: float) -> dict[str, Any]:
    """:func:`worker` in a fresh interpreter, capped as benchmarks/memory.py's cells are."""
    from benchmarks.memory import run_worker as run_capped

    return run_capped(spec, limit_gib, "benchmarks.lora")


# -- the report -------------------------------------------------------------------------
def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2f}"


def _ratio(value: float | None, reference: float | None, against: str) -> str:
    return f" ({value / reference:.2f}x {against})" if value and reference else ""


def row_texts(row: dict[str, Any], column: str) -> list[str]:
    """The cells of one line: parameters trained, optimizer state, peak (against the same
    library's full fine-tuning), step (against torch + PEFT's); "-" for what a column does
    not measure (the floor: its step alone)."""
    record = row.get(column, {})
    if "step_ms" not in record:
        return [record.get("error", "-")] + ["-"] * 3
    texts = [f"{record['trained_parameters']:,}" if "trained_parameters" in record else "-",
             _number(record["optimizer_state_mb"]) if "optimizer_state_mb" in record else "-"]
    if "peak_mb" in record:
        full = row.get("torch" if column in ("torch", "peft") else "full", {})
        texts.append(_number(record["peak_mb"]) + (
            _ratio(record["peak_mb"], full.get("peak_mb"), "full")
            if column not in ("torch", "full") else ""))
    else:
        texts.append("-")
    step = _number(record["step_ms"])
    if column != "peft":
        step += _ratio(record["step_ms"], row.get("peft", {}).get("step_ms"), "PEFT")
    return [*texts, step]


def goals(cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two goals on each model that has the cells they compare."""
    verdicts = []
    for name, row in cells.items():
        lora = row.get("lora", {})
        for figure, reference, goal, what in (
                ("peak_mb", "full", PEAK_GOAL, "peak memory against lossgraph full fine-tuning"),
                ("step_ms", "peft", STEP_GOAL, "step time against torch + PEFT")):
            ours, theirs = lora.get(figure), row.get(reference, {}).get(figure)
            if ours is None or not theirs:
                continue
            ratio = ours / theirs
            verdicts.append({"model": name, "goal": what, "ratio": ratio, "target": goal,
                             "verdict": "PASS" if ratio <= goal else "MISS"})
    return verdicts


def report(cells: dict[str, dict[str, Any]], columns: list[str]) -> list[dict[str, Any]]:
    """The table, what bounds lossgraph LoRA's peak, and the goals' verdicts (returned)."""
    print("\nAdamW steps; peak resident memory above the baseline (MiB; ratio to the same "
          "library's full fine-tuning), step time (ms; ratio to torch + PEFT's)")
    print("| model (weights) | run | trained parameters | optimizer state (MiB) "
          "| peak (MiB) | step (ms) |")
    print("|---|---|---|---|---|---|")
    for name, row in cells.items():
        for column in columns:
            if column != "phases":
                print(f"| {name} ({_number(row['weights_mb'])} MiB) | {COLUMNS[column]} | "
                      + " | ".join(row_texts(row, column)) + " |")
    print("\nlossgraph's peaks on the way (MiB above the baseline): compile's, what the "
          "program holds once compiled, once the Trainer is made, after each step")
    for name, row in cells.items():
        print(f"  {name} (its export stores {_number(row['stored_mb'])} MiB):")
        for column in ("full", "lora"):
            record = row.get(column, {})
            if "trainer_peak_mb" in record:
                print(f"    {COLUMNS[column]}: compile {_number(record['compile_peak_mb'])}, "
                      f"held {_number(record['compiled_mb'])}, Trainer "
                      f"{_number(record['trainer_peak_mb'])}, steps "
                      + " -> ".join(_number(v) for v in record["steps_mb"]))
        if "kernels" in row.get("floor", {}):
            print(f"    {COLUMNS['floor']}: {row['floor']['kernels']}")
        for phase in row.get("phases", {}).get("phases", []):
            print(f"    LoRA, {phase['phase']}: resident {_number(phase['rss_mb'])}, "
                  f"peak {_number(phase['peak_mb'])}")
        if "error" in row.get("phases", {}):
            print(f"    {COLUMNS['phases']}: {row['phases']['error']}")
    verdicts = goals(cells)
    if verdicts:
        print("\ngoals (issue 29):")
    for verdict in verdicts:
        print(f"  {verdict['model']}: lossgraph LoRA's {verdict['goal']}: "
              f"{verdict['ratio']:.2f}x (goal <= {verdict['target']}x): {verdict['verdict']}")
    return verdicts


# -- the command line -------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from benchmarks import memory

    parser = memory.cells_parser(__doc__.split("\n\n")[0], list(TARGETS), list(COLUMNS))
    parser.add_argument("--fuse", default="step", choices=("step", "epoch", "separate"),
                        help="lossgraph's fuse mode (default step)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from benchmarks.machine import cpu_seconds, machine_facts, report_run
    from benchmarks.output import check_targets, save_figures, written_by

    models, columns = memory.chosen_cells(parser, args, list(TARGETS), list(COLUMNS))
    check_targets(parser, [args.json], written_by(BENCHMARK_MARK))
    facts = machine_facts()
    print(f"LoRA (rank {RANK}, alpha {ALPHA}) against full fine-tuning, lossgraph "
          f'(fuse="{args.fuse}") and torch + PEFT: {memory.STEPS} AdamW steps, float32')
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    cells, skipped = memory.run_cells(
        models, columns, {"quick": args.quick, "fuse": args.fuse, "threads": args.threads,
                          "checkout": None}, args.memory_limit, run_worker,
        lambda row, column: ", ".join(row_texts(row, column)))
    verdicts = report(cells, columns)
    report_run(started, cpu_before, facts, skipped)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "quick": args.quick,
                   "steps": memory.STEPS, "threads": args.threads, "fuse": args.fuse,
                   "rank": RANK, "alpha": ALPHA, "targets": TARGETS, "optimizer": {
                       "name": "AdamW", "learning_rate": LEARNING_RATE, "epsilon": EPSILON,
                       "weight_decay": WEIGHT_DECAY},
                   "memory": "peak resident set (VmHWM) above the baseline taken after "
                   "imports, model and data (VmRSS), MiB", "cells": cells, "goals": verdicts,
                   "skipped": skipped}
        save_figures(figures, args.json, written_by(BENCHMARK_MARK))
    return 0


if __name__ == "__main__":
    sys.exit(main())
