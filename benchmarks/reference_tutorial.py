"""The reference documents' own benchmark: scikit-learn's MLPRegressor against lossgraph's
two reference APIs, 100 epochs of minibatch SGD, plain and with Nesterov momentum.

The reference documents (onnxcustom's tutorial "Benchmark, comparison scikit-learn -
forward-backward") train ``MLPRegressor(hidden_layer_sizes=(50, 10))`` on 750 rows of
100 features, batch 15, 100 epochs; they reported scikit-learn 1.98 s against their
forward/backward optimizer's 1.88 s, and 2.26 s with Nesterov momentum. This script
times, in one process, on the same data (750 x 100 float32, fixed seed), from the same
initial weights and with the same learning rate and momentum:

    scikit-learn     MLPRegressor(solver="sgd", batch_size=15, max_iter=100, ...).fit
    whole graph      lossgraph.OrtGradientOptimizer on add_loss_output(model,
                     score_name="half_squared_error") (one onnxruntime run per epoch)
    forward/backward lossgraph.OrtGradientForwardBackwardOptimizer on the inference
                     model, learning_loss=SquareLearningLoss() (the separate graphs:
                     forward, loss and backward in one run, then the update)
    floors           never candidates: each step's matrix products alone, in
                     onnxruntime (benchmarks/bounds.py) and in numpy

each with plain SGD (``LearningRateSGD``; scikit-learn ``momentum=0``) and Nesterov
momentum 0.9 (``LearningRateSGDNesterov``). lossgraph's first fit, of one epoch, compiles
the program and creates the sessions ("setup", reported apart); each candidate is then
fitted once untimed, and ``--repeat`` rounds each time one whole fit of every candidate
in turn, each after
``SETTLE_S`` of sleep; a figure is the best of its rounds, in seconds per 100 epochs,
and its ratio to scikit-learn with the same optimizer (target: at most 0.5x). Every fit
restarts from the initial weights (``warm_start=False``), so each candidate's final loss
(the last epoch's mean minibatch loss, and the loss of its final weights on all rows,
computed by the same numpy code for all) shows that speed is not bought with less work.

Run from the repository root:
      python -m benchmarks.reference_tutorial [--quick] [--repeat 5] [--json out.json]
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from benchmarks.bounds import numpy_products, onnxruntime_products
from benchmarks.harness import SETTLE_S
from benchmarks.machine import cpu_seconds, machine_facts, report_run
from benchmarks.output import check_targets, save_figures, written_by
from benchmarks.problems import (
    N_FEATURES,
    Epoch,
    Problem,
    Unavailable,
    Weights,
    make_data,
)

BENCHMARK_MARK = "lossgraph benchmarks/reference_tutorial.py"  # in every file the run writes
HIDDEN_LAYERS = (50, 10)
ROWS, BATCH, EPOCHS = 750, 15, 100
QUICK_ROWS, QUICK_EPOCHS = 150, 3
LEARNING_RATE, MOMENTUM, SEED = 1e-3, 0.9, 0
TARGET = 0.5  # each lossgraph API's time over scikit-learn's, same optimizer
OPTIMIZERS = ("sgd", "nesterov")
WHOLE = "OrtGradientOptimizer (whole graph)"
FORWARD_BACKWARD = "OrtGradientForwardBackwardOptimizer (forward/backward)"
SKLEARN = "scikit-learn MLPRegressor"
LOSS_TOLERANCE = 1.5  # a final loss above this factor of scikit-learn's is flagged


@dataclass
class Config:
    """The run's sizes."""

    rows: int = ROWS
    epochs: int = EPOCHS
    batch: int = BATCH
    repeat: int = 5


@dataclass
class Candidate:
    """One timed fit (or floor) and its figures."""

    name: str
    optimizer: str | None  # "sgd", "nesterov"; None for a floor (no update at all)
    kind: str  # "peer", "lossgraph" or "floor"
    note: str = ""
    fit: Callable[[], None] | None = None
    weights: Callable[[], Weights | None] = lambda: None  # after the last fit
    train_loss: Callable[[], float | None] = lambda: None  # the last epoch's mean loss
    prepare: Callable[[], None] | None = None  # lossgraph: compile and one epoch
    prepare_s: float | None = None
    first_fit_s: float | None = None
    samples_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def best_s(self) -> float | None:
        """The best timed fit, in seconds (None when it could not run)."""
        return min(self.samples_s) if self.samples_s and self.error is None else None

    def setup_s(self, epochs: int) -> float | None:
        """lossgraph's setup: its first fit, of one epoch (compile_program, the Trainer,
        the sessions), less one epoch of its best fit of ``epochs`` epochs."""
        if self.prepare_s is None or self.best_s is None:
            return None
        return max(0.0, self.prepare_s - self.best_s / epochs)


@dataclass
class Setting:
    """What every candidate shares: data, the initial model and the run's sizes."""

    X: np.ndarray  # (rows, 100) float32
    y: np.ndarray  # (rows, 1) float32
    model: onnx.ModelProto  # the inference model, scikit-learn's initial weights
    weight_names: list[str]  # its weights, in the order [W0, b0, W1, b1, W2, b2]
    initial: Weights
    config: Config


# -- the candidates -------------------------------------------------------------------------
def sklearn_estimator(optimizer: str, config: Config, learning_rate: float = LEARNING_RATE,
                      max_iter: int | None = None) -> Any:
    """scikit-learn's MLPRegressor with this run's SGD (``optimizer``: sgd or nesterov)."""
    from sklearn.neural_network import MLPRegressor

    epochs = config.epochs if max_iter is None else max_iter
    nesterov = optimizer == "nesterov"
    return MLPRegressor(hidden_layer_sizes=HIDDEN_LAYERS, activation="relu", solver="sgd",
                        batch_size=config.batch, max_iter=epochs,
                        learning_rate="constant", learning_rate_init=learning_rate,
                        momentum=MOMENTUM if nesterov else 0.0, nesterovs_momentum=nesterov,
                        alpha=0.0, tol=0.0, n_iter_no_change=epochs + 1, shuffle=True,
                        early_stopping=False, random_state=SEED)


def _quietly(call: Callable[[], Any]) -> Any:
    """Runs ``call`` without scikit-learn's ConvergenceWarning (max_iter is the point)."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return call()


def make_setting(config: Config) -> Setting:
    """The data and the inference model holding scikit-learn's initial weights.

    scikit-learn draws its initial weights from ``random_state`` at every fit; one epoch
    at a learning rate of 1e-30 leaves them unchanged in float32, and skl2onnx converts
    them: every candidate starts where scikit-learn does.
    """
    try:
        from skl2onnx import to_onnx
    except ImportError as error:
        raise Unavailable("this benchmark needs scikit-learn and skl2onnx") from error
    X, y = make_data(config.rows)
    start = sklearn_estimator("sgd", config, learning_rate=1e-30, max_iter=1)
    _quietly(lambda: start.fit(X, y.ravel()))
    initial = [np.asarray(a, np.float32) for pair in zip(start.coefs_, start.intercepts_)
               for a in pair]
    model = to_onnx(start, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    suffixes = [str(j or "") for j in range(len(initial) // 2)]  # skl2onnx's names
    names = [f"{kind}{suffix}" for suffix in suffixes for kind in ("coefficient", "intercepts")]
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    if not floats >= set(names):
        raise Unavailable(f"skl2onnx named the weights {sorted(floats)}, not {names}")
    return Setting(X, y, model, names, initial, config)


def sklearn_candidate(setting: Setting, optimizer: str) -> Candidate:
    """scikit-learn's fit, restarting from its initial weights each time."""
    estimator = sklearn_estimator(optimizer, setting.config)
    X, y = setting.X, setting.y.ravel()

    def weights() -> Weights:
        return [np.asarray(a) for pair in zip(estimator.coefs_, estimator.intercepts_)
                for a in pair]

    return Candidate(SKLEARN, optimizer, "peer",
                     "momentum=0, nesterovs_momentum=False" if optimizer == "sgd" else
                     f"momentum={MOMENTUM}, nesterovs_momentum=True",
                     lambda: _quietly(lambda: estimator.fit(X, y)), weights,
                     lambda: float(estimator.loss_curve_[-1]))


def lossgraph_candidate(setting: Setting, api: str, optimizer: str) -> Candidate:
    """One of lossgraph's reference APIs; its first fit compiles, the others reuse that."""
    import lossgraph

    if optimizer == "sgd":
        rate = lossgraph.LearningRateSGD(eta0=LEARNING_RATE, learning_rate="constant")
    else:
        rate = lossgraph.LearningRateSGDNesterov(eta0=LEARNING_RATE, learning_rate="constant",
                                                 momentum=MOMENTUM, nesterov=True)
    common = {"max_iter": setting.config.epochs, "batch_size": setting.config.batch,
              "learning_rate": rate, "warm_start": False, "random_state": SEED}
    if api == WHOLE:
        model = lossgraph.add_loss_output(setting.model, score_name="half_squared_error")
        estimator = lossgraph.OrtGradientOptimizer(model, setting.weight_names, **common)
        note = "add_loss_output(score_name='half_squared_error'), compiled fuse='epoch'"
    else:
        estimator = lossgraph.OrtGradientForwardBackwardOptimizer(
            setting.model, setting.weight_names, learning_loss=lossgraph.SquareLearningLoss(),
            **common)
        note = "learning_loss=SquareLearningLoss(), compiled fuse='separate'"
    X, y = setting.X, setting.y

    def weights() -> Weights:
        state = estimator.get_state()
        return [np.asarray(state[name]) for name in setting.weight_names]

    def prepare() -> None:  # max_iter does not recompile: later fits reuse the sessions
        estimator.set_params(max_iter=1)
        try:
            estimator.fit(X, y)
        finally:
            estimator.set_params(max_iter=setting.config.epochs)

    return Candidate(api, optimizer, "lossgraph", note, lambda: estimator.fit(X, y), weights,
                     lambda: float(estimator.train_losses_[-1]), prepare)


def floor_candidates(setting: Setting) -> list[Candidate]:
    """Each step's matrix products alone, ``epochs`` times over the batches (no shuffling,
    no bias, activation, loss or update): in onnxruntime and in numpy
    (``benchmarks/bounds.py``)."""
    config = setting.config
    problem = Problem("mlp", setting.X, setting.y, setting.initial, setting.model,
                      setting.weight_names)
    floors = []
    for library, products, note in (
            ("onnxruntime", onnxruntime_products,
             "benchmarks/bounds.py products_graph: a Scan over the batches, one run per epoch"),
            ("numpy", numpy_products,
             "np.matmul(out=) per product, a Python loop over the batches")):
        name = f"floor: matrix products ({library})"
        try:
            epoch, _ = products(problem, config.batch)
        except Exception as error:  # a floor must not end the run
            floors.append(Candidate(name, None, "floor", error=_describe(error)))
        else:
            floors.append(Candidate(name, None, "floor", note,
                                    _epochs_of(epoch, config.epochs)))
    return floors


def _epochs_of(epoch: Epoch, epochs: int) -> Callable[[], None]:
    """A fit of ``epochs`` calls of ``epoch``."""

    def fit() -> None:
        for _ in range(epochs):
            epoch()

    return fit


def line_up(setting: Setting) -> list[Candidate]:
    """Every candidate, in the order of the table: per optimizer scikit-learn and the two
    APIs, then the floors."""
    candidates = []
    for optimizer in OPTIMIZERS:
        candidates.append(_or_failed(lambda o=optimizer: sklearn_candidate(setting, o),
                                     SKLEARN, optimizer, "peer"))
        for api in (WHOLE, FORWARD_BACKWARD):
            candidates.append(_or_failed(
                lambda a=api, o=optimizer: lossgraph_candidate(setting, a, o),
                api, optimizer, "lossgraph"))
    return candidates + floor_candidates(setting)


def _or_failed(build: Callable[[], Candidate], name: str, optimizer: str,
               kind: str) -> Candidate:
    try:
        return build()
    except Exception as error:  # one candidate must not end the run
        return Candidate(name, optimizer, kind, error=_describe(error))


def _describe(error: Exception) -> str:
    """The error in one line (the traceback with BENCH_DEBUG set)."""
    if os.environ.get("BENCH_DEBUG"):
        traceback.print_exc()
    if isinstance(error, Unavailable):
        return str(error)
    return f"{type(error).__name__}: {error!s:.200}"


# -- timing ---------------------------------------------------------------------------------
def time_candidates(candidates: list[Candidate], repeat: int) -> None:
    """lossgraph's setup (a first fit of one epoch), a first whole fit of each candidate
    (untimed), then ``repeat`` rounds timing one fit of every candidate in turn, each
    after ``SETTLE_S`` of sleep.

    A fit takes a fraction of a second or more, so a sleep, not untimed work as in
    :func:`benchmarks.harness.settle`, keeps the previous candidate's spinning thread
    pools off the cores; waking the pools again costs milliseconds once per fit. Taking
    turns, a burst of load from another process falls on every candidate.
    """
    for candidate in candidates:
        if candidate.fit is None:
            continue
        try:
            if candidate.prepare is not None:
                start = time.perf_counter()
                candidate.prepare()
                candidate.prepare_s = time.perf_counter() - start
            start = time.perf_counter()
            candidate.fit()
            candidate.first_fit_s = time.perf_counter() - start
        except Exception as error:  # one candidate must not end the run
            candidate.error = _describe(error)
    for _ in range(repeat):
        for candidate in candidates:
            if candidate.fit is None or candidate.error is not None:
                continue
            time.sleep(SETTLE_S)
            try:
                start = time.perf_counter()
                candidate.fit()
                candidate.samples_s.append(time.perf_counter() - start)
            except Exception as error:  # one candidate must not end the run
                candidate.error = _describe(error)


# -- the report -----------------------------------------------------------------------------
def full_data_loss(weights: Weights | None, X: np.ndarray, y: np.ndarray) -> float | None:
    """``mean(0.5 (f(X) - y)^2)`` of the MLP with ``weights`` ([W0, b0, W1, b1, ...]) on
    all rows, in float64: the same code for every candidate."""
    if weights is None:
        return None
    a = X.astype(np.float64)
    layers = list(zip(weights[::2], weights[1::2]))
    for j, (w, b) in enumerate(layers):
        a = a @ np.asarray(w, np.float64) + np.asarray(b, np.float64).reshape(1, -1)
        if j < len(layers) - 1:
            a = np.maximum(a, 0.0)
    return float(0.5 * np.mean((a - y.astype(np.float64)) ** 2))


def _per_100(seconds: float | None, epochs: int) -> float | None:
    return None if seconds is None else seconds * 100 / epochs


def report(candidates: list[Candidate], setting: Setting) -> dict[str, Any]:
    """Prints the table and notes; returns the rows, checks and verdicts for the JSON."""
    sklearn = {c.optimizer: c for c in candidates if c.kind == "peer"}
    floors = [c for c in candidates if c.kind == "floor"]
    rows = []
    for optimizer in OPTIMIZERS:
        reference = sklearn.get(optimizer)
        reference_loss = (full_data_loss(reference.weights(), setting.X, setting.y)
                          if reference is not None and reference.error is None else None)
        for c in [c for c in candidates if c.optimizer == optimizer] + floors:
            rows.append(_row(c, optimizer, reference, reference_loss, setting))
    width = max(len(r["candidate"]) for r in rows)
    print(f"\n{'optimizer':10s}{'candidate':{width}s}  {'s/100 epochs':>12s}  {'ratio':>6s}  "
          f"{'target <= ' + str(TARGET) + 'x':>16s}  {'train loss':>10s}  {'all-rows loss':>13s}")
    for r in rows:
        cells = [_fmt(r["seconds_per_100_epochs"], ".3f"), _fmt(r["ratio_to_sklearn"], ".2f"),
                 r["verdict"], _fmt(r["train_loss"], ".4g"), _fmt(r["full_data_loss"], ".4g")]
        flag = "  LOSS DIFFERS" if r["loss_differs"] else ""
        print(f"{r['optimizer']:10s}{r['candidate']:{width}s}  {cells[0]:>12s}  "
              f"{cells[1]:>6s}  {cells[2]:>16s}  {cells[3]:>10s}  {cells[4]:>13s}{flag}")
    checks = _agreement(candidates)
    print("notes:")
    for c in candidates:
        if c.error:
            print(f"  {c.name} ({c.optimizer or 'floor'}): n/a -- {c.error}")
    for optimizer in OPTIMIZERS:
        notes = [c.note for c in candidates if c.optimizer == optimizer and c.kind == "peer"]
        if notes:
            print(f"  {optimizer}: scikit-learn {notes[0]}")
    for c in candidates:
        if c.kind == "floor":
            print(f"  {c.name}: {c.note}; not a training, the same for both optimizers")
    epochs = setting.config.epochs
    setups = [f"{c.name.split()[0]} {c.optimizer} {c.setup_s(epochs) * 1000:.0f} ms"
              for c in candidates if c.setup_s(epochs) is not None]
    if setups:
        print("  setup, excluded from the timings (a first fit of one epoch, less one epoch: "
              "compile_program, Trainer, sessions): " + "; ".join(setups))
    firsts = [f"{c.name if c.optimizer is None else c.name.split()[0] + ' ' + c.optimizer} "
              f"{c.first_fit_s:.2f} s" for c in candidates if c.first_fit_s is not None]
    print("  first whole fit, untimed: " + "; ".join(firsts))
    for optimizer, diff in checks.items():
        print(f"  check, {optimizer}: max |w_whole - w_forward_backward| after the last fit = "
              + ("n/a" if diff is None else f"{diff:.1e} (same start, same shuffles)"))
    print("  train loss: the last epoch's mean minibatch loss, 0.5 (p - y)^2 (scikit-learn's "
          "loss_curve_[-1], lossgraph's train_losses_[-1]); all-rows loss: the final weights "
          "on every row, by the same numpy code. Shuffles differ between scikit-learn and "
          "lossgraph (each its own generator, seed 0).")
    return {"rows": rows, "checks": checks}


def _row(c: Candidate, optimizer: str, reference: Candidate | None,
         reference_loss: float | None, setting: Setting) -> dict[str, Any]:
    epochs = setting.config.epochs
    best = c.best_s
    reference_best = reference.best_s if reference is not None else None
    ratio = best / reference_best if best is not None and reference_best else None
    if c.kind != "lossgraph":
        verdict = "-" if c.error is None else "n/a"
    else:
        verdict = ("n/a" if ratio is None else "PASS" if ratio <= TARGET else "MISS")
    full = None
    train = None
    if c.kind != "floor" and c.error is None:
        full = full_data_loss(c.weights(), setting.X, setting.y)
        train = c.train_loss()
    differs = bool(c.kind == "lossgraph" and full is not None and reference_loss is not None
                   and not full <= LOSS_TOLERANCE * reference_loss)
    return {"optimizer": optimizer, "candidate": c.name, "kind": c.kind, "note": c.note,
            "seconds_per_100_epochs": _per_100(best, epochs),
            "median_seconds_per_100_epochs": _per_100(
                statistics.median(c.samples_s) if c.samples_s and c.error is None else None,
                epochs),
            "samples_s": list(c.samples_s), "first_fit_s": c.first_fit_s,
            "setup_s": c.setup_s(epochs), "setup_fit_of_one_epoch_s": c.prepare_s,
            "ratio_to_sklearn": ratio, "target": TARGET if c.kind == "lossgraph" else None,
            "verdict": verdict, "train_loss": train, "full_data_loss": full,
            "loss_differs": differs, "error": c.error}


def _agreement(candidates: list[Candidate]) -> dict[str, float | None]:
    """Per optimizer, the largest difference between the two APIs' final weights."""
    checks: dict[str, float | None] = {}
    for optimizer in OPTIMIZERS:
        pair = [c for c in candidates if c.optimizer == optimizer and c.kind == "lossgraph"
                and c.error is None]
        if len(pair) != 2:
            checks[optimizer] = None
            continue
        a, b = (c.weights() for c in pair)
        checks[optimizer] = max(float(np.abs(np.asarray(u) - np.asarray(v)).max())
                                for u, v in zip(a, b))
    return checks


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


#: True for a file this benchmark wrote (its JSON carries BENCHMARK_MARK)
is_benchmark_output = written_by(BENCHMARK_MARK)


def run(config: Config) -> dict[str, Any]:
    """Sets up, times and reports every candidate; returns what the JSON holds."""
    with contextlib.suppress(ImportError):
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    facts = machine_facts()
    print(f"MLPRegressor(hidden_layer_sizes={HIDDEN_LAYERS}) on {config.rows} rows x "
          f"{N_FEATURES} float32 features, batch {config.batch}, {config.epochs} epochs, "
          f"learning rate {LEARNING_RATE:g}, shuffled; best of {config.repeat} fit(s) each "
          f"after a first fit, {SETTLE_S:g} s of sleep before each")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    setting = make_setting(config)
    candidates = line_up(setting)
    time_candidates(candidates, config.repeat)
    figures = report(candidates, setting)
    report_run(started, cpu_before, facts)
    return {"generator": BENCHMARK_MARK, "machine": facts,
            "config": {"rows": config.rows, "features": N_FEATURES, "batch": config.batch,
                       "epochs": config.epochs, "hidden_layer_sizes": list(HIDDEN_LAYERS),
                       "learning_rate": LEARNING_RATE, "momentum": MOMENTUM,
                       "repeat": config.repeat, "target": TARGET},
            **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_ROWS} rows, {QUICK_EPOCHS} epochs, one round")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed rounds after the first fit; a figure is the best "
                             "(default 5; 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 5)
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    check_targets(parser, [args.json], is_benchmark_output)
    config = (Config(QUICK_ROWS, QUICK_EPOCHS, BATCH, repeat) if args.quick
              else Config(repeat=repeat))
    try:
        figures = run(config)
    except Unavailable as error:
        print(f"cannot run: {error}", file=sys.stderr)
        return 1
    if args.json:
        save_figures(figures, args.json, is_benchmark_output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
