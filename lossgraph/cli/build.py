"""lossgraph compile: a model into a program folder or training artifacts."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..adapters import LoRA
from ..compiler import compile_program
from ..errors import (
    RuntimeUnavailableError,
    UnsupportedOptionError,
)
from ..optim import SGD, Adam, AdamW, Momentum, Optimizer, optimizer_from_dict
from ..passes.recompute import PLANS
from ..penalties import Penalty
from ..schedules import SCHEDULE_NAMES, Schedule, schedule_named

EXIT_OK = 0

# -- compile ---------------------------------------------------------------------------------


def _optimizer(args: argparse.Namespace) -> Optimizer:
    """The optimizer of ``--optimizer`` with ``--learning-rate``, ``--momentum``, the
    schedule's options and ``--exclude-from-weight-decay``."""
    optimizer = _scheduled(_rule(args), args)
    excluded = args.exclude_from_weight_decay
    if excluded is None:
        return optimizer
    if isinstance(optimizer, AdamW):
        return dataclasses.replace(optimizer, exclude_from_weight_decay=excluded or "auto")
    if args.penalty_l1 is None and args.penalty_l2 is None:
        raise UnsupportedOptionError(
            f"--exclude-from-weight-decay goes with --optimizer adamw or --penalty-l1/"
            f"--penalty-l2, which decay weights; {type(optimizer).__name__} does not.")
    return optimizer


def _scheduled(optimizer: Optimizer, args: argparse.Namespace) -> Optimizer:
    """``optimizer`` with ``--schedule`` (its peak the optimizer's learning rate)."""
    given = {"warmup_steps": args.warmup_steps, "total_steps": args.total_steps,
             **dict(args.schedule_option)}
    given = {key: value for key, value in given.items() if value is not None}
    if args.schedule is None:
        if given:
            flags = ", ".join(f"--{key.replace('_', '-')}" if key in ("warmup_steps",
                              "total_steps") else f"--schedule-option {key}=..."
                              for key in given)
            raise UnsupportedOptionError(
                f"{flags} go{'es' if len(given) == 1 else ''} with --schedule NAME.")
        return optimizer
    if isinstance(optimizer.learning_rate, Schedule):
        raise UnsupportedOptionError(
            "The schedule is given twice, by --schedule and in --optimizer's JSON: give it "
            "once.")
    kind = SCHEDULE_NAMES[args.schedule]
    integers = {f.name for f in dataclasses.fields(kind) if f.type == "int"}
    given = {key: int(value) if key in integers and isinstance(value, float) and
             value.is_integer() else value for key, value in given.items()}
    schedule = schedule_named(args.schedule,
                              **{kind.peak_argument: optimizer.learning_rate, **given})
    return dataclasses.replace(optimizer, learning_rate=schedule)


def _rule(args: argparse.Namespace) -> Optimizer:
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
    balanced = options.get("class_weight") == "balanced"
    if balanced != bool(args.class_weight_labels):
        raise UnsupportedOptionError(
            "--loss-option class_weight=balanced weighs the classes by the training labels: "
            "name them with --class-weight-labels DATA [NAME]." if balanced else
            "--class-weight-labels goes with --loss-option class_weight=balanced (the labels "
            "it reads weigh the classes).")
    if balanced:
        from ..passes.loss import balanced_class_weight
        from .data import class_labels

        path, *name = args.class_weight_labels
        options["class_weight"] = balanced_class_weight(
            class_labels(path, name[0] if name else None),
            ignore_index=options.get("ignore_index"))
    return options


def _penalty(args: argparse.Namespace, loss: str | None) -> Any:
    """``--penalty``'s JSON, or ``--penalty-l1/--penalty-l2`` on every trained weight but
    those ``--exclude-from-weight-decay`` leaves out."""
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
    excluded = args.exclude_from_weight_decay
    return Penalty(l1 or 0.0, l2 or 0.0,
                   () if excluded is None else excluded or "auto")


def _recompute(tensors: list[str] | None, budget: float | None
               ) -> str | float | list[str] | None:
    """``--recompute``: absent, None (compile's default); alone, "auto"; a plan's name
    (:data:`~lossgraph.passes.recompute.PLANS`), that plan; else the boundaries.
    ``--recompute-budget``: the budget (with no tensors named)."""
    if budget is not None:
        if tensors not in (None, [], ["auto"]):
            raise UnsupportedOptionError(
                "--recompute-budget applies to the boundaries lossgraph chooses: give it alone "
                "(or with --recompute auto), not with the tensors --recompute names.")
        return budget
    if tensors is None:
        return None
    if len(tensors) == 1 and tensors[0] in PLANS:
        return tensors[0]
    return "auto" if not tensors else tensors


def _adapters(args: argparse.Namespace) -> LoRA | None:
    """``--lora RANK`` and its options as a :class:`~lossgraph.adapters.LoRA`, or None."""
    flags = {"--lora-alpha": args.lora_alpha, "--lora-targets": args.lora_targets,
             "--lora-pattern": args.lora_pattern, "--lora-dropout": args.lora_dropout}
    if args.lora is None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise UnsupportedOptionError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''}"
                                         " an option of LoRA adapters: add --lora RANK.")
        return None
    options = {"alpha": args.lora_alpha, "targets": _lora_targets(args),
               "dropout": args.lora_dropout}
    return LoRA(args.lora, **{k: v for k, v in options.items() if v is not None})


def _lora_targets(args: argparse.Namespace) -> str | list[str] | None:
    """``LoRA(targets=)`` of ``--lora-targets`` (names by space or comma, PEFT's list;
    ``all-linear`` alone) or ``--lora-pattern`` (a regular expression), or None."""
    if args.lora_pattern is not None:
        if args.lora_targets is not None:
            raise UnsupportedOptionError(
                "--lora-targets and --lora-pattern both choose the adapted weights: give "
                "names (--lora-targets query,value) or one regular expression "
                "(--lora-pattern), not both.")
        return args.lora_pattern
    if args.lora_targets is None:
        return None
    names = [name.strip() for value in args.lora_targets for name in value.split(",")]
    if not all(names):
        raise UnsupportedOptionError(
            f"--lora-targets {' '.join(args.lora_targets)!r} has an empty name: list module "
            "or weight names by space or comma (query,value).")
    return "all-linear" if names == ["all-linear"] else names


def _compile(args: argparse.Namespace) -> int:
    loss = None if args.loss == "none" else args.loss
    loss_options = _loss_options(args)
    optimizer = _optimizer(args)
    penalty = _penalty(args, loss)
    untie = None if args.untie is None else args.untie or "auto"  # --untie alone: "auto"
    adapters = _adapters(args)
    if args.format == "ort-artifacts":
        given = [option for option, value in (("--fuse", args.fuse), ("--backend", args.backend),
                                              ("--target", args.target),
                                              ("--accumulation-steps",
                                               args.accumulation_steps != 1),
                                              ("--recompute", args.recompute is not None),
                                              ("--recompute-budget",
                                               args.recompute_budget is not None))
                 if value]
        if given:
            raise UnsupportedOptionError(
                f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --format "
                "program only: onnxruntime's training "
                "artifacts have their own graphs, gradients from lossgraph's onnx backend, and "
                "the opsets of onnxruntime-training 1.19.")
        to_ort_artifacts = _export_function("to_ort_artifacts")
        written = to_ort_artifacts(args.model, args.output, optimizer=optimizer,
                                   weights=args.weights, loss=loss, loss_options=loss_options,
                                   penalty=penalty, fixed_batch=args.fixed_batch, untie=untie,
                                   max_grad_norm=args.max_grad_norm, ema_decay=args.ema_decay,
                                   adapters=adapters)
        print(f"{args.output}: {', '.join(Path(path).name for path in written)}; trains with "
              f"{type(optimizer).__name__} (learning rate {_rate(optimizer)}: "
              "onnxruntime's Optimizer starts at 0.001, set_learning_rate sets it)")
        return EXIT_OK
    program = compile_program(
        args.model, weights=args.weights, loss=loss, loss_options=loss_options, penalty=penalty,
        optimizer=optimizer, backend=args.backend or "onnx", fuse=args.fuse or "step",
        target=args.target, fixed_batch=args.fixed_batch, untie=untie,
        accumulation_steps=args.accumulation_steps, max_grad_norm=args.max_grad_norm,
        ema_decay=args.ema_decay, recompute=_recompute(args.recompute, args.recompute_budget),
        adapters=adapters)
    program.save(args.output)
    for note in program.notes.lines():
        print(f"{args.output}: {note}")
    print(f"{args.output}: {', '.join(sorted(program.graphs))}; trains "
          f"{', '.join(program.weights)} with {type(program.optimizer).__name__} "
          f"(learning rate {_rate(program.optimizer)})")
    if "batch" in program.manifest:
        print(f"the model: {program.manifest['batch']['detail']}")
    return EXIT_OK


def _rate(optimizer: Optimizer) -> str:
    """The learning rate as the summary line shows it: a number, or its schedule."""
    rate = optimizer.learning_rate
    return repr(rate) if isinstance(rate, Schedule) else f"{rate:g}"


def _export_function(name: str) -> Callable[..., Any]:
    """``lossgraph.export.<name>``, or a clear error where it cannot be imported."""
    from .. import export

    try:
        return getattr(export, name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeUnavailableError(
            f"lossgraph.export.{name} is not available in this installation ({exc}).") from None


