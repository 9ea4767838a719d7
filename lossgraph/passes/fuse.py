"""Fusion: one training graph per step, or per epoch.

``step_graph`` turns a loss model with gradients (weights as inputs) into

    (features, label[, sample_weight], learning_rate, step, weights..., states...)
        -> (loss, <w>_new..., <state>_new...)

by appending each weight's optimizer update to the gradient graph.

``epoch_graph`` wraps a step graph in a ``Scan`` over the batches of one epoch:

    (features, label[, sample_weight], permutation, learning_rates, step, weights..., states...)
        -> (losses, <w>_new..., <state>_new...)

Every data input is gathered by ``permutation`` (shuffling) and reshaped to
``(batches, batch, ...)``; ``batches`` is the length of ``learning_rates`` (one
learning rate per batch) and ``batch`` is ``len(permutation) / batches``. Without
shuffling (``shuffled=False``) there is no ``permutation``: the data inputs are the
epoch's rows in order, reshaped in place, never copied. The ``Scan`` hands each
batch to the step graph as a view, carries weights, states and the step counter,
and stacks the per-batch losses. No Python runs between batches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..builder import GraphBuilder
from ..graphs import np_dtype, opset_version, rename_values
from ..names import NameAuthority
from .contract import model_pass

__all__ = ["Signature", "step_graph", "epoch_graph"]


@dataclass
class Signature:
    """Who is who among a training graph's inputs and outputs."""

    features: list[str]
    label: str
    sample_weight: str | None
    loss: str
    weights: list[str]
    states: dict[str, list[str]] = field(default_factory=dict)  # weight -> its state names
    gradients: dict[str, str] = field(default_factory=dict)  # weight -> gradient value
    learning_rate: str = "learning_rate"
    step: str = "step"
    new: dict[str, str] = field(default_factory=dict)  # weight or state -> its output name
    permutation: str | None = None  # epoch graphs only
    learning_rates: str | None = None
    losses: str | None = None
    prediction: str | None = None  # separate graphs only
    prediction_grad: str | None = None

    @property
    def data(self) -> list[str]:
        """The per-row inputs: features, label, sample weight."""
        return [*self.features, self.label, *([self.sample_weight] if self.sample_weight else [])]

    @property
    def state_names(self) -> list[str]:
        """Every optimizer state, weight by weight."""
        return [s for w in self.weights for s in self.states.get(w, [])]


@model_pass
def step_graph(model: onnx.ModelProto, signature: Signature,
               optimizer) -> tuple[onnx.ModelProto, Signature]:
    """Append the optimizer's update of every weight to a gradient model (see module doc).

    ``model`` holds the loss, and ``signature.gradients[w]`` for each weight ``w``,
    which must be a graph input. Returns the step graph and a copy of ``signature``
    completed with the names chosen for the new inputs and outputs (learning rate,
    step, states, ``<name>_new``).
    """
    signature = copy.deepcopy(signature)
    graph = model.graph
    names = NameAuthority.for_model(model)
    types = {v.name: v.type for v in graph.input}
    dtype_code = types[signature.weights[0]].tensor_type.elem_type
    dtype = np_dtype(dtype_code)
    signature.learning_rate = names.fresh(signature.learning_rate)
    signature.step = names.fresh(signature.step)
    graph.input.append(helper.make_tensor_value_info(signature.learning_rate, dtype_code, []))
    graph.input.append(helper.make_tensor_value_info(signature.step, TensorProto.INT64, []))
    b = GraphBuilder(names, opset_version(model) or 13, prefix="update/")
    outputs = [graph.output[[o.name for o in graph.output].index(signature.loss)]]
    for weight in signature.weights:
        states = [names.fresh(s) for s in optimizer.state_names(weight)]
        signature.states[weight] = states
        for state in states:
            graph.input.append(helper.make_value_info(state, types[weight]))
        reserved = {old: names.fresh(f"{old}_new") for old in [weight, *states]}
        new_weight, new_states = optimizer.emit_update(
            b, weight, signature.gradients[weight], states, signature.learning_rate,
            signature.step, dtype)
        for old, value in zip([weight, *states], [new_weight, *new_states]):
            signature.new[old] = _bind(b, value, reserved[old])
            outputs.append(helper.make_value_info(signature.new[old], types[weight]))
    b.append_to(graph)
    del graph.output[:]
    graph.output.extend(outputs)
    return model, signature


def _bind(b: GraphBuilder, value: str, name: str) -> str:
    """Give ``value`` the output name ``name`` (renaming its producer when it has one)."""
    try:
        return b.rename(value, name)
    except KeyError:
        return b.Identity(value, outputs=[name])


@model_pass
def epoch_graph(step: onnx.ModelProto, signature: Signature,
                shuffled: bool = True) -> tuple[onnx.ModelProto, Signature]:
    """Wrap a step graph (from :func:`step_graph`) in a Scan over one epoch's batches.

    With ``shuffled=False`` there is no permutation input: the data inputs hold exactly
    the epoch's rows in order (a view of the first ``batches * batch`` rows), and no
    copy of them is made. Returns the epoch graph and a copy of ``signature`` with its
    permutation, learning rates and losses names.
    """
    signature = copy.deepcopy(signature)
    names = NameAuthority.for_model(step)
    body = onnx.GraphProto()
    body.CopyFrom(step.graph)
    # The body reads nothing from outside: give every body value its own name.
    local = {v.name for v in (*body.input, *body.output, *body.value_info)}
    local |= {t.name for t in body.initializer} | {o for n in body.node for o in n.output}
    mapping = {name: names.fresh(f"{name}_in_step") for name in sorted(local) if name}
    rename_values(body, mapping)
    for node in body.node:
        node.name = names.fresh(f"scan/{node.name or node.op_type}")
    inputs = {v.name: v for v in body.input}
    carried = [*signature.weights, *signature.state_names]
    step_in = mapping[signature.step]
    step_out = names.fresh("step_next")
    one = names.fresh("one")
    body.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), one))
    body.node.append(helper.make_node("Add", [step_in, one], [step_out],
                                      name=names.fresh("scan/next_step")))
    scanned = [*signature.data, signature.learning_rate]
    outputs = {v.name: v for v in body.output}
    new_body_inputs = [inputs[mapping[n]] for n in [*carried, signature.step, *scanned]]
    new_body_outputs = [outputs[mapping[signature.new[n]]] for n in carried]
    new_body_outputs += [helper.make_tensor_value_info(step_out, TensorProto.INT64, []),
                         outputs[mapping[signature.loss]]]
    del body.input[:]
    body.input.extend(new_body_inputs)
    del body.output[:]
    body.output.extend(new_body_outputs)
    body.name = "train_step"

    graph = step.graph
    outer_types = {v.name: v.type for v in graph.input}
    b = GraphBuilder(names, opset_version(step) or 13, prefix="epoch/")
    permutation = names.fresh("permutation") if shuffled else None
    learning_rates = names.fresh("learning_rates")
    batches = b.Shape(learning_rates, hint="batches")
    rows_count = b.dims(permutation if shuffled else signature.data[0], 0, 1)
    batch = b.Div(rows_count, batches, hint="batch")
    batched = []
    for name in signature.data:
        rows = b.Gather(name, permutation, axis=0, hint=f"{name}_shuffled") if shuffled else name
        rank = len(outer_types[name].tensor_type.shape.dim)
        shape = [batches, batch]
        if rank > 1:
            shape.append(b.Slice(b.Shape(name), b.ints([1]), b.ints([rank])))
        batched.append(b.Reshape(rows, b.Concat(*shape, axis=0), hint=f"{name}_batches"))
    losses = names.fresh("losses")
    results = [signature.new[n] for n in carried] + [names.fresh("step_final"), losses]
    b.op("Scan", *carried, signature.step, *batched, learning_rates, outputs=results,
         body=body, num_scan_inputs=len(batched) + 1)

    dtype_code = outer_types[signature.weights[0]].tensor_type.elem_type
    new_inputs = [_input(graph, n) for n in signature.data]
    if shuffled:
        new_inputs.append(helper.make_tensor_value_info(permutation, TensorProto.INT64, ["rows"]))
    new_inputs.append(helper.make_tensor_value_info(learning_rates, dtype_code, ["batches"]))
    new_inputs += [_input(graph, n) for n in [signature.step, *carried]]
    outputs = [helper.make_tensor_value_info(losses, dtype_code, ["batches"])]
    outputs += [helper.make_value_info(signature.new[n], outer_types[n]) for n in carried]
    del graph.node[:]
    del graph.initializer[:]
    del graph.value_info[:]
    del graph.input[:]
    graph.input.extend(new_inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    b.append_to(graph)
    signature.permutation, signature.learning_rates, signature.losses = (
        permutation, learning_rates, losses)
    return step, signature


def _input(graph: onnx.GraphProto, name: str) -> onnx.ValueInfoProto:
    return next(v for v in graph.input if v.name == name)
