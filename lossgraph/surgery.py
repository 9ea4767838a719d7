"""Graph surgery on whole models: a vector-Jacobian graph cut in two, two graphs chained.

- :func:`split_gradient`: the forward half and the backward half of a gradient graph, so
  that training computes the forward pass once and the backward half reads its residuals;
- :func:`chain_graphs`: one model running two (a runner's two runs as one session);
- :func:`giving_only`: a model giving only some of its outputs.

The first two return models under the pass contract's checks
(:func:`lossgraph.models.check_emitted`), at the source's IR version; the third a copy of a
model it was given, its graph's outputs fewer.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from .errors import InternalError
from .graphs import (
    ForwardFacts,
    GraphIndex,
    names_in_graph,
    outer_references,
    rename_values,
    subgraphs,
)
from .metadata import GRADIENTS_KEY, read_json
from .models import check_emitted
from .names import NameAuthority

__all__ = ["GradientHalves", "split_gradient", "chain_graphs", "giving_only"]


@dataclass(frozen=True)
class GradientHalves:
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
                   seeds: Sequence[str]) -> GradientHalves:
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
    index = GraphIndex(graph.node)
    reads = [[*dict.fromkeys([*node.input, *(n for sub in subgraphs(node)
                                              for n in sorted(outer_references(sub)))])]
             for node in graph.node]

    def needed(targets: Sequence[str], known: set[int]) -> set[int]:
        """The positions of the nodes computing ``targets``, but those in ``known``."""
        found: set[int] = set()
        pending = [p for t in targets if (p := index.position(t)) is not None]
        while pending:
            position = pending.pop()
            if position not in found and position not in known:
                found.add(position)
                pending.extend(p for n in reads[position]
                               if (p := index.position(n)) is not None)
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
    return GradientHalves(forward, backward, outputs, residuals, reused, seeds, gradients)


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


def giving_only(model: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs are those of its outputs named in ``names``.

    onnxruntime holds every output of a run until the run ends; another value is freed
    after its last reader. A forward half chained with its backward half
    (:func:`chain_graphs`) gives its activations as outputs: given only what the runner
    reads, they are freed as the backward is done with them. An InternalError where
    ``names`` holds a name that is not an output of ``model``.
    """
    wanted = set(names)
    missing = wanted - {o.name for o in model.graph.output}
    if missing:
        raise InternalError(f"giving_only: {sorted(missing)} are not outputs of the model.")
    given = onnx.ModelProto()
    given.CopyFrom(model)
    kept = [o for o in given.graph.output if o.name in wanted]
    del given.graph.output[:]
    given.graph.output.extend(kept)
    return given
