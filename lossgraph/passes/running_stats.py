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
the weights), and rewrites each training-mode node into standard ops that any runtime
runs alike::

    y[, running_mean', running_var'[, saved_mean, saved_var]] = BatchNormalization<training>(
        x, scale, B, running_mean, running_var)
 -> mean = ReduceMean(x), var = ReduceMean((x - mean)^2)       (biased: the normalization's)
    y = BatchNormalization<inference>(x, scale, B, mean, var)
    running_mean_new, running_var_new = the update above        (new graph outputs)

The normalization is the training-mode one to the formula (``y`` uses the batch mean and
the biased batch variance, as ONNX and torch both do), and its gradient flows through the
batch statistics to ``x``. onnxruntime's training-mode kernel is not run: it writes its
running statistics into the buffers of its inputs, in place (the live state the runner
bound, and after onnxruntime's constant sharing any equal initializer, such as a scale of
ones), it requires both running-statistics outputs, and it crashed on a node with only
one of them (1.19 and 1.32).

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
from onnx import helper

from ..builder import GraphBuilder
from ..errors import UnsupportedModelError
from ..graphs import ForwardFacts, all_graphs, attribute_value, np_dtype, opset_version
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
    return node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


@dataclass(frozen=True)
class RunningStatistics(Pass):
    """Rewrite each training-mode BatchNormalization into batch statistics and an
    inference-mode node, and add its running statistics' update as outputs (see the module
    docstring). The running statistics must be graph inputs; the report is
    ``{buffer: new output}``, in the order of :func:`buffer_names`."""

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
        b = GraphBuilder(names, opset_version(model) or 13, prefix="batch_norm/")
        rewritten = {stats.index: stats for stats in found}
        nodes: list[onnx.NodeProto] = []
        dropped: set[str] = set()
        new: dict[str, str] = {}
        for index, node in enumerate(graph.node):
            stats = rewritten.get(index)
            if stats is None:
                nodes.append(node)
                continue
            batch_mean, batch_var, running = _statistics(b, facts, stats)
            for buffer, value in zip((stats.mean, stats.var), running):
                new[buffer] = b.rename(value, names.fresh(f"{buffer}_new"))
            nodes.extend(b.nodes)
            b.nodes = []
            dropped.update(name for name in node.output[1:] if name)
            node.input[3], node.input[4] = batch_mean, batch_var
            del node.output[1:]
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            nodes.append(node)
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
        write_json(model, BUFFERS_KEY, new)
        return PassResult(model, new)


def _statistics(b: GraphBuilder, facts: ForwardFacts, stats: BatchNormStatistics
                ) -> tuple[str, str, tuple[str, str]]:
    """The batch mean and biased variance (what the node normalizes with) and the running
    mean and variance after this batch (module docstring), in the type of the running
    statistics."""
    x = stats.x
    shape = facts.shapes.get(x)
    if shape is None or len(shape) < 2:
        raise UnsupportedModelError(
            f"BatchNormalization node {stats.node!r} runs in training mode, but the rank of its "
            f"input {x!r} is unknown (or below 2): lossgraph needs it to compute the batch "
            "statistics over every axis but the channel axis 1. Give the model's inputs "
            "shapes (a fixed rank).")
    dtype = np_dtype(facts.elem_types[x])
    kind = facts.elem_types[stats.mean]
    axes = [0, *range(2, len(shape))]
    kept = b.reduce("ReduceMean", x, axes, keepdims=1, hint=f"{x}_batch_mean")
    centered = b.Sub(x, kept, hint=f"{x}_centered")
    variance = b.reduce("ReduceMean", b.Mul(centered, centered), axes, keepdims=0,
                        hint=f"{x}_batch_var")
    mean = b.Reshape(kept, b.ints([-1], "flat"), hint=f"{x}_batch_mean")
    count = _count(b, x, [shape[a] for a in axes], dtype)
    unbiased = b.Mul(variance, b.Div(count, b.Sub(count, b.const(1.0, dtype, "one"))),
                     hint=f"{x}_unbiased_var")
    if kind != facts.elem_types[x]:
        mean, variance, unbiased = (b.Cast(v, to=kind) for v in (mean, variance, unbiased))
    dtype = np_dtype(kind)
    m = b.const(stats.momentum, dtype, "momentum")
    rest = b.const(1.0 - stats.momentum, dtype, "one_minus_momentum")
    running = tuple(b.Add(b.Mul(old, m), b.Mul(batch, rest))
                    for old, batch in ((stats.mean, mean), (stats.var, unbiased)))
    return mean, variance, (running[0], running[1])


def _count(b: GraphBuilder, x: str, dims: list, dtype: np.dtype) -> str:
    """The number of elements per channel, ``n``, as a scalar of ``dtype``: a constant when
    the dims are static, else ``Size(x) / Shape(x)[1]``."""
    if all(isinstance(d, int) and d > 0 for d in dims):
        return b.const(float(np.prod(dims)), dtype, "count")
    channels = b.Gather(b.Shape(x), b.const(1, np.int64, "channel_axis"), axis=0)
    return b.Cast(b.Div(b.Size(x), channels), to=helper.np_dtype_to_tensor_dtype(dtype),
                  hint="count")
