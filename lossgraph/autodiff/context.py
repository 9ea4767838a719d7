"""What a gradient rule sees: the node, and a builder that knows the forward graph."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..builder import GraphBuilder
from ..errors import InvalidModelError, UnsupportedModelError
from ..graphs import ForwardFacts, Shape, attribute_value, np_dtype
from ..names import NameAuthority
from ..target import Target

__all__ = ["Node", "GradContext", "Pick", "Shape"]


@dataclass
class Node:
    """A forward node as a rule sees it."""

    proto: onnx.NodeProto
    opset: int
    #: The inputs and captured outer values (for ops with subgraphs) whose gradient is
    #: wanted; a rule may skip work for the others.
    wanted: list[str] = field(default_factory=list)
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.inputs = list(self.proto.input)
        self.outputs = list(self.proto.output)

    @property
    def op_type(self) -> str:
        return self.proto.op_type

    @property
    def name(self) -> str:
        return self.proto.name

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute's Python value (strings decoded), or ``default``."""
        return attribute_value(self.proto, name, default)

    def grads(self, *leading: str | None) -> tuple[str | None, ...]:
        """A rule's result: ``leading`` for the first inputs and ``None`` for the rest
        (the inputs after them that the rule declares ``nondiff``, or that are absent).

        ``None`` entries past the node's last input (optional inputs it does not have)
        are dropped; a gradient there is kept, for the walker to report.
        """
        count = len(self.inputs)
        if any(entry is not None for entry in leading[count:]):
            return leading
        return (*leading[:count], *[None] * (count - len(leading)))

    def input(self, position: int) -> str | None:
        """The name of an optional input, ``None`` when absent."""
        present = position < len(self.inputs) and self.inputs[position]
        return self.inputs[position] if present else None


#: The walker's ``differentiate``, as a context hands it to rules of ops with subgraphs.
Walker = Callable[..., "GradContext"]


@dataclass(frozen=True)
class Pick:
    """A gradient that is zeros but for one value a row along ``axis``: ``rows`` (of the
    forward shape ``shape``, 1 along ``axis``) added at ``index`` (a GatherElements'
    gradient where it picks one element a row, as a cross entropy picks each row's
    label)."""

    index: str
    rows: str
    axis: int
    shape: Shape


#: The number of values from which a gradient's fill is made at each run (:meth:`GradContext.
#: filled`): one this large would otherwise be a constant onnxruntime keeps for the session's
#: life (1 MiB of float32).
RUN_TIME_FILL = 1 << 18


class GradContext(GraphBuilder):
    """A GraphBuilder for gradient nodes that can also answer questions about forward values
    (from the model's :class:`~lossgraph.graphs.ForwardFacts`), knows the runtimes the
    gradient is emitted for (``target``), and differentiates a subgraph as the walker
    does the graph (:meth:`differentiate`)."""

    def __init__(self, names: NameAuthority, opset: int, facts: ForwardFacts, target: Target,
                 walker: Walker) -> None:
        super().__init__(names, opset, prefix="grad/")
        self._facts = facts
        self.target = target
        self._walker = walker
        #: gradients that are picks (:class:`Pick`) by name, for the rule that reads them
        #: to add the picked values into its own product rather than into zeros
        self.picks: dict[str, Pick] = {}

    def differentiate(self, model: onnx.ModelProto, seeds: Mapping[str, str],
                      wrt: Sequence[str], grad_names: Mapping[str, str],
                      facts: ForwardFacts | None = None, *,
                      zeros_for_unreached: bool = False) -> GradContext:
        """The gradient nodes of a subgraph made a model (an ``If`` branch, a loop body),
        by the walker (:func:`lossgraph.autodiff.walker.differentiate`), with this
        context's names and target."""
        return self._walker(model, seeds, wrt, grad_names, self.names, facts,
                            zeros_for_unreached=zeros_for_unreached, target=self.target)

    # -- forward facts ---------------------------------------------------------------
    def shape(self, name: str) -> Shape | None:
        """The static shape of a forward value, if shape inference found one."""
        return self._facts.shapes.get(name)

    def rank(self, name: str) -> int:
        """The rank of a forward value; rules rely on it, so unknown ranks are errors."""
        shape = self._facts.shapes.get(name)
        if shape is None:
            raise UnsupportedModelError(
                f"The rank of {name!r} is unknown after shape inference; the gradient needs it. "
                "Give the model's inputs static ranks (onnx.shape_inference must find them)."
            )
        return len(shape)

    def readers(self, name: str) -> list[tuple[str, list[str]]]:
        """(op type, outputs) of each forward node that reads the value ``name``."""
        return self._facts.readers.get(name, [])

    def elem_type(self, name: str) -> int:
        """The element type of a forward value; rules rely on it, so an unknown one (made
        by an op of a domain onnx does not know) is an error."""
        elem_type = self._facts.elem_types.get(name)
        if elem_type is None:
            raise UnsupportedModelError(
                f"The element type of {name!r} is unknown after shape inference; the gradient "
                "needs it. Is it made by an op of a domain onnx does not know? Declare its type "
                "in the model's value_info.")
        return elem_type

    def dtype(self, name: str) -> np.dtype:
        return np_dtype(self.elem_type(name))

    def value_info(self, name: str) -> onnx.ValueInfoProto:
        """A value_info declaring a forward value with its known type and shape."""
        elem_type = self._facts.elem_types.get(name, onnx.TensorProto.UNDEFINED)
        return helper.make_tensor_value_info(name, elem_type, self._facts.shapes.get(name))

    def value(self, name: str | None) -> np.ndarray | None:
        """The value of an initializer or Constant output, ``None`` if not constant."""
        return None if not name else self._facts.constants.get(name)

    def ints_value(self, name: str | None, what: str) -> list[int] | None:
        """A constant int input (axes, pads, shape...) as a list; error if not constant."""
        if not name:
            return None
        value = self.value(name)
        if value is None:
            raise UnsupportedModelError(
                f"The gradient needs {what} ({name!r}) to be a constant (an initializer or a "
                "Constant node), but it is computed at run time."
            )
        return [int(v) for v in np.asarray(value).reshape(-1)]

    # -- helpers for rules ---------------------------------------------------------------
    def const_like(self, value: Any, like: str, hint: str = "const") -> str:
        """A constant with the element type of the forward value ``like``."""
        return self.const(value, self.dtype(like), hint)

    def mask(self, condition: str, like: str, hint: str = "mask") -> str:
        """A boolean ``condition`` as 0/1 in the element type of ``like``.

        Gradients gate with ``Mul(dy, mask)`` rather than ``Where``, which is slow in
        onnxruntime-training 1.19.
        """
        return self.Cast(condition, to=self.elem_type(like), hint=hint)

    def filled(self, shape: str, value: float, like: str, hint: str = "filled",
               run_time: str | Sequence[str] | None = None) -> str:
        """``ConstantOfShape(shape)`` filled with ``value`` in the element type of ``like``.

        With ``run_time`` (values computed at run time: the gradient a rule receives, the
        indices it scatters at), a fill shaped like ``like`` where ``like`` has a static
        shape of :data:`RUN_TIME_FILL` values or more is made at each run: onnxruntime
        folds a ``ConstantOfShape`` of a static shape into a constant it stores for the
        session's life, the size of the whole fill (an embedding table's). ``shape`` then
        reads an empty slice of each of ``run_time`` (its value is unchanged), which no
        runtime folds while one of them is computed at run time (a mean loss's gradient is
        a constant once the batch is fixed: pass the indices too), and the fill is reshaped
        to ``shape``, which shape inference reads (onnxruntime's Reshape copies nothing).
        Smaller fills, and those of a free batch, stay foldable: rewrites such as
        ConcatScatteredSlabs read them, and replace them.
        """
        fill = numpy_helper.from_array(np.full(1, value, dtype=self.dtype(like)), "value")
        if run_time is None or not self.made_at_run_time(like):
            return self.ConstantOfShape(shape, value=fill, hint=hint)
        empty = [self.Cast(self.Slice(self.Reshape(source, self.ints([-1], "shape")),
                                      self.ints([0], "starts"), self.ints([0], "ends")),
                           to=onnx.TensorProto.INT64)
                 for source in ([run_time] if isinstance(run_time, str) else run_time)]
        made = self.ConstantOfShape(self.Concat(shape, *empty, axis=0), value=fill, hint=hint)
        return self.Reshape(made, shape, hint=hint)  # its shape known to shape inference

    def shape_around(self, like: str, axis: int, middle: str) -> str:
        """The shape of the forward value ``like`` with its ``axis`` replaced by the dims
        ``middle`` (a 1-D int64 value): ``Concat(Shape(like)[:axis], middle,
        Shape(like)[axis + 1:])``."""
        rank = self.rank(like)
        parts = [*([self.dims(like, 0, axis)] if axis > 0 else []), middle,
                 *([self.dims(like, axis + 1, rank)] if axis + 1 < rank else [])]
        return self.Concat(*parts, axis=0) if len(parts) > 1 else middle

    def made_at_run_time(self, like: str) -> bool:
        """Whether a fill shaped like the forward value ``like`` is made at each run
        (:meth:`filled`): ``like``'s shape is static, of :data:`RUN_TIME_FILL` values or
        more."""
        shape = self.shape(like)
        return (shape is not None and self._static(shape)
                and int(np.prod(shape)) >= RUN_TIME_FILL)

    def zeros_like(self, like: str, run_time: str | Sequence[str] | None = None) -> str:
        """Zeros with the shape and type of the forward value ``like``: a constant where
        its shape is static, unless ``run_time`` is given and :meth:`filled` makes them at
        each run (the zeros a gradient scatters into: pass its gradient and indices)."""
        shape = self.shape(like)
        if shape is None or not self._static(shape):
            return self.filled(self.Shape(like), 0, like, hint="zeros")
        if run_time is None or not self.made_at_run_time(like):
            return self.const(np.zeros(shape), self.dtype(like), "zeros")
        return self.filled(self.ints(shape, "shape"), 0, like, hint="zeros", run_time=run_time)

    def or_zeros(self, dy: str | None, like: str) -> str:
        """``dy`` itself, or zeros shaped like ``like`` when no gradient flows there."""
        return dy if dy is not None else self.zeros_like(like)

    def unbroadcast(self, grad: str, to: str, source: str) -> str:
        """Sum ``grad`` (shaped like ``source``) down to the shape of ``to`` (numpy broadcasting).

        Axes are found statically where the shapes tell: leading axes ``to`` lacks, and
        axes where ``to`` has a static 1 and ``source`` does not. Where they cannot tell
        (a dim of ``to`` unknown or symbolic, and not the same symbol, nor 1, in
        ``source``), the axes to sum are picked at run time from the two shapes.
        """
        target, full = self.shape(to), self.shape(source)
        if target is None or full is None:
            raise UnsupportedModelError(
                f"Cannot tell how {to!r} broadcasts against {source!r}: shape inference gave no "
                "rank. Give the model's inputs static ranks."
            )
        lead = len(full) - len(target)
        clash = next((i for i, d in enumerate(target) if lead < 0 or isinstance(d, int)
                      and d != 1 and isinstance(full[lead + i], int) and full[lead + i] != d),
                     None)
        if clash is not None:  # onnx's checker misses it for some ops (a Gemm's C)
            raise InvalidModelError(
                f"{to!r} of shape {tuple(target)} does not broadcast to {source!r} of shape "
                f"{tuple(full)}"
                + ("" if lead < 0 else f" (its dim {clash} is {target[clash]}, the result's "
                   f"{full[lead + clash]})") + ": the model is not valid ONNX, and onnxruntime "
                "refuses to run it. Fix the node that reads it.")
        kept = [lead + i for i, d in enumerate(target) if d == 1 and full[lead + i] != 1]
        unknown = [lead + i for i, d in enumerate(target) if not isinstance(d, int)
                   and full[lead + i] != 1 and not (isinstance(d, str) and full[lead + i] == d)]
        axes = list(range(lead)) + kept
        if axes and not unknown and axes == list(range(len(axes))) \
                and self._static(full[len(axes):]) and self._static(target):
            return self.sum_leading_axes(grad, to, source, len(axes))
        if kept:
            grad = self.reduce("ReduceSum", grad, kept, keepdims=1)
        if unknown:
            grad = self.sum_where_broadcast(grad, to, source, unknown, lead)
        if lead > 0:
            grad = self.reduce("ReduceSum", grad, list(range(lead)), keepdims=0)
        return grad

    def sum_where_broadcast(self, grad: str, to: str, source: str, axes: list[int],
                            lead: int) -> str:
        """Sum ``grad`` over those of ``axes`` (of ``source``, axis ``a`` being axis
        ``a - lead`` of ``to``) where ``to`` is 1 at run time and ``source`` is not:
        ``ReduceSum`` with axes picked by ``Compress``, dims kept."""
        if self.opset < 13:
            raise UnsupportedModelError(
                f"Cannot tell statically how {to!r} broadcasts against {source!r}, and summing "
                "over axes chosen at run time needs opset 13. Convert the model to opset 13 or "
                "later, or give the model's inputs static shapes.")
        dims_to = self.Gather(self.Shape(to), self.ints([a - lead for a in axes]), axis=0)
        dims_from = self.Gather(self.Shape(source), self.ints(axes), axis=0)
        one = self.ints([1], "one")
        broadcast = self.And(self.Equal(dims_to, one), self.Not(self.Equal(dims_from, one)))
        picked = self.Compress(self.ints(axes), broadcast, axis=0, hint="broadcast_axes")
        return self.op("ReduceSum", grad, picked, keepdims=1, noop_with_empty_axes=1)

    @staticmethod
    def _static(shape: Sequence) -> bool:
        return all(isinstance(d, int) for d in shape)

    def sum_leading_axes(self, grad: str, like: str, source: str, count: int) -> str:
        """Sum ``grad`` (shaped like ``source``) over its first ``count`` axes, reshaped to
        the static shape of ``like``: ``Reshape(ReduceSum(grad, axes=(0..count-1)), like)``.

        A bias gradient is such a sum over the batch; compile runs
        :class:`~lossgraph.speed.SumRowsByProduct` to compute it the fast way.
        """
        target = [int(d) for d in self.shape(like)]
        total = self.reduce("ReduceSum", grad, list(range(count)), keepdims=0, hint="row_sum")
        return self.Reshape(total, self.ints(target), hint="summed")

    def sum_of(self, terms: Sequence[str], hint: str | None = None) -> str:
        """One value for several gradient contributions: the term, or a single Sum."""
        return terms[0] if len(terms) == 1 else self.Sum(*terms, hint=hint)
