"""Early stopping: end a fit when the monitored value stops improving, keep the best state.

    trainer.fit(X, y, epochs=100, validation_fraction=0.1,
                early_stopping=EarlyStopping(monitor="validation_loss", patience=5))
    trainer.early_stopping_.best_epoch, trainer.early_stopping_.stopped_epoch

After every epoch the fit's logs hold ``loss``, ``validation_loss`` and each metric
(``accuracy``, ``validation_accuracy``, ...); ``monitor`` names one (Keras's ``val_``
prefix reads as ``validation_``, as everywhere a fit monitors a value:
:class:`~lossgraph.runtime.callbacks.Monitor`). An epoch improves when its value beats the
best so far by more than ``min_delta`` (lower is better for losses, MAE, RMSE and log
loss; higher for accuracy, F1 and R2: ``mode="auto"`` infers it, ``"min"`` or ``"max"``
says it); a NaN never improves. After ``patience`` epochs in a row
without improvement the fit stops (Keras's ``EarlyStopping``) and, with ``restore_best``,
ends on the state (weights, optimizer states, buffers) of the best epoch; the counters
(``steps_``, ``epochs_``) and the history keep what ran. A fit that runs out of epochs
before the rule stops it keeps its last state, so that a checkpoint of it resumes exactly
as the uninterrupted fit goes on (the best state so far is ``early_stopping_.best_state``,
for ``set_state``).

The record (:class:`StoppingRecord`: best value, best epoch, epochs without improvement,
the best state) is the trainer's ``early_stopping_``: a checkpoint keeps it, and a
``fit(..., warm_start=True)`` with the same monitor goes on counting from it (after a stop,
it counts afresh).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidProgramError, UnknownNameError, UnsupportedOptionError, suggest
from ..options import count, flag, non_negative
from .callbacks import Monitor, epoch_log_keys
from .metrics import METRICS

__all__ = ["EarlyStopping", "StoppingRecord"]

_VALIDATION = "validation_"


@dataclass(frozen=True)
class EarlyStopping:
    """Stop a fit after ``patience`` epochs in a row whose ``monitor`` does not improve on
    the best by more than ``min_delta`` (module docstring); every value is checked here."""

    monitor: str = "validation_loss"
    patience: int = 5
    min_delta: float = 0.0
    restore_best: bool = True
    mode: str = "auto"

    def __post_init__(self) -> None:
        Monitor(self.monitor, self.mode)  # the name and mode, checked
        count("EarlyStopping patience", self.patience, 1)
        non_negative("EarlyStopping min_delta", self.min_delta)
        flag("EarlyStopping restore_best", self.restore_best)

    @property
    def watched(self) -> Monitor:
        """The value of the logs ``monitor`` names (``key``) and which way is better."""
        return Monitor(self.monitor, self.mode)

    @property
    def key(self) -> str:
        """The logs' name of the monitored value (``val_loss`` is ``validation_loss``)."""
        return self.watched.key

    @property
    def maximize(self) -> bool:
        """Whether a larger monitored value is better."""
        return self.watched.mode == "max"

    def check(self, metrics: tuple[str, ...], validation: bool, streamed: bool = False
              ) -> None:
        """The fit's logs will hold ``monitor``: its ``metrics`` (of the training rows unless
        they are ``streamed``), and with ``validation`` data the ``validation_`` ones; else
        an error before any work."""
        available = epoch_log_keys(metrics, validation, streamed)
        key = self.key
        if key in available:
            return
        name = key.removeprefix(_VALIDATION)
        if streamed and key in metrics:
            raise UnsupportedOptionError(
                f"EarlyStopping(monitor={self.monitor!r}) watches a metric of the training "
                "rows, which a fit over streamed batches does not compute: monitor "
                f"'validation_{name}' (with validation_data) or 'loss'.")
        if key.startswith(_VALIDATION) and not validation and (name == "loss" or name in metrics):
            raise UnsupportedOptionError(
                f"EarlyStopping(monitor={self.monitor!r}) watches validation data, but the fit "
                "has none: pass validation_fraction=0.1 (or validation_data), or monitor "
                "'loss'.")
        known = name in METRICS or name.endswith("_accuracy")
        if known and name not in metrics:
            raise UnsupportedOptionError(
                f"EarlyStopping(monitor={self.monitor!r}) watches the metric {name!r}, which "
                f"the fit does not compute: pass metrics=[{name!r}].")
        raise UnknownNameError(f"EarlyStopping(monitor={self.monitor!r}) is not in the fit's "
                               "logs." + suggest(key, available, "values"))


@dataclass
class StoppingRecord:
    """What early stopping knows so far: the monitored value, its best value and epoch,
    the epochs since (``wait``), the epoch training stopped after (None: it did not), and
    the state of the best epoch (kept when the rule restores it)."""

    monitor: str
    best: float | None = None
    best_epoch: int | None = None
    wait: int = 0
    stopped_epoch: int | None = None
    best_state: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def update(self, rule: EarlyStopping, epoch: int, logs: Mapping[str, float],
               state: Callable[[], dict[str, np.ndarray]]) -> bool:
        """Count ``epoch`` (``logs`` its values; ``state()`` a copy of its state): whether
        training stops now."""
        value = float(logs[rule.key])
        better = not math.isnan(value) and (
            self.best is None
            or (value > self.best + rule.min_delta if rule.maximize
                else value < self.best - rule.min_delta))
        if better:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if rule.restore_best:
                self.best_state = state()
            return False
        self.wait += 1
        if self.wait >= rule.patience:
            self.stopped_epoch = epoch
            return True
        return False

    def best_to_restore(self, rule: EarlyStopping) -> dict[str, np.ndarray] | None:
        """The best epoch's state when the rule stopped the fit and restores it."""
        if rule.restore_best and self.stopped_epoch is not None:
            return self.best_state
        return None

    def to_record(self) -> dict[str, Any]:
        """The JSON record a checkpoint keeps (the best state is stored beside it)."""
        return {"monitor": self.monitor, "best": self.best, "best_epoch": self.best_epoch,
                "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    @classmethod
    def from_record(cls, record: Any, best_state: dict[str, np.ndarray] | None, at: str
                    ) -> StoppingRecord:
        """The record :meth:`to_record` wrote, checked (an InvalidProgramError names ``at``)."""
        def number(key: str, kind: type) -> Any:
            value = record.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise InvalidProgramError(f"{at}: early_stopping {key!r} is {value!r}.")
            return value

        if not isinstance(record, dict) or not isinstance(record.get("monitor"), str):
            raise InvalidProgramError(f"{at}: 'early_stopping' is not an early-stopping record.")
        wait = number("wait", numbers.Integral)
        return cls(record["monitor"], number("best", numbers.Real),
                   number("best_epoch", numbers.Integral), wait or 0,
                   number("stopped_epoch", numbers.Integral), best_state)
