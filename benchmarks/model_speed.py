"""How fast does lossgraph train the networks people train, next to torch eager?

Times minibatch SGD steps (learning rate 0.01, mean squared error, no momentum) of six
torch networks, each trained by torch eager and, exported by torch's legacy exporter
(opset 17, free batch axis), by ``lossgraph.compile_program(..., optimizer=SGD(0.01),
fuse=mode)`` and ``Trainer.fit`` in the ``step`` and ``epoch`` fuse modes:

    cnn          two Conv2d(3x3, pad 1) + ReLU + MaxPool2d(2), a Linear: 1x28x28 inputs,
                 16 and 32 channels, 10 outputs, batch 64
    transformer  nn.TransformerEncoder: 2 layers, d_model 128, 4 heads, feed-forward 512,
                 no dropout, sequence 64, a Linear head averaged over the sequence,
                 batch 32
    resnet       a ResNet basic block: a Conv-BN-ReLU stem, then Conv-BN-ReLU-Conv-BN plus
                 the skip, ReLU, global average pooling and a Linear: 3x32x32 inputs,
                 16 channels, 10 outputs, batch 32; BatchNorm in training mode (exported
                 with TrainingMode.TRAINING, running statistics updated as torch does)
    lstm         nn.LSTM (32 features, 128 hidden, batch_first) over 32 steps, a Linear
                 head on the last step, batch 32
    resnet18     torchvision's ResNet-18 (built from code, no download): 3x32x32 inputs,
                 10 outputs, batch 4; BatchNorm in training mode as for ``resnet``
    mobilenet_v3 torchvision's MobileNetV3-Small (dropout 0, so that both sides compute
                 the same): 3x32x32 inputs, 10 outputs, batch 4; BatchNorm in training mode

Every candidate runs in this one process on the same data and batches, from the same
initial weights, with the same number of threads (``--threads``: torch's
``set_num_threads`` and onnxruntime's ``intra_op_num_threads``). Each candidate first
trains one warm-up epoch of ``--steps`` steps (sessions, caches); its weights are then
checked against torch's after the same steps (``check``: the largest absolute difference
of any weight or running statistic, beside how far torch's moved in those steps; after one
step for ResNet-18 and MobileNetV3, whose training at batch 4 is chaotic: their last blocks
normalize 4 values a channel, and float32 rounding grows ~40x a step in torch itself, 1e-5
after one step and 5e-2 after three, float32 against float64). Then
``--repeat`` rounds each time one epoch of every candidate in turn (each after
``SETTLE_S`` of untimed epochs of the same one, so that no other candidate's spinning
threads share the cores), so that a burst of load from another process falls on all of
them. A cell is the median of its rounds, in ms per
step, with its ratio to torch's.

Two **floor** rows per workload, timed in the same rounds (:mod:`benchmarks.kernel_floor`):
``onnxruntime heavy kernels only`` runs the convolutions and products of the ``step``
candidate's own step graph alone (in one session with its options, fed the values a step
feeds them), ``torch heavy kernels only`` the same kernels as torch ops (``F.conv2d`` and
``convolution_backward``, the linear layers' and attention's products) on tensors of the
step's shapes. Neither trains; each is what its runtime needs at least for a step, and the
line under the table says whether onnxruntime's leaves room for the target.

``--clock cpu`` times the CPU seconds of this process instead of the wall clock: with
``--threads 1`` every candidate computes in this thread, and the figure is its work, far
less disturbed by other processes on a busy machine than wall time.

Run from the repository root:
      python -m benchmarks.model_speed [--quick] [--workloads cnn,transformer,resnet,lstm,...]
          [--steps 20] [--repeat 7] [--threads 2] [--clock wall|cpu] [--json out.json]
Without torch (onnxruntime 1.32's environment) it times the models saved by a run with
``--save-models DIR`` (``--models DIR``), lossgraph alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import lossgraph
from benchmarks.harness import SETTLE_S
from benchmarks.kernel_floor import heavy_kernel_floor, step_graph, torch_heavy_kernels
from benchmarks.machine import cpu_seconds, machine_facts, report_load
from benchmarks.output import check_targets, save_figure, written_by
from lossgraph.errors import UnsupportedModelError
from lossgraph.fileio import write_file
from lossgraph.optim import SGD
from lossgraph.runtime.session import create_session

BENCHMARK_MARK = "lossgraph benchmarks/model_speed.py"  # in every file the run writes
LEARNING_RATE = 0.01
MODES = ("step", "epoch")
TORCH = "torch eager"
STEP = "lossgraph fuse=step"
#: The floors (module doc): each runtime's heavy kernels of a step, nothing else.
ONNXRUNTIME_FLOOR = "onnxruntime heavy kernels only"
TORCH_FLOOR = "torch heavy kernels only"
FLOORS = (ONNXRUNTIME_FLOOR, TORCH_FLOOR)
#: Target (issue 17): a lossgraph training step at most this times torch eager's.
TARGET = 0.8
#: Target (issue 27): ResNet-18's step at most this times torch eager's.
RESNET18_TARGET = 1.3
#: A check above this (float32 rounding over a few steps is about 1e-6) prints DIFFERS.
CHECK_LIMIT = 1e-4


# -- the workloads ---------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A torch network and its data: ``build(torch, **sizes)`` makes the network,
    ``shape(**sizes)`` is one row's shape; ``sizes`` (and ``quick``, tiny ones for smoke
    tests) hold the batch and the layer sizes."""

    name: str
    build: Callable[..., Any]
    shape: Callable[..., tuple[int, ...]]
    outputs: Callable[..., int]
    sizes: dict[str, int]
    quick: dict[str, int]
    #: exported with TrainingMode.TRAINING (BatchNormalization's batch statistics)
    training_mode: bool = False
    #: the target for lossgraph's step (issue 17: TARGET, 27: RESNET18_TARGET), as a ratio
    #: to torch eager's (None: none)
    target: float | None = None
    #: steps before the check (None: the warm-up epoch's): fewer where training is chaotic
    check_steps: int | None = None


def _cnn(torch, side: int, c1: int, c2: int, classes: int, batch: int):
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(c2 * (side // 4) ** 2, classes))


def transformer_encoder(torch, d_model: int, heads: int, ff: int, length: int, batch: int):
    nn = torch.nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, 1)

        def forward(self, x):
            return self.head(self.encoder(x)).mean(dim=1)

    return Encoder()


def _resnet(torch, side: int, channels: int, classes: int, batch: int):
    nn = torch.nn

    def conv_bn(inputs: int) -> list:
        return [nn.Conv2d(inputs, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(*conv_bn(3), nn.ReLU())
            self.residual = nn.Sequential(*conv_bn(channels), nn.ReLU(), *conv_bn(channels))
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(channels, classes))

        def forward(self, x):
            x = self.stem(x)
            return self.head(torch.relu(self.residual(x) + x))

    return Block()


def _lstm(torch, features: int, hidden: int, length: int, batch: int):
    nn = torch.nn

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, batch_first=True)
            self.head = nn.Linear(hidden, 1)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    return Recurrent()


def _resnet18(torch, side: int, classes: int, batch: int):
    import torchvision

    return torchvision.models.resnet18(num_classes=classes)


def _mobilenet_v3(torch, side: int, classes: int, width: int, batch: int):
    """MobileNetV3-Small at ``width`` percent of its channels."""
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=classes, dropout=0.0,
                                                 width_mult=width / 100)


def _image(side: int, **_: int) -> tuple[int, ...]:
    return (3, side, side)


def _classes(classes: int, **_: int) -> int:
    return classes


WORKLOADS = {w.name: w for w in (
    Workload("cnn", _cnn, lambda side, **_: (1, side, side), lambda classes, **_: classes,
             dict(side=28, c1=16, c2=32, classes=10, batch=64),
             dict(side=8, c1=2, c2=3, classes=2, batch=4), target=TARGET),
    Workload("transformer", transformer_encoder, lambda d_model, length, **_: (length, d_model),
             lambda **_: 1, dict(d_model=128, heads=4, ff=512, length=64, batch=32),
             dict(d_model=8, heads=2, ff=16, length=4, batch=3), target=TARGET),
    Workload("resnet", _resnet, lambda side, **_: (3, side, side), lambda classes, **_: classes,
             dict(side=32, channels=16, classes=10, batch=32),
             dict(side=6, channels=3, classes=2, batch=4), training_mode=True),
    Workload("lstm", _lstm, lambda features, length, **_: (length, features), lambda **_: 1,
             dict(features=32, hidden=128, length=32, batch=32),
             dict(features=3, hidden=4, length=5, batch=3)),
    Workload("resnet18", _resnet18, _image, _classes, dict(side=32, classes=10, batch=4),
             dict(side=32, classes=2, batch=4), training_mode=True, target=RESNET18_TARGET,
             check_steps=1),
    Workload("mobilenet_v3", _mobilenet_v3, _image, _classes,
             dict(side=32, classes=10, width=100, batch=4),
             dict(side=32, classes=2, width=25, batch=2), training_mode=True, check_steps=1),
)}


@dataclass
class Problem:
    """One workload ready to train: its export, data and, with torch, the network (at the
    export's weights, which both sides start from)."""

    workload: Workload
    sizes: dict[str, int]
    model: onnx.ModelProto
    X: np.ndarray
    y: np.ndarray
    net: Any = None  # the torch network, None without torch

    @property
    def batch(self) -> int:
        return self.sizes["batch"]


def make_problem(workload: Workload, steps: int, quick: bool) -> Problem:
    """The workload's network (seed 0, every weight nudged so that the exporter ties none
    of them), its export and ``steps`` batches of data (seed 1)."""
    import torch

    sizes = workload.quick if quick else workload.sizes
    torch.manual_seed(0)
    net = workload.build(torch, **sizes)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    net.train()
    rng = np.random.default_rng(1)
    rows = steps * sizes["batch"]
    X = rng.random((rows, *workload.shape(**sizes)), dtype=np.float32)
    y = rng.standard_normal((rows, workload.outputs(**sizes))).astype(np.float32)
    return Problem(workload, sizes, _export(torch, net, X[:2], workload.training_mode), X, y,
                   net)


def _export(torch, net, example: np.ndarray, training_mode: bool) -> onnx.ModelProto:
    """``net`` by torch's legacy exporter: opset 17, free batch axis, no constant folding
    (the weights keep torch's names)."""
    buffer = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if training_mode else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(example),), buffer, dynamo=False,
                          opset_version=17, training=mode, do_constant_folding=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    net.train()  # the exporter puts the module back as it found it; make sure
    return onnx.load_from_string(buffer.getvalue())


def save_problem(problem: Problem, directory: Path) -> None:
    """The export and the data, for a run without torch (``--models``)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = problem.workload.name
    onnx.save(problem.model, directory / f"{name}.onnx")
    np.savez(directory / f"{name}.npz", X=problem.X, y=problem.y,
             sizes=json.dumps(problem.sizes), mark=BENCHMARK_MARK)


def load_problem(workload: Workload, directory: Path, steps: int) -> Problem:
    """A problem saved by :func:`save_problem`, its data cut to ``steps`` batches."""
    saved = np.load(directory / f"{workload.name}.npz")
    sizes = json.loads(str(saved["sizes"]))
    rows = steps * sizes["batch"]
    if len(saved["X"]) < rows:
        raise SystemExit(f"{directory} holds {len(saved['X'])} rows of {workload.name}, "
                         f"fewer than {steps} steps of {sizes['batch']}: save more steps.")
    return Problem(workload, sizes, onnx.load(directory / f"{workload.name}.onnx"),
                   saved["X"][:rows], saved["y"][:rows])


# -- what the check compares ------------------------------------------------------------


def torch_state(problem: Problem) -> dict[str, np.ndarray]:
    """The torch network's weights and running statistics under the export's names: its
    state-dict keys, and for an LSTM the ONNX node's W, R and B, which the exporter builds
    from torch's weights with the gates reordered (torch i, f, g, o; ONNX i, o, f, c)."""
    state = {name: value.detach().numpy().copy()
             for name, value in problem.net.state_dict().items()
             if not name.endswith("num_batches_tracked")}
    initializers = {t.name for t in problem.model.graph.initializer}
    lstms = [m for m in problem.net.modules() if type(m).__name__ == "LSTM"]
    nodes = [n for n in problem.model.graph.node if n.op_type == "LSTM"]
    for module, node in zip(lstms, nodes):
        def gates(value) -> np.ndarray:
            i, f, g, o = np.split(value.detach().numpy(), 4)
            return np.concatenate([i, o, f, g])[None]
        state[node.input[1]] = gates(module.weight_ih_l0)
        state[node.input[2]] = gates(module.weight_hh_l0)
        state[node.input[3]] = np.concatenate([gates(module.bias_ih_l0),
                                               gates(module.bias_hh_l0)], axis=1)
    return {name: value for name, value in state.items() if name in initializers}


def weights_difference(trainer: lossgraph.Trainer, expected: dict[str, np.ndarray]
                       ) -> tuple[float, int, int]:
    """(largest |lossgraph - torch| over the weights and running statistics both have,
    how many were compared, how many the trainer holds)."""
    state = trainer.state
    weights = [entry["name"] for entry in trainer.program.manifest["weights"]]
    compared = [name for name in state if name in expected]
    largest = max((float(np.abs(state[n].reshape(expected[n].shape) - expected[n]).max())
                   for n in compared), default=float("nan"))
    return largest, len([n for n in weights if n in expected]), len(weights)


# -- the candidates ---------------------------------------------------------------------

#: One epoch of a candidate; ``epoch(steps)`` trains the first ``steps`` batches only.
Epoch = Callable[..., None]


def torch_candidate(problem: Problem, threads: int) -> Epoch:
    """``steps`` steps of torch eager: zero_grad, MSE, backward, SGD step, per batch."""
    import torch

    torch.set_num_threads(threads)
    net, batch = problem.net, problem.batch
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
    X, y = torch.from_numpy(problem.X), torch.from_numpy(problem.y)

    def epoch(steps: int | None = None) -> None:
        for start in range(0, len(X) if steps is None else steps * batch, batch):
            optimizer.zero_grad()
            loss = ((net(X[start:start + batch]) - y[start:start + batch]) ** 2).mean()
            loss.backward()
            optimizer.step()

    return epoch


def lossgraph_candidate(problem: Problem, mode: str, threads: int
                        ) -> tuple[Epoch, lossgraph.Trainer]:
    """``Trainer.fit`` of one epoch (every batch, in order) of the program compiled with
    SGD in the fuse ``mode``; onnxruntime with ``threads`` intra-op threads."""
    program = lossgraph.compile_program(problem.model, optimizer=SGD(LEARNING_RATE), fuse=mode)
    trainer = lossgraph.Trainer(program, session_options={"intra_op_num_threads": threads})

    def epoch(steps: int | None = None) -> None:
        rows = len(problem.X) if steps is None else steps * problem.batch
        trainer.fit(problem.X[:rows], problem.y[:rows], epochs=1, batch_size=problem.batch,
                    shuffle=False, progress=False, warm_start=trainer.steps_ > 0)

    return epoch, trainer


def onnxruntime_floor(problem: Problem, trainer: lossgraph.Trainer | None
                      ) -> tuple[Epoch, str]:
    """``steps`` runs of the heavy kernels alone of the step graph ``trainer`` (the step
    candidate's) runs, in one session with its options, inputs and outputs bound once (as
    the trainer binds its own); and what they are."""
    if trainer is None:
        raise UnsupportedModelError(f"needs {STEP}")
    data = {"feature": problem.X[:problem.batch], "label": problem.y[:problem.batch]}
    floor = heavy_kernel_floor(*step_graph(trainer.program, data, LEARNING_RATE))
    session = create_session(floor.model, trainer.providers, trainer.session_options)
    return BoundRuns(session, floor.feeds, len(problem.X) // problem.batch), floor.describe()


class BoundRuns:
    """``steps`` runs of ``session`` on ``feeds``, its inputs and outputs bound once to
    arrays held here (the OrtValues alias them)."""

    def __init__(self, session: Any, feeds: dict[str, np.ndarray], steps: int) -> None:
        import onnxruntime

        self.steps, self.session, self.binding = steps, session, session.io_binding()
        self.inputs = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        self.outputs = dict(zip((o.name for o in session.get_outputs()),
                                session.run(None, self.inputs)))
        self.values = {name: onnxruntime.OrtValue.ortvalue_from_numpy(array) for name, array
                       in (*self.inputs.items(), *self.outputs.items())}
        for name in self.inputs:
            self.binding.bind_ortvalue_input(name, self.values[name])
        for name in self.outputs:
            self.binding.bind_ortvalue_output(name, self.values[name])

    def __call__(self) -> None:
        for _ in range(self.steps):
            self.session.run_with_iobinding(self.binding)


def torch_floor(problem: Problem) -> tuple[Epoch, str]:
    """``steps`` times the heavy kernels of torch's step alone, called directly; and what
    they are."""
    if problem.net is None:
        raise UnsupportedModelError("needs torch")
    kernels = torch_heavy_kernels(problem.net, problem.X[:problem.batch])
    steps = len(problem.X) // problem.batch

    def epoch() -> None:
        for _ in range(steps):
            kernels.step()

    return epoch, kernels.describe()


# -- the run -----------------------------------------------------------------------------


@dataclass
class Result:
    """One workload's figures: ms per step by candidate, and the checks."""

    workload: str
    sizes: dict[str, int]
    steps: int
    target: float | None = None
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    setup_s: dict[str, float] = field(default_factory=dict)
    checks: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    #: what each floor runs or, when it has no samples, why it is not there
    floors: dict[str, str] = field(default_factory=dict)

    def median(self, name: str) -> float | None:
        samples = self.samples_ms.get(name)
        return statistics.median(samples) if samples else None

    def ratio(self, name: str, to: str = TORCH) -> float | None:
        ours, theirs = self.median(name), self.median(to)
        return ours / theirs if ours is not None and theirs else None

    def bound(self) -> dict[str, float | None]:
        """The floors against torch's step and onnxruntime's against lossgraph's."""
        return {"onnxruntime_floor_to_torch": self.ratio(ONNXRUNTIME_FLOOR),
                "onnxruntime_floor_to_step": self.ratio(ONNXRUNTIME_FLOOR, STEP),
                "torch_floor_to_torch": self.ratio(TORCH_FLOOR), "target": self.target}


def _settle(epoch: Epoch) -> None:
    """Untimed epochs of one candidate for SETTLE_S seconds (one at least)."""
    start = time.perf_counter()
    epoch()
    while time.perf_counter() - start < SETTLE_S:
        epoch()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def run_workload(problem: Problem, steps: int, repeat: int, threads: int,
                 clock: str = "wall") -> Result:
    """Set up every candidate, train its warm-up epoch and check it, then time
    ``repeat`` rounds (module doc)."""
    result = Result(problem.workload.name, problem.sizes, steps, problem.workload.target)
    checked = min(steps, problem.workload.check_steps or steps)
    epochs: dict[str, Epoch] = {}
    trainers: dict[str, lossgraph.Trainer] = {}
    if problem.net is not None:
        epochs[TORCH] = torch_candidate(problem, threads)
    for mode in MODES:
        name = f"lossgraph fuse={mode}"
        start = time.perf_counter()
        try:
            epochs[name], trainers[name] = lossgraph_candidate(problem, mode, threads)
            epochs[name](checked)  # the warm-up: sessions made, the check's steps
        except Exception as error:  # one candidate must not end the run
            result.errors[name] = f"{type(error).__name__}: {error!s:.300}"
            epochs.pop(name, None)
            continue
        result.setup_s[name] = time.perf_counter() - start
    if TORCH in epochs:
        initial = torch_state(problem)
        epochs[TORCH](checked)  # its warm-up: the same steps from the same weights
        expected = torch_state(problem)
        moved = max(float(np.abs(expected[n] - initial[n]).max()) for n in expected)
        for name, trainer in trainers.items():
            largest, compared, weights = weights_difference(trainer, expected)
            result.checks[name] = {"max_abs_difference": largest, "weights_compared": compared,
                                   "weights": weights, "torch_moved": moved}
    floors = {ONNXRUNTIME_FLOOR: lambda: onnxruntime_floor(problem, trainers.get(STEP)),
              TORCH_FLOOR: lambda: torch_floor(problem)}
    for name, make in floors.items():
        try:
            epochs[name], result.floors[name] = make()
        except UnsupportedModelError as error:  # not for this network, or this environment
            result.floors[name] = str(error)
        except Exception as error:
            result.errors[name] = f"{type(error).__name__}: {error!s:.300}"
    tick = CLOCKS[clock]
    result.samples_ms = {name: [] for name in epochs}
    for _ in range(repeat):
        for name, epoch in epochs.items():
            _settle(epoch)
            start = tick()
            epoch()
            result.samples_ms[name].append((tick() - start) * 1000 / steps)
    return result


def report(result: Result) -> list[str]:
    """The workload's table: ms per step, ratio to torch, the target, the check (for a
    floor: its kernels); then the bound the floors set."""
    sizes = ", ".join(f"{k} {v}" for k, v in result.sizes.items())
    width = max(len(name) for name in FLOORS)
    lines = [f"\n{result.workload} ({sizes}), {result.steps} steps per timed epoch",
             f"  {'candidate':<{width}} {'ms/step':>9} {'vs torch':>9}  {'target':>7}  check"]
    for name in (TORCH, *(f"lossgraph fuse={m}" for m in MODES), *FLOORS):
        if name in result.errors:
            lines.append(f"  {name:<{width}} {'n/a':>9}  {result.errors[name]}")
            continue
        ms = result.median(name)
        if ms is None:
            if name == TORCH:
                lines.append(f"  {name:<{width}} {'n/a':>9}  (needs torch)")
            elif name in FLOORS:
                lines.append(f"  {name:<{width}} {'n/a':>9}  ({result.floors[name]})")
            continue
        ratio = result.ratio(name)
        verdict = "" if (ratio is None or name == TORCH or name in FLOORS
                         or result.target is None) else (
            "PASS" if ratio <= result.target else "MISS")
        check = result.checks.get(name)
        check_text = "" if check is None else (
            f"{check['max_abs_difference']:.1e} ({check['weights_compared']}/"
            f"{check['weights']} weights; they moved {check['torch_moved']:.1e})"
            + (" DIFFERS" if not check["max_abs_difference"] <= CHECK_LIMIT else ""))
        if name in FLOORS:
            check_text = f"kernels: {result.floors[name]}"
        ratio_text = "" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"  {name:<{width}} {ms:9.2f} {ratio_text:>9}  {verdict:>7}  {check_text}")
    lines.append(f"  {bound_text(result)}")
    return lines


def bound_text(result: Result) -> str:
    """What onnxruntime's floor leaves of the target (the line under a table)."""
    bound, floor_ms = result.bound(), result.median(ONNXRUNTIME_FLOOR)
    if floor_ms is None:
        return "bound: n/a (no onnxruntime floor)"
    to_torch, to_step = bound["onnxruntime_floor_to_torch"], bound["onnxruntime_floor_to_step"]
    of_step = "" if to_step is None else f" ({to_step:.2f}x lossgraph's fuse=step)"
    if to_torch is None:
        return (f"bound: onnxruntime's heavy kernels alone take {floor_ms:.2f} ms a step"
                f"{of_step}; torch eager's step needs torch")
    torch_floor, target = bound["torch_floor_to_torch"], result.target
    if target is None:
        verdict = "no target"
    elif to_torch > target:
        verdict = f"target {target}x: out of reach on this runtime with these kernels"
    else:
        verdict = (f"target {target}x: within reach, {target - to_torch:.2f}x of torch's step "
                   "left for the other kernels")
    return (f"bound: onnxruntime's heavy kernels alone take {to_torch:.2f}x torch eager's "
            f"step{of_step}" + ("" if torch_floor is None else
                                f"; torch's take {torch_floor:.2f}x")
            + f"; {verdict}")


#: True for a file this benchmark wrote (its JSON or PNG carries BENCHMARK_MARK)
is_benchmark_output = written_by(BENCHMARK_MARK)


def plot(results: list[Result], path: str) -> None:
    """One panel per workload (needs matplotlib): ms per step of every candidate and floor
    that ran, as bars, with torch eager's step and the target (0.8x of it) as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n--plot {path}: matplotlib is not installed, no plot written")
        return
    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4),
                                squeeze=False)
    for axis, result in zip(axes[0], results):
        names = [n for n in (TORCH, *(f"lossgraph fuse={m}" for m in MODES), *FLOORS)
                 if result.median(n) is not None]
        colors = ["tab:gray" if n == TORCH else "tab:blue" if n.startswith("lossgraph")
                  else "tab:green" for n in names]
        labels = [n.replace("lossgraph ", "").replace(" heavy kernels only", "\nkernels only")
                  for n in names]
        axis.barh(labels, [result.median(n) for n in names], color=colors)
        torch_ms = result.median(TORCH)
        if torch_ms is not None:
            axis.axvline(torch_ms, color="black", linewidth=1)
        if torch_ms is not None and result.target is not None:
            axis.axvline(result.target * torch_ms, color="tab:red", linestyle="--",
                         linewidth=1, label=f"target: {result.target}x torch eager")
            axis.legend(fontsize=8, loc="lower right")
        axis.invert_yaxis()
        axis.set(xlabel="ms per step", title=result.workload)
        axis.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    save_figure(figure, path, BENCHMARK_MARK, dpi=110)
    print(f"\nplot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny networks, 3 steps, one round")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed epoch (default 20; 3 with --quick)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed rounds (default 7; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch's threads and onnxruntime's intra-op threads (default 2)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (with --threads 1)")
    parser.add_argument("--save-models", metavar="DIR", help="save the exports and data here")
    parser.add_argument("--models", metavar="DIR",
                        help="time the models saved in DIR (lossgraph only; no torch needed)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH",
                        help="ms per step of each workload's candidates as bars (matplotlib)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 20)
    repeat = args.repeat or (1 if args.quick else 7)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}: pick from "
                     f"{', '.join(WORKLOADS)}")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures this thread's work: use it with --threads 1")
    check_targets(parser, [args.json, args.plot], is_benchmark_output)
    with contextlib.suppress(ImportError):
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    facts = machine_facts()
    print(f"SGD (lr {LEARNING_RATE}) steps, mean squared error, {args.threads} thread(s), "
          f"{args.clock} clock; median of {repeat} epoch(s) of {steps} steps, each after "
          f"{SETTLE_S:g} s of untimed ones; targets: lossgraph's step <= "
          + ", ".join(f"{v.target}x torch eager's ({w})" for w, v in WORKLOADS.items()
                      if v.target is not None))
    print(", ".join(f"{k} {v}" for k, v in facts.items()))
    cpu_before, started = cpu_seconds(), time.perf_counter()
    results = []
    for name in names:
        workload = WORKLOADS[name]
        if args.models:
            problem = load_problem(workload, Path(args.models), steps)
        else:
            problem = make_problem(workload, steps, args.quick)
        if args.save_models:
            save_problem(problem, Path(args.save_models))
        result = run_workload(problem, steps, repeat, args.threads, args.clock)
        results.append(result)
        print("\n".join(report(result)), flush=True)
    print()
    report_load(cpu_before, time.perf_counter() - started, facts)
    if args.json:
        figures = {"generator": BENCHMARK_MARK, "machine": facts, "threads": args.threads,
                   "clock": args.clock, "target": TARGET,
                   "workloads": [{**vars(r), "ms_per_step": {n: r.median(n) for n in
                                                             r.samples_ms},
                                  "ratio_to_torch": {n: r.ratio(n) for n in r.samples_ms},
                                  "bound": r.bound()}
                                 for r in results]}
        write_file(args.json, json.dumps(figures, indent=1).encode(), owned=is_benchmark_output)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
