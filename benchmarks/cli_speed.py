"""How fast does the lossgraph command answer?

Times the command in fresh processes (``python -m lossgraph ...``, as the ``lossgraph``
script runs it), each row several times, the rows interleaved round by round so that a
change in the machine's load touches every row alike:

- ``lossgraph --help``;
- ``lossgraph train --data missing.csv prog``: an argument error (no ``-o``);
- ``lossgraph compile missing.onnx -o x``: a missing model file;
- ``lossgraph train prog --data missing.csv -o out.onnx``: a real program folder, a missing
  data file (issue 26 measured 7.1 s for this one);
- ``lossgraph train prog --data train.npz -o out.onnx``: a real run (one epoch of a
  10-row linear regression), for scale: onnxruntime loads here;

beside the floors they sit on, each a fresh process too: ``python -c pass`` (the
interpreter), ``import numpy``, ``import onnx``, ``import onnxruntime`` as Python does it
(the training build's import pulls in torch), and
``lossgraph.training_build.import_onnxruntime()`` (the same module without the training
build's Python package, as lossgraph imports it).

Each row gives the least and the median wall time and CPU time (user + system of the
child process: on a busy machine the wall time grows with the load, the CPU time much
less) and, from one more run under ``python -X importtime``, which of numpy, onnx,
onnxruntime and torch the command imported. The command's exit status and message are
checked, so that a row times what it claims.

Run from the repository root:
      python -m benchmarks.cli_speed [--quick] [--runs 9] [--compare PATH] [--json out.json]
``--compare PATH`` times another checkout's lossgraph (``PATH`` holding its ``lossgraph``
package, e.g. a worktree of main) beside this one's. See docs/benchmarks.md#the-command-lines-speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.output import check_targets, save_figures, written_by

BENCHMARK_MARK = "lossgraph benchmarks/cli_speed.py"  # in every file the run writes
ROOT = Path(__file__).resolve().parents[1]
RUNS, RUNS_QUICK = 9, 2
#: The modules whose import the table reports (a command line that answers at once
#: imports none of them).
HEAVY = ("numpy", "onnx", "onnxruntime", "torch")
#: The issue's target for --help and every argument or path error (issue 26).
TARGET_S = 0.5


@dataclass(frozen=True)
class Row:
    """One timed command: ``argv`` after ``python``; the exit status and a fragment of its
    output that show it did what the row claims."""

    name: str
    argv: tuple[str, ...]
    status: int
    says: str
    lossgraph: bool = True  # a lossgraph command (else a floor)
    target: bool = True  # held to TARGET_S


def rows(real_run: bool = True) -> list[Row]:
    """The commands and floors, run in a folder holding ``prog`` (a program folder) and
    ``train.npz``, and no ``missing.*``."""
    command = (sys.executable, "-m", "lossgraph")
    listed = [
        Row("lossgraph --help", (*command, "--help"), 0, "usage: lossgraph"),
        Row("lossgraph train --data missing.csv prog", (*command, "train", "--data",
                                                        "missing.csv", "prog"),
            2, "required: -o/--output"),
        Row("lossgraph compile missing.onnx -o x", (*command, "compile", "missing.onnx", "-o",
                                                    "x"), 2, "No ONNX file at 'missing.onnx'"),
        Row("lossgraph train prog --data missing.csv -o out.onnx",
            (*command, "train", "prog", "--data", "missing.csv", "-o", "out.onnx"), 2,
            "There is no data file at 'missing.csv'"),
    ]
    if real_run:
        listed.append(Row("lossgraph train prog --data train.npz -o out.onnx (one epoch)",
                          (*command, "train", "prog", "--data", "train.npz", "-o", "out.onnx",
                           "--force"), 0, "losses by epoch", target=False))
    python = (sys.executable, "-c")
    listed += [
        Row("python -c pass", (*python, "pass"), 0, "", lossgraph=False, target=False),
        Row("import numpy", (*python, "import numpy"), 0, "", lossgraph=False, target=False),
        Row("import onnx", (*python, "import onnx"), 0, "", lossgraph=False, target=False),
        Row("import onnxruntime", (*python, "import onnxruntime"), 0, "", lossgraph=False,
            target=False),
        Row("lossgraph.training_build.import_onnxruntime()",
            (*python, "from lossgraph.training_build import import_onnxruntime; "
                      "import_onnxruntime()"), 0, "", lossgraph=False, target=False),
    ]
    return listed


@dataclass
class Timing:
    """A row's runs: wall and CPU seconds of each, and what the command imported."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    imported: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {"wall_min": min(self.wall), "wall_median": statistics.median(self.wall),
                "cpu_min": min(self.cpu), "cpu_median": statistics.median(self.cpu)}


def timed(row: Row, folder: Path, environment: dict[str, str]) -> tuple[float, float]:
    """One run of ``row``: (wall seconds, the child's CPU seconds), the CPU time read from
    the difference in this process's children's usage (communicate() reaps the child)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(row.argv, cwd=folder, env=environment, capture_output=True,
                            text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = result.stdout + result.stderr
    assert result.returncode == row.status and row.says in output, \
        f"{row.name}: exit {result.returncode}, {output.strip()[:300]}"
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def imported(row: Row, folder: Path, environment: dict[str, str]) -> list[str]:
    """Which of :data:`HEAVY` ``row`` imports: one run under ``python -X importtime``."""
    argv = (row.argv[0], "-X", "importtime", *row.argv[1:])
    result = subprocess.run(argv, cwd=folder, env=environment, capture_output=True, text=True)
    names = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
             if line.startswith("import time:")}
    return [name for name in HEAVY if name in names]


def prepare(folder: Path, environment: dict[str, str]) -> None:
    """A program folder ``prog`` (a 3-feature linear regression) and ``train.npz``."""
    script = (
        "import numpy as np, onnx, lossgraph\n"
        "model = onnx.parser.parse_model('''<ir_version: 8, opset_import: [\"\" : 18]>\n"
        "  g (float[N, 3] x) => (float[N, 1] y) <float[3, 1] w = {1, 2, 3}, float[1] b = {0}>\n"
        "  { h = MatMul(x, w)\n y = Add(h, b) }''')\n"
        "lossgraph.compile_program(model).save('prog')\n"
        "rng = np.random.default_rng(0)\n"
        "X = rng.normal(size=(10, 3)).astype(np.float32)  # (older checkouts took no float64)\n"
        "np.savez('train.npz', X=X, y=X @ np.float32([1.0, 2.0, 3.0]))\n")
    subprocess.run([sys.executable, "-c", script], cwd=folder, env=environment, check=True)


def measure(sources: dict[str, Path], runs: int, real_run: bool = True
            ) -> dict[str, dict[str, Timing]]:
    """Every row of :func:`rows` for the lossgraph of each of ``sources`` (a folder holding
    its package), ``runs`` rounds; each round runs every row of every source once."""
    listed = rows(real_run)
    first = next(iter(sources))  # the floors are timed once, with this checkout
    chosen = {name: [row for row in listed if row.lossgraph or name == first]
              for name in sources}
    with tempfile.TemporaryDirectory(prefix="lossgraph_cli_speed_") as tmp:
        setups = {}
        for index, (name, source) in enumerate(sources.items()):
            environment = {**os.environ, "PYTHONPATH": str(source)}
            environment.pop("LOSSGRAPH_DEBUG", None)
            folder = Path(tmp) / str(index)
            folder.mkdir()
            prepare(folder, environment)
            setups[name] = folder, environment
        measured = {name: {row.name: Timing() for row in chosen[name]} for name in sources}
        for name, (folder, environment) in setups.items():
            for row in chosen[name]:  # one warm-up run each (the file cache), not counted
                timed(row, folder, environment)
                measured[name][row.name].imported = imported(row, folder, environment)
        for _ in range(runs):
            for row in listed:
                for name, (folder, environment) in setups.items():
                    if row.name not in measured[name]:
                        continue
                    wall, cpu = timed(row, folder, environment)
                    measured[name][row.name].wall.append(wall)
                    measured[name][row.name].cpu.append(cpu)
    return measured


def report(measured: dict[str, dict[str, Timing]], runs: int, listed: list[Row]) -> list[str]:
    """Print the table of ``listed`` rows (one column group per checkout); return the
    verdicts on this checkout's rows held to the target."""
    sources = list(measured)
    print(f"\nseconds over {runs} run(s) in fresh processes (least / median), wall and CPU "
          "(user + system of the process)")
    header = f"{'command':62s}" + "".join(
        f" | {name[:30]:^30s}" for name in sources)
    print(header)
    print(f"{'':62s}" + " | wall min  med   CPU min  med  imports" * len(sources))
    verdicts = []
    for row in listed:
        cells = []
        for name in sources:
            timing = measured[name].get(row.name)
            if timing is None:
                cells.append(f" | {'-':^30s}")
                continue
            figures = timing.summary()
            cells.append(f" | {figures['wall_min']:5.2f} {figures['wall_median']:5.2f}  "
                         f"{figures['cpu_min']:6.2f} {figures['cpu_median']:5.2f}  "
                         f"{','.join(timing.imported) or '-'}")
        print(f"{row.name[:62]:62s}" + "".join(cells))
        if row.target:
            timing = measured[sources[0]][row.name]
            median = statistics.median(timing.wall)
            heavy = ", imports onnxruntime" if "onnxruntime" in timing.imported else ""
            verdicts.append(f"{row.name}: median wall {median:.2f} s, CPU "
                            f"{statistics.median(timing.cpu):.2f} s (target < {TARGET_S} s "
                            f"wall): {'met' if median < TARGET_S else 'missed'}{heavy}")
    print()
    for line in verdicts:
        print(line)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {RUNS_QUICK} runs a row, no real training run")
    parser.add_argument("--runs", type=int, help=f"timed runs a row (default {RUNS})")
    parser.add_argument("--compare", type=Path, metavar="PATH",
                        help="another checkout (a folder holding the lossgraph package) to "
                             "time beside this one")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    from benchmarks.machine import cpu_seconds, machine_facts, report_load

    if args.compare is not None and not (args.compare / "lossgraph" / "__init__.py").is_file():
        parser.error(f"--compare {args.compare}: no lossgraph package there")
    check_targets(parser, [args.json], written_by(BENCHMARK_MARK))
    runs = args.runs or (RUNS_QUICK if args.quick else RUNS)
    facts = machine_facts()
    print("the lossgraph command's answer time: --help, argument and path errors, a real run")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    sources = {f"this checkout ({ROOT.name})": ROOT}
    if args.compare is not None:
        sources[f"--compare ({args.compare.resolve().name})"] = args.compare.resolve()
    measured = measure(sources, runs, real_run=not args.quick)
    verdicts = report(measured, runs, rows(real_run=not args.quick))
    wall = time.perf_counter() - started
    print(f"\ntotal wall time {wall:.0f} s")
    report_load(cpu_before, wall, facts)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "runs": runs,
                   "sources": {name: str(path) for name, path in sources.items()},
                   "rows": {name: {row: {**asdict(t), **t.summary()} for row, t in timings.items()}
                            for name, timings in measured.items()},
                   "verdicts": verdicts}
        save_figures(figures, args.json, written_by(BENCHMARK_MARK))
    return 0


if __name__ == "__main__":
    sys.exit(main())
