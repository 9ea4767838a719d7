"""The files a command writes, checked before any work."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..errors import RuntimeUnavailableError, UnsafeWriteError, UnsupportedOptionError
from ..fileio import check_file_target, check_folder_target
from ..paths import CHECKPOINT_FOLDER, PROGRAM_FOLDER, is_csv_log
from .parser import PNG_SIGNATURE

EXIT_OK = 0

# -- outputs, checked before any work ------------------------------------------------------


def _is_history(path: Path) -> bool:
    """Whether ``path`` holds a loss history lossgraph wrote (JSON with its format mark)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and str(record.get("format", "")).startswith(
        "lossgraph-history/")


def _is_plot(path: Path) -> bool:
    """Whether ``path`` is a PNG lossgraph drew (a ``Software: lossgraph`` text chunk)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not data.startswith(PNG_SIGNATURE):
        return False
    position = len(PNG_SIGNATURE)
    while position + 8 <= len(data):
        length = int.from_bytes(data[position:position + 4], "big")
        kind = data[position + 4:position + 8]
        if kind == b"tEXt":
            key, _, value = data[position + 8:position + 8 + length].partition(b"\0")
            if key == b"Software" and value.startswith(b"lossgraph"):
                return True
        if kind == b"IEND":
            break
        position += 12 + length
    return False


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, outputs that would replace what lossgraph did not write, or
    that need a package that is missing."""
    if args.command == "compile":
        if args.format == "program":
            check_folder_target(args.output, PROGRAM_FOLDER)
        else:
            _check_artifacts_target(args.output)
        return
    if args.command == "export":
        _check_export_outputs(args)
    if getattr(args, "output", None) is None:
        return
    _check_model_suffix(args.output)
    check_file_target(args.output, overwrite=args.force)
    if args.command != "train":
        return
    named = {"--data": args.data, "-o": args.output, "--checkpoint": args.checkpoint,
             "--checkpoint-dir": args.checkpoint_dir, "--log-csv": args.log_csv,
             "--history": args.history, "--plot": args.plot}
    seen: dict[str, str] = {}
    for option, path in named.items():
        if path is None:
            continue
        key = os.path.normpath(os.path.abspath(path))
        if key in seen:
            raise UnsupportedOptionError(
                f"{seen[key]} and {option} name the same path {path!r}: give each output a "
                "path of its own.")
        seen[key] = option
    if args.checkpoint:
        check_folder_target(args.checkpoint, CHECKPOINT_FOLDER)
    if args.checkpoint_dir and (os.path.lexists(args.checkpoint_dir)
                                and not os.path.isdir(args.checkpoint_dir)):
        raise UnsafeWriteError(
            f"--checkpoint-dir {args.checkpoint_dir!r} is not a folder; lossgraph saves its "
            "checkpoints into a folder there. Choose another path.")
    if args.log_csv:
        check_file_target(args.log_csv, is_csv_log, overwrite=args.force)
    if args.history:
        check_file_target(args.history, _is_history, overwrite=args.force)
    if args.plot:
        check_file_target(args.plot, _is_plot, overwrite=args.force)
        _figure_class()


#: File name endings onnx.load reads as a text format, not as the binary model lossgraph
#: writes (onnx.serialization's registry; these are onnx 1.23's).
_TEXT_SUFFIXES = (".json", ".onnxjson", ".prototxt", ".txtpb", ".pbtxt", ".textproto",
                  ".onnxtext", ".onnxtxt")


def _check_model_suffix(path: str) -> None:
    """A model file's name that onnx.load reads as what lossgraph writes (binary protobuf):
    ``onnx.load("model.json")`` parses JSON text, and fails on a binary model."""
    suffix = Path(path).suffix.lower()
    if suffix in _TEXT_SUFFIXES:
        raise UnsupportedOptionError(
            f"-o {path!r}: lossgraph writes the model in ONNX's binary format, but onnx.load "
            f"reads a {suffix!r} file as a text format, so the file could not be loaded back "
            "by its name. Name it .onnx (or .pb).")


def _check_export_outputs(args: argparse.Namespace) -> None:
    """lossgraph export writes the inference model (-o), the adapters (--adapters) or both."""
    if args.output is None and args.adapters is None:
        raise UnsupportedOptionError(
            "lossgraph export writes the inference model (-o FILE), the LoRA adapters "
            "(--adapters FILE) or both: give at least one.")
    if args.adapters is None:
        if args.peft_config:
            raise UnsupportedOptionError("--peft-config goes with --adapters "
                                         ".../adapter_model.safetensors.")
        return
    if args.output is not None and os.path.abspath(args.output) == os.path.abspath(
            args.adapters):
        raise UnsupportedOptionError(
            f"-o and --adapters name the same path {args.output!r}: give each its own.")
    from ..export.adapters import check_adapters_target

    check_adapters_target(args.adapters, peft_config=args.peft_config, overwrite=args.force)


def _check_artifacts_target(path: str) -> None:
    """The artifacts writer's own check of its folder (to_ort_artifacts checks it again)."""
    try:
        from ..export.artifacts import ARTIFACTS_FOLDER
    except ImportError:
        return  # said when the command runs (_export_function)
    check_folder_target(path, ARTIFACTS_FOLDER)

def _figure_class() -> type:
    """matplotlib's Figure (no pyplot, no GUI), or a clear error when it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeUnavailableError(
            "--plot needs matplotlib: pip install matplotlib (or pip install "
            "'lossgraph[plot]'), or leave --plot out.") from None
    return Figure

def _external_note(path: str) -> str:
    """`` and <file>`` when the model at ``path`` keeps tensors in an external file."""
    import onnx

    model = onnx.load_model_from_string(Path(path).read_bytes())  # binary, whatever its name
    files = sorted({entry.value for tensor in model.graph.initializer
                    for entry in tensor.external_data if entry.key == "location"})
    return "".join(f" and {os.path.join(os.path.dirname(path), name)}" for name in files)
