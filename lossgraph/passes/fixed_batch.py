"""A model exported with a fixed batch, freed to take any number of rows where its graph
proves which constants hold the batch size::

    x[2, 1, 28, 28]        ->  x[batch, 1, 28, 28]    (every data input, every output)
    Reshape(h, [2, 676])   ->  Reshape(h, [0, 676])    h[batch, 4, 13, 13]: 0 copies h's batch
    Reshape(h, [8, 16])    ->  Reshape(h, [-1, 16])    h[batch, 4, 16]: the batch merged with 4
    Expand(h, [2, 5])      ->  Expand(h, [1, 5])       h[batch, 5]: 1 keeps h's batch
    Mul(h, c[2, 5, 1])     ->  Mul(h, c[0:1])          h[batch, 5, 8]; c's two slices equal
    ConstantOfShape([2, 5]) -> ConstantOfShape([1, 5]) (meeting h[batch, 5] in a broadcast)
    Concat(c[2, 1, 8], h, axis=1)
                           ->  Concat(Expand(c[0:1], [Shape(h)[0], 1, 1]), h, axis=1)

torch's default export (``torch.onnx.export(net, (x,), path)``, dynamo in torch 2.13)
fixes the batch at the example's rows and writes shape constants computed from it
(a ``flatten`` or ``view`` becomes ``Reshape(h, [2, 676])``). lossgraph trains batches of
rows, so it reads each such constant back as the batch, where the graph proves it.

**The proof.** The graph's shapes are inferred (onnx's shape inference with data
propagation) with the inputs' batch at two sizes, :data:`PROBES`: a dimension that
differs between the two is the batch times a constant (``k * batch``); one that does not
is fixed. A ``Reshape`` whose data carries the batch at axis ``i`` (``k * batch``) keeps
the rows apart only if one axis ``j`` of its target holds them: the axes before ``j``
hold a part of what the data's axes before ``i`` hold (their product divides), and ``j``
holds ``k * batch`` times what it merges from either side. An axis that holds the batch
alone, after the same leading axes, is the batch's where there is one (at a batch of 1,
``[1, 676]`` also reads as one row of every row's values: the batch stays an axis of its
own); otherwise the one merged axis that fits; a target that fits several ways, or splits
a merged batch across axes (``[4, ...] -> [2, 2, ...]``: which factor is the batch is not
in the shapes), is not guessed. That axis is rewritten to read the batch (``0``: the
data's own axis, or ``-1``: what is left); a constant that merely equals the batch
elsewhere (a hidden width of 2 at a batch of 2) is never an axis ``j`` and is left alone.
An ``Expand`` whose data carries the batch at an axis gets 1 there. A constant that meets
another value's batch axis in a broadcasting op or a ``Concat`` with an axis of the
batch's size there (``k * batch``) must be the batch's there, or the graph would not be
valid at another batch size; where its slices along it are equal (a constant tensor, a
``ConstantOfShape``, an ``Expand`` of one slice) it becomes one slice, which computes what
the export did (a ``Concat`` expands it to the other value's rows). Rewrites are repeated
until none is left (a rewrite frees the values after it). The result must then be
**proved consistent** at both sizes: strict shape inference passes, every shape is known,
every ``Reshape`` keeps its element count, and every output's first axis is the batch (one
output row per input row) with its other axes as exported.

A consistent result frees the batch (:class:`GeneralizeBatch` reports each rewrite).
Otherwise the batch stays fixed: the model then trains in batches of exactly that size
(the compiler's ``fixed_batch`` option, docs/reference/errors.md "Decisions"), or with
``strict=True`` the pass raises an :class:`~lossgraph.errors.UnsupportedModelError`
saying why and how to export again.
A constant with a value of its own for each exported row has none for other rows, and a
number computed from the batch size (``x / x.size(0)``, written by the exporter as a
number) cannot be told from any other: the first keeps the batch, the second is what no
graph shows (docs/reference/program.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UnsupportedModelError
from ..graphs import (
    attribute_value,
    constant_value,
    known_shapes,
    tensor_array,
    without_weight_data,
)
from ..names import NameAuthority
from ..options import FIXED_BATCH_CHOICES
from ..speed.specialize_batch import set_leading_dims
from .contract import Pass, PassResult

__all__ = ["GeneralizeBatch", "BatchReport", "Rewrite", "fixed_batch", "export_calls",
           "FIXED_BATCH_CHOICES",
           "export_advice", "rows", "PROBES", "BATCH_NAME"]

#: The two batch sizes the shapes are inferred at: a dimension that differs between them
#: is the batch's; primes, so that a multiple of the batch is never taken for another.
PROBES = (97, 89)
#: The name a freed batch axis gets (``batch_1``, ... when the model uses it already).
BATCH_NAME = "batch"
#: The float initializers the probes infer shapes without (as inputs of their type): every
#: one of 256 bytes or more. Smaller ones may be shapes (a Resize's scales); a weight's
#: data is copied with the model for each inference (45 MB a copy for ResNet-18).
_PROBED_BYTES = 256


@dataclass(frozen=True)
class Rewrite:
    """One constant read back as the batch: the node that reads it (its name and op), the
    value it reads, and that value's numbers (a shape) or shape (a constant tensor)
    before and after; ``expanded``: the value is then expanded to the batch of
    ``expanded`` (a Concat takes it whole)."""

    node: str
    op_type: str
    value: str
    before: tuple[int, ...]
    after: tuple[int, ...]
    kind: str = "target"  # a shape's numbers ("target"), a tensor's shape ("constant"), or
    #                       "expanded" (no numbers: the value read is expanded)
    expanded: str = ""

    def __str__(self) -> str:
        where = f"{self.op_type} {self.node!r}"
        if self.kind == "target":
            return f"{where} {list(self.before)} -> {list(self.after)}"
        if self.kind == "expanded":
            return f"{where} reads {self.value!r} expanded to the rows of {self.expanded!r}"
        grown = f", expanded to the rows of {self.expanded!r}" if self.expanded else ""
        return (f"{where} reads {self.value!r} of shape {list(self.before)} as its one row "
                f"{list(self.after)}{grown}")


@dataclass(frozen=True)
class BatchReport:
    """What :class:`GeneralizeBatch` did with a model's fixed batch of ``batch`` rows:
    freed it (``rewrites``, possibly none), or kept it (``reason``)."""

    batch: int
    freed: bool
    rewrites: tuple[Rewrite, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        """One sentence, as ``describe_plan``, ``inspect`` and ``compile`` print it."""
        if self.freed:
            what = ("; ".join(map(str, self.rewrites)) if self.rewrites
                    else "no shape constant holds it")
            return f"its fixed batch of {rows(self.batch)} freed ({what})"
        return (f"its fixed batch of {rows(self.batch)} kept: it trains in batches of exactly "
                f"{rows(self.batch)} ({self.reason})")


def rows(count: int) -> str:
    """``1 row``, ``2 rows``."""
    return f"{count} row{'s' * (count != 1)}"


def fixed_batch(model: onnx.ModelProto) -> int | None:
    """The batch size every data input of ``model`` fixes (its first dimension), or None
    when their batch axis is free. Inputs that disagree (one fixed, one free, or two
    sizes) are an :class:`~lossgraph.errors.UnsupportedModelError`."""
    sizes = _leading_dims(model)
    if not sizes or all(not isinstance(d, int) for d in sizes.values()):
        return None
    fixed = {name: d for name, d in sizes.items() if isinstance(d, int)}
    if len(fixed) < len(sizes):
        free = next(name for name in sizes if name not in fixed)
        name, size = next(iter(fixed.items()))
        raise UnsupportedModelError(
            f"Input {name!r} has a fixed batch dimension of {size}, but input {free!r}'s is "
            "free: lossgraph feeds every data input the same rows. "
            + export_advice(model))
    if len(set(fixed.values())) > 1:
        raise UnsupportedModelError(
            f"The data inputs fix different batch sizes ({fixed}): lossgraph feeds every data "
            "input the same rows. " + export_advice(model))
    return next(iter(fixed.values()))


def _leading_dims(model: onnx.ModelProto) -> dict[str, int | str | None]:
    """The first dimension of every data input that has one: its size, name or None."""
    weights = {t.name for t in model.graph.initializer}
    dims: dict[str, int | str | None] = {}
    for value in model.graph.input:
        shape = value.type.tensor_type.shape.dim if value.type.HasField("tensor_type") else ()
        if value.name in weights or not shape:
            continue
        first = shape[0]
        dims[value.name] = (first.dim_value if first.HasField("dim_value") else
                            first.dim_param or None)
    return dims


def export_calls(inputs: Sequence[str], outputs: Sequence[str]) -> tuple[str, str]:
    """The torch calls that export ``model`` again with a free batch axis, for
    ``torch.onnx.export``'s two exporters in torch 2.13: the default (dynamo), which takes
    ``dynamic_shapes`` (one per positional argument of ``forward``), and the legacy one,
    which takes ``dynamic_axes`` by input and output name. Each reads ``model``, ``args``
    (the example inputs, a tuple) and ``path``."""
    shapes = ", ".join("{0: torch.export.Dim('batch')}" for _ in inputs)
    axes = ", ".join(f"{name!r}: {{0: 'batch'}}" for name in (*inputs, *outputs))
    return (f"torch.onnx.export(model, args, path, dynamic_shapes=({shapes},))",
            f"torch.onnx.export(model, args, path, dynamo=False, input_names={list(inputs)!r}, "
            f"output_names={list(outputs)!r}, dynamic_axes={{{axes}}})")


def export_advice(model: onnx.ModelProto) -> str:
    """How to export ``model`` again with a free batch axis (both of torch's exporters)."""
    weights = {t.name for t in model.graph.initializer}
    inputs = [v.name for v in model.graph.input if v.name not in weights]
    default, legacy = export_calls(inputs, [v.name for v in model.graph.output])
    return (f"To train any batch size, export it with a free batch axis: {default} (torch's "
            f"default exporter), or {legacy} (the legacy exporter).")


@dataclass(frozen=True)
class GeneralizeBatch(Pass[BatchReport]):
    """A fixed-batch model's batch freed where the graph proves which shape constants hold
    it (module doc); else the model unchanged and the report's reason, or with ``strict``
    an :class:`~lossgraph.errors.UnsupportedModelError`. A model whose batch is free
    already is returned unchanged, with no report."""

    strict: bool = False

    def call(self, model: onnx.ModelProto) -> PassResult[BatchReport | None]:
        batch = fixed_batch(model)
        if batch is None:
            return PassResult(model, None, changed=False)
        reading = _Search(model, batch).follow(_Reading())
        if isinstance(reading, _Reading):
            rewrites = tuple(reading.rewrites(model))
            _free(model, batch, reading)
            return PassResult(model, BatchReport(batch, True, rewrites))
        reason = reading
        if self.strict:
            raise UnsupportedModelError(
                f"The model's batch is fixed at {rows(batch)}, and lossgraph cannot free it: "
                f"{reason}. " + export_advice(model))
        return PassResult(model, BatchReport(batch, False, reason=reason), changed=False)


# -- the search ----------------------------------------------------------------------------

#: Ops whose inputs broadcast against each other, right-aligned: an axis of the batch's
#: size in one input meets the batch axis of another.
_BROADCASTING = frozenset((
    "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where", "Equal",
    "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "PRelu",
    "BitShift"))
#: The input that holds the shape a node makes, by op.
_SHAPE_INPUTS = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0}
#: An input of a node, by the node's position and the input's.
_Input = tuple[int, int]
#: How a node input is expanded to the batch: its axis, its rank, and the value and axis
#: whose size it takes.
_Expansion = tuple[int, int, str, int]


@dataclass
class _Reading:
    """The constants read as the batch so far: by node input, the constant it reads
    instead (the same one where the node was found to need no rewrite); and the node
    inputs then expanded to the batch: the axis, the value's rank, and the value and axis
    whose size they take."""

    targets: dict[_Input, np.ndarray] = field(default_factory=dict)
    expansions: dict[_Input, _Expansion] = field(default_factory=dict)

    def but(self, targets: Mapping[_Input, np.ndarray],
            expansions: Mapping[_Input, _Expansion] | None = None) -> _Reading:
        return _Reading({**self.targets, **targets}, {**self.expansions, **(expansions or {})})

    def rewrites(self, model: onnx.ModelProto) -> Iterator[Rewrite]:
        """What this reading changes in ``model`` (to which it is not applied)."""
        graph = model.graph
        changed = {key for key, after in self.targets.items()
                   if not _same(_constant_of(graph, graph.node[key[0]].input[key[1]]), after)}
        for (index, position), after in sorted(self.targets.items()):
            if (index, position) not in changed:
                continue
            node = graph.node[index]
            name = node.input[position]
            before = _constant_of(graph, name)
            label = node.name or node.output[0]
            if _SHAPE_INPUTS.get(node.op_type) == position:
                yield Rewrite(label, node.op_type, name, tuple(int(v) for v in before),
                              tuple(int(v) for v in after))
            else:
                expanded = self.expansions.get((index, position))
                yield Rewrite(label, node.op_type, name, before.shape, after.shape,
                              "constant", expanded[2] if expanded else "")
        for (index, position), (_, _, source, _) in sorted(self.expansions.items()):
            if (index, position) not in changed:
                node = graph.node[index]
                yield Rewrite(node.name or node.output[0], node.op_type, node.input[position],
                              (), (), "expanded", source)


class _Search:
    """How a model's batch-sized constants read the batch (module doc): the probes and
    the rules."""

    def __init__(self, model: onnx.ModelProto, batch: int) -> None:
        self.batch = batch
        self.source = model
        #: the data inputs, whose first axis is the batch (not the weights the light model
        #: takes as inputs)
        self.inputs = {v.name for v in _data_inputs(model)}
        light, _ = without_weight_data(model, _PROBED_BYTES)
        self.model = onnx.ModelProto()
        self.model.CopyFrom(light)
        del self.model.graph.value_info[:]  # the exporter's shapes, at the fixed batch
        self.constants = _constants(self.model.graph)
        self.declared = {v.name: _dims(v) for v in model.graph.output}

    def follow(self, reading: _Reading) -> _Reading | str:
        """``reading`` taken as far as it goes, each rewrite proven (module doc): the
        reading under which the graph is consistent at any batch size, or why none is."""
        while True:
            model = self._apply(reading)
            probes = [self._shapes(model, size) for size in PROBES]
            decided = {}
            for index, node in enumerate(self.model.graph.node):
                if (index, 1) in reading.targets or node.op_type not in ("Reshape", "Expand"):
                    continue
                if len(node.input) < 2 or node.input[1] not in self.constants:
                    continue
                option = _options(node, self.constants[node.input[1]], probes, self.batch)
                if isinstance(option, str):
                    return option
                if option is not None:
                    decided[(index, 1)] = option
            if decided:
                reading = reading.but(decided)
                continue
            met = self._batch_met(reading, probes)
            if met is not None:
                reading = reading.but(*met)
                continue
            return (self._unknown_shape(model, dict(zip(PROBES, probes)))
                    or self._inconsistency(model) or reading)

    def _batch_met(self, reading: _Reading, probes: Sequence[Mapping[str, list[int | None]]]
                   ) -> tuple[dict[_Input, np.ndarray], dict[_Input, _Expansion]] | None:
        """Constants that meet the batch: an input of a broadcasting op or a Concat with an
        axis of the batch's size (``k * batch``) where another input has the batch
        (``k * batch`` rows at every batch size), made of equal slices along that axis (a
        constant tensor, a ``ConstantOfShape``, an ``Expand`` of one slice). The graph is
        valid at another batch size only if that axis is the batch, and one slice there
        computes what the exported graph did: the constant is rewritten to one slice (for
        a Concat, then expanded to the other input's rows). None when none meets it."""
        targets: dict[_Input, np.ndarray] = {}
        expansions: dict[_Input, _Expansion] = {}
        for index, node in enumerate(self.model.graph.node):
            concat = node.op_type == "Concat"
            if node.op_type not in _BROADCASTING and not concat:
                continue
            shapes = [[probe.get(name) for name in node.input] for probe in probes]
            if not all(_static(shape) for probe in shapes for shape in probe):
                continue
            rank = max(len(shape) for shape in shapes[0])
            axis = attribute_value(node, "axis", 0) % rank if concat else None
            for aligned in range(rank):
                if aligned == axis:
                    continue
                own = [aligned - rank + len(shape) for shape in shapes[0]]
                sizes = [[shape[a] if a >= 0 else None for shape, a in zip(probe, own)]
                         for probe in shapes]
                carriers = [(position, p // PROBES[0]) for position, (p, q)
                            in enumerate(zip(*sizes)) if p is not None and p != q
                            and p % PROBES[0] == 0 and q == p // PROBES[0] * PROBES[1]]
                if not carriers:
                    continue
                source, k = carriers[0]
                for position, size in enumerate(sizes[0]):
                    key = (index, position)
                    if size != k * self.batch or (size == 1 and not concat) or \
                            sizes[1][position] != size \
                            or key in reading.targets or key in reading.expansions:
                        continue
                    found = self._one_slice(key, node.input[position], own[position],
                                            probes[0])
                    if found is None:
                        continue
                    targets[found[0]] = found[1]
                    if concat:
                        expansions[key] = (own[position], len(shapes[0][position]),
                                           node.input[source], own[source])
        new = any(key not in reading.targets or not _same(reading.targets[key], value)
                  for key, value in targets.items()) or not expansions.keys() <= \
            reading.expansions.keys()
        return (targets, expansions) if new else None

    def _one_slice(self, reader: _Input, name: str, axis: int,
                   shapes: Mapping[str, list[int | None]]) -> tuple[_Input, np.ndarray] | None:
        """The node input to rewrite, and what it then reads, for ``name`` (read by
        ``reader``) to be one slice along ``axis``: where it is a constant made of equal
        slices (the reader's input, its first slice), a ``ConstantOfShape`` (its shape,
        1 there) or an ``Expand`` of a value of size 1 there (its shape, 1 there); else
        None."""
        nodes = self.model.graph.node
        producer = next((i for i, n in enumerate(nodes) if name in n.output), None)
        if producer is None or nodes[producer].op_type == "Constant":
            value = _constant_of(self.source.graph, name)
            if value is None or not np.all(value == value.take([0], axis=axis)):
                return None
            return reader, value.take([0], axis=axis)
        node = nodes[producer]
        position = {"ConstantOfShape": 0, "Expand": 1}.get(node.op_type)
        if position is None or len(node.input) <= position or \
                node.input[position] not in self.constants:
            return None
        shape = self.constants[node.input[position]].copy()
        j = axis - (len(shapes[name]) - len(shape))
        if node.op_type == "Expand":
            data = shapes.get(node.input[0])
            d = axis - (len(shapes[name]) - len(data)) if data is not None else None
            if d is None or (d >= 0 and data[d] != 1):
                return None  # the data has rows of its own there
        if j < 0:
            return None
        shape[j] = 1
        return (producer, position), shape

    def _apply(self, reading: _Reading) -> onnx.ModelProto:
        """The probe model with ``reading`` applied."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        _rewrite(model, reading, prune=False)
        return model

    def _shapes(self, model: onnx.ModelProto, size: int, strict: bool = False
                ) -> dict[str, list[int | None]]:
        """Every value's shape with the inputs' batch of ``size`` rows (outputs' declared
        first axis left out): their own shape inference's, strict where asked."""
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        set_leading_dims([v for v in probe.graph.input if v.name in self.inputs], size,
                         fixed=self.batch)
        for output in probe.graph.output:
            dims = output.type.tensor_type.shape.dim
            if dims:
                dims[0].Clear()
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=strict, data_prop=True)
        shapes = known_shapes(inferred.graph)
        shapes.update({t.name: list(t.dims) for t in inferred.graph.initializer})
        return shapes

    def _unknown_shape(self, model: onnx.ModelProto,
                       probes: Mapping[int, Mapping[str, list[int | None]]]) -> str | None:
        """The first node whose result's shape is not known at a probe size, in words
        (with its inputs' shapes and constants); None when every shape is known."""
        for size, shapes in probes.items():
            for node in model.graph.node:
                if all(_static(shapes.get(o)) for o in node.output if o):
                    continue
                read = ", ".join(
                    f"{name!r} = {self.constants[name].tolist()}" if name in self.constants
                    else f"{name!r} of shape {shapes.get(name)}" for name in node.input if name)
                return (f"at {size} rows the shape of {node.op_type} "
                        f"{node.name or node.output[0]!r}'s result is not known (it reads "
                        f"{read}): a constant there holds the batch where lossgraph cannot "
                        "prove it, or the graph's shapes are not static")
        return None

    def _inconsistency(self, model: onnx.ModelProto) -> str | None:
        """Why ``model`` (a reading applied) does not take any batch size, or None."""
        for size in PROBES:
            try:
                shapes = self._shapes(model, size, strict=True)
            except Exception as exc:  # noqa: BLE001  onnx's shape errors have no common type
                detail = str(exc).strip().splitlines()[-1][:300]
                return (f"at {size} rows its shapes contradict each other ({detail}): "
                                "a constant that lossgraph cannot read as the batch holds it")
            unknown = self._unknown_shape(model, {size: shapes})
            if unknown:
                return (unknown)
            for node in model.graph.node:
                if node.op_type != "Reshape":
                    continue
                data, out = shapes.get(node.input[0]), shapes.get(node.output[0])
                if not (_static(data) and _static(out)) or math.prod(data) != math.prod(out):
                    return (f"at {size} rows Reshape {node.name or node.output[0]!r} "
                                    f"would turn {data} into {out}")
            for output in model.graph.output:
                computed, declared = shapes.get(output.name), self.declared[output.name]
                if not computed or computed[0] != size:
                    return (f"output {output.name!r} does not have one row per input "
                                    f"row (at {size} input rows it has shape {computed})")
                if declared and any(isinstance(d, int) and d != c
                                    for d, c in zip(declared[1:], computed[1:])):
                    return (f"output {output.name!r} changes shape with the batch (at "
                                    f"{size} rows it has shape {computed})")
        return None


def _options(node: onnx.NodeProto, target: np.ndarray,
             probes: Sequence[Mapping[str, list[int | None]]], batch: int
             ) -> np.ndarray | str | None:
    """The target under which ``node`` (a Reshape or Expand) keeps the batch, in place of
    its constant ``target``; None where its data carries no batch yet (or its shape is not
    known); or why no target is proven."""
    data = [probe.get(node.input[0]) for probe in probes]
    if not all(_static(d) for d in data) or len(data[0]) != len(data[1]):
        return None
    linear = [(axis, p // PROBES[0]) for axis, (p, q) in enumerate(zip(*data)) if p != q]
    if not linear:
        return None
    label = f"{node.op_type} {node.name or node.output[0]!r}"
    for axis, k in linear:
        p, q = data[0][axis], data[1][axis]
        if p % PROBES[0] or q != k * PROBES[1]:
            return f"{label} reads a value whose axis {axis} is not a multiple of the batch"
    exported = list(data[0])
    for axis, k in linear:
        exported[axis] = k * batch
    if node.op_type == "Expand":
        return _expand_target(target, exported, linear, batch, label)
    if len(linear) > 1:
        return f"{label} reshapes a value that holds the batch in {len(linear)} axes"
    return _reshape_target(target, exported, *linear[0],
                           bool(attribute_value(node, "allowzero", 0)), label)


def _reshape_target(target: np.ndarray, data: list[int], axis: int, k: int, allowzero: bool,
                    label: str) -> np.ndarray | str:
    """The target under which ``Reshape(data, target)`` keeps the batch (``data[axis]`` is
    ``k`` times it) in one axis of its result (module doc), or why none is proven: an axis
    ``j`` fits where the axes before it hold a part ``1/u`` of what the data's axes before
    ``axis`` hold, and it holds ``u * data[axis] * tail``, ``tail`` taken from the axes
    after. An axis that holds the batch alone (``u = tail = 1``) is the batch's where there
    is one; otherwise the one merged axis that fits. A target that fits several ways (at a
    batch of 1, ``[1, 1, 676]``) is not guessed."""
    resolved = _resolved(target, data, allowzero)
    if resolved is None:
        return f"{label}'s target {target.tolist()} does not fit its data's shape {data}"
    before, rows, after = math.prod(data[:axis]), data[axis], math.prod(data[axis + 1:])
    alone, merged = [], []
    for j, size in enumerate(resolved):
        head = math.prod(resolved[:j])
        if head == 0 or before % head or size % (before // head * rows):
            continue
        tail = size // (before // head * rows)
        if math.prod(resolved[j + 1:]) * tail == after:
            (alone if before == head and tail == 1 else merged).append(j)
    fits = alone or merged
    if len(fits) != 1:
        how = ("splits the batch across axes" if not fits else
               f"fits the batch at {len(fits)} of its axes")
        return (f"{label} {how} ({data} -> {resolved.tolist()}), so which part is the batch "
                "is not known")
    j = fits[0]
    option = np.array(target, np.int64)
    if option[j] == -1 or (option[j] == 0 and not allowzero and j == axis):
        return option  # the target reads the batch already
    if j == axis and alone and not allowzero:
        option[j] = 0  # the data's own axis, copied
        return option
    option = np.array(resolved, np.int64)
    option[j] = -1  # the batch (times the axes merged into it): what is left
    return option


def _expand_target(target: np.ndarray, data: list[int], linear: list[tuple[int, int]],
                   batch: int, label: str) -> np.ndarray | str:
    """The target under which ``Expand(data, target)`` keeps the batch axes of ``data`` (1
    where the target repeats their size: broadcasting keeps them), or why none is."""
    option = np.array(target, np.int64)
    for axis, k in linear:
        j = len(target) - (len(data) - axis)
        if j < 0 or option[j] == 1:
            continue
        if option[j] != k * batch:
            return f"{label} broadcasts a batch axis of {k * batch} to {int(option[j])}"
        option[j] = 1
    return option


def _resolved(target: np.ndarray, data: list[int], allowzero: bool) -> np.ndarray | None:
    """``target`` as ``Reshape`` reads it for ``data``: 0 copies, -1 what is left; None
    when it does not fit."""
    resolved = np.array(target, np.int64)
    if not allowzero:
        for j in np.flatnonzero(resolved == 0):
            if j >= len(data):
                return None
            resolved[j] = data[j]
    missing = np.flatnonzero(resolved == -1)
    known = math.prod(int(v) for v in resolved if v != -1)
    if len(missing) > 1 or (resolved < -1).any():
        return None
    if len(missing):
        if known == 0 or math.prod(data) % known:
            return None
        resolved[missing[0]] = math.prod(data) // known
    return resolved if math.prod(resolved.tolist()) == math.prod(data) else None


# -- rewriting -----------------------------------------------------------------------------


def _free(model: onnx.ModelProto, batch: int, reading: _Reading) -> None:
    """``model`` with ``reading`` applied and its inputs' and outputs' batch named; the
    exporter's value_info entries whose shape the batch changes dropped."""
    _rewrite(model, reading)
    taken = {d.dim_param for v in (*model.graph.input, *model.graph.output, *model.graph.value_info)
             for d in v.type.tensor_type.shape.dim if d.dim_param}
    name = NameAuthority(taken).fresh(BATCH_NAME)
    set_leading_dims(_data_inputs(model), name, fixed=batch)
    set_leading_dims(model.graph.output, name, fixed=batch)
    search = _Search(model, batch)
    shapes = [search._shapes(search.model, size) for size in PROBES]
    kept = [v for v in model.graph.value_info
            if shapes[0].get(v.name) == shapes[1].get(v.name) == _dims(v)]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def _rewrite(model: onnx.ModelProto, reading: _Reading, prune: bool = True) -> None:
    """Point each node input of ``reading``'s targets at a new initializer holding its
    value (where it differs from the one it reads), and expand each of its expansions to
    the rows of the value it names; with ``prune``, drop the constants no longer read."""
    graph = model.graph
    names = NameAuthority.for_model(model)
    made: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
    replaced: set[str] = set()
    for (index, position), value in sorted(reading.targets.items()):
        node = graph.node[index]
        name = node.input[position]
        if _same(_constant_of(graph, name), value):
            continue
        key = (name, value.tobytes(), value.shape)
        if key not in made:
            made[key] = names.fresh(f"{name}_any_batch")
            graph.initializer.append(numpy_helper.from_array(value, made[key]))
        node.input[position] = made[key]
        replaced.add(name)
    for (index, position), (axis, rank, source, source_axis) in sorted(
            reading.expansions.items(), reverse=True):
        node = graph.node[index]  # from the last: inserting nodes moves those after
        read = node.input[position]
        rows = names.fresh(f"{source}_rows")
        shape = names.fresh(f"{read}_shape")
        expanded = names.fresh(f"{read}_rows")
        ones = [numpy_helper.from_array(np.ones(count, np.int64), names.fresh("ones"))
                for count in (axis, rank - axis - 1)]
        graph.initializer.extend(ones)
        added = [helper.make_node("Shape", [source], [rows], start=source_axis,
                                  end=source_axis + 1, name=names.fresh(f"{rows}/Shape")),
                 helper.make_node("Concat", [ones[0].name, rows, ones[1].name], [shape],
                                  axis=0, name=names.fresh(f"{shape}/Concat")),
                 helper.make_node("Expand", [read, shape], [expanded],
                                  name=names.fresh(f"{expanded}/Expand"))]
        node.input[position] = expanded
        for offset, new in enumerate(added):
            graph.node.insert(index + offset, new)
    if not prune:
        return
    read = {name for n in graph.node for name in n.input}
    unread = replaced - read
    kept = [t for t in graph.initializer if t.name not in unread]
    if len(kept) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in unread)]
    if len(nodes) < len(graph.node):
        del graph.node[:]
        graph.node.extend(nodes)


def _constants(graph: onnx.GraphProto, any_type: bool = False) -> dict[str, np.ndarray]:
    """The graph's 1-D int64 constants (initializers and Constant nodes): the shape
    targets a Reshape or Expand may read; with ``any_type``, every constant."""
    found = {}
    inputs = {v.name for v in graph.input}
    for tensor in graph.initializer:
        if tensor.name not in inputs and (any_type or (
                tensor.data_type == onnx.TensorProto.INT64 and len(tensor.dims) == 1)):
            found[tensor.name] = tensor_array(tensor)
    for node in graph.node:
        if node.op_type == "Constant" and not node.domain:
            value = constant_value(node)
            if value is not None and (any_type or (value.dtype == np.int64
                                                   and value.ndim == 1)):
                found[node.output[0]] = value
    return found


def _constant_of(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` where it is an initializer (not an input) or a Constant."""
    tensor = next((t for t in graph.initializer if t.name == name), None)
    if tensor is not None:
        return None if name in {v.name for v in graph.input} else tensor_array(tensor)
    node = next((n for n in graph.node if n.op_type == "Constant" and not n.domain
                 and n.output[0] == name), None)
    return None if node is None else constant_value(node)


def _same(a: np.ndarray | None, b: np.ndarray) -> bool:
    """Whether two constants are the same tensor (shape and values)."""
    return a is not None and a.shape == b.shape and np.array_equal(a, b)


def _data_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    weights = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in weights]


def _dims(value: onnx.ValueInfoProto) -> list[int | None] | None:
    """A value's declared shape (None: unknown rank; a None dim: not a number)."""
    if not value.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None
            for d in value.type.tensor_type.shape.dim]


def _static(shape: list[int | None] | None) -> bool:
    return shape is not None and None not in shape
