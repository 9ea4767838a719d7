"""07: train from Parquet files larger than the memory the process is allowed.

A folder of Parquet files is written to a temporary folder: a linear regression with 20
features, 8 files of 100,000 rows by default (64 MB of float32 once decoded). The
Trainer reads it with pyarrow one record batch at a time: ``Trainer.fit`` takes a
function that returns an iterable of ``(X, y)`` batches and calls it once per epoch, so
one batch is in memory at a time, whatever the size of the folder.

The proof is a limit, not a promise: after the first training step (which makes
onnxruntime's sessions and threads), the process caps its address space
(``resource.RLIMIT_AS``, Linux) at what it maps then plus 32 MB, half the data. Training goes
on to the end, reading every file again each epoch; collecting the same batches in a list
then fails with ``MemoryError`` under the same cap. The resident memory after the first
step and its peak through the epochs (``VmHWM``, reset at the first step) are printed
beside the data's size. The fit's R2 on rows none of the files hold is printed beside that
of the true coefficients, the best any fit can score.

Run: python docs/examples/07_out_of_core.py [--files 8] [--rows 100000]
(``--files 200`` writes 1.6 GB and trains on it under the same 32 MB cap: docs/out_of_core.md)
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.parquet as pq

import lossgraph
from lossgraph.optim import SGD

FEATURES = 20
COLUMNS = [f"x{i}" for i in range(FEATURES)]
TRUE_COEF = np.linspace(-2.0, 2.0, FEATURES)
TRUE_INTERCEPT = 0.5
BATCH_ROWS = 10_000
CAP = 32 * 2**20  # address space allowed beyond what the process maps after one step
MB = 2**20

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--files", type=int, default=8)
parser.add_argument("--rows", type=int, default=100_000, help="rows per file")
args = parser.parse_args()


def write_parquet(folder: Path, files: int, rows: int) -> int:
    """``files`` Parquet files of ``rows`` rows of y = x @ TRUE_COEF + TRUE_INTERCEPT + noise,
    written one at a time; returns the bytes the data take once decoded."""
    rng = np.random.default_rng(0)
    for index in range(files):
        X = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        y = X @ TRUE_COEF + TRUE_INTERCEPT + 0.1 * rng.normal(size=rows)
        table = pa.table({**dict(zip(COLUMNS, X.T)), "y": y.astype(np.float32)})
        pq.write_table(table, folder / f"part-{index:04d}.parquet", row_group_size=50_000,
                       use_dictionary=False)
    return files * rows * (FEATURES + 1) * 4


def batches(folder: Path):
    """One pass over every file of ``folder``, one ``(X, y)`` batch at a time."""
    for path in sorted(folder.glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            X = np.column_stack([batch.column(name).to_numpy() for name in COLUMNS])
            yield X, batch.column("y").to_numpy()


def status(field: str) -> int:
    """A size from /proc/self/status in bytes: VmSize (address space mapped now), VmRSS
    (resident now), VmHWM (the most resident since start, or since :func:`reset_peak`)."""
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field))


def reset_peak() -> bool:
    """Start VmHWM again from the resident memory now (Linux 4.0+); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def capped_after_first(items, extra: int):
    """``items`` with the address space capped at its size after the first item is used
    plus ``extra`` bytes; the cap is lifted on leaving (only the soft limit is lowered)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    state = {}

    def capped():
        for item in items():
            yield item
            if not state:  # the first step has run: sessions and threads exist
                state["resident"] = status("VmRSS")
                state["peak_reset"] = reset_peak()
                resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + extra, hard))
                state["capped"] = True

    try:
        yield capped, state
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


if not sys.platform.startswith("linux"):
    sys.exit("This example caps memory with RLIMIT_AS and reads /proc: it needs Linux.")

zeros = ", ".join(["0"] * FEATURES)
model = onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 18]>
    linear (float[N, {FEATURES}] x) => (float[N, 1] y)
    <float[{FEATURES}, 1] coef = {{{zeros}}}, float[1] intercept = {{0}}>
    {{
        h = MatMul(x, coef)
        y = Add(h, intercept)
    }}
""")
trainer = lossgraph.Trainer(lossgraph.compile_program(model, optimizer=SGD(0.05)))

with tempfile.TemporaryDirectory() as name:
    folder = Path(name)
    data_bytes = write_parquet(folder, args.files, args.rows)
    on_disk = sum(path.stat().st_size for path in folder.iterdir())
    print(f"{args.files} Parquet files, {args.files * args.rows:,} rows: {on_disk / MB:.0f} MB "
          f"on disk, {data_bytes / MB:.0f} MB decoded")
    assert data_bytes > 2 * CAP, "the data must exceed the cap for the demonstration"

    with capped_after_first(lambda: batches(folder), CAP) as (stream, cap):
        start = time.perf_counter()
        trainer.fit(stream, epochs=3, progress=False)  # a function: called once per epoch
        seconds = time.perf_counter() - start
        peak = status("VmHWM")
        try:  # the same batches, all kept: more than the cap allows
            everything = [X for X, _ in batches(folder)]
            loaded = f"loaded {sum(X.nbytes for X in everything) / MB:.0f} MB"
        except MemoryError:
            loaded = "MemoryError"
        everything = None

rows = 3 * args.files * args.rows
print(f"trained 3 epochs, {rows:,} rows in {seconds:.1f} s ({rows / seconds:,.0f} rows/s) "
      f"with the address space capped at +{CAP / MB:.0f} MB after the first step")
since = "after the first step" if cap["peak_reset"] else "since the start (VmHWM not reset)"
print(f"resident memory after the first step: {cap['resident'] / MB:.0f} MB (Python, "
      f"onnxruntime, pyarrow); peak {since} through every epoch: {peak / MB:.0f} MB, "
      f"+{(peak - cap['resident']) / MB:.1f} MB for {data_bytes / MB:.0f} MB of data")
print(f"collecting every batch in a list under the same cap: {loaded}")
print(f"train loss by epoch: {', '.join(f'{loss:.4f}' for loss in trainer.train_losses_)}")

assert loaded == "MemoryError", loaded  # the whole data set does not fit under the cap
assert cap["capped"]
if cap["peak_reset"]:  # measured from the first step: training never held the data either
    assert peak - cap["resident"] < CAP
state = trainer.state
np.testing.assert_allclose(state["coef"].ravel(), TRUE_COEF, atol=0.01)
np.testing.assert_allclose(state["intercept"], [TRUE_INTERCEPT], atol=0.01)
# Rows none of the files hold: the fit scores as the true coefficients do (the noise is
# what no fit can predict).
rng = np.random.default_rng(1)
X_test = rng.normal(size=(10_000, FEATURES)).astype(np.float32)
exact = X_test @ TRUE_COEF + TRUE_INTERCEPT
y_test = exact + 0.1 * rng.normal(size=len(X_test))
ours, best = (1 - np.mean((y_test - p) ** 2) / np.var(y_test)
              for p in (trainer.predict(X_test).ravel(), exact))
print(f"held-out R2: lossgraph {ours:.5f}, the true coefficients {best:.5f}")
assert abs(ours - best) < 1e-3, (ours, best)
print("OK: trained on Parquet files larger than the memory allowed, one batch at a time")
