"""strip_training: an inference model with nothing of training left in it.

A model lossgraph trains may still carry what only training needs: a loss output with
its label and sample-weight inputs (:class:`~lossgraph.passes.loss.AddLossOutput`),
the roles record, and layers left in training mode. This pass rewrites them::

    (inputs, label[, weight]) -> (loss, outputs)    ->  (inputs) -> (outputs)      RemoveLossOutput
    BatchNormalization(x, s, b, m, v) training_mode=1
        -> (y, running_mean, running_var)           ->  ... training_mode=0 -> (y)
    BatchNormalization (opset 13) -> (y, mean, var, saved_mean, saved_var)
                                                    ->  BatchNormalization -> (y)
    Dropout(x, ratio, training) -> (y[, mask unused])   ->  Identity(x) -> (y)
    Dropout(x, ratio, training) -> (y, mask used)       ->  Dropout(x, ratio, false) -> (y, mask)
    lossgraph.FakeQuantizeLinear(w, s, z)  ->  DequantizeLinear(QuantizeLinear(w, s, z), s, z)

where ``training`` is anything but a constant false (a constant true, a graph input,
a computed flag); a Dropout whose ``training`` is absent or a constant false runs in
inference mode already and is left as it is. The running-statistics outputs of a
BatchNormalization are removed from the graph's outputs when they are there (they are
the training state, not a prediction); any other use of them is an error. The fake
quantization that :class:`~lossgraph.passes.quantization.StraightThroughQuantization`
wrote for training is inlined back into the standard QuantizeLinear/DequantizeLinear
pairs (its function's body), which quantization tools and runtimes recognise. Values,
constants, nodes and graph inputs that only the rewritten nodes read (the ``training``
flag, a Dropout's ``ratio``) go too. The ``lossgraph.roles`` record goes with the loss.

:class:`InferenceMode` does the layers' part alone, keeping the loss (an eval graph).

A model that records gradients or a training graph's signature (``lossgraph.gradients``,
``lossgraph.signature``) is a training graph, not a model with a loss: it is refused
with the way to export its inference model instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff.rules.quantization import FAKE_QUANTIZE, FAKE_QUANTIZE_DOMAIN
from ..errors import UnsupportedModelError
from ..graphs import all_graphs, attribute_value, is_default_domain, is_onnx_op, tensor_array
from ..metadata import GRADIENTS_KEY, ROLES_KEY, SIGNATURE_KEY, read_text, remove_record
from ..models import ModelLike
from ..names import NameAuthority
from ..roles import get_roles
from .contract import Pass, PassResult
from .loss import RemoveLossOutput

__all__ = ["InferenceMode", "StripTraining", "strip_training"]

#: Metadata that marks a training graph, which this pass refuses (see the module docstring).
_TRAINING_GRAPH_KEYS = (GRADIENTS_KEY, SIGNATURE_KEY)


@dataclass(frozen=True)
class StripTraining(Pass[dict[str, Any]]):
    """Remove the loss, its inputs and the roles record; put BatchNormalization and Dropout
    in inference mode (see the module docstring).

    The report says what went: ``{"loss": name or None, "metadata": [keys],
    "inference_mode": [nodes], "identity": [nodes], "inputs": [names], "outputs": [names],
    "nodes": [names], "initializers": [names], "inlined": [fake-quantization nodes]}``,
    nodes named by name (or ``op_type#index`` in their graph when unnamed).
    """

    def call(self, model: onnx.ModelProto) -> PassResult:
        report = _strip(model)
        return PassResult(model, report, changed=any(report.values()))


@dataclass(frozen=True)
class InferenceMode(Pass[dict[str, Any]]):
    """Put BatchNormalization and Dropout in inference mode and nothing else: the loss, its
    inputs and the roles stay (an eval graph, with the loss, runs this; see the module
    docstring for the rewrites). The report has :class:`StripTraining`'s keys but
    ``loss`` and ``metadata``."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        report: dict[str, Any] = {"inference_mode": [], "identity": [], "inputs": [],
                                  "outputs": [], "nodes": [], "initializers": []}
        _to_inference_mode(model, report)
        return PassResult(model, report, changed=any(report.values()))


def strip_training(model: ModelLike) -> onnx.ModelProto:
    """``model`` with nothing of training left (:class:`StripTraining`)."""
    return StripTraining()(model).model


def _strip(model: onnx.ModelProto) -> dict[str, Any]:
    for key in _TRAINING_GRAPH_KEYS:
        if read_text(model, key) is not None:
            raise UnsupportedModelError(
                f"The model records {key!r}: it is a training graph (weights as inputs, "
                "gradients or an optimizer's update), not an inference model with a loss. "
                "Export the inference model from its training program instead: "
                "lossgraph.export.to_inference_model(program or trainer or program folder).")
    report: dict[str, Any] = {"loss": None, "metadata": [], "inference_mode": [],
                              "identity": [], "inputs": [], "outputs": [], "nodes": [],
                              "initializers": [], "inlined": []}
    roles = get_roles(model)
    if read_text(model, ROLES_KEY) is not None:
        report["metadata"].append(ROLES_KEY)
    if "loss" in roles:
        inputs, outputs = list(model.graph.input), list(model.graph.output)
        RemoveLossOutput().call(model)  # the roles record goes with the loss
        report["loss"] = roles["loss"]
        for key, values, kept in (("inputs", inputs, model.graph.input),
                                  ("outputs", outputs, model.graph.output)):
            left = {v.name for v in kept}
            report[key].extend(v.name for v in values if v.name not in left)
    remove_record(model, ROLES_KEY)
    _to_inference_mode(model, report)
    report["inlined"] = _inline_fake_quantization(model)
    return report


def _inline_fake_quantization(model: onnx.ModelProto) -> list[str]:
    """Replace lossgraph's FakeQuantizeLinear nodes by their body, in place; their names."""
    key = (FAKE_QUANTIZE_DOMAIN, FAKE_QUANTIZE)
    fake = [node.name for graph in all_graphs(model.graph) for node in graph.node
            if (node.domain, node.op_type) == key]
    if not fake:
        return []
    if not any((f.domain, f.name) == key for f in model.functions):
        raise UnsupportedModelError(
            f"The model has {FAKE_QUANTIZE_DOMAIN}.{FAKE_QUANTIZE} nodes ({', '.join(fake[:3])})"
            " but not the function that defines them: run StraightThroughQuantization on the "
            "model itself, which declares it.")
    model.CopyFrom(onnx.inliner.inline_selected_functions(model, [key]))
    kept = [f for f in model.functions if (f.domain, f.name) != key]
    del model.functions[:]
    model.functions.extend(kept)
    if not any(f.domain == FAKE_QUANTIZE_DOMAIN for f in kept):
        imports = [o for o in model.opset_import if o.domain != FAKE_QUANTIZE_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(imports)
    return fake


def _to_inference_mode(model: onnx.ModelProto, report: dict[str, Any]) -> None:
    """Put every BatchNormalization and Dropout in inference mode, in place, then remove
    what only their training mode read; ``report`` lists what changed and went."""
    before = _referenced(model)
    authority = NameAuthority.for_model(model)
    constants = _constant_values(model)
    read = _read_anywhere(model)
    false_flag: list[str] = []  # the one constant false, made when first needed

    def inference_flag() -> str:
        if not false_flag:
            false_flag.append(authority.fresh("inference_mode"))
            model.graph.initializer.append(
                numpy_helper.from_array(np.array(False), false_flag[0]))
        return false_flag[0]

    for position, graph in enumerate(all_graphs(model.graph)):  # the main graph first
        used = read | {o.name for o in graph.output}
        for index, node in enumerate(graph.node):
            label = node.name or f"{node.op_type}#{index}"
            if not is_default_domain(node.domain):
                continue
            if node.op_type == "BatchNormalization":
                if _batch_norm_to_inference(graph, position == 0, node, label, read, report):
                    report["inference_mode"].append(label)
            elif node.op_type == "Dropout":
                action = _dropout_to_inference(node, constants, used, inference_flag)
                if action:
                    report[action].append(label)
    _prune_orphans(model, before, report)


def _batch_norm_to_inference(graph: onnx.GraphProto, main: bool, node: onnx.NodeProto,
                             label: str, read: set[str], report: dict[str, Any]) -> bool:
    """Drop a BatchNormalization's running-statistics outputs and its training mode; True
    when the node ran in training mode. ``main``: ``graph`` is the model's main graph."""
    training = bool(attribute_value(node, "training_mode", 0))
    extra = [name for name in node.output[1:] if name]
    if not training and not extra:
        return False
    for name in extra:
        if name in read:
            raise UnsupportedModelError(
                f"BatchNormalization node {label!r} runs in training mode and another node "
                f"reads its running statistic {name!r}; in inference mode the node has no such "
                "output. Remove that use from the model (the statistics are training state).")
        if name in {o.name for o in graph.output}:
            if not main:
                raise UnsupportedModelError(
                    f"BatchNormalization node {label!r} in a subgraph returns its running "
                    f"statistic {name!r} as a subgraph output, which inference mode does not "
                    "have. Remove that output from the model.")
            kept = [o for o in graph.output if o.name != name]
            del graph.output[:]
            graph.output.extend(kept)
            report["outputs"].append(name)
    del node.output[1:]
    for attribute in node.attribute:
        if attribute.name == "training_mode":
            attribute.i = 0
    return True


def _dropout_to_inference(node: onnx.NodeProto, constants: dict[str, np.ndarray],
                          used: set[str], inference_flag: Any) -> str | None:
    """Put a Dropout that may run in training mode in inference mode: an Identity when its
    mask is unused (``"identity"``), else a constant false flag (``"inference_mode"``)."""
    training = node.input[2] if len(node.input) > 2 else ""
    if not training:
        return None
    value = constants.get(training)
    if value is not None and value.size and not bool(value.reshape(-1)[0]):
        return None
    mask = node.output[1] if len(node.output) > 1 else ""
    if mask and mask in used:
        node.input[2] = inference_flag()
        return "inference_mode"
    identity = helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name,
                                doc_string=node.doc_string)
    identity.metadata_props.extend(node.metadata_props)
    node.CopyFrom(identity)
    return "identity"


def _constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The values of the Dropout nodes' ``training`` flags that are constants: initializers
    or Constant nodes, in any graph (nothing else is decoded)."""
    flags = {node.input[2] for graph in all_graphs(model.graph) for node in graph.node
             if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]}
    values: dict[str, np.ndarray] = {}
    for graph in all_graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.name in flags:
                values[tensor.name] = tensor_array(tensor)
        for node in graph.node:
            if (is_onnx_op(node, "Constant") and node.attribute
                    and node.output[0] in flags):
                attribute = node.attribute[0]
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
                elif attribute.name in ("value_int", "value_ints", "value_float", "value_floats"):
                    values[node.output[0]] = np.array(helper.get_attribute_value(attribute))
    return values


def _read_anywhere(model: onnx.ModelProto) -> set[str]:
    """Every value some node reads, in any graph."""
    return {name for graph in all_graphs(model.graph) for node in graph.node
            for name in node.input if name}


def _referenced(model: onnx.ModelProto) -> set[str]:
    """Every value a node reads or a graph returns, in any graph."""
    return _read_anywhere(model) | {o.name for graph in all_graphs(model.graph)
                                    for o in graph.output}


def _prune_orphans(model: onnx.ModelProto, before: set[str], report: dict[str, Any]) -> None:
    """Remove what the rewrites left unread: nodes, initializers, the main graph's inputs
    (and their value_info) that something read before and nothing reads now. What was
    unread before the pass stays: it is the model's own business."""
    while True:
        referenced = _referenced(model)
        orphaned = before - referenced
        removed = False
        for graph in list(all_graphs(model.graph)):
            dead = [index for index, node in enumerate(graph.node)
                    if any(node.output) and all(o in orphaned for o in node.output if o)]
            if dead:
                report["nodes"].extend(graph.node[i].name or f"{graph.node[i].op_type}#{i}"
                                       for i in dead)
                kept = [node for i, node in enumerate(graph.node) if i not in dead]
                del graph.node[:]
                graph.node.extend(kept)
                removed = True
        if not removed:
            break
    gone = before - _referenced(model)
    for depth, graph in enumerate(all_graphs(model.graph)):
        for field, key in (("initializer", "initializers"),
                           *((("input", "inputs"),) if depth == 0 else ())):
            values = getattr(graph, field)
            report[key].extend(v.name for v in values if v.name in gone)
            kept = [v for v in values if v.name not in gone]
            del values[:]
            values.extend(kept)
        info = [v for v in graph.value_info if v.name not in gone]
        del graph.value_info[:]
        graph.value_info.extend(info)
