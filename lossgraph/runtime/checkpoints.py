"""Checkpoints that rotate: ``fit(..., checkpoint_dir=..., checkpoint_every=1, keep_last=3,
keep_best=True, monitor="val_loss")``.

    trainer.fit(X, y, epochs=20, validation_data=(Xv, yv), checkpoint_dir="ckpt")
    trainer = Trainer.load_checkpoint(latest_checkpoint("ckpt"))   # lossgraph.paths
    trainer.fit(X, y, epochs=10, validation_data=(Xv, yv), checkpoint_dir="ckpt",
                warm_start=True)                                   # continues it exactly

Every ``checkpoint_every`` epochs (and at the end of the fit, when its last state is not
saved yet) :meth:`Trainer.save_checkpoint` writes ``checkpoint_dir/checkpoint-<steps_>``
(Hugging Face's naming) with the epoch's logs in its record; then only the last
``keep_last`` of lossgraph's checkpoints there stay, and the best by the monitored value
of their logs (:class:`~lossgraph.runtime.callbacks.Monitor`). A checkpoint is lossgraph's
when its folder is one it recognises (:data:`~lossgraph.paths.CHECKPOINT_FOLDER`: its
``trainer.json`` and program folder) and holds nothing else: whatever else is in
``checkpoint_dir`` (your files and folders, a checkpoint you added a file to) is never
touched, and :func:`~lossgraph.fileio.remove_directory` checks again before it deletes.

A fit refuses, before any work, a ``checkpoint_dir`` holding lossgraph checkpoints of a
later step than the one it starts from: they are another run's, and rotating would mix
the two (resume from the latest, or choose another folder).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UnsafeWriteError, UnsupportedOptionError
from ..fileio import ensure_folder, remove_directory
from ..options import count, flag
from ..paths import CHECKPOINT_FOLDER, checkpoint_record, saved_checkpoints
from .callbacks import Callback, Monitor

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Checkpoints"]

class Checkpoints(Callback):
    """Saves the trainer into ``folder`` every ``every`` epochs and at the end of the fit,
    keeping the last ``keep_last`` (None: all) and, with ``keep_best``, the best by
    ``monitor`` (module docstring)."""

    def __init__(self, folder: str | os.PathLike, every: int = 1, keep_last: int | None = 3,
                 keep_best: bool = True, monitor: str = "val_loss") -> None:
        if not isinstance(folder, (str, os.PathLike)):
            raise UnsupportedOptionError(
                f"checkpoint_dir={folder!r} must be a path (a str or os.PathLike): the folder "
                "the checkpoints go into.")
        self.folder = Path(folder)
        self.every = count("checkpoint_every", every, 1)
        self.keep_last = None if keep_last is None else count("keep_last", keep_last, 1)
        self.keep_best = flag("keep_best", keep_best)
        self.monitor = Monitor(monitor)
        self._saved_at: int | None = None

    def check(self, first_step: int, keys: Sequence[str]) -> None:
        """Before any work: the epoch logs will hold the monitored value (``keys``), the
        folder is one (made when missing), and no checkpoint there is past ``first_step``
        (another run's)."""
        if self.keep_best:
            self.monitor.check(keys)
        ensure_folder(self.folder)
        later = [path.name for steps, path in saved_checkpoints(self.folder)
                 if steps > first_step]
        if later:
            raise UnsafeWriteError(
                f"checkpoint_dir {str(self.folder)!r} holds {', '.join(later)}, past step "
                f"{first_step} this fit starts from: another run's checkpoints, which rotating "
                "would mix with this one's. Resume from the latest "
                "(Trainer.load_checkpoint(latest_checkpoint(folder)), then fit(..., "
                "warm_start=True)), or choose another folder.")
        self._saved_at = first_step  # the state a fit starts from needs no new checkpoint

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> None:
        if trainer.epochs_ % self.every == 0:
            self.save(trainer, logs)

    def on_train_end(self, trainer: Trainer, logs: dict) -> None:
        if trainer.steps_ != self._saved_at:
            self.save(trainer, logs)

    def save(self, trainer: Trainer, logs: dict) -> Path:
        """Save ``trainer`` (with the epoch's ``logs``) as ``checkpoint-<steps_>``, then
        rotate."""
        path = trainer.save_checkpoint(self.folder / f"checkpoint-{trainer.steps_}", logs=logs)
        self._saved_at = trainer.steps_
        self.rotate()
        return path

    def rotate(self) -> None:
        """Delete lossgraph's checkpoints in the folder but the last ``keep_last`` and the
        best."""
        saved = [path for _, path in saved_checkpoints(self.folder)]
        keep = set(saved if self.keep_last is None else saved[-self.keep_last:])
        if self.keep_best:
            best, best_path = None, None
            for path in saved:
                logs = (checkpoint_record(path) or {}).get("logs")
                value = logs.get(self.monitor.key) if isinstance(logs, dict) else None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                        self.monitor.better(float(value), best):
                    best, best_path = float(value), path
            keep.add(best_path)
        for path in saved:
            if path not in keep:
                remove_directory(path, CHECKPOINT_FOLDER)
