"""Control flow.

    If(c) <then_branch = T, else_branch = E>
        ->  dv = If(c) <then_branch = vjp(T, v, dy), else_branch = vjp(E, v, dy)>

for every outer value ``v`` the branches capture whose gradient is wanted (the
condition has none). Each gradient branch recomputes its forward branch under fresh
names and differentiates it with the same walker, seeded with the gradients of the
If's outputs; a branch that does not use ``v`` yields zeros for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from ...graphs import names_in_graph, outer_references, rename_values
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
    from ..walker import differentiate  # the walker imports the rule registry

    body = onnx.GraphProto()
    body.CopyFrom(branch)
    outer = outer_references(branch)
    local = sorted(names_in_graph(body) - outer)
    rename_values(body, {name: g.names.fresh(name) for name in local})
    for node in body.node:
        node.name = g.names.fresh(node.name or node.op_type)

    declared = sorted(set(outer) | set(wanted))
    inputs = [g.value_info(name) for name in declared]
    domains = sorted({n.domain for n in body.node if n.domain not in ("", "ai.onnx")})
    model = helper.make_model(
        helper.make_graph(list(body.node), "branch", inputs, list(body.output),
                          list(body.initializer)),
        opset_imports=[helper.make_opsetid("", g.opset),
                       *(helper.make_opsetid(d, 1) for d in domains)],
    )
    seeds = {out.name: dy for out, dy in zip(body.output, dys) if dy is not None}
    grad_names = {name: g.names.fresh(f"{name}_grad") for name in wanted}
    gradients = differentiate(model, seeds, list(wanted), grad_names, g.names,
                              zeros_for_unreached=True)
    return helper.make_graph(
        [*body.node, *gradients.nodes],
        g.names.fresh("gradient_branch"),
        [],
        [helper.make_tensor_value_info(grad_names[n], g.elem_type(n), g.shape(n))
         for n in wanted],
        [*body.initializer, *gradients.initializers],
    )
