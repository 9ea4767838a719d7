"""The ``lossgraph`` command: from an ONNX model to a trained ONNX model, in the shell.

    lossgraph inspect model.onnx                       # what it holds, what can be trained
    lossgraph compile model.onnx -o program/ --optimizer adam --learning-rate 0.01
    lossgraph train program/ --data train.csv --epochs 20 --validation-split 0.2 \
        -o trained.onnx --checkpoint ckpt/ --history history.json --plot loss.png
    lossgraph export ckpt/ -o deployed.onnx            # the inference model of a checkpoint

and the passes one by one: ``add-loss``, ``gradient``, ``lower-ml``, ``alphabetize``,
``trainable``, ``ops``. ``lossgraph COMMAND --help`` shows each command's options and
an example.

Every command that writes writes atomically (:mod:`lossgraph.fileio`), never over a file
or folder lossgraph did not write (``--force`` replaces a file anyway), and checks all
its outputs before any work. Exit status: 0 when the command did its work; 2 for a user
error (a bad command line, file, option or data set), with one line on stderr; 1 for
an internal error (a bug: please report it), with one line on stderr naming the
exception (``LOSSGRAPH_DEBUG=1`` adds the traceback); 130 when interrupted, 141 when
stdout closes early (``| head``). The previous release's spellings of
options (``--score``, ``--weight``, ``--wrt``, gradient's ``--loss``, ``--gradient``)
still work, with a warning on stderr.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import onnx

from . import __version__
from .analysis import differentiable_values, influenced_values, trainable_initializers
from .autodiff import supported_ops
from .autodiff.registry import find_rule
from .compiler import compile_program
from .differentiability import differentiable_inputs
from .errors import (
    InvalidDataError,
    InvalidModelError,
    InvalidProgramError,
    LossgraphError,
    RuntimeUnavailableError,
    UnsupportedOptionError,
    suggest,
)
from .fileio import check_file_target, check_folder_target, save_model, write_file
from .graphs import (
    ForwardFacts,
    all_graphs,
    elem_type_name,
    opset_version,
    outer_references,
    shortest_path,
    subgraphs,
)
from .models import as_model
from .optim import SGD, Adam, AdamW, Momentum, Optimizer, optimizer_from_dict
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import LOWERED_OPS, lower_ml_ops
from .passes.rename import alphabetize_initializers
from .program import TrainingProgram
from .roles import get_roles
from .runtime import Trainer
from .storage import CHECKPOINT_FOLDER, PROGRAM_FOLDER, read_arrays
from .target import use_target

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it
EXIT_BROKEN_PIPE = 141  # stdout closed early, as shells report SIGPIPE
#: Set (to anything but "" or "0") to print the traceback of an internal error.
DEBUG_VARIABLE = "LOSSGRAPH_DEBUG"

ML_DOMAIN = "ai.onnx.ml"
HISTORY_FORMAT = "lossgraph-history/1"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TABLE_SUFFIXES = (".csv", ".parquet", ".pq")

EXAMPLES = {
    "inspect": """\
example:
  lossgraph inspect model.onnx          # a table: inputs, outputs, initializers, ops
  lossgraph inspect model.onnx --json   # the same, as JSON""",
    "compile": """\
examples:
  lossgraph compile model.onnx -o program/
  lossgraph compile model.onnx -o program/ --optimizer nesterov --learning-rate 0.01 \\
      --momentum 0.9 --penalty-l2 1e-4 --fuse epoch
  lossgraph compile model.onnx -o program/ --trainable coef intercept --loss huber \\
      --loss-option delta=0.5 --weight-name sample_weight
  lossgraph compile model.onnx -o program/ \\
      --optimizer '{"type": "AdamW", "learning_rate": 0.001, "weight_decay": 0.05}'
  lossgraph compile model.onnx -o artifacts/ --format ort-artifacts --optimizer adamw""",
    "train": """\
examples:
  lossgraph train program/ --data train.npz --epochs 10 -o trained.onnx
  lossgraph train program/ --data train.csv --label price --epochs 20 --batch-size 64 \\
      --validation-split 0.2 --random-state 0 -o trained.onnx --checkpoint ckpt/ \\
      --history history.json --plot loss.png
  lossgraph train --resume ckpt/ --data train.csv --epochs 5 -o trained.onnx \\
      --checkpoint ckpt/      # 5 more epochs from the checkpoint

data: an .npz file or a folder of .npy files (arrays X, y and optionally sample_weight,
or those --features, --label, --sample-weight name), or a .csv (a header row, then
numbers) or .parquet file (columns --features, --label, --sample-weight: by default the
label is the column y or label, the sample weight the column sample_weight when there
is one and the program takes sample weights (compile --weight-name), the features every
other column). --validation-split F holds out the last F of the rows, in the file's
order.""",
    "export": """\
examples:
  lossgraph export ckpt/ -o deployed.onnx       # a checkpoint folder (lossgraph train)
  lossgraph export program/ -o initial.onnx     # a program folder (lossgraph compile)""",
    "add-loss": """\
example:
  lossgraph add-loss model.onnx -o loss.onnx --loss huber --option delta=0.5 \\
      --weight-name sample_weight --penalty '{"coef": {"l1": 0.01, "l2": 0.1}}'""",
    "gradient": """\
examples:
  lossgraph gradient loss.onnx -o grad.onnx --weights coef intercept
  lossgraph gradient model.onnx -o vjp.onnx --outputs y    # vector-Jacobian mode""",
    "lower-ml": """\
example:
  lossgraph lower-ml model.onnx -o lowered.onnx""",
    "alphabetize": """\
example:
  lossgraph alphabetize model.onnx -o renamed.onnx    # prints the old -> new names""",
    "trainable": """\
example:
  lossgraph trainable model.onnx      # one name per line""",
    "ops": """\
example:
  lossgraph ops                       # op, opsets and notes of every gradient rule""",
}

EPILOG = """\
from model.onnx to a trained model:
  lossgraph inspect model.onnx
  lossgraph compile model.onnx -o program/ --optimizer adam --learning-rate 0.01
  lossgraph train program/ --data train.csv --epochs 20 --validation-split 0.2 \\
      -o trained.onnx --checkpoint ckpt/ --history history.json --plot loss.png
  lossgraph export ckpt/ -o deployed.onnx

exit status: 0 done; 2 a user error (one line on stderr); 1 an internal error (a bug:
please report it; LOSSGRAPH_DEBUG=1 prints the traceback)."""


# -- argument parsing ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other lossgraph error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _json(example: str) -> Callable[[str], Any]:
    """An argument type: JSON text, with ``example`` in the message when it is not."""

    def parse(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not JSON; write it like {example}") from None

    parse.__name__ = "JSON"
    return parse


class _Renamed(argparse.Action):
    """An option's previous spelling: stores into the new one's ``dest``, with a warning."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the "
              f"next release: use {self.new}.", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _key_value(text: str) -> tuple[str, object]:
    """An argument type: ``KEY=VALUE``, the value read as a bool, a number or a string."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. delta=1.5)")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    try:
        return key, float(value)
    except ValueError:
        return key, value


#: ``--optimizer NAME``: the optimizers the flag form builds (the JSON form takes any).
OPTIMIZER_NAMES = ("sgd", "momentum", "nesterov", "adam", "adamw")
_OPTIMIZER_EXAMPLE = '\'{"type": "Adam", "learning_rate": 0.001}\''


def _optimizer_spec(text: str) -> str | Any:
    """An argument type: an optimizer name (any case), or the JSON form."""
    if text.lower() in OPTIMIZER_NAMES:
        return text.lower()
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    if isinstance(value, str):  # a name, maybe quoted
        if value.lower() in OPTIMIZER_NAMES:
            return value.lower()
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an optimizer name ({', '.join(OPTIMIZER_NAMES)}) nor JSON "
            f"like {_OPTIMIZER_EXAMPLE}")
    return value


def _fraction(text: str) -> float:
    """An argument type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1 (e.g. 0.2)")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lossgraph", description="From an ONNX model to a trained ONNX "
                     "model: inspect it, compile it into training\ngraphs, train them on a data "
                     "file, export the result.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lossgraph {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                     metavar="COMMAND")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_,
                                   description=textwrap.fill(help_[0].upper() + help_[1:] + ".",
                                                             width=88),
                                   epilog=EXAMPLES[name],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    def output_file(cmd: argparse.ArgumentParser, help_: str = "output ONNX file") -> None:
        cmd.add_argument("-o", "--output", required=True, metavar="FILE", help=help_)
        cmd.add_argument("--force", action="store_true",
                         help="replace output files even if lossgraph did not write them")

    penalty = _json('\'{"coef": {"l1": 0.01, "l2": 0.1}}\'')

    inspect = command("inspect", "show a model's inputs, outputs, opsets, initializers (which "
                                 "are trainable), op counts and ops without a gradient rule")
    inspect.add_argument("model", help="ONNX model file")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")

    build = command("compile", "compile a model into a training program folder (or onnxruntime "
                               "training artifacts)")
    build.add_argument("model", help="ONNX model file (an inference model)")
    build.add_argument("-o", "--output", required=True, metavar="FOLDER",
                       help="output folder: new, empty, or one lossgraph wrote")
    build.add_argument("--format", default="program", choices=["program", "ort-artifacts"],
                       help="a lossgraph program folder (for lossgraph train), or onnxruntime's "
                            "on-device training artifacts (default: program)")
    build.add_argument("--trainable", "--weights", dest="weights", nargs="+", metavar="NAME",
                       help="the initializers to train (default: every trainable candidate, "
                            "as lossgraph inspect lists them)")
    build.add_argument("--loss", default="squared_error",
                       help="the loss function (default: squared_error), or 'none' when the "
                            "model carries its loss")
    build.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                       type=_key_value,
                       help="an option of the loss, e.g. delta=1.5, or of add-loss, e.g. "
                            "reduction=sum (repeat for several)")
    build.add_argument("--weight-name", metavar="NAME",
                       help="add a per-row sample-weight input of this name (lossgraph train "
                            "--sample-weight feeds it)")
    build.add_argument("--optimizer", type=_optimizer_spec, default="sgd",
                       metavar="NAME|JSON",
                       help=f"{'|'.join(OPTIMIZER_NAMES)} (default: sgd), or the JSON form, "
                            f"e.g. {_OPTIMIZER_EXAMPLE}")
    build.add_argument("--learning-rate", type=float, metavar="LR",
                       help="the learning rate (default: the optimizer's: 0.01 for sgd, "
                            "momentum and nesterov, 0.001 for adam and adamw)")
    build.add_argument("--momentum", type=float, metavar="M",
                       help="the momentum of --optimizer momentum or nesterov (default: 0.9)")
    build.add_argument("--penalty-l1", type=float, metavar="A",
                       help="add A * sum|w| to the loss for every trained weight w")
    build.add_argument("--penalty-l2", type=float, metavar="B",
                       help="add B * sum w^2 to the loss for every trained weight w")
    build.add_argument("--penalty", type=penalty, default=None, metavar="JSON",
                       help='per-weight penalties, e.g. \'{"coef": {"l1": 0.01, "l2": 0.1}}\' '
                            "(not with --penalty-l1/--penalty-l2)")
    build.add_argument("--backend", default=None, choices=["onnx", "ort"],
                       help="the gradient backend (default: onnx; ort needs the onnxruntime "
                            "training build)")
    build.add_argument("--gradient", dest="backend", action=_Renamed, new="--backend")
    build.add_argument("--fuse", default=None, choices=["separate", "step", "epoch"],
                       help="how the training graphs are fused (default: step)")
    build.add_argument("--target", default=None,
                       help="the runtimes the graphs must load in: a target name (default, "
                            "onnxruntime-1.23, onnxruntime-latest, ...) or ir<IR>-opset<N>; "
                            "see docs/reference/targets.md")

    train = command("train", "train a compiled program on a data file; write the trained model, "
                             "and optionally a checkpoint, the loss history and its plot")
    train.add_argument("program", nargs="?",
                       help="program folder (lossgraph compile -o); optional with --resume")
    train.add_argument("--data", required=True, metavar="PATH",
                       help=".npz, folder of .npy files, .csv or .parquet (see below)")
    train.add_argument("--features", nargs="+", metavar="NAME",
                       help="the feature columns (.csv, .parquet) or arrays (.npz, .npy)")
    train.add_argument("--label", nargs="+", metavar="NAME",
                       help="the label column(s) or array (default: y, else label)")
    train.add_argument("--sample-weight", metavar="NAME",
                       help="the sample-weight column or array (default: sample_weight if "
                            "present and the program takes sample weights)")
    train.add_argument("--validation-split", type=_fraction, metavar="F",
                       help="hold out the last fraction F of the rows as validation data")
    train.add_argument("--epochs", type=int, default=1, help="epochs to train (default: 1)")
    train.add_argument("--batch-size", type=int, default=32, help="rows a step (default: 32)")
    train.add_argument("--no-shuffle", action="store_true",
                       help="visit the rows in order (default: shuffled every epoch)")
    train.add_argument("--random-state", type=int, default=None, metavar="SEED",
                       help="seed of the shuffling (ignored with --resume: the checkpoint's "
                            "generator goes on)")
    train.add_argument("--resume", metavar="CHECKPOINT",
                       help="continue this checkpoint folder (lossgraph train --checkpoint) "
                            "for --epochs more epochs")
    output_file(train, "the trained inference model (.onnx)")
    train.add_argument("--checkpoint", metavar="FOLDER",
                       help="also save a checkpoint folder here, to --resume or export")
    train.add_argument("--history", metavar="FILE",
                       help="also write the losses of every epoch here, as JSON")
    train.add_argument("--plot", metavar="FILE",
                       help="also draw the loss curve into this PNG (needs matplotlib)")
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar (default: when stderr is a terminal)")

    export = command("export", "write the inference model of a checkpoint or program folder, "
                               "with its weights and nothing of training left")
    export.add_argument("source", help="checkpoint folder (lossgraph train --checkpoint), "
                                       "program folder (lossgraph compile) or .onnx model")
    output_file(export, "the inference model (.onnx)")
    export.add_argument("--external-data", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the large weights in FILE.data beside the model (default: "
                             "only for models over protobuf's 2 GiB)")
    export.add_argument("--target", default=None,
                        help="the runtimes the model must load in: a target name (default: "
                             "default) or ir<IR>-opset<N>; see docs/reference/targets.md")

    add_loss = command("add-loss", "append a scalar loss output")
    add_loss.add_argument("model", help="input ONNX file")
    output_file(add_loss)
    add_loss.add_argument("--loss", default="squared_error", help="the loss function")
    add_loss.add_argument("--score", dest="loss", action=_Renamed, new="--loss")
    add_loss.add_argument("--loss-name")
    add_loss.add_argument("--label-name")
    add_loss.add_argument("--weight-name", help="name of a per-row sample-weight input")
    add_loss.add_argument("--weight", dest="weight_name", action=_Renamed, new="--weight-name")
    add_loss.add_argument("--output-index", help="output name or position")
    add_loss.add_argument("--reduction", default="mean", choices=["mean", "sum"])
    add_loss.add_argument("--penalty", type=penalty, default=None,
                          help='JSON, e.g. \'{"coef": {"l1": 0.01, "l2": 0.1}}\'')
    add_loss.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                          type=_key_value,
                          help="option of the loss, e.g. delta=1.5 or from_logits=true")

    grad = command("gradient", "add <weight>_grad outputs")
    grad.add_argument("model", help="input ONNX file")
    output_file(grad)
    grad.add_argument("--weights", nargs="+", help="what to differentiate with respect to")
    grad.add_argument("--wrt", dest="weights", nargs="+", action=_Renamed, new="--weights")
    grad.add_argument("--loss-name", help="the scalar output to differentiate")
    grad.add_argument("--loss", dest="loss_name", action=_Renamed, new="--loss-name")
    grad.add_argument("--outputs", nargs="+", help="vector-Jacobian mode")
    grad.add_argument("--backend", default="onnx", choices=["onnx", "ort"])

    for name, help_ in (("lower-ml", "rewrite ai.onnx.ml linear models into standard ops"),
                        ("alphabetize", "rename trainable initializers into graph order")):
        simple = command(name, help_)
        simple.add_argument("model", help="input ONNX file")
        output_file(simple)
    command("trainable", "list the trainable initializers").add_argument("model")
    command("ops", "list the ops lossgraph can differentiate")
    return parser


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
    if getattr(args, "output", None) is None:
        return
    check_file_target(args.output, overwrite=args.force)
    if args.command != "train":
        return
    named = {"--data": args.data, "-o": args.output, "--checkpoint": args.checkpoint,
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
    if args.history:
        check_file_target(args.history, _is_history, overwrite=args.force)
    if args.plot:
        check_file_target(args.plot, _is_plot, overwrite=args.force)
        _figure_class()


def _check_artifacts_target(path: str) -> None:
    """The artifacts writer's own check of its folder (to_ort_artifacts checks it again)."""
    try:
        from .export.artifacts import ARTIFACTS_FOLDER
    except ImportError:
        return  # said when the command runs (_export_function)
    check_folder_target(path, ARTIFACTS_FOLDER)


# -- inspect ---------------------------------------------------------------------------------


def _type_text(value_type: onnx.TypeProto) -> tuple[str, list[int | str | None] | None]:
    """``(element type, shape)`` of a value: the shape lists ints, names and None
    (unknown), or is None when even the rank is unknown."""
    kind = value_type.WhichOneof("value")
    if kind != "tensor_type":
        return {"sequence_type": "sequence", "map_type": "map", "optional_type": "optional",
                "sparse_tensor_type": "sparse tensor"}.get(kind or "", "unknown"), None
    tensor = value_type.tensor_type
    dtype = elem_type_name(tensor.elem_type) if tensor.elem_type else "unknown"
    if not tensor.HasField("shape"):
        return dtype, None
    dims: list[int | str | None] = []
    for dim in tensor.shape.dim:
        which = dim.WhichOneof("value")
        dims.append(dim.dim_value if which == "dim_value" else
                    dim.dim_param if which == "dim_param" else None)
    return dtype, dims


def _values(values: Iterable[onnx.ValueInfoProto], skip: set[str]) -> list[dict[str, Any]]:
    described = []
    for value in values:
        if value.name in skip:
            continue
        dtype, shape = _type_text(value.type)
        described.append({"name": value.name, "dtype": dtype, "shape": shape})
    return described


def _label(node: onnx.NodeProto) -> str:
    op = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    return f"{op} {node.name!r}" if node.name else op


def _rule_path(graph: onnx.GraphProto, node: onnx.NodeProto, weights: Sequence[str],
               entering: set[str], leaving: str, targets: set[str]) -> tuple[list[str], int]:
    """``[weight, node, value, ..., node, ..., output]``, the shortest way from a trainable
    weight into ``node`` (through one of ``entering``) and from ``leaving`` to a target,
    and the position of ``node`` in it."""
    back: list[str | onnx.NodeProto] = []
    for weight in weights:
        found = shortest_path(graph, weight, entering)
        if found is not None and (not back or len(found) < len(back)):
            back = found
    onward = shortest_path(graph, leaving, targets) or [leaving]
    steps = [*back, node, *onward]
    return [step if isinstance(step, str) else _label(step) for step in steps], len(back)


def _short_path(path: Sequence[str], at: int, ends: int = 4) -> str:
    """``path`` joined by arrows; a long one keeps both ends and the node at ``at``."""
    keep = {*range(ends), *range(at - 1, at + 2), *range(len(path) - ends, len(path))}
    shown, last = [], -1
    for index in sorted(i for i in keep if 0 <= i < len(path)):
        if index > last + 1:
            shown.append("...")
        shown.append(path[index])
        last = index
    return " -> ".join(shown)


def inspect_model(path: str | os.PathLike) -> dict[str, Any]:
    """What ``lossgraph inspect`` reports about the model at ``path``, as a JSON-ready dict.

    Initializers, trainable candidates and missing gradient rules are those of the model
    as :func:`~lossgraph.compile_program` sees it: with its ``ai.onnx.ml`` linear models
    lowered into standard ops (their coefficients become initializers).
    """
    model = as_model(path)
    graph = model.graph
    try:
        lowered = lower_ml_ops(model)
    except LossgraphError as exc:  # compile fails the same way; the rest still tells
        lowered, lowering = model, _one_line(str(exc))
    else:
        lowering = None
    given = {t.name for t in graph.initializer}
    facts = ForwardFacts.of(lowered)
    roles = get_roles(lowered)
    targets = [roles["loss"]] if roles.get("loss") else [o.name for o in lowered.graph.output]
    candidates = trainable_initializers(lowered)
    needed = differentiable_values(lowered, targets, facts.types)
    relevant = influenced_values(lowered, candidates, facts.types) & needed

    missing = []
    for node in lowered.graph.node:
        opset = opset_version(lowered, node.domain or "") or 1
        if find_rule(node.op_type, node.domain, opset) is not None:
            continue
        leaving = [o for o in node.output if o in needed]
        positions = differentiable_inputs(node.op_type, node.domain, len(node.input),
                                          opset=opset)
        entering = {node.input[p] for p in positions if node.input[p] in relevant}
        entering |= {n for sub in subgraphs(node) for n in outer_references(sub) if n in relevant}
        if leaving and entering:
            path_, at = _rule_path(lowered.graph, node, candidates, entering, leaving[0],
                                   set(targets))
            missing.append({"op_type": node.op_type, "domain": node.domain, "node": node.name,
                            "opset": opset, "path": path_, "at": at})

    counts: dict[tuple[str, str], int] = {}
    for sub in all_graphs(graph):
        for node in sub.node:
            key = ("" if node.domain == "ai.onnx" else node.domain, node.op_type)
            counts[key] = counts.get(key, 0) + 1
    blocking = {(m["domain"], m["op_type"]) for m in missing}
    ops = []
    for (domain, op_type), count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if domain == ML_DOMAIN and op_type in LOWERED_OPS:
            rule = "lowered"
        elif find_rule(op_type, domain, opset_version(model, domain) or 1) is not None:
            rule = "yes"
        else:
            rule = "missing" if (domain, op_type) in blocking else "no"
        ops.append({"domain": domain, "op_type": op_type, "count": count, "gradient_rule": rule})

    initializers = []
    for tensor in lowered.graph.initializer:
        initializers.append({
            "name": tensor.name, "dtype": elem_type_name(tensor.data_type),
            "shape": list(tensor.dims), "size": int(np.prod(tensor.dims, dtype=np.int64)),
            "trainable": tensor.name in candidates,
            "origin": "model" if tensor.name in given else "lowered"})
    return {
        "file": str(path),
        "ir_version": model.ir_version,
        "producer": {"name": model.producer_name, "version": model.producer_version},
        "opsets": {op.domain or "ai.onnx": op.version for op in model.opset_import},
        "inputs": _values(graph.input, given),
        "outputs": _values(graph.output, set()),
        "initializers": initializers,
        "trainable": candidates,
        "lowered_ops": sorted({n.op_type for n in graph.node
                               if n.domain == ML_DOMAIN and n.op_type in LOWERED_OPS}),
        "lowering_error": lowering,
        "roles": roles,
        "ops": ops,
        "missing_gradient_rules": missing,
    }


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "  ") -> str:
    """Rows as aligned text columns under ``header``."""
    cells = [list(header), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in cells)


def _shape_text(shape: list[int | str | None] | None) -> str:
    if shape is None:
        return "unknown"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _op_text(domain: str, op_type: str) -> str:
    return f"{domain}::{op_type}" if domain else op_type


#: ``gradient_rule`` of inspect's op counts, in words.
_RULE_TEXT = {"yes": "yes", "missing": "MISSING (see below)",
              "no": "no (no gradient needs to pass it)",
              "lowered": "lowered into standard ops by compile"}


def format_inspection(report: Mapping[str, Any]) -> str:
    """:func:`inspect_model`'s report as readable tables."""
    producer = " ".join(filter(None, report["producer"].values())) or "unknown producer"
    opsets = ", ".join(f"{domain} {version}" for domain, version in report["opsets"].items())
    parts = [f"{report['file']}: ONNX IR version {report['ir_version']}, {producer}, opsets "
             f"{opsets}"]
    for key in ("inputs", "outputs"):
        parts.append(f"\n{key}\n" + _table(
            ("name", "type", "shape"),
            ((v["name"], v["dtype"], _shape_text(v["shape"])) for v in report[key])))
    initializers = report["initializers"]
    if initializers:
        total = sum(t["size"] for t in initializers)
        trainable = sum(t["size"] for t in initializers if t["trainable"])
        title = (f"\ninitializers ({len(initializers)}: {total} values, {trainable} in "
                 "trainable candidates)")
        header = ["name", "type", "shape", "values", "trainable"]
        rows = [[t["name"], t["dtype"], _shape_text(t["shape"]), t["size"],
                 "yes" if t["trainable"] else "-"] for t in initializers]
        if report["lowered_ops"]:  # say which initializers compile makes of ai.onnx.ml nodes
            header.append("from")
            for row, tensor in zip(rows, initializers):
                row.append("the model" if tensor["origin"] == "model" else
                           f"lowering {'/'.join(report['lowered_ops'])} (see lossgraph lower-ml)")
        parts.append(title + "\n" + _table(header, rows))
    else:
        parts.append("\ninitializers: none")
    if report["lowering_error"]:
        parts.append(f"the ai.onnx.ml ops cannot be lowered into standard ops (compile fails "
                     f"the same way): {report['lowering_error']}")
    if report["roles"].get("loss"):
        parts.append(f"the model carries its loss {report['roles']['loss']!r} (compile it with "
                     "--loss none); trainable means: reaching the loss")
    if report["trainable"]:
        parts.append("trainable candidates (what compile trains unless --trainable says "
                     f"otherwise): {' '.join(report['trainable'])}")
    else:
        parts.append("trainable candidates: none (no float initializer reaches an output "
                     "differentiably)")
    nodes = sum(op["count"] for op in report["ops"])
    parts.append(f"\nops ({nodes} node{'s' * (nodes != 1)})\n" + _table(
        ("op", "count", "gradient rule"),
        ((_op_text(op["domain"], op["op_type"]), op["count"], _RULE_TEXT[op["gradient_rule"]])
         for op in report["ops"])))
    missing = report["missing_gradient_rules"]
    if missing:
        parts.append("\nops without a gradient rule between a trainable weight and an output:\n"
                     "compile fails on them; train other weights (--trainable), register a rule "
                     "(lossgraph.grad_rule) or compile with --backend ort\n" + _table(
                         ("op", "node", "path"),
                         ((_op_text(m["domain"], m["op_type"]), m["node"] or "-",
                           _short_path(m["path"], m["at"])) for m in missing)))
    elif report["trainable"]:
        parts.append("\nevery op between the trainable weights and the outputs has a gradient "
                     "rule")
    return "\n".join(parts)


# -- compile ---------------------------------------------------------------------------------


def _optimizer(args: argparse.Namespace) -> Optimizer:
    """The optimizer of ``--optimizer`` with ``--learning-rate`` and ``--momentum``."""
    spec, rate, momentum = args.optimizer, args.learning_rate, args.momentum
    if not isinstance(spec, str):  # the JSON form
        if momentum is not None:
            raise UnsupportedOptionError(
                "--momentum goes with --optimizer momentum or nesterov; in the JSON form, write "
                'it inside: \'{"type": "Momentum", "momentum": 0.9}\'.')
        if rate is not None:
            if isinstance(spec, Mapping) and "learning_rate" in spec:
                raise UnsupportedOptionError(
                    "The learning rate is given twice, by --learning-rate and in --optimizer's "
                    "JSON: give it once.")
            spec = {**spec, "learning_rate": rate} if isinstance(spec, Mapping) else spec
        return optimizer_from_dict(spec)
    options: dict[str, Any] = {} if rate is None else {"learning_rate": rate}
    if spec in ("momentum", "nesterov"):
        return Momentum(**options, momentum=0.9 if momentum is None else momentum,
                        nesterov=spec == "nesterov")
    if momentum is not None:
        raise UnsupportedOptionError(
            f"--momentum goes with --optimizer momentum or nesterov, not {spec}.")
    return {"sgd": SGD, "adam": Adam, "adamw": AdamW}[spec](**options)


def _loss_options(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(args.loss_option)
    if args.weight_name is not None:
        if "weight_name" in options and options["weight_name"] != args.weight_name:
            raise UnsupportedOptionError(
                "--weight-name and --loss-option weight_name=... disagree: give it once.")
        options["weight_name"] = args.weight_name
    return options


def _penalty(args: argparse.Namespace, loss: str | None,
             loss_options: Mapping[str, Any]) -> Any:
    """``--penalty``'s JSON, or ``--penalty-l1/--penalty-l2`` on every trained weight."""
    l1, l2 = args.penalty_l1, args.penalty_l2
    if l1 is None and l2 is None:
        return args.penalty
    if args.penalty is not None:
        raise UnsupportedOptionError(
            "--penalty (per weight) and --penalty-l1/--penalty-l2 (every trained weight) "
            "cannot be combined: use one form.")
    if loss is None:
        raise UnsupportedOptionError(
            "--penalty-l1/--penalty-l2 need lossgraph to add the loss; with --loss none the "
            "model carries its own: add the penalty when building it (lossgraph add-loss "
            "--penalty).")
    weights = args.weights
    if not weights:  # the weights compile_program trains by default: those of the loss model
        with use_target(args.target):
            weights = trainable_initializers(add_loss_output(lower_ml_ops(args.model), loss,
                                                             **loss_options))
    return {w: {"l1": l1 or 0.0, "l2": l2 or 0.0} for w in weights}


def _compile(args: argparse.Namespace) -> int:
    loss = None if args.loss == "none" else args.loss
    loss_options = _loss_options(args)
    optimizer = _optimizer(args)
    penalty = _penalty(args, loss, loss_options)
    if args.format == "ort-artifacts":
        given = [option for option, value in (("--fuse", args.fuse), ("--backend", args.backend),
                                              ("--target", args.target)) if value]
        if given:
            raise UnsupportedOptionError(
                f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --format "
                "program only: onnxruntime's training "
                "artifacts have their own graphs, gradients from lossgraph's onnx backend, and "
                "the opsets of onnxruntime-training 1.19.")
        to_ort_artifacts = _export_function("to_ort_artifacts")
        written = to_ort_artifacts(args.model, args.output, optimizer=optimizer,
                                   weights=args.weights, loss=loss, loss_options=loss_options,
                                   penalty=penalty)
        print(f"{args.output}: {', '.join(Path(path).name for path in written)}; trains with "
              f"{type(optimizer).__name__} (learning rate {optimizer.learning_rate:g}: "
              "onnxruntime's Optimizer starts at 0.001, set_learning_rate sets it)")
        return EXIT_OK
    program = compile_program(
        args.model, weights=args.weights, loss=loss, loss_options=loss_options, penalty=penalty,
        optimizer=optimizer, backend=args.backend or "onnx", fuse=args.fuse or "step",
        target=args.target)
    program.save(args.output)
    print(f"{args.output}: {', '.join(sorted(program.graphs))}; trains "
          f"{', '.join(program.weights)} with {type(program.optimizer).__name__} "
          f"(learning rate {program.optimizer.learning_rate:g})")
    return EXIT_OK


def _export_function(name: str) -> Callable[..., Any]:
    """``lossgraph.export.<name>``, or a clear error where it cannot be imported."""
    from . import export

    try:
        return getattr(export, name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeUnavailableError(
            f"lossgraph.export.{name} is not available in this installation ({exc}).") from None


# -- training data ---------------------------------------------------------------------------


def _input_specs(program: TrainingProgram) -> dict[str, list[dict[str, Any]]]:
    """The evaluate graph's data inputs by role: feature, label, sample_weight."""
    specs: dict[str, list[dict[str, Any]]] = {"feature": [], "label": [], "sample_weight": []}
    for value in program.manifest["graphs"]["evaluate"]["inputs"]:
        if value["role"] in specs:
            specs[value["role"]].append(value)
    return specs


def _default_label(available: Sequence[str], path: str, what: str) -> list[str]:
    for name in ("y", "label"):
        if name in available:
            return [name]
    raise InvalidDataError(
        f"{path!r} has no {what} named y or label: name the label with --label ({what}s: "
        f"{', '.join(available)}).")


def _selection(args: argparse.Namespace, available: Sequence[str], path: str, what: str,
               weighted: bool, default_features: Callable[[list[str]], list[str]]
               ) -> tuple[list[str], list[str], str | None]:
    """The features, label and sample weight to read (column or array names), checked:
    each exists and is read once. The sample weight defaults to ``sample_weight`` when the
    program takes one."""
    label = args.label or _default_label(available, path, what)
    weight = args.sample_weight
    if weight is not None and not weighted:
        raise UnsupportedOptionError(
            f"--sample-weight {weight}: the program has no sample-weight input; compile it "
            "with --weight-name NAME to train with sample weights.")
    if weight is None and "sample_weight" in available and "sample_weight" not in label:
        if weighted:
            weight = "sample_weight"
        elif not args.features:
            print(f"lossgraph train: warning: {path!r} holds sample weights ('sample_weight'), "
                  "but the program has no sample-weight input (compile --weight-name): they "
                  "are not used.", file=sys.stderr)
    taken = [*label, *([weight] if weight else [])]
    unused = ["sample_weight"] if weight is None and "sample_weight" in available else []
    features = args.features or default_features([*taken, *unused])
    _known([*features, *taken], available, path, what)
    for option, names in (("--features", features), ("--label", label)):
        repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if repeated is not None:
            raise InvalidDataError(f"{option} names the {what} {repeated!r} twice.")
    both = next((n for n in features if n in taken), None)
    if both is not None:
        role = "the sample weight" if both == weight else "the label"
        raise InvalidDataError(f"The {what} {both!r} cannot be both a feature and {role}.")
    return features, label, weight


def _known(names: Sequence[str], available: Sequence[str], path: str, what: str) -> None:
    for name in names:
        if name not in available:
            raise InvalidDataError(f"{path!r} has no {what} {name!r}."
                                   + suggest(name, available, f"{what}s"))


def _array_data(path: str, args: argparse.Namespace,
                specs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``X``, ``y`` (and ``sample_weight``) from an .npz file or a folder of .npy files."""
    arrays = read_arrays(path)
    names = sorted(arrays)
    needs = (f"{path!r} holds {names}; it needs arrays named X and y (and optionally "
             "sample_weight), or --features and --label naming others.")
    by_input = [f["name"] for f in specs["feature"]]

    def default_features(taken: list[str]) -> list[str]:
        if "X" in arrays:
            return ["X"]
        if len(by_input) > 1 and all(n in arrays for n in by_input):
            return by_input  # one array per feature input, named after it
        raise InvalidDataError(needs)

    if not args.label and "y" not in arrays and "label" not in arrays:
        raise InvalidDataError(needs)
    features, label, weight = _selection(args, names, path, "array",
                                         bool(specs["sample_weight"]), default_features)
    if len(label) > 1:
        raise InvalidDataError(f"--label names {len(label)} arrays; in .npz and .npy data the "
                               "label is one array (of shape (N, k) for k outputs).")
    data = {"X": arrays[features[0]] if len(features) == 1 else
            {name: arrays[name] for name in features}, "y": arrays[label[0]]}
    if weight:
        data["sample_weight"] = arrays[weight]
    return data


def _csv_columns(path: Path) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as stream:
            header = next(csv.reader(stream), None)
    except UnicodeDecodeError:
        raise InvalidDataError(f"{str(path)!r} is not a text file (UTF-8): a .csv file holds a "
                               "header row, then rows of numbers.") from None
    except csv.Error as exc:
        raise InvalidDataError(f"{str(path)!r} cannot be read as CSV ({exc}).") from None
    if not header or not any(name.strip() for name in header):
        raise InvalidDataError(f"{str(path)!r} is empty: a .csv file starts with a header row "
                               "naming its columns.")
    return [name.strip() for name in header]


def _read_csv(path: Path, names: Sequence[str], wanted: Sequence[str]) -> dict[str, np.ndarray]:
    columns = [names.index(name) for name in wanted]
    try:
        with warnings.catch_warnings():  # no rows: said below, as an error
            warnings.filterwarnings("ignore", "loadtxt: input contained no data")
            table = np.loadtxt(path, delimiter=",", skiprows=1, usecols=columns, ndmin=2,
                               dtype=np.float64, encoding="utf-8-sig", quotechar='"')
    except ValueError as exc:
        raise InvalidDataError(f"{str(path)!r} cannot be read as numbers: "
                               f"{_csv_problem(path, names, wanted) or _one_line(str(exc))} "
                               "(choose the columns with --features, --label, --sample-weight)."
                               ) from None
    return {name: table[:, k] for k, name in enumerate(wanted)}


def _csv_problem(path: Path, names: Sequence[str], wanted: Sequence[str]) -> str | None:
    """Where a .csv file numpy could not read goes wrong: the first bad line and cell."""
    columns = [names.index(name) for name in wanted]
    line = 1
    try:
        with open(path, newline="", encoding="utf-8-sig") as stream:
            reader = csv.reader(stream)
            next(reader, None)
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) != len(names):
                    return f"line {line} has {len(row)} fields, the header {len(names)}"
                for index in columns:
                    try:
                        float(row[index])
                    except ValueError:
                        return (f"line {line}, column {names[index]!r}: {row[index]!r} is not "
                                "a number")
    except UnicodeDecodeError:
        return f"after line {line} it is not UTF-8 text"
    except csv.Error as exc:
        return f"line {line + 1}: {exc}"
    return None


def _parquet_module() -> Any:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise RuntimeUnavailableError(
            "Reading .parquet files needs pyarrow: pip install pyarrow (or pip install "
            "'lossgraph[parquet]').") from None
    return parquet


def _parquet_columns(path: Path) -> list[str]:
    parquet = _parquet_module()
    try:
        return list(parquet.read_schema(path).names)
    except (OSError, ValueError) as exc:
        raise InvalidDataError(f"{str(path)!r} is not a readable Parquet file ({exc}).") from None


def _read_parquet(path: Path, wanted: Sequence[str]) -> dict[str, np.ndarray]:
    table = _parquet_module().read_table(path, columns=list(wanted))
    return {name: np.asarray(table.column(name).to_numpy()) for name in wanted}


def _as_input(values: np.ndarray, spec: Mapping[str, Any], what: str) -> np.ndarray:
    """A column (or columns) of a table as the dtype input ``spec`` declares."""
    dtype = np.dtype(spec["dtype"])
    if dtype.kind in "iu" and values.dtype.kind == "f":
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise InvalidDataError(
                f"{what} holds {values[bad][0]!r} (row {row}), but the model's input "
                f"{spec['name']!r} takes whole numbers ({dtype}).")
    return values.astype(dtype)


def _table_data(path: str, args: argparse.Namespace,
                specs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``X``, ``y`` (and ``sample_weight``) from the columns of a .csv or .parquet file,
    converted to the dtypes of the program's inputs."""
    source = Path(path)
    if not source.is_file():
        raise InvalidDataError(f"There is no data file at {path!r}." if not source.exists()
                               else f"{path!r} is not a regular file.")
    parquet = source.suffix.lower() != ".csv"
    names = _parquet_columns(source) if parquet else _csv_columns(source)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidDataError(f"{path!r} names the column {duplicates[0]!r} twice.")
    features, label, weight = _selection(
        args, names, path, "column", bool(specs["sample_weight"]),
        lambda taken: [n for n in names if n not in taken])
    if not features:
        raise InvalidDataError(f"{path!r} has no feature column besides {', '.join(label)}.")
    if len(specs["feature"]) != 1:
        inputs = ", ".join(f["name"] for f in specs["feature"])
        raise InvalidDataError(
            f"The program has {len(specs['feature'])} feature inputs ({inputs}); a .csv or "
            ".parquet file feeds one. Save one array per input in an .npz file instead, named "
            "after the inputs.")
    wanted = [*features, *label, *([weight] if weight else [])]
    columns = _read_parquet(source, wanted) if parquet else _read_csv(source, names, wanted)
    rows = len(next(iter(columns.values())))
    if rows == 0:
        raise InvalidDataError(f"{path!r} has no rows of data.")

    for name, values in columns.items():
        if values.dtype.kind not in "biuf":
            raise InvalidDataError(f"The column {name!r} of {path!r} holds {values.dtype} values "
                                   "(text?), not numbers: leave it out of --features.")

    def stacked(chosen: Sequence[str]) -> np.ndarray:
        return np.stack([columns[name] for name in chosen], axis=1)

    feature_spec = specs["feature"][0]
    width = feature_spec["shape"][-1] if len(feature_spec["shape"]) == 2 else None
    if isinstance(width, int) and width != len(features):
        raise InvalidDataError(
            f"{path!r} gives {len(features)} feature column{'s' * (len(features) != 1)} "
            f"({', '.join(features)}), but the model's input {feature_spec['name']!r} takes "
            f"{width}: choose them with --features (and the label with --label).")
    label_spec = specs["label"][0] if specs["label"] else {"name": "label", "dtype": "float32",
                                                           "shape": []}
    outputs = label_spec["shape"][-1] if len(label_spec["shape"]) == 2 else 1
    if isinstance(outputs, int) and outputs != len(label):
        raise InvalidDataError(
            f"{path!r} gives {len(label)} label column{'s' * (len(label) != 1)} "
            f"({', '.join(label)}), but the model's label {label_spec['name']!r} takes "
            f"{outputs}: name them with --label.")
    data: dict[str, Any] = {
        "X": _as_input(stacked(features), feature_spec, f"{path!r} columns {', '.join(features)}"),
        "y": _as_input(columns[label[0]] if len(label) == 1 else stacked(label), label_spec,
                       f"{path!r} column {', '.join(label)}")}
    if weight:
        data["sample_weight"] = _as_input(columns[weight], specs["sample_weight"][0],
                                          f"{path!r} column {weight}")
    return data


def _training_data(path: str, args: argparse.Namespace,
                   program: TrainingProgram) -> dict[str, Any]:
    """The data of ``--data``, by the names ``Trainer.fit`` takes them."""
    specs = _input_specs(program)
    if Path(path).suffix.lower() in TABLE_SUFFIXES:
        return _table_data(path, args, specs)
    if Path(path).suffix.lower() == ".npy":
        raise InvalidDataError(
            f"{path!r} is one .npy array; --data takes an .npz file, a folder of .npy files "
            "(X.npy, y.npy, ...), a .csv or a .parquet file.")
    return _array_data(path, args, specs)


def _rows(value: Any) -> int:
    return len(next(iter(value.values()))) if isinstance(value, Mapping) else len(value)


def _split(data: Mapping[str, Any], fraction: float) -> tuple[dict[str, Any], tuple]:
    """The rows but the last ``fraction``, and those held out as validation data."""
    rows = _rows(data["y"])
    held = int(round(rows * fraction))
    if not 0 < held < rows:
        raise InvalidDataError(
            f"--validation-split {fraction:g} of {rows} rows holds out {held}: choose a split "
            "that keeps at least one row on each side.")
    cut = rows - held

    def part(value: Any, rows_: slice) -> Any:
        return ({k: v[rows_] for k, v in value.items()} if isinstance(value, Mapping)
                else value[rows_])

    train = {name: part(value, slice(None, cut)) for name, value in data.items()}
    validation = tuple(part(data[name], slice(cut, None))
                       for name in ("X", "y", "sample_weight") if name in data)
    return train, validation


# -- train -----------------------------------------------------------------------------------


def _figure_class() -> type:
    """matplotlib's Figure (no pyplot, no GUI), or a clear error when it is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeUnavailableError(
            "--plot needs matplotlib: pip install matplotlib (or pip install "
            "'lossgraph[plot]'), or leave --plot out.") from None
    return Figure


def loss_curve_png(train_losses: Sequence[float], validation_losses: Sequence[float],
                   title: str = "") -> bytes:
    """The loss by epoch drawn as a PNG (marked as lossgraph's); validation losses are
    drawn against the last epochs when there are fewer of them."""
    figure = _figure_class()(figsize=(6.4, 4.0), dpi=100)
    axes = figure.add_subplot()
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
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": f"lossgraph {__version__}"})
    return buffer.getvalue()


def _trainer(args: argparse.Namespace) -> Trainer:
    """A trainer of the program folder, or resuming ``--resume``'s checkpoint."""
    if args.resume is None:
        if args.program is None:
            raise UnsupportedOptionError(
                "Name the program folder to train (lossgraph train PROGRAM --data ...), or a "
                "checkpoint to continue with --resume CHECKPOINT.")
        return Trainer(TrainingProgram.load(args.program))
    trainer = Trainer.load_checkpoint(args.resume)
    if args.program is not None:
        program = TrainingProgram.load(args.program)
        if program.manifest != trainer.program.manifest:
            raise UnsupportedOptionError(
                f"The checkpoint {args.resume!r} was not saved by training the program "
                f"{args.program!r} (their manifests differ): leave the program out to continue "
                "the checkpoint's own.")
    return trainer


def _train(args: argparse.Namespace) -> int:
    trainer = _trainer(args)
    data = _training_data(args.data, args, trainer.program)
    validation = None
    if args.validation_split is not None:
        data, validation = _split(data, args.validation_split)
    before = len(trainer.train_losses_), len(trainer.validation_losses_)  # a checkpoint's
    trainer.fit(**data, epochs=args.epochs, batch_size=args.batch_size,
                shuffle=not args.no_shuffle, random_state=args.random_state,
                validation_data=validation, progress=args.progress,
                warm_start=args.resume is not None)
    train_losses, validation_losses = trainer.train_losses_, trainer.validation_losses_
    print(f"trained {args.epochs}{' more' if args.resume else ''} epoch"
          f"{'s' * (args.epochs != 1)} on {_rows(data['y'])} rows"
          + (f" ({_rows(validation[1])} held out for validation)" if validation else "")
          + (f", {trainer.epochs_} in all with those of {args.resume}" if args.resume else ""))
    span = f" {before[0] + 1}-{len(train_losses)}" if args.resume else ""
    print(f"losses by epoch{span}: "
          f"{', '.join(f'{v:.6g}' for v in train_losses[before[0]:])}")
    if len(validation_losses) > before[1]:
        print(f"validation losses by epoch{span}: "
              f"{', '.join(f'{v:.6g}' for v in validation_losses[before[1]:])}")
    # everything but the model is rendered before the first write
    history = None
    if args.history:
        history = json.dumps({
            "format": HISTORY_FORMAT, "epochs": trainer.epochs_, "steps": trainer.steps_,
            "train_loss": list(train_losses), "validation_loss": list(validation_losses),
            "batch_size": args.batch_size, "data": args.data,
            "validation_split": args.validation_split,
            "program": args.program, "resumed_from": args.resume}, indent=2) + "\n"
    plot = loss_curve_png(train_losses, validation_losses,
                          f"lossgraph: {Path(args.data).name}") if args.plot else None
    _export_function("save_inference_model")(trainer, args.output, overwrite=args.force)
    written = [f"{args.output}{_external_note(args.output)}"]
    if args.checkpoint:
        trainer.save_checkpoint(args.checkpoint)
        written.append(args.checkpoint)
    if history is not None:
        write_file(args.history, history.encode(), _is_history, overwrite=args.force)
        written.append(args.history)
    if plot is not None:
        write_file(args.plot, plot, _is_plot, overwrite=args.force)
        written.append(args.plot)
    print(f"wrote {', '.join(written)}")
    return EXIT_OK


# -- the other commands ----------------------------------------------------------------------


def _output_index(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def _export(args: argparse.Namespace) -> int:
    if not Path(args.source).exists():
        raise InvalidProgramError(
            f"There is nothing at {args.source!r}: lossgraph export takes a checkpoint folder "
            "(lossgraph train --checkpoint), a program folder (lossgraph compile) or an .onnx "
            "model.")
    save_inference_model = _export_function("save_inference_model")
    save_inference_model(args.source, args.output, external_data=args.external_data,
                         target=args.target, overwrite=args.force)
    print(f"wrote {args.output}{_external_note(args.output)}")
    return EXIT_OK


def _external_note(path: str) -> str:
    """`` and <file>`` when the model at ``path`` keeps tensors in an external file."""
    model = onnx.load(path, load_external_data=False)
    files = sorted({entry.value for tensor in model.graph.initializer
                    for entry in tensor.external_data if entry.key == "location"})
    return "".join(f" and {os.path.join(os.path.dirname(path), name)}" for name in files)


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; return the exit status."""
    if args.command == "inspect":
        if Path(args.model).is_dir():
            raise InvalidModelError(
                f"{args.model!r} is a folder; lossgraph inspect reads an ONNX model file (a "
                "program folder keeps its inference model as inference.onnx).")
        report = inspect_model(args.model)
        print(json.dumps(report, indent=2) if args.json else format_inspection(report))
        return EXIT_OK
    if args.command == "compile":
        return _compile(args)
    if args.command == "train":
        return _train(args)
    if args.command == "export":
        return _export(args)
    if args.command == "add-loss":
        result = add_loss_output(
            args.model, args.loss, loss_name=args.loss_name, label_name=args.label_name,
            weight_name=args.weight_name, penalty=args.penalty,
            output_index=_output_index(args.output_index), reduction=args.reduction,
            **dict(args.option))
    elif args.command == "gradient":
        result = gradient(args.model, weights=args.weights, loss_name=args.loss_name,
                          backend=args.backend, outputs=args.outputs)
    elif args.command == "lower-ml":
        result = lower_ml_ops(args.model)
    elif args.command == "alphabetize":
        result, mapping = alphabetize_initializers(args.model)
        print(json.dumps(mapping, indent=2))
    elif args.command == "trainable":
        print("\n".join(trainable_initializers(args.model)))
        return EXIT_OK
    else:
        for rule in supported_ops(None):
            domain = f"{rule.domain}::" if rule.domain else ""
            print(f"{domain}{rule.op_type}\topset {rule.opsets}\t{rule.notes}".rstrip())
        return EXIT_OK
    save_model(result, args.output, overwrite=args.force)
    return EXIT_OK


def _one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _warning_printer(prefix: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: one line, like the errors."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        print(f"{prefix}: warning: {_one_line(str(message))}", file=sys.stderr)

    return show


def _broken_pipe() -> int:
    """The reader of stdout went away (``lossgraph inspect ... | head``): stop quietly."""
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file descriptor (tests capture it)
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status: 0 done, 2 a user error, 1 an internal
    error (see the module docstring)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a one-line usage error
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    prefix = f"lossgraph {args.command}"
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(prefix)
            _check_outputs(args)
            return _run(args)
    except (LossgraphError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            return _broken_pipe()
        print(f"{prefix}: error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: say so in one line, the traceback on request
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            traceback.print_exc()
        detail = _one_line(str(exc), 500)
        print(f"{prefix}: internal error, please report it: {type(exc).__name__}"
              + (f": {detail}" if detail else "")
              + f" (run with {DEBUG_VARIABLE}=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
