"""Control flow.

    If(c) <then_branch = T, else_branch = E>
        ->  dv = If(c) <then_branch = vjp(T, v, dy), else_branch = vjp(E, v, dy)>

for every outer value ``v`` the branches capture whose gradient is wanted (the
condition has none). Each gradient branch recomputes its forward branch under fresh
names and differentiates it with the same walker, seeded with the gradients of the
If's outputs; a branch that does not use ``v`` yields zeros for it.

Loops run a body ``(s', y_t) = B(s, x_t; c)`` once per iteration ``t = 0 .. T-1``
(states ``s``, scanned slices ``x_t`` and stacked outputs ``y_t``, captured outer
values ``c``). With ``vjp(B)`` the body's vector-Jacobian product from the same walker:

    (ds_t, dx_t, dc_t) = vjp(B at s_t, x_t)(ds_{t+1}, dy_t),
    ds_T = d(final states),   ds = ds_0,   dc = sum_t dc_t

    Scan(s_0, x) <body = B>
        ->  s_t      = Scan(s_0, x) <body = B, also output s (the state each step reads)>
            ds, dc, dx = Scan(ds_T, 0, s_t, x, dy) <body = B then vjp(B), reversed>

The reverse Scan walks the iterations last to first (every scan direction flipped, the
axes kept), recomputes each step's body from the recorded state ``s_t`` and the slice
``x_t``, carries ``ds`` and the running sum ``dc``, and writes ``dx_t`` where ``x_t``
was read. ``Loop`` is the same with ``t`` its iteration number and ``x_t`` none: a copy
of the Loop records ``t`` and ``s_t`` as scan outputs (their count is the number of
iterations the condition allowed), and the reverse Scan runs over them with the
condition fixed to true (each recorded step ran with it true). Trip count and condition
carry no gradient; a loop-carried value whose shape changes across iterations cannot be
recorded and is an :class:`~lossgraph.errors.UnsupportedModelError`. Where a Loop may
run no iteration, the reverse Scan runs in ``If(T > 0)``: onnxruntime's Scan fails on an
empty sequence (a forward Scan over one fails there too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...builder import GraphBuilder
from ...errors import UnsupportedModelError
from ...graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    Shape,
    is_default_domain,
    names_in_graph,
    outer_references,
    rename_values,
    subgraphs,
)
from ..context import GradContext, Node
from ..registry import grad_rule


@grad_rule("If", nondiff=(0,), notes="both branches; gradients flow to captured outer values")
def if_(g, node, *dys):
    wanted = [name for name in node.wanted if name != node.inputs[0]]
    branches = {
        key: _branch_gradient(g, node.attr(key), dys, wanted)
        for key in ("then_branch", "else_branch")
    }
    outputs = [g.names.fresh(f"{name}_grad_if") for name in wanted]
    g.op("If", node.inputs[0], outputs=outputs, **branches)
    return dict(zip(wanted, outputs))


def _branch_gradient(g, branch: onnx.GraphProto, dys: Sequence[str | None],
                     wanted: Sequence[str]) -> onnx.GraphProto:
    """A graph with no inputs whose outputs are the gradients of ``wanted`` through ``branch``."""
    body = onnx.GraphProto()
    body.CopyFrom(branch)
    outer = outer_references(branch)
    local = sorted(names_in_graph(body) - outer)
    rename_values(body, {name: g.names.fresh(name) for name in local})
    for node in body.node:
        node.name = g.names.fresh(node.name or node.op_type)

    declared = sorted(set(outer) | set(wanted))
    inputs = [g.value_info(name) for name in declared]
    domains = sorted({n.domain for n in body.node if not is_default_domain(n.domain)})
    model = helper.make_model(
        helper.make_graph(list(body.node), "branch", inputs, list(body.output),
                          list(body.initializer)),
        opset_imports=[helper.make_opsetid("", g.opset),
                       *(helper.make_opsetid(d, 1) for d in domains)],
    )
    seeds = {out.name: dy for out, dy in zip(body.output, dys) if dy is not None}
    grad_names = {name: g.names.fresh(f"{name}_grad") for name in wanted}
    gradients = g.differentiate(model, seeds, list(wanted), grad_names,
                                zeros_for_unreached=True)
    return helper.make_graph(
        [*body.node, *gradients.nodes],
        g.names.fresh("gradient_branch"),
        [],
        [helper.make_tensor_value_info(grad_names[n], g.elem_type(n), g.shape(n))
         for n in wanted],
        [*body.initializer, *gradients.initializers],
    )


# ------------------------------------------------------------------ Scan and Loop
@dataclass
class _Plan:
    """How a loop body's inputs and outputs (by position) map onto its reverse Scan."""

    #: float states: (body input, body output, gradient of the final state, outer graph)
    carried: list[tuple[int, int, str]] = field(default_factory=list)
    #: (body input, stacked outer value, axis, direction in the reverse Scan)
    scanned: list[tuple[int, str, int, int]] = field(default_factory=list)
    #: (body output, gradient of its stacked outer value, axis, direction in the reverse Scan)
    seeded: list[tuple[int, str, int, int]] = field(default_factory=list)
    #: (body input, axis, direction): its gradient, stacked by the reverse Scan
    emitted: list[tuple[int, int, int]] = field(default_factory=list)
    #: body inputs that every recorded iteration read as this constant (Loop's condition)
    fixed: dict[int, bool] = field(default_factory=dict)
    #: (body input, body output) of every state: one shape across iterations
    states: list[tuple[int, int]] = field(default_factory=list)
    #: the number of iterations where it may be 0 (Loop): onnxruntime's Scan fails on an
    #: empty sequence, so the reverse Scan then runs in ``If(steps > 0)``
    steps: str | None = None


def _renamed_copy(g: GradContext, body: onnx.GraphProto) -> onnx.GraphProto:
    """``body`` with fresh names for its values and nodes (outer references kept), each
    output a distinct value computed by a node: an output that repeats another, or
    passes a body input, an initializer or an outer value through, is copied by
    ``Identity`` (onnxruntime's Scan computes wrong values for a state input returned as is)."""
    copy = onnx.GraphProto()
    copy.CopyFrom(body)
    local = sorted(names_in_graph(copy) - outer_references(body))
    rename_values(copy, {name: g.names.fresh(name) for name in local})
    for node in copy.node:
        node.name = g.names.fresh(node.name or node.op_type)
    seen = {v.name for v in copy.input} | {t.name for t in copy.initializer}
    seen |= outer_references(copy)
    for output in copy.output:
        if output.name in seen:
            fresh = g.names.fresh(output.name)
            copy.node.append(helper.make_node("Identity", [output.name], [fresh],
                                              name=g.names.fresh("Identity")))
            output.name = fresh
        seen.add(output.name)
    return copy


def _recording(g: GradContext, body: onnx.GraphProto,
               positions: Sequence[int]) -> onnx.GraphProto:
    """A renamed copy of ``body`` that also outputs its inputs at ``positions`` (the
    values each iteration reads), as scan outputs after its own."""
    copy = _renamed_copy(g, body)
    for position in positions:
        value = copy.input[position]
        record = g.names.fresh(f"{value.name}_record")
        copy.node.append(helper.make_node("Identity", [value.name], [record],
                                          name=g.names.fresh("Identity")))
        copy.output.append(helper.make_value_info(record, value.type))
    return copy


def _dims(value: onnx.ValueInfoProto) -> list | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim]


def _typed(declared: onnx.ValueInfoProto, outer: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """A body input as declared, its element type and shape taken from ``outer`` (what
    the outer graph knows of the value bound to it) where the body leaves them out."""
    if declared.type.WhichOneof("value") not in (None, "tensor_type"):
        return declared
    elem_type = declared.type.tensor_type.elem_type or outer.type.tensor_type.elem_type
    shape = _dims(declared) if declared.type.tensor_type.HasField("shape") else _dims(outer)
    return helper.make_tensor_value_info(declared.name, elem_type, shape)


def _sliced(g: GradContext, name: str, axis: int) -> onnx.ValueInfoProto:
    """What the outer graph knows of one slice of ``name`` along ``axis``."""
    whole = g.value_info(name)
    dims = _dims(whole)
    if dims:
        del dims[axis % len(dims)]
    return helper.make_tensor_value_info(name, whole.type.tensor_type.elem_type, dims)


def _is_float(g: GradContext, name: str) -> bool:
    return g.value_info(name).type.tensor_type.elem_type in FLOAT_TYPES


def _body_model(g: GradContext, body: onnx.GraphProto, outer: Sequence[onnx.ValueInfoProto],
                wanted: Sequence[str]) -> onnx.ModelProto:
    """``body`` as a model of its own: its inputs typed (``outer`` fills in what it leaves
    out), the outer values it reads as inputs, or as initializers where they are
    constants whose gradient is not wanted (axes and indices, which rules read)."""
    inputs = [_typed(v, o) for v, o in zip(body.input, outer)]
    captured, constants = [], []
    for name in sorted(outer_references(body)):
        value = g.value(name)
        if value is not None and name not in wanted:
            constants.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            captured.append(g.value_info(name))
    domains = sorted({n.domain for n in body.node if not is_default_domain(n.domain)})
    return helper.make_model(
        helper.make_graph(list(body.node), "body", [*inputs, *captured], list(body.output),
                          [*body.initializer, *constants], value_info=list(body.value_info)),
        opset_imports=[helper.make_opsetid("", g.opset),
                       *(helper.make_opsetid(d, 1) for d in domains)],
    )


def _check_states(node: Node, body: onnx.GraphProto, facts: ForwardFacts,
                  states: Sequence[tuple[int, int]]) -> None:
    """Each state keeps its shape across iterations, where shape inference can tell."""
    for index, (into, out) in enumerate(states):
        before = facts.shapes.get(body.input[into].name)
        after = facts.shapes.get(body.output[out].name)
        if before is None or after is None:
            continue
        if len(before) != len(after) or any(
                isinstance(a, int) and isinstance(b, int) and a != b
                for a, b in zip(before, after)):
            raise UnsupportedModelError(
                f"{node.op_type} node {node.name or '<unnamed>'!r} changes the shape of its "
                f"state {index} from {_shown(before)} to "
                f"{_shown(after)} in one iteration. Its gradient recomputes each iteration from "
                "the values it read, recorded as scan outputs, which need one shape across "
                "iterations. Keep the state's shape fixed (pad it), or train only weights "
                "that do not pass through the loop (weights=...).")


def _shown(shape: Shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _live(nodes: Sequence[onnx.NodeProto], outputs: Sequence[str]) -> list[onnx.NodeProto]:
    """The nodes that ``outputs`` depend on (reads by subgraphs included), in order."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
            needed.update(n for sub in subgraphs(node) for n in outer_references(sub))
    return kept[::-1]


def _reverse(g: GradContext, node: Node, body: onnx.GraphProto,
             outer: Sequence[onnx.ValueInfoProto], plan: _Plan
             ) -> tuple[list[str], list[str], dict[str, str]]:
    """Emit the reverse Scan of a loop: its body recomputes ``body`` (a renamed copy) on
    each recorded step and runs its vector-Jacobian product.

    Returns the gradients of the initial states (``plan.carried`` order), the stacked
    gradients of ``plan.emitted``, and the gradients of the wanted captured values.
    """
    captured = [n for n in node.wanted if n in outer_references(body)]
    model = _body_model(g, body, outer, captured)
    facts = ForwardFacts.of(model)
    _check_states(node, body, facts, plan.states)

    name_in = [v.name for v in body.input]
    name_out = [v.name for v in body.output]
    carries = {i: g.names.fresh(f"{name_out[o]}_grad_carry") for i, o, _ in plan.carried}
    slices = {o: g.names.fresh(f"{name_out[o]}_grad_slice") for o, _, _, _ in plan.seeded}
    seeds = {name_out[o]: carries[i] for i, o, _ in plan.carried}
    seeds.update({name_out[o]: slices[o] for o in slices})
    wanted = list(dict.fromkeys([name_in[i] for i, _, _ in plan.carried]
                                + [name_in[i] for i, _, _ in plan.emitted] + captured))
    grads = {name: g.names.fresh(f"{name}_grad") for name in wanted}
    vjp = g.differentiate(model, seeds, wanted, grads, facts, zeros_for_unreached=True)

    def typed(name: str, like: str, ranked: bool = False) -> onnx.ValueInfoProto:
        """``name`` typed like the body's value ``like`` (unknown dims left open); a
        ``ranked`` one must have a known rank: onnxruntime's Scan wants its outputs'."""
        shape = facts.shapes.get(like)
        if shape is None and ranked:
            raise UnsupportedModelError(
                f"The gradient of {node.op_type} node {node.name or '<unnamed>'!r} needs the "
                f"rank of {like!r}, which shape inference does not find. Give the model's "
                "inputs, and the loop body's inputs, static ranks.")
        dims = None if shape is None else [d if isinstance(d, int) else None for d in shape]
        return helper.make_tensor_value_info(
            name, facts.elem_types.get(like, onnx.TensorProto.UNDEFINED), dims)

    # the reverse step: fixed inputs, the body, its VJP, the sums of captured gradients
    b = GraphBuilder(g.names, g.opset, prefix=g.prefix)
    for position, value in plan.fixed.items():
        b.op("Constant", outputs=[name_in[position]],
             value=numpy_helper.from_array(np.array(value), "value"))
    fixed, b.nodes = b.nodes, []
    sums = {c: g.names.fresh(f"{c}_grad_sum") for c in captured}
    totals = [b.Add(sums[c], grads[c], hint=f"{c}_grad_sum") for c in captured]
    results = ([(grads[name_in[i]], name_in[i]) for i, _, _ in plan.carried]
               + list(zip(totals, captured))
               + [(grads[name_in[i]], name_in[i]) for i, _, _ in plan.emitted])
    produced = {o for n in [*fixed, *body.node, *vjp.nodes, *b.nodes] for o in n.output}
    outputs: list[str] = []
    for value, _ in results:  # the body's outputs: distinct values computed in it
        outputs.append(value if value in produced and value not in outputs
                       else b.Identity(value))
    nodes = _live([*fixed, *body.node, *vjp.nodes, *b.nodes], outputs)
    read = {i for n in nodes for i in n.input}
    read.update(n for node_ in nodes for sub in subgraphs(node_) for n in outer_references(sub))
    step = helper.make_graph(
        nodes, g.names.fresh(f"{node.op_type.lower()}_gradient_body"),
        [typed(carries[i], name_in[i]) for i, _, _ in plan.carried]
        + [typed(sums[c], c) for c in captured]
        + [typed(name_in[i], name_in[i]) for i, _, _, _ in plan.scanned]
        + [typed(slices[o], name_out[o]) for o, _, _, _ in plan.seeded],
        [typed(name, like, ranked=True) for name, (_, like) in zip(outputs, results)],
        [t for t in [*body.initializer, *vjp.initializers] if t.name in read])

    initial = [seed for _, _, seed in plan.carried] + [g.zeros_like(c) for c in captured]
    values = _reverse_scan(g, plan, step, initial, hint=f"{node.op_type.lower()}_grad")
    count = len(plan.carried)
    return (values[:count], values[count + len(captured):],
            dict(zip(captured, values[count:count + len(captured)])))


def _reverse_scan(g: GradContext, plan: _Plan, step: onnx.GraphProto, initial: Sequence[str],
                  hint: str) -> list[str]:
    """``Scan`` of ``step`` over ``plan.scanned`` and ``plan.seeded`` from the carries
    ``initial``: the final carries, then the stacked ``plan.emitted``. Where the loop may
    not have run (``plan.steps``), in ``If(steps > 0)``, whose other branch returns the
    carries as they came in."""
    scanned = [(v, axis, d) for _, v, axis, d in [*plan.scanned, *plan.seeded]]
    attributes = dict(body=step, num_scan_inputs=len(scanned),
                      scan_input_axes=[axis for _, axis, _ in scanned],
                      scan_input_directions=[d for _, _, d in scanned],
                      scan_output_axes=[axis for _, axis, _ in plan.emitted] or None,
                      scan_output_directions=[d for _, _, d in plan.emitted] or None)
    inputs = [*initial, *[v for v, _, _ in scanned]]
    count = len(step.output)
    if plan.steps is None:
        return _names(g.op("Scan", *inputs, outputs=count, hint=hint, **attributes))
    assert count == len(initial), "a loop that may not run has no stacked gradients"
    ran, kept = (GraphBuilder(g.names, g.opset, prefix=g.prefix) for _ in range(2))
    results = _names(ran.op("Scan", *inputs, outputs=count, hint=hint, **attributes))
    as_is = [kept.Identity(v) for v in initial]

    def branch(b: GraphBuilder, values: list[str], name: str) -> onnx.GraphProto:
        types = [onnx.ValueInfoProto(name=v, type=out.type) for v, out in zip(values, step.output)]
        return helper.make_graph(b.nodes, g.names.fresh(name), [], types)

    any_steps = g.Greater(plan.steps, g.const(0, np.int64, "zero"))
    return _names(g.op("If", any_steps, outputs=count, hint=hint,
                       then_branch=branch(ran, results, f"{hint}_steps"),
                       else_branch=branch(kept, as_is, f"{hint}_no_steps")))


def _names(values: str | tuple[str, ...]) -> list[str]:
    return [values] if isinstance(values, str) else list(values)


def _answer(g: GradContext, node: Node, pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Every wanted value's gradient: the sum of its ``(value, gradient)`` contributions."""
    terms: dict[str, list[str]] = {name: [] for name in node.wanted}
    for name, grad in pairs:
        if name in terms:
            terms[name].append(grad)
    return {name: g.sum_of(grads) if grads else g.zeros_like(name)
            for name, grads in terms.items()}


def _zeros_for(g: GradContext, output: str, like: str) -> str:
    """Zeros shaped like the forward ``output``, in the element type of ``like``."""
    shape = g.shape(output)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return g.const(np.zeros(shape), g.dtype(like), "zeros")
    return g.filled(g.Shape(output), 0, like, hint="zeros")


def _runs(g: GradContext, node: Node) -> bool:
    """Whether a Loop runs at least once: its trip count and condition, where given, are
    constants that let it (a positive count, true)."""
    trips, go = node.input(0), node.input(1)
    count, condition = g.value(trips), g.value(go)
    return ((trips is None or (count is not None and int(np.reshape(count, -1)[0]) > 0))
            and (go is None or (condition is not None and bool(np.reshape(condition, -1)[0]))))


def _copy_attributes(node: Node, **changed) -> dict:
    """The node's attributes as keyword arguments, ``changed`` ones replaced."""
    attributes = {a.name: node.attr(a.name) for a in node.proto.attribute}
    attributes.update(changed)
    return {k: v for k, v in attributes.items() if v is not None}


@grad_rule("Scan", since=9, notes="states, scan inputs and outputs (any axes and directions), "
                                  "captured values; recomputes each step in a reverse Scan")
def scan(g: GradContext, node: Node, *dys: str | None) -> dict[str, str]:
    """(s', y_t) = B(s, x_t; c):  ds_t, dx_t, dc_t += vjp(B at s_t, x_t)(ds_{t+1}, dy_t),
    over the steps last to first by a Scan with every direction flipped (module docstring)."""
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    n = len(node.inputs) - m
    k = len(node.outputs) - n
    in_axes = list(node.attr("scan_input_axes") or [0] * m)
    in_dirs = list(node.attr("scan_input_directions") or [0] * m)
    out_axes = list(node.attr("scan_output_axes") or [0] * k)
    out_dirs = list(node.attr("scan_output_directions") or [0] * k)
    states, xs = node.inputs[:n], node.inputs[n:]
    plan = _Plan(states=[(i, i) for i in range(n)])
    if n:  # the states each step reads, recorded by a copy of the Scan
        attributes = {"body": _recording(g, body, range(n))}
        if node.attr("scan_output_axes") is not None:
            attributes["scan_output_axes"] = [*out_axes, *[0] * n]
        if node.attr("scan_output_directions") is not None:
            attributes["scan_output_directions"] = [*out_dirs, *[0] * n]
        recorded = _names(g.op("Scan", *node.inputs, outputs=n + k + n, hint="scan_record",
                               **_copy_attributes(node, **attributes)))
        plan.scanned += [(i, recorded[n + k + i], 0, 1) for i in range(n)]
    plan.carried = [(i, i, dys[i] if dys[i] is not None else g.zeros_like(states[i]))
                    for i in range(n) if _is_float(g, states[i])]
    plan.scanned += [(n + j, x, in_axes[j], 1 - in_dirs[j]) for j, x in enumerate(xs)]
    plan.seeded = [(n + j, dys[n + j], out_axes[j], 1 - out_dirs[j]) for j in range(k)
                   if dys[n + j] is not None]
    emitted = [j for j, x in enumerate(xs) if x in node.wanted]
    plan.emitted = [(n + j, in_axes[j], 1 - in_dirs[j]) for j in emitted]
    outer = [g.value_info(s) for s in states] + \
            [_sliced(g, x, axis) for x, axis in zip(xs, in_axes)]
    finals, stacked, captured = _reverse(g, node, _renamed_copy(g, body), outer, plan)
    pairs = [(states[i], grad) for (i, _, _), grad in zip(plan.carried, finals)]
    pairs += [(xs[j], grad) for j, grad in zip(emitted, stacked)]
    return _answer(g, node, [*pairs, *captured.items()])


@grad_rule("Loop", nondiff=(0, 1), notes="loop-carried values, scan outputs, captured values; "
                                         "a reverse Scan over the recorded iterations")
def loop(g: GradContext, node: Node, *dys: str | None) -> dict[str, str]:
    """(cond', s', y_t) = B(t, cond, s; c):  ds_t, dc_t += vjp(B at t, s_t)(ds_{t+1}, dy_t),
    over the iterations that ran (recorded by a copy of the Loop), last to first
    (module docstring). The trip count and the condition carry no gradient."""
    body = node.attr("body")
    n = len(node.inputs) - 2
    k = len(node.outputs) - n
    states = node.inputs[2:]
    for s in states:
        if g.value_info(s).type.tensor_type.elem_type == onnx.TensorProto.UNDEFINED:
            raise UnsupportedModelError(
                f"Loop node {node.name or '<unnamed>'!r} carries {s!r}, which is not a tensor "
                "of known type (a sequence or an optional?). Its gradient records each "
                "iteration's loop-carried values as scan outputs, which must be tensors.")
    plan = _Plan(states=[(2 + i, 1 + i) for i in range(n)], fixed={1: True})
    if n:  # the iteration numbers and the states each iteration reads, recorded
        recorded = _names(g.op("Loop", *node.inputs, outputs=n + k + 1 + n, hint="loop_record",
                               body=_recording(g, body, [0, *range(2, n + 2)])))
        iterations = recorded[n + k]
        plan.steps = g.Squeeze(g.dims(iterations, 0, 1), hint="steps")
        plan.scanned += [(2 + i, recorded[n + k + 1 + i], 0, 1) for i in range(n)]
    else:  # as many iterations as stacked outputs
        plan.steps = g.Squeeze(g.dims(node.outputs[0], 0, 1), hint="steps")
        iterations = g.Range(g.const(0, np.int64, "zero"), plan.steps,
                             g.const(1, np.int64, "one"))
    plan.scanned.insert(0, (0, iterations, 0, 1))
    if _runs(g, node):
        plan.steps = None
    plan.carried = [(2 + i, 1 + i, dys[i] if dys[i] is not None
                     else _zeros_for(g, node.outputs[i], states[i]))
                    for i in range(n) if _is_float(g, states[i])]
    plan.seeded = [(1 + n + j, dys[n + j], 0, 1) for j in range(k) if dys[n + j] is not None]
    outer = [helper.make_tensor_value_info("iteration", onnx.TensorProto.INT64, []),
             helper.make_tensor_value_info("condition", onnx.TensorProto.BOOL, []),
             *[g.value_info(s) for s in states]]
    finals, _, captured = _reverse(g, node, _renamed_copy(g, body), outer, plan)
    pairs = [(states[i - 2], grad) for (i, _, _), grad in zip(plan.carried, finals)]
    return _answer(g, node, [*pairs, *captured.items()])
