"""How fast does lossgraph train, next to the usual ways of training the same model?

Times ONE EPOCH of minibatch SGD with Nesterov momentum (learning rate 0.01, momentum
0.9, squared error) over N=100,000 rows of 100 float32 features (synthetic regression
data, fixed seed), for an MLP 100-50-1 (relu) and for linear regression, at batch
sizes 100, 1000 and 10000, without shuffling. Every implementation runs in this one
process, on the same data and the same batches:

    peers.py            scikit-learn, torch eager, ORT on-device, numpy by hand
    lossgraph_modes.py  lossgraph.compile_program(...) + lossgraph.Trainer(...).fit, per fuse mode
    bounds.py           never peers: the same epoch as one hand-minimized onnxruntime
                        graph (the bound), and only the matrix products of each step in
                        numpy, torch and onnxruntime (the floor: the fastest of the three)

Cells read "ms/epoch (ratio to the fastest peer at that batch size)", and for lossgraph
and the bound also the ratio to the floor (report.py). Each figure is the median of
--repeat epochs after one warm-up epoch; setup (model construction, export, compilation,
sessions) is excluded and reported separately (harness.py). A row that cannot run in this
environment shows "n/a".

Run from the repository root:
      python -m benchmarks.training_speed [--quick] [--models mlp,linear]
          [--batches 100,1000,10000] [--repeat 3] [--json out.json] [--plot out.png]
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import SETTLE_S, run_model
from benchmarks.machine import cpu_seconds, machine_facts, report_run
from benchmarks.output import check_targets, save_figures
from benchmarks.problems import N_FEATURES, PROBLEMS, make_data
from benchmarks.report import ModelReport, is_benchmark_output, plot, report_model, to_json

N_ROWS, N_ROWS_QUICK = 100_000, 20_000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: N={N_ROWS_QUICK:,} rows, one repeat")
    parser.add_argument("--models", default="mlp,linear", help="comma-separated: mlp,linear")
    parser.add_argument("--batches", default="100,1000,10000", help="comma-separated sizes")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed epochs per cell, after one warm-up (default 3; 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (needs matplotlib)")
    args = parser.parse_args(argv)
    args.repeat = args.repeat or (1 if args.quick else 3)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - set(PROBLEMS)
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}: pick from mlp, linear")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    n = N_ROWS_QUICK if args.quick else N_ROWS
    check_targets(parser, [args.json, args.plot], is_benchmark_output)
    if any(b <= 0 or n % b for b in batches):
        parser.error(f"every batch size must divide N={n}")

    with contextlib.suppress(ImportError):
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    facts = machine_facts()
    print("one epoch of minibatch SGD, Nesterov momentum (lr 0.01, momentum 0.9), "
          f"N={n:,} rows x {N_FEATURES} float32 features, no shuffling; "
          f"median of {args.repeat} epoch(s), each after {SETTLE_S:g} s of untimed ones")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    X, y = make_data(n)
    reports: dict[str, ModelReport] = {}
    with tempfile.TemporaryDirectory(prefix="lossgraph_bench_") as workdir:
        for name in models:
            result = run_model(PROBLEMS[name](X, y), batches, args.repeat, Path(workdir))
            reports[name] = report_model(result, batches, n)
    report_run(started, cpu_before, facts)
    if args.json:
        save_figures(to_json(facts, reports, args.repeat, n), args.json, is_benchmark_output)
    if args.plot:
        plot(reports, batches, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
