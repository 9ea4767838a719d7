"""The ``lossgraph`` command: run passes on ONNX files from the shell.

    lossgraph add-loss model.onnx -o loss.onnx --score squared_error --weight w
    lossgraph gradient loss.onnx -o grad.onnx [--wrt coef intercept] [--backend ort]
    lossgraph lower-ml model.onnx -o lowered.onnx
    lossgraph alphabetize model.onnx -o renamed.onnx
    lossgraph trainable model.onnx
    lossgraph ops

Every command that writes a model writes it atomically; errors print lossgraph's
message (no traceback) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from .analysis import trainable_initializers
from .autodiff import supported_ops
from .errors import LossgraphError
from .fileio import save_model
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.rename import alphabetize_initializers


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
    except (LossgraphError, OSError) as exc:
        print(f"lossgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
