"""lossgraph train: fit a program, write the model, checkpoint, history and plot."""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import __version__
from ..errors import (
    UnsupportedOptionError,
)
from ..fileio import write_file
from ..paths import latest_checkpoint, resumed_checkpoint
from ..program import TrainingProgram
from ..runtime.early_stopping import EarlyStopping
from ..runtime.trainer import Trainer
from .build import _export_function
from .data import _rows, _split, _training_data
from .outputs import _external_note, _figure_class, _is_history, _is_plot
from .parser import HISTORY_FORMAT

EXIT_OK = 0

# -- train -----------------------------------------------------------------------------------


def loss_curve_png(train_losses: Sequence[float], validation_losses: Sequence[float],
                   title: str = "", metrics: Mapping[str, Sequence[float]] | None = None
                   ) -> bytes:
    """The loss by epoch drawn as a PNG (marked as lossgraph's), and below it each metric
    by epoch when there are some; a series with fewer values than epochs is drawn against
    the last epochs."""
    metrics = metrics or {}
    figure = _figure_class()(figsize=(6.4, 6.4 if metrics else 4.0), dpi=100)
    axes = figure.add_subplot(2 if metrics else 1, 1, 1)
    count = len(train_losses)
    marker = "o" if count <= 40 else None
    axes.plot(range(1, count + 1), train_losses, marker=marker, markersize=3,
              label="training loss")
    if validation_losses:
        first = count - len(validation_losses) + 1
        axes.plot(range(first, first + len(validation_losses)), validation_losses,
                  marker=marker, markersize=3, label="validation loss")
    values = [v for v in (*train_losses, *validation_losses) if math.isfinite(v)]
    if values and min(values) > 0 and max(values) / min(values) > 100:
        axes.set_yscale("log")
    else:
        axes.ticklabel_format(axis="y", useOffset=False)  # the losses as they are printed
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.set_title(title or "loss by epoch")
    axes.grid(alpha=0.3)
    axes.legend()
    if metrics:
        below = figure.add_subplot(2, 1, 2, sharex=axes)
        for name, values in metrics.items():
            first = count - len(values) + 1
            below.plot(range(first, first + len(values)), values, marker=marker, markersize=3,
                       label=name)
        below.set_xlabel("epoch")
        below.set_ylabel("metric")
        below.grid(alpha=0.3)
        below.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": f"lossgraph {__version__}"})
    return buffer.getvalue()


def _trainer_and_data(args: argparse.Namespace) -> tuple[Trainer, dict]:
    """A trainer of the program folder (or resuming ``--resume``'s checkpoint) and the data
    of ``--data``, read before the trainer starts onnxruntime (check_inputs found both)."""
    if args.resume is None:
        program = TrainingProgram.load(args.program)
        data = _training_data(args.data, args, program)
        return Trainer(program), data
    trainer = Trainer.load_checkpoint(resumed_checkpoint(args.resume))
    if args.program is not None:
        program = TrainingProgram.load(args.program)
        if program.manifest != trainer.program.manifest:
            raise UnsupportedOptionError(
                f"The checkpoint {args.resume!r} was not saved by training the program "
                f"{args.program!r} (their manifests differ): leave the program out to continue "
                "the checkpoint's own.")
    return trainer, _training_data(args.data, args, trainer.program)


def _callbacks(args: argparse.Namespace) -> list:
    """The loggers the options ask for (``--log-csv``)."""
    if args.log_csv is None:
        return []
    from ..runtime.callbacks import CSVLogger

    return [CSVLogger(args.log_csv, per=args.log_per, overwrite=args.force)]


def _checkpoint_options(args: argparse.Namespace, validation: bool) -> dict:
    """fit's checkpoint options from ``--checkpoint-dir``, ``--checkpoint-every`` and
    ``--keep-last``: the best by validation loss kept where there is a validation split."""
    if args.checkpoint_dir is None:
        return {}
    return {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": args.checkpoint_every or 1,
            "keep_last": args.keep_last or 3, "keep_best": validation}


def _train(args: argparse.Namespace) -> int:
    trainer, data = _trainer_and_data(args)
    if args.ema:  # a program that keeps no average: the error before any training
        trainer.program.model_state(ema=True)
    if args.merge:  # adapters that cannot be merged (a quantized base): the same
        trainer.program.check_merge()
    validation = None
    if args.validation_split is not None:
        data, validation = _split(data, args.validation_split)
    before = len(trainer.train_losses_), len(trainer.validation_losses_)  # a checkpoint's
    steps = trainer.steps_
    stopping = None if args.early_stopping_patience is None else EarlyStopping(
        args.early_stopping_monitor, args.early_stopping_patience, args.early_stopping_min_delta)
    trainer.fit(**data, epochs=args.epochs, batch_size=args.batch_size,
                accumulation_steps=args.accumulation_steps, shuffle=not args.no_shuffle,
                random_state=args.random_state,
                validation_data=validation, progress=args.progress,
                warm_start=args.resume is not None, max_steps=args.max_steps,
                callbacks=_callbacks(args), **_checkpoint_options(args, validation is not None),
                metrics=args.metrics, early_stopping=stopping)
    metrics = {k: v for k, v in trainer.history_.items() if k not in ("loss", "validation_loss")}
    train_losses, validation_losses = trainer.train_losses_, trainer.validation_losses_
    epochs = len(train_losses) - before[0]  # fewer than --epochs after early stopping
    print(f"trained {epochs}{' more' if args.resume else ''} epoch"
          f"{'s' * (epochs != 1)}"
          + (f" ({trainer.steps_ - steps} steps)" if args.max_steps is not None else "")
          + f" on {_rows(data['y'])} rows"
          + (f" ({_rows(validation[1])} held out for validation)" if validation else "")
          + (f", {trainer.epochs_} in all with those of {args.resume}" if args.resume else ""))
    span = f" {before[0] + 1}-{len(train_losses)}" if args.resume else ""
    print(f"losses by epoch{span}: "
          f"{', '.join(f'{v:.6g}' for v in train_losses[before[0]:])}")
    if len(validation_losses) > before[1]:
        print(f"validation losses by epoch{span}: "
              f"{', '.join(f'{v:.6g}' for v in validation_losses[before[1]:])}")
    if metrics:
        print("metrics after the last epoch: "
              + ", ".join(f"{k} {v[-1]:.6g}" for k, v in metrics.items()))
    record = trainer.early_stopping_
    if record is not None and record.stopped_epoch is not None:
        kept = (" and keeps the best epoch's weights" if stopping.restore_best else "")
        print(f"early stopping: no improvement of {record.monitor} for {stopping.patience} "
              f"epochs, stopped after epoch {record.stopped_epoch + 1}; the best was epoch "
              f"{record.best_epoch + 1} ({record.monitor} {record.best:.6g}){kept}")
    # everything but the model is rendered before the first write
    history = None
    if args.history:
        history = json.dumps({
            "format": HISTORY_FORMAT, "epochs": trainer.epochs_, "steps": trainer.steps_,
            "train_loss": list(train_losses), "validation_loss": list(validation_losses),
            "metrics": metrics,
            "early_stopping": None if record is None else record.to_record(),
            "batch_size": trainer.batch_size(args.batch_size), "data": args.data,
            "validation_split": args.validation_split,
            "program": args.program, "resumed_from": args.resume,
            **({"grad_norm": list(trainer.grad_norms_)} if trainer.engine.clips else {})},
            indent=2) + "\n"
    plot = loss_curve_png(train_losses, validation_losses,
                          f"lossgraph: {Path(args.data).name}", metrics) if args.plot else None
    _export_function("save_inference_model")(trainer, args.output, overwrite=args.force,
                                             ema=args.ema, merge=args.merge)
    written = [f"{args.output}{_external_note(args.output)}"]
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)
        written.append(args.checkpoint)
    latest = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if latest is not None:
        written.append(str(latest))
    if args.log_csv:
        written.append(args.log_csv)
    if history is not None:
        write_file(args.history, history.encode(), _is_history, overwrite=args.force)
        written.append(args.history)
    if plot is not None:
        write_file(args.plot, plot, _is_plot, overwrite=args.force)
        written.append(args.plot)
    print(f"wrote {', '.join(written)}")
    return EXIT_OK


