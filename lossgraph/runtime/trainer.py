"""Trainer: fit a TrainingProgram with onnxruntime, scikit-learn style.

    trainer = Trainer(lossgraph.compile_program(model, optimizer=Momentum(0.01, nesterov=True)))
    trainer.fit(X, y, epochs=10, batch_size=100, random_state=0)
    trainer.predict(X_test), trainer.train_losses_, trainer.to_inference_model()

The Trainer is the training loop: epochs and batches, the learning rate of every update
(the optimizer's schedule, or ``epoch_learning_rate``), the counters and loss histories,
callbacks, the progress bar, checkpoints and pickling. What runs a step, the sessions,
the state and the data checks are its :class:`~lossgraph.runtime.engine.Engine`'s
(``trainer.engine``). Every option and every array is checked before any work
(:mod:`lossgraph.data`: types, shapes, NaN and infinity by row, sample weights, class
labels). Batches are views of the data (a shuffled epoch gathers its rows once). A NaN or
infinite loss stops training with the last state whose loss was finite (the state before
the previous step: the failing step's loss is that of the state the previous step made;
for ``fuse="epoch"`` after an epoch's first batch, the epoch's start) and a
:class:`~lossgraph.errors.ConvergenceError` naming the epoch and batch and the state kept,
or an :class:`~lossgraph.errors.InvalidDataError` when the batch itself is at fault.
"""

from __future__ import annotations

import copy
import itertools
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
from ..deprecation import warn_renamed
from ..errors import (
    ConvergenceError,
    InvalidDataError,
    UnsupportedOptionError,
    ValidationLossWarning,
)
from ..options import count, flag
from ..passes.fixed_batch import rows
from ..program import TrainingProgram
from ..storage import read_checkpoint, save_checkpoint
from .callbacks import Callback, Loop, as_callbacks, epoch_log_keys
from .checkpoints import Checkpoints
from .early_stopping import EarlyStopping, StoppingRecord
from .engine import Engine
from .metrics import Metrics

__all__ = ["Trainer"]

#: What ``fit(callbacks=...)`` takes: Callback objects, or epoch functions.
CallbackLike = Callback | Callable[["Trainer", int, dict], Any]


class Trainer:
    """Runs a :class:`~lossgraph.program.TrainingProgram` in onnxruntime.

    ``keep_previous_state``: whether to keep the state before the last step, so that after a
    non-finite loss the weights go back to the last whose loss was finite. It costs one
    more copy of the weights and optimizer states; by default it is kept for states up to
    64 MiB (:data:`~lossgraph.runtime.engine.KEEP_PREVIOUS_MAX_BYTES`), and a larger
    model keeps the weights the failing step read instead.

    ``in_place``: whether each step writes the next state over the one it reads, so that
    the state is held once (:mod:`lossgraph.passes.in_place`); by default where the state
    before the last step is not kept and the program's steps can (``fuse="step"``, and
    ``"separate"`` without running statistics; not an accumulating program). A step whose
    loss is not finite writes the state it read back, as with a second copy. A
    ``fuse="epoch"`` program run in place runs its epochs as steps (a Scan writes its loop
    state into arrays of its own, the weights held four times over); it does so by
    default only where the state is over those 64 MiB.
    """

    def __init__(self, program: TrainingProgram, providers: Sequence[str] | None = None,
                 session_options: Any = None, keep_previous_state: bool | None = None,
                 in_place: bool | None = None) -> None:
        #: the program's graphs over one live state (sessions, buffers, data checks)
        self.engine = Engine(program, providers, session_options, keep_previous_state,
                             in_place)
        #: the buffer-set options as given (a pickled trainer keeps them)
        self._state_options = {"keep_previous_state": keep_previous_state,
                               "in_place": in_place}
        self.program = program
        self.providers = self.engine.providers
        self.session_options = session_options
        self._optimizer = program.optimizer
        self.reset()

    # -- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the program's initial state, as if nothing had been trained."""
        self.engine.reset()
        self.steps_ = 0
        self.epochs_ = 0
        #: every epoch's logs by name: ``loss``, ``validation_loss``, each metric and its
        #: ``validation_`` twin (a name first logged later has fewer values: the last epochs')
        self.history_: dict[str, list[float]] = {"loss": [], "validation_loss": []}
        #: what early stopping knows so far (None: the fit had none)
        self.early_stopping_: StoppingRecord | None = None
        #: the gradients' global norm (before clipping) of every update since the last
        #: reset, where the program clips them (``max_grad_norm``); not kept in checkpoints
        self.grad_norms_: list[float] = []
        self._rng: np.random.Generator | None = None
        self._epoch_rate: Callable[[int], float] | None = None
        self._loop = Loop([])

    @property
    def train_losses_(self) -> list[float]:
        """The mean training loss of every epoch (``history_["loss"]``)."""
        return self.history_["loss"]

    @train_losses_.setter
    def train_losses_(self, losses: Iterable[float]) -> None:
        self.history_["loss"] = list(losses)

    @property
    def validation_losses_(self) -> list[float]:
        """The validation loss of every epoch that had validation data
        (``history_["validation_loss"]``)."""
        return self.history_["validation_loss"]

    @validation_losses_.setter
    def validation_losses_(self, losses: Iterable[float]) -> None:
        self.history_["validation_loss"] = list(losses)

    @property
    def state(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, optimizer states and buffers (running statistics)."""
        return self.engine.state

    def set_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace weights (and optimizer states or buffers, when given); names, shapes, dtypes
        are checked."""
        self.engine.set_state(state)

    # -- training ----------------------------------------------------------------------
    def fit(self, X: Any, y: Any = None, sample_weight: Any = None, epochs: int | None = None,
            batch_size: int | None = None, shuffle: bool = True, random_state: Any = None,
            validation_data: tuple | None = None,
            callbacks: CallbackLike | Iterable[CallbackLike] | None = None,
            progress: bool | None = None, warm_start: bool = False,
            epoch_learning_rate: Callable[[int], float] | None = None,
            max_steps: int | None = None, checkpoint_dir: str | os.PathLike | None = None,
            checkpoint_every: int = 1, keep_last: int | None = 3, keep_best: bool = True,
            monitor: str = "val_loss", accumulation_steps: int | None = None,
            metrics: Sequence[str] | None = None, validation_fraction: float | None = None,
            early_stopping: EarlyStopping | None = None) -> Trainer:
        """Train for ``epochs`` epochs of minibatch updates (1 by default), or ``max_steps``
        updates, whichever ends first; returns ``self``.

        ``X`` is an array (or a dict of arrays by feature input name; a list, or an object
        with ``to_numpy()`` or ``__array__`` such as a pandas DataFrame, is read as one),
        or an iterable of ``(X, y[, sample_weight])`` batches (a callable returning one, for
        several epochs). ``warm_start=True`` continues from the current state, step count
        and shuffling generator; otherwise training restarts from the program's state.
        ``callbacks`` are :class:`~lossgraph.runtime.callbacks.Callback` objects (hooks after
        every step and epoch) or functions ``callback(trainer, epoch, logs)`` called after
        every epoch; one returning ``True`` stops training. ``max_steps`` counts this fit's
        updates and stops at exactly the last, mid-epoch too (that epoch then ends there).
        ``checkpoint_dir`` saves a checkpoint there every ``checkpoint_every`` epochs and at
        the end, keeping the last ``keep_last`` and, with ``keep_best``, the best by
        ``monitor`` (:mod:`lossgraph.runtime.checkpoints`). ``epoch_learning_rate``, a
        function of the epoch (``epochs_``, 0 for the first), gives the learning rate of
        every update of that epoch instead of the optimizer's schedule (a per-epoch
        schedule, as scikit-learn's MLP takes). Every argument is checked before the state changes.

        ``batch_size`` is 32 by default. A model exported with a fixed batch that compile
        kept (:attr:`Engine.fixed_batch`) trains in batches of exactly that size (the
        default then, and the only one): each epoch's remaining rows are left out, as
        torch's ``DataLoader(drop_last=True)`` does (shuffled, other rows each epoch).

        ``accumulation_steps=k`` makes one update of every ``k`` batches (micro-batches):
        the gradient of the mean loss over their rows (weighted by ``sample_weight``), as
        one step at a batch of ``k * batch_size`` rows takes, to float rounding; by default
        the program's (``compile_program(accumulation_steps=...)``, which ``k > 1``
        needs). An epoch's last group may hold fewer micro-batches (and its last one fewer
        rows): it is one update all the same, its gradient the mean over the rows it holds,
        as Hugging Face's Trainer does at the end of an epoch. The learning-rate schedule,
        the step count (``steps_``, Adam's bias correction), ``max_steps`` and the step
        callbacks count updates (a step's ``loss``: its micro-batches' mean by rows);
        running statistics (BatchNormalization in training mode) move per micro-batch, as
        in torch. With an iterable of batches, every ``k`` batches it yields are one update.
        ``metrics`` (:mod:`lossgraph.runtime.metrics`) are computed after every epoch over
        the training data (arrays; not streamed batches) and the validation data, in the
        logs and ``history_``. ``validation_fraction`` holds out that share of the rows
        (arrays only) as validation data: the rows scikit-learn's ``ShuffleSplit`` (class
        labels: ``StratifiedShuffleSplit``) holds out with ``random_state``.
        ``early_stopping`` (:class:`~lossgraph.runtime.early_stopping.EarlyStopping`) stops
        when its monitored value stops improving and restores the best epoch's state.
        """
        epochs = None if epochs is None else count("epochs", epochs, 0)
        max_steps = None if max_steps is None else count("max_steps", max_steps, 0)
        if epochs is None and max_steps is None:
            epochs = 1
        batch_size = self.batch_size(batch_size)
        shuffle, warm_start = flag("shuffle", shuffle), flag("warm_start", warm_start)
        progress = None if progress is None else flag("progress", progress)
        seed = checks.random_state(random_state)
        callbacks = as_callbacks(callbacks)
        checkpoints = _checkpoints(checkpoint_dir, checkpoint_every, keep_last, keep_best,
                                   monitor)
        if epoch_learning_rate is not None and not callable(epoch_learning_rate):
            raise UnsupportedOptionError(
                f"epoch_learning_rate={epoch_learning_rate!r} must be a function of the epoch "
                "returning the learning rate, or None.")
        accumulation = self.engine.accumulation_steps(accumulation_steps)
        streaming = _streaming(X, y, sample_weight)
        if streaming and epochs not in (0, 1) and not callable(X) and iter(X) is X:
            several = f"{epochs} epochs" if epochs else f"max_steps={max_steps} over epochs"
            raise InvalidDataError(
                f"A one-shot iterator of batches cannot be replayed for {several}: pass a "
                "function that returns a new iterator (or a list), or epochs=1.")
        data = None if streaming else self.engine.prepare(X, y, sample_weight)
        if data is not None and self.engine.fixed_batch is not None and \
                len(next(iter(data.values()))) < batch_size:
            self.engine.check_batch(data, "X")  # not even one batch of the fixed size
        fraction = checks.validation_fraction(validation_fraction)
        held_out = None
        if fraction is not None:
            if validation_data is not None or data is None:
                raise UnsupportedOptionError(
                    f"validation_fraction={fraction:g} holds out rows of X, so it takes arrays "
                    "and no validation_data: pass one or the other.")
            data, held_out = self._hold_out(data, fraction, seed)
        if validation_data is not None:
            if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
                got = (f"a {type(validation_data).__name__}"
                       if not isinstance(validation_data, (tuple, list)) else
                       f"{len(validation_data)} item" + "s" * (len(validation_data) != 1))
                raise InvalidDataError(
                    f"validation_data must be a tuple (X, y) or (X, y, sample_weight); got {got}.")
            held_out = self.engine.prepare(*validation_data, what="validation_data ")
            self.engine.check_rows(held_out, "validation_data")
        metrics = Metrics(self.engine, () if metrics is None else metrics)
        if metrics and data is not None and self.engine.fixed_batch is not None:
            self.engine.check_rows(data, "X (its metrics are computed by prediction runs)")
        if early_stopping is not None:
            if not isinstance(early_stopping, EarlyStopping):
                raise UnsupportedOptionError(
                    f"early_stopping={early_stopping!r} must be an EarlyStopping(...), or None.")
            early_stopping.check(metrics.names, held_out is not None, streamed=data is None)
        if checkpoints is not None:
            checkpoints.check(self.steps_ if warm_start else 0, epoch_log_keys(
                metrics.names, held_out is not None, streamed=data is None))
            callbacks.append(checkpoints)
        if not warm_start:
            self.reset()
        record = self.early_stopping_  # a warm start goes on counting, unless it stopped
        if early_stopping is None or record is None or record.stopped_epoch is not None \
                or record.monitor != early_stopping.key:
            self.early_stopping_ = (None if early_stopping is None else
                                    StoppingRecord(early_stopping.key))
        if self._rng is None:
            self._rng = np.random.default_rng(seed)
        self._epoch_rate = epoch_learning_rate
        self._loop = loop = Loop(callbacks, None if max_steps is None else self.steps_ + max_steps)
        loop.train_begin(self)
        bar = self._progress_bar(progress, epochs)
        try:
            for _ in range(epochs) if epochs is not None else itertools.count():
                if loop.steps_left(self.steps_) == 0:
                    break
                epoch = self.epochs_
                if streaming:
                    losses, sizes = self._stream_epoch(X, epoch, accumulation)
                else:
                    losses, sizes = self._array_epoch(data, batch_size, shuffle, epoch,
                                                      accumulation)
                self.epochs_ += 1
                logs = {"loss": float(np.dot(losses, sizes) / np.sum(sizes))}
                if data is not None:
                    logs.update(metrics(data))
                if held_out is not None:
                    logs["validation_loss"] = self._validation_loss(held_out, epoch)
                    logs.update({f"validation_{k}": v for k, v in metrics(held_out).items()})
                for name, value in logs.items():
                    self.history_.setdefault(name, []).append(value)
                if bar is not None:
                    bar.set_postfix({k: f"{v:.4g}" for k, v in logs.items()}, refresh=False)
                    bar.update(1)
                stop = early_stopping is not None and self.early_stopping_.update(
                    early_stopping, epoch, logs, lambda: self.state)
                loop.epoch_done(self, epoch, logs)
                if loop.stopping or stop:
                    break
        finally:
            if bar is not None:
                bar.close()
        if early_stopping is not None:
            best = self.early_stopping_.best_to_restore(early_stopping)
            if best is not None:
                self.set_state(best)
        loop.train_end(self)
        return self

    def _hold_out(self, data: dict[str, np.ndarray], fraction: float, seed: Any
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``data`` split into the rows trained on and those held out for validation
        (:func:`lossgraph.data.split_rows`; a Generator ``seed`` gives an integer seed)."""
        labels = data[self.engine.label]
        classes = labels if labels.dtype.kind in "iu" and labels.ndim == 1 else None
        if isinstance(seed, np.random.Generator):
            seed = int(seed.integers(2**32))
        train, validation = checks.split_rows(len(labels), fraction, seed, classes)
        if self.engine.fixed_batch is not None:
            self.engine.check_rows({"": validation}, f"validation_fraction={fraction:g}")
        return ({name: array[train] for name, array in data.items()},
                {name: array[validation] for name, array in data.items()})

    def batch_size(self, batch_size: int | None = None) -> int:
        """The rows a step of ``fit(batch_size=batch_size)`` takes: ``batch_size``, by
        default 32 or the batch a model exported with a fixed batch keeps (then the only
        one it takes)."""
        fixed = self.engine.fixed_batch
        if batch_size is None:
            return fixed or 32
        batch_size = count("batch_size", batch_size, 1)
        if fixed is not None and batch_size != fixed:
            detail = self.program.manifest["batch"]["detail"]
            raise UnsupportedOptionError(
                f"batch_size={batch_size}, but the model's batch is fixed at {rows(fixed)}: "
                f"it trains in batches of exactly {rows(fixed)} ({detail}). Leave batch_size out, "
                "or export the model with a free batch axis (lossgraph inspect shows how).")
        return batch_size

    @staticmethod
    def _progress_bar(progress: bool | None, epochs: int | None):
        if progress is None:
            progress = sys.stderr.isatty()
        if not progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=epochs, desc="lossgraph", unit="epoch")

    def _array_epoch(self, data: dict[str, np.ndarray], batch_size: int, shuffle: bool,
                     epoch: int, accumulation: int) -> tuple[np.ndarray, np.ndarray]:
        rows = len(next(iter(data.values())))
        order = self._rng.permutation(rows) if shuffle else None
        full = rows // batch_size
        if self.engine.fixed_batch is not None:
            rows = full * batch_size  # the last, short batch is left out (drop_last)
        updates = full // accumulation  # the epoch graph runs whole groups, any count of them
        losses, sizes = [], []
        if self.engine.runs_epochs and updates > 0:
            left = self._loop.steps_left(self.steps_)
            run = (updates if left is None else min(updates, left)) * accumulation
            losses.append(self._fused_epoch(data, order, run, batch_size, epoch, accumulation))
            sizes.append(np.full(run, batch_size))
            start = run * batch_size
        else:
            start = 0
        if start < rows and not self._loop.stopping:
            if order is None:
                rest = {name: array[start:rows] for name, array in data.items()}
            else:  # one gather per epoch, then views
                rest = {name: array[order[start:rows]] for name, array in data.items()}
            batch_losses, batch_sizes = self._steps(rest, batch_size, epoch, start // batch_size,
                                                    None if order is None else order[start:rows],
                                                    accumulation)
            losses.append(batch_losses)
            sizes.append(batch_sizes)
        return np.concatenate(losses), np.concatenate(sizes)

    def _steps(self, data: dict[str, np.ndarray], batch_size: int, epoch: int, first: int,
               order: np.ndarray | None, accumulation: int,
               specialize: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Minibatch updates over ``data`` (already in epoch order), one per
        ``accumulation`` batches, whose full batches run graphs specialized to
        ``batch_size`` when ``specialize``."""
        rows = len(next(iter(data.values())))
        bounds = [(lo, min(rows, lo + batch_size)) for lo in range(0, rows, batch_size)]
        losses = np.empty(len(bounds))
        sizes = np.array([hi - lo for lo, hi in bounds], np.int64)
        full = batch_size if specialize else None
        done = 0
        while done < len(bounds) and not self._loop.stopping:
            group = bounds[done:done + accumulation]
            batches = [{name: array[lo:hi] for name, array in data.items()} for lo, hi in group]
            losses[done:done + len(group)] = self._update(
                batches, epoch, first + done, full,
                lambda index, group=group: (np.arange(*group[index]) if order is None
                                            else order[slice(*group[index])]))
            done += len(group)
        return losses[:done], sizes[:done]

    def _update(self, batches: list[dict[str, np.ndarray]], epoch: int, first: int,
                full: int | None, rows: Callable[[int], np.ndarray]) -> np.ndarray:
        """One update from the micro-batches ``batches``, the epoch's from batch ``first``
        on (``rows(i)``: the rows of the data in batch ``i``, for messages): their losses.
        The step hooks see the update, its loss the micro-batches' mean by rows."""
        number, rate = self.steps_ + 1, self.learning_rate(self.steps_ + 1)
        losses = self.engine.accumulate(batches, step=number, rate=rate, full=full)
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            index = int(bad[0])
            self._diverged(epoch, first + index, float(losses[index]), batches[index],
                           rows(index))
        self._apply(1, epoch, first)
        if self.engine.clips:
            self.grad_norms_.append(self.engine.grad_norm)
        if self._loop.counts_steps:
            loss = losses[0] if len(losses) == 1 else np.average(
                losses, weights=[_rows(batch) for batch in batches])
            self._loop.step_done(self, number, epoch, first, loss, rate)
        return losses

    def learning_rate(self, step: int) -> float:
        """The learning rate of update ``step`` (counted from 1) as the fit runs it: the
        optimizer's schedule, or the fit's ``epoch_learning_rate`` of the current epoch."""
        if self._epoch_rate is None:
            return self._optimizer.schedule(step)
        rate = self._epoch_rate(self.epochs_)
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not (
                math.isfinite(rate) and rate >= 0):
            raise UnsupportedOptionError(
                f"epoch_learning_rate({self.epochs_}) returned {rate!r}; a learning rate is a "
                "finite number >= 0.")
        return float(rate)

    def _fused_epoch(self, data: dict[str, np.ndarray], order: np.ndarray | None, full: int,
                     batch_size: int, epoch: int, accumulation: int) -> np.ndarray:
        """All full batches of an epoch (whole groups of ``accumulation``) in one run of
        the epoch graph."""
        first = self.steps_ + 1
        updates = full // accumulation
        rates = (self._optimizer.schedules(first, updates) if self._epoch_rate is None else
                 np.full(updates, self.learning_rate(first)))
        losses = self.engine.epoch(data, order, full, batch_size, first_step=first,
                                   rates=rates, accumulation_steps=accumulation)
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            index = int(bad[0])
            rows_used = (np.arange(index * batch_size, (index + 1) * batch_size) if order is None
                         else order[index * batch_size:(index + 1) * batch_size])
            batch = {name: array[rows_used] for name, array in data.items()}
            self._diverged(epoch, index, float(losses[index]), batch, rows_used,
                           first_of_run=index < accumulation)
        self._apply(updates, epoch, 0)
        if self.engine.clips:
            self.grad_norms_.extend(self.engine.grad_norms.tolist())
        losses = losses.astype(np.float64)
        self._loop.steps_done(self, first, epoch, 0,
                              losses.reshape(updates, accumulation).mean(axis=1), rates,
                              batches_per_step=accumulation)
        return losses

    def _stream_epoch(self, batches: Any, epoch: int, accumulation: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """One pass over an iterable of (X, y[, w]) batches, one update per
        ``accumulation`` of them (and one for those left at the end)."""
        source = batches() if callable(batches) else batches
        losses, sizes = [], []
        group: list[dict[str, np.ndarray]] = []

        def update(first: int) -> None:
            losses.append(self._update(group, epoch, first, None,
                                       lambda index: np.arange(_rows(group[index]))))
            sizes.append([_rows(batch) for batch in group])  # they may differ in size

        for index, item in enumerate(source):
            if self._loop.stopping:
                break
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise InvalidDataError(
                    f"Batch {index} is not an (X, y) or (X, y, sample_weight) tuple: pass an "
                    "iterable of such tuples, or X and y as arrays.")
            data = self.engine.prepare(*item, what=f"batch {index} ")
            self.engine.check_batch(data, f"Batch {index}")
            group.append(data)
            if len(group) == accumulation:
                update(index + 1 - len(group))
                group = []
        if group and not self._loop.stopping:
            update(index + 1 - len(group))
        if not losses:
            raise InvalidDataError("The iterable of batches was empty.")
        return np.concatenate(losses), np.concatenate(sizes)

    def _apply(self, steps: int, epoch: int, batch: int) -> None:
        """A successful run of ``steps`` updates from ``epoch``'s ``batch``: its state made
        live (the one it read kept for a step back) and counted."""
        self.engine.apply(steps, f"epoch {epoch}, batch {batch}")
        self.steps_ += steps

    def step_back(self, loss: float, first_of_run: bool = True) -> str:
        """After a run whose loss was not finite, keep the last state whose loss was: the one
        before the last applied run where the failing run's first loss is the bad one (it
        was computed at the run's input state), else the run's input (``steps_`` counts
        back with it). Says which, for the error's message."""
        if first_of_run:
            undone = self.engine.step_back()
            if undone is not None:
                steps, where = undone
                self.steps_ -= steps
                return (f"The weights are those before step {self.steps_ + 1} ({where}), the "
                        f"last whose loss was finite; steps_ is {self.steps_} again.")
            if self.steps_ and not self.engine.keeps_previous_state:
                return (f"The weights are those the failing step read, whose loss is {loss}: "
                        "the state before them is not kept for a model this size "
                        "(Trainer(program, keep_previous_state=True) keeps it, at the cost of "
                        "more copies of the weights).")
            return (f"The weights are those this training started from; their loss is "
                    f"{loss} already.")
        return (f"The weights are those at the start of the failing epoch (before step "
                f"{self.steps_ + 1}), whose first batch's loss was finite.")

    def _diverged(self, epoch: int, batch: int, loss: float, data: Mapping[str, np.ndarray],
                  rows: np.ndarray, first_of_run: bool = True) -> None:
        """Raise the error that explains a non-finite loss: the batch's data, or divergence
        (then the last state whose loss was finite is kept, :meth:`step_back`)."""
        restored = "the failing step" if first_of_run else "the start of the epoch"
        where = f"epoch {epoch}, batch {batch}"
        problem = self.engine.data_problem(data, rows, where, restored)
        if problem is not None:
            raise problem
        rate = self.learning_rate(self.steps_ + 1)
        kept = self.step_back(loss, first_of_run)
        if not all(np.isfinite(v).all() for v in self.engine.live().values()):
            kept += (" They hold non-finite values already (an earlier update overflowed): "
                     "reset() or set_state() before training again.")
        raise ConvergenceError(
            f"The loss became {loss} at {where}: training diverged. Try a smaller learning "
            f"rate (now {rate:g}), scale the features, or a smaller penalty. {kept}")

    # -- evaluation and export ---------------------------------------------------------
    def _validation_loss(self, data: Mapping[str, np.ndarray], epoch: int) -> float:
        """The loss on the validation data, with a ValidationLossWarning when it is not
        finite (the training data's loss was: the model fails on these data only)."""
        loss = self.engine.evaluate(data)
        if not math.isfinite(loss):
            warnings.warn(
                f"The validation loss after epoch {epoch} is {loss}, though the training loss "
                "is finite: the model predicts values the loss cannot score on the validation "
                "data (features far outside the training range, or labels the loss cannot "
                "take). It is recorded in validation_losses_; training goes on.",
                ValidationLossWarning, stacklevel=4)
        return loss

    def evaluate(self, X: Any, y: Any, sample_weight: Any = None,
                 metrics: Sequence[str] | None = None, *, ema: bool = False
                 ) -> float | dict[str, float]:
        """The loss on ``(X, y)`` with the current weights (lower is better; layers in
        inference mode), or with their averages where ``ema=True`` (a program compiled
        with ``ema_decay``). For a model whose batch is fixed, ``X`` holds a multiple of
        that many rows, run that many a time, their losses averaged as one mean. With
        ``metrics`` (:mod:`lossgraph.runtime.metrics`), a dict: ``loss`` and each metric."""
        scores = None if metrics is None else Metrics(self.engine, metrics)
        data = self.engine.prepare(X, y, sample_weight)
        loss = self.engine.evaluate(data, ema)
        return loss if scores is None else {"loss": loss, **scores(data, ema)}

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The previous release's name of :meth:`evaluate`: a loss, lower is better, unlike
        scikit-learn's ``score`` (with a warning)."""
        warn_renamed("Trainer.score", "Trainer.evaluate (a loss: lower is better)")
        return self.evaluate(X, y, sample_weight)

    def predict(self, X: Any, *, ema: bool = False) -> np.ndarray:
        """The model's prediction (the output the loss is computed on) for ``X`` (for a
        model whose batch is fixed, a multiple of that many rows, run that many a time);
        with ``ema=True``, by the weights' averages."""
        return self.engine.predict(self.engine.prepare(X, graph="predict", with_label=False),
                                   ema)

    def to_inference_model(self, *, ema: bool = False, merge: bool = False) -> onnx.ModelProto:
        """The original inference model with the trained weights and buffers written back
        (``ema=True``: the weights' averages; ``merge=True``: LoRA adapters folded into
        their base weights, :meth:`TrainingProgram.to_inference_model`)."""
        return self.program.to_inference_model(self.engine.live(), ema=ema, merge=merge)

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, logs: Mapping[str, Any] | None = None
                        ) -> Path:
        """Write the program, state, counters, losses and shuffling generator, atomically,
        and ``logs`` (an epoch's, which rotating checkpoints compare) in its record.

        ``path`` must be new, empty, or a checkpoint folder lossgraph wrote (holding
        nothing else); anything else is an :class:`~lossgraph.errors.UnsafeWriteError`.
        """
        program = TrainingProgram(self.program.light_graphs, self.program.manifest, self.state,
                                  self.program.inference_model)
        progress = self.progress()
        rng, record = progress["rng"], progress["early_stopping"]
        extra = {} if logs is None else {"logs": dict(logs)}
        return save_checkpoint(path, program, {
            **progress, "rng": None if rng is None else rng.bit_generator.state,
            "early_stopping": None if record is None else record.to_record(), **extra},
            None if record is None else record.best_state)

    @classmethod
    def load_checkpoint(cls, path: str | os.PathLike, providers: Sequence[str] | None = None,
                        session_options: Any = None, keep_previous_state: bool | None = None,
                        in_place: bool | None = None) -> Trainer:
        """A trainer resuming a checkpoint: ``fit(..., warm_start=True)`` continues it (the
        options as the constructor's).

        A damaged checkpoint is an :class:`~lossgraph.errors.InvalidProgramError`.
        """
        parts, record = read_checkpoint(path)
        trainer = cls(TrainingProgram(*parts), providers, session_options, keep_previous_state,
                      in_place)
        trainer.restore_progress(record)
        return trainer

    def progress(self) -> dict[str, Any]:
        """What ``fit(warm_start=True)`` continues besides the state: the counters, the
        losses and metrics, the shuffling generator and early stopping's record (for
        :meth:`restore_progress`)."""
        losses = ("loss", "validation_loss")
        return {"steps": self.steps_, "epochs": self.epochs_,
                "train_losses": list(self.train_losses_),
                "validation_losses": list(self.validation_losses_),
                "metrics": {k: list(v) for k, v in self.history_.items() if k not in losses},
                "rng": self._rng, "early_stopping": self.early_stopping_}

    def restore_progress(self, progress: Mapping[str, Any]) -> None:
        """Continue from :meth:`progress` (another trainer's, or a checkpoint's)."""
        self.steps_, self.epochs_ = progress["steps"], progress["epochs"]
        self.history_ = {"loss": list(progress["train_losses"]),
                         "validation_loss": list(progress["validation_losses"]),
                         **{k: list(v) for k, v in progress.get("metrics", {}).items()}}
        self._rng = progress["rng"]
        record = progress.get("early_stopping")
        if record is not None and not isinstance(record, StoppingRecord):  # a checkpoint's
            record = StoppingRecord.from_record(record, progress.get("best_state"),
                                                "the checkpoint's trainer.json")
        self.early_stopping_ = copy.deepcopy(record)

    # -- pickling ----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """A trainer pickles as its program, live state, progress and buffer-set options;
        onnxruntime sessions are made again on first use after unpickling.
        ``session_options`` are kept when a dict of settings; onnxruntime's
        ``SessionOptions`` (not picklable) are not: pass them again with a new Trainer if
        needed."""
        settings = self.session_options if isinstance(self.session_options, Mapping) else None
        return {"program": self.program, "providers": self.providers, "state": self.state,
                "progress": self.progress(), "session_options": settings,
                **self._state_options}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(saved["program"], saved["providers"], saved.get("session_options"),
                      saved.get("keep_previous_state"), saved.get("in_place"))
        self.set_state(saved["state"])
        self.restore_progress(saved["progress"])


def _checkpoints(folder: str | os.PathLike | None, every: int, keep_last: int | None,
                 keep_best: bool, monitor: str) -> Checkpoints | None:
    """fit's checkpoint options as a :class:`Checkpoints` callback (None without a folder,
    where the other options have nothing to act on)."""
    if folder is None:
        given = [f"{name}={value!r}" for name, value, default in (
            ("checkpoint_every", every, 1), ("keep_last", keep_last, 3),
            ("keep_best", keep_best, True), ("monitor", monitor, "val_loss"))
            if value != default or type(value) is not type(default)]
        if given:
            raise UnsupportedOptionError(
                f"{', '.join(given)} without checkpoint_dir: these options rotate the "
                "checkpoints fit saves into checkpoint_dir. Pass checkpoint_dir=FOLDER, or "
                "leave them out.")
        return None
    return Checkpoints(folder, every, keep_last, keep_best, monitor)


def _rows(data: Mapping[str, np.ndarray]) -> int:
    """The number of rows of a batch's arrays."""
    return len(next(iter(data.values())))


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
