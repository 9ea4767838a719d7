"""The ``lossgraph`` command: run passes on ONNX files from the shell.

    lossgraph add-loss model.onnx -o loss.onnx --loss squared_error --weight-name w
    lossgraph gradient loss.onnx -o grad.onnx [--weights coef intercept] [--backend ort]
    lossgraph lower-ml model.onnx -o lowered.onnx
    lossgraph alphabetize model.onnx -o renamed.onnx
    lossgraph trainable model.onnx
    lossgraph ops
    lossgraph compile model.onnx -o program/ --loss squared_error --fuse epoch \
        --optimizer '{"type": "Momentum", "learning_rate": 0.01, "nesterov": true}'
    lossgraph train program/ --data train.npz --epochs 10 --batch-size 50 -o trained.onnx

Every command that writes a model writes it atomically, never over a file or folder
lossgraph did not write (``--force`` replaces a file anyway), and checks its outputs
before any work; every error, a bad command line included, prints one line (no
traceback) and exits with status 2. The previous release's spellings of options
(``--score``, ``--weight``, ``--wrt``, gradient's ``--loss``, ``--trainable``,
``--gradient``) still work, with a warning on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from . import __version__
from .analysis import trainable_initializers
from .autodiff import supported_ops
from .compiler import compile_program
from .errors import InvalidDataError, LossgraphError
from .fileio import check_file_target, check_folder_target, save_model
from .optim import optimizer_from_dict
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.rename import alphabetize_initializers
from .program import TrainingProgram
from .runtime import Trainer
from .storage import CHECKPOINT_FOLDER, PROGRAM_FOLDER, read_arrays

EXIT_ERROR = 2


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


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lossgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lossgraph {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def with_io(name: str, help_: str, source: str = "input ONNX file",
                output: str = "output ONNX file") -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_)
        command.add_argument("model", help=source)
        command.add_argument("-o", "--output", required=True, help=output)
        if output.endswith("file"):
            command.add_argument("--force", action="store_true",
                                 help="replace the output file even if lossgraph did not "
                                      "write it")
        return command

    penalty = _json('\'{"coef": {"l1": 0.01, "l2": 0.1}}\'')
    add_loss = with_io("add-loss", "append a scalar loss output")
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

    grad = with_io("gradient", "add <weight>_grad outputs")
    grad.add_argument("--weights", nargs="+", help="what to differentiate with respect to")
    grad.add_argument("--wrt", dest="weights", nargs="+", action=_Renamed, new="--weights")
    grad.add_argument("--loss-name", help="the scalar output to differentiate")
    grad.add_argument("--loss", dest="loss_name", action=_Renamed, new="--loss-name")
    grad.add_argument("--outputs", nargs="+", help="vector-Jacobian mode")
    grad.add_argument("--backend", default="onnx", choices=["onnx", "ort"])

    build = with_io("compile", "compile a training program into a folder",
                    output="output program folder (new, empty, or a program lossgraph wrote)")
    build.add_argument("--loss", default="squared_error",
                       help="the loss function, or 'none' when the model carries its loss")
    build.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                       type=_key_value,
                       help="add_loss_output option, e.g. weight_name=w or delta=1.5")
    build.add_argument("--penalty", type=penalty, default=None)
    build.add_argument("--optimizer", type=_json('\'{"type": "Adam", "learning_rate": 0.001}\''),
                       default={"type": "SGD"},
                       help='JSON, e.g. \'{"type": "Adam", "learning_rate": 0.001}\'')
    build.add_argument("--weights", nargs="+", help="the weights to train")
    build.add_argument("--trainable", dest="weights", nargs="+", action=_Renamed,
                       new="--weights")
    build.add_argument("--backend", default="onnx", choices=["onnx", "ort"],
                       help="the gradient backend")
    build.add_argument("--gradient", dest="backend", action=_Renamed, new="--backend")
    build.add_argument("--fuse", default="step", choices=["separate", "step", "epoch"])
    build.add_argument("--target", default=None, help="default or onnxruntime")

    train = with_io("train", "train a compiled program; write the trained inference model",
                    source="program folder (written by lossgraph compile -o)")
    train.add_argument("--data", required=True,
                       help=".npz with X and y (and sample_weight), or a folder of .npy files")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, default=32)
    train.add_argument("--no-shuffle", action="store_true")
    train.add_argument("--random-state", type=int, default=None)
    train.add_argument("--checkpoint", help="also save a checkpoint folder here")

    with_io("lower-ml", "rewrite ai.onnx.ml linear models into standard ops")
    with_io("alphabetize", "rename trainable initializers into graph order")
    commands.add_parser("trainable", help="list the trainable initializers").add_argument("model")
    commands.add_parser("ops", help="list the ops lossgraph can differentiate")
    return parser


def _output_index(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def _training_data(path: str) -> dict[str, np.ndarray]:
    """``X``, ``y`` (and ``sample_weight``) from an .npz file or a folder of .npy files."""
    arrays = read_arrays(path)
    missing = [name for name in ("X", "y") if name not in arrays]
    if missing:
        raise InvalidDataError(
            f"{path} holds {sorted(arrays)}; it needs arrays named X and y (and optionally "
            "sample_weight).")
    return {name: arrays[name] for name in ("X", "y", "sample_weight") if name in arrays}


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, outputs that would replace what lossgraph did not write."""
    if args.command == "compile":
        check_folder_target(args.output, PROGRAM_FOLDER)
    elif getattr(args, "output", None) is not None:
        check_file_target(args.output, overwrite=args.force)
    if getattr(args, "checkpoint", None):
        check_folder_target(args.checkpoint, CHECKPOINT_FOLDER)


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; return the exit status."""
    if args.command == "add-loss":
        result = add_loss_output(
            args.model, args.loss, loss_name=args.loss_name, label_name=args.label_name,
            weight_name=args.weight_name, penalty=args.penalty,
            output_index=_output_index(args.output_index), reduction=args.reduction,
            **dict(args.option))
    elif args.command == "gradient":
        result = gradient(args.model, weights=args.weights, loss_name=args.loss_name,
                          backend=args.backend, outputs=args.outputs)
    elif args.command == "compile":
        program = compile_program(
            args.model, weights=args.weights,
            loss=None if args.loss == "none" else args.loss, loss_options=dict(args.loss_option),
            penalty=args.penalty, optimizer=optimizer_from_dict(args.optimizer),
            backend=args.backend, fuse=args.fuse, target=args.target)
        program.save(args.output)
        print(f"{args.output}: {', '.join(sorted(program.graphs))}")
        return 0
    elif args.command == "train":
        trainer = Trainer(TrainingProgram.load(args.model))
        trainer.fit(**_training_data(args.data), epochs=args.epochs,
                    batch_size=args.batch_size, shuffle=not args.no_shuffle,
                    random_state=args.random_state)
        print(f"losses by epoch: {', '.join(f'{v:.6g}' for v in trainer.train_losses_)}")
        if args.checkpoint:
            trainer.save_checkpoint(args.checkpoint)
        result = trainer.to_inference_model()
    elif args.command == "lower-ml":
        result = lower_ml_ops(args.model)
    elif args.command == "alphabetize":
        result, mapping = alphabetize_initializers(args.model)
        print(json.dumps(mapping, indent=2))
    elif args.command == "trainable":
        print("\n".join(trainable_initializers(args.model)))
        return 0
    else:
        for rule in supported_ops(None):
            domain = f"{rule.domain}::" if rule.domain else ""
            print(f"{domain}{rule.op_type}\topset {rule.opsets}\t{rule.notes}".rstrip())
        return 0
    save_model(result, args.output, overwrite=args.force)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (2 for every error)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a one-line usage error
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    try:
        _check_outputs(args)
        return _run(args)
    except (LossgraphError, OSError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message holds
        print(f"lossgraph {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
