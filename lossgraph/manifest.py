"""The program manifest: its format, how it is built, and a check of its structure.

A manifest is a JSON object (docs/reference/program.md)::

    {"format": "lossgraph-program/1", "fuse": "step" | "epoch" | "separate",
     "optimizer": {"type": ..., ...}, "roles": {role: tensor},
     "weights": [{"name": w, "new": w_new, "states": [{"name": s, "new": s_new}]}],
     "graphs": {graph: {"file": "<graph>.onnx", "inputs": [io], "outputs": [io]}}}

    io = {"name": str, "role": str, "dtype": numpy dtype name, "shape": [int | str | null]}

A program compiled from a model exported with a fixed batch (torch's default export)
has one more key, ``"batch": {"size": int, "fixed": bool, "detail": str, "loss_reduction":
"mean" | "sum" | null}``: the exported batch size, whether the program keeps it (its
graphs then take batches of exactly ``size`` rows; else the batch was freed), what
compile did, and how the loss reduces rows (how losses of several batches combine).
Other programs are written without it.

A program with buffers (the running statistics of a training-mode BatchNormalization,
:mod:`lossgraph.passes.running_stats`) has the format ``"lossgraph-program/2"`` and one
more key, ``"buffers": [{"name": b, "new": b_new}]``, with the roles ``buffer`` and
``new_buffer`` in its graphs' inputs and outputs. A program without buffers is written
exactly as before (format 1), and both formats are read: a lossgraph that knows no
buffers refuses a program that has them instead of training or exporting it without them.

A program compiled with ``untie`` (:class:`~lossgraph.passes.UntieWeights`) has one more
key, ``"untied": {initializer: [copy, ...]}``: each initializer several layers read and the
copies its layers read instead, all weights of their own. Its graphs and inference model
hold the copies like any weight, so it needs no new format (a lossgraph that does not know
the key trains and exports the program all the same).

A program compiled with ``accumulation_steps=k > 1`` has one more key,
``"accumulation": {"steps": k, "loss_reduction": "mean" | "sum"}``: the micro-batches of
one update a fit takes by default, and how its loss reduces rows (how the gradients of
micro-batches combine into the gradient of their rows' loss). Its fused modes hold the
graphs that accumulate gradients (``train_accumulate``, ``train_step_accumulated`` and,
for ``fuse="epoch"``, ``train_epoch_accumulated`` and ``train_epoch_ordered_accumulated``),
whose inputs and outputs have the roles
``gradient_sum``, ``new_gradient_sum``, ``gradient_scale`` and ``gradient_scales``; the
format stays (a lossgraph that does not know the key trains one batch per update).

A program compiled with ``max_grad_norm`` or ``ema_decay``
(:mod:`lossgraph.update_options`) has the key ``"update": {"max_grad_norm": c,
"ema_decay": d}`` (the options set), and with ``ema_decay`` the key ``"ema": {weight:
state}``: the state of each weight that holds its average (its last state). Its graphs
output the gradients' norm with the role ``grad_norm`` (an epoch graph: ``grad_norms``, one
per update). The graphs compute both, so it needs no new format either.

A program with LoRA adapters (``compile_program(adapters=...)``, or a model
:func:`~lossgraph.add_lora` rewrote) has one more key, ``"adapters": [record, ...]``: each
adapter's :class:`~lossgraph.adapters.Adapter` record (its base weight, module path, tensors
``a`` and ``b``, kind, rank, alpha, layout). The adapters are weights like any other, so it
needs no new format either.

A program compiled with ``recompute`` (:class:`~lossgraph.passes.Recompute`) has one more
key, ``"recompute": {graph: {"boundaries": [...], "kept": [...], "recomputed": [...]}}``:
by training graph, the boundaries, the forward values its backward reads kept, and those
it recomputes. It tells, and changes nothing for a runner (the format stays).

:func:`build_manifest` writes it from a program's graphs and signature;
:func:`check_manifest` proves a manifest read from disk has this shape before anything
trusts it, so a damaged one fails with the key at fault rather than a ``KeyError``
deep inside training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .adapters import Adapter
from .errors import InvalidProgramError, UnsupportedModelError, UnsupportedOptionError
from .modes import MODES
from .optim import Optimizer
from .roles import renamed_roles
from .signature import Signature
from .update_options import UpdateOptions

__all__ = ["FORMAT", "FORMAT_WITH_BUFFERS", "FORMATS", "FUSE_MODES", "REQUIRED_GRAPHS",
           "build_manifest", "check_manifest"]

FORMAT = "lossgraph-program/1"
#: The format of a program with buffers (a manifest with the key "buffers").
FORMAT_WITH_BUFFERS = "lossgraph-program/2"
#: Every format this lossgraph reads.
FORMATS = (FORMAT, FORMAT_WITH_BUFFERS)
#: The fusion modes' names (:data:`lossgraph.modes.MODES`).
FUSE_MODES = tuple(MODES)

#: The graphs a program of each fusion mode must hold: evaluate, predict and the mode's
#: training graphs but its optional ones.
REQUIRED_GRAPHS = {name: ("evaluate", "predict",
                          *(g for g in mode.graphs if g not in mode.optional))
                   for name, mode in MODES.items()}


def _fail(where: str, problem: str) -> InvalidProgramError:
    return InvalidProgramError(f"{where}: {problem}. The program folder is damaged: save it "
                               "again (TrainingProgram.save or lossgraph compile -o).")


def _field(record: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(record, Mapping):
        raise _fail(where, f"expected a JSON object, found {type(record).__name__}")
    if key not in record:
        raise _fail(where, f"the key {key!r} is missing")
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in _kinds(kind):
        names = " or ".join(k.__name__ for k in _kinds(kind))
        raise _fail(where, f"{key!r} must be {names}, found {type(value).__name__}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_io(value: Any, where: str) -> None:
    _field(value, "name", str, where)
    _field(value, "role", str, where)
    dtype = _field(value, "dtype", str, where)
    try:
        np.dtype(dtype)
    except TypeError:
        raise _fail(where, f"dtype {dtype!r} is not a numpy dtype name") from None
    for dim in _field(value, "shape", list, where):
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, (int, str))):
            raise _fail(where, f"shape holds {dim!r}; dims are ints, names or null")


def check_manifest(manifest: Any, where: str = "manifest.json") -> dict[str, Any]:
    """``manifest`` itself, once its structure is proven; else InvalidProgramError.

    The format is checked first, so a manifest of another lossgraph version gets that
    message rather than one about its keys.
    """
    form = _field(manifest, "format", str, where)
    if form not in FORMATS:
        raise InvalidProgramError(
            f"{where}: the program has format {form!r}; this lossgraph reads "
            f"{' and '.join(map(repr, FORMATS))}. Compile the model again with this version "
            "of lossgraph.")
    fuse = _field(manifest, "fuse", str, where)
    if fuse not in FUSE_MODES:
        raise _fail(where, f"fuse is {fuse!r}, not one of {', '.join(FUSE_MODES)}")
    _field(_field(manifest, "optimizer", dict, where), "type", str, f"{where} optimizer")
    roles = _field(manifest, "roles", dict, where)
    manifest["roles"] = roles = renamed_roles(roles)  # a program of the previous release
    for role in ("loss", "label", "prediction"):
        _field(roles, role, str, f"{where} roles")
    for index, weight in enumerate(_field(manifest, "weights", list, where)):
        at = f"{where} weights[{index}]"
        _field(weight, "name", str, at)
        _field(weight, "new", str, at)
        for position, state in enumerate(_field(weight, "states", list, at)):
            _field(state, "name", str, f"{at} states[{position}]")
            _field(state, "new", str, f"{at} states[{position}]")
    if "buffers" in manifest:
        if form != FORMAT_WITH_BUFFERS:
            raise _fail(where, f"a program with buffers has the format {FORMAT_WITH_BUFFERS!r}")
        for index, buffer in enumerate(_field(manifest, "buffers", list, where)):
            _field(buffer, "name", str, f"{where} buffers[{index}]")
            _field(buffer, "new", str, f"{where} buffers[{index}]")
    elif form == FORMAT_WITH_BUFFERS:
        raise _fail(where, f"a {FORMAT_WITH_BUFFERS!r} program lists its buffers, and the key "
                           "'buffers' is missing")
    if "batch" in manifest:
        batch = _field(manifest, "batch", dict, where)
        if _field(batch, "size", int, f"{where} batch") < 1:
            raise _fail(where, "batch size must be >= 1")
        _field(batch, "fixed", bool, f"{where} batch")
        _field(batch, "detail", str, f"{where} batch")
        if _field(batch, "loss_reduction", (str, type(None)), f"{where} batch") not in (
                "mean", "sum", None):
            raise _fail(where, "batch loss_reduction must be 'mean', 'sum' or null")
    for name, copies in _field(manifest, "untied", dict, where).items() \
            if "untied" in manifest else ():
        if not isinstance(copies, list) or not all(isinstance(c, str) for c in copies):
            raise _fail(f"{where} untied[{name!r}]", "expected a list of names")
    if "accumulation" in manifest:
        accumulation = _field(manifest, "accumulation", dict, where)
        if _field(accumulation, "steps", int, f"{where} accumulation") < 1:
            raise _fail(where, "accumulation steps must be >= 1")
        if _field(accumulation, "loss_reduction", str, f"{where} accumulation") not in (
                "mean", "sum"):
            raise _fail(where, "accumulation loss_reduction must be 'mean' or 'sum'")
    _check_update(manifest, where)
    for index, record in enumerate(_field(manifest, "adapters", list, where)
                                   if "adapters" in manifest else ()):
        try:
            Adapter.from_record(record if isinstance(record, dict) else {}, "record")
        except UnsupportedModelError:
            raise _fail(f"{where} adapters[{index}]", "expected an adapter's record (weight, "
                        "module, a, b, kind, rank, alpha, layout)") from None
    graphs = _field(manifest, "graphs", dict, where)
    required = [*REQUIRED_GRAPHS[fuse],
                *(MODES[fuse].accumulating if "accumulation" in manifest else ())]
    missing = [name for name in required if name not in graphs]
    if missing:
        raise _fail(where, f"a fuse={fuse!r} program needs the graphs {', '.join(missing)}")
    for name, entry in graphs.items():
        at = f"{where} graphs[{name!r}]"
        _field(entry, "file", str, at)
        for key in ("inputs", "outputs"):
            for position, value in enumerate(_field(entry, key, list, at)):
                _check_io(value, f"{at} {key}[{position}]")
    return manifest


def _check_update(manifest: Mapping[str, Any], where: str) -> None:
    """The keys ``update`` (options a :class:`UpdateOptions` takes) and ``ema`` (each
    weight's average, one of its states), where present."""
    if "update" in manifest:
        try:
            options = UpdateOptions.from_dict(_field(manifest, "update", dict, where))
        except (TypeError, UnsupportedOptionError) as exc:
            raise _fail(f"{where} update", str(exc).rstrip(".")) from None
        if options.averages != ("ema" in manifest):
            raise _fail(where, "'ema' lists each weight's average exactly when 'update' holds "
                               "ema_decay")
    elif "ema" in manifest:
        raise _fail(where, "'ema' needs 'update' with its ema_decay")
    if "ema" in manifest:
        states = {w.get("name"): [s.get("name") for s in w.get("states", [])]
                  for w in manifest["weights"]}
        ema = _field(manifest, "ema", dict, where)
        if set(ema) != set(states) or any(not states[w] or ema[w] != states[w][-1]
                                           for w in ema):
            raise _fail(f"{where} ema", "each weight maps to its last state, its average")


def build_manifest(graphs: Mapping[str, onnx.ModelProto], signature: Signature,
                   optimizer: Optimizer, fuse: str, roles: Mapping[str, str],
                   graph_roles: Mapping[str, Mapping[str, str]] | None = None,
                   untied: Mapping[str, list[str]] | None = None,
                   batch: Mapping[str, Any] | None = None,
                   accumulation: Mapping[str, Any] | None = None,
                   update: UpdateOptions | None = None,
                   recompute: Mapping[str, Any] | None = None,
                   adapters: Sequence[Adapter] = ()) -> dict[str, Any]:
    """The program's description: graphs with the role of every input and output.

    Roles come from ``signature``; ``graph_roles`` gives, by graph, the roles of the names
    a graph's builder chose (the separate graphs'), which take precedence in that graph;
    ``untied`` the copies of each untied initializer (the key is left out without any).
    ``batch`` is the record of a model exported with a fixed batch, ``accumulation`` that
    of a program compiled to accumulate gradients, ``recompute`` what each graph recomputes
    (module doc); ``update`` the clipping and EMA around the optimizer's update,
    ``adapters`` the LoRA adapters' records (keys left out without).
    """
    role_of = signature.roles()

    def describe(values, own: Mapping[str, str]) -> list[dict[str, Any]]:
        described = []
        for value in values:
            tensor = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tensor.shape.dim]
            role = own.get(value.name) or role_of.get(value.name, "output")
            described.append({"name": value.name, "role": role,
                              "dtype": helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
                              "shape": dims})
        return described

    manifest: dict[str, Any] = {
        "format": FORMAT_WITH_BUFFERS if signature.buffers else FORMAT,
        "fuse": fuse,
        "optimizer": optimizer.to_dict(),
        "roles": dict(roles),
        "weights": [{"name": w, "new": signature.new[w],
                     "states": [{"name": s, "new": signature.new[s]}
                                for s in signature.states.get(w, [])]}
                    for w in signature.weights],
    }
    if signature.buffers:
        manifest["buffers"] = [{"name": b, "new": signature.new[b]} for b in signature.buffers]
    if batch:
        manifest["batch"] = dict(batch)
    if untied:
        manifest["untied"] = {name: list(copies) for name, copies in untied.items()}
    if accumulation:
        manifest["accumulation"] = dict(accumulation)
    if update:
        manifest["update"] = update.to_dict()
    if update and update.averages:
        manifest["ema"] = {w: signature.states[w][-1] for w in signature.weights}
    if recompute:
        manifest["recompute"] = {name: dict(plan) for name, plan in recompute.items()}
    if adapters:
        manifest["adapters"] = [a.to_record() for a in adapters]
    graph_roles = graph_roles or {}
    manifest["graphs"] = {name: {"file": f"{name}.onnx",
                                 "inputs": describe(g.graph.input, graph_roles.get(name, {})),
                                 "outputs": describe(g.graph.output, graph_roles.get(name, {}))}
                          for name, g in graphs.items()}
    return manifest
