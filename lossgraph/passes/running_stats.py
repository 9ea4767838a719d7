"""RunningStatistics: a training-mode BatchNormalization as training graphs run it, its
running mean and variance updated every step exactly as torch updates them.

A BatchNormalization in training mode (opset 14 and later: ``training_mode=1``; opsets
9-13: more than one output, as torch's training-mode export writes them) normalizes
with the batch's statistics; its running mean and variance (inputs 3 and 4) are what
inference normalizes with. Training updates them every step::

    running_mean_new = m running_mean + (1 - m) mean(x)
    running_var_new  = m running_var  + (1 - m) var(x) n / (n - 1)

over every axis of ``x`` but the channel axis 1, ``n`` elements per channel, ``m`` the
node's ``momentum`` attribute (default 0.9; torch's ``momentum`` is ``1 - m``, 0.1 by
default), read as the shortest decimal its float32 stands for (0.9, not 0.8999999762), so
that ``1 - m`` is torch's 0.1. The variance is the **unbiased** one, as torch's running
variance. The ONNX specification's own ``running_var`` output (its reference
implementation, and onnxruntime's kernel, measured on 1.19 and 1.32) takes the biased one.

These values are the program's **buffers**: state that the training graphs read as
inputs and write as outputs each step, like an optimizer's states but without gradients
and untouched by the optimizer. The pass takes a model whose running statistics are
graph inputs already (:class:`~lossgraph.passes.weights.WeightsToInputs` lifts them with
the weights), and rewrites each training-mode node into one node of a function the model
defines, ``lossgraph.BatchNormalizationTraining``, whose body is standard ops that any
runtime runs alike::

    y[, running_mean', running_var'[, saved_mean, saved_var]] = BatchNormalization<training>(
        x, scale, B, running_mean, running_var)
 -> y, mean, var = lossgraph.BatchNormalizationTraining(x, scale, B)
        body: mean = ReduceMean(x), var = ReduceMean((x - mean)^2)     (biased: the
              y = BatchNormalization<inference>(x, scale, B, mean, var)  normalization's)
    running_mean_new, running_var_new = the update above        (new graph outputs)

The normalization is the training-mode one to the formula (``y`` uses the batch mean and
the biased batch variance, as ONNX and torch both do); the node also outputs the batch
statistics, in x's type (the mean with the reduced axes kept, the variance per channel),
which the update reads. onnxruntime inlines the body: the forward runs exactly those ops.
The gradient pass differentiates the node by its own rule (``lossgraph.autodiff.rules.nn``):
training-mode BatchNormalization's closed form, six full-size kernels that read the
forward's statistics, instead of the chain rule through the body's ops (the inference-mode
rule, then the statistics' ReduceMean, Sub and Mul). onnxruntime's training-mode kernel is
not run: it writes its running statistics into the buffers of its inputs, in place (the
live state the runner bound, and after onnxruntime's constant sharing any equal
initializer, such as a scale of ones), it requires both running-statistics outputs, and it
crashed on a node with only one of them (1.19 and 1.32). The function is in the training
graphs only: the evaluate and predict graphs and the exported inference model run the
model's BatchNormalization in inference mode.

The node's own statistics outputs go: a graph output among them is removed, a node reading
one is refused. The new outputs are recorded under :data:`~lossgraph.metadata.BUFFERS_KEY`
(``{buffer: new output}``) for the fusion passes, and reported. :func:`running_statistics`
names what the pass rewrites and refuses, naming the node at fault, what lossgraph does
not update: a training-mode BatchNormalization inside a subgraph, a running statistic
shared by two nodes (or the mean and variance of one node) or read by any other node, and
a statistics output read by another node. :func:`buffer_names` also requires the running
statistics to be initializers of the main graph; the pass, an input of known rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from ..autodiff.rules.nn import TRAINING_BATCH_NORM, TRAINING_BATCH_NORM_DOMAIN
from ..builder import GraphBuilder
from ..errors import UnsupportedModelError
from ..graphs import ForwardFacts, all_graphs, attribute_value, is_onnx_op, np_dtype, opset_version
from ..metadata import BUFFERS_KEY, write_json
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["RunningStatistics", "BatchNormStatistics", "running_statistics", "buffer_names",
           "in_training_mode"]


@dataclass(frozen=True)
class BatchNormStatistics:
    """One training-mode BatchNormalization of the main graph and its running statistics."""

    index: int  # its position in the main graph
    node: str  # its name, or ``BatchNormalization#<index>`` when unnamed
    x: str
    mean: str
    var: str
    momentum: float


def in_training_mode(node: onnx.NodeProto, opset: int) -> bool:
    """Whether a BatchNormalization node normalizes with batch statistics: ``training_mode=1``
    from opset 14, more than one output before (the opset 9-13 training form)."""
    if opset >= 14:
        return bool(attribute_value(node, "training_mode", 0))
    return any(node.output[1:])


def running_statistics(model: onnx.ModelProto) -> list[BatchNormStatistics]:
    """The training-mode BatchNormalization nodes of ``model`` whose running statistics
    training updates, in graph order; what lossgraph cannot update is an
    :class:`~lossgraph.errors.UnsupportedModelError` (see the module docstring)."""
    opset = opset_version(model) or 1
    graph = model.graph
    for position, sub in enumerate(all_graphs(graph)):
        if position == 0:
            continue
        for index, node in enumerate(sub.node):
            if _is_batch_norm(node) and in_training_mode(node, opset):
                raise UnsupportedModelError(
                    f"BatchNormalization node {_label(node, index)!r} in the subgraph "
                    f"{sub.name!r} runs in training mode: lossgraph updates the running "
                    "statistics of the main graph's BatchNormalization only. Export the model "
                    "with that layer outside the loop or branch, or in inference mode.")
    found: list[BatchNormStatistics] = []
    owner: dict[str, str] = {}
    for index, node in enumerate(graph.node):
        if not (_is_batch_norm(node) and in_training_mode(node, opset)):
            continue
        label = _label(node, index)
        mean, var = node.input[3], node.input[4]
        for name, what in ((mean, "running mean"), (var, "running variance")):
            if name in owner:
                raise UnsupportedModelError(
                    f"BatchNormalization node {label!r} reads {name!r} as its {what}, which "
                    f"{owner[name]} reads too: each training-mode BatchNormalization needs "
                    "running statistics of its own, updated from its own batch. Give each "
                    "layer its own initializers (an exporter may merge equal ones: make them "
                    "differ before export).")
            owner[name] = f"node {label!r}"
        found.append(BatchNormStatistics(index, label, node.input[0], mean, var,
                                         _decimal(attribute_value(node, "momentum", 0.9))))
    if found:
        _check_no_other_reader(model, found)
    return found


def _decimal(value: float) -> float:
    """The shortest decimal that a float attribute (stored as float32) reads back as: the
    exporter's 0.9 rather than 0.8999999761581421, so that ``1 - m`` is torch's 0.1 too."""
    return float(str(np.float32(value)))


def buffer_names(model: onnx.ModelProto) -> list[str]:
    """The buffers of ``model``: each training-mode BatchNormalization's running mean, then
    its running variance, in graph order (:func:`running_statistics`). Each must be an
    initializer of the main graph (the model stores it; training lifts it to an input)."""
    stored = {t.name for t in model.graph.initializer}
    names = []
    for stats in running_statistics(model):
        for name, what in ((stats.mean, "running mean"), (stats.var, "running variance")):
            if name not in stored:
                raise UnsupportedModelError(
                    f"BatchNormalization node {stats.node!r} runs in training mode, and its "
                    f"{what} {name!r} is not an initializer of the main graph (a graph input "
                    "or a computed value): lossgraph updates running statistics that the model "
                    "stores. Store it as an initializer, or export the layer in inference "
                    "mode.")
            names.append(name)
    return names


def _check_no_other_reader(model: onnx.ModelProto, found: list[BatchNormStatistics]) -> None:
    """Only its own BatchNormalization reads a running statistic (as input 3 or 4), and no
    node reads a training-mode node's statistics outputs."""
    owners = {name: stats.node for stats in found for name in (stats.mean, stats.var)}
    outputs = {name: stats.node for stats in found
               for name in model.graph.node[stats.index].output[1:] if name}
    for graph in all_graphs(model.graph):
        for index, node in enumerate(graph.node):
            label = _label(node, index)
            for position, name in enumerate(node.input):
                if name in outputs:
                    raise UnsupportedModelError(
                        f"Node {label!r} ({node.op_type}) reads {name!r}, a statistics output "
                        f"of the training-mode BatchNormalization {outputs[name]!r}: lossgraph "
                        "keeps the running statistics as training state and runs the node "
                        "without those outputs. Remove that use from the model.")
                owner = owners.get(name)
                if owner is None or (graph is model.graph and position in (3, 4)
                                     and owner == label and _is_batch_norm(node)):
                    continue
                raise UnsupportedModelError(
                    f"Node {label!r} ({node.op_type}) reads {name!r}, a running statistic of "
                    f"the training-mode BatchNormalization {owner!r}, which training updates "
                    "every step: remove that use, or give that node a copy of its own.")


def _is_batch_norm(node: onnx.NodeProto) -> bool:
    return is_onnx_op(node, "BatchNormalization")


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


@dataclass(frozen=True)
class RunningStatistics(Pass[dict[str, str]]):
    """Rewrite each training-mode BatchNormalization into a
    ``lossgraph.BatchNormalizationTraining`` node (normalization by the batch statistics,
    which it outputs too), and add its running statistics' update as outputs (see the module
    docstring). The running statistics must be graph inputs; the report is ``{buffer: new
    output}``, in the order of :func:`buffer_names`."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        found = running_statistics(model)
        if not found:
            return PassResult(model, {}, changed=False)
        graph = model.graph
        inputs = {i.name: i for i in graph.input}
        constant = [name for stats in found for name in (stats.mean, stats.var)
                    if name not in inputs]
        if constant:
            raise UnsupportedModelError(
                f"RunningStatistics updates running statistics that are graph inputs, and "
                f"{constant[0]!r} is not one: lift them first (WeightsToInputs with the names "
                "lossgraph.passes.running_stats.buffer_names gives).")
        facts = ForwardFacts.of(model)
        names = NameAuthority.for_model(model)
        opset = opset_version(model) or 13
        b = GraphBuilder(names, opset, prefix="batch_norm/")
        rewritten = {stats.index: stats for stats in found}
        nodes: list[onnx.NodeProto] = []
        dropped: set[str] = set()
        new: dict[str, str] = {}
        for index, node in enumerate(graph.node):
            stats = rewritten.get(index)
            if stats is None:
                nodes.append(node)
                continue
            normalization = _batch_statistics_normalization(names, facts, node, stats)
            nodes.append(normalization)
            running = _running_update(b, facts, stats, *normalization.output[1:3])
            for buffer, value in zip((stats.mean, stats.var), running):
                new[buffer] = b.rename(value, names.fresh(f"{buffer}_new"))
            nodes.extend(b.nodes)
            b.nodes = []
            dropped.update(name for name in node.output[1:] if name)
        del graph.node[:]
        graph.node.extend(nodes)
        b.append_to(graph)  # the constants
        kept = [o for o in graph.output if o.name not in dropped]
        del graph.output[:]
        graph.output.extend(kept)
        graph.output.extend(helper.make_value_info(new[buffer], inputs[buffer].type)
                            for buffer in new)
        info = [v for v in graph.value_info if v.name not in dropped]
        del graph.value_info[:]
        graph.value_info.extend(info)
        _declare_function(model, opset)
        write_json(model, BUFFERS_KEY, new)
        return PassResult(model, new)


def _batch_statistics_normalization(names: NameAuthority, facts: ForwardFacts,
                                    node: onnx.NodeProto, stats: BatchNormStatistics
                                    ) -> onnx.NodeProto:
    """The node ``y, mean, var = lossgraph.BatchNormalizationTraining(x, scale, B)`` that
    replaces the training-mode ``node``: its name, output ``y`` and attributes (but
    ``training_mode``), the axes of its statistics and the running statistics' type."""
    x = stats.x
    shape = facts.shapes.get(x)
    if shape is None or len(shape) < 2:
        raise UnsupportedModelError(
            f"BatchNormalization node {stats.node!r} runs in training mode, but the rank of its "
            f"input {x!r} is unknown (or below 2): lossgraph needs it to compute the batch "
            "statistics over every axis but the channel axis 1. Give the model's inputs "
            "shapes (a fixed rank).")
    outputs = [node.output[0], names.fresh(f"{x}_batch_mean"), names.fresh(f"{x}_batch_var")]
    normalization = helper.make_node(
        TRAINING_BATCH_NORM, list(node.input[:3]), outputs, name=node.name,
        domain=TRAINING_BATCH_NORM_DOMAIN, doc_string=node.doc_string,
        axes=[0, *range(2, len(shape))], statistics_type=facts.elem_types[stats.mean])
    normalization.attribute.extend(a for a in node.attribute if a.name != "training_mode")
    normalization.metadata_props.extend(node.metadata_props)
    return normalization


def _running_update(b: GraphBuilder, facts: ForwardFacts, stats: BatchNormStatistics,
                    mean: str, variance: str) -> tuple[str, str]:
    """The running mean and variance after this batch (module docstring), in their type,
    from the batch ``mean`` (axes kept) and biased ``variance`` (per channel), in x's type."""
    x = stats.x
    shape = facts.shapes[x]
    dtype = np_dtype(facts.elem_types[x])
    kind = facts.elem_types[stats.mean]
    count = _count(b, x, [shape[a] for a in (0, *range(2, len(shape)))], dtype)
    mean = b.Reshape(mean, b.ints([-1], "flat"), hint=f"{x}_batch_mean")
    unbiased = b.Mul(variance, b.Div(count, b.Sub(count, b.const(1.0, dtype, "one"))),
                     hint=f"{x}_unbiased_var")
    if kind != facts.elem_types[x]:
        mean, unbiased = (b.Cast(v, to=kind) for v in (mean, unbiased))
    dtype = np_dtype(kind)
    m = b.const(stats.momentum, dtype, "momentum")
    rest = b.const(1.0 - stats.momentum, dtype, "one_minus_momentum")
    running = tuple(b.Add(b.Mul(old, m), b.Mul(batch, rest))
                    for old, batch in ((stats.mean, mean), (stats.var, unbiased)))
    return running[0], running[1]


def _declare_function(model: onnx.ModelProto, opset: int) -> None:
    """The function ``lossgraph.BatchNormalizationTraining(x, scale, B) -> (y, mean, var)``
    (module docstring), once per model; its attributes: ``axes`` (ints), ``statistics_type``
    (the running statistics' element type) and BatchNormalization's at ``opset`` but
    ``training_mode``, passed on by reference. The statistics reach the BatchNormalization
    cast to the running statistics' type (as the running update reads them); where that is
    x's type, onnxruntime removes the Cast (measured on 1.19 and 1.32)."""
    if not any(o.domain == TRAINING_BATCH_NORM_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(TRAINING_BATCH_NORM_DOMAIN, 1))
    if any((f.domain, f.name) == (TRAINING_BATCH_NORM_DOMAIN, TRAINING_BATCH_NORM)
           for f in model.functions):
        return
    schema = onnx.defs.get_schema("BatchNormalization", opset)
    passed = [(name, attribute.type) for name, attribute in sorted(schema.attributes.items())
              if name != "training_mode"]
    axes = _by_reference(helper.make_node("Constant", [], ["axes"]),
                         ("value_ints", "axes", onnx.AttributeProto.INTS))
    statistics_type = ("to", "statistics_type", onnx.AttributeProto.INT)
    body = [
        *([axes] if opset >= 18 else []),
        _reduce_mean("x", "mean", opset, keepdims=1),
        helper.make_node("Sub", ["x", "mean"], ["centered"]),
        helper.make_node("Mul", ["centered", "centered"], ["squares"]),
        _reduce_mean("squares", "var", opset, keepdims=0),
        helper.make_node("Constant", [], ["flat"],
                         value=numpy_helper.from_array(np.array([-1], np.int64))),
        helper.make_node("Reshape", ["mean", "flat"], ["mean_per_channel"]),
        _by_reference(helper.make_node("Cast", ["mean_per_channel"], ["mean_as_statistics"]),
                      statistics_type),
        _by_reference(helper.make_node("Cast", ["var"], ["var_as_statistics"]), statistics_type),
        _by_reference(helper.make_node(
            "BatchNormalization", ["x", "scale", "B", "mean_as_statistics", "var_as_statistics"],
            ["y"]), *((name, name, kind) for name, kind in passed)),
    ]
    model.functions.append(helper.make_function(
        TRAINING_BATCH_NORM_DOMAIN, TRAINING_BATCH_NORM, ["x", "scale", "B"],
        ["y", "mean", "var"], body, [helper.make_opsetid("", opset)],
        attributes=["axes", "statistics_type", *(name for name, _ in passed)],
        doc_string="BatchNormalization of x by its batch mean and biased variance over axes "
                   "(every axis but the channel axis 1), which it outputs too, in x's type (the "
                   "mean with the axes kept, the variance per channel): a training-mode "
                   "BatchNormalization as lossgraph's training programs run it "
                   "(lossgraph.passes.running_stats)"))


def _by_reference(node: onnx.NodeProto, *references: tuple[str, str, int]) -> onnx.NodeProto:
    """``node`` with attributes ``(name, function attribute, type)`` taken from the call."""
    node.attribute.extend(onnx.AttributeProto(name=name, ref_attr_name=ref, type=kind)
                          for name, ref, kind in references)
    return node


def _reduce_mean(value: str, output: str, opset: int, keepdims: int) -> onnx.NodeProto:
    """ReduceMean over the function's ``axes``: from opset 18 an input (the body's Constant
    ``axes``), before an attribute."""
    if opset >= 18:
        return helper.make_node("ReduceMean", [value, "axes"], [output], keepdims=keepdims)
    return _by_reference(helper.make_node("ReduceMean", [value], [output], keepdims=keepdims),
                         ("axes", "axes", onnx.AttributeProto.INTS))


def _count(b: GraphBuilder, x: str, dims: list, dtype: np.dtype) -> str:
    """The number of elements per channel, ``n``, as a scalar of ``dtype``: a constant when
    the dims are static, else ``Size(x) / Shape(x)[1]``."""
    if all(isinstance(d, int) and d > 0 for d in dims):
        return b.const(float(np.prod(dims)), dtype, "count")
    channels = b.Gather(b.Shape(x), b.const(1, np.int64, "channel_axis"), axis=0)
    return b.Cast(b.Div(b.Size(x), channels), to=helper.np_dtype_to_tensor_dtype(dtype),
                  hint="count")
