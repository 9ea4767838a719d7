"""The files a command reads and the options it can check alone, checked before any work
and before numpy, onnx or onnxruntime are imported: a missing path or a bad count is said
at once (the functions that take them check them again, with the same messages)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import (
    InvalidDataError,
    InvalidModelError,
    InvalidProgramError,
    UnsupportedOptionError,
)
from ..options import count
from ..paths import PROGRAM, data_source, model_file, resumed_checkpoint, saved_folder
from .parser import TABLE_SUFFIXES

__all__ = ["check_inputs"]


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse, before any import of the heavy packages, input paths that hold nothing of
    what the command reads (the readers check what the files hold), and the training
    counts."""
    if args.command == "inspect" and Path(args.model).is_dir():
        raise InvalidModelError(
            f"{args.model!r} is a folder; lossgraph inspect reads an ONNX model file (a "
            "program folder keeps its inference model as inference.onnx).")
    if getattr(args, "model", None) is not None:
        model_file(args.model)
    if args.command == "train":
        if args.resume is None and args.program is None:
            raise UnsupportedOptionError(
                "Name the program folder to train (lossgraph train PROGRAM --data ...), or a "
                "checkpoint to continue with --resume CHECKPOINT.")
        if args.epochs is not None:  # Trainer.fit's checks
            count("epochs", args.epochs, 0)
        if args.max_steps is not None:
            count("max_steps", args.max_steps, 0)
        if args.checkpoint_dir is None:
            given = [option for option, value in (("--checkpoint-every", args.checkpoint_every),
                                                  ("--keep-last", args.keep_last))
                     if value is not None]
            if given:
                raise UnsupportedOptionError(
                    f"{' and '.join(given)} without --checkpoint-dir: they rotate the "
                    "checkpoints saved into --checkpoint-dir. Name that folder, or leave them "
                    "out.")
        if args.checkpoint_every is not None:
            count("checkpoint_every", args.checkpoint_every, 1)
        if args.keep_last is not None:
            count("keep_last", args.keep_last, 1)
        if args.early_stopping_patience is not None:
            count("--early-stopping-patience", args.early_stopping_patience, 1)
            if args.early_stopping_monitor.startswith(("validation_", "val_")) and \
                    args.validation_split is None:
                raise UnsupportedOptionError(
                    f"--early-stopping-monitor {args.early_stopping_monitor} watches validation "
                    "rows: pass --validation-split F, or monitor loss.")
        if args.batch_size is not None:  # None: the Trainer's default, or a kept batch
            count("batch_size", args.batch_size, 1)
        if args.accumulation_steps is not None:  # None: the program's
            count("accumulation_steps", args.accumulation_steps, 1)
        if args.program is not None:
            saved_folder(args.program, PROGRAM)
        if args.resume is not None:
            resumed_checkpoint(args.resume)
        _data_file(args.data, "--data")
    if args.command == "compile" and args.class_weight_labels:
        if len(args.class_weight_labels) > 2:
            raise UnsupportedOptionError(
                f"--class-weight-labels takes a data file and optionally the label's name, not "
                f"{len(args.class_weight_labels)} values.")
        _data_file(args.class_weight_labels[0], "--class-weight-labels")
    if args.command == "export" and not Path(args.source).exists():
        raise InvalidProgramError(
            f"There is nothing at {args.source!r}: lossgraph export takes a checkpoint folder "
            "(lossgraph train --checkpoint), a program folder (lossgraph compile) or an .onnx "
            "model.")


def _data_file(path: str, flag: str) -> None:
    """A data file or folder that ``flag`` names: an .npz file, a folder of .npy files, a
    .csv or a .parquet file."""
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        raise InvalidDataError(
            f"{path!r} is one .npy array; {flag} takes an .npz file, a folder of .npy files "
            "(X.npy, y.npy, ...), a .csv or a .parquet file.")
    data_source(path, table=suffix in TABLE_SUFFIXES)
