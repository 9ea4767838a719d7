"""The timing harness: every implementation of one problem, set up, checked and timed.

Per batch size: each implementation is set up and trains one warm-up epoch (its weights
are then checked against numpy's), then ``repeat`` rounds each time one epoch of every
implementation in turn, so that a burst of load from another process falls on all of
them rather than on one. A cell is the median of its rounds; setup is excluded.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.bounds import (
    hand_graph_bound,
    numpy_products,
    onnxruntime_products,
    torch_products,
)
from benchmarks.lossgraph_modes import Compiled, compile_modes, lossgraph_trainer
from benchmarks.peers import TORCH_THREADS, numpy_peer, ort_on_device_peer, sklearn_peer, torch_peer
from benchmarks.problems import Epoch, Implementation, Problem, Unavailable, Weights

SETTLE_S = 0.15

Factory = Callable[[Problem, int], Implementation]


@dataclass
class Row:
    """One implementation's figures for one model."""

    name: str
    kind: str  # "peer", "lossgraph", "bound" or "floor" (the last two never the fastest peer)
    note: str = ""
    ms: dict[int, float | None] = field(default_factory=dict)  # batch -> median ms/epoch
    samples: dict[int, list[float]] = field(default_factory=dict)
    setup_ms: dict[int, float] = field(default_factory=dict)
    warm_up_ms: dict[int, float] = field(default_factory=dict)  # first epoch, lazy setup included
    errors: dict[int, str] = field(default_factory=dict)
    check: dict[int, float | None] = field(default_factory=dict)  # max |w - w_numpy|


@dataclass
class ModelRun:
    """Every implementation's figures for one problem, and lossgraph's compiled modes."""

    problem: Problem
    rows: list[Row]
    compiled: list[Compiled]


def line_up(problem: Problem, compiled: list[Compiled],
            workdir: Path) -> list[tuple[Row, Factory]]:
    """The rows of one problem's table, in order, each with the factory of its implementation.

    numpy comes first: the others' weights are checked against its weights. The fastest
    of the "floor" rows at a batch size is that cell's floor (report.py).
    """
    sk_note = ("SGDRegressor: per-sample updates, no minibatch, no momentum"
               if problem.name == "linear" else "MLPRegressor.partial_fit; loss is MSE/2")
    products = "not a peer, not a training: only the step's matrix products"
    rows: list[tuple[Row, Factory]] = [
        (Row("numpy", "peer", "hand-written Nesterov SGD"), numpy_peer),
        (Row("scikit-learn", "peer", sk_note), sklearn_peer),
        (Row("torch eager", "peer", f"{TORCH_THREADS} threads"), torch_peer),
        (Row("ORT on-device", "peer", "plain SGD (no momentum): its API has SGD/AdamW only"),
         partial(ort_on_device_peer, workdir=workdir)),
        (Row("hand-written graph", "bound", "not a peer: the same epoch as one hand-minimized "
             "graph of standard ops in onnxruntime, the bound for lossgraph's graphs"),
         hand_graph_bound),
        (Row("matrix products (numpy)", "floor", f"{products}, np.matmul(out=) step by step"),
         numpy_products),
        (Row("matrix products (torch)", "floor", f"{products}, torch.mm(out=) step by step, "
             f"{TORCH_THREADS} threads"), torch_products),
        (Row("matrix products (onnxruntime)", "floor", f"{products}, a Scan over the batches: "
             "the floor for any onnxruntime graph"), onnxruntime_products)]
    rows += [(Row(f"lossgraph fuse={c.mode}", "lossgraph"), partial(lossgraph_trainer, c))
             for c in compiled]
    return rows


def record_failure(row: Row, batch: int, error: Exception) -> None:
    """The row's cell becomes n/a, with the reason (the traceback with BENCH_DEBUG set)."""
    row.ms[batch] = None
    if isinstance(error, Unavailable):
        row.errors[batch] = str(error)
        return
    row.errors[batch] = f"{type(error).__name__}: {error!s:.200}"
    if os.environ.get("BENCH_DEBUG"):
        traceback.print_exc()


def warm_up(row: Row, factory: Callable[[], Implementation], batch: int,
            reference: Weights | None) -> tuple[Epoch | None, Weights | None]:
    """Sets one implementation up and trains its warm-up epoch (the one the check reads).

    Returns its epoch function (None if it cannot run) and its weights after that epoch.
    """
    try:
        start = time.perf_counter()
        epoch, weights = factory()
        row.setup_ms[batch] = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        epoch()
        row.warm_up_ms[batch] = (time.perf_counter() - start) * 1000
        after_warm_up = weights()
    except Exception as error:  # one implementation must not end the run
        record_failure(row, batch, error)
        return None, None
    if after_warm_up is not None and reference is not None:
        row.check[batch] = max(float(np.abs(a - b).max()) for a, b in
                               zip(after_warm_up, reference))
    return epoch, after_warm_up


def settle(epoch: Epoch) -> None:
    """Untimed epochs of one implementation for at least SETTLE_S seconds (one at least).

    Thread pools keep spinning after a call, and would take the cores of whichever
    implementation runs next: OpenBLAS's for up to 2**28 cycles (about 0.1 s), torch's
    OpenMP and onnxruntime's for less. One untimed epoch is not enough when epochs take
    a few milliseconds: such epochs then varied 5x within a run.
    """
    start = time.perf_counter()
    epoch()
    while time.perf_counter() - start < SETTLE_S:
        epoch()


def run_model(problem: Problem, batches: list[int], repeat: int, workdir: Path) -> ModelRun:
    """Per batch size: set up and warm up every implementation, then time `repeat` rounds.

    Each round times one epoch of every implementation in turn. Each timed epoch
    follows untimed epochs of the same implementation (see :func:`settle`).
    """
    compiled = compile_modes(problem)
    lined_up = line_up(problem, compiled, workdir)
    rows = [row for row, _ in lined_up]
    for batch in batches:
        epochs: dict[str, Epoch] = {}
        reference = None
        for row, factory in lined_up:
            epoch, after = warm_up(row, partial(factory, problem, batch), batch, reference)
            if epoch is not None:
                epochs[row.name] = epoch
            if row.name == "numpy":
                reference = after
        samples: dict[str, list[float]] = {name: [] for name in epochs}
        for _ in range(repeat):
            for row in rows:
                if row.name not in epochs:
                    continue
                try:
                    settle(epochs[row.name])
                    start = time.perf_counter()
                    epochs[row.name]()
                    samples[row.name].append((time.perf_counter() - start) * 1000)
                except Exception as error:  # one implementation must not end the run
                    record_failure(row, batch, error)
                    del epochs[row.name]
        for row in rows:
            if row.name in epochs:
                row.samples[batch] = samples[row.name]
                row.ms[batch] = statistics.median(samples[row.name])
    return ModelRun(problem, rows, compiled)
