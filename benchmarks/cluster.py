"""Data-parallel training on a local Ray cluster (lossgraph.ray) against the single-process
Trainer, and the per-step cost of the two all-reduces.

The problem is training_speed's MLP 100-50-1 (``problems.py``: N rows x 100 float32,
5,101 weights) with Nesterov SGD, at a global batch of 10,000 rows, on the separate graphs
every replica runs (``fuse="separate"``), without shuffling:

- ``single process``: ``lossgraph.Trainer`` on the same program, one epoch per ``fit``
  (``warm_start``), each timed, with onnxruntime's threads on every core, and with one
  thread (as each worker has when two share two cores);
- ``ray, W workers, <all-reduce>``: ``RayTrainer.fit`` on the arrays, each worker with
  ``cores / W`` CPUs and as many onnxruntime threads; rows per second of each epoch as
  the workers time it (steps and all-reduces, not checkpoints), and the whole fit's wall
  time, which adds Ray Train's start of the workers. ``all_reduce ms`` is the time a step
  spends in the all-reduce, waiting for the slower worker included.

A figure is the best epoch after the first (the first creates the sessions). Every Ray run
must end with the single-process weights (``max |w - w_single|``, float rounding).

The all-reduce alone: ``W`` plain Ray actors (each one CPU's share) time ``--steps``
all-reduces of a float32 array of each ``--sizes`` (the MLP's gradient and its three
counts: 5,104 floats), through a gloo group (needs torch) and through the reducer actor;
the median per call.

Run from the repository root (it starts its own local cluster, unless Ray is running):
      python -m benchmarks.cluster [--quick] [--rows 100000] [--json out.json]
See docs/cluster.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from benchmarks.machine import machine_facts
from benchmarks.output import check_targets, save_figures, written_by
from benchmarks.problems import LEARNING_RATE, MOMENTUM, make_data, mlp_problem

BENCHMARK_MARK = "lossgraph benchmarks/cluster.py"  # in every file the run writes
ROWS, BATCH, EPOCHS = 100_000, 10_000, 4
QUICK_ROWS, QUICK_BATCH, QUICK_EPOCHS = 1_000, 250, 2
SIZES = (5_104, 100_000, 1_000_000)  # floats all-reduced: the MLP's gradient + 3 counts
STEPS = 50
#: Ray's settings for the local cluster: no token authentication on a private cluster,
#: and Ray Train's controller polling every 0.2 s (a shorter wait at each fit's end)
RAY_ENVIRONMENT = {"RAY_AUTH_MODE": "disabled", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


@dataclass
class Config:
    """The run's sizes and what it runs."""

    rows: int = ROWS
    batch: int = BATCH
    epochs: int = EPOCHS
    runs: tuple[tuple[int, str], ...] = ((1, "auto"), (2, "gloo"), (2, "actor"))  # workers, kind
    sizes: tuple[int, ...] = SIZES
    steps: int = STEPS
    workers: int = 2  # of the all-reduce alone


QUICK = Config(QUICK_ROWS, QUICK_BATCH, QUICK_EPOCHS, ((2, "auto"),), (5_104,), 5)


@dataclass
class Training:
    """One way of training and its figures."""

    name: str
    workers: int  # 0: the single process
    all_reduce: str | None
    rows_per_second: float | None = None
    all_reduce_ms: float | None = None
    fit_s: float | None = None
    max_weight_gap: float | None = None  # against the single process
    epochs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def single_process(program: Any, X: np.ndarray, y: np.ndarray, config: Config,
                   threads: int | None = None) -> tuple:
    """The Trainer (onnxruntime's ``threads``, default: one per core), one timed epoch per
    fit; its figures and final state."""
    import lossgraph

    options = None if threads is None else {"intra_op_num_threads": threads}
    trainer = lossgraph.Trainer(program, session_options=options)
    row = Training(f"single process, {threads or os.cpu_count()} thread"
                   f"{'s' * ((threads or os.cpu_count() or 1) > 1)}", 0, None)
    start = time.perf_counter()
    for _ in range(config.epochs):
        began = time.perf_counter()
        trainer.fit(X, y, epochs=1, batch_size=config.batch, shuffle=False, warm_start=True,
                    progress=False)
        seconds = time.perf_counter() - began
        row.epochs.append({"seconds": seconds, "rows_per_second": len(y) / seconds})
    row.fit_s = time.perf_counter() - start
    row.rows_per_second = _best(row.epochs, "rows_per_second")
    return row, trainer.state


def on_ray(program: Any, X: np.ndarray, y: np.ndarray, config: Config, workers: int,
           all_reduce: str, single: dict[str, np.ndarray], storage: str) -> Training:
    """``RayTrainer.fit`` with ``workers`` workers sharing the cores."""
    from lossgraph.ray import RayTrainer

    cpus = (os.cpu_count() or 1) / workers
    trainer = RayTrainer(program, num_workers=workers, resources_per_worker={"CPU": cpus},
                         all_reduce=all_reduce, storage_path=storage,
                         checkpoint_every=config.epochs)
    kind = trainer.all_reduce if workers > 1 else None  # one worker sums with no one
    row = Training(f"ray, {workers} worker{'s' * (workers > 1)}, {kind or 'no all-reduce'}",
                   workers, kind)
    start = time.perf_counter()
    result = trainer.fit((X, y), epochs=config.epochs, batch_size=config.batch)
    row.fit_s = time.perf_counter() - start
    row.epochs = result.history
    row.rows_per_second = _best(result.history, "rows_per_second")
    row.all_reduce_ms = min(r["all_reduce_ms"] for r in result.history[1:] or result.history)
    row.max_weight_gap = max(float(np.abs(result.state[n] - single[n]).max()) for n in single)
    return row


def _best(epochs: list[dict[str, Any]], key: str) -> float:
    """The best figure of the epochs after the first (the first one alone if it is all)."""
    return max(record[key] for record in epochs[1:] or epochs)


def all_reduce_alone(config: Config) -> list[dict[str, Any]]:
    """The median time of one all-reduce, by kind and array size, on plain actors."""
    import ray

    from lossgraph.ray import actor_all_reduce, gloo_all_reduce, reducer

    @ray.remote
    class Member:
        def join(self, kind: str, peer: Any, size: int, rank: int) -> None:
            self.all_reduce = (gloo_all_reduce(peer, size, rank) if kind == "gloo" else
                               actor_all_reduce(peer, rank))

        def time(self, floats: int, steps: int) -> list[float]:
            values, times = np.ones(floats, np.float32), []
            for _ in range(steps + 3):  # three to warm up
                start = time.perf_counter()
                self.all_reduce(values.copy())
                times.append(time.perf_counter() - start)
            return times[3:]

    kinds = ["actor"] + (["gloo"] if importlib.util.find_spec("torch") else [])
    rows = []
    cpus = (os.cpu_count() or 1) / config.workers
    for kind in kinds:
        members = [Member.options(num_cpus=cpus).remote() for _ in range(config.workers)]
        peer = f"lossgraph-bench-{uuid.uuid4().hex}" if kind == "gloo" else reducer(
            config.workers)
        ray.get([m.join.remote(kind, peer, config.workers, r) for r, m in enumerate(members)])
        for floats in config.sizes:
            times = ray.get([m.time.remote(floats, config.steps) for m in members])
            rows.append({"all_reduce": kind, "workers": config.workers, "floats": floats,
                         "median_ms": 1e3 * statistics.median(t for ts in times for t in ts)})
        for actor in members + ([] if kind == "gloo" else [peer]):
            ray.kill(actor)
    return rows


def run(config: Config) -> dict[str, Any]:
    """Every training and the all-reduce alone; returns what the JSON holds."""
    import ray

    from lossgraph.optim import Momentum
    from lossgraph.parallel import ParallelProgram

    facts = machine_facts()
    facts["ray"] = ray.__version__
    X, y = make_data(config.rows)
    problem = mlp_problem(X, y)
    program = ParallelProgram.compile(
        problem.onnx_model, optimizer=Momentum(LEARNING_RATE, MOMENTUM, nesterov=True))
    print(f"MLP 100-50-1, {config.rows} rows, global batch {config.batch}, {config.epochs} "
          f"epochs, {os.cpu_count()} cores")
    single, state = single_process(program.program, X, y, config)
    trainings = [single, single_process(program.program, X, y, config, threads=1)[0]]
    started = not ray.is_initialized()
    if started:
        os.environ.update(RAY_ENVIRONMENT)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as storage:
            for workers, kind in config.runs:
                row = Training(f"ray, {workers} workers, {kind}", workers, kind)
                if kind == "gloo" and importlib.util.find_spec("torch") is None:
                    row.error = "skipped: the gloo all-reduce needs torch"
                    trainings.append(row)
                    continue
                try:
                    row = on_ray(program, X, y, config, workers, kind, state, storage)
                except Exception as error:  # a failed run is a row of the report
                    row.error = f"failed: {type(error).__name__}: {error}"
                trainings.append(row)
        alone = all_reduce_alone(config)
    finally:
        if started:
            ray.shutdown()
    report(trainings, alone)
    return {"generator": BENCHMARK_MARK, "config": asdict(config), "machine": facts,
            "trainings": [asdict(t) for t in trainings], "all_reduce": alone}


def report(trainings: list[Training], alone: list[dict[str, Any]]) -> None:
    single = trainings[0].rows_per_second
    print(f"\n{'training':<28} {'rows/s':>10} {'x single':>9} {'all-reduce ms':>14} "
          f"{'fit s':>7} {'max |w - w_single|':>19}")
    for t in trainings:
        if t.error:
            print(f"{t.name:<28} {t.error}")
            continue
        ratio = f"{t.rows_per_second / single:.2f}" if single and t.rows_per_second else "-"
        ms = "-" if t.all_reduce_ms is None else f"{t.all_reduce_ms:.2f}"
        gap = "-" if t.max_weight_gap is None else f"{t.max_weight_gap:.2g}"
        print(f"{t.name:<28} {t.rows_per_second:>10,.0f} {ratio:>9} {ms:>14} "
              f"{t.fit_s:>7.1f} {gap:>19}")
    print(f"\n{'all-reduce alone':<18} {'workers':>7} {'floats':>10} {'median ms':>10}")
    for row in alone:
        print(f"{row['all_reduce']:<18} {row['workers']:>7} {row['floats']:>10,} "
              f"{row['median_ms']:>10.2f}")


#: True for a file this benchmark wrote (its JSON carries BENCHMARK_MARK)
is_benchmark_output = written_by(BENCHMARK_MARK)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_ROWS} rows, one 2-worker run")
    parser.add_argument("--rows", type=int, default=None, help=f"rows (default {ROWS})")
    parser.add_argument("--sizes", default=None,
                        help="floats of the all-reduce alone, comma-separated "
                             f"(default {','.join(map(str, SIZES))})")
    parser.add_argument("--workers", type=int, default=2, help="actors of the all-reduce alone")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("ray") is None:
        print("cannot run: Ray is not installed (pip install 'lossgraph[ray]')", file=sys.stderr)
        return 1
    check_targets(parser, [args.json], is_benchmark_output)
    config = replace(QUICK if args.quick else Config(), workers=args.workers)
    if args.rows:
        config.rows = args.rows
    if args.sizes:
        config.sizes = tuple(int(size) for size in args.sizes.split(","))
    figures = run(config)
    if args.json:
        save_figures(figures, args.json, is_benchmark_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
