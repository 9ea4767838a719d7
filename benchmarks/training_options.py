"""What do the fine-tuning options built into the training graphs cost a step?

Each option of issue 28 that changes the graphs, beside the same training without it:

    plain        AdamW(1e-3, epsilon=1e-6, weight_decay=0.01), constant rate, cross
                 entropy of the logits
    schedule     learning_rate=Linear(1e-3, total_steps, warmup_steps): a rate per step
                 (fed to the graphs like a constant one)
    groups       AdamW(exclude_from_weight_decay="auto"): no decay for biases and norms (an
                 epoch graph then updates the weights apart instead of as one packed vector)
    smoothing    loss_options label_smoothing=0.1 and class_weight (one per class)
    accumulate   accumulation_steps=4: one update per 4 batches of b rows
    batch 4b     one step per 4b rows (what accumulation stands in for)

A cell is the median ms per b rows (one step at batch b; for ``accumulate`` one
micro-batch, for ``batch 4b`` a quarter of a step), so every variant trains the same rows
in the same time unit. Every fuse mode, and torch eager doing the same (two parameter
groups, ``LambdaLR``, ``CrossEntropyLoss(weight=, label_smoothing=)``, the loss divided by
4 before ``backward``):

    mlp          Linear(100, 50), ReLU, Linear(50, 10): batch 100
    transformer  benchmarks.model_speed's encoder (2 layers, d_model 128, 4 heads,
                 feed-forward 512, sequence 64, batch 32) with a 10-class head

Every candidate runs in this one process on the same data, from the same weights, with the
same threads (``--threads``). Each first trains one warm-up epoch, then ``--repeat`` rounds
each time one epoch of every variant of a runtime in turn (so that a burst of load from
another process falls on all of them). After the timed rounds each lossgraph variant's
weights are checked against torch's after two epochs from the start: ``check`` is the
largest difference, beside how far torch's weights moved.

Run from the repository root:
      python -m benchmarks.training_options [--quick] [--workloads mlp,transformer]
          [--fuses step,epoch,separate] [--steps 20] [--repeat 7] [--threads 2]
          [--clock wall|cpu] [--json out.json]
See docs/benchmarks.md#the-fine-tuning-options.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

BENCHMARK_MARK = "lossgraph benchmarks/training_options.py"  # in every file the run writes
RATE, DECAY, CLASSES, SMOOTHING, K = 1e-3, 0.01, 10, 0.1, 4
#: AdamW's epsilon (docs/examples/09's note): the attention key biases' gradient is zero but
#: for rounding, which the default 1e-8 would turn into full steps that differ by library
EPSILON = 1e-6
#: one weight per class, as a rebalanced data set has
CLASS_WEIGHT = tuple(float(w) for w in np.linspace(0.5, 2.0, CLASSES))


@dataclass(frozen=True)
class Variant:
    """One way to train: the options it sets (compile_program's ``schedule``, decay
    ``groups``, the loss's ``smoothing`` and class weights) and the rows of an update
    (``micro`` batches of ``rows`` times the workload's batch)."""

    schedule: bool = False
    groups: bool = False
    smoothing: bool = False
    micro: int = 1
    rows: int = 1


VARIANTS = {"plain": Variant(), "schedule": Variant(schedule=True),
            "groups": Variant(groups=True), "smoothing": Variant(smoothing=True),
            "accumulate": Variant(micro=K), "batch 4b": Variant(rows=K)}

Epoch = Callable[[], Any]


def _mlp(torch, features: int, hidden: int, classes: int, batch: int):
    nn = torch.nn
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def _transformer(torch, classes: int, **sizes: int):
    """model_speed's encoder with a ``classes``-way head."""
    from benchmarks import model_speed

    net = model_speed.transformer_encoder(torch, **sizes)
    net.head = torch.nn.Linear(sizes["d_model"], classes)
    return net


def make_problem(name: str, steps: int, quick: bool):
    """The workload's torch network, its export and ``steps`` batches of data with a
    class label per row (:func:`benchmarks.model_speed.make_problem`)."""
    from benchmarks import model_speed

    if name == "mlp":
        sizes = (dict(features=6, hidden=4, classes=3, batch=4) if quick else
                 dict(features=100, hidden=50, classes=CLASSES, batch=100))
        build, shape = _mlp, (lambda features, **_: (features,))
    else:
        base = model_speed.WORKLOADS["transformer"]
        sizes = {**(base.quick if quick else base.sizes), "classes": 3 if quick else CLASSES}
        build, shape = _transformer, base.shape
    workload = model_speed.Workload(name, build, shape, lambda classes, **_: classes,
                                    sizes, sizes)
    problem = model_speed.make_problem(workload, steps, quick)
    problem.y = np.random.default_rng(2).integers(0, sizes["classes"], len(problem.X))
    return problem


def _schedule(steps: int):
    """The schedule variant's rate: a quarter of the epoch's updates of warmup, then down."""
    from lossgraph.schedules import Linear

    return Linear(RATE, total_steps=steps, warmup_steps=max(1, steps // 4))


def _class_weight(problem: Any) -> list[float]:
    return list(CLASS_WEIGHT[:problem.sizes["classes"]])


def _no_decay(name: str) -> bool:
    """The torch parameters the ``groups`` variant does not decay: biases and norms."""
    return name.endswith("bias") or ".norm" in name


def updates(problem: Any, variant: Variant) -> int:
    """The updates of one epoch of ``variant``."""
    return len(problem.X) // (problem.batch * variant.micro * variant.rows)


# -- the candidates ----------------------------------------------------------------------
def torch_candidate(problem: Any, name: str) -> tuple[Epoch, Callable[[], dict]]:
    """One epoch of torch eager with variant ``name``'s options, and its weights by the
    export's names."""
    import torch

    variant = VARIANTS[name]
    net = copy.deepcopy(problem.net)
    named = list(net.named_parameters())
    groups = ([{"params": [p for n, p in named if not _no_decay(n)]},
               {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0}]
              if variant.groups else [p for _, p in named])
    optimizer = torch.optim.AdamW(groups, lr=RATE, eps=EPSILON, weight_decay=DECAY)
    schedule = _schedule(updates(problem, variant)) if variant.schedule else None
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s + 1) / RATE)
                 if schedule else None)
    loss = torch.nn.CrossEntropyLoss(
        weight=torch.tensor(_class_weight(problem)) if variant.smoothing else None,
        label_smoothing=SMOOTHING if variant.smoothing else 0.0)
    X, y = torch.from_numpy(problem.X), torch.from_numpy(problem.y)
    batch = problem.batch * variant.rows

    def epoch() -> None:
        for start in range(0, len(X), batch * variant.micro):
            optimizer.zero_grad()
            for lo in range(start, start + batch * variant.micro, batch):
                (loss(net(X[lo:lo + batch]), y[lo:lo + batch]) / variant.micro).backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

    def weights() -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}

    return epoch, weights


def compiled(problem: Any, fuse: str, name: str) -> Any:
    """The export compiled with variant ``name``'s options in ``fuse`` mode."""
    import lossgraph
    from lossgraph.optim import AdamW

    variant = VARIANTS[name]
    rate = _schedule(updates(problem, variant)) if variant.schedule else RATE
    loss_options = {"from_logits": True}
    if variant.smoothing:
        loss_options.update(label_smoothing=SMOOTHING, class_weight=_class_weight(problem))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lossgraph.compile_program(
            problem.model, loss="multiclass_log_loss", loss_options=loss_options,
            optimizer=AdamW(rate, epsilon=EPSILON, weight_decay=DECAY,
                            exclude_from_weight_decay="auto" if variant.groups else ()),
            fuse=fuse, accumulation_steps=variant.micro)


# -- the run ----------------------------------------------------------------------------
def run_workload(name: str, fuses: list[str], steps: int, repeat: int, threads: int,
                 quick: bool, clock: Callable[[], float]) -> dict[str, Any]:
    """Every runtime's variants: ms per b rows, and each lossgraph variant's check against
    torch after two epochs."""
    import torch

    from benchmarks.update_options import lossgraph_candidate, run_variants

    torch.set_num_threads(threads)
    problem = make_problem(name, steps, quick)
    return run_variants(
        name, problem, fuses, list(VARIANTS), "ms_per_batch",
        compile_variant=lambda fuse, v: compiled(problem, fuse, v),
        torch_variant=lambda v: torch_candidate(problem, v),
        lossgraph_variant=lambda program, v: lossgraph_candidate(
            problem, program, threads, problem.batch * VARIANTS[v].rows, VARIANTS[v].micro),
        repeat=repeat, steps=steps, clock=clock)


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table: each workload and runtime, its variants side by side with their cost
    over the plain step, and the largest check."""
    from benchmarks.update_options import variants_table

    return variants_table(results, [v for v in VARIANTS if v != "plain"], "ms_per_batch",
                          "batch of b rows", check=lambda cell: max(cell["check"].values()),
                          moved=lambda cell: min(cell["moved"].values()))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.update_options import variants_main

    def whole_updates(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        if args.steps < K or args.steps % K:
            parser.error(f"--steps {args.steps}: a multiple of {K}, so that every variant "
                         "trains the same rows in whole updates")

    variants = {n: {"schedule": v.schedule, "groups": v.groups, "smoothing": v.smoothing,
                    "micro_batches": v.micro, "batch_factor": v.rows}
                for n, v in VARIANTS.items()}
    return variants_main(
        argv, doc=__doc__, mark=BENCHMARK_MARK, run_workload=run_workload, report=report,
        variants=variants, check=whole_updates,
        steps_help="batches of b rows an epoch, a multiple of 4 (default 20)",
        headline="the cost of a schedule, decay groups, label smoothing with class weights "
        f"and gradient accumulation (k={K}) per batch of b rows")


if __name__ == "__main__":
    sys.exit(main())
