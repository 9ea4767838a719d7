"""GraphBuilder: emit nodes and constants, readably and for the model's opset.

    b = GraphBuilder(names, opset=17)
    diff = b.Sub(prediction, label, hint="diff")
    per_row = b.reduce("ReduceMean", b.Mul(diff, diff), axes=[1], keepdims=0)

Ops are called by their ONNX name; keyword arguments become attributes, ``hint``
names the result and ``outputs`` sets how many results (or their exact names) a
node has. Forms that changed between opsets (reduction ``axes``, ``Squeeze`` and
``Unsqueeze`` axes, ``Split``) go through helpers that pick the right form.
Constants are deduplicated, so a value used twice is stored once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .models import check_emitted
from .names import NameAuthority

__all__ = ["GraphBuilder", "standalone_model"]

# The opset in which each reduction's ``axes`` moved from an attribute to an input.
_AXES_AS_INPUT_SINCE = {"ReduceSum": 13, "Squeeze": 13, "Unsqueeze": 13}
_AXES_AS_INPUT_DEFAULT = 18


class GraphBuilder:
    """Accumulates nodes and initializers to append to a graph."""

    def __init__(self, names: NameAuthority, opset: int, prefix: str = "") -> None:
        self.names = names
        self.opset = opset
        self.prefix = prefix
        self._nodes: list[onnx.NodeProto] = []
        # value -> the nodes of ``nodes`` that read it, kept by ``op`` for ``rename``
        # (``None`` after ``nodes`` is replaced: rebuilt on the next rename)
        self._consumers: dict[str, list[onnx.NodeProto]] | None = {}
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self._producers: dict[str, onnx.NodeProto] = {}
        self._memo: dict[tuple, Any] = {}

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        """The nodes built so far, in order (append through :meth:`op`, or replace whole)."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: list[onnx.NodeProto]) -> None:
        self._nodes = nodes
        self._consumers = None

    # -- nodes -------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        *inputs: str | None,
        outputs: int | Sequence[str] = 1,
        hint: str | None = None,
        domain: str = "",
        **attributes: Any,
    ) -> Any:
        """Append one node; return its output name (or a tuple of names).

        A ``Transpose`` whose ``perm`` keeps every axis in place is no node: its input is
        returned (onnxruntime's Gemm-Transpose fusion takes any Transpose after a Gemm for
        a real one, which made such an identity a wrong result).
        """
        perm = attributes.get("perm")
        if (op_type == "Transpose" and isinstance(outputs, int) and perm is not None
                and list(perm) == list(range(len(perm)))):
            return inputs[0]
        if isinstance(outputs, int):
            base = hint or op_type.lower()
            hints = [base] if outputs == 1 else [f"{base}_{i}" for i in range(outputs)]
            names = [self.names.fresh(h) for h in hints]
        else:
            names = list(outputs)
        node = helper.make_node(
            op_type,
            [i or "" for i in inputs],
            names,
            name=self.names.fresh(f"{self.prefix}{op_type}"),
            domain=domain,
            **{k: v for k, v in attributes.items() if v is not None},
        )
        self._nodes.append(node)
        self._producers.update((name, node) for name in names)
        if self._consumers is not None:
            for name in node.input:
                self._consumers.setdefault(name, []).append(node)
        return names[0] if len(names) == 1 else tuple(names)

    def __getattr__(self, op_type: str) -> Any:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **kwargs: self.op(op_type, *inputs, **kwargs)

    # -- constants ---------------------------------------------------------------
    def const(self, value: Any, dtype: Any, hint: str = "const") -> str:
        """An initializer holding ``value`` cast to ``dtype`` (numpy dtype or ONNX type)."""
        if isinstance(dtype, int):
            dtype = helper.tensor_dtype_to_np_dtype(dtype)
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.names.fresh(hint)
            self.initializers.append(numpy_helper.from_array(array, name))
            self._constants[key] = name
        return self._constants[key]

    def memo(self, key: tuple, emit: Callable[[], Any]) -> Any:
        """``emit()``'s result, emitted once while this builder's nodes are here.

        For subexpressions several emitters share (a bias correction used by every
        weight's update, a row of ones for every bias gradient).
        """
        if key not in self._memo:
            self._memo[key] = emit()
        return self._memo[key]

    def ints(self, values: Sequence[int], hint: str = "axes") -> str:
        """A 1-D int64 constant (axes, shapes, indices)."""
        return self.const(list(values), np.int64, hint)

    # -- opset-dependent forms ------------------------------------------------------
    def _axes_form(self, op_type: str, x: str, axes: Sequence[int] | None, hint: str | None,
                   **attributes: Any) -> str:
        since = _AXES_AS_INPUT_SINCE.get(op_type, _AXES_AS_INPUT_DEFAULT)
        if axes is None:
            return self.op(op_type, x, hint=hint, **attributes)
        if self.opset >= since:
            return self.op(op_type, x, self.ints(axes), hint=hint, **attributes)
        return self.op(op_type, x, hint=hint, axes=list(axes), **attributes)

    def reduce(self, op_type: str, x: str, axes: Sequence[int] | None = None,
               keepdims: int = 1, hint: str | None = None) -> str:
        """``ReduceXxx(x)`` over ``axes`` (all axes when ``None``)."""
        return self._axes_form(op_type, x, axes, hint, keepdims=keepdims)

    def squeeze(self, x: str, axes: Sequence[int], hint: str | None = None) -> str:
        return self._axes_form("Squeeze", x, axes, hint)

    def unsqueeze(self, x: str, axes: Sequence[int], hint: str | None = None) -> str:
        return self._axes_form("Unsqueeze", x, axes, hint)

    def rename(self, value: str, new_name: str, uses: bool = True) -> str:
        """Call the value the builder produced ``value`` by ``new_name`` from now on.

        The producing node's output is renamed, and with ``uses`` every use of the value
        by the builder's nodes (callers that know there is none skip them). The uses are
        found through an index of consumers, so that renaming every value of a large graph
        costs time in proportion to its size, not to its size squared.
        """
        producer = self._producers.pop(value, None)
        if producer is None:
            raise KeyError(f"{value!r} was not produced by this builder")
        producer.output[:] = [new_name if o == value else o for o in producer.output]
        self._producers[new_name] = producer
        if uses:
            consumers = self._consumer_index()
            readers = consumers.pop(value, [])
            for node in readers:
                if value in node.input:
                    node.input[:] = [new_name if name == value else name for name in node.input]
            consumers.setdefault(new_name, []).extend(readers)
        return new_name

    def _consumer_index(self) -> dict[str, list[onnx.NodeProto]]:
        """Value -> the nodes that read it (rebuilt here after ``nodes`` was replaced)."""
        if self._consumers is None:
            self._consumers = {}
            for node in self._nodes:
                for name in node.input:
                    self._consumers.setdefault(name, []).append(node)
        return self._consumers

    def dims(self, x: str, start: int, end: int, hint: str | None = None) -> str:
        """``Shape(x)[start:end]`` (the ``start``/``end`` attributes need opset 15)."""
        if self.opset >= 15:
            return self.Shape(x, start=start, end=end, hint=hint)
        return self.Slice(self.Shape(x), self.ints([start]), self.ints([end]), hint=hint)

    # -- output ------------------------------------------------------------------
    def append_to(self, graph: onnx.GraphProto) -> None:
        """Move everything built so far into ``graph``."""
        graph.node.extend(self._nodes)
        graph.initializer.extend(self.initializers)
        self._nodes, self._consumers, self.initializers = [], {}, []
        self._constants, self._producers, self._memo = {}, {}, {}


def standalone_model(
    b: GraphBuilder,
    name: str,
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[tuple[str, str, onnx.ValueInfoProto]],
    opset: int,
) -> onnx.ModelProto:
    """A model holding ``b``'s nodes, with ``outputs`` as ``(value, output name, info)``.

    Each value is renamed to its output name where ``b`` produced it (consumers
    included), or copied with ``Identity`` where it is a graph input, an initializer
    or already another output. The output names must be reserved in ``b.names``.
    """
    produced = {o for node in b.nodes for o in node.output}
    renames: dict[str, str] = {}
    for value, out_name, _ in outputs:
        if value in produced and value not in renames:
            renames[value] = out_name
        else:
            b.Identity(renames.get(value, value), outputs=[out_name])
    for node in b.nodes:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]
    graph = helper.make_graph([], name, list(inputs), [info for _, _, info in outputs])
    b.append_to(graph)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    check_emitted(model, name)
    return model
