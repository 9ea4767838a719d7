"""Trainer: fit a TrainingProgram with onnxruntime, scikit-learn style.

    trainer = Trainer(lossgraph.compile_program(model, optimizer=Momentum(0.01, nesterov=True)))
    trainer.fit(X, y, epochs=10, batch_size=100, random_state=0)
    trainer.predict(X_test), trainer.train_losses_, trainer.to_inference_model()

Every option and every array is checked before any work (:mod:`lossgraph.validation`:
types, shapes, NaN and infinity by row, sample weights, class labels). Batches are
views of the data (a shuffled epoch gathers its rows once); weights, optimizer states
and the program's buffers (running statistics of a training-mode BatchNormalization)
stay in buffers bound to the sessions and rotated between steps
(:mod:`lossgraph.runtime.buffers`). A NaN or infinite loss stops training with the
last state whose loss was finite (the state before the previous step: the failing
step's loss is that of the state the previous step made; for ``fuse="epoch"`` after
an epoch's first batch, the epoch's start) and a
:class:`~lossgraph.errors.ConvergenceError` naming the epoch and batch and the state
kept, or an :class:`~lossgraph.errors.InvalidDataError` when the batch itself is at
fault.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .. import data as checks
from ..errors import (
    ConvergenceError,
    InvalidDataError,
    InvalidProgramError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
    ValidationLossWarning,
    suggest,
)
from ..metadata import LOSS_KEY, read_json
from ..optimize import SpecializeBatch
from ..options import count, flag
from ..program import TrainingProgram
from ..storage import read_checkpoint, save_checkpoint
from .buffers import GraphRunner, StateBuffers
from .forward_backward import SeparateStep
from .packed import PackedUpdate, packed_update
from .session import check_loadable, checked_providers, create_session, evaluation_error

__all__ = ["Trainer"]

Callback = Callable[["Trainer", int, dict], Any]


class Trainer:
    """Runs a :class:`~lossgraph.program.TrainingProgram` in onnxruntime."""

    def __init__(self, program: TrainingProgram, providers: Sequence[str] | None = None,
                 session_options: Any = None) -> None:
        if not isinstance(program, TrainingProgram):
            hint = ""
            if isinstance(program, (onnx.ModelProto, bytes, str, os.PathLike)):
                hint = " Compile a model first: Trainer(lossgraph.compile_program(model))."
            raise UnsupportedOptionError(
                f"Trainer takes a TrainingProgram (from lossgraph.compile_program or "
                f"TrainingProgram.load), not a {type(program).__name__}.{hint}")
        for name, graph in program.graphs.items():  # before any work, not at the first fit
            check_loadable(graph, f"The program's {name!r} graph")
        self.program = program
        self.providers = checked_providers(providers)
        self.session_options = session_options
        manifest = program.manifest
        roles = manifest["roles"]
        self._sample_weight = roles.get("sample_weight")
        self._classes = _class_count(manifest)
        self._ignored = _ignored_label(program)
        # Models that impute missing values take NaN features on purpose.
        self._allows_missing = any(node.op_type in ("Imputer", "IsNaN")
                                   for node in program.graphs["predict"].graph.node)
        self._checked = checks.CheckedArrays()
        self._names = program.weights + program.states + program.buffers
        self._new = {w["name"]: w["new"] for w in manifest["weights"]}
        self._new.update({s["name"]: s["new"] for w in manifest["weights"] for s in w["states"]})
        self._new.update({b["name"]: b["new"] for b in manifest.get("buffers", [])})
        # separate mode updates every weight at once: weights and states lie end to end
        self._packed = _packed_update(program) if program.fuse == "separate" else None
        self._buffers = StateBuffers(self._names, program.state,
                                     self._packed.blocks if self._packed else ())
        self._sessions: dict[tuple[str, int | None], Any] = {}
        self._runners: dict[tuple[str, int | None, tuple[str, ...]], GraphRunner] = {}
        self._separate: dict[int | None, SeparateStep] = {}
        self._optimizer = program.optimizer
        self._dtype = program.state[program.weights[0]].dtype
        self._learning_rate = np.zeros((), self._dtype)
        self._step = np.zeros((), np.int64)
        self._loss = np.zeros((), self._dtype)
        self.reset()

    # -- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the program's initial state, as if nothing had been trained."""
        self._buffers.load(self.program.state)
        self.steps_ = 0
        self.epochs_ = 0
        self.train_losses_: list[float] = []
        self.validation_losses_: list[float] = []
        self._rng: np.random.Generator | None = None
        self._epoch_rate: Callable[[int], float] | None = None
        #: the last successful run's steps, epoch and first batch (what step_back undoes)
        self._last_run: tuple[int, int, int] | None = None

    @property
    def state(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, optimizer states and buffers (running statistics)."""
        return {name: array.copy() for name, array in self._buffers.live().items()}

    def set_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace weights (and optimizer states or buffers, when given); names, shapes, dtypes
        are checked."""
        live = self._buffers.live()
        if not isinstance(state, Mapping):
            raise UnsupportedOptionError(
                f"set_state takes a dict of arrays by name (as Trainer.state gives), not a "
                f"{type(state).__name__}.")
        for name, value in state.items():
            if name not in live:
                raise UnknownNameError(f"{name!r} is not a weight, state or buffer of this program."
                                       + suggest(str(name), list(live), "names"))
            value = np.asarray(value)
            if value.shape != live[name].shape or value.dtype != live[name].dtype:
                raise ShapeMismatchError(
                    f"State {name!r} must be {live[name].dtype}{list(live[name].shape)}, got "
                    f"{value.dtype}{list(value.shape)}.")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise InvalidDataError(f"State {name!r} holds NaN or infinite values.")
        for name, value in state.items():
            live[name][...] = value

    # -- sessions ----------------------------------------------------------------------
    def _session(self, graph: str, batch: int | None = None):
        """The session of ``graph``, specialized to ``batch`` rows a step when given (one
        batch size at a time per graph: another batch size replaces it)."""
        key = (graph, batch)
        if key not in self._sessions:
            model = self.program.graphs[graph]
            if batch is not None:
                for stale in [k for k in self._sessions if k[0] == graph and k[1] is not None]:
                    del self._sessions[stale]
                for stale in [k for k in self._runners if k[0] == graph and k[1] is not None]:
                    del self._runners[stale]
                model = SpecializeBatch(batch)(model).model
            self._sessions[key] = self._new_session(model, graph)
        return self._sessions[key]

    def _new_session(self, model: onnx.ModelProto, graph: str = "model"):
        return create_session(model, self.providers, self.session_options, graph)

    def _runner(self, graph: str | PackedUpdate, batch: int | None = None,
                bound: Mapping[str, np.ndarray] | None = None) -> GraphRunner:
        """The runner of ``graph`` (or of the packed update graph) over the state buffers
        (specialized to ``batch``), with the learning rate, the step and the arrays
        ``bound`` (by input name) bound once."""
        if isinstance(graph, PackedUpdate):
            return self._packed_runner(graph, bound or {})
        key = (graph, batch, tuple(bound or ()))
        if key not in self._runners:
            entry = self.program.manifest["graphs"][graph]
            inputs = {v["name"]: v["name"] for v in entry["inputs"]
                      if v["role"] in ("weight", "state", "buffer")}
            outputs = {self._new[name]: name for name in inputs.values()}
            roles = {v["role"]: v["name"] for v in (*entry["inputs"], *entry["outputs"])}
            fixed_in = {roles["step"]: self._step, **(bound or {})}
            fixed_out = {}
            if "learning_rate" in roles:
                fixed_in[roles["learning_rate"]] = self._learning_rate
            if "loss" in roles:
                fixed_out[roles["loss"]] = self._loss
            self._runners[key] = GraphRunner(self._session(graph, batch), self._buffers, inputs,
                                             outputs, fixed_in, fixed_out, graph)
        return self._runners[key]

    def _packed_runner(self, packed: PackedUpdate, bound: Mapping[str, np.ndarray]
                       ) -> GraphRunner:
        """A runner of the packed update graph over the packed weights and states, reading
        the arrays ``bound`` (a new runner each time: each step binds its own gradient)."""
        key = ("packed update", None)
        if key not in self._sessions:
            self._sessions[key] = self._new_session(packed.model)
        return GraphRunner(self._sessions[key], self._buffers, packed.inputs, packed.outputs,
                           {packed.learning_rate: self._learning_rate, packed.step: self._step,
                            **bound}, {}, "update")

    # -- data --------------------------------------------------------------------------
    def _inputs(self, graph: str, role: str) -> list[dict]:
        entry = self.program.manifest["graphs"][graph]
        return [v for v in entry["inputs"] if v["role"] == role]

    def _prepare(self, X: Any, y: Any = None, sample_weight: Any = None,
                 graph: str = "evaluate", with_label: bool = True,
                 what: str = "") -> dict[str, np.ndarray]:
        """Checked, C-contiguous data arrays by input name; errors before any work.

        ``what`` prefixes the data's names in messages (``"validation_data "``).
        """
        features = self._inputs(graph, "feature")
        if isinstance(X, Mapping):
            unknown = sorted(set(X) - {f["name"] for f in features})
            if unknown:
                raise UnknownNameError(f"{what}X names {unknown[0]!r}, not a feature input."
                                       + suggest(str(unknown[0]), [f["name"] for f in features],
                                                 "feature inputs"))
            given = {name: (value, f"{what}X[{name!r}]") for name, value in X.items()}
        elif len(features) == 1:
            given = {features[0]["name"]: (X, f"{what}X")}
        else:
            raise InvalidDataError(
                f"The model has {len(features)} feature inputs "
                f"({', '.join(f['name'] for f in features)}): pass {what}X as a dict by name.")
        data = {f["name"]: self._array(*given.get(f["name"], (None, f"{what}X")), f, "feature")
                for f in features}
        if with_label:
            label = self._inputs(graph, "label")[0]
            if y is None:
                raise InvalidDataError(
                    f"{what}y is missing: training and evaluation need labels.")
            data[label["name"]] = self._array(y, f"{what}y", label, "label")
            weight = self._inputs(graph, "sample_weight")
            if sample_weight is not None and not weight:
                raise UnsupportedOptionError(
                    "sample_weight was given but the program has no sample-weight input: "
                    "compile with loss_options={'weight_name': 'sample_weight'}.")
            if weight:
                rows = len(next(iter(data.values())))
                data[weight[0]["name"]] = (
                    np.ones(rows, self._dtype) if sample_weight is None else
                    self._array(sample_weight, f"{what}sample_weight", weight[0],
                                "sample_weight"))
        rows = {name: len(array) for name, array in data.items()}
        if len(set(rows.values())) > 1:
            raise ShapeMismatchError(f"The {what}data have different numbers of rows: {rows}.")
        return data

    def _array(self, value: Any, what: str, spec: dict, role: str) -> np.ndarray:
        """One input's data, converted and checked (values once per array, see
        :class:`~lossgraph.validation.CheckedArrays`)."""
        array = checks.as_array(value, spec, what)
        context = (role, spec["name"])
        if (array, context) not in self._checked:
            checks.check_values(array, role, what, self._classes,
                                finite=not (role == "feature" and self._allows_missing),
                                ignored=self._ignored)
            self._checked.add(array, context)
        return array

    # -- training ----------------------------------------------------------------------
    def fit(self, X: Any, y: Any = None, sample_weight: Any = None, epochs: int = 1,
            batch_size: int = 32, shuffle: bool = True, random_state: Any = None,
            validation_data: tuple | None = None, callbacks: Iterable[Callback] | None = None,
            progress: bool | None = None, warm_start: bool = False,
            epoch_learning_rate: Callable[[int], float] | None = None) -> Trainer:
        """Train for ``epochs`` epochs of minibatch updates; returns ``self``.

        ``X`` is an array (or a dict of arrays by feature input name; a list, or an object
        with ``to_numpy()`` or ``__array__`` such as a pandas DataFrame, is read as one),
        or an iterable of ``(X, y[, sample_weight])`` batches (a callable returning one, for
        several epochs). ``warm_start=True`` continues from the current state, step count
        and shuffling generator; otherwise training restarts from the program's state.
        Each callback is called as ``callback(trainer, epoch, logs)`` after every epoch;
        one returning ``True`` stops training. ``epoch_learning_rate``, a function of the
        epoch (``epochs_``, 0 for the first), gives the learning rate of every update of
        that epoch instead of the optimizer's schedule (a per-epoch schedule, as
        scikit-learn's MLP takes). Every argument is checked before the state changes.
        """
        epochs = count("epochs", epochs, 0)
        batch_size = count("batch_size", batch_size, 1)
        shuffle, warm_start = flag("shuffle", shuffle), flag("warm_start", warm_start)
        progress = None if progress is None else flag("progress", progress)
        seed = checks.random_state(random_state)
        callbacks = checks.callbacks(callbacks)
        if epoch_learning_rate is not None and not callable(epoch_learning_rate):
            raise UnsupportedOptionError(
                f"epoch_learning_rate={epoch_learning_rate!r} must be a function of the epoch "
                "returning the learning rate, or None.")
        streaming = _streaming(X, y, sample_weight)
        if streaming and epochs > 1 and not callable(X) and iter(X) is X:
            raise InvalidDataError(
                f"A one-shot iterator of batches cannot be replayed for {epochs} epochs: pass a "
                "function that returns a new iterator (or a list).")
        data = None if streaming else self._prepare(X, y, sample_weight)
        held_out = None
        if validation_data is not None:
            if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
                got = (f"a {type(validation_data).__name__}"
                       if not isinstance(validation_data, (tuple, list)) else
                       f"{len(validation_data)} item" + "s" * (len(validation_data) != 1))
                raise InvalidDataError(
                    f"validation_data must be a tuple (X, y) or (X, y, sample_weight); got {got}.")
            held_out = self._prepare(*validation_data, what="validation_data ")
        if not warm_start:
            self.reset()
        if self._rng is None:
            self._rng = np.random.default_rng(seed)
        self._epoch_rate = epoch_learning_rate
        bar = self._progress_bar(progress, epochs)
        try:
            for _ in range(epochs):
                epoch = self.epochs_
                if streaming:
                    losses, sizes = self._stream_epoch(X, epoch)
                else:
                    losses, sizes = self._array_epoch(data, batch_size, shuffle, epoch)
                self.epochs_ += 1
                logs = {"loss": float(np.dot(losses, sizes) / np.sum(sizes))}
                self.train_losses_.append(logs["loss"])
                if held_out is not None:
                    logs["validation_loss"] = self._validation_loss(held_out, epoch)
                    self.validation_losses_.append(logs["validation_loss"])
                if bar is not None:
                    bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()}, refresh=False)
                    bar.update(1)
                if any(callback(self, epoch, logs) is True for callback in callbacks):
                    break
        finally:
            if bar is not None:
                bar.close()
        return self

    @staticmethod
    def _progress_bar(progress: bool | None, epochs: int):
        if progress is None:
            progress = sys.stderr.isatty()
        if not progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=epochs, desc="lossgraph", unit="epoch")

    def _array_epoch(self, data: dict[str, np.ndarray], batch_size: int, shuffle: bool,
                     epoch: int) -> tuple[np.ndarray, np.ndarray]:
        rows = len(next(iter(data.values())))
        order = self._rng.permutation(rows) if shuffle else None
        full = rows // batch_size
        losses, sizes = [], []
        if self.program.fuse == "epoch" and full > 0:
            losses.append(self._fused_epoch(data, order, full, batch_size, epoch))
            sizes.append(np.full(full, batch_size))
            start = full * batch_size
        else:
            start = 0
        if start < rows:
            if order is None:
                rest = {name: array[start:] for name, array in data.items()}
            else:  # one gather per epoch, then views
                rest = {name: array[order[start:]] for name, array in data.items()}
            batch_losses, batch_sizes = self._steps(rest, batch_size, epoch, start // batch_size,
                                                    None if order is None else order[start:])
            losses.append(batch_losses)
            sizes.append(batch_sizes)
        return np.concatenate(losses), np.concatenate(sizes)

    def _steps(self, data: dict[str, np.ndarray], batch_size: int, epoch: int, first: int,
               order: np.ndarray | None,
               specialize: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Minibatch steps over ``data`` (already in epoch order) with ``train_step``, whose
        full batches run the graph specialized to ``batch_size`` when ``specialize``."""
        rows = len(next(iter(data.values())))
        count = math.ceil(rows / batch_size)
        losses = np.empty(count)
        sizes = np.empty(count, np.int64)
        step = self._separate_step if self.program.fuse == "separate" else self._fused_step
        train = functools.partial(step, full=batch_size if specialize else None)
        for index in range(count):
            lo, hi = index * batch_size, min(rows, (index + 1) * batch_size)
            batch = {name: array[lo:hi] for name, array in data.items()}
            self._learning_rate[()] = self._rate(self.steps_ + 1)
            self._step[()] = self.steps_ + 1
            loss = train(batch)
            if not math.isfinite(loss):
                rows_used = np.arange(lo, hi) if order is None else order[lo:hi]
                self._diverged(epoch, first + index, loss, batch, rows_used)
            self._advance(1, epoch, first + index)
            losses[index], sizes[index] = loss, hi - lo
        return losses, sizes

    def _rate(self, step: int) -> float:
        """The learning rate of update ``step`` (1-based) in the current epoch."""
        if self._epoch_rate is None:
            return self._optimizer.schedule(step)
        rate = self._epoch_rate(self.epochs_)
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not (
                math.isfinite(rate) and rate >= 0):
            raise UnsupportedOptionError(
                f"epoch_learning_rate({self.epochs_}) returned {rate!r}; a learning rate is a "
                "finite number >= 0.")
        return float(rate)

    def _fused_step(self, batch: dict[str, np.ndarray], full: int | None = None) -> float:
        """One run of ``train_step``: the loss; the next state waits in the other buffers.

        A batch of ``full`` rows (the fit's batch size) runs the graph specialized to it;
        others (the last, smaller batch; streamed batches) the general one.
        """
        rows = len(next(iter(batch.values())))
        self._runner("train_step", rows if rows == full else None).run(batch)
        return float(self._loss)

    def _separate_step(self, batch: dict[str, np.ndarray], full: int | None = None) -> float:
        """The reference documents' sequence: forward, loss, backward, penalty, update
        (:class:`~lossgraph.runtime.forward_backward.SeparateStep`); a batch of ``full``
        rows runs graphs specialized to it, as :meth:`_fused_step` does."""
        rows = len(next(iter(batch.values())))
        size = rows if rows == full else None
        if size not in self._separate:
            if size is not None:  # one batch size at a time, as for the fused graphs
                self._separate = {k: v for k, v in self._separate.items() if k is None}
            self._separate[size] = SeparateStep(self.program, self._buffers, self._new_session,
                                                self._runner, size, self._packed)
        return self._separate[size].run(batch)

    def _fused_epoch(self, data: dict[str, np.ndarray], order: np.ndarray | None, full: int,
                     batch_size: int, epoch: int) -> np.ndarray:
        """All full batches of an epoch in one run of ``train_epoch``."""
        graph = "train_epoch" if order is not None else "train_epoch_ordered"
        runner = self._runner(graph, batch_size)
        first = self.steps_ + 1
        rates = (self._optimizer.schedules(first, full) if self._epoch_rate is None else
                 np.full(full, self._rate(first))).astype(self._dtype)
        losses = np.empty(full, self._dtype)
        runner.bind_output(self.program.io(graph, "losses")[0], losses)
        feeds = {self.program.io(graph, "learning_rates")[0]: rates}
        if order is None:
            feeds.update({name: array[:full * batch_size] for name, array in data.items()})
        else:
            feeds.update(data)
            feeds[self.program.io(graph, "permutation")[0]] = np.ascontiguousarray(
                order[:full * batch_size])
        self._step[()] = first
        runner.run(feeds)
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            index = int(bad[0])
            rows_used = (np.arange(index * batch_size, (index + 1) * batch_size) if order is None
                         else order[index * batch_size:(index + 1) * batch_size])
            batch = {name: array[rows_used] for name, array in data.items()}
            self._diverged(epoch, index, float(losses[index]), batch, rows_used,
                           first_of_run=index == 0)
        self._advance(full, epoch, 0)
        return losses.astype(np.float64)

    def _stream_epoch(self, batches: Any, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass over an iterable of (X, y[, w]) batches with ``train_step``."""
        source = batches() if callable(batches) else batches
        losses, sizes = [], []
        for index, item in enumerate(source):
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise InvalidDataError(
                    f"Batch {index} is not an (X, y) or (X, y, sample_weight) tuple: pass an "
                    "iterable of such tuples, or X and y as arrays.")
            data = self._prepare(*item, graph="train_step", what=f"batch {index} ")
            rows = len(next(iter(data.values())))  # streamed batches may differ in size
            batch_losses, batch_sizes = self._steps(data, rows, epoch, index, None,
                                                    specialize=False)
            losses.append(batch_losses)
            sizes.append(batch_sizes)
        if not losses:
            raise InvalidDataError("The iterable of batches was empty.")
        return np.concatenate(losses), np.concatenate(sizes)

    def _advance(self, steps: int, epoch: int, batch: int) -> None:
        """A successful run of ``steps`` steps from ``epoch``'s ``batch``: its new state
        becomes the live one, and the state it read is kept for :meth:`_step_back`."""
        self._buffers.advance()
        self._last_run = (steps, epoch, batch)
        self.steps_ += steps

    def _step_back(self, loss: float, first_of_run: bool = True) -> str:
        """After a run whose loss was not finite, keep the last state whose loss was: the
        one before the last successful run where the failing run's first loss is the bad
        one (it was computed at the run's input state), else the run's input. Says which."""
        if first_of_run and self._last_run is not None and self._buffers.step_back():
            steps, epoch, batch = self._last_run
            self._last_run = None
            self.steps_ -= steps
            return (f"The weights are those before step {self.steps_ + 1} (epoch {epoch}, "
                    f"batch {batch}), the last whose loss was finite; steps_ is "
                    f"{self.steps_} again.")
        if first_of_run:
            return (f"The weights are those this training started from; their loss is "
                    f"{loss} already.")
        return (f"The weights are those at the start of the failing epoch (before step "
                f"{self.steps_ + 1}), whose first batch's loss was finite.")

    def _diverged(self, epoch: int, batch: int, loss: float, data: Mapping[str, np.ndarray],
                  rows: np.ndarray, first_of_run: bool = True) -> None:
        """Raise the error that explains a non-finite loss: the batch's data, or divergence
        (then the last state whose loss was finite is kept, :meth:`_step_back`)."""
        restored = "the failing step" if first_of_run else "the start of the epoch"
        where = f"epoch {epoch}, batch {batch}"
        for name, array in data.items():
            if array.dtype.kind != "f" or (self._allows_missing and name not in (
                    self.program.manifest["roles"]["label"], self._sample_weight)):
                continue
            finite = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            if not finite.all():  # the data changed in place since they were checked
                bad_row = int(rows[np.flatnonzero(~finite)[0]])
                raise InvalidDataError(
                    f"Input {name!r} holds NaN or infinite values (row {bad_row}, {where}): "
                    "clean or impute the data before training.")
        if self._sample_weight in data and not data[self._sample_weight].any():
            raise InvalidDataError(
                f"The sample weights of {where} are all zero, so its mean loss is 0/0. Shuffle "
                "the rows (shuffle=True), use larger batches, or drop rows of weight zero. The "
                f"weights are those before {restored}.")
        labels = data.get(self.program.manifest["roles"]["label"])
        if self._ignored is not None and labels is not None:
            counted = (labels != self._ignored).reshape(len(labels), -1).sum(axis=1)
            if not np.any(counted * data.get(self._sample_weight, 1)):
                raise InvalidDataError(
                    f"No label of {where} counts: each is {self._ignored} (the loss's "
                    "ignore_index) or in a row of weight zero, so its mean loss is 0/0. Shuffle "
                    "the rows (shuffle=True), use larger batches, or drop such rows. The "
                    f"weights are those before {restored}.")
        rate = self._rate(self.steps_ + 1)
        kept = self._step_back(loss, first_of_run)
        if not all(np.isfinite(v).all() for v in self._buffers.live().values()):
            kept += (" They hold non-finite values already (an earlier update overflowed): "
                     "reset() or set_state() before training again.")
        raise ConvergenceError(
            f"The loss became {loss} at {where}: training diverged. Try a smaller learning "
            f"rate (now {rate:g}), scale the features, or a smaller penalty. {kept}")

    # -- evaluation and export ---------------------------------------------------------
    def _evaluate(self, data: Mapping[str, np.ndarray]) -> float:
        session = self._session("evaluate")
        loss = self.program.manifest["roles"]["loss"]
        return float(self._run(session, "evaluate", [loss],
                               {**data, **self._model_state("evaluate")})[0])

    def _validation_loss(self, data: Mapping[str, np.ndarray], epoch: int) -> float:
        """The loss on the validation data, with a ValidationLossWarning when it is not
        finite (the training data's loss was: the model fails on these data only)."""
        loss = self._evaluate(data)
        if not math.isfinite(loss):
            warnings.warn(
                f"The validation loss after epoch {epoch} is {loss}, though the training loss "
                "is finite: the model predicts values the loss cannot score on the validation "
                "data (features far outside the training range, or labels the loss cannot "
                "take). It is recorded in validation_losses_; training goes on.",
                ValidationLossWarning, stacklevel=4)
        return loss

    def _model_state(self, graph: str) -> dict[str, np.ndarray]:
        """The live weights and buffers that ``graph`` takes as inputs."""
        live = self._buffers.live()
        return {v["name"]: live[v["name"]] for v in self.program.manifest["graphs"][graph]["inputs"]
                if v["role"] in ("weight", "buffer")}

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The loss on ``(X, y)`` with the current weights."""
        return self._evaluate(self._prepare(X, y, sample_weight))

    def predict(self, X: Any) -> np.ndarray:
        """The model's prediction (the output the loss is computed on) for ``X``."""
        data = self._prepare(X, graph="predict", with_label=False)
        prediction = self.program.manifest["roles"]["prediction"]
        return self._run(self._session("predict"), "predict", [prediction],
                         {**data, **self._model_state("predict")})[0]

    @staticmethod
    def _run(session: Any, graph: str, outputs: list[str], feeds: Mapping[str, Any]) -> list:
        try:
            return session.run(outputs, feeds)
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise evaluation_error(graph, exc) from None

    def to_inference_model(self) -> onnx.ModelProto:
        """The original inference model with the trained weights and buffers written back."""
        return self.program.to_inference_model(self._buffers.live())

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write the program, state, counters, losses and shuffling generator, atomically.

        ``path`` must be new, empty, or a checkpoint folder lossgraph wrote (holding
        nothing else); anything else is an :class:`~lossgraph.errors.UnsafeWriteError`.
        """
        program = TrainingProgram(self.program.graphs, self.program.manifest, self.state,
                                  self.program.inference_model)
        progress = self._progress()
        rng = progress["rng"]
        return save_checkpoint(path, program, {
            **progress, "rng": None if rng is None else rng.bit_generator.state})

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike, providers: Sequence[str] | None = None,
                        session_options: Any = None) -> Trainer:
        """A trainer resuming a checkpoint: ``fit(..., warm_start=True)`` continues it.

        A damaged checkpoint is an :class:`~lossgraph.errors.InvalidProgramError`.
        """
        parts, record = read_checkpoint(path)
        trainer = cls(TrainingProgram(*parts), providers, session_options)
        trainer._restore_progress(record)
        return trainer

    def _progress(self) -> dict[str, Any]:
        """What ``fit(warm_start=True)`` continues besides the state: the counters, the
        losses and the shuffling generator."""
        return {"steps": self.steps_, "epochs": self.epochs_,
                "train_losses": list(self.train_losses_),
                "validation_losses": list(self.validation_losses_), "rng": self._rng}

    def _restore_progress(self, progress: Mapping[str, Any]) -> None:
        self.steps_, self.epochs_ = progress["steps"], progress["epochs"]
        self.train_losses_ = list(progress["train_losses"])
        self.validation_losses_ = list(progress["validation_losses"])
        self._rng = progress["rng"]

    # -- pickling ----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """A trainer pickles as its program, live state and progress; onnxruntime sessions
        are made again on first use after unpickling. ``session_options`` (onnxruntime's,
        not picklable) are not kept: pass them again with a new Trainer if needed."""
        return {"program": self.program, "providers": self.providers, "state": self.state,
                "progress": self._progress()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(saved["program"], saved["providers"])
        self.set_state(saved["state"])
        self._restore_progress(saved["progress"])


def _packed_update(program: TrainingProgram) -> PackedUpdate | None:
    """The packed form of a separate program's update graph (None where it has none)."""
    return packed_update(program.graphs["update"], program.optimizer,
                         {w: program.state[w] for w in program.weights})


def _class_count(manifest: Mapping[str, Any]) -> int | None:
    """How many classes integer labels index: C for an (N, C) prediction, 2 for (N,) or
    (N, 1) (a binary loss), C for an (N, d1, ..., C) prediction with labels of shape
    (N, d1, ...) (a class at each position); None when the count is not static."""
    roles, graph = manifest["roles"], manifest["graphs"]["evaluate"]
    shape = next((o["shape"] for o in graph["outputs"] if o["name"] == roles["prediction"]),
                 None)
    if shape is None:
        return None
    if len(shape) > 2:
        label = next((i["shape"] for i in graph["inputs"] if i["name"] == roles["label"]), None)
        if label != shape[:-1]:
            return None
    elif len(shape) == 1 or shape[1] == 1:
        return 2
    return shape[-1] if isinstance(shape[-1], int) else None


def _ignored_label(program: TrainingProgram) -> int | None:
    """The label value the loss ignores (its ``ignore_index``), recorded by add_loss_output
    in the loss model and so in the evaluate graph; None when it has none."""
    record = read_json(program.graphs["evaluate"], LOSS_KEY)
    if record is None:
        return None
    ignored = record.get("ignore_index") if isinstance(record, dict) else None
    if not isinstance(record, dict) or isinstance(ignored, bool) or not isinstance(
            ignored, (int, type(None))):
        raise InvalidProgramError(
            f"The evaluate graph's metadata {LOSS_KEY!r} must be a JSON object such as "
            f'{{"ignore_index": -100}}, not {record!r}: compile the model again.')
    return ignored


def _is_data(X: Any) -> bool:
    """Arrays and what reads as one: a dict of arrays, a list of rows, a DataFrame."""
    return (isinstance(X, (np.ndarray, Mapping, list, tuple)) or hasattr(X, "__array__")
            or hasattr(X, "to_numpy"))


def _streaming(X: Any, y: Any, sample_weight: Any) -> bool:
    """Whether ``X`` is an iterable of ``(X, y[, w])`` batches (then ``y`` and
    ``sample_weight`` come inside the batches, never beside them)."""
    if isinstance(X, (list, tuple)) and X:
        first = X[0]
        unlabelled = y is None and sample_weight is None
        batches = (isinstance(first, (tuple, list)) and 2 <= len(first) <= 3
                   and not isinstance(first[0], (list, tuple, numbers.Number))
                   and _is_data(first[0])) or (
            unlabelled and not isinstance(first, (list, tuple, numbers.Number))
            and _is_data(first))
    else:
        batches = not _is_data(X) and (callable(X) or isinstance(X, Iterable))
    if batches and (y is not None or sample_weight is not None):
        raise InvalidDataError(
            "X is an iterable of (X, y[, sample_weight]) batches, so the labels and weights "
            "come inside each batch: leave y and sample_weight out, or pass X and y as arrays.")
    return batches
