"""The ``lossgraph`` command: from an ONNX model to a trained ONNX model, in the shell.

    lossgraph inspect model.onnx                       # what it holds, what can be trained
    lossgraph compile model.onnx -o program/ --optimizer adam --learning-rate 0.01
    lossgraph train program/ --data train.csv --epochs 20 --validation-split 0.2 \
        -o trained.onnx --checkpoint ckpt/ --history history.json --plot loss.png
    lossgraph export ckpt/ -o deployed.onnx            # the inference model of a checkpoint
    lossgraph export ckpt/ --adapters adapter.safetensors   # LoRA adapters alone

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
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import LossgraphError
from .inputs import check_inputs
from .outputs import _check_outputs
from .parser import (
    DEBUG_VARIABLE,
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    _one_line,
    build_parser,
)

__all__ = ["main"]


# -- the other commands ----------------------------------------------------------------------


def _output_index(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def _export(args: argparse.Namespace) -> int:
    from .build import _export_function
    from .outputs import _external_note

    source = args.source
    if args.adapters is not None and os.path.isdir(source):
        # a program or checkpoint folder (export_adapters reads no other): read once
        from ..program import TrainingProgram
        from ..storage import read_saved

        source = TrainingProgram(*read_saved(source))
    if args.merge:  # adapters that cannot be merged: the error before anything is written
        from ..export.inference import check_merge_of

        check_merge_of(source)
    if args.adapters is not None:
        from ..export.adapters import PEFT_CONFIG

        written = _export_function("export_adapters")(
            source, args.adapters, peft_config=args.peft_config, overwrite=args.force)
        config = f" and {written.with_name(PEFT_CONFIG)}" if args.peft_config else ""
        print(f"wrote {args.adapters}{config}")
    if args.output is not None:
        save_inference_model = _export_function("save_inference_model")
        save_inference_model(source, args.output, external_data=args.external_data,
                             target=args.target, overwrite=args.force, ema=args.ema,
                             merge=args.merge)
        print(f"wrote {args.output}{_external_note(args.output)}")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; return the exit status. Each command imports what it
    needs (numpy, onnx, onnxruntime) here, after its arguments and paths were checked."""
    if args.command == "inspect":
        from .inspection import format_inspection, inspect_model

        report = inspect_model(args.model)
        print(json.dumps(report, indent=2) if args.json else format_inspection(report))
        return EXIT_OK
    if args.command == "compile":
        from .build import _compile

        return _compile(args)
    if args.command == "train":
        from .train import _train

        return _train(args)
    if args.command == "export":
        return _export(args)
    if args.command == "add-loss":
        from ..passes.loss import add_loss_output

        result = add_loss_output(
            args.model, args.loss, loss_name=args.loss_name, label_name=args.label_name,
            weight_name=args.weight_name, penalty=args.penalty,
            output_index=_output_index(args.output_index), reduction=args.reduction,
            **dict(args.loss_option))
    elif args.command == "gradient":
        from ..passes.gradient import gradient

        result = gradient(args.model, weights=args.weights, loss_name=args.loss_name,
                          backend=args.backend, outputs=args.outputs)
    elif args.command == "lower-ml":
        from ..passes.lower_ml import lower_ml_ops

        result = lower_ml_ops(args.model)
    elif args.command == "alphabetize":
        from ..passes.rename import alphabetize_initializers

        result, mapping = alphabetize_initializers(args.model)
        print(json.dumps(mapping, indent=2))
    elif args.command == "trainable":
        from ..analysis import trainable_initializers

        print("\n".join(trainable_initializers(args.model)))
        return EXIT_OK
    else:
        from ..autodiff import supported_ops

        for rule in supported_ops(None):
            domain = f"{rule.domain}::" if rule.domain else ""
            print(f"{domain}{rule.op_type}\topset {rule.opsets}\t{rule.notes}".rstrip())
        return EXIT_OK
    from ..fileio import save_model

    save_model(result, args.output, overwrite=args.force)
    return EXIT_OK


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
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a one-line usage error
        return exit_.code if isinstance(exit_.code, int) else EXIT_ERROR
    prefix = f"lossgraph {args.command}"
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(prefix)
            check_inputs(args)
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

