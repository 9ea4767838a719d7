"""The report: one table per model, the notes and targets below it, JSON and a plot.

A cell reads ``ms per epoch (ratio to the fastest peer at that batch size)``; the bounds
and lossgraph's modes are compared with the peers and are never the fastest peer.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import ModelRun, Row
from benchmarks.problems import LEARNING_RATE, MOMENTUM, N_FEATURES
from lossgraph.fileio import write_file

BENCHMARK_MARK = "lossgraph benchmarks/training_speed.py"  # in every file the run writes
CHECK_TOLERANCE = 1e-4  # float32 weights after one epoch, against numpy's
# Targets: lossgraph's best mode against the fastest peer (MLP), against numpy by hand
# (linear); batch size -> the largest ratio that passes.
TARGETS = {"mlp": {100: 0.5, 1000: 0.5, 10000: 0.5},
           "linear": {100: 1.5, 1000: 1.0, 10000: 1.0}}


@dataclass
class ModelReport:
    """One model's table as printed: its rows, fastest peer per batch size, target verdicts."""

    title: str
    rows: list[Row]
    fastest: dict[int, Row | None]
    targets: list[dict[str, Any]]


def fastest_peer(rows: list[Row], batch: int) -> Row | None:
    peers = [r for r in rows if r.kind == "peer" and r.ms.get(batch) is not None]
    return min(peers, key=lambda r: r.ms[batch]) if peers else None


def ratio_to(row: Row, other: Row | None, batch: int) -> float | None:
    if other is None or row.ms.get(batch) is None or not other.ms.get(batch):
        return None
    return row.ms[batch] / other.ms[batch]


def report_model(result: ModelRun, batches: list[int], n_rows: int) -> ModelReport:
    """Prints one model's table and the notes under it."""
    problem, rows = result.problem, result.rows
    title = ("MLP 100-50-1 (relu)" if problem.name == "mlp" else "linear regression")
    print(f"\n== {title}: ms per epoch of {n_rows:,} rows (ratio to the fastest peer, "
          "* = fastest peer) ==")
    for note in problem.notes:
        print(f"   note: {note}")
    width = 24
    print(f"{'implementation':{width}s}" + "".join(f"{'batch ' + str(b):>20s}" for b in batches))
    fastest = {b: fastest_peer(rows, b) for b in batches}
    for row in rows:
        cells = []
        for b in batches:
            ms = row.ms.get(b)
            if ms is None:
                cells.append("n/a")
                continue
            ratio = ratio_to(row, fastest[b], b)
            mark = "*" if fastest[b] is row else " "
            cells.append(f"{ms:.1f} ms ({ratio:.2f}x){mark}" if ratio else f"{ms:.1f} ms")
        print(f"{row.name:{width}s}" + "".join(f"{c:>20s}" for c in cells))
    print("notes:")
    for row in rows:
        if row.note:
            print(f"  {row.name}: {row.note}")
        for message in sorted(set(row.errors.values())):
            print(f"  {row.name}: n/a -- {message}")
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
    return ModelReport(title, rows, fastest, report_targets(problem.name, rows, batches))


def report_targets(model: str, rows: list[Row], batches: list[int]) -> list[dict[str, Any]]:
    """Prints lossgraph's best mode against its target per batch size; returns the verdicts."""
    ours = [r for r in rows if r.kind == "lossgraph"]
    numpy_row = next(r for r in rows if r.name == "numpy")
    against = "the fastest peer" if model == "mlp" else "numpy by hand"
    print(f"  targets (lossgraph's best mode vs {against}):")
    verdicts = []
    for b in batches:
        limit = TARGETS[model].get(b)
        done = [r for r in ours if r.ms.get(b) is not None]
        reference = fastest_peer(rows, b) if model == "mlp" else numpy_row
        if not done or limit is None or ratio_to(done[0], reference, b) is None:
            why = "no target at this batch size" if limit is None else "untested (n/a)"
            print(f"    batch {b}: {why}")
            verdicts.append({"batch": b, "limit": limit, "ratio": None, "verdict": why})
            continue
        best = min(done, key=lambda r: r.ms[b])
        ratio = ratio_to(best, reference, b)
        verdict = "PASS" if ratio <= limit else "MISS"
        bounds = {r.name: ratio_to(r, reference, b) for r in rows if r.kind == "bound"}
        bound_text = "".join(f"; {name} {x:.2f}x" for name, x in bounds.items() if x is not None)
        print(f"    batch {b}: {best.name} {ratio:.2f}x {reference.name} "
              f"(target <= {limit}x): {verdict}{bound_text}")
        verdicts.append({"batch": b, "limit": limit, "ratio": ratio, "best": best.name,
                         "against": reference.name, "verdict": verdict, "bounds": bounds})
    if model == "linear":
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
                              "rows": [_row_json(row, r) for row in r.rows]}
                       for name, r in reports.items()}}


def is_benchmark_output(path: Path) -> bool:
    """True for a file this benchmark wrote (its JSON or PNG carries BENCHMARK_MARK)."""
    return BENCHMARK_MARK.encode() in path.read_bytes()[:4096]


def plot(reports: dict[str, ModelReport], batches: list[int], path: str) -> None:
    """ms/epoch against batch size, log-log, one panel per model (needs matplotlib)."""
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
            if points:
                axis.plot(*zip(*points), marker="o", label=row.name,
                          linestyle="-" if row.kind == "lossgraph" else "--")
        axis.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per epoch",
                 title=report.title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120, metadata={"Software": BENCHMARK_MARK})
    write_file(path, image.getvalue(), owned=is_benchmark_output)
    print(f"\nplot written to {path}")
