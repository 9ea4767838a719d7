"""How much memory does training take, lossgraph against torch eager? (issue 27)

Each cell runs in a fresh process (``--worker``), under an address-space cap
(``RLIMIT_AS``, what ``prlimit --as`` sets) and killed once its resident set passes
``--memory-limit``, so that one cell cannot take the machine down. A cell imports what it
runs and warms it up on a one-weight model (one compile and step: lazy imports,
onnxruntime's and autograd's first-use costs), loads its model and data, then takes its
**baseline**: the resident set (``VmRSS`` of /proc/self/status) with the peak reset to it
(/proc/self/clear_refs). Its figure is the
peak resident set (``VmHWM``) above that baseline, so it counts protobuf's and
onnxruntime's memory, which tracemalloc does not see, and not the model and data the user
holds anyway. The columns:

- **torch eager**: the network (``eval()``: no dropout, as the export) trained 3 SGD steps
  (learning rate 0.01): ``zero_grad``, forward, loss, ``backward``, ``step``;
- **lossgraph** ``fuse="step"``, ``"epoch"``, ``"separate"``: ``compile_program`` of the
  export (SGD(0.01), the same loss), a ``Trainer``, and 3 steps of ``fit`` (``"epoch"``:
  one epoch of 3 batches, then a second one, timed: its first run opens the session);
- **compile_program alone**: the compile of ``fuse="step"``, and nothing else, as a
  multiple of the weights' size too;
- **recompute="auto"** (``auto``): ``fuse="step"`` with the least memory recomputation
  gives, against torch eager without recomputation;
- **from the file, whole**: ``fuse="step"`` compiled from the export's file, the baseline
  taken before any of the model is read: the whole process's training memory, against
  torch's peak plus what its network holds (``model_mb``, measured as it is built); and
  the same for ``fuse="epoch"`` (``file-epoch``), ``fuse="separate"`` (``file-separate``)
  and ``recompute="auto"``
  (``file-auto``, against torch eager without recomputation).

Beside the peaks, each cell's **step time** (ms, the mean of steps 2 and 3, the first one
opening sessions) and the peak after each step (a peak that grows from step to step is
held memory). The models (float32, random weights nudged so that the exporter ties none,
exported by torch's legacy exporter at opset 17 with a free batch axis, without constant
folding, as lossgraph's FoldedWeightWarning advises: folded, GPT-2's output layer reads a
transposed copy of the token embedding stored as a weight of its own, and training it
trains another, larger model than torch's):

    cnn          benchmarks/model_speed.py's CNN (two Conv2d + ReLU + MaxPool2d, a Linear;
                 1x28x28, 10 outputs, squared error), batch 64
    transformer  model_speed.py's 2-layer encoder (d_model 128, 4 heads, sequence 64, a
                 Linear head, squared error), batch 32
    bert         transformers' BertForSequenceClassification(BertConfig()) (110M
                 parameters, 2 labels, cross entropy of the logits), batch 8 x 128 tokens
    gpt2         transformers' GPT2LMHeadModel(GPT2Config()) (124M parameters; the cross
                 entropy of every next token's logits), batch 4 x 128 tokens

``--quick`` runs tiny versions of all four (a minute or two: each cell starts a process).
``--threads`` sets torch's and onnxruntime's intra-op threads alike. ``--checkout PATH``
measures the lossgraph of another checkout (the figures of today's main beside a
branch's), ``--compare JSON`` shows a previous run's figures beside this one's.

Run from the repository root:
      python -m benchmarks.memory [--quick] [--models cnn,transformer,bert,gpt2]
          [--columns torch,step,epoch,separate,auto,compile,file,file-epoch,file-separate,
                     file-auto]
          [--memory-limit 12] [--threads N]
          [--checkout PATH] [--compare before.json] [--json out.json] [--plot out.png]
See docs/benchmarks.md#memory.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCHMARK_MARK = "lossgraph benchmarks/memory.py"  # in every file the run writes
ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LEARNING_RATE = 0.01
COLUMNS = {"torch": "torch eager", "step": 'lossgraph fuse="step"',
           "epoch": 'fuse="epoch"', "separate": 'fuse="separate"', "auto": 'recompute="auto"',
           "compile": "compile_program alone", "file": 'fuse="step" from the file, whole',
           "file-epoch": 'fuse="epoch" from the file, whole',
           "file-separate": 'fuse="separate" from the file, whole',
           "file-auto": 'recompute="auto" from the file, whole'}
#: The whole-process columns: each compiles the export's file with these options.
WHOLE = {"file": {"fuse": "step"}, "file-epoch": {"fuse": "epoch"},
         "file-separate": {"fuse": "separate"}, "file-auto": {"fuse": "step", "recompute": "auto"}}
#: The other lossgraph columns' compile options (beside ``fuse=column``).
OPTIONS = {"compile": {"fuse": "step"}, "auto": {"fuse": "step", "recompute": "auto"}}
#: Address space a cell may map beyond --memory-limit (threads' stacks, mapped libraries).
ADDRESS_HEADROOM_GIB = 6


# -- the models -------------------------------------------------------------------------
@dataclass(frozen=True)
class Subject:
    """One row: ``network(torch, quick)`` builds the torch module (seeded, weights nudged),
    ``data(rng, rows, quick)`` the inputs and labels, ``batch`` the rows of a step; the loss
    is the squared error of the output, or the cross entropy of logits (``classes``)."""

    name: str
    network: Callable[[Any, bool], Any]
    data: Callable[[np.random.Generator, int, bool], tuple[np.ndarray, np.ndarray]]
    batch: tuple[int, int]  # full, quick
    logits: bool = False

    def rows(self, quick: bool) -> int:
        return self.batch[quick]


def _workload(name: str) -> tuple[Callable, Callable]:
    """model_speed.py's network and data of ``name`` (imported when used: it imports
    lossgraph, which a worker takes from ``--checkout``)."""

    def workload() -> Any:
        from benchmarks.model_speed import WORKLOADS

        return WORKLOADS[name]

    def network(torch: Any, quick: bool) -> Any:
        built = workload()
        return built.build(torch, **(built.quick if quick else built.sizes))

    def data(rng: np.random.Generator, rows: int, quick: bool) -> tuple[np.ndarray, np.ndarray]:
        built = workload()
        sizes = built.quick if quick else built.sizes
        X = rng.random((rows, *built.shape(**sizes)), dtype=np.float32)
        return X, rng.standard_normal((rows, built.outputs(**sizes))).astype(np.float32)

    return network, data


#: Tokens of a row, vocabulary, labels of BERT (full, quick).
TOKENS, BERT_LABELS = (128, 16), 2
_TINY = {"bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=32),
         "gpt2": dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)}


def _transformers(name: str) -> tuple[Callable, Callable]:
    """transformers' BERT-base classifier or GPT-2 small language model, their logits."""

    def network(torch: Any, quick: bool) -> Any:
        import transformers

        options = _TINY[name] if quick else {}
        if name == "bert":
            model = transformers.BertForSequenceClassification(
                transformers.BertConfig(num_labels=BERT_LABELS, **options))
        else:
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(use_cache=False,
                                                                          **options))

        class Logits(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids):  # a mask of ones: the export has no packed rows
                mask = torch.ones_like(input_ids)
                return self.model(input_ids=input_ids, attention_mask=mask).logits

        return Logits()

    def data(rng: np.random.Generator, rows: int, quick: bool) -> tuple[np.ndarray, np.ndarray]:
        vocabulary = _TINY[name]["vocab_size"] if quick else (30522 if name == "bert" else 50257)
        ids = rng.integers(0, vocabulary, size=(rows, TOKENS[quick]))
        if name == "bert":
            return ids, rng.integers(0, BERT_LABELS, size=rows)
        return ids, np.concatenate([ids[:, 1:], rng.integers(0, vocabulary, (rows, 1))], axis=1)

    return network, data


SUBJECTS = {s.name: s for s in (
    Subject("cnn", *_workload("cnn"), batch=(64, 4)),
    Subject("transformer", *_workload("transformer"), batch=(32, 3)),
    Subject("bert", *_transformers("bert"), batch=(8, 2), logits=True),
    Subject("gpt2", *_transformers("gpt2"), batch=(4, 2), logits=True),
)}


def build(subject: Subject, quick: bool) -> tuple[Any, np.ndarray, np.ndarray]:
    """The torch network (seed 0, every weight nudged, in eval mode) and 3 steps of data
    (seed 1)."""
    import torch

    torch.manual_seed(0)
    net = subject.network(torch, quick)
    with torch.no_grad():  # random weights: nudged, or the exporter ties equal initializers
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    X, y = subject.data(np.random.default_rng(1), STEPS * subject.rows(quick), quick)
    return net.eval(), X, y


def export(subject: Subject, quick: bool, folder: Path) -> dict[str, Any]:
    """Write the export and the data of ``subject`` into ``folder``; the size of its weights
    (torch's parameters) and of the export's initializers (the same: unfolded, GPT-2's
    output layer reads the token embedding it is tied to, as in torch)."""
    import onnx
    import torch

    net, X, y = build(subject, quick)
    names = ("input_ids", "logits") if subject.logits else ("x", "y")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(X[:2]),), buffer, dynamo=False,
                          opset_version=17, do_constant_folding=False,
                          input_names=[names[0]], output_names=[names[1]],
                          dynamic_axes={names[0]: {0: "N"}, names[1]: {0: "N"}})
    model = onnx.load_from_string(buffer.getvalue())
    onnx.save(model, folder / f"{subject.name}.onnx")
    np.savez(folder / f"{subject.name}.npz", X=X, y=y)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    stored = sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                 for t in model.graph.initializer)
    return {"weights_mb": weights / 2**20, "stored_mb": stored / 2**20,
            "parameters": sum(p.numel() for p in net.parameters())}


# -- one cell ---------------------------------------------------------------------------
def _memory(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, MiB (imported here: benchmarks.machine
    imports lossgraph, which a worker takes from ``--checkout``)."""
    from benchmarks.machine import process_memory_mb

    return process_memory_mb(field)


def baseline() -> float:
    """The resident set now, the peak reset to it."""
    from benchmarks.machine import reset_peak_memory

    gc.collect()
    reset_peak_memory()
    return _memory("VmRSS")


def _steps(step: Callable[[int], None], base: float) -> dict[str, Any]:
    """``STEPS`` calls of ``step``: the peak after each, the mean time of all but the
    first."""
    peaks, times = [], []
    for index in range(STEPS):
        start = time.perf_counter()
        step(index)
        times.append(time.perf_counter() - start)
        peaks.append(_memory("VmHWM") - base)
    return {"peak_mb": max(peaks), "steps_mb": peaks,
            "step_ms": 1000 * statistics.mean(times[1:])}


def torch_cell(subject: Subject, quick: bool, threads: int | None = None,
               optimizer: Callable[[Any, Any], Any] | None = None,
               adapt: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """3 SGD steps of torch eager (``threads``: torch's intra-op threads; None: its
    default). ``optimizer(torch, parameters)`` makes another optimizer of the parameters
    that require a gradient; ``adapt(network)`` returns the network to train (PEFT's
    wrapper: benchmarks/lora.py), before the baseline. Beside the peak, the parameters
    trained and the optimizer's state after the steps (MiB)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    _torch_warm_up(torch)
    before_model = baseline()
    net, X, y = build(subject, quick)
    if adapt is not None:
        net = adapt(net)
    model_mb = _memory("VmRSS") - before_model  # what the network holds, its weights
    batch = subject.rows(quick)
    X, y = torch.from_numpy(X), torch.from_numpy(y)
    trained = [p for p in net.parameters() if p.requires_grad]
    optimizer = (optimizer or (lambda torch, parameters: torch.optim.SGD(
        parameters, lr=LEARNING_RATE)))(torch, trained)

    def loss(output: Any, target: Any) -> Any:
        if subject.logits:
            return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]),
                                                     target.reshape(-1))
        return ((output - target) ** 2).mean()

    def step(index: int) -> None:
        rows = slice(index * batch, (index + 1) * batch)
        optimizer.zero_grad()
        loss(net(X[rows]), y[rows]).backward()
        optimizer.step()

    figures = _steps(step, baseline())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {**figures, "trained_parameters": sum(p.numel() for p in trained),
            "optimizer_state_mb": sum(t.numel() * t.element_size() for t in state) / 2**20,
            "model_mb": model_mb}


def _torch_warm_up(torch: Any) -> None:
    """One SGD step of a one-weight layer: autograd's and the optimizer's first-use costs
    paid before the baseline."""
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=LEARNING_RATE)
    layer(torch.ones(4, 2)).pow(2).mean().backward()
    optimizer.step()


def lossgraph_warm_up(fuse: str, options: Any) -> None:
    """compile_program and one step of a linear model in the fuse mode ``fuse``: the
    lazy imports (onnxruntime among them) paid before the baseline."""
    import onnx.reference  # noqa: F401  (compile's shape folding imports it where needed)
    from onnx import TensorProto, helper

    import lossgraph

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], "warm_up",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor("W", TensorProto.FLOAT, [2, 1], [0.5, -0.5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    program = lossgraph.compile_program(model, fuse=fuse)
    lossgraph.Trainer(program, session_options=options).fit(
        np.ones((4, 2), np.float32), np.ones((4, 1), np.float32), batch_size=4,
        progress=False)


def compile_loss(subject: Subject) -> dict[str, Any]:
    """compile_program's loss options for ``subject``: torch cells' loss."""
    if subject.logits:
        return {"loss": "multiclass_log_loss", "loss_options": {"from_logits": True}}
    return {"loss": "squared_error"}


def session_options(threads: int | None = None, entries: dict[str, str] | None = None) -> Any:
    """lossgraph's session defaults with ``threads`` intra-op threads (None: onnxruntime's
    default) and the configuration ``entries``: a dict of settings, from which lossgraph
    makes each session's options (so that its sessions read a program's frozen weights
    without a copy), or, for a --checkout older than those, its ``SessionOptions``."""
    threading = {"intra_op_num_threads": threads} if threads else {}
    try:
        from lossgraph.runtime.session import check_session_options
    except ImportError:  # a --checkout older than a dict of settings: lossgraph's defaults
        from lossgraph.runtime.session import quiet_session_options

        options = quiet_session_options(enable_mem_pattern=False, **threading)
        for key, value in (entries or {}).items():
            options.add_session_config_entry(key, value)
        return options
    settings = {**threading, **(entries or {})}
    check_session_options(settings)
    return settings


def lossgraph_cell(subject: Subject, quick: bool, column: str, folder: Path,
                   threads: int | None = None, optimizer: Any = None,
                   session_entries: dict[str, str] | None = None,
                   **options: Any) -> dict[str, Any]:
    """compile_program of the export, then (but ``compile``) 3 steps of a Trainer
    (``threads``: onnxruntime's intra-op threads; None: its default; ``session_entries``:
    its sessions' configuration entries). ``optimizer`` (SGD by default) and ``options`` go
    to compile_program (``adapters=``: benchmarks/lora.py). Beside the peaks: the
    parameters trained and the optimizer's state (MiB), what the process holds once
    compiled (``compiled_mb``: the program) and its peak once the Trainer is made
    (``trainer_peak_mb``)."""

    import lossgraph
    from lossgraph.optim import SGD

    whole = WHOLE.get(column)
    options = {**options, **(whole or OPTIONS.get(column, {"fuse": column}))}
    sessions = session_options(threads, session_entries)
    lossgraph_warm_up(options["fuse"], sessions)
    if whole:  # the file's path alone: the model is lossgraph's to read
        model, data = folder / f"{subject.name}.onnx", np.load(folder / f"{subject.name}.npz")
    else:
        model, data = load_export(subject, folder)
    X, y, batch = data["X"], data["y"], subject.rows(quick)
    base = baseline()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = lossgraph.compile_program(model, optimizer=optimizer or SGD(LEARNING_RATE),
                                            **compile_loss(subject), **options)
    plans = program.manifest.get("recompute", {}).values()
    compiled = {"compile_s": time.perf_counter() - start,
                "compile_peak_mb": _memory("VmHWM") - base,
                "compiled_mb": _memory("VmRSS") - base,
                "trained_parameters": sum(program.state.like(w).size for w in program.weights),
                "optimizer_state_mb": sum(program.state.like(s).nbytes
                                          for s in program.optimizer_states) / 2**20,
                "boundaries": sum(len(plan["boundaries"]) for plan in plans),
                "recomputed": sum(len(plan["recomputed"]) for plan in plans)}
    if column == "compile":
        return {**compiled, "peak_mb": compiled["compile_peak_mb"]}
    trainer = lossgraph.Trainer(program, session_options=sessions)
    compiled["trainer_peak_mb"] = _memory("VmHWM") - base
    del program

    def fit(rows: slice, warm: bool) -> None:
        trainer.fit(X[rows], y[rows], epochs=1, batch_size=batch, shuffle=False,
                    progress=False, warm_start=warm)

    if options["fuse"] == "epoch":  # one run an epoch: the second epoch's runs timed
        fit(slice(None), False)
        first = _memory("VmHWM") - base
        start = time.perf_counter()
        fit(slice(None), True)
        step_ms = 1000 * (time.perf_counter() - start) / STEPS
        peak = _memory("VmHWM") - base
        return {**compiled, "peak_mb": peak, "steps_mb": [first, peak], "step_ms": step_ms,
                "steps": trainer.steps_}
    return {**compiled, **_steps(
        lambda index: fit(slice(index * batch, (index + 1) * batch), index > 0), base),
        "steps": trainer.steps_}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell in this fresh process (``spec``: task, subject, quick, folder, checkout,
    threads)."""
    if spec.get("checkout"):  # that checkout's lossgraph, before anything imports one
        sys.path.insert(0, spec["checkout"])
    subject, quick, folder = SUBJECTS[spec["subject"]], spec["quick"], Path(spec["folder"])
    if spec["task"] == "export":
        return export(subject, quick, folder)
    if spec["task"] == "torch":
        return torch_cell(subject, quick, spec.get("threads"))
    return lossgraph_cell(subject, quick, spec["task"], folder, spec.get("threads"))


def run_worker(spec: dict[str, Any], limit_gib: float, module: str = "benchmarks.memory"
               ) -> dict[str, Any]:
    """``module``'s ``worker`` (this one's, :func:`worker`) in a fresh interpreter, its
    address space capped and killed once its resident set passes ``limit_gib``; a failure is
    the cell's ``error``."""
    from benchmarks.machine import run_capped_worker

    return run_capped_worker(module, spec, limit_gib,
                             address_gib=limit_gib + ADDRESS_HEADROOM_GIB)


def load_export(subject: Subject, folder: Path) -> tuple[Any, dict[str, np.ndarray]]:
    """``subject``'s export in ``folder`` (:func:`export` wrote it) and its data (``X``,
    ``y``)."""
    import onnx

    data = np.load(folder / f"{subject.name}.npz")
    return onnx.load(folder / f"{subject.name}.onnx"), {"X": data["X"], "y": data["y"]}


def run_cells(models: Sequence[str], columns: Sequence[str], spec: dict[str, Any],
              limit_gib: float, run: Callable[[dict[str, Any], float], dict[str, Any]],
              shown: Callable[[dict[str, Any], str], str]
              ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each model exported by a fresh process into a temporary folder, then each column's
    cell, ``run(spec, limit_gib)`` (``spec`` with the task, subject and folder), its line
    ``shown(row, column)`` printed as it comes; the rows by model, and the models skipped
    (their export failed)."""
    cells: dict[str, dict[str, Any]] = {}
    skipped = []
    with tempfile.TemporaryDirectory(prefix="lossgraph_cells_") as folder:
        for name in models:
            model_spec = {**spec, "subject": name, "folder": folder}
            exported = run_worker({**model_spec, "task": "export"}, limit_gib)
            if "error" in exported:
                skipped.append(f"{name}: skipped (export {exported['error']})")
                continue
            cells[name] = dict(exported)
            for column in columns:
                cells[name][column] = run({**model_spec, "task": column}, limit_gib)
                print(f"  {name} {column}: {shown(cells[name], column)}", flush=True)
    return cells, skipped


# -- the report -------------------------------------------------------------------------
def _mib(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def cell_text(cells: dict[str, Any], column: str, before: dict[str, Any] | None) -> str:
    """A peak with its ratio to torch's (compile: to the weights), and ``before``'s."""
    record = cells.get(column, {})
    if "peak_mb" not in record:
        return record.get("error", "-")
    text = _mib(record["peak_mb"])
    torch = cells.get("torch", {}).get("peak_mb", 0)
    if column == "compile" and cells["weights_mb"] > 0:
        text += f" ({record['peak_mb'] / cells['weights_mb']:.2f}x the weights"
        stored = cells.get("stored_mb")
        text += f", {record['peak_mb'] / stored:.2f}x stored)" if stored else ")"
    elif column in WHOLE:  # the whole process: torch's network counts
        whole = torch + cells.get("torch", {}).get("model_mb", 0)
        if whole > 0:
            text += f" ({record['peak_mb'] / whole:.2f}x torch's {_mib(whole)} with its network)"
    elif column not in ("torch", "compile") and torch > 0:  # a tiny model's may round to 0
        text += f" ({record['peak_mb'] / torch:.2f}x)"
    was = (before or {}).get(column, {})
    return f"{text}, was {_mib(was['peak_mb'])}" if "peak_mb" in was else text


def report(cells: dict[str, dict[str, Any]], columns: list[str],
           before: dict[str, dict[str, Any]] | None = None) -> None:
    """The peaks' table, the step times' table, and each step's peak."""
    print("\npeak resident memory above the baseline, MiB (ratio to torch eager's)")
    print("| model (weights) | " + " | ".join(COLUMNS[c] for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in cells.items():
        print(f"| {name} ({_mib(row['weights_mb'])} MiB) | " + " | ".join(
            cell_text(row, c, (before or {}).get(name)) for c in columns) + " |")
    timed = [c for c in columns if c != "compile"]
    print("\nstep time, ms (ratio to torch eager's); compile_program alone: seconds")
    print("| model | " + " | ".join(COLUMNS[c] for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in cells.items():
        torch_ms = row.get("torch", {}).get("step_ms")
        texts = []
        for column in columns:
            if column == "compile":
                seconds = row.get("compile", {}).get("compile_s")
                texts.append("-" if seconds is None else f"{seconds:.1f} s")
                continue
            ms = row.get(column, {}).get("step_ms")
            texts.append("-" if ms is None else f"{ms:,.1f}" + (
                f" ({ms / torch_ms:.2f}x)" if torch_ms and column != "torch" else ""))
        print(f"| {name} | " + " | ".join(texts) + " |")
    print("\npeak after each step (MiB; epoch: after each epoch):")
    for name, row in cells.items():
        print(f"  {name}: " + "; ".join(
            f"{c} " + " -> ".join(_mib(v) for v in row[c]["steps_mb"])
            for c in timed if "steps_mb" in row.get(c, {})))


def plot(cells: dict[str, dict[str, Any]], columns: list[str], path: str,
         before: dict[str, dict[str, Any]] | None = None) -> None:
    """Each model's peaks by column as bars (``before``'s hatched beside them), the weights'
    size a line (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n--plot {path}: matplotlib is not installed, no plot written")
        return
    from benchmarks.output import save_figure

    figure, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 4.2), squeeze=False)
    for axis, (name, row) in zip(axes[0], cells.items()):
        positions = np.arange(len(columns))
        now = [row.get(c, {}).get("peak_mb", 0) for c in columns]
        width = 0.4 if before else 0.8
        if before:
            was = [before.get(name, {}).get(c, {}).get("peak_mb", 0) for c in columns]
            axis.bar(positions - width / 2, was, width, color="lightgray", hatch="//",
                     edgecolor="gray", label="lossgraph before")
        for torch_column, color, label in ((True, "tab:orange", "torch eager"),
                                           (False, "tab:blue", "lossgraph now" if before
                                            else "lossgraph")):
            shown = [i for i, c in enumerate(columns) if (c == "torch") == torch_column]
            axis.bar(positions[shown] + (width / 2 if before else 0),
                     [now[i] for i in shown], width, color=color, label=label)
        axis.axhline(row["weights_mb"], color="black", linestyle=":", label="weights")
        ticks = {"compile": "compile alone", "file": "step, file", "file-epoch": "epoch, file",
                 "file-separate": "separate, file", "file-auto": "auto, file"}
        axis.set_xticks(positions, [ticks.get(c, c) for c in columns], fontsize=8,
                        rotation=40, ha="right")
        axis.set(title=f"{name} ({_mib(row['weights_mb'])} MiB of weights)",
                 ylabel="peak above baseline (MiB)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    save_figure(figure, path, BENCHMARK_MARK)
    print(f"\nplot written to {path}")


# -- the command line -------------------------------------------------------------------
def cells_parser(description: str, models: Sequence[str], columns: Sequence[str]
                 ) -> argparse.ArgumentParser:
    """The command line of a benchmark of cells in fresh processes (this one,
    benchmarks/lora.py): ``--quick``, ``--models``, ``--columns``, ``--memory-limit``,
    ``--threads``, ``--json`` and the internal ``--worker``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny models")
    parser.add_argument("--models", default=",".join(models),
                        help="comma-separated, of " + ", ".join(models))
    parser.add_argument("--columns", default=",".join(columns),
                        help="comma-separated, of " + ", ".join(columns))
    parser.add_argument("--memory-limit", type=float, default=12.0, metavar="GIB",
                        help="kill a cell whose process holds more than this (default 12)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads of torch and onnxruntime (default: theirs)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--worker", metavar="SPEC", help="internal: one cell, printed as JSON")
    return parser


def chosen_cells(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 models: Sequence[str], columns: Sequence[str]) -> tuple[list[str], list[str]]:
    """The models and columns ``args`` names, each known, else the command line's error."""
    chosen = ([m for m in args.models.split(",") if m], [c for c in args.columns.split(",") if c])
    for names, known, what in zip(chosen, (models, columns), ("model", "column")):
        unknown = set(names) - set(known)
        if unknown:
            parser.error(f"unknown {what} {sorted(unknown)[0]!r}: choose of {', '.join(known)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = cells_parser(__doc__.split("\n\n")[0], list(SUBJECTS), list(COLUMNS))
    parser.add_argument("--checkout", metavar="PATH",
                        help="measure the lossgraph of this checkout (default: this one)")
    parser.add_argument("--compare", metavar="JSON",
                        help="a previous run's figures (--json), shown beside these")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from benchmarks.machine import cpu_seconds, machine_facts, report_run
    from benchmarks.output import check_targets, save_figures, written_by

    models, columns = chosen_cells(parser, args, list(SUBJECTS), list(COLUMNS))
    check_targets(parser, [args.json, args.plot], written_by(BENCHMARK_MARK))
    before = json.loads(Path(args.compare).read_text())["cells"] if args.compare else None
    checkout = str(Path(args.checkout).resolve()) if args.checkout else None
    facts = machine_facts()
    print("memory of training, lossgraph against torch eager: peak resident set above the "
          f"baseline, {STEPS} SGD steps, float32" + (f", lossgraph of {checkout}" if checkout
                                                     else ""))
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), cpu_seconds()
    cells, skipped = run_cells(
        models, columns, {"quick": args.quick, "checkout": checkout, "threads": args.threads},
        args.memory_limit, run_worker, lambda row, column: cell_text(row, column, None))
    report(cells, columns, before)
    report_run(started, cpu_before, facts, skipped)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "quick": args.quick,
                   "steps": STEPS, "threads": args.threads, "checkout": checkout or str(ROOT),
                   "memory": "peak resident set (VmHWM) above the baseline taken after "
                   "imports and data (VmRSS), MiB", "cells": cells, "skipped": skipped}
        save_figures(figures, args.json, written_by(BENCHMARK_MARK))
    if args.plot:
        plot(cells, columns, args.plot, before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
