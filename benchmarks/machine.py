"""What a run ran on: the machine's facts, how busy other processes kept it, and a process's
memory (a cell run in a fresh process of its own, capped: :func:`run_worker`)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import lossgraph
from lossgraph import training_build


def machine_facts() -> dict[str, str]:
    """Cores, load, and the version of Python and of every library the run uses."""
    facts = {"cores": str(os.cpu_count()), "python": platform.python_version(),
             "platform": platform.platform(terse=True), "numpy": np.__version__,
             "onnx": onnx.__version__}
    with contextlib.suppress(OSError, AttributeError):
        facts["load average (1 min)"] = f"{os.getloadavg()[0]:.2f}"
    try:
        import onnxruntime
    except ImportError:
        facts["onnxruntime"] = "not installed"
    else:
        training = training_build.available()
        distribution = "onnxruntime-training-cpu" if training else "onnxruntime"
        facts["onnxruntime"] = (f"{onnxruntime.__version__} ({distribution}, training build: "
                                f"{'yes' if training else 'no'})")
    for package in ("torch", "scikit-learn", "skl2onnx"):
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            facts[package] = "not installed"
    facts["lossgraph"] = lossgraph.__version__
    return facts


def report_load(cpu_before: tuple[float, float] | None, wall: float,
                facts: dict[str, str]) -> None:
    """Print (and record in ``facts``) how busy other processes kept the machine since
    ``cpu_before`` (:func:`cpu_seconds`), warning when the figures are unreliable."""
    cpu_after = cpu_seconds()
    if not (cpu_before and cpu_after):
        return
    others = max(0.0, (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1]))
    facts["other processes' CPU load during the run (cores)"] = f"{others / wall:.2f}"
    warning = ("  WARNING: the machine was busy, figures are unreliable: rerun on a quiet "
               "machine" if others / wall > 0.25 else "")
    print(f"other processes kept {others / wall:.2f} of {os.cpu_count()} cores busy "
          f"during the run{warning}")


def report_run(started: float, cpu_before: tuple[float, float] | None,
               facts: dict[str, str], skipped: Sequence[str] = ()) -> None:
    """Print what a run skipped, its total wall time since ``started``
    (``time.perf_counter()``) and how busy other processes kept the machine
    (:func:`report_load`)."""
    for line in skipped:
        print(f"  {line}")
    wall = time.perf_counter() - started
    print(f"\ntotal wall time {wall:.0f} s")
    report_load(cpu_before, wall, facts)


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process), Linux only."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    times = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), times.user + times.system


def process_memory_mb(field: str, pid: int | str = "self") -> float:
    """``VmRSS`` (resident set now) or ``VmHWM`` (its peak) of this process (or of process
    ``pid``), in MiB; NaN where ``/proc`` has no such file (a process gone). (``ru_maxrss``
    would not do: Linux keeps it across exec, so a worker would report the peak of the
    parent that started it.)"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_memory() -> None:
    """Start this process's ``VmHWM`` over from its resident set now (Linux 4.0 and later:
    ``/proc/self/clear_refs``), so that the peak counts what comes next; nothing elsewhere."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def run_capped_worker(module: str, spec: dict[str, Any], limit_gib: float,
               address_gib: float | None = None) -> dict[str, Any]:
    """``python -m module --worker SPEC`` in a fresh interpreter from the repository root:
    the figures it prints as JSON on its last line. It is killed once its resident set
    passes ``limit_gib`` (checked every 20 ms from here: a worker may hold its interpreter
    in native code), and its address space is capped at ``address_gib`` where given
    (``RLIMIT_AS``, as ``prlimit --as``); a failure is the cell's ``error``."""
    root = Path(__file__).resolve().parents[1]

    def capped() -> None:
        cap = int(address_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    command = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, cwd=root,
                                 env={**os.environ, "PYTHONPATH": str(root)},
                                 preexec_fn=capped if address_gib else None)
        while child.poll() is None:
            if process_memory_mb("VmRSS", child.pid) > limit_gib * 1024:
                child.kill()
                child.wait()
                return {"error": f"over {limit_gib:g} GiB"}
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        if child.returncode or not lines:
            last = (err.read().strip().splitlines() or ["no output"])[-1]
            return {"error": f"worker exited {child.returncode}: {last[:300]}"}
    return json.loads(lines[-1])
