"""Fusion: one training graph per step, or per epoch.

``StepGraph`` turns a loss model with gradients (weights as inputs) into

    (features, label[, sample_weight], weights..., buffers..., learning_rate, step, states...)
        -> (loss, <w>_new..., <state>_new..., <buffer>_new...[, grad_norm])

by appending each weight's optimizer update to the gradient graph (with the gradients
clipped by their global norm before it, then output, and an EMA of the weights after it,
where :class:`~lossgraph.update_options.UpdateOptions` asks: the EMA is one more state).
Buffers (the running statistics of a training-mode BatchNormalization,
:mod:`lossgraph.passes.running_stats`) are inputs already and their next values outputs
already; the step graph keeps them.

``PackWeights`` lays a gradient model's weights end to end in one flat vector
(and their gradients in another), so that ``StepGraph`` emits one update for all
weights instead of one per weight:

    theta -> Split -> Reshape -> w_1 ... w_n         g_1 ... g_n -> Reshape(-1) -> Concat

The optimizers' updates are elementwise, so the packed update is the per-weight one
to the last bit (but for a clipped update's norm, one sum of squares over the flat
gradient instead of one per weight: equal to float rounding); it runs a handful of
kernels instead of a handful per weight.

``EpochGraph`` wraps a step graph in a ``Scan`` over the batches of one epoch:

    (features, label[, sample_weight], permutation, learning_rates, step, weights..., states...,
     buffers...) -> (losses, <w>_new..., <state>_new..., <buffer>_new...)

Every data input is gathered by ``permutation`` (shuffling) and reshaped to
``(batches, batch, ...)``; ``batches`` is the length of ``learning_rates`` (one
learning rate per batch) and ``batch`` is ``len(permutation) / batches``. Without
shuffling (``shuffle=False``) there is no ``permutation``: the data inputs are the
epoch's rows in order, reshaped in place, never copied. The ``Scan`` hands each
batch to the step graph as a view, carries weights, states, buffers and (for an update
that reads it) the step counter, and stacks the per-batch losses (and, where the update
clips, the gradients' norms: ``grad_norms``). No Python runs between
batches. A packed step graph's Scan carries the flat vectors; the epoch graph packs
the weights and states before it and unpacks them after it, so its inputs and outputs
are the per-weight ones either way; buffers are carried as they are, never packed.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..builder import GraphBuilder
from ..deprecation import renamed_keywords
from ..errors import UnsupportedOptionError
from ..graphs import names_in_graph, np_dtype, opset_version, rename_values, values_read
from ..metadata import GRADIENTS_KEY, SIGNATURE_KEY, read_json
from ..names import NameAuthority
from ..optim import Optimizer
from ..roles import get_roles
from ..signature import Signature
from ..update_options import UpdateOptions
from .contract import Pass, PassResult, Requirement

__all__ = ["PackWeights", "StepGraph", "EpochGraph"]


def name_update(model: onnx.ModelProto, signature: Signature, optimizer: Optimizer,
                options: UpdateOptions | None = None) -> tuple[Signature, NameAuthority]:
    """``signature`` completed with the names a step graph of ``model`` gives its learning
    rate, step, states (the optimizer's, an EMA), new values and gradients' norm, and the
    authority that minted them.

    The names depend only on ``model``, ``optimizer`` and ``options``, so a packed epoch
    graph and the step graph of the same gradient model name their per-weight values alike.
    """
    options = options or UpdateOptions()
    named = copy.deepcopy(signature)
    names = NameAuthority.for_model(model)
    named.learning_rate = names.fresh(named.learning_rate)
    named.step = names.fresh(named.step)
    for weight in named.weights:
        named.states[weight] = [names.fresh(s) for s in options.state_names(optimizer, weight)]
        for old in [weight, *named.states[weight]]:
            named.new[old] = names.fresh(f"{old}_new")
    if options.clips:
        named.grad_norm = names.fresh("grad_norm")
    return named, names


def _gradients_problem(model: onnx.ModelProto) -> str | None:
    """What keeps ``model`` from being a gradient model: a loss (add_loss_output) and the
    gradients of its weights as outputs (lossgraph.gradient), recorded in its metadata."""
    if read_json(model, SIGNATURE_KEY):
        return None  # a step graph's signature names its gradients
    if "loss" not in get_roles(model):
        return "the model records no loss (build it with lossgraph.add_loss_output)"
    if not read_json(model, GRADIENTS_KEY):
        return ("the model records no gradients (lossgraph.gradient, with its weights as "
                "inputs)")
    return None


def _step_graph_problem(model: onnx.ModelProto) -> str | None:
    """What keeps ``model`` from being a step graph (StepGraph's output)."""
    recorded = read_json(model, SIGNATURE_KEY)
    if not recorded or recorded.get("learning_rates") is not None:
        return ("the model records no step graph signature: it must be StepGraph's output "
                "(an epoch graph cannot be wrapped again)")
    return None


#: A loss model with its weights' gradients, as :class:`~lossgraph.passes.Gradient` emits.
GRADIENT_MODEL = Requirement("a loss model with its weights' gradients", _gradients_problem)
#: A training step graph, as :class:`StepGraph` emits.
STEP_GRAPH = Requirement("a training step graph", _step_graph_problem)


@dataclass(frozen=True)
class PackWeights(Pass[Signature]):
    """One flat weight input and one flat gradient instead of one per weight (module doc).

    The input is a gradient model whose weights are graph inputs of static shapes and
    one float type. The packed signature it records keeps the per-weight one, named as
    :class:`StepGraph` with ``optimizer`` names the unpacked step graph, in ``unpacked``.
    """

    optimizer: Optimizer
    options: UpdateOptions = UpdateOptions()
    requires = (GRADIENT_MODEL,)

    def call(self, model: onnx.ModelProto) -> PassResult:
        if not self.optimizer.same_for_every_weight:
            raise UnsupportedOptionError(
                f"PackWeights: {self.optimizer!r} updates some weights differently from others "
                "(decay groups), so one update of the packed vector would be wrong: leave the "
                "weights apart.")
        unpacked, names = name_update(model, Signature.of_gradient_model(model), self.optimizer,
                                      self.options)
        packed = _pack(model, unpacked, names)
        packed.record(model)
        return PassResult(model, packed)


def _pack(model: onnx.ModelProto, unpacked: Signature, names: NameAuthority) -> Signature:
    graph = model.graph
    inputs = {v.name: v for v in graph.input}
    shapes = {w: [d.dim_value for d in inputs[w].type.tensor_type.shape.dim]
              for w in unpacked.weights}
    elem_type = inputs[unpacked.weights[0]].type.tensor_type.elem_type
    theta = names.fresh("weights_packed")
    b = GraphBuilder(names, opset_version(model) or 13, prefix="pack/")
    _unpack(b, theta, unpacked.weights, [shapes[w] for w in unpacked.weights])
    unpacking = b.nodes
    b.nodes = []
    flat = b.ints([-1], hint="flat")
    gradients = [unpacked.gradients[w] if len(shapes[w]) == 1 else
                 b.Reshape(unpacked.gradients[w], flat, hint=f"{w}_grad_flat")
                 for w in unpacked.weights]
    gradient = b.Concat(*gradients, axis=0, hint="weights_packed_grad")
    b.append_to(graph)
    for node in reversed(unpacking):
        graph.node.insert(0, node)
    kept = [v for v in graph.input if v.name not in shapes]
    del graph.input[:]
    size = sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())
    graph.input.extend([*kept, helper.make_tensor_value_info(theta, elem_type, [size])])
    return Signature(features=unpacked.features, label=unpacked.label,
                     sample_weight=unpacked.sample_weight, loss=unpacked.loss,
                     weights=[theta], gradients={theta: gradient}, unpacked=unpacked,
                     shapes=shapes, buffers=list(unpacked.buffers),
                     new={b: unpacked.new[b] for b in unpacked.buffers})


@dataclass(frozen=True)
class StepGraph(Pass[Signature]):
    """Append ``optimizer``'s update of every weight to a gradient model (module doc).

    The input holds the loss and each weight's gradient (the weights are graph inputs),
    per weight or packed by :class:`PackWeights`. The step graph records its signature,
    completed with the names chosen for the new inputs and outputs (learning rate, step,
    states, ``<name>_new``), and reports it.
    """

    optimizer: Optimizer
    #: gradient clipping and an EMA of the weights (:mod:`lossgraph.update_options`)
    options: UpdateOptions = UpdateOptions()
    requires = (GRADIENT_MODEL,)

    def call(self, model: onnx.ModelProto) -> PassResult:
        signature, names = name_update(model, Signature.of(model), self.optimizer, self.options)
        _append_update(model, signature, names, self.optimizer, self.options)
        signature.record(model)
        return PassResult(model, signature)


def _append_update(model: onnx.ModelProto, signature: Signature, names: NameAuthority,
                   optimizer: Optimizer, options: UpdateOptions) -> None:
    graph = model.graph
    types = {v.name: v.type for v in graph.input}
    dtype_code = types[signature.weights[0]].tensor_type.elem_type
    dtype = np_dtype(dtype_code)
    graph.input.append(helper.make_tensor_value_info(signature.learning_rate, dtype_code, []))
    graph.input.append(helper.make_tensor_value_info(signature.step, TensorProto.INT64, []))
    b = GraphBuilder(names, opset_version(model) or 13, prefix="update/")
    outputs = [graph.output[[o.name for o in graph.output].index(signature.loss)]]
    for weight in signature.weights:
        for state in signature.states[weight]:
            graph.input.append(helper.make_value_info(state, types[weight]))
    new, norm = options.emit_update(
        b, optimizer, {w: signature.gradients[w] for w in signature.weights}, signature.states,
        signature.learning_rate, signature.step, dtype)
    for weight in signature.weights:
        for old, value in zip([weight, *signature.states[weight]], new[weight]):
            _bind(b, value, signature.new[old])
            outputs.append(helper.make_value_info(signature.new[old], types[weight]))
    if norm is not None:
        _bind(b, norm, signature.grad_norm)
    b.append_to(graph)
    computed = {o.name: o for o in graph.output}  # buffers: their next values are outputs
    outputs += [computed[signature.new[buffer]] for buffer in signature.buffers]
    if norm is not None:
        outputs.append(helper.make_tensor_value_info(signature.grad_norm, dtype_code, []))
    del graph.output[:]
    graph.output.extend(outputs)


def _bind(b: GraphBuilder, value: str, name: str) -> None:
    """Give ``value`` the output name ``name`` (renaming its producer when it has one)."""
    try:
        b.rename(value, name)
    except KeyError:
        b.Identity(value, outputs=[name])


@dataclass(frozen=True)
class EpochGraph(Pass[Signature]):
    """Wrap a step graph (from :class:`StepGraph`) in a Scan over one epoch's batches.

    With ``shuffle=False`` there is no permutation input: the data inputs hold exactly
    the epoch's rows in order (a view of the first ``batches * batch`` rows), and no
    copy of them is made. The epoch graph records and reports its signature, with its
    permutation, learning rates and losses names.
    """

    shuffle: bool = True
    requires = (STEP_GRAPH,)

    def call(self, model: onnx.ModelProto) -> PassResult:
        signature = _wrap_in_scan(model, Signature.of(model), self.shuffle)
        signature.record(model)
        return PassResult(model, signature)


#: ``EpochGraph(shuffled=...)``, the previous release's spelling, still works (with a warning).
EpochGraph.__init__ = renamed_keywords(shuffled="shuffle")(EpochGraph.__init__)  # type: ignore


def _wrap_in_scan(step: onnx.ModelProto, signature: Signature, shuffle: bool) -> Signature:
    outer = signature.unpacked or signature  # the epoch graph's inputs and outputs
    names = NameAuthority([*names_in_graph(step.graph), *outer.weights, *outer.state_names,
                           *outer.buffers, *outer.new.values(), outer.step])
    # The body reads nothing from outside: every body value gets its own name.
    body, mapping = scan_body(step.graph, names, "step", "scan")
    inputs = {v.name: v for v in body.input}
    packable = [*signature.weights, *signature.state_names]
    carried = [*packable, *signature.buffers]  # buffers: never packed
    # the step counter is carried only where the update reads it (Adam)
    counts_steps = mapping[signature.step] in values_read(body)
    counted = [signature.step] if counts_steps else []
    # per update: a group's gradient scales (lossgraph.passes.accumulate), its learning rate
    per_update = [*([signature.gradient_scale] if signature.gradient_scale else []),
                  signature.learning_rate]
    scanned = [*signature.data, *per_update]
    outputs = {v.name: v for v in body.output}
    new_body_inputs = [inputs[mapping[n]] for n in [*carried, *counted, *scanned]]
    new_body_outputs = [outputs[mapping[signature.new[n]]] for n in carried]
    if counts_steps:
        step_out = names.fresh("step_next")
        one = names.fresh("one")
        body.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), one))
        body.node.append(helper.make_node("Add", [mapping[signature.step], one], [step_out],
                                          name=names.fresh("scan/next_step")))
        new_body_outputs.append(helper.make_tensor_value_info(step_out, TensorProto.INT64, []))
    new_body_outputs.append(outputs[mapping[signature.loss]])
    norms = [mapping[signature.grad_norm]] if signature.grad_norm else []
    new_body_outputs += [outputs[n] for n in norms]
    del body.input[:]
    body.input.extend(new_body_inputs)
    del body.output[:]
    body.output.extend(new_body_outputs)
    body.name = "train_step"

    graph = step.graph
    outer_types = _outer_types(graph, signature)
    b = GraphBuilder(names, opset_version(step) or 13, prefix="epoch/")
    permutation = names.fresh("permutation") if shuffle else None
    learning_rates = names.fresh("learning_rates")
    batches = b.Shape(learning_rates, hint="batches")
    rows_count = b.dims(permutation if shuffle else signature.data[0], 0, 1)
    batch = b.Div(rows_count, batches, hint="batch")
    batched = []
    for name in signature.data:
        rows = b.Gather(name, permutation, axis=0, hint=f"{name}_shuffled") if shuffle else name
        rank = len(outer_types[name].tensor_type.shape.dim)
        shape = [batches, batch]
        if rank > 1:
            shape.append(b.Slice(b.Shape(name), b.ints([1]), b.ints([rank])))
        batched.append(b.Reshape(rows, b.Concat(*shape, axis=0), hint=f"{name}_batches"))
    losses = names.fresh("losses")
    scales = names.fresh("gradient_scales") if signature.gradient_scale else None
    grad_norms = names.fresh("grad_norms") if norms else None
    if signature.unpacked:
        flat = b.ints([-1], hint="flat")
        scan_in = [b.Concat(*(b.Reshape(m, flat) for m in signature.members(c)), axis=0,
                            hint=f"{c}_in") for c in packable]
        scan_out = [names.fresh(f"{c}_out") for c in packable]
        scan_in += signature.buffers
        scan_out += [outer.new[n] for n in signature.buffers]
    else:
        scan_in, scan_out = carried, [signature.new[n] for n in carried]
    steps_in, steps_out = ([outer.step], [names.fresh("step_final")]) if counts_steps else ([], [])
    grouped = names.fresh("losses_by_group") if scales else losses
    b.op("Scan", *scan_in, *steps_in, *batched, *([scales] if scales else []), learning_rates,
         outputs=[*scan_out, *steps_out, grouped, *([grad_norms] if norms else [])],
         body=body, num_scan_inputs=len(batched) + len(per_update))
    if scales:  # a group's step gives the losses of its micro-batches: one vector of all
        b.op("Reshape", grouped, b.ints([-1], hint="flat"), outputs=[losses])
    if signature.unpacked:
        shapes = [signature.shapes[w] for w in outer.weights]
        for packed, out in zip(packable, scan_out):
            _unpack(b, out, [outer.new[m] for m in signature.members(packed)], shapes)

    dtype_code = outer_types[outer.weights[0]].tensor_type.elem_type
    outer_carried = [*outer.weights, *outer.state_names, *outer.buffers]
    new_inputs = [all_rows(helper.make_value_info(n, outer_types[n])) for n in signature.data]
    if shuffle:
        new_inputs.append(helper.make_tensor_value_info(permutation, TensorProto.INT64, ["rows"]))
    if scales:
        new_inputs.append(helper.make_tensor_value_info(scales, dtype_code,
                                                        ["batches", "micro_batches"]))
    new_inputs.append(helper.make_tensor_value_info(learning_rates, dtype_code, ["batches"]))
    new_inputs += [helper.make_value_info(n, outer_types[n])
                   for n in [outer.step, *outer_carried]]
    outputs = [helper.make_tensor_value_info(losses, dtype_code,
                                             ["micro_batches" if scales else "batches"])]
    if norms:  # one per update
        outputs.append(helper.make_tensor_value_info(grad_norms, dtype_code, ["batches"]))
    outputs += [helper.make_value_info(outer.new[n], outer_types[n]) for n in outer_carried]
    del graph.node[:]
    del graph.initializer[:]
    del graph.value_info[:]
    del graph.input[:]
    graph.input.extend(new_inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    b.append_to(graph)
    signature = copy.deepcopy(outer)
    signature.permutation, signature.learning_rates, signature.losses = (
        permutation, learning_rates, losses)
    signature.gradient_scale = scales
    signature.grad_norms = grad_norms  # grad_norm: the step graph's output, named alike
    return signature


def scan_body(graph: onnx.GraphProto, names: NameAuthority, name: str, prefix: str,
              outer: Collection[str] = ()) -> tuple[onnx.GraphProto, dict[str, str]]:
    """A copy of ``graph`` to be a Scan's body: every value it defines, but the ``outer``
    ones it reads from the enclosing graph, renamed ``<value>_in_<name>`` and every node
    ``<prefix>/<node>``, fresh in ``names``; the renaming."""
    body = onnx.GraphProto()
    body.CopyFrom(graph)
    local = {v.name for v in (*body.input, *body.output, *body.value_info)} - set(outer)
    local |= {t.name for t in body.initializer} | {o for n in body.node for o in n.output}
    mapping = {value: names.fresh(f"{value}_in_{name}") for value in sorted(local) if value}
    rename_values(body, mapping)
    for node in body.node:
        node.name = names.fresh(f"{prefix}/{node.name or node.op_type}")
    return body, mapping


def all_rows(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """A data input of the epoch graph: every row of the epoch, whose number a step graph
    of a fixed batch (a model exported with one, passes/fixed_batch.py) does not fix."""
    dims = value.type.tensor_type.shape.dim
    if dims and dims[0].HasField("dim_value"):
        dims[0].Clear()
        dims[0].dim_param = "rows"
    return value


def _outer_types(graph: onnx.GraphProto, signature: Signature) -> dict[str, onnx.TypeProto]:
    """The types of the epoch graph's inputs: the step graph's own, and for a packed
    step graph those of every per-weight weight and state (a state is shaped like its
    weight)."""
    types = {v.name: v.type for v in graph.input}
    unpacked = signature.unpacked
    if unpacked is not None:
        elem_type = types[signature.weights[0]].tensor_type.elem_type
        types[unpacked.step] = types[signature.step]
        for weight in unpacked.weights:
            kind = helper.make_tensor_type_proto(elem_type, signature.shapes[weight])
            for name in [weight, *unpacked.states.get(weight, [])]:
                types[name] = kind
    return types


def _unpack(b: GraphBuilder, flat: str, outputs: list[str], shapes: list[list[int]]) -> None:
    """Split the flat vector ``flat`` into the values ``outputs``, of the given shapes."""
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    parts = [out if len(shape) == 1 else b.names.fresh(f"{out}_flat")
             for out, shape in zip(outputs, shapes)]
    b.op("Split", flat, b.ints(sizes, hint="sizes"), outputs=parts, axis=0)
    for out, part, shape in zip(outputs, parts, shapes):
        if part != out:
            b.op("Reshape", part, b.ints(shape, hint="shape"), outputs=[out])
