"""What do gradient clipping and an EMA of the weights cost a training step?

``compile_program(max_grad_norm=1.0)`` clips the gradients by their global norm before the
update and ``ema_decay=0.999`` keeps an average of every weight after it
(:mod:`lossgraph.update_options`): one sum of squares per weight (one in all, packed) and
a multiply per weight; a subtraction, two multiplies and an add per weight. This benchmark
times one epoch of ``--steps`` minibatch steps (momentum SGD, learning rate 0.01, mean
squared error) with neither, each and both, side by side, in every fuse mode, and torch
eager doing the same (``clip_grad_norm_`` after ``backward``, ``AveragedModel`` with
``get_ema_multi_avg_fn`` updated after ``step``):

    mlp          Linear(100, 50), ReLU, Linear(50, 1): batch 100 (the design's MLP)
    transformer  benchmarks.model_speed's encoder: 2 layers, d_model 128, 4 heads,
                 feed-forward 512, sequence 64, batch 32

Every candidate runs in this one process on the same data, from the same weights, with
the same threads (``--threads``). Each first trains one warm-up epoch, then ``--repeat``
rounds each time one epoch of every variant of a runtime in turn (so that a burst of load
from another process falls on all of them). A cell is the median of its rounds, in ms per
step, with its cost over the plain step. After the timed rounds each lossgraph variant's
weights (and averages) are checked against torch's after the same steps: ``check`` is the
largest difference, beside how far torch's weights moved.

Run from the repository root:
      python -m benchmarks.update_options [--quick] [--workloads mlp,transformer]
          [--fuses step,epoch,separate] [--steps 20] [--repeat 7] [--threads 2]
          [--clock wall|cpu] [--json out.json]
See docs/benchmarks.md#clipping-and-the-average-of-the-weights.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

BENCHMARK_MARK = "lossgraph benchmarks/update_options.py"  # in every file the run writes
WORKLOADS = ("mlp", "transformer")
FUSES = ("step", "epoch", "separate")
#: the variants: (max_grad_norm, ema_decay)
VARIANTS = {"plain": (None, None), "clip": (1.0, None), "ema": (None, 0.999),
            "both": (1.0, 0.999)}
RATE, MOMENTUM = 0.01, 0.9
SETTLE_S = 0.1

Epoch = Callable[[], Any]


def _mlp(torch, features: int, hidden: int, batch: int):
    nn = torch.nn
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def make_problem(name: str, steps: int, quick: bool):
    """The workload's torch network, its export and ``steps`` batches of data
    (:func:`benchmarks.model_speed.make_problem`; the MLP built alike)."""
    from benchmarks import model_speed

    if name == "transformer":
        return model_speed.make_problem(model_speed.WORKLOADS["transformer"], steps, quick)
    sizes = dict(features=6, hidden=4, batch=5) if quick else dict(features=100, hidden=50,
                                                                   batch=100)
    workload = model_speed.Workload("mlp", _mlp, lambda features, **_: (features,),
                                    lambda **_: 1, sizes, sizes)
    return model_speed.make_problem(workload, steps, quick)


# -- the candidates ----------------------------------------------------------------------
def torch_candidate(problem: Any, variant: str) -> tuple[Epoch, Callable[[], dict]]:
    """One epoch of torch eager with ``variant``'s clipping and average, and its weights
    (``<name>`` and ``<name>_ema``) by the export's names."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    max_norm, decay = VARIANTS[variant]
    net = copy.deepcopy(problem.net)
    average = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(decay)) if decay else None
    optimizer = torch.optim.SGD(net.parameters(), lr=RATE, momentum=MOMENTUM)
    X, y, batch = torch.from_numpy(problem.X), torch.from_numpy(problem.y), problem.batch

    def epoch() -> None:
        for start in range(0, len(X), batch):
            optimizer.zero_grad()
            loss = ((net(X[start:start + batch]) - y[start:start + batch]) ** 2).mean()
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
            optimizer.step()
            if average is not None:
                average.update_parameters(net)

    def weights() -> dict[str, np.ndarray]:
        found = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
        if average is not None:
            found.update({f"{n}_ema": p.detach().numpy().copy()
                          for n, p in average.module.named_parameters()})
        return found

    return epoch, weights


def compiled(problem: Any, fuse: str, variant: str) -> Any:
    """The export compiled with ``variant``'s options in ``fuse`` mode."""
    import lossgraph
    from lossgraph.optim import Momentum

    max_norm, decay = VARIANTS[variant]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lossgraph.compile_program(problem.model, loss="squared_error",
                                         optimizer=Momentum(RATE, momentum=MOMENTUM),
                                         fuse=fuse, max_grad_norm=max_norm, ema_decay=decay)


def lossgraph_candidate(problem: Any, program: Any, threads: int, batch_size: int | None = None,
                        accumulation_steps: int | None = None
                        ) -> tuple[Epoch, Callable[[], dict]]:
    """One epoch of ``Trainer.fit`` of ``program`` (from a benchmark's ``compiled``) on a
    fresh trainer, in batches of ``batch_size`` rows (default ``problem.batch``), and its
    state by name (weights, and averages where it keeps them); this benchmark's and
    ``training_options``'."""
    import lossgraph

    trainer = lossgraph.Trainer(program,
                                session_options={"intra_op_num_threads": threads})
    started = [False]

    def epoch() -> None:
        trainer.fit(problem.X, problem.y, batch_size=batch_size or problem.batch,
                    accumulation_steps=accumulation_steps, shuffle=False, progress=False,
                    warm_start=started[0])
        started[0] = True

    def weights() -> dict[str, np.ndarray]:
        return trainer.state

    return epoch, weights


def _settle(epoch: Epoch) -> None:
    """Untimed epochs of ``epoch`` for SETTLE_S, so that the cores are its own."""
    end = time.perf_counter() + SETTLE_S
    while time.perf_counter() < end:
        epoch()


def time_rounds(candidates: dict[str, Epoch], repeat: int, steps: int,
                clock: Callable[[], float]) -> dict[str, float]:
    """Median ms per step of each candidate, over ``repeat`` interleaved rounds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeat):
        for name, epoch in candidates.items():
            _settle(epoch)
            start = clock()
            epoch()
            times[name].append((clock() - start) * 1000 / steps)
    return {name: statistics.median(found) for name, found in times.items()}


def difference(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    """The largest absolute difference between the weights (and averages) both hold."""
    return max((float(np.max(np.abs(ours[n].reshape(value.shape) - value)))
                for n, value in theirs.items() if n in ours), default=float("nan"))


# -- the run ----------------------------------------------------------------------------
def run_workload(name: str, fuses: list[str], steps: int, repeat: int, threads: int,
                 quick: bool, clock: Callable[[], float]) -> dict[str, Any]:
    """Every runtime's four variants: ms per step, and each lossgraph variant's check
    against torch after the same epochs."""
    import torch

    torch.set_num_threads(threads)
    problem = make_problem(name, steps, quick)
    return run_variants(
        name, problem, fuses, list(VARIANTS), "ms_per_step",
        compile_variant=lambda fuse, v: compiled(problem, fuse, v),
        torch_variant=lambda v: torch_candidate(problem, v),
        lossgraph_variant=lambda program, v: lossgraph_candidate(problem, program, threads),
        repeat=repeat, steps=steps, clock=clock)


def run_variants(name: str, problem: Any, fuses: list[str], variants: list[str], key: str, *,
                 compile_variant: Callable[[str, str], Any],
                 torch_variant: Callable[[str], tuple[Epoch, Callable[[], dict]]],
                 lossgraph_variant: Callable[[Any, str], tuple[Epoch, Callable[[], dict]]],
                 repeat: int, steps: int, clock: Callable[[], float]) -> dict[str, Any]:
    """The cells of a benchmark of training variants (this one and ``training_options``):
    each runtime's (torch eager, each fuse mode) median ms per step of every variant under
    ``key``, then each lossgraph variant's largest difference from torch after two epochs
    from the start (``check``), and how far torch's weights moved (``moved``)."""
    programs = {(fuse, v): compile_variant(fuse, v) for fuse in fuses for v in variants}
    runtimes = {"torch": {v: torch_variant(v) for v in variants}}
    for fuse in fuses:
        runtimes[f"lossgraph {fuse}"] = {v: lossgraph_variant(programs[fuse, v], v)
                                         for v in variants}
    cells: dict[str, Any] = {}
    for runtime, candidates in runtimes.items():
        for epoch, _ in candidates.values():
            epoch()  # warm-up: sessions, caches
        cells[runtime] = {key: time_rounds({v: e for v, (e, _) in candidates.items()},
                                           repeat, steps, clock)}
        print(f"  {name} {runtime}: done", flush=True)
    start = {n: p.detach().numpy() for n, p in problem.net.named_parameters()}
    moved = {}
    for variant in variants:
        reference_epoch, reference = torch_variant(variant)
        for _ in range(2):
            reference_epoch()
        expected = reference()
        moved[variant] = difference(expected, start)
        for fuse in fuses:
            epoch, weights = lossgraph_variant(programs[fuse, variant], variant)
            for _ in range(2):
                epoch()
            cells[f"lossgraph {fuse}"].setdefault("check", {})[variant] = difference(
                weights(), expected)
    cells["torch"]["moved"] = moved
    return cells


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table: each workload and runtime, its variants side by side with their cost."""
    return variants_table(results, ["clip", "ema", "both"], "ms_per_step", "step",
                          check=lambda cell: cell["check"]["both"],
                          moved=lambda cell: cell["moved"]["both"], checked="both")


def variants_table(results: dict[str, dict[str, Any]], variants: list[str], key: str,
                   unit: str, check: Callable[[dict], float], moved: Callable[[dict], float],
                   checked: str = "") -> list[str]:
    """A table of ``results`` (workload -> runtime -> cell): the plain step's median ms
    per ``unit`` (``cell[key]``) and each of ``variants`` with its cost over it, and the
    largest difference from torch (torch's row: how far its weights moved)."""
    lines = ["| workload | runtime | plain | " + " | ".join(variants)
             + f" | check (largest difference from torch{', ' + checked if checked else ''}) |",
             "|---|---|---|" + "---|" * len(variants) + "---|"]
    for workload, cells in results.items():
        for runtime, cell in cells.items():
            ms = cell[key]
            parts = [f"{ms['plain']:.3f}"] + [
                f"{ms[v]:.3f} ({(ms[v] / ms['plain'] - 1) * 100:+.0f}%)" for v in variants]
            shown = (f"{check(cell):.1e}" if "check" in cell else
                     f"(weights moved {moved(cell):.1e})")
            lines.append(f"| {workload} | {runtime} | {' | '.join(parts)} | {shown} |")
    lines.append(f"(median ms per {unit}; in brackets, the cost over the plain step)")
    return lines


def main(argv: list[str] | None = None) -> int:
    return variants_main(
        argv, doc=__doc__, mark=BENCHMARK_MARK, run_workload=run_workload, report=report,
        variants=VARIANTS, headline="the cost of gradient clipping (max_grad_norm=1.0) and an "
        "EMA of the weights (ema_decay=0.999) per training step")


def variants_main(argv: list[str] | None, *, doc: str, mark: str, headline: str,
                  run_workload: Callable[..., dict[str, Any]],
                  report: Callable[[dict[str, dict[str, Any]]], list[str]], variants: Any,
                  steps_help: str = "steps an epoch (default 20)",
                  check: Callable[[argparse.ArgumentParser, argparse.Namespace], None]
                  | None = None) -> int:
    """The command line of a benchmark of training variants side by side (this one and
    ``training_options``): every workload in every fuse mode and torch eager, the table,
    and the figures as JSON (``variants`` recorded as given)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny models")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--fuses", default=",".join(FUSES),
                        help="comma-separated, of " + ", ".join(FUSES))
    parser.add_argument("--steps", type=int, default=20, help=steps_help)
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--threads", type=int, default=2, help="threads (default 2)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time the wall clock, or this process's CPU seconds (with "
                             "--threads 1: each candidate's work, steadier on a busy machine)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if check is not None:
        check(parser, args)
    from benchmarks.machine import cpu_seconds, machine_facts, report_run
    from benchmarks.output import check_targets, save_figures, written_by

    check_targets(parser, [args.json], written_by(mark))
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skipped: the benchmark compares with torch eager (pip install torch)")
        return 0
    facts = machine_facts()
    print(headline)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    fuses = args.fuses.split(",")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    results = {name: run_workload(name, fuses, args.steps, args.repeat, args.threads,
                                  args.quick, clock)
               for name in args.workloads.split(",")}
    print()
    print("\n".join(report(results)))
    report_run(started, cpu_before, facts)
    if args.json:
        figures = {"generator": mark, "machine": facts, "steps": args.steps,
                   "repeat": args.repeat, "threads": args.threads, "clock": args.clock,
                   "variants": variants, "results": results}
        save_figures(figures, args.json, written_by(mark))
    return 0


if __name__ == "__main__":
    sys.exit(main())
