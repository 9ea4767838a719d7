"""The ``lossgraph`` command: run passes on ONNX files from the shell.

    lossgraph add-loss model.onnx -o loss.onnx --score squared_error --weight w
    lossgraph gradient loss.onnx -o grad.onnx [--wrt coef intercept] [--backend ort]
    lossgraph lower-ml model.onnx -o lowered.onnx
    lossgraph alphabetize model.onnx -o renamed.onnx
    lossgraph trainable model.onnx
    lossgraph ops
    lossgraph compile model.onnx -o program/ --loss squared_error --fuse epoch \
        --optimizer '{"type": "Momentum", "learning_rate": 0.01, "nesterov": true}'
    lossgraph train program/ --data train.npz --epochs 10 --batch-size 50 -o trained.onnx

Every command that writes a model writes it atomically; errors print lossgraph's
message (no traceback) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import __version__
from .analysis import trainable_initializers
from .autodiff import supported_ops
from .errors import InvalidDataError, LossgraphError
from .fileio import save_model
from .optim import optimizer_from_dict
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.rename import alphabetize_initializers
from .program import TrainingProgram
from .program import compile as compile_program
from .runtime import Trainer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lossgraph", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lossgraph {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_io(name: str, help_: str) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_)
        command.add_argument("model", help="input ONNX file")
        command.add_argument("-o", "--output", required=True, help="output ONNX file")
        return command

    add_loss = with_io("add-loss", "append a scalar loss output")
    add_loss.add_argument("--score", default="squared_error")
    add_loss.add_argument("--loss-name")
    add_loss.add_argument("--label-name")
    add_loss.add_argument("--weight", dest="weight_name")
    add_loss.add_argument("--output-index", help="output name or position")
    add_loss.add_argument("--reduction", default="mean", choices=["mean", "sum"])
    add_loss.add_argument("--penalty", type=json.loads, default=None,
                          help='JSON, e.g. \'{"coef": {"l1": 0.01, "l2": 0.1}}\'')
    add_loss.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                          help="score option, e.g. delta=1.5 or from_logits=true")

    grad = with_io("gradient", "add <weight>_grad outputs")
    grad.add_argument("--wrt", nargs="+")
    grad.add_argument("--loss")
    grad.add_argument("--outputs", nargs="+", help="vector-Jacobian mode")
    grad.add_argument("--backend", default="onnx", choices=["onnx", "ort"])

    build = with_io("compile", "compile a training program into a folder")
    build.add_argument("--loss", default="squared_error",
                       help="a score name, or 'none' when the model carries its loss")
    build.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                       help="add_loss_output option, e.g. weight_name=w or delta=1.5")
    build.add_argument("--penalty", type=json.loads, default=None)
    build.add_argument("--optimizer", type=json.loads, default={"type": "SGD"},
                       help='JSON, e.g. \'{"type": "Adam", "learning_rate": 0.001}\'')
    build.add_argument("--trainable", nargs="+")
    build.add_argument("--gradient", default="onnx", choices=["onnx", "ort"])
    build.add_argument("--fuse", default="step", choices=["separate", "step", "epoch"])
    build.add_argument("--target", default=None, help="default or onnxruntime")

    train = with_io("train", "train a compiled program; write the trained inference model")
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


def _option_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return float(text)
    except ValueError:
        return text


def _output_index(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def _training_data(path: str) -> dict[str, np.ndarray]:
    """``X``, ``y`` (and ``sample_weight``) from an .npz file or a folder of .npy files."""
    folder = Path(path)
    if folder.is_dir():
        arrays = {p.stem: np.load(p) for p in folder.glob("*.npy")}
    else:
        with np.load(folder) as stored:
            arrays = {name: stored[name] for name in stored.files}
    missing = [name for name in ("X", "y") if name not in arrays]
    if missing:
        raise InvalidDataError(
            f"{path} holds {sorted(arrays)}; it needs arrays named X and y (and optionally "
            "sample_weight).")
    return {name: arrays[name] for name in ("X", "y", "sample_weight") if name in arrays}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "add-loss":
            options = dict(item.split("=", 1) for item in args.option)
            result = add_loss_output(
                args.model, args.score, loss_name=args.loss_name, label_name=args.label_name,
                weight_name=args.weight_name, penalty=args.penalty,
                output_index=_output_index(args.output_index), reduction=args.reduction,
                **{k: _option_value(v) for k, v in options.items()})
        elif args.command == "gradient":
            result = gradient(args.model, wrt=args.wrt, loss=args.loss, backend=args.backend,
                              outputs=args.outputs)
        elif args.command == "compile":
            options = {k: _option_value(v) for k, v in
                       (item.split("=", 1) for item in args.loss_option)}
            program = compile_program(
                args.model, trainable=args.trainable,
                loss=None if args.loss == "none" else args.loss, loss_options=options,
                penalty=args.penalty, optimizer=optimizer_from_dict(args.optimizer),
                gradient=args.gradient, fuse=args.fuse, target=args.target)
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
        save_model(result, args.output)
    except (LossgraphError, OSError, json.JSONDecodeError) as exc:
        print(f"lossgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
