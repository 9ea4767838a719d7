"""Recompute: trade compute for memory, the graph-level form of ``torch.utils.checkpoint``.

A gradient graph keeps every forward value its backward reads alive from the forward to
the backward. :class:`Recompute` rewrites a gradient graph (the output of
:class:`~lossgraph.passes.Gradient`) so that the backward reads only **kept** values:

- the **boundaries** (checkpoints): forward values named by the user, or chosen by
  ``"activations"``, ``"elementwise"`` or ``"auto"`` (below);
- what cannot or need not be recomputed: the graph's inputs and weights, values computed
  from weights and constants alone (weight-sized, not activations), the outputs of nodes
  that draw random numbers (``Dropout``, ``RandomNormal``, ..., which would draw other
  values) and of nodes holding subgraphs (``If``, ``Loop``, ``Scan``).

Every other forward value the backward reads is **recomputed**: the forward nodes between
the kept values and it are copied into the backward (outputs renamed
``<value>_recomputed``), each copy placed right before the first backward node that reads
it, so that onnxruntime (whose memory planner frees a value after its last reader) frees
the forward activations as soon as the forward is done with them, and holds one segment's
activations at a time during the backward. A copy whose inputs are all kept reads one of
them through ``Max(v, v)`` (``<value>_fenced``, the same value bit for bit): otherwise
onnxruntime's common-subexpression elimination would merge the copy back into the forward
node, keeping the forward activations alive.

``"activations"`` keeps every activation the backward reads but those elementwise
arithmetic (:data:`ARITHMETIC_OPS`: no copies or shape ops) computes from kept values
alone, and the views of those (:data:`VIEW_OPS`, a ``Reshape`` by a kept shape): a
decomposed GELU keeps its input, and its ``x / sqrt 2``, erf and products, and a
``Reshape`` of its output (GPT-2's ``Conv1D``), are computed again from it in the
backward. Fewer bytes are kept, never more but a view's few shape numbers (what they are
computed from is kept anyway), at the cost of a few elementwise kernels: the default for
a model of :data:`ACTIVATIONS_MIN_BYTES` of initializers or more
(:func:`default_recompute`).

``"elementwise"`` makes every output of an op that is not cheap to compute again a
boundary (:data:`CHEAP_OPS`: elementwise arithmetic and activations, views, shape ops):
the backward then reads the products, normalizations and softmaxes the forward computed
and recomputes the elementwise chains between them (a bias added, a decomposed GELU's
four intermediates, a residual sum), as torch's compiler partitions a graph. It costs
about those chains once more, memory-bound kernels, and no product.

``"auto"`` picks boundaries among the forward graph's **cuts** (float values every path of
activations passes through: the residual stream between transformer layers, a
``Sequential``'s layer outputs), greedily: a cut becomes a boundary once the activations
the backward reads since the last one reach the budget ``total / sqrt(total / mean cut)``
(sizes from the inferred shapes), Chen et al.'s rule (*Training Deep Nets with Sublinear
Memory Cost*, 2016): about ``sqrt(n)`` segments of equal activation size. The segment
after the last boundary is kept whole, as ``torch.utils.checkpoint.checkpoint_sequential``
runs its last one: the backward reads it first, while the forward's values are still
there, so that recomputing it would hold as much and compute it twice (a language
model's output layer, GPT-2 small's largest product); a tail of less than half a
segment joins the segment before it (a classifier's head: BERT-base's last layer is not
recomputed either). Under a
**budget** (a fraction of the activations the backward reads, ``recompute=0.5``), the
segments are then kept whole (their values kept, not recomputed), those whose
recomputation costs the most for the memory they hold first, while the estimated peak of
what the backward holds (what is never recomputed, the boundaries, the segments kept
whole and the largest one recomputed) stays within it: the dial between ``"auto"`` (the
least memory) and ``"none"`` (no recomputation), as torch's ``activation_memory_budget``.

The report (:class:`RecomputePlan`) names the boundaries, the values kept for the
backward and those recomputed; compile records it in the manifest (``recompute``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from ..errors import UnknownNameError, UnsupportedModelError, UnsupportedOptionError, suggest
from ..graphs import ForwardFacts, is_onnx_op, node_reads
from ..metadata import GRADIENTS_KEY, SIGNATURE_KEY, read_json
from ..names import NameAuthority
from ..signature import Signature
from .contract import Pass, PassResult, Requirement

__all__ = ["Recompute", "RecomputePlan", "PLANS", "RANDOM_OPS", "CHEAP_OPS", "ARITHMETIC_OPS",
           "VIEW_OPS",
           "ACTIVATIONS_MIN_BYTES", "UpdatesInBackwardOrder", "default_recompute",
           "recompute_choice"]

#: The plans ``recompute=`` names (beside a budget and a list of boundaries).
PLANS = ("none", "activations", "elementwise", "auto")

#: Ops whose outputs are drawn at random: never recomputed (a copy would draw again).
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike", "Bernoulli", "Multinomial"})

#: Elementwise arithmetic, comparisons and activations: each output element computed from
#: the inputs' elements, not a view, a copy or a shape. ``recompute="activations"``
#: recomputes chains of these alone.
ARITHMETIC_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Reciprocal", "Sqrt", "Pow", "Exp", "Log",
    "Erf", "Tanh", "Sigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Gelu",
    "HardSigmoid", "HardSwish", "Softplus", "Softsign", "Clip", "Where", "Max", "Min",
    "Cast", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or",
    "Sign", "Floor", "Ceil", "Round"})
#: Views: the first input's elements as they are, in another shape (onnxruntime makes no
#: copy). ``recompute="activations"`` recomputes a view of a value it recomputes.
VIEW_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
#: Views and copies, shape computations.
_VIEW_AND_SHAPE_OPS = VIEW_OPS | {"Transpose", "Expand", "Shape", "Size", "Slice", "Concat",
                                  "Split", "Gather", "ConstantOfShape", "Range"}
#: Ops cheap to compute again, beside the kernels that read their results: arithmetic,
#: views and shape computations. ``recompute="elementwise"`` keeps the outputs of every
#: other op.
CHEAP_OPS = ARITHMETIC_OPS | _VIEW_AND_SHAPE_OPS

_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                     onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
#: Element types ``Max`` takes (the fence reads a kept value through ``Max(v, v)``).
_FENCEABLE = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                        onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                        onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                        onnx.TensorProto.UINT32, onnx.TensorProto.UINT64,
                        onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
                        onnx.TensorProto.INT16, onnx.TensorProto.UINT16})


#: A model whose initializers hold this many bytes or more is compiled with
#: ``recompute="activations"`` unless ``recompute`` says otherwise; a smaller one with
#: ``"none"``, its graphs exactly as the gradient builds them. Measured (BERT-base, GPT-2
#: small, a 2-layer transformer of 1.5 MiB): 10-27% less peak memory, the step time within
#: the noise of ``"none"``'s (docs/benchmarks.md).
ACTIVATIONS_MIN_BYTES = 64 * 2**20


def default_recompute(model: onnx.ModelProto) -> str:
    """compile's ``recompute`` where none is given: ``"activations"`` for a model of
    :data:`ACTIVATIONS_MIN_BYTES` of initializers or more, else ``"none"`` (sizes from the
    dims, no data read)."""
    held = sum(math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer if t.data_type != onnx.TensorProto.STRING)
    return "activations" if held >= ACTIVATIONS_MIN_BYTES else "none"


def recompute_choice(value: object) -> str | tuple[str, ...] | float | None:
    """``compile_program``'s ``recompute=`` checked: None (:func:`default_recompute`),
    ``"none"``, ``"activations"``, ``"elementwise"``, ``"auto"``, a budget (a float in
    (0, 1]) or a non-empty list of forward tensor names (the boundaries), else an
    UnsupportedOptionError."""
    if value is None:
        return None
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise UnsupportedOptionError(
                f"recompute={value!r}: a budget is the fraction of the activations the "
                "backward reads that recomputation may keep, above 0 and at most 1 (1: keep "
                "them all, as 'none'; 'auto': the least memory).")
        return value
    if isinstance(value, str) and value in PLANS:
        return value
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(v, str) and v for v in value)):
        if len(set(value)) != len(value):
            raise UnsupportedOptionError(
                f"recompute={list(value)!r} names a tensor twice: name each boundary once.")
        return tuple(value)
    raise UnsupportedOptionError(
        f"recompute={value!r} must be None (lossgraph's choice by the model's size), 'none' "
        "(keep every activation), 'activations' (what elementwise arithmetic computes from "
        "kept values recomputed), 'elementwise' (the elementwise ops' outputs recomputed, "
        "every other kept), 'auto' (boundaries "
        "chosen among the forward graph's cuts), a budget (a float in (0, 1]: 'auto' keeping "
        "at most that fraction of the activations) or a non-empty list of forward tensor "
        "names (the boundaries kept; everything between them recomputed in the backward).")


@dataclass(frozen=True)
class RecomputePlan:
    """What :class:`Recompute` did: the boundaries, the forward values the backward reads
    kept (boundaries included), and those it recomputes, each in graph order."""

    boundaries: tuple[str, ...]
    kept: tuple[str, ...]
    recomputed: tuple[str, ...]

    def as_record(self) -> dict[str, list[str]]:
        """The plan as the manifest records it."""
        return {"boundaries": list(self.boundaries), "kept": list(self.kept),
                "recomputed": list(self.recomputed)}


def _gradient_model(model: onnx.ModelProto) -> str | None:
    return None if read_json(model, GRADIENTS_KEY) else (
        "a gradient model (the output of Gradient), which records its gradient outputs")


@dataclass(frozen=True)
class Recompute(Pass[RecomputePlan]):
    """The backward of a gradient model reads kept values only, the rest recomputed
    (module docstring). ``boundaries``: ``"activations"``, ``"elementwise"``, ``"auto"``
    or forward tensor names; ``budget`` (with ``"auto"``): the fraction of the activations
    the backward reads kept at most, None for the least memory."""

    boundaries: str | tuple[str, ...] = "auto"
    budget: float | None = None
    requires = (Requirement("a gradient model", _gradient_model),)

    def call(self, model: onnx.ModelProto) -> PassResult[RecomputePlan]:
        graph = model.graph
        weights = set(read_json(model, GRADIENTS_KEY))
        gradients = set(read_json(model, GRADIENTS_KEY).values())
        nodes = list(graph.node)
        producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
        forward = _ancestors(nodes, producer, [o.name for o in graph.output
                                               if o.name not in gradients])
        constants = {t.name for t in graph.initializer}
        data = {i.name for i in graph.input} - constants - weights
        dependent = _dependent(nodes, forward, data)  # activations: computed from the data
        facts = ForwardFacts.of(model)
        whole: set[int] = set()  # the forward nodes of the segments kept whole
        if self.boundaries == "auto":
            floats = {v for v in dependent if facts.elem_types.get(v) in _FLOATS}
            needed = _backward_reads(nodes, forward, floats)
            boundaries = _auto_boundaries(nodes, forward, floats, needed, facts)
            whole = _kept_whole(nodes, forward, needed, boundaries, facts, self.budget)
        elif self.boundaries == "activations":
            boundaries = _chain_roots(nodes, forward, dependent,
                                      {o.name for o in graph.output})
        elif self.boundaries == "elementwise":
            boundaries = tuple(o for i in sorted(forward) for o in nodes[i].output
                               if o in dependent and not is_onnx_op(nodes[i], *CHEAP_OPS))
        else:
            boundaries = tuple(self.boundaries)
            _check_boundaries(boundaries, nodes, forward)
        stop = set(boundaries) | {i.name for i in graph.input} | constants
        for i in forward:
            node = nodes[i]
            if (node.domain in ("", "ai.onnx") and node.op_type in RANDOM_OPS) \
                    or any(a.g.node or a.graphs for a in node.attribute) \
                    or i in whole or not any(o in dependent for o in node.output):
                stop.update(o for o in node.output if o)
        names = NameAuthority.for_model(model)
        renamed: dict[str, str] = {}  # recomputed forward value -> its copy
        fences: dict[str, str] = {}
        kept: dict[str, None] = {}
        emitted: list[onnx.NodeProto] = []

        def fence(value: str) -> str:
            if value not in fences:
                fences[value] = names.fresh(f"{value}_fenced")
                emitted.append(helper.make_node("Max", [value, value], [fences[value]],
                                                name=names.fresh(f"{value}_fence")))
            return fences[value]

        def recomputable(value: str) -> bool:
            return value in producer and producer[value] in forward and value not in stop

        def copy_of(node: onnx.NodeProto) -> None:
            """Emit the copy of ``node``, whose recomputed inputs have their copies."""
            inputs = [renamed.get(v, v) for v in node.input]
            if inputs == list(node.input):  # every input kept: fence one activation
                at = next((k for k, v in enumerate(inputs) if v in dependent
                           and facts.elem_types.get(v) in _FENCEABLE), None)
                if at is not None:
                    inputs[at] = fence(inputs[at])
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = inputs
            copy.output[:] = [names.fresh(f"{o}_recomputed") if o else o for o in node.output]
            if node.name:
                copy.name = names.fresh(f"{node.name}_recomputed")
            renamed.update((o, c) for o, c in zip(node.output, copy.output) if o)
            emitted.append(copy)

        def recompute(value: str) -> str:
            """The copy of ``value`` (its chain emitted first, depth first without
            recursion: chains may be long), or ``value`` itself where it is kept."""
            if not recomputable(value):
                if value in dependent and value in producer and producer[value] in forward:
                    kept[value] = None
                return value
            stack = [producer[value]]
            while stack:
                node = nodes[stack[-1]]
                if any(o in renamed for o in node.output):
                    stack.pop()
                    continue
                waiting = [producer[v] for v in node.input
                           if v and recomputable(v) and v not in renamed]
                if waiting:
                    stack.extend(waiting)
                    continue
                stack.pop()
                for v in node.input:
                    if v and not recomputable(v):
                        recompute(v)  # noted as kept
                copy_of(node)
            return renamed[value]

        rewritten: list[onnx.NodeProto] = []
        for i, node in enumerate(nodes):
            if i not in forward:
                node.input[:] = [recompute(v) if v else v for v in node.input]
                for value in set(node_reads(node)) - set(node.input):  # a subgraph's outer reads
                    if value in dependent and producer.get(value) in forward:
                        kept[value] = None
                rewritten.extend(emitted)
                emitted.clear()
            rewritten.append(node)
        del graph.node[:]
        graph.node.extend(rewritten)
        order = {o: k for k, n in enumerate(nodes) for o in n.output}
        recomputed = tuple(sorted(renamed, key=order.__getitem__))
        plan = RecomputePlan(boundaries, tuple(sorted(kept, key=order.__getitem__)),
                             recomputed)
        return PassResult(model, plan, changed=bool(renamed))


def _ancestors(nodes: Sequence[onnx.NodeProto], producer: dict[str, int],
               outputs: Sequence[str]) -> set[int]:
    """The indices of the nodes ``outputs`` depend on (subgraphs' outer reads included)."""
    seen: set[int] = set()
    stack = [producer[o] for o in outputs if o in producer]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producer[v] for v in node_reads(nodes[i]) if v in producer)
    return seen


def _dependent(nodes: Sequence[onnx.NodeProto], forward: set[int], data: set[str]) -> set[str]:
    """The forward values computed from the data (not from weights and constants alone)."""
    dependent = set(data)
    for i in sorted(forward):
        if any(v in dependent for v in node_reads(nodes[i])):
            dependent.update(o for o in nodes[i].output if o)
    return dependent


def _check_boundaries(boundaries: Sequence[str], nodes: Sequence[onnx.NodeProto],
                      forward: set[int]) -> None:
    values = [o for i in sorted(forward) for o in nodes[i].output if o]
    for name in boundaries:
        if name not in values:
            raise UnknownNameError(
                f"recompute= names {name!r}, which is not a value the forward computes: name "
                "tensors between layers (node outputs of the inference model)."
                + suggest(name, values, "forward values"))


def _backward_reads(nodes: Sequence[onnx.NodeProto], forward: set[int], values: set[str]
                    ) -> set[str]:
    """The forward values (of ``values``: the float activations, or all of them) the
    backward reads: what it keeps without recomputation."""
    return {v for i, node in enumerate(nodes) if i not in forward
            for v in node_reads(node) if v in values}


def _chain_roots(nodes: Sequence[onnx.NodeProto], forward: set[int], dependent: set[str],
                 outputs: set[str]) -> tuple[str, ...]:
    """The boundaries of ``"activations"``, in forward order: each activation the backward
    reads that elementwise arithmetic (:data:`ARITHMETIC_OPS`) cannot compute from the
    boundaries before it, and the graph's ``outputs`` (held to the end anyway). The other
    activations the backward reads, computed from those alone by such arithmetic (a
    decomposed GELU's intermediates from its input, a SiLU's sigmoid), and the views
    (:data:`VIEW_OPS`) of those, are recomputed: fewer bytes kept, never more, since what
    they are computed from is kept anyway. A recomputed view's shape is kept (a few
    numbers); a view of a boundary is one too (a view of a kept value holds no memory of
    its own, where a copy of it would)."""
    read = _backward_reads(nodes, forward, dependent)
    computable: set[str] = set()  # computed from the boundaries by arithmetic alone
    boundaries: dict[str, None] = {}  # in forward order

    def keep(value: str) -> None:
        boundaries[value] = None
        computable.add(value)

    for i in sorted(forward):
        node = nodes[i]
        cheap = is_onnx_op(node, *ARITHMETIC_OPS) and all(
            v in computable for v in node_reads(node) if v in dependent)
        if is_onnx_op(node, *VIEW_OPS) and node.input[0] in computable \
                and node.input[0] not in boundaries:
            cheap = True
            for shape in node.input[1:]:
                if shape in dependent and shape not in computable:
                    keep(shape)
        for value in node.output:
            if not value or value not in dependent:
                continue
            if cheap and value not in outputs:
                computable.add(value)
            elif value in read or value in outputs:
                keep(value)
    return tuple(boundaries)


def _auto_boundaries(nodes: Sequence[onnx.NodeProto], forward: set[int], floats: set[str],
                     needed: set[str], facts: ForwardFacts) -> tuple[str, ...]:
    """Boundaries among the forward's cuts, greedily: a cut becomes one once the
    activations the backward reads (``needed``) since the last boundary reach
    ``total / k``, with ``k = sqrt(total / mean cut)`` (sizes from the inferred shapes, an
    unknown dimension counted 1: every activation shares the batch), Chen et al.'s budget
    (module doc); ``floats``: the float activations."""
    order = sorted(forward)
    last_read: dict[str, int] = {}  # the last forward node reading each value
    for i in order:
        for v in node_reads(nodes[i]):
            last_read[v] = i
    live: set[str] = set()
    cuts = set()
    for i in order:
        live.update(o for o in nodes[i].output if o in floats)
        live = {v for v in live if last_read.get(v, -1) > i}
        if len(live) == 1 and next(iter(live)) in nodes[i].output:
            cuts.add(next(iter(live)))
    if not cuts:
        raise UnsupportedModelError(
            "recompute='auto' found no cut in the forward graph (a value every path of "
            "activations passes through) to keep: name the boundaries, recompute=[...].")
    total = sum(_size(facts, v) for v in needed) or 1
    budget = total / max(1, round(math.sqrt(total / (sum(_size(facts, c) for c in cuts)
                                                     / len(cuts)))))
    boundaries, gathered = [], 0
    for i in order:
        gathered += sum(_size(facts, o) for o in nodes[i].output if o in needed)
        cut = next((o for o in nodes[i].output if o in cuts), None)
        if cut is not None and gathered >= budget:
            boundaries.append(cut)
            gathered = 0
    if len(boundaries) > 1 and gathered < budget / 2:
        boundaries.pop()  # the tail rounds to no segment: it joins the last one
    return tuple(boundaries)


def _kept_whole(nodes: Sequence[onnx.NodeProto], forward: set[int], needed: set[str],
                boundaries: Sequence[str], facts: ForwardFacts, budget: float | None
                ) -> set[int]:
    """The forward nodes of the segments (between consecutive ``boundaries``) kept whole:
    the last one's (after the last boundary: the backward reads it first, while the
    forward's values are still there, so that recomputing it would hold as much), and
    under ``budget`` (module docstring) more, or an UnsupportedOptionError where
    recomputing every other segment still keeps more."""
    ends, segments, current = set(boundaries), [], []
    for i in sorted(forward):
        current.append(i)
        if any(o in ends for o in nodes[i].output):
            segments.append(current)
            current = []
    segments.append(current)  # after the last boundary (empty where it is an output's)
    last = len(segments) - 1
    if budget is None:
        return set(segments[last])
    held = [sum(_size(facts, o) for i in segment for o in nodes[i].output
                if o in needed and o not in ends) for segment in segments]
    # a segment's recomputation computes each of its nodes' outputs again
    work = [sum(_size(facts, o) for i in segment for o in nodes[i].output if o)
            for segment in segments]
    produced = {o for i in forward for o in nodes[i].output}
    always = sum(_size(facts, v) for v in needed - produced)  # the data, never recomputed
    total = sum(_size(facts, v) for v in needed) or 1

    def peak(whole: set[int]) -> int:
        """What the backward holds at most: boundaries the backward or a recomputed
        segment reads, the segments kept whole, and the largest recomputed one or the
        last (whose values the backward is done with before it recomputes any)."""
        kept = sum(_size(facts, b) for k, b in enumerate(boundaries)
                   if b in needed or k + 1 not in whole)
        return always + kept + sum(held[k] for k in whole - {last}) + max(
            (held[k] for k in range(len(segments)) if k not in whole or k == last),
            default=0)

    least = peak({last})
    if least > budget * total:
        named = "the boundary" if len(boundaries) == 1 else f"the {len(boundaries)} boundaries"
        raise UnsupportedOptionError(
            f"recompute={budget!r} keeps at most {budget:.0%} of the activations the backward "
            f"reads, but with every segment but the last recomputed the backward still holds "
            f"{least / total:.0%} of them here (the data, {named} and "
            f"one segment at a time, estimated from the inferred shapes): raise the budget "
            f"to {math.ceil(100 * least / total) / 100} or more, or name the boundaries "
            f"(recompute=[...]).")
    whole = {last}
    for k in sorted(range(last), key=lambda k: -work[k] / max(held[k], 1)):
        if peak(whole | {k}) <= budget * total:
            whole.add(k)
    return {i for k in whole for i in segments[k]}


def _size(facts: ForwardFacts, value: str) -> int:
    """The elements of ``value``, an unknown dimension counted 1."""
    return math.prod(d if isinstance(d, int) and d > 0 else 1
                     for d in facts.shapes.get(value, ()))


@dataclass(frozen=True)
class UpdatesInBackwardOrder(Pass[None]):
    """A step graph's weight updates (a gradient graph's gradients) last in its node list,
    the weights the forward reads last placed last, so that onnxruntime computes each
    weight's gradient and update as soon as the backward reaches its layer.

    Why: onnxruntime's default execution order is a depth-first walk back from the graph's
    leaves (the nodes nothing reads), the last leaf first. With the updates in the
    signature's order (an export lists biases and norms apart from the matrices), the walk
    runs the whole backward for the first weights it meets and leaves the other layers'
    bias and norm gradients to the end, keeping the activation gradients they read alive
    all along: the recomputation saves nothing then. Values unchanged, only node order.
    """

    def call(self, model: onnx.ModelProto) -> PassResult[None]:
        graph = model.graph
        signature = Signature.of(model) if read_json(model, SIGNATURE_KEY) else None
        first_read: dict[str, int] = {}
        for position, node in enumerate(graph.node):
            for value in node_reads(node):
                first_read.setdefault(value, position)
        weight_of = {gradient: weight
                     for weight, gradient in (read_json(model, GRADIENTS_KEY) or {}).items()}
        if signature is not None:
            weight_of.update((signature.new[old], weight) for weight in signature.weights
                             for old in (weight, *signature.states.get(weight, []))
                             if old in signature.new)
        read = {v for node in graph.node for v in node_reads(node)}
        updates = [node for node in graph.node
                   if any(o in weight_of for o in node.output)
                   and not any(o in read for o in node.output)]
        if not updates:
            return PassResult(model, None, changed=False)
        moved = {id(node) for node in updates}
        key = {id(node): first_read.get(weight_of[next(o for o in node.output
                                                       if o in weight_of)], -1)
               for node in updates}
        ordered = [node for node in graph.node if id(node) not in moved] \
            + sorted(updates, key=lambda node: key[id(node)])
        kept = [onnx.NodeProto() for _ in ordered]
        for copy, node in zip(kept, ordered):
            copy.CopyFrom(node)
        del graph.node[:]
        graph.node.extend(kept)
        return PassResult(model, None)
