"""Callbacks of :meth:`Trainer.fit <lossgraph.runtime.trainer.Trainer.fit>`: hooks at every
step and every epoch, the CSV and TensorBoard loggers, and the loop's stop (a callback's
request, ``max_steps``).

    class Watch(lossgraph.Callback):
        def on_step_end(self, trainer, step, logs):      # logs: loss, learning_rate, ...
            print(step, logs["loss"])
        def on_epoch_end(self, trainer, epoch, logs):    # logs: loss, validation_loss
            return logs["loss"] < 1e-3                   # True stops training

    trainer.fit(X, y, callbacks=[Watch(), lossgraph.CSVLogger("steps.csv", per="step")])

A plain function ``callback(trainer, epoch, logs)`` is an epoch callback, as before
:class:`Callback` existed. The hooks are those Keras and Hugging Face users know:
``on_train_begin``, ``on_step_end`` (after every update, ``step`` counted from 1 as
``trainer.steps_``), ``on_epoch_end``, ``on_train_end``; a hook returning ``True`` stops
training. Step logs hold ``loss`` (the batch's loss, at the state the step read),
``learning_rate``, ``epoch`` and ``batch``, and every other per-step value the program
reports (a gradient norm, ``grad_norm``, where it clips gradients): :meth:`Loop.step_done`
and :meth:`Loop.steps_done` take them as keywords and pass them on.

With ``fuse="epoch"`` an epoch's full batches run as one graph: its per-step losses are
outputs of that run, and the step hooks are called after it, once per step, in order,
with each step's values (the trainer is then at the run's end). A stop asked there takes
effect after the run: the steps of the run happened, so every hook sees each of them.
Without a step hook (none overrides ``on_step_end``) nothing per step is built: the loop
runs as fast as without callbacks.
"""

from __future__ import annotations

import csv
import io
import math
import os
import reprlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import RuntimeUnavailableError, UnknownNameError, UnsupportedOptionError, suggest
from ..fileio import check_file_target, ensure_folder
from ..options import choice, flag
from ..paths import LOG_COLUMNS, is_csv_log

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Callback", "CSVLogger", "TensorBoard", "Monitor", "Loop", "as_callbacks"]


class Callback:
    """Hooks :meth:`Trainer.fit` calls; override those you need. Returning ``True`` from
    ``on_step_end`` or ``on_epoch_end`` stops training (after the epoch graph's run, in
    ``fuse="epoch"``: see the module docstring)."""

    @property
    def watches_steps(self) -> bool:
        """Whether :meth:`on_step_end` does anything: without such a callback the loop
        builds no step logs (a subclass whose step hook is off says so here)."""
        return type(self).on_step_end is not Callback.on_step_end

    def on_train_begin(self, trainer: Trainer, logs: dict) -> None:
        """Before the first step of a fit (every option checked, nothing trained)."""

    def on_step_end(self, trainer: Trainer, step: int, logs: dict) -> bool | None:
        """After update number ``step`` (from 1, as ``trainer.steps_``)."""

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> bool | None:
        """After epoch ``epoch`` (from 0) and its validation."""

    def on_train_end(self, trainer: Trainer, logs: dict) -> None:
        """After the fit's last step and epoch (also when a hook or ``max_steps`` stopped
        it; not after an error, as in Keras); ``logs`` are the last epoch's."""


class EpochFunction(Callback):
    """A plain function ``callback(trainer, epoch, logs)``: an epoch callback."""

    def __init__(self, function: Callable[[Trainer, int, dict], Any]) -> None:
        self.function = function

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> bool | None:
        return self.function(trainer, epoch, logs) is True


def as_callbacks(value: Any) -> list[Callback]:
    """``fit``'s ``callbacks=`` as :class:`Callback` objects: ``None``, one callback or a
    list; each a Callback or a function ``callback(trainer, epoch, logs)``."""
    if value is None:
        return []
    if isinstance(value, Callback) or callable(value):
        value = [value]
    elif isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise UnsupportedOptionError(
            f"callbacks={reprlib.repr(value)} must be a list of lossgraph.Callback objects or "
            "functions callback(trainer, epoch, logs).")
    listed = []
    for index, callback in enumerate(value):
        if isinstance(callback, Callback):
            listed.append(callback)
        elif callable(callback):
            listed.append(EpochFunction(callback))
        else:
            raise UnsupportedOptionError(
                f"callbacks[{index}]={reprlib.repr(callback)} is not callable: each callback is "
                "a lossgraph.Callback or a function callback(trainer, epoch, logs).")
    return listed


class Loop:
    """One fit's callbacks and stop: the hooks called in order, ``True`` from any stops
    training, and the step budget (``max_steps``) ends it at exactly that update."""

    def __init__(self, callbacks: list[Callback], last_step: int | None = None) -> None:
        self.callbacks = callbacks
        #: the ``steps_`` at which training stops (None: no step budget)
        self.last_step = last_step
        #: whether training stops at the end of the current run
        self.stopping = False
        self._stepping = [c for c in callbacks if c.watches_steps]
        self.last_logs: dict = {}

    @property
    def watches_steps(self) -> bool:
        """Whether a callback has a step hook (else nothing per step is built)."""
        return bool(self._stepping)

    @property
    def counts_steps(self) -> bool:
        """Whether :meth:`step_done` has anything to do: a step hook, or a budget."""
        return self.watches_steps or self.last_step is not None

    def steps_left(self, steps: int) -> int | None:
        """Updates the budget allows after ``steps`` (None: no budget)."""
        return None if self.last_step is None else max(0, self.last_step - steps)

    def train_begin(self, trainer: Trainer) -> None:
        for callback in self.callbacks:
            callback.on_train_begin(trainer, {})

    def step_done(self, trainer: Trainer, step: int, epoch: int, batch: int, loss: float,
                  rate: float, **values: float) -> None:
        """Update ``step`` ran (``values``: the program's other per-step outputs): the step
        hooks, then the budget."""
        if self._stepping:
            logs = {"loss": float(loss), "learning_rate": float(rate), "epoch": epoch,
                    "batch": batch, **{k: float(v) for k, v in values.items()}}
            if any([c.on_step_end(trainer, step, dict(logs)) is True for c in self._stepping]):
                self.stopping = True
        if self.last_step is not None and step >= self.last_step:
            self.stopping = True

    def steps_done(self, trainer: Trainer, first_step: int, epoch: int, first_batch: int,
                   losses: np.ndarray, rates: np.ndarray, batches_per_step: int = 1,
                   **values: np.ndarray) -> None:
        """A run of ``len(losses)`` updates from ``first_step`` (the epoch graph's), each of
        ``batches_per_step`` batches (gradient accumulation): each step's hooks in order,
        with its values."""
        if not self._stepping:
            self.step_done(trainer, first_step + len(losses) - 1, epoch, 0, 0.0, 0.0)
            return
        for index, (loss, rate) in enumerate(zip(losses.tolist(), rates.tolist())):
            self.step_done(trainer, first_step + index, epoch,
                           first_batch + index * batches_per_step, loss, rate,
                           **{k: v[index] for k, v in values.items()})

    def epoch_done(self, trainer: Trainer, epoch: int, logs: dict) -> None:
        self.last_logs = logs
        if any([c.on_epoch_end(trainer, epoch, dict(logs)) is True for c in self.callbacks]):
            self.stopping = True

    def train_end(self, trainer: Trainer) -> None:
        for callback in self.callbacks:
            callback.on_train_end(trainer, dict(self.last_logs))


# -- what a callback monitors --------------------------------------------------------------


#: Keras's spelling of a validation value's prefix, and the one lossgraph's logs use.
_KERAS_PREFIX, _PREFIX = "val_", "validation_"
#: Words of a monitored name that make higher better (Keras's ``mode="auto"`` rule).
_HIGHER_IS_BETTER = ("accuracy", "acc", "f1", "r2", "auc")


def epoch_log_keys(metrics: Sequence[str], validation: bool, streamed: bool = False
                   ) -> list[str]:
    """The values a fit's epoch logs hold: the loss and its ``metrics`` (of the training
    rows, unless they are ``streamed``), and with ``validation`` data their ``validation_``
    twins."""
    keys = ["loss", *(() if streamed else metrics)]
    if validation:
        keys += [_PREFIX + name for name in ("loss", *metrics)]
    return keys


class Monitor:
    """A value of the epoch logs to compare (``"val_loss"``, Keras's spelling, is the logs'
    ``validation_loss``), and which way is better: ``mode="auto"`` is ``"max"`` for
    accuracies, F1, R² and AUC, else ``"min"``."""

    def __init__(self, name: str = "val_loss", mode: str = "auto") -> None:
        if not isinstance(name, str) or not name:
            raise UnsupportedOptionError(
                f"monitor={reprlib.repr(name)} must name a value of the epoch logs, such as "
                "'val_loss' (the validation loss) or 'loss' (the training loss).")
        mode = choice("mode", mode, ("auto", "min", "max"))
        self.name = name
        #: the key of the epoch logs the value is read from
        self.key = _PREFIX + name[len(_KERAS_PREFIX):] if name.startswith(_KERAS_PREFIX) \
            else name
        if mode == "auto":
            mode = "max" if any(w in self.key.split("_") for w in _HIGHER_IS_BETTER) else "min"
        self.mode = mode

    def check(self, keys: Sequence[str]) -> None:
        """Refuse, before any work, a value the epoch logs will not hold (``keys``)."""
        if self.key in keys:
            return
        if self.key.startswith(_PREFIX) and self.key[len(_PREFIX):] in keys:
            raise UnsupportedOptionError(
                f"monitor={self.name!r} is a validation value, but fit has no "
                "validation_data: pass validation_data=(X, y), monitor='loss' (the training "
                "loss), or keep_best=False.")
        raise UnknownNameError(
            f"monitor={self.name!r}: the epoch logs hold no {self.key!r}, only "
            f"{', '.join(map(repr, keys))}." + suggest(self.key, list(keys), "values"))

    def better(self, value: float, best: float | None) -> bool:
        """Whether ``value`` improves on ``best`` (None: nothing yet); NaN never does."""
        if math.isnan(value):
            return False
        if best is None or math.isnan(best):
            return True
        return value < best if self.mode == "min" else value > best


# -- loggers -------------------------------------------------------------------------------


#: The hook that writes a CSVLogger's row, by what a row is.
_ROW_HOOKS = {"epoch": "on_epoch_end", "step": "on_step_end"}
#: Step logs that say where a step is, not what it measured (not plotted).
_POSITION = frozenset({"epoch", "batch"})


class CSVLogger(Callback):
    """One CSV row per epoch (``per="epoch"``: ``epoch, steps`` and the epoch logs, as
    Keras's CSVLogger) or per step (``per="step"``: ``step`` and the step logs), each row
    written and flushed as it comes, numbers as Python prints them (they read back
    exactly). An existing file is replaced only when it is a log lossgraph wrote (its
    header row says so), or with ``overwrite=True``; ``append=True`` adds to it."""

    def __init__(self, path: str | os.PathLike, per: str = "epoch", append: bool = False,
                 overwrite: bool = False) -> None:
        self.per = choice("per", per, tuple(LOG_COLUMNS))
        #: the hook that writes a row
        self.hook = _ROW_HOOKS[self.per]
        self.append = flag("append", append)
        self.overwrite = flag("overwrite", overwrite)
        self.path = check_file_target(path, is_csv_log, overwrite or append)
        self._stream: io.TextIOBase | None = None
        self._writer: csv.DictWriter | None = None

    @property
    def watches_steps(self) -> bool:
        return self.hook == "on_step_end"

    def on_train_begin(self, trainer: Trainer, logs: dict) -> None:
        check_file_target(self.path, is_csv_log, self.overwrite or self.append)
        exists = self.append and self.path.exists() and self.path.stat().st_size > 0
        self._stream = open(self.path, "a" if exists else "w", newline="")  # noqa: SIM115
        self._writer = None
        if exists:
            with open(self.path, newline="") as stream:
                self._start(next(csv.reader(stream)))

    def _start(self, columns: list[str]) -> None:
        self._writer = csv.DictWriter(self._stream, columns, restval="",
                                      extrasaction="ignore")

    def _write(self, row: dict) -> None:
        if self._writer is None:
            self._start(list(row))  # LOG_COLUMNS[self.per], then the logs
            self._writer.writeheader()
        self._writer.writerow({k: repr(v) if isinstance(v, float) else v
                               for k, v in row.items()})
        self._stream.flush()

    def on_step_end(self, trainer: Trainer, step: int, logs: dict) -> None:
        if self.hook == "on_step_end":
            self._write({"step": step, **logs})

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> None:
        if self.hook == "on_epoch_end":
            self._write({"epoch": epoch, "steps": trainer.steps_, **logs})

    def on_train_end(self, trainer: Trainer, logs: dict) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class TensorBoard(Callback):
    """Scalars for TensorBoard in ``log_dir`` (made when missing): every step's logs under
    ``step/<name>`` (at the step number), every epoch's under ``epoch/<name>`` (at the
    epoch number). Written with the ``tensorboard`` package's own event writer, the one
    ``torch.utils.tensorboard`` uses: ``pip install 'lossgraph[tensorboard]'``."""

    def __init__(self, log_dir: str | os.PathLike, steps: bool = True) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise RuntimeUnavailableError(
                "lossgraph.TensorBoard needs the tensorboard package: pip install tensorboard "
                "(or pip install 'lossgraph[tensorboard]'), or log with lossgraph.CSVLogger."
            ) from None
        self.log_dir = Path(log_dir)
        self.steps = flag("steps", steps)
        self._types = Event, Summary, EventFileWriter
        self._writer = None

    @property
    def watches_steps(self) -> bool:
        return self.steps

    def on_train_begin(self, trainer: Trainer, logs: dict) -> None:
        ensure_folder(self.log_dir)
        self._writer = self._types[2](str(self.log_dir))

    def _scalars(self, prefix: str, number: int, logs: Mapping[str, Any]) -> None:
        event, summary = self._types[0], self._types[1]
        values = [summary.Value(tag=f"{prefix}/{name}", simple_value=float(value))
                  for name, value in logs.items() if name not in _POSITION]
        self._writer.add_event(event(wall_time=time.time(), step=number,
                                     summary=summary(value=values)))

    def on_step_end(self, trainer: Trainer, step: int, logs: dict) -> None:
        if self.steps:
            self._scalars("step", step, logs)

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> None:
        self._scalars("epoch", epoch, logs)
        self._writer.flush()

    def on_train_end(self, trainer: Trainer, logs: dict) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
