"""The paths users name, checked before anything is read, with the standard library alone.

The command line checks every path it is given here before it imports numpy, onnx or
onnxruntime (a missing file is said at once); the readers make the same checks, with the
same messages, when they are called from Python:

- :func:`model_file`: an ONNX model file (:func:`lossgraph.models.as_model`);
- :func:`data_source`: a data file, or a folder of ``.npy`` files
  (:func:`lossgraph.storage.read_arrays`, ``lossgraph train --data``);
- :func:`saved_folder`: a program or checkpoint folder lossgraph wrote
  (:mod:`lossgraph.storage`); :func:`latest_checkpoint`, the latest of those a fit saved
  into its ``checkpoint_dir``.

It also holds the layout of those folders, which :mod:`lossgraph.storage` reads and writes
and :mod:`lossgraph.fileio` protects: their file names and how each kind is recognised
(:data:`PROGRAM_FOLDER`, :data:`CHECKPOINT_FOLDER`).
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import InvalidDataError, InvalidModelError, InvalidProgramError
from .fileio import FolderKind

__all__ = ["model_file", "data_source", "saved_folder", "is_plain", "is_checkpoint_record",
           "checkpoint_record", "is_csv_log", "LOG_COLUMNS", "saved_checkpoints",
           "latest_checkpoint", "resumed_checkpoint",
           "PROGRAM_FOLDER", "CHECKPOINT_FOLDER", "PROGRAM", "CHECKPOINT", "MANIFEST_FILE",
           "STATE_FILE", "INFERENCE_FILE", "TRAINER_FILE", "BEST_STATE_FILE", "PROGRAM_SUBFOLDER",
           "CHECKPOINT_FORMAT"]

MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.npz"
INFERENCE_FILE = "inference.onnx"
TRAINER_FILE = "trainer.json"
#: A checkpoint's state of the best epoch so far (early stopping), when it keeps one.
BEST_STATE_FILE = "best_state.npz"
PROGRAM_SUBFOLDER = "program"
CHECKPOINT_FORMAT = "lossgraph-checkpoint/1"

#: ``(what, written by, the file that marks it)`` of each folder lossgraph reads back, for
#: :func:`saved_folder`.
PROGRAM = ("lossgraph program folder", "TrainingProgram.save or lossgraph compile -o",
           MANIFEST_FILE)
CHECKPOINT = ("lossgraph checkpoint folder", "Trainer.save_checkpoint", TRAINER_FILE)


# -- what a path names ---------------------------------------------------------------------------


def model_file(path: str | os.PathLike) -> Path:
    """``path``, once it is a file (the model's bytes are read later); else an
    InvalidModelError saying what is there instead."""
    path = Path(path)
    if os.path.isdir(path):
        raise InvalidModelError(
            f"{str(path)!r} is a folder, not an ONNX file. A saved TrainingProgram loads with "
            "lossgraph.TrainingProgram.load(folder); a model is a .onnx file.")
    if not os.path.isfile(path):
        hint = (" It looks like ONNX text: parse it with onnx.parser.parse_model(text) first."
                if str(path).lstrip().startswith("<") else "")
        raise InvalidModelError(f"No ONNX file at {str(path)!r} (current directory: "
                                f"{os.getcwd()!r}).{hint}")
    return path


def data_source(path: str | os.PathLike, table: bool = False) -> Path:
    """``path``, once something is there: a file or a folder of ``.npy`` files, or only a
    regular file where ``table`` (a .csv or .parquet file); else an InvalidDataError."""
    source = Path(path)
    if table and not source.is_file():
        raise InvalidDataError(f"There is no data file at {str(path)!r}." if not source.exists()
                               else f"{str(path)!r} is not a regular file.")
    if not source.exists():
        raise InvalidDataError(f"There is no data file or folder at {str(source)!r}.")
    return source


def saved_folder(path: str | os.PathLike, kind: tuple[str, str, str]) -> Path:
    """``path``, once it is a folder holding the file that marks ``kind`` (:data:`PROGRAM`,
    :data:`CHECKPOINT`); else an InvalidProgramError (a model file gets a hint). What the
    files hold is read and checked by :mod:`lossgraph.storage`."""
    what, writer, marker = kind
    folder = Path(path)
    if not folder.exists():
        raise InvalidProgramError(f"There is no {what} at {str(folder)!r}.")
    if not folder.is_dir():
        hint = (" To train a model file, compile it first (lossgraph.compile_program, or lossgraph "
                "compile MODEL -o FOLDER)." if folder.suffix == ".onnx" else "")
        raise InvalidProgramError(
            f"{str(folder)!r} is a file; a {what} is a folder written by {writer}.{hint}")
    if not (folder / marker).exists():
        raise InvalidProgramError(f"{str(folder)!r} holds no {marker}: it is not a {what}.")
    return folder


def is_plain(name: Any) -> bool:
    """A file name that stays inside its folder: no separators, no ``..``, not hidden."""
    return (isinstance(name, str) and bool(name) and not name.startswith(".")
            and os.sep not in name and "/" not in name and (os.altsep or "/") not in name)


# -- recognising lossgraph's folders ----------------------------------------------------------


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _program_entries(folder: Path) -> set[str] | None:
    manifest = _json_object(folder / MANIFEST_FILE)
    if manifest is None or not str(manifest.get("format", "")).startswith("lossgraph-program/"):
        return None
    graphs = manifest.get("graphs")
    files = [entry.get("file") for entry in graphs.values() if isinstance(entry, dict)] \
        if isinstance(graphs, dict) else []
    owned = {MANIFEST_FILE, STATE_FILE, INFERENCE_FILE, *(f for f in files if is_plain(f))}
    return {name for name in owned if not (folder / name).is_symlink()}


def checkpoint_record(folder: Path) -> dict[str, Any] | None:
    """The record (``trainer.json``) of a checkpoint folder lossgraph wrote, read alone and
    unchecked (the program is not read); None when ``folder`` holds none."""
    record = _json_object(folder / TRAINER_FILE)
    return record if record is not None and is_checkpoint_record(record) else None


def _checkpoint_entries(folder: Path) -> set[str] | None:
    record = checkpoint_record(folder)
    if record is None:
        return None
    program = folder / PROGRAM_SUBFOLDER
    entries = _program_entries(program) if program.is_dir() and not program.is_symlink() else None
    own = {TRAINER_FILE} | ({BEST_STATE_FILE} if "best_state" in record
                            and not (folder / BEST_STATE_FILE).is_symlink() else set())
    if entries is not None and set(os.listdir(program)) <= entries:
        return own | {PROGRAM_SUBFOLDER}
    return own


def is_checkpoint_record(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` (a checkpoint's trainer.json) is one lossgraph wrote."""
    if "format" in record:
        return str(record["format"]).startswith("lossgraph-checkpoint/")
    return {"steps", "epochs", "rng"} <= set(record)  # written before checkpoints had a format


#: The first columns of a CSV log's header (``lossgraph.CSVLogger``), by what a row is:
#: what marks a log as lossgraph's, which it may replace.
LOG_COLUMNS = {"epoch": ("epoch", "steps"), "step": ("step",)}


def is_csv_log(path: Path) -> bool:
    """Whether ``path`` holds a CSV log lossgraph wrote (its header row starts as one)."""
    try:
        with open(path, newline="") as stream:
            header = next(csv.reader(stream), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    return any(tuple(header[:len(first)]) == first for first in LOG_COLUMNS.values())


PROGRAM_FOLDER = FolderKind("a lossgraph program folder", _program_entries)
CHECKPOINT_FOLDER = FolderKind("a lossgraph checkpoint folder", _checkpoint_entries)


#: The name of a checkpoint ``fit(..., checkpoint_dir=...)`` saves: its step count.
_NAME = re.compile(r"checkpoint-(\d+)")


def saved_checkpoints(folder: str | os.PathLike) -> list[tuple[int, Path]]:
    """lossgraph's checkpoints in ``folder`` (``checkpoint-<steps>`` folders it recognises,
    holding nothing else), as ``(steps, path)`` by step."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _NAME.fullmatch(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        owned = CHECKPOINT_FOLDER.entries(entry)
        if owned is not None and set(os.listdir(entry)) <= owned:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint of the most steps among lossgraph's in ``folder`` (``fit(...,
    checkpoint_dir=folder)`` wrote them), for :meth:`Trainer.load_checkpoint`; None when
    there is none."""
    saved = saved_checkpoints(folder)
    return saved[-1][1] if saved else None


def resumed_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint to resume: ``path`` itself, or the latest lossgraph saved into the
    ``checkpoint_dir`` ``path`` names; else an InvalidProgramError (:func:`saved_folder`)."""
    folder = Path(path)
    if folder.is_dir() and not (folder / TRAINER_FILE).exists():
        latest = latest_checkpoint(folder)
        if latest is not None:
            return latest
    return saved_folder(folder, CHECKPOINT)
