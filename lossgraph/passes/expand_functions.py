"""expand_functions: ops defined as ONNX functions, differentiated through their bodies.

Many ONNX ops are *functions*: the standard defines them by a body of simpler ops
(``onnx.defs``: ``schema.has_function``, or ``has_context_dependent_function`` for a
body built from the node's attributes and input types; one body per opset where the
ops it uses changed), and a model may define its own (``model.functions``, modules
exported as functions). For such an op without a gradient rule, the gradient is the
gradient of its body::

    y = Op(x1, ..., xn; attributes)  =  body(x1, ..., xn)   (the body for the model's
                                          opset of the op's domain, ``@attribute``
                                          references replaced by the node's attributes
                                          or the schema's defaults, absent optional
                                          inputs left absent, names made fresh)
    dx_k = vjp(body, x_k)(dy)         (the walker, with the rules of the body's ops)

**The forward is not changed.** The gradient pass keeps the node itself for the
forward values (onnxruntime's fused kernel for Attention, RMSNormalization, ...) and
differentiates a *view* of the model in which the node is its body
(:func:`gradient_view`). The body values the gradient reads are recomputed after the
forward, under the fresh names (:meth:`GradientView.add_recomputation`; values only
the forward reads are not), so the forward outputs are exactly the original op's and
the gradient is the body's, evaluated at the same inputs. Where onnxruntime itself
inlines the body (a local function, an op without a kernel), its common-subexpression
elimination merges the recomputation with the inlined forward.

Nested function ops (a body op that is itself a function without a rule) are expanded
in turn, and so are nodes inside subgraphs. A node stays as it is, and the walker names
it if the gradient needs it, when its op has a gradient rule, is declared
non-differentiable (:mod:`lossgraph.autodiff.registry`), has no body at the model's
opset, or its body cannot be built (a context-dependent body that needs input types
shape inference did not find).

:class:`ExpandFunctions` is the same expansion as a pass on the forward graph itself:
for a runtime without a kernel for an op, or to read what the gradient differentiates.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import onnx
import onnx.defs
from onnx import helper

from ..analysis import differentiable_values, influenced_values
from ..autodiff.registry import differentiable_inputs, find_rule
from ..graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    all_graphs,
    all_value_types,
    canonical_domain,
    node_reads,
    subgraphs,
)
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["ExpandFunctions", "GradientView", "expand_functions", "gradient_view",
           "function_body"]

#: Nested expansions deeper than this are left alone (a function calling itself).
_MAX_DEPTH = 16

_FunctionKey = tuple[str, str, str]  # (domain, name, overload) of a local function


# ------------------------------------------------------------------------ bodies
def _domain(domain: str) -> str:
    return canonical_domain(domain)


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {_domain(o.domain): o.version for o in model.opset_import}


def _local_functions(model: onnx.ModelProto) -> dict[_FunctionKey, onnx.FunctionProto]:
    return {(f.domain, f.name, getattr(f, "overload", "")): f for f in model.functions}


def _schema(node: onnx.NodeProto, opsets: Mapping[str, int]) -> onnx.defs.OpSchema | None:
    version = opsets.get(_domain(node.domain))
    if version is None:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, version, _domain(node.domain))
    except onnx.defs.SchemaError:
        return None


def _with_defaults(node: onnx.NodeProto,
                   defaults: Iterable[onnx.AttributeProto]) -> onnx.NodeProto:
    """A copy of ``node`` with each attribute it does not set given its default."""
    full = onnx.NodeProto()
    full.CopyFrom(node)
    present = {a.name for a in node.attribute}
    full.attribute.extend(a for a in defaults if a.name and a.name not in present)
    return full


def function_body(node: onnx.NodeProto, opsets: Mapping[str, int],
                  local: Mapping[_FunctionKey, onnx.FunctionProto] | None = None,
                  types: Mapping[str, onnx.TypeProto] | None = None,
                  ) -> tuple[onnx.FunctionProto, onnx.NodeProto] | None:
    """The body defining ``node``'s op, and the node with its attribute defaults filled
    in; ``None`` when the op is no function at these opsets.

    A local function of the model (``local``, by domain, name and overload) comes
    first; else the op schema's function for the model's opset of the op's domain
    (``opsets``), the context-dependent ones built from ``types`` (the node's input
    types).
    """
    key = (node.domain, node.op_type, getattr(node, "overload", ""))
    if local and key in local:
        function = local[key]
        return function, _with_defaults(node, function.attribute_proto)
    schema = _schema(node, opsets)
    if schema is None or not (schema.has_function or schema.has_context_dependent_function):
        return None
    version = opsets[_domain(node.domain)]
    full = _with_defaults(node, [a.default_value for a in schema.attributes.values()
                                 if a.default_value.name])
    data = b""
    if schema.has_function:
        data = schema.get_function_with_opset_version(version)
    if not data and schema.has_context_dependent_function:
        known = types or {}
        input_types = [known[name].SerializeToString() if name in known
                       else onnx.TypeProto().SerializeToString() for name in node.input]
        try:
            data = schema.get_context_dependent_function_with_opset_version(
                version, full.SerializeToString(), input_types)
        except Exception:  # the builder needs a type it was not given (its own error)
            return None
    if not data:
        return None
    function = onnx.FunctionProto()
    function.ParseFromString(data)
    return (function, full) if function.node else None


class _Instance:
    """One copy of a function body for one node: names made fresh, ``@attribute``
    references resolved, subgraphs included."""

    def __init__(self, function: onnx.FunctionProto, node: onnx.NodeProto,
                 names: NameAuthority, label: str) -> None:
        self.names = names
        self.label = label
        self.attributes = {a.name: a for a in node.attribute}
        self.mapping: dict[str, str] = {"": ""}
        for position, formal in enumerate(function.input):
            self.mapping[formal] = node.input[position] if position < len(node.input) else ""
        for position, formal in enumerate(function.output):
            if position < len(node.output) and node.output[position]:
                self.mapping[formal] = node.output[position]
        self.nodes = [self.node(inner) for inner in function.node]

    def name(self, name: str) -> str:
        if name not in self.mapping:
            self.mapping[name] = self.names.fresh(f"{self.label}/{name}")
        return self.mapping[name]

    def node(self, inner: onnx.NodeProto) -> onnx.NodeProto:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        copy.input[:] = [self.name(i) for i in inner.input]
        copy.output[:] = [self.name(o) for o in inner.output]
        copy.name = self.names.fresh(f"{self.label}/{inner.name or inner.op_type}")
        del copy.attribute[:]
        for attribute in inner.attribute:
            if attribute.ref_attr_name:
                given = self.attributes.get(attribute.ref_attr_name)
                if given is None:  # an optional attribute the node does not set
                    continue
                resolved = onnx.AttributeProto()
                resolved.CopyFrom(given)
                resolved.name = attribute.name
                copy.attribute.append(resolved)
                continue
            resolved = onnx.AttributeProto()
            resolved.CopyFrom(attribute)
            if attribute.type == onnx.AttributeProto.GRAPH:
                resolved.g.CopyFrom(self.graph(attribute.g))
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                del resolved.graphs[:]
                resolved.graphs.extend(self.graph(g) for g in attribute.graphs)
            copy.attribute.append(resolved)
        return copy

    def graph(self, graph: onnx.GraphProto) -> onnx.GraphProto:
        copy = onnx.GraphProto()
        copy.CopyFrom(graph)
        for value in (*copy.input, *copy.output, *copy.value_info):
            value.name = self.name(value.name)
        for tensor in copy.initializer:
            tensor.name = self.name(tensor.name)
        del copy.node[:]
        copy.node.extend(self.node(inner) for inner in graph.node)
        return copy


def _signature(op_type: str, version: int) -> tuple | None:
    """An op's inputs, outputs and attributes at an opset (``None``: no such op)."""
    try:
        schema = onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return None
    return ([i.name for i in schema.inputs], [o.name for o in schema.outputs],
            set(schema.attributes))


def _compatible(node: onnx.NodeProto, then: int, now: int) -> bool:
    """Whether ``node``, written for opset ``then``, means the same at opset ``now``: the
    inputs, outputs and attributes it uses are the same ones at both (later versions
    of most ops only add element types, trailing optional inputs or attributes; some
    move an attribute to an input, as ReduceMean's axes at opset 18, and a node that
    uses the old form cannot be placed in the newer model)."""
    old, new = _signature(node.op_type, then), _signature(node.op_type, now)
    if old is None or new is None:
        return False
    inputs, outputs = len(node.input), len(node.output)
    return (old[0][:inputs] == new[0][:inputs] and old[1][:outputs] == new[1][:outputs]
            and {a.name for a in node.attribute} <= new[2])


def _same_ops(function: onnx.FunctionProto, opsets: Mapping[str, int]) -> bool:
    """Whether every standard node of the body means at the model's opset what it means
    at the body's (:func:`_compatible`). A schema's body is the newest one written for
    an opset up to the model's, which may be older than the model's."""
    own = {_domain(o.domain): o.version for o in function.opset_import}
    body_version, model_version = own.get("", opsets.get("")), opsets.get("")
    if body_version == model_version:
        return True
    if body_version is None or model_version is None:
        return False
    nodes = [*function.node, *(inner for n in function.node for sub in subgraphs(n)
                               for g in all_graphs(sub) for inner in g.node)]
    return all(_compatible(n, body_version, model_version) for n in nodes
               if _domain(n.domain) == "")


# --------------------------------------------------------------------- expansion
Selector = Callable[[onnx.NodeProto, Mapping[str, int]], bool]


def without_rule(node: onnx.NodeProto, opsets: Mapping[str, int]) -> bool:
    """A node the gradient walker cannot differentiate as it is: no rule for its op at
    the model's opset, and not declared non-differentiable."""
    version = opsets.get(_domain(node.domain), 1)
    if find_rule(node.op_type, node.domain, version) is not None:
        return False
    return bool(differentiable_inputs(node.op_type, node.domain, len(node.input),
                                      opset=version))


@dataclass
class _Expansion:
    model: onnx.ModelProto
    #: names of the top-level nodes that are (parts of) bodies
    inserted: set[str] = field(default_factory=set)
    #: the expanded ops, and how many of each
    counts: Counter = field(default_factory=Counter)


def _may_carry_gradient(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto],
                        relevant: set[str] | None) -> bool:
    """Whether a gradient may flow through ``node``: an output on the way from the
    weights to the seeds (``relevant``), or, not knowing those, a float output (or one
    of unknown type)."""
    if relevant is not None:
        return any(o in relevant for o in node.output)
    for name in node.output:
        value_type = types.get(name)
        if value_type is None or not value_type.HasField("tensor_type"):
            return True
        if value_type.tensor_type.elem_type in (*FLOAT_TYPES, onnx.TensorProto.UNDEFINED):
            return True
    return False


def _placeable_body(node: onnx.NodeProto, top: bool, *, select: Selector,
                    opsets: Mapping[str, int], local: Mapping[_FunctionKey, onnx.FunctionProto],
                    types: Mapping[str, onnx.TypeProto], relevant: set[str] | None,
                    imports: dict[str, int]) -> tuple | None:
    """The body to put in place of ``node`` (see :func:`function_body`), or ``None``: not
    selected, no gradient through it, no body, or a body using older forms of its ops.
    Records in ``imports`` the domains the body imports."""
    if not select(node, opsets) or not _may_carry_gradient(node, types,
                                                           relevant if top else None):
        return None
    found = function_body(node, opsets, local, types)
    if found is None or not _same_ops(found[0], opsets):
        return None
    for opset in found[0].opset_import:
        imports.setdefault(_domain(opset.domain), opset.version)
    return found


def _expand(model: onnx.ModelProto, names: NameAuthority, select: Selector,
            paths: tuple[Sequence[str], Sequence[str]] | None = None,
            types: Mapping[str, onnx.TypeProto] | None = None) -> _Expansion:
    """``model`` with every node ``select`` picks that has a body replaced by it, until
    no such node is left (bodies inside bodies, subgraphs included): a new model, or
    ``model`` itself when no node has one. With ``paths`` (weights, seeds), only the
    top-level nodes a gradient flows through; ``types``, the model's known types, spare
    a first shape inference."""
    opsets = _opsets(model)
    local = _local_functions(model)
    result = _Expansion(model)
    for depth in range(_MAX_DEPTH):
        work = result.model
        if not any(select(n, opsets) for g in all_graphs(work.graph) for n in g.node):
            break
        known = types if depth == 0 and types is not None else all_value_types(work, data_prop=True)
        relevant = None
        if paths is not None:
            relevant = (influenced_values(work, paths[0], known)
                        & differentiable_values(work, paths[1], known))
        imports: dict[str, int] = {}
        body_of = functools.partial(_placeable_body, select=select, opsets=opsets, local=local,
                                    types=known, relevant=relevant, imports=imports)
        graph = _replace(work.graph, body_of, names, result, top=True)
        if graph is None:
            break
        expanded = onnx.ModelProto()
        expanded.CopyFrom(work)
        expanded.graph.CopyFrom(graph)
        for domain, version in sorted(imports.items()):
            if domain not in opsets:
                opsets[domain] = version
                expanded.opset_import.append(helper.make_opsetid(domain, version))
        result.model = expanded
    return result


def _replace(graph: onnx.GraphProto, body_of: Callable[[onnx.NodeProto, bool], tuple | None],
             names: NameAuthority, result: _Expansion, top: bool) -> onnx.GraphProto | None:
    """A copy of ``graph`` whose nodes that have a body are replaced by it (in subgraphs
    too), or ``None`` when none has one."""
    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        found = body_of(node, top)
        if found is not None:
            function, full = found
            label = node.name or f"{node.op_type}_{node.output[0] if node.output else ''}"
            body = _Instance(function, full, names, label).nodes
            result.counts[node.op_type] += 1
            if top:
                result.inserted.update(n.name for n in body)
            nodes.extend(body)
            changed = True
            continue
        kept = onnx.NodeProto()
        kept.CopyFrom(node)
        for attribute in kept.attribute:
            inner = ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                     else attribute.graphs)
            for sub in inner:
                replaced = _replace(sub, body_of, names, result, top=False)
                if replaced is not None:
                    sub.CopyFrom(replaced)
                    changed = True
        nodes.append(kept)
    if not changed:
        return None
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    del copy.node[:]
    copy.node.extend(nodes)
    return copy


def expand_functions(model: onnx.ModelProto, names: NameAuthority,
                     op_types: Sequence[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """``model`` (a copy) with its function ops replaced by their bodies, and
    ``{op type: nodes expanded}``: the ops ``op_types`` names, or by default those
    without a gradient rule (:func:`without_rule`)."""
    if op_types is None:
        select = without_rule
    else:
        wanted = set(op_types)

        def select(node: onnx.NodeProto, opsets: Mapping[str, int]) -> bool:
            return node.op_type in wanted

    expansion = _expand(model, names, select)
    return expansion.model, dict(sorted(expansion.counts.items()))


# ------------------------------------------------------------------ gradient view
@dataclass
class GradientView:
    """The model the gradient walker differentiates: the forward model with each op
    that has no rule but a body replaced by the body (see the module docstring)."""

    #: the view (the forward model itself when nothing was expanded)
    model: onnx.ModelProto
    #: forward facts of the view; ``None`` when nothing was expanded
    facts: ForwardFacts | None = None
    #: the top-level body nodes of the view, by name
    inserted: frozenset[str] = frozenset()
    #: the values of the forward model's top-level graph
    forward_values: frozenset[str] = frozenset()
    #: the expanded ops, and how many of each
    expanded: dict[str, int] = field(default_factory=dict)
    #: the name authority of the gradient (names of recomputed duplicates)
    names: NameAuthority | None = None

    def add_recomputation(self, model: onnx.ModelProto,
                          gradient_nodes: Sequence[onnx.NodeProto]) -> None:
        """Append to ``model`` the body nodes whose values ``gradient_nodes`` read
        (directly or through other body nodes), in order: the forward keeps the
        original nodes, the gradient reads the bodies' intermediate values from these.
        An output of a recomputed node that the forward already computes (the op's own
        output) is renamed to an unused fresh name."""
        if not self.inserted:
            return
        needed = {name for node in gradient_nodes for name in node_reads(node)}
        kept: list[onnx.NodeProto] = []
        for node in reversed(self.model.graph.node):
            if node.name not in self.inserted:
                continue
            if any(o in needed and o not in self.forward_values for o in node.output):
                kept.append(node)
                needed.update(node_reads(node))
        if not kept:
            return
        taken = self.names or NameAuthority.for_model(self.model)
        recomputed = []
        for node in reversed(kept):
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.output[:] = [taken.fresh(f"{o}_recomputed") if o in self.forward_values
                              else o for o in node.output]
            recomputed.append(copy)
        model.graph.node.extend(recomputed)
        present = {_domain(o.domain) for o in model.opset_import}
        model.opset_import.extend(o for o in self.model.opset_import
                                  if _domain(o.domain) not in present
                                  and any(_domain(n.domain) == _domain(o.domain)
                                          for n in recomputed))


def gradient_view(model: onnx.ModelProto, names: NameAuthority,
                  facts: ForwardFacts | None = None, weights: Sequence[str] | None = None,
                  seeds: Sequence[str] | None = None) -> GradientView:
    """The view of ``model`` the gradient walker differentiates (module docstring): the
    model itself when it has no function op without a rule, else a copy with those ops
    as their bodies, named by ``names``. The view keeps the types ``facts`` (the
    forward's) know for the expanded nodes' outputs, so the values after them keep
    their shapes."""
    paths = (list(weights), list(seeds)) if weights is not None and seeds is not None else None
    facts = facts or ForwardFacts.of(model)
    expansion = _expand(model, names, without_rule, paths, facts.types)
    if not expansion.counts:
        return GradientView(model)
    view = expansion.model
    known = facts.types
    declared = {v.name for v in (*view.graph.input, *view.graph.output, *view.graph.value_info)}
    produced = [o for node in model.graph.node for o in node.output if o]
    view.graph.value_info.extend(helper.make_value_info(name, known[name]) for name in produced
                                 if name in known and name not in declared)
    forward_values = {*produced, *(i.name for i in model.graph.input),
                      *(t.name for t in model.graph.initializer)}
    return GradientView(view, ForwardFacts.of(view), frozenset(expansion.inserted),
                        frozenset(forward_values), dict(sorted(expansion.counts.items())), names)


# ------------------------------------------------------------------------- pass
@dataclass(frozen=True)
class ExpandFunctions(Pass[dict[str, int]]):
    """Replace function ops by their bodies in the forward graph (module docstring).

    ``op_types``: the ops to expand (any that has a body at the model's opset, rule or
    not); by default those without a gradient rule, which is what the gradient pass
    differentiates through their bodies. The report is ``{op type: nodes expanded}``.
    Local functions no node calls any more are dropped.
    """

    op_types: Sequence[str] | None = None

    def call(self, model: onnx.ModelProto) -> PassResult:
        names = NameAuthority.for_model(model)
        expanded, report = expand_functions(model, names, self.op_types)
        if not report:
            return PassResult(model, report, changed=False)
        called = {(n.domain, n.op_type) for g in all_graphs(expanded.graph) for n in g.node}
        for function in expanded.functions:
            called.update((n.domain, n.op_type) for n in function.node)
        kept = [f for f in expanded.functions if (f.domain, f.name) in called]
        del expanded.functions[:]
        expanded.functions.extend(kept)
        return PassResult(expanded, report)
