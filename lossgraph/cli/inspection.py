"""lossgraph inspect: what a model holds and what of it can be trained."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..analysis import (
    blocked_initializers,
    constant_weights,
    differentiable_values,
    folded_weights,
    influenced_values,
    tied_initializers,
    trainable_initializers,
)
from ..autodiff.registry import differentiable_inputs, find_rule
from ..errors import (
    InvalidModelError,
    LossgraphError,
)
from ..graphs import (
    ForwardFacts,
    all_graphs,
    canonical_domain,
    elem_type_name,
    is_default_domain,
    opset_version,
    outer_references,
    shortest_path,
    subgraphs,
)
from ..models import as_model
from ..opsets import OpsetMove
from ..passes.fixed_batch import GeneralizeBatch, export_calls, rows
from ..passes.loss import AUTO, choose_loss
from ..passes.lower_ml import LOWERED_OPS, lower_ml_ops
from ..passes.opset import ConvertOpset
from ..passes.zipmap import ZipMapToTensor, zipped_outputs
from ..roles import get_roles
from .parser import ML_DOMAIN, _one_line

EXIT_OK = 0

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
    op = f"{node.domain}::{node.op_type}" if not is_default_domain(node.domain) else node.op_type
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
        moved: dict[str, Any] = _opset_report(ConvertOpset()(model).report)
    except LossgraphError as exc:  # compile fails the same way
        moved = {"error": _one_line(str(exc))}
    try:
        lowered = lower_ml_ops(model)
    except InvalidModelError:  # not valid ONNX: nothing more can be told about it
        raise
    except LossgraphError as exc:  # compile fails the same way; the rest still tells
        lowered, lowering = model, _one_line(str(exc))
    else:
        lowering = None
    zipmaps = zipped_outputs(lowered) if lowering is None else {}
    if zipmaps:  # what compile trains: the tensor a ZipMap zips
        lowered = ZipMapToTensor()(lowered).model
    given = {t.name for t in graph.initializer}
    facts = ForwardFacts.of(lowered)
    roles = get_roles(lowered)
    targets = [roles["loss"]] if roles.get("loss") else [o.name for o in lowered.graph.output]
    training = _training_output(lowered) if lowering is None and not roles.get("loss") else None
    candidates = trainable_initializers(lowered)
    blocked = [{"name": b.name, "kind": b.kind, "partial": b.partial,
                "path": [_label(p) if isinstance(p, onnx.NodeProto) else p for p in b.path]}
               for b in blocked_initializers(lowered)]
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
            key = (canonical_domain(node.domain), node.op_type)
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

    tied = [{"name": t.name, "readers": [_label(n) for n, _ in t.readers]}
            for t in tied_initializers(lowered, candidates)]
    folded = [{"name": f.name, "how": f.how} for f in folded_weights(lowered, candidates)]
    constants = [{"name": c.name, "node": c.node.name, "dtype": elem_type_name(c.elem_type),
                  "shape": list(c.dims), "size": int(np.prod(c.dims, dtype=np.int64)),
                  "feeds": _label(c.reader)} for c in constant_weights(lowered)]
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
        "opset": moved,
        "zipmaps": [{"output": output, "tensor": tensor} for output, tensor in zipmaps.items()],
        "training_output": training,
        "inputs": _values(graph.input, given),
        "outputs": _values(graph.output, set()),
        "initializers": initializers,
        "trainable": candidates,
        "tied": tied,
        "folded": folded,
        "constants": constants,
        "blocked": blocked,
        "lowered_ops": sorted({n.op_type for n in graph.node
                               if n.domain == ML_DOMAIN and n.op_type in LOWERED_OPS}),
        "lowering_error": lowering,
        "roles": roles,
        "ops": ops,
        "missing_gradient_rules": missing,
        "fixed_batch": _fixed_batch(lowered),
    }


def _opset_report(move: OpsetMove) -> dict[str, Any]:
    """What compile does with the model's ai.onnx opset, for inspect's report."""
    return {"from": move.source, "to": move.result, "action": move.direction,
            "imported": list(move.imported), "text": str(move)}


def _training_output(model: onnx.ModelProto) -> dict[str, Any]:
    """The output compile trains by default (``--loss auto``) and its loss, or the error
    that choice meets."""
    try:
        choice = choose_loss(model, AUTO)
    except LossgraphError as exc:
        return {"error": _one_line(str(exc))}
    return {"name": choice.output, "holds": choice.kind.kind, "evidence": choice.kind.evidence,
            "loss": choice.loss, "loss_options": dict(choice.options), "text": str(choice)}


def _fixed_batch(model: onnx.ModelProto) -> dict[str, Any] | None:
    """What compile does with the model's fixed batch (None: its batch is free): frees it
    (the constants rewritten) or keeps it (why), and how to export it with a free batch."""
    weights = {t.name for t in model.graph.initializer}
    calls = export_calls([v.name for v in model.graph.input if v.name not in weights],
                         [v.name for v in model.graph.output])
    try:
        result = GeneralizeBatch()(model)
    except LossgraphError as exc:  # inputs that disagree: compile fails the same way
        return {"size": None, "freed": False, "rewrites": [], "reason": _one_line(str(exc)),
                "export": list(calls)}
    report = result.report
    if report is None:
        return None
    return {"size": report.batch, "freed": report.freed,
            "rewrites": [{"node": r.node, "op_type": r.op_type, "value": r.value,
                          "kind": r.kind, "before": list(r.before), "after": list(r.after),
                          "expanded": r.expanded or None, "text": str(r)}
                         for r in report.rewrites],
            "reason": report.reason or None, "export": list(calls)}


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


def _readers_text(readers: Sequence[str], most: int = 3) -> str:
    """The first ``most`` readers, then how many more."""
    more = f" and {len(readers) - most} more" if len(readers) > most else ""
    return ", ".join(readers[:most]) + more


def _op_text(domain: str, op_type: str) -> str:
    return f"{domain}::{op_type}" if domain else op_type


#: ``gradient_rule`` of inspect's op counts, in words.
_RULE_TEXT = {"yes": "yes", "missing": "MISSING (see below)",
              "no": "no (no gradient needs to pass it)",
              "lowered": "lowered into standard ops by compile"}


def _fixed_batch_text(batch: Mapping[str, Any]) -> str:
    """The fixed batch, what compile does with it, and how to export the model again."""
    export = (f"\n  to train any batch size, export the model with a free batch axis:\n"
              f"    {batch['export'][0]}   (torch's default exporter)\n"
              f"    {batch['export'][1]}   (the legacy exporter)")
    if batch["size"] is None:
        return f"\nfixed batch: compile refuses the model: {batch['reason']}{export}"
    size = rows(batch["size"])
    head = (f"\nfixed batch: the inputs fix the batch at {size} (as torch.onnx.export "
            "writes a model without dynamic_shapes or dynamic_axes)")
    if batch["freed"]:
        how = "; ".join(r["text"] for r in batch["rewrites"]) or "no shape constant holds it"
        return (f"{head}; compile frees it, proven from the graph ({how}): the program "
                "trains and predicts any number of rows")
    return (f"{head}; compile keeps it ({batch['reason']}): the program trains in batches of "
            f"exactly {size}, each epoch's remaining rows left out{export}")


def format_inspection(report: Mapping[str, Any]) -> str:
    """:func:`inspect_model`'s report as readable tables."""
    producer = " ".join(filter(None, report["producer"].values())) or "unknown producer"
    opsets = ", ".join(f"{domain} {version}" for domain, version in report["opsets"].items())
    parts = [f"{report['file']}: ONNX IR version {report['ir_version']}, {producer}, opsets "
             f"{opsets}"]
    opset = report["opset"]
    if "error" in opset:
        parts.append(f"its ai.onnx opset is not one the target loads (compile fails the same "
                     f"way): {opset['error']}")
    elif opset["action"] != "kept" or opset["imported"]:
        parts.append(f"compile: {opset['text']}")
    for key in ("inputs", "outputs"):
        parts.append(f"\n{key}\n" + _table(
            ("name", "type", "shape"),
            ((v["name"], v["dtype"], _shape_text(v["shape"])) for v in report[key])))
    if report.get("fixed_batch"):
        parts.append(_fixed_batch_text(report["fixed_batch"]))
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
    for zipmap in report["zipmaps"]:
        parts.append(f"output {zipmap['output']!r} is a ZipMap of {zipmap['tensor']!r} (a list of "
                     "{class: probability} maps, which no loss reads): compile trains and "
                     f"predicts {zipmap['tensor']!r} instead, and the exported model keeps the "
                     "ZipMap")
    training = report["training_output"]
    if training and "error" in training:
        parts.append(f"training output: none by default (compile fails the same way unless "
                     f"--loss or --loss-option output_index=... say): {training['error']}")
    elif training:
        parts.append(f"training output (compile's default, --loss auto): {training['text']}")
    if report["lowering_error"]:
        parts.append(f"the ai.onnx.ml ops cannot be lowered into standard ops (compile fails "
                     f"the same way): {report['lowering_error']}")
    if report["roles"].get("loss"):
        parts.append(f"the model carries its loss {report['roles']['loss']!r} (compile it with "
                     "--loss none); trainable means: reaching the loss")
    if report["trainable"]:
        what = ("compile trains them alone only when --weights names them, see below"
                if report["blocked"] else "what compile trains unless --weights says otherwise")
        parts.append(f"trainable candidates ({what}): {' '.join(report['trainable'])}")
    else:
        parts.append("trainable candidates: none (no float initializer reaches an output "
                     "differentiably)")
    sections = (
        ("tied", "initializers several layers read as their own (torch's exporters merge "
         "equal values, such as a fresh model's LayerNorm scales and zero biases): compile "
         "trains each as one weight those layers share, and warns; compile --untie gives each "
         "layer its own copy", ("initializer", "layers", "read by"),
         lambda t: (t["name"], len(t["readers"]), _readers_text(t["readers"]))),
        ("folded", "weights that are not the module's parameters (torch's exporter folded a "
         "BatchNorm or a parametrization into them, copied a tied tensor, or dropped a zero "
         "bias): compile trains the export as it is, and warns; export with optimize=False "
         "(dynamo) or do_constant_folding=False (legacy) to train the module's parameters",
         ("weight", "what the exporter did"), lambda f: (f["name"], f["how"])),
        ("constants", "float constants that feed a product like a weight (an exporter may "
         "have folded a parameter into one): not trainable: a constant; compile --weights "
         "NAME makes it an initializer and trains it",
         ("constant", "type", "shape", "values", "feeds"),
         lambda c: (c["name"], c["dtype"], _shape_text(c["shape"]), c["size"], c["feeds"])),
        ("blocked", "weights whose effect on the outputs passes values lossgraph does not "
         "differentiate (sequences, optionals): compile chooses no default weights around "
         "them; name the weights to train with --weights", ("weight", "gradient", "path"),
         lambda b: (b["name"], "partial" if b["partial"] else "none",
                    f"{_short_path(b['path'], len(b['path']) - 2)} ({b['kind']})")),
    )
    for key, heading, columns, row in sections:
        if report[key]:
            parts.append(f"\n{heading}\n" + _table(columns, (row(x) for x in report[key])))
    nodes = sum(op["count"] for op in report["ops"])
    parts.append(f"\nops ({nodes} node{'s' * (nodes != 1)})\n" + _table(
        ("op", "count", "gradient rule"),
        ((_op_text(op["domain"], op["op_type"]), op["count"], _RULE_TEXT[op["gradient_rule"]])
         for op in report["ops"])))
    missing = report["missing_gradient_rules"]
    if missing:
        parts.append("\nops without a gradient rule between a trainable weight and an output:\n"
                     "compile fails on them; train other weights (--weights), register a rule "
                     "(lossgraph.grad_rule) or compile with --backend ort\n" + _table(
                         ("op", "node", "path"),
                         ((_op_text(m["domain"], m["op_type"]), m["node"] or "-",
                           _short_path(m["path"], m["at"])) for m in missing)))
    elif report["trainable"] and not report["blocked"]:
        parts.append("\nevery op between the trainable weights and the outputs has a gradient "
                     "rule")
    return "\n".join(parts)


