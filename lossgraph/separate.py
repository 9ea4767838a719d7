"""The graphs of ``fuse="separate"``: the reference documents' forward/backward design.

A separate-mode program trains with four graphs that a runner chains itself::

    gradient (x, weights..., prediction_grad) -> (prediction, <w>_grad...)     model VJP
    loss     (prediction, label[, weight])    -> (loss, prediction_grad)
    penalty  (penalized weights...)           -> (penalty, <w>_penalty_grad...)   optional
    update   (learning_rate, step, <w>, <w>_grad, <w states>...) -> (<w>_new, <state>_new...)

with the penalty and the update (:mod:`lossgraph.optim`)::

    penalty(W)      = a sum|W| + b sum W^2       penalty_grad(W) = a sign(W) + 2 b W

``update`` is IR 10 and standard ONNX ops only, so it runs on onnxruntime-training 1.19
and on current onnxruntime alike.

A runner may run ``update`` *packed* (:func:`packed_update`): the same graph built for one
flat vector holding every weight end to end (its gradient and each state likewise). The
optimizers' updates are elementwise, so it gives the per-weight graph's numbers to the
last bit, in a handful of kernels instead of a handful per weight (at batch 15 on the
reference documents' MLP, 6 kernels in 6 us instead of 36 in 15 us). It may run several
graphs as one session (:func:`chain_graphs`): the Trainer runs the forward half, the
loss and the backward half of a full batch in one run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from .builder import GraphBuilder, standalone_model
from .errors import InternalError, UnknownNameError, UnsupportedOptionError, suggest
from .graphs import ForwardFacts, names_in_graph, outer_references, rename_values, subgraphs
from .metadata import GRADIENTS_KEY, read_json
from .models import check_emitted
from .names import NameAuthority
from .optim import Optimizer
from .optimize import SumRowsByProduct, WidenScalarConstants
from .passes.contract import PassResult, Pipeline
from .passes.gradient import Gradient
from .passes.loss import AddLossOutput
from .penalties import parse_penalty, penalty_gradient, penalty_terms
from .roles import get_roles
from .signature import Signature
from .target import check_opset_option
from .validation import weights_dtype

__all__ = ["separate_graphs", "loss_graph", "program_loss_graph", "penalty_graph", "update_graph",
           "PenaltyGraph", "UpdateGraph", "build_penalty", "build_update", "PackedUpdate",
           "packed_update", "ForwardBackward", "split_gradient", "chain_graphs"]


def separate_graphs(predict: onnx.ModelProto, roles: Mapping[str, str], loss: str,
                    options: Mapping[str, Any], penalty: Mapping[str, Any] | None,
                    initial: Mapping[str, np.ndarray], optimizer: Optimizer, backend: str,
                    signature: Signature
                    ) -> tuple[dict[str, onnx.ModelProto], dict[str, dict[str, str]]]:
    """The four graphs for ``predict`` (weights as inputs) and ``loss`` with ``options``,
    and the role of each input and output of each (the manifest's roles, by graph).

    ``signature`` is completed with the names the graphs chose. Every name lossgraph
    invents (a gradient, a state, ``learning_rate``, ``step``, ``penalty``) is a free one:
    a weight or input of the model named alike keeps its name, and the invented one gets
    a suffix.
    """
    prediction = roles["prediction"]
    weights = list(initial)
    model_gradient = Pipeline((Gradient(weights, outputs=[prediction], backend=backend),
                               SumRowsByProduct()))(predict).model
    model_gradient = SumRowsByProduct()(model_gradient).model  # OPTIMIZE: sum-rows helper
    gradients = read_json(model_gradient, GRADIENTS_KEY)
    value = next(o for o in predict.graph.output if o.name == prediction)
    loss_step = program_loss_graph(value, roles["label"], loss, options, backend)
    # the model's own names, so that a name the update invents means one thing program-wide
    taken = {v.name for v in (*model_gradient.graph.input, *model_gradient.graph.output)
             if v.name not in gradients.values()}
    taken.update(roles.values())
    update = build_update(optimizer, initial, taken=taken)
    graphs = {"gradient": model_gradient, "loss": loss_step.model, "update": update.model}
    seed = loss_step.report[prediction]
    graph_roles = {
        "gradient": {prediction: "prediction", seed: "prediction_grad",
                     **{g: "gradient" for g in gradients.values()}},
        "loss": {prediction: "prediction", seed: "prediction_grad"},
        "update": update.roles,
    }
    if penalty:
        built = build_penalty(initial, penalty)
        graphs["penalty"], graph_roles["penalty"] = built.model, built.roles
    signature.gradients = dict(gradients)
    signature.learning_rate, signature.step = update.learning_rate, update.step
    signature.states = update.states
    signature.new = dict(update.new)
    signature.prediction = prediction
    signature.prediction_grad = seed
    return graphs, graph_roles


def program_loss_graph(prediction: onnx.ValueInfoProto, label: str, loss: str,
                       options: Mapping[str, Any], backend: str,
                       reduction: str | None = None) -> PassResult:
    """The ``loss`` graph of a separate program: :func:`loss_graph` of ``loss`` with
    compile_program's ``loss_options`` (``options``) on the prediction ``prediction``, whose
    label is named ``label``. ``reduction`` replaces the options' reduction: the
    data-parallel step (:mod:`lossgraph.parallel`) needs the gradient of the loss summed
    over the rows where the program's loss is their mean, which it divides by the rows'
    total weight. A mean over the positions an ``ignore_index`` leaves is not that (its
    divisor counts positions): an UnsupportedOptionError."""
    own = {k: v for k, v in options.items() if k not in ("output_index", "label_name")}
    output_options = {k: own.pop(k) for k in ("loss_name", "weight_name", "reduction")
                      if k in own}
    if reduction is not None:
        if (own.get("ignore_index") is not None and reduction == "sum"
                and output_options.get("reduction", "mean") == "mean"):
            raise UnsupportedOptionError(
                f"loss={loss!r} with ignore_index={own['ignore_index']!r} and reduction='mean' "
                "averages over the positions whose label is not ignored, counted over the "
                "whole batch; the data-parallel step divides summed gradients by the rows' "
                "total weight, so it would not compute that mean. Train in one process "
                "(lossgraph.Trainer), or compile with loss_options reduction='sum' (the "
                "learning rate then scales with the batch).")
        output_options["reduction"] = reduction
    return loss_graph(prediction, loss, own, label_name=label, backend=backend, **output_options)


def loss_graph(prediction: onnx.ValueInfoProto, loss: str, options: Mapping[str, Any],
               *, label_name: str | None = None, loss_name: str | None = None,
               weight_name: str | None = None, reduction: str = "mean",
               backend: str = "onnx", opset: int = 18) -> PassResult:
    """The graph ``(prediction, label[, weight]) -> (loss, prediction_grad)`` of
    ``loss`` (an :func:`~lossgraph.add_loss_output` loss with its ``options``) on a
    prediction of type ``prediction``; the report maps the prediction to its gradient.

    With ``reduction="none"`` the graph is ``(prediction, label[, weight]) -> (loss)``,
    the loss of each row, and has no gradient.
    """
    names = NameAuthority({prediction.name})
    copy = names.fresh(f"{prediction.name}_copy")  # the loss pass needs an output to score
    prediction = _named_dims(prediction)
    identity = helper.make_model(
        helper.make_graph([helper.make_node("Identity", [prediction.name], [copy])], "loss",
                          [prediction], [helper.make_value_info(copy, prediction.type)]),
        opset_imports=[helper.make_opsetid("", opset)])
    loss_model = AddLossOutput(loss, loss_name, label_name, weight_name, None, None, reduction,
                               dict(options))(identity).model
    kept = [o for o in loss_model.graph.output if o.name != copy]
    del loss_model.graph.output[:]
    loss_model.graph.output.extend(kept)
    if reduction == "none":
        return PassResult(loss_model, {})
    step = Pipeline((Gradient([prediction.name], loss_name=get_roles(loss_model)["loss"],
                              backend=backend), SumRowsByProduct()))(loss_model)
    return PassResult(step.model, step.report["Gradient"])


def _named_dims(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """``value`` with a name for each dimension that has neither a size nor a name: the
    label, declared like the prediction, then shares them, so shape inference proves the
    two alike and the loss's gradient needs no run-time broadcast reduction."""
    named = onnx.ValueInfoProto()
    named.CopyFrom(value)
    dims = named.type.tensor_type.shape.dim
    taken = {dim.dim_param for dim in dims if dim.dim_param}
    for index, dim in enumerate(dims):
        if not dim.HasField("dim_value") and not dim.dim_param:
            # a name of the model's own (a column named 'N') never doubles as this one
            base = "N" if index == 0 else f"d{index}"
            name = next(n for n in (base, *(f"{base}_{i}" for i in range(1, len(dims) + 2)))
                        if n not in taken)
            dim.dim_param = name
            taken.add(name)
    return named


@dataclass(frozen=True)
class PenaltyGraph:
    """A penalty graph (:func:`penalty_graph`) and the names of its outputs."""

    model: onnx.ModelProto
    penalty: str  # the penalty, summed over the weights
    gradients: dict[str, str]  # weight -> its penalty's gradient

    @property
    def roles(self) -> dict[str, str]:
        """The role of each input and output, as the manifest names them."""
        return {**{w: "weight" for w in self.gradients}, self.penalty: "penalty",
                **{g: "penalty_gradient" for g in self.gradients.values()}}


def penalty_graph(weights: Mapping[str, np.ndarray], penalty: Any) -> onnx.ModelProto:
    """The standalone penalty graph for ``penalty`` (add_loss_output's dict form).

    ``weights`` maps every trainable weight's name to its value (giving dtype and
    shape); the penalty's names must be among them. Inputs: the penalized weights in
    the penalty's order; outputs: ``penalty`` (their sum, a scalar of the weights'
    float type), then ``<W>_penalty_grad`` for each (each with a suffix where a weight
    has that name).
    """
    return build_penalty(weights, penalty).model


def build_penalty(weights: Mapping[str, np.ndarray], penalty: Any) -> PenaltyGraph:
    """:func:`penalty_graph` with the names it chose."""
    coefficients = parse_penalty(penalty)
    if not coefficients:
        raise UnsupportedOptionError(
            "penalty_graph needs at least one penalized weight, e.g. "
            "{'coef': {'l1': 0.01, 'l2': 0.1}}; the penalty given is empty."
        )
    for name in coefficients:
        if name not in weights:
            raise UnknownNameError(
                f"The penalty names {name!r}, which is not a weight."
                + suggest(name, list(weights), "weights")
            )
    penalized = {name: np.asarray(weights[name]) for name in coefficients}
    dtype = weights_dtype(penalized, "penalty_graph")
    elem_type = helper.np_dtype_to_tensor_dtype(dtype)
    names = NameAuthority(weights)
    inputs = [helper.make_tensor_value_info(name, elem_type, value.shape)
              for name, value in penalized.items()]
    total_name = names.fresh("penalty")
    grad_names = {name: names.fresh(f"{name}_penalty_grad") for name in penalized}

    b = GraphBuilder(names, opset=18)
    total: str | None = None
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    for name, value in penalized.items():
        terms = penalty_terms(b, name, coefficients[name], dtype, hint=name)
        term = (b.Add(*terms) if len(terms) > 1 else terms[0]) if terms else b.const(
            0.0, dtype, "zero")
        total = term if total is None else b.Add(total, term)
        grad = penalty_gradient(b, name, coefficients[name], dtype)
        info = helper.make_tensor_value_info(grad_names[name], elem_type, value.shape)
        outputs.append((grad, grad_names[name], info))
    assert total is not None
    outputs.insert(0, (total, total_name, helper.make_tensor_value_info(total_name, elem_type, [])))
    model = standalone_model(b, "penalty", inputs, outputs, 18)
    return PenaltyGraph(model, total_name, grad_names)


@dataclass(frozen=True)
class UpdateGraph:
    """An update graph (:func:`update_graph`) and the names of its inputs and outputs."""

    model: onnx.ModelProto
    learning_rate: str
    step: str
    gradients: dict[str, str]  # weight -> its gradient input
    states: dict[str, list[str]]  # weight -> its state inputs
    new: dict[str, str]  # weight or state -> the output with its next value

    @property
    def roles(self) -> dict[str, str]:
        """The role of each input and output, as the manifest names them."""
        roles = {self.learning_rate: "learning_rate", self.step: "step"}
        for weight, states in self.states.items():
            roles.update({weight: "weight", self.gradients[weight]: "gradient",
                          self.new[weight]: "new_weight"})
            roles.update((s, "state") for s in states)
            roles.update((self.new[s], "new_state") for s in states)
        return roles


def update_graph(
    optimizer: Optimizer, weights: Mapping[str, np.ndarray], opset: int = 18
) -> onnx.ModelProto:
    """The standalone update graph of ``optimizer`` for ``weights`` (name -> initial value).

    Inputs: ``learning_rate`` (a scalar of the weights' float type: the schedule's value
    for this update), ``step`` (int64 scalar, the 1-based update number; Adam and AdamW
    read it), then per weight ``w``, ``w_grad``, its states
    (:meth:`Optimizer.state_names`); outputs per weight ``w_new`` then ``<state>_new``.
    A name a weight has already gets a suffix (``w_grad_1``). A runner feeds the
    outputs back as the next step's inputs.
    """
    return build_update(optimizer, weights, opset).model


def build_update(optimizer: Optimizer, weights: Mapping[str, np.ndarray], opset: int = 18,
                 taken: Iterable[str] = ()) -> UpdateGraph:
    """:func:`update_graph` with the names it chose, none of them a weight's or in
    ``taken``."""
    if not isinstance(optimizer, Optimizer):
        raise UnsupportedOptionError(
            f"optimizer must be a lossgraph.optim optimizer (SGD, Momentum, Adam, AdamW), "
            f"not {optimizer!r}."
        )
    check_opset_option(opset)
    dtype = weights_dtype(weights, "update_graph")
    elem_type = helper.np_dtype_to_tensor_dtype(dtype)
    names = NameAuthority([*weights, *taken])
    learning_rate, step = names.fresh("learning_rate"), names.fresh("step")
    inputs = [helper.make_tensor_value_info(learning_rate, elem_type, []),
              helper.make_tensor_value_info(step, TensorProto.INT64, [])]
    gradients = {w: names.fresh(f"{w}_grad") for w in weights}
    states = {w: [names.fresh(s) for s in optimizer.state_names(w)] for w in weights}
    for weight, value in weights.items():
        for name in (weight, gradients[weight], *states[weight]):
            inputs.append(helper.make_tensor_value_info(name, elem_type, np.shape(value)))
    new = {name: names.fresh(f"{name}_new") for w in weights for name in (w, *states[w])}

    b = GraphBuilder(names, opset)
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    for weight, value in weights.items():
        new_weight, new_states = optimizer.emit_update(
            b, weight, gradients[weight], states[weight], learning_rate, step, dtype
        )
        for computed, old in zip([new_weight, *new_states], [weight, *states[weight]]):
            info = helper.make_tensor_value_info(new[old], elem_type, np.shape(value))
            outputs.append((computed, new[old], info))
    model = standalone_model(b, f"{type(optimizer).__name__}_update", inputs, outputs, opset)
    return UpdateGraph(model, learning_rate, step, gradients, states, new)


@dataclass(frozen=True)
class PackedUpdate:
    """An update graph on flat vectors (:func:`packed_update`).

    ``inputs`` and ``outputs`` map the graph's weight and state inputs, and its outputs
    with their next values, to the names laid end to end in them (``blocks``: the
    weights, then each state of every weight); ``gradient`` is the flat gradient input,
    the weights' gradients end to end.
    """

    model: onnx.ModelProto
    learning_rate: str
    step: str
    gradient: str
    inputs: dict[str, tuple[str, ...]]
    outputs: dict[str, tuple[str, ...]]

    @property
    def blocks(self) -> list[tuple[str, ...]]:
        """The groups of names each flat vector holds, weights first."""
        return list(self.inputs.values())


def packed_update(update: onnx.ModelProto, optimizer: Optimizer,
                  weights: Mapping[str, np.ndarray]) -> PackedUpdate | None:
    """``update``, the update graph of ``optimizer`` for ``weights`` (name -> value), on
    flat vectors: the same graph built for one vector of every weight end to end, as
    ``compile_program`` builds it (:func:`update_graph`, then WidenScalarConstants).

    None where ``update`` is not the graph :func:`update_graph` builds (a hand-edited
    program: only its own graph may run) or the weights are not of one float type.
    """
    dtypes = {np.asarray(value).dtype for value in weights.values()}
    if len(dtypes) != 1:
        return None
    built = build_update(optimizer, weights)
    if WidenScalarConstants()(built.model).model.graph.SerializeToString() != \
            update.graph.SerializeToString():
        return None
    size = sum(int(np.asarray(value).size) for value in weights.values())
    flat = "weights"  # update_graph reads only the shape and dtype: no memory for the values
    shaped = np.broadcast_to(np.zeros((), *dtypes), (size,))
    model = WidenScalarConstants()(update_graph(optimizer, {flat: shaped})).model
    names = [flat, *optimizer.state_names(flat)]
    blocks = [tuple(weights), *(tuple(built.states[w][k] for w in weights)
                                for k in range(len(names) - 1))]
    return PackedUpdate(model, "learning_rate", "step", f"{flat}_grad",
                        dict(zip(names, blocks)), {f"{n}_new": b for n, b in zip(names, blocks)})


@dataclass(frozen=True)
class ForwardBackward:
    """A vector-Jacobian graph cut in two at its forward outputs (:func:`split_gradient`).

    ``forward`` takes the gradient graph's inputs but the seeds and returns ``outputs``,
    then the ``residuals`` that are not among them: the forward values the backward
    half reads. ``backward`` takes ``residuals``, then ``reused`` (the forward inputs it
    reads again, such as features and weights), then the seeds, and returns the
    gradients.
    """

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    outputs: tuple[str, ...]
    residuals: tuple[str, ...]
    reused: tuple[str, ...]
    seeds: tuple[str, ...]
    gradients: tuple[str, ...]


def split_gradient(model: onnx.ModelProto, outputs: Sequence[str],
                   seeds: Sequence[str]) -> ForwardBackward:
    """Cut a vector-Jacobian graph (:class:`~lossgraph.passes.gradient.Gradient` with
    ``outputs=``) into a forward and a backward half, so that training computes the
    forward pass once::

        gradient(x, W, y_grad) -> (y, W_grad)
            = backward(forward(x, W).residuals, x, W, y_grad)

    The forward half holds the nodes ``outputs`` need; the backward half the nodes
    the gradients (recorded by the pass) need, once the forward half has run; other
    outputs are left out.
    """
    graph = model.graph
    seeds, outputs = tuple(seeds), tuple(outputs)
    producer = {o: i for i, node in enumerate(graph.node) for o in node.output if o}
    reads = [[*dict.fromkeys([*node.input, *(n for sub in subgraphs(node)
                                              for n in sorted(outer_references(sub)))])]
             for node in graph.node]

    def needed(targets: Sequence[str], known: set[int]) -> set[int]:
        """The nodes computing ``targets``, but those in ``known``."""
        found: set[int] = set()
        pending = [producer[t] for t in targets if t in producer]
        while pending:
            index = pending.pop()
            if index not in found and index not in known:
                found.add(index)
                pending.extend(producer[n] for n in reads[index] if n in producer)
        return found

    gradients = tuple(read_json(model, GRADIENTS_KEY).values())
    in_forward = needed(outputs, set())
    in_backward = needed(gradients, in_forward)
    forward_nodes = [n for i, n in enumerate(graph.node) if i in in_forward]
    backward_nodes = [n for i, n in enumerate(graph.node) if i in in_backward]
    inputs = [i.name for i in graph.input]
    backward_reads = {n for i in in_backward for n in reads[i]}
    residuals = tuple(o for n in forward_nodes for o in n.output if o in backward_reads)
    reused = tuple(i for i in inputs if i in backward_reads and i not in seeds)
    types = ForwardFacts.of(model).types
    initializers = {t.name: t for t in graph.initializer}

    def half(name: str, nodes: list[onnx.NodeProto], in_names: Sequence[str],
             out_names: Sequence[str]) -> onnx.ModelProto:
        made = {o for n in nodes for o in n.output}
        if not made.issuperset(out_names):
            raise InternalError(f"split_gradient: the {name} half does not compute "
                                f"{sorted(set(out_names) - made)}.")
        used = {n for node in nodes for n in node.input} | {
            n for node in nodes for sub in subgraphs(node) for n in outer_references(sub)}
        body = helper.make_graph(
            nodes, f"{graph.name}_{name}",
            [helper.make_value_info(i, types[i]) for i in in_names],
            [helper.make_value_info(o, types[o]) for o in out_names],
            [initializers[n] for n in initializers if n in used and n not in in_names])
        half_model = helper.make_model(body, opset_imports=list(model.opset_import),
                                       functions=list(model.functions))
        half_model.ir_version = model.ir_version  # loads where the gradient graph does
        check_emitted(half_model, f"split_gradient ({name})")
        return half_model

    forward_inputs = [i for i in inputs if i not in seeds]
    forward = half("forward", forward_nodes, forward_inputs,
                   [*outputs, *(r for r in residuals if r not in outputs)])
    backward = half("backward", backward_nodes, [*residuals, *reused, *seeds], list(gradients))
    return ForwardBackward(forward, backward, outputs, residuals, reused, seeds, gradients)


def chain_graphs(first: onnx.ModelProto, second: onnx.ModelProto
                 ) -> tuple[onnx.ModelProto, dict[str, str]] | None:
    """One model running ``first`` then ``second`` (a runner's two runs as one)::

        chained(first's inputs, second's other inputs) -> (first's outputs, second's outputs)

    An input of ``second`` named like an input or output of ``first`` reads it. The other
    names of ``second`` that ``first`` uses are renamed: the dict maps each to its new
    name. None where the two import different versions of an opset (no op may change
    meaning) or define different functions of the same name.
    """
    versions = {o.domain: o.version for o in first.opset_import}
    if any(versions.get(o.domain, o.version) != o.version for o in second.opset_import):
        return None
    functions = {(f.domain, f.name): f for f in first.functions}
    if any((f.domain, f.name) in functions and functions[f.domain, f.name] != f
           for f in second.functions):
        return None
    ahead, after = first.graph, onnx.GraphProto()
    after.CopyFrom(second.graph)
    interface = {v.name for v in (*ahead.input, *ahead.output)}
    shared = {v.name for v in after.input if v.name in interface}
    taken = NameAuthority(names_in_graph(ahead) | names_in_graph(after))
    clashing = names_in_graph(ahead) & (names_in_graph(after) - shared)
    renamed = {name: taken.fresh(name) for name in sorted(clashing)}
    rename_values(after, renamed)
    for node in after.node:
        node.name = renamed.get(node.name, node.name)
    outputs = {v.name for v in ahead.output}
    known = outputs | {v.name for v in ahead.value_info}
    body = helper.make_graph(
        [*ahead.node, *after.node], f"{ahead.name}_{after.name}",
        [*ahead.input, *(v for v in after.input if v.name not in shared)],
        [*ahead.output, *(v for v in after.output if v.name not in outputs)],
        [*ahead.initializer, *after.initializer],
        value_info=[*ahead.value_info, *(v for v in after.value_info if v.name not in known)],
        sparse_initializer=[*ahead.sparse_initializer, *after.sparse_initializer])
    imports = {**versions, **{o.domain: o.version for o in second.opset_import}}
    chained = helper.make_model(
        body, opset_imports=[helper.make_opsetid(d, v) for d, v in imports.items()],
        functions=[*first.functions, *(f for f in second.functions
                                       if (f.domain, f.name) not in functions)])
    chained.ir_version = max(first.ir_version, second.ir_version)
    check_emitted(chained, "chain_graphs")
    return chained, renamed
