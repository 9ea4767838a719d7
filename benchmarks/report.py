"""The report: one table per model, the notes and targets below it, JSON and a plot.

A cell reads ``ms per epoch (ratio to the fastest peer at that batch size)``, and for
lossgraph's modes and the hand-written bound also the ratio to the **floor**: the fastest
matrix-products row at that batch size (each step's matrix products alone, in numpy,
torch or onnxruntime, whichever is fastest on this machine). The bound, the products
rows and lossgraph's modes are compared with the peers and are never the fastest peer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import ModelRun, Row
from benchmarks.output import save_figure, written_by
from benchmarks.problems import LEARNING_RATE, MOMENTUM, N_FEATURES

BENCHMARK_MARK = "lossgraph benchmarks/training_speed.py"  # in every file the run writes
CHECK_TOLERANCE = 1e-4  # float32 weights after one epoch, against numpy's
FASTEST_PEER, FLOOR = "the fastest peer", "the floor"


@dataclass(frozen=True)
class Target:
    """lossgraph's best mode at most ``limit`` times ``against``'s time: FASTEST_PEER,
    FLOOR or the name of a row."""

    against: str
    limit: float


# Issue 17's targets, per model and batch size.
TARGETS = {"mlp": {100: Target(FASTEST_PEER, 0.55), 1000: Target(FLOOR, 1.5),
                   10000: Target(FLOOR, 1.5)},
           "linear": {100: Target("numpy", 1.5), 1000: Target("numpy", 1.0),
                      10000: Target("numpy", 1.0)}}


@dataclass
class ModelReport:
    """One model's table as printed: its rows, the fastest peer and the floor per batch
    size, target verdicts."""

    title: str
    rows: list[Row]
    fastest: dict[int, Row | None]
    floor: dict[int, Row | None]
    targets: list[dict[str, Any]]


def _fastest(rows: list[Row], kind: str, batch: int) -> Row | None:
    timed = [r for r in rows if r.kind == kind and r.ms.get(batch) is not None]
    return min(timed, key=lambda r: r.ms[batch]) if timed else None


def fastest_peer(rows: list[Row], batch: int) -> Row | None:
    return _fastest(rows, "peer", batch)


def floor_row(rows: list[Row], batch: int) -> Row | None:
    """The floor at ``batch``: the fastest matrix-products row there (None if none ran)."""
    return _fastest(rows, "floor", batch)


def reference_row(rows: list[Row], against: str, batch: int) -> Row | None:
    """The row a target's ratio is taken against at ``batch``."""
    if against == FASTEST_PEER:
        return fastest_peer(rows, batch)
    if against == FLOOR:
        return floor_row(rows, batch)
    return next((r for r in rows if r.name == against), None)


def ratio_to(row: Row, other: Row | None, batch: int) -> float | None:
    if other is None or row.ms.get(batch) is None or not other.ms.get(batch):
        return None
    return row.ms[batch] / other.ms[batch]


def _cell(row: Row, fastest: Row | None, floor: Row | None, batch: int) -> str:
    """``ms (ratio to the fastest peer[, ratio to the floor])`` and the mark: ``*`` the
    fastest peer, ``^`` the floor."""
    ms = row.ms.get(batch)
    if ms is None:
        return "n/a"
    ratios = []
    if (to_peer := ratio_to(row, fastest, batch)) is not None:
        ratios.append(f"{to_peer:.2f}x")
    if row.kind in ("lossgraph", "bound") and (to_floor := ratio_to(row, floor, batch)):
        ratios.append(f"{to_floor:.2f}x floor")
    mark = "*" if row is fastest else "^" if row is floor else " "
    return f"{ms:.1f} ms" + (f" ({', '.join(ratios)})" if ratios else "") + mark


def report_model(result: ModelRun, batches: list[int], n_rows: int) -> ModelReport:
    """Prints one model's table and the notes under it."""
    problem, rows = result.problem, result.rows
    title = ("MLP 100-50-1 (relu)" if problem.name == "mlp" else "linear regression")
    print(f"\n== {title}: ms per epoch of {n_rows:,} rows (ratio to the fastest peer, "
          "* = fastest peer; lossgraph and the bound: also the ratio to the floor, the "
          "fastest matrix-products row, ^) ==")
    for note in problem.notes:
        print(f"   note: {note}")
    fastest = {b: fastest_peer(rows, b) for b in batches}
    floor = {b: floor_row(rows, b) for b in batches}
    cells = {row.name: [_cell(row, fastest[b], floor[b], b) for b in batches] for row in rows}
    width = max(len(row.name) for row in rows) + 2
    column = max(len(c) for line in cells.values() for c in line) + 2
    print(f"{'implementation':{width}s}" + "".join(f"{'batch ' + str(b):>{column}s}"
                                                   for b in batches))
    for row in rows:
        print(f"{row.name:{width}s}" + "".join(f"{c:>{column}s}" for c in cells[row.name]))
    print("notes:")
    for row in rows:
        if row.note:
            print(f"  {row.name}: {row.note}")
        for message in sorted(set(row.errors.values())):
            print(f"  {row.name}: n/a -- {message}")
    print("  floor (the fastest matrix-products row): " + ", ".join(
        f"b{b} {floor[b].name} {floor[b].ms[b]:.1f} ms" if floor[b] else f"b{b} n/a"
        for b in batches))
    checks = {row.name: max(row.check.values()) for row in rows if row.check}
    if checks:
        print("  check, max |w - w_numpy| after the warm-up epoch (same start, same batches): "
              + ", ".join(f"{name} {d:.1e}{' DIFFERS' if d > CHECK_TOLERANCE else ''}"
                          for name, d in checks.items()))
    setups = [f"{row.name} {statistics.median(row.setup_ms.values()):.0f} ms"
              for row in rows if row.setup_ms]
    print("  setup per batch size (excluded from the timings; median): " + ", ".join(setups))
    for row, c in zip((r for r in rows if r.kind == "lossgraph"), result.compiled):
        if c.program is not None:
            trainer = f"{statistics.median(c.trainer_s) * 1000:.1f} ms" if c.trainer_s else "-"
            first = ", ".join(f"b{b} {row.warm_up_ms[b]:.0f} ms" for b in batches
                              if b in row.warm_up_ms)
            print(f"  {row.name}: compile {c.compile_s * 1000:.0f} ms (once), Trainer() "
                  f"{trainer}, first fit (creates the sessions, + 1 epoch) {first}")
    return ModelReport(title, rows, fastest, floor,
                       report_targets(problem.name, rows, batches))


def report_targets(model: str, rows: list[Row], batches: list[int]) -> list[dict[str, Any]]:
    """Prints lossgraph's best mode against its target per batch size, with its ratio to
    the fastest peer and to the floor and the bounds' ratios; returns the verdicts."""
    ours = [r for r in rows if r.kind == "lossgraph"]
    print("  targets (lossgraph's best mode):")
    verdicts = []
    for b in batches:
        target = TARGETS[model].get(b)
        done = [r for r in ours if r.ms.get(b) is not None]
        best = min(done, key=lambda r: r.ms[b]) if done else None
        reference = reference_row(rows, target.against, b) if target else None
        ratio = ratio_to(best, reference, b) if best is not None else None
        if target is None or ratio is None:
            why = "no target at this batch size" if target is None else "untested (n/a)"
            print(f"    batch {b}: {why}")
            verdicts.append({"batch": b, "against": target and target.against,
                             "limit": target and target.limit, "ratio": None, "verdict": why})
            continue
        verdict = "PASS" if ratio <= target.limit else "MISS"
        peer, floor = fastest_peer(rows, b), floor_row(rows, b)
        context = {FASTEST_PEER: ratio_to(best, peer, b), FLOOR: ratio_to(best, floor, b)}
        bounds = {r.name: ratio_to(r, reference, b) for r in rows if r.kind == "bound"}
        if floor is not None and floor is not reference:
            bounds["floor"] = ratio_to(floor, reference, b)
        against = (reference.name if target.against == reference.name
                   else f"{target.against} [{reference.name}]")
        others = "".join(f" | {x:.2f}x {what}" for what, x in context.items()
                         if what != target.against and x is not None)
        bound_text = ", ".join(f"{name} {x:.2f}x" for name, x in bounds.items() if x is not None)
        print(f"    batch {b}: {best.name} {ratio:.2f}x {against} (target <= {target.limit}x): "
              f"{verdict}{others}" + (f" | bounds vs {reference.name}: {bound_text}"
                                      if bound_text else ""))
        verdicts.append({"batch": b, "against": target.against, "limit": target.limit,
                         "reference": reference.name, "best": best.name, "ratio": ratio,
                         "verdict": verdict,
                         "ratio_to_fastest_peer": context[FASTEST_PEER],
                         "ratio_to_floor": context[FLOOR],
                         "floor": floor.name if floor is not None else None,
                         "bounds": bounds})
    if model == "linear":
        numpy_row = next(r for r in rows if r.name == "numpy")
        for r in ours:
            ratios = [ratio_to(r, numpy_row, b) for b in batches]
            print(f"    {r.name} / numpy: " + ", ".join(
                f"b{b} {x:.2f}x" if x is not None else f"b{b} n/a"
                for b, x in zip(batches, ratios)))
    return verdicts


def _row_json(row: Row, report: ModelReport) -> dict[str, Any]:
    return {"name": row.name, "kind": row.kind, "note": row.note,
            "ms_per_epoch": {str(b): v for b, v in row.ms.items()},
            "samples_ms": {str(b): v for b, v in row.samples.items()},
            "ratio_to_fastest_peer": {str(b): ratio_to(row, report.fastest[b], b)
                                      for b in row.ms},
            "ratio_to_floor": {str(b): ratio_to(row, report.floor[b], b) for b in row.ms},
            "setup_ms": {str(b): v for b, v in row.setup_ms.items()},
            "warm_up_ms": {str(b): v for b, v in row.warm_up_ms.items()},
            "max_abs_diff_vs_numpy": {str(b): v for b, v in row.check.items()},
            "errors": {str(b): v for b, v in row.errors.items()}}


def to_json(facts: dict[str, str], reports: dict[str, ModelReport], repeat: int,
            n: int) -> dict[str, Any]:
    """Every figure of the run, as the --json file holds it."""
    return {"generator": BENCHMARK_MARK, "machine": facts, "rows_per_epoch": n,
            "features": N_FEATURES, "learning_rate": LEARNING_RATE, "momentum": MOMENTUM,
            "repeat": repeat,
            "models": {name: {"title": r.title, "targets": r.targets,
                              "fastest_peer": {str(b): (f.name if f else None)
                                               for b, f in r.fastest.items()},
                              "floor": {str(b): ({"row": f.name, "ms_per_epoch": f.ms[b]}
                                                 if f else None)
                                        for b, f in r.floor.items()},
                              "rows": [_row_json(row, r) for row in r.rows]}
                       for name, r in reports.items()}}


#: True for a file this benchmark wrote (its JSON or PNG carries BENCHMARK_MARK)
is_benchmark_output = written_by(BENCHMARK_MARK)


def plot(reports: dict[str, ModelReport], batches: list[int], path: str) -> None:
    """ms/epoch against batch size, log-log, one panel per model (needs matplotlib): every
    row but the matrix-products rows, and the floor, the fastest of those per batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n--plot {path}: matplotlib is not installed, no plot written")
        return
    figure, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for axis, report in zip(axes[0], reports.values()):
        for row in report.rows:
            points = [(b, row.ms[b]) for b in batches if row.ms.get(b) is not None]
            if points and row.kind != "floor":
                axis.plot(*zip(*points), marker="o", label=row.name,
                          linestyle="-" if row.kind == "lossgraph" else "--")
        floor = [(b, f.ms[b]) for b, f in report.floor.items() if f is not None]
        if floor:
            axis.plot(*zip(*floor), marker="s", color="black", linestyle=":", linewidth=2,
                      label="floor (fastest matrix products)")
        axis.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per epoch",
                 title=report.title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    save_figure(figure, path, BENCHMARK_MARK, dpi=120)
    print(f"\nplot written to {path}")
