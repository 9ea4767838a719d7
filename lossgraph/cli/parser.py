"""Argument parsing: the commands, their options and their help."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from .. import __version__
from ..options import FIXED_BATCH_CHOICES
from ..schedules import SCHEDULE_NAMES

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
  lossgraph compile model.onnx -o program/ --weights coef intercept --loss huber \\
      --loss-option delta=0.5 --weight-name sample_weight
  lossgraph compile model.onnx -o program/ \\
      --optimizer '{"type": "AdamW", "learning_rate": 0.001, "weight_decay": 0.05}'
  lossgraph compile model.onnx -o program/ --optimizer adamw --learning-rate 5e-5 \\
      --schedule linear --warmup-steps 100 --total-steps 1000 --exclude-from-weight-decay
  lossgraph compile model.onnx -o program/ --schedule cosine --total-steps 1000 \\
      --schedule-option end=1e-5 --schedule-option cycles=1
  lossgraph compile bert.onnx -o program/ --untie   # each layer its own LayerNorm scale
  lossgraph compile bert.onnx -o program/ --lora 8 --lora-targets query,value
  lossgraph compile model.onnx -o artifacts/ --format ort-artifacts --optimizer adamw""",
    "train": """\
examples:
  lossgraph train program/ --data train.npz --epochs 10 -o trained.onnx
  lossgraph train program/ --data train.csv --label price --epochs 20 --batch-size 64 \\
      --validation-split 0.2 --random-state 0 -o trained.onnx --checkpoint ckpt/ \\
      --history history.json --plot loss.png
  lossgraph train --resume ckpt/ --data train.csv --epochs 5 -o trained.onnx \\
      --checkpoint ckpt/      # 5 more epochs from the checkpoint
  lossgraph train program/ --data train.npz --epochs 100 --validation-split 0.1 \\
      --metrics accuracy top_5_accuracy --early-stopping-patience 5 \\
      --early-stopping-monitor validation_accuracy -o trained.onnx --history history.json

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
  lossgraph export program/ -o initial.onnx     # a program folder (lossgraph compile)
  lossgraph export ckpt/ --adapters adapter/adapter_model.safetensors --peft-config
                                                # the LoRA adapters alone, for PEFT""",
    "add-loss": """\
example:
  lossgraph add-loss model.onnx -o loss.onnx --loss huber --loss-option delta=0.5 \\
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

    def __init__(self, option_strings: list[str], dest: str, new: str = "",
                 append: bool = False, **kwargs: Any):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new
        self.append = append  # the new option may be given several times: add to its list

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the "
              f"next release: use {self.new}.", file=sys.stderr)
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def _key_value(text: str) -> tuple[str, object]:
    """An argument type: ``KEY=VALUE``, the value read as a bool, a number, a JSON list
    (``class_weight=[1, 2.5]``) or a string."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. delta=1.5)")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    if value.lstrip().startswith("["):
        try:
            return key, json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {value!r} is not a JSON list (e.g. {key}=[1, 2.5])") from None
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


class _Modes:
    """The fusion modes of :data:`lossgraph.modes.MODES`, read when argparse checks
    ``--fuse`` or shows its help: importing the registry imports numpy and onnx, which
    ``--help`` and the argument checks of every other option do without."""

    def __iter__(self) -> Iterator[str]:
        from ..modes import MODES

        return iter(MODES)

    def __contains__(self, name: object) -> bool:
        return name in list(self)

    def __str__(self) -> str:
        from ..modes import MODES

        return "; ".join(f"{name}, {mode.summary}" for name, mode in MODES.items())


#: --merge of train and export.
MERGE_HELP = ("with -o: fold the LoRA adapters (a program compiled with --lora) into their "
              "base weights, the model's original graph (default: the adapters' branches "
              "stay, the form every base allows: a quantized or shared base refuses --merge)")


def build_parser() -> argparse.ArgumentParser:
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
    build.add_argument("--weights", nargs="+", metavar="NAME",
                       help="the initializers to train (default: every trainable candidate, "
                            "as lossgraph inspect lists them)")
    build.add_argument("--trainable", dest="weights", nargs="+", action=_Renamed,
                       new="--weights")
    build.add_argument("--untie", nargs="*", metavar="NAME",
                       help="give each layer reading one of these initializers its own copy "
                            "(alone: every initializer several layers read as their own, as "
                            "lossgraph inspect lists them; torch's exporters merge equal "
                            "values, such as a fresh model's LayerNorm scales)")
    build.add_argument("--lora", type=int, metavar="RANK",
                       help="train LoRA adapters of this rank beside the frozen weights "
                            "instead of the weights (--weights names base weights that train "
                            "too)")
    build.add_argument("--lora-alpha", type=float, metavar="ALPHA",
                       help="with --lora: the adapters' alpha, their update scaled by "
                            "alpha / rank (default: 16)")
    build.add_argument("--lora-targets", nargs="+", metavar="NAME[,NAME...]",
                       help="with --lora: the modules or weights that get an adapter, by "
                            "space or comma, PEFT's target_modules list (a module path equal "
                            "to or ending in .NAME, or a weight's name), or all-linear "
                            "(default: PEFT's defaults where the module paths name them, "
                            "e.g. query,value, else every 2-D MatMul/Gemm weight)")
    build.add_argument("--lora-pattern", metavar="REGEX",
                       help="with --lora, instead of --lora-targets: a regular expression a "
                            "module path or weight name matches in full (PEFT's "
                            "target_modules as a string)")
    build.add_argument("--lora-dropout", type=float, metavar="P",
                       help="with --lora: dropout on the adapters' input in training "
                            "(default: 0)")
    build.add_argument("--loss", default="auto",
                       help="the loss function (default: auto, the loss that fits the trained "
                            "output: a log loss for a classifier's probabilities or scores, "
                            "squared_error for values), or 'none' when the model carries its "
                            "loss")
    build.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                       type=_key_value,
                       help="an option of the loss, e.g. delta=1.5, or of add-loss, e.g. "
                            "reduction=sum (repeat for several)")
    build.add_argument("--weight-name", metavar="NAME",
                       help="add a per-row sample-weight input of this name (lossgraph train "
                            "--sample-weight feeds it)")
    build.add_argument("--class-weight-labels", nargs="+", metavar=("DATA", "NAME"),
                       help="with --loss-option class_weight=balanced: the data file whose "
                            "labels weigh the classes, as scikit-learn's balanced weights "
                            "(computed now and kept in the program), and the label column or "
                            "array (default: y, else label)")
    build.add_argument("--optimizer", type=_optimizer_spec, default="sgd",
                       metavar="NAME|JSON",
                       help=f"{'|'.join(OPTIMIZER_NAMES)} (default: sgd), or the JSON form, "
                            f"e.g. {_OPTIMIZER_EXAMPLE}")
    build.add_argument("--learning-rate", type=float, metavar="LR",
                       help="the learning rate (default: the optimizer's: 0.01 for sgd, "
                            "momentum and nesterov, 0.001 for adam and adamw)")
    build.add_argument("--momentum", type=float, metavar="M",
                       help="the momentum of --optimizer momentum or nesterov (default: 0.9)")
    build.add_argument("--schedule", choices=list(SCHEDULE_NAMES), metavar="NAME",
                       help="change the learning rate every step: "
                            f"{', '.join(SCHEDULE_NAMES)} (lossgraph.schedules; the learning "
                            "rate is its peak; default: a constant rate)")
    build.add_argument("--warmup-steps", type=int, metavar="N",
                       help="the schedule's linear warmup from 0, in steps (default: 0)")
    build.add_argument("--total-steps", type=int, metavar="N",
                       help="the steps the schedule decays over (linear, cosine, polynomial, "
                            "one_cycle)")
    build.add_argument("--schedule-option", action="append", default=[], metavar="KEY=VALUE",
                       type=_key_value,
                       help="another argument of the schedule, e.g. end=1e-5, cycles=1, "
                            "power=2, step_size=100, gamma=0.5, pct_start=0.3 (repeat for "
                            "several)")
    build.add_argument("--exclude-from-weight-decay", nargs="*", metavar="NAME",
                       help="weights adamw's decay and --penalty-l1/--penalty-l2 leave out: "
                            "names or regular expressions; alone: every bias and "
                            "normalization scale and shift, found from the graph")
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
    fuse = build.add_argument("--fuse", default=None, choices=_Modes(), metavar="MODE",
                              help="how the training graphs are fused (default: step): "
                                   "%(modes)s")
    fuse.modes = _Modes()  # read by argparse's help as %(modes)s, when it is shown
    build.add_argument("--target", default=None,
                       help="the runtimes the graphs must load in: a target name (default, "
                            "onnxruntime-1.23, onnxruntime-latest, ...) or ir<IR>-opset<N>; "
                            "see docs/reference/targets.md")
    build.add_argument("--max-grad-norm", type=float, metavar="C",
                       help="clip the gradients to this global norm before each update, as "
                            "torch.nn.utils.clip_grad_norm_ (default: no clipping)")
    build.add_argument("--ema-decay", type=float, metavar="D",
                       help="keep an exponential moving average of the weights, "
                            "e = D e + (1 - D) w after each update (e.g. 0.999); train and "
                            "export --ema write it (default: none)")
    build.add_argument("--fixed-batch", default="auto", choices=list(FIXED_BATCH_CHOICES),
                       help="a model whose inputs fix the batch size (torch.onnx.export's "
                            "default): auto frees it where the graph proves which constants "
                            "hold it, else trains batches of exactly that size (default); "
                            "generalize frees it or fails; keep trains at that size")
    build.add_argument("--accumulation-steps", type=int, default=1, metavar="K",
                       help="micro-batches of one update a training takes by default; above 1 "
                            "the program holds the graphs that accumulate gradients, and "
                            "lossgraph train --accumulation-steps may then take any K "
                            "(default: 1)")
    build.add_argument("--recompute", nargs="*", default=None, metavar="TENSOR",
                       help="recompute activations in the backward instead of keeping them: "
                            "alone (or 'auto'), boundaries chosen among the forward graph's "
                            "cuts; 'none', every activation kept; 'activations', what "
                            "elementwise arithmetic computes from kept values recomputed; "
                            "'elementwise', the elementwise ops' outputs recomputed and "
                            "every other kept; else the forward tensors kept, everything "
                            "between them recomputed (default: 'activations' for a model of "
                            "64 MiB of weights or more, else 'none')")
    build.add_argument("--recompute-budget", type=float, default=None, metavar="F",
                       help="with the boundaries lossgraph chooses, keep at most the fraction "
                            "F (0 < F <= 1) of the activations the backward reads, recomputing "
                            "as few layers as that allows (alone or with --recompute)")

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
    train.add_argument("--epochs", type=int, default=None,
                       help="epochs to train (default: 1, or as many as --max-steps takes)")
    train.add_argument("--max-steps", type=int, default=None, metavar="N",
                       help="stop after N updates, mid-epoch too (with --epochs, whichever "
                            "comes first)")
    train.add_argument("--batch-size", type=int, default=None,
                       help="rows a step (default: 32, or the batch a model exported with a "
                            "fixed batch keeps)")
    train.add_argument("--accumulation-steps", type=int, default=None, metavar="K",
                       help="one update every K batches (micro-batches), with the gradient of "
                            "the mean loss over their rows, as a batch K times larger; the "
                            "program must be compiled with --accumulation-steps (default: the "
                            "program's, 1 if it has none)")
    train.add_argument("--no-shuffle", action="store_true",
                       help="visit the rows in order (default: shuffled every epoch)")
    train.add_argument("--random-state", type=int, default=None, metavar="SEED",
                       help="seed of the shuffling (ignored with --resume: the checkpoint's "
                            "generator goes on)")
    train.add_argument("--resume", metavar="CHECKPOINT",
                       help="continue this checkpoint folder (lossgraph train --checkpoint), "
                            "or the latest in a --checkpoint-dir, for --epochs more epochs")
    output_file(train, "the trained inference model (.onnx)")
    train.add_argument("--checkpoint", metavar="FOLDER",
                       help="also save a checkpoint folder here, to --resume or export")
    train.add_argument("--checkpoint-dir", metavar="FOLDER",
                       help="save a checkpoint FOLDER/checkpoint-<steps> every "
                            "--checkpoint-every epochs and at the end, keeping the last "
                            "--keep-last and, with --validation-split, the one of the best "
                            "validation loss")
    train.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                       help="epochs between checkpoints in --checkpoint-dir (default: 1)")
    train.add_argument("--keep-last", type=int, default=None, metavar="K",
                       help="checkpoints of --checkpoint-dir kept besides the best "
                            "(default: 3)")
    train.add_argument("--log-csv", metavar="FILE",
                       help="also write the logs here as CSV, a row per epoch (or step, "
                            "--log-per step) as training goes")
    train.add_argument("--log-per", choices=["epoch", "step"], default="epoch",
                       help="a --log-csv row per epoch (default) or per update")
    train.add_argument("--history", metavar="FILE",
                       help="also write the losses of every epoch here, as JSON")
    train.add_argument("--plot", metavar="FILE",
                       help="also draw the loss curve into this PNG (needs matplotlib)")
    train.add_argument("--metrics", nargs="+", metavar="NAME",
                       help="also compute these after every epoch, on the training and "
                            "validation rows: accuracy, top_<k>_accuracy, f1, log_loss, mae, "
                            "rmse, r2")
    train.add_argument("--early-stopping-patience", type=int, metavar="N",
                       help="stop after N epochs in a row without improvement of the "
                            "monitored value, and keep the best epoch's weights")
    train.add_argument("--early-stopping-monitor", metavar="NAME", default="validation_loss",
                       help="the value early stopping watches (default: validation_loss, "
                            "which needs --validation-split; loss, or a metric such as "
                            "validation_accuracy)")
    train.add_argument("--early-stopping-min-delta", type=float, default=0.0, metavar="D",
                       help="an improvement is a change by more than D (default: 0)")
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar (default: when stderr is a terminal)")
    train.add_argument("--ema", action="store_true",
                       help="write the weights' moving average (a program compiled with "
                            "--ema-decay) instead of the last weights")
    train.add_argument("--merge", action="store_true", help=MERGE_HELP)

    export = command("export", "write the inference model of a checkpoint or program folder, "
                               "with its weights and nothing of training left")
    export.add_argument("source", help="checkpoint folder (lossgraph train --checkpoint), "
                                       "program folder (lossgraph compile) or .onnx model")
    export.add_argument("-o", "--output", metavar="FILE",
                        help="the inference model (.onnx); with --adapters, optional")
    export.add_argument("--force", action="store_true",
                        help="replace output files even if lossgraph did not write them")
    export.add_argument("--adapters", metavar="FILE",
                        help="write the LoRA adapters alone (a program compiled with --lora): "
                             ".safetensors (PEFT's names), .npz or .onnx_adapter")
    export.add_argument("--peft-config", action="store_true",
                        help="with --adapters .../adapter_model.safetensors, write PEFT's "
                             "adapter_config.json beside it (peft.PeftModel.from_pretrained "
                             "loads the folder)")
    export.add_argument("--external-data", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the large weights in FILE.data beside the model (default: "
                             "only for models over protobuf's 2 GiB)")
    export.add_argument("--target", default=None,
                        help="the runtimes the model must load in: a target name (default: "
                             "default) or ir<IR>-opset<N>; see docs/reference/targets.md")
    export.add_argument("--ema", action="store_true",
                        help="write the weights' moving average (a program or checkpoint "
                             "compiled with --ema-decay) instead of the weights")
    export.add_argument("--merge", action="store_true", help=MERGE_HELP)

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
    add_loss.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                          type=_key_value,
                          help="option of the loss, e.g. delta=1.5 or from_logits=true")
    add_loss.add_argument("--option", dest="loss_option", type=_key_value, action=_Renamed,
                          new="--loss-option", append=True)

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

def _one_line(text: str, limit: int = 2000) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
