"""Reverse-mode differentiation of an ONNX graph, in standard ONNX ops.

The walker owns every hard part so that rules stay one-liners:

- **relevance**: only values both influenced by a requested weight and leading to
  a seed are differentiated; nothing else gets gradient nodes;
- **traversal**: nodes are visited in reverse topological order, each once;
- **accumulation**: a value used several times gets one ``Sum`` of its
  contributions, built once, when its producer is visited;
- **broadcasting**: for rules registered with ``broadcast=True`` each input
  gradient is summed back to the input's shape, over axes found from static shapes,
  or at run time where the shapes cannot tell;
- **the rule contract** (see :mod:`.registry`): the inputs a rule's registration
  declares ``nondiff`` get no gradient work; every rule's result is checked, one entry
  per input, a gradient for every wanted input and none for a ``nondiff`` one, else
  :class:`~lossgraph.errors.InvalidRuleError` naming the op, node, rule and counts;
- **no gradient**: a requested weight that no gradient can reach is a
  :class:`~lossgraph.errors.NoGradientError` naming the weight and the node that
  blocks it (an integer Cast, a comparison, a shape or index input), or saying it
  does not influence the seeds at all; never a silent zero. Only the gradient
  branches of ``If`` (``zeros_for_unreached=True``) take zeros for captured values
  a branch does not use;
- **missing rules**: an op on the path without a rule is a
  :class:`~lossgraph.errors.MissingGradientError` naming the op, the node and the
  path from the weight to the seed;
- **dead code**: gradient nodes whose results nothing uses are dropped;
- **subgraphs**: values an op's subgraphs capture from outer scopes count as its
  inputs; the op's rule returns their gradients by name (see ``rules/control.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import onnx

from ..analysis import differentiable_values, gradient_block, influenced_values
from ..errors import InvalidRuleError, MissingGradientError, NoGradientError
from ..graphs import (
    ForwardFacts,
    GraphIndex,
    captured_values,
    node_reads,
    opset_version,
    shortest_path,
)
from ..names import NameAuthority
from ..target import Target, active_target
from .context import GradContext, Node
from .registry import RuleInfo, differentiable_inputs, find_rule

__all__ = ["differentiate"]


def differentiate(
    model: onnx.ModelProto,
    seeds: Mapping[str, str],
    wrt: Sequence[str],
    grad_names: Mapping[str, str],
    names: NameAuthority,
    facts: ForwardFacts | None = None,
    *,
    zeros_for_unreached: bool = False,
    target: Target | None = None,
) -> GradContext:
    """Emit the gradients of ``seeds`` into a new GradContext.

    ``seeds`` maps forward values to the names of their incoming gradients (already
    defined: a constant one for a scalar loss, a graph input for a vector-Jacobian
    product). The gradient of each ``wrt`` value ends up in ``grad_names[w]``. The
    returned context holds exactly the nodes and constants needed for them, in
    topological order, ready to ``append_to`` the graph.

    A ``wrt`` value no gradient can reach is a :class:`NoGradientError`; with
    ``zeros_for_unreached`` (the branches of ``If``, where a branch may not use a
    captured value) it gets zeros instead. The rules emit for ``target`` (default: the
    active target, :func:`lossgraph.target.use_target`).
    """
    facts = facts or ForwardFacts.of(model)
    graph = model.graph
    g = GradContext(names, opset_version(model) or 1, facts, target or active_target(),
                    differentiate)
    relevant = influenced_values(model, wrt, facts.types) & differentiable_values(
        model, list(seeds), facts.types)
    unreached = [w for w in wrt if w not in relevant and w not in seeds]
    if unreached and not zeros_for_unreached:
        others = f" No gradient reaches {unreached[1:]} either." if unreached[1:] else ""
        raise NoGradientError(_no_gradient_message(model, unreached[0], seeds, facts) + others)
    relevant.update(wrt)

    grads: dict[str, list[str]] = defaultdict(list)
    for value, seed in seeds.items():
        grads[value].append(seed)

    for proto in reversed(graph.node):
        if not any(grads.get(o) for o in proto.output):
            continue
        opset = opset_version(model, proto.domain or "") or 1
        positions = [p for p in differentiable_inputs(proto.op_type, proto.domain,
                                                      len(proto.input), opset=opset)
                     if proto.input[p] in relevant]
        captured = [n for n in captured_values(proto) if n in relevant]
        if not positions and not captured:
            continue
        wanted = list(dict.fromkeys([proto.input[p] for p in positions] + captured))
        node = Node(proto, opset, wanted)
        info = find_rule(proto.op_type, proto.domain, opset)
        if info is None:
            raise MissingGradientError(_missing_rule_message(model, node, wrt, seeds, relevant))
        dys = [g.sum_of(grads[o], hint=f"{o}_grad") if grads.get(o) else None
               for o in proto.output]
        result = info.rule(g, node, *dys)
        if isinstance(result, Mapping):  # rules of ops with subgraphs: by value name
            answered = _checked_by_name(result, info, node)
            for name in wanted:
                grads[name].append(answered[name])
            continue
        if captured:
            raise InvalidRuleError(_rule_message(
                info, node, f"returned a sequence, but the node's subgraphs capture {captured}, "
                "whose gradients it must return by name (a dict)"))
        entries = _checked_entries(result, info, node, positions)
        for position in positions:
            grad = entries[position]
            if grad is None:  # the same value got its gradient at another position
                continue
            if info.broadcast:
                grad = g.unbroadcast(grad, proto.input[position], proto.output[0])
            grads[proto.input[position]].append(grad)

    finals = {}
    for w in wrt:
        if grads.get(w):
            finals[w] = g.sum_of(grads[w])
        elif zeros_for_unreached:
            finals[w] = g.zeros_like(w)
        else:  # every rule answered every wanted input: a relevant value always gets one
            raise NoGradientError(_no_gradient_message(model, w, seeds, facts))
    _bind_outputs(g, finals, grad_names)
    _drop_dead_code(g, list(grad_names.values()))
    return g


def _rule_message(info: RuleInfo, node: Node, problem: str) -> str:
    rule = f"{info.rule.__module__}.{info.rule.__qualname__}"
    return (
        f"The gradient rule {rule} for op {node.op_type!r} (node {node.name or '<unnamed>'!r}) "
        f"{problem}. A rule returns exactly one entry per input of the node: the name of "
        "its gradient, or None for an input without one (a bare name only for a "
        "single-input node); see lossgraph.autodiff.registry."
    )


def _checked_entries(result: object, info: RuleInfo, node: Node,
                     positions: Sequence[int]) -> list[str | None]:
    """The rule's result as one entry per input, or InvalidRuleError (the rule contract)."""
    count = len(node.inputs)
    if result is None or isinstance(result, str):
        if count != 1:
            raise InvalidRuleError(_rule_message(
                info, node, f"returned a single {'None' if result is None else 'name'} for a "
                f"node with {count} inputs"))
        entries = [result]
    elif isinstance(result, (tuple, list)):
        entries = list(result)
    else:
        raise InvalidRuleError(_rule_message(
            info, node, f"returned a {type(result).__name__}, not a tuple of names"))
    if len(entries) != count:
        raise InvalidRuleError(_rule_message(
            info, node, f"returned {len(entries)} entries for a node with {count} inputs "
            f"{node.inputs}"))
    for position, entry in enumerate(entries):
        if entry is not None and not isinstance(entry, str):
            raise InvalidRuleError(_rule_message(
                info, node, f"returned a {type(entry).__name__} for input {position}, not a "
                "name or None"))
        if entry is not None and not node.inputs[position]:
            raise InvalidRuleError(_rule_message(
                info, node, f"returned a gradient for input {position}, which is absent"))
        if entry is not None and position in info.nondiff:
            raise InvalidRuleError(_rule_message(
                info, node, f"returned a gradient for input {position} "
                f"({node.inputs[position]!r}), which its registration declares "
                f"non-differentiable (nondiff={tuple(sorted(info.nondiff))})"))
    for position in positions:
        name = node.inputs[position]
        if entries[position] is None and not any(
                entries[p] is not None for p, other in enumerate(node.inputs) if other == name):
            raise InvalidRuleError(_rule_message(
                info, node, f"returned None for input {position} ({name!r}), whose gradient is "
                "wanted: return zeros if the gradient is zero, raise "
                "lossgraph.errors.UnsupportedModelError if it cannot be computed, or declare "
                "the input in grad_rule(..., nondiff=...) if it never carries a gradient"))
    return entries


def _checked_by_name(result: Mapping, info: RuleInfo, node: Node) -> dict[str, str]:
    """A rule's gradients by value name, checked to answer every wanted value."""
    reads = set(node_reads(node.proto))
    unknown = [name for name in result if name not in reads]
    if unknown:
        raise InvalidRuleError(_rule_message(
            info, node, f"returned gradients for {unknown}, which the node does not read"))
    missing = [name for name in node.wanted if not isinstance(result.get(name), str)]
    if missing:
        raise InvalidRuleError(_rule_message(
            info, node, f"returned no gradient for {missing}, whose gradients are wanted"))
    return {name: result[name] for name in node.wanted}


def _no_gradient_message(model: onnx.ModelProto, w: str, seeds: Mapping[str, str],
                         facts: ForwardFacts) -> str:
    targets = list(seeds)
    shown = targets[0] if len(targets) == 1 else targets
    block = gradient_block(model, w, targets, facts.types)
    advice = (f" Remove {w!r} from the weights to differentiate or train (weights=); "
              "lossgraph.trainable_initializers(model) lists those that get a gradient.")
    if block.at < 0:
        return f"No gradient reaches {w!r}: it does not influence {shown!r} at all." + advice
    path = [_label(p) if isinstance(p, onnx.NodeProto) else p for p in block.path]
    return (
        f"No gradient reaches {w!r}: it influences {shown!r} only through values that carry "
        f"no gradient. On the path {' -> '.join(path)}, node {path[block.at]} blocks it: "
        f"{block.reason}." + advice
    )


def _label(n: onnx.NodeProto) -> str:
    return f"[{n.op_type} {n.name!r}]" if n.name else f"[{n.op_type}]"


def _bind_outputs(g: GradContext, finals: Mapping[str, str], grad_names: Mapping[str, str]) -> None:
    """Make each final gradient value available under its output name.

    The producing node is renamed in place when nothing else reads its value;
    otherwise (shared values, seeds, constants) an Identity carries it.
    """
    uses: dict[str, int] = defaultdict(int)
    for node in g.nodes:
        for name in node_reads(node):
            uses[name] += 1
    for value in finals.values():
        uses[value] += 1
    produced = {o for node in g.nodes for o in node.output}
    for w, value in finals.items():
        if value in produced and uses[value] == 1:  # read by nothing else: rename in place
            g.rename(value, grad_names[w], uses=False)
        else:
            g.Identity(value, outputs=[grad_names[w]])


def _drop_dead_code(g: GradContext, outputs: Sequence[str]) -> None:
    needed = set(outputs)
    kept = []
    for node in reversed(g.nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node_reads(node))
    g.nodes = kept[::-1]
    g.initializers = [t for t in g.initializers if t.name in needed]


def _missing_rule_message(model: onnx.ModelProto, node: Node, wrt: Sequence[str],
                          seeds: Mapping[str, str], relevant: set[str]) -> str:
    path = _path_through(model, node.proto, wrt, seeds, relevant)
    domain = node.proto.domain or "ai.onnx"
    return (
        f"No gradient rule for op {node.op_type!r} (domain {domain!r}, opset {node.opset}) "
        f"at node {node.name or '<unnamed>'!r}, which lies on the path {path}. "
        f"Register one with @lossgraph.grad_rule({node.op_type!r}"
        + (f", domain={node.proto.domain!r}" if node.proto.domain else "")
        + "), train only weights that do not pass through it (weights=...), or use "
        "backend='ort'. lossgraph.supported_ops() lists the covered ops."
    )


_PATH_ENDS = 5  # values and nodes shown at each end of a long path in error messages


def _path_through(model: onnx.ModelProto, target: onnx.NodeProto, wrt: Sequence[str],
                  seeds: Mapping[str, str], relevant: set[str]) -> str:
    """'w -> [Op 'name'] -> v -> ... -> loss' through ``target``, for error messages."""
    index = GraphIndex(model.graph.node)
    # backwards from the node to a requested weight
    back: list[str] = []
    current = next((i for i in target.input if i in relevant), None)
    while current is not None and current not in wrt:
        back.append(current)
        producer = index.producer(current)
        if producer is None:
            break
        back.append(_label(producer))
        current = next((i for i in producer.input if i in relevant), None)
    if current is not None:
        back.append(current)
    # forwards from the node to a seed, the shortest way
    start = next((o for o in target.output if o in relevant or o in seeds), target.output[0])
    onward = shortest_path(model.graph, start, seeds) or [start]
    forward = [step if isinstance(step, str) else _label(step) for step in onward[1:]]
    parts = [*reversed(back), _label(target), start, *forward]
    if len(parts) > 2 * _PATH_ENDS + 1:  # long paths: both ends, and the failing node
        focus = parts.index(_label(target))
        shown = sorted({*range(_PATH_ENDS), *range(len(parts) - _PATH_ENDS, len(parts)),
                        *range(max(focus - 2, 0), min(focus + 3, len(parts)))})
        pieces, previous = [], -1
        for index in shown:
            if index != previous + 1:
                pieces.append("...")
            pieces.append(parts[index])
            previous = index
        parts = pieces
    return " -> ".join(parts)
