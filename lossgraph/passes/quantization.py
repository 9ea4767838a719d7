"""StraightThroughQuantization: quantization-aware training through fake quantization.

A quantized model in the QDQ format (onnxruntime's quantization tools, torch's export of a
model prepared for quantization-aware training) fake-quantizes a float tensor ``w``, a
weight or an activation::

    y = DequantizeLinear(QuantizeLinear(w, s, z), s, z)
      = (clamp(round(w / s) + z, qmin, qmax) - z) s

The derivative of ``y`` with respect to ``w`` is 0 almost everywhere (the rounding), so no
gradient reaches ``w``: :func:`lossgraph.gradient` and :func:`~lossgraph.compile_program`
raise :class:`~lossgraph.errors.NoGradientError` naming the QuantizeLinear. Training
through it uses the straight-through estimator instead, as torch's ``FakeQuantize`` does:
``dy/dw = 1`` where ``qmin <= round(w / s) + z <= qmax``, 0 outside (the scale: torch's
learnable fake quantization, LSQ; see :mod:`lossgraph.autodiff.rules.quantization`). That
is a modelling choice, not the derivative, so lossgraph makes it where asked, with this
pass:

    q = QuantizeLinear(w, s, z)           ->   y = lossgraph.FakeQuantizeLinear(w, s, z)
    y = DequantizeLinear(q, s, z)              (a model-local function: its body is the
                                               pair itself, so the forward is unchanged,
                                               bit for bit; onnxruntime inlines it)

for every pair of the main graph where ``w`` is float or double, the QuantizeLinear's
output is read by the DequantizeLinear (a QuantizeLinear that others read too stays for
them), both nodes take the same scale and zero point (the same values, or constants
equal in value and type) and the same ``axis`` and ``block_size``, and the quantized type
is an integer one (int8, uint8, int16, uint16, int4, uint4). The rewritten node keeps the
DequantizeLinear's output name, and the model imports the ``lossgraph`` domain (version 1).

``dequantize_weights=True`` also gives trainable float weights to a model that stores
only the quantized integers: each ``DequantizeLinear(q, s, z)`` whose ``q`` is an integer
initializer and ``s`` and ``z`` constants becomes ``FakeQuantizeLinear(w, s, z)`` with a
new float initializer ``w = (q - z) s`` (named after ``q``), which fake-quantizes back to
exactly ``q``; an integer initializer others read too stays for them.

Train the result like any model: :func:`~lossgraph.compile_program` keeps the function, and
the exported inference model (:class:`~lossgraph.passes.strip.StripTraining`) has the
QuantizeLinear and DequantizeLinear pairs again. The report lists each rewrite
(:class:`FakeQuantization`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from ..autodiff.rules.quantization import FAKE_QUANTIZE, FAKE_QUANTIZE_DOMAIN, INTEGER_RANGES
from ..graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    GraphIndex,
    attribute_values,
    is_default_domain,
    is_onnx_op,
    opset_version,
)
from ..models import ModelLike
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["StraightThroughQuantization", "FakeQuantization", "straight_through_quantization",
           "quantized_weight_hint"]

#: The attributes of the pair that the function passes on, where the op's schema at the
#: model's opset has them.
_QUANTIZE_ATTRIBUTES = ("axis", "block_size", "output_dtype", "saturate")
_DEQUANTIZE_ATTRIBUTES = ("axis", "block_size")


@dataclass(frozen=True)
class FakeQuantization:
    """One rewrite: ``output`` is now ``FakeQuantizeLinear(value, scale, zero_point)``;
    ``weight`` is the float initializer made from an integer one (``dequantize_weights``),
    else empty."""

    output: str
    value: str
    scale: str
    zero_point: str
    weight: str = ""


@dataclass(frozen=True)
class StraightThroughQuantization(Pass[tuple[FakeQuantization, ...]]):
    """Fake-quantization pairs (QuantizeLinear -> DequantizeLinear of a float tensor)
    rewritten into ``lossgraph.FakeQuantizeLinear`` nodes, differentiated with the
    straight-through estimator (module doc); with ``dequantize_weights``, integer weights
    behind a DequantizeLinear become float weights fake-quantized the same way. The report
    is the tuple of :class:`FakeQuantization` done, in graph order."""

    dequantize_weights: bool = False

    def call(self, model: onnx.ModelProto) -> PassResult:
        ops = {node.op_type for node in model.graph.node if is_default_domain(node.domain)}
        if "DequantizeLinear" not in ops:
            return PassResult(model, (), changed=False)
        rewrites = _Rewriter(model, self.dequantize_weights).run()
        return PassResult(model, tuple(rewrites), changed=bool(rewrites))


def straight_through_quantization(model: ModelLike, dequantize_weights: bool = False
                                  ) -> onnx.ModelProto:
    """A copy of ``model`` whose fake-quantization pairs train with the straight-through
    estimator (:class:`StraightThroughQuantization`)."""
    return StraightThroughQuantization(dequantize_weights)(model).model


def quantized_weight_hint(graph: onnx.GraphProto, name: str) -> str:
    """Advice for an error about the integer weight ``name`` that a DequantizeLinear of
    ``graph`` reads: how to train it as a float weight; "" for any other value."""
    if not any(node.op_type == "DequantizeLinear" and node.input[:1] == [name]
               for node in graph.node):
        return ""
    return (f" {name!r} is a quantized weight (a DequantizeLinear reads it): to fine-tune it, "
            "replace it with a float weight that fake-quantizes back to it, model = "
            "lossgraph.passes.straight_through_quantization(model, dequantize_weights=True) "
            f"(the weight is named {name + '_float'!r}), and train that: the "
            "straight-through estimator, docs/reference/gradient.md.")


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, dequantize_weights: bool) -> None:
        self.model = model
        self.graph = model.graph
        self.dequantize_weights = dequantize_weights
        self.opset = opset_version(model) or onnx.defs.onnx_opset_version()
        self.facts = ForwardFacts.of(model)
        self.names = NameAuthority.for_model(model)
        self.index = GraphIndex(self.graph.node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.outputs = {o.name for o in self.graph.output}
        #: what the rewrites stop reading: QuantizeLinear outputs, integer weights
        self.replaced_levels: set[str] = set()
        self.replaced_weights: set[str] = set()

    def run(self) -> list[FakeQuantization]:
        rewrites: list[FakeQuantization] = []
        replaced: dict[int, onnx.NodeProto] = {}
        for index, node in enumerate(self.graph.node):
            if not is_onnx_op(node, "DequantizeLinear"):
                continue
            found = self._pair(node) or self._integer_weight(node)
            if found is not None:
                replaced[index], rewrite = found
                rewrites.append(rewrite)
        if not rewrites:
            return []
        nodes = [replaced.get(i, node) for i, node in enumerate(self.graph.node)]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self._drop_unread()
        self._declare_function()
        return rewrites

    # -- matching ----------------------------------------------------------------------
    def _pair(self, node: onnx.NodeProto) -> tuple[onnx.NodeProto, FakeQuantization] | None:
        quantize = self.index.producer(node.input[0])
        if quantize is None or quantize.op_type != "QuantizeLinear" \
                or not is_default_domain(quantize.domain):
            return None
        value = quantize.input[0]
        if self.facts.elem_types.get(value) not in FLOAT_TYPES:
            return None
        if self.facts.elem_types.get(quantize.output[0]) not in INTEGER_RANGES:
            return None
        if not all(self._same(_input(quantize, i), _input(node, i)) for i in (1, 2)):
            return None
        q_attrs, dq_attrs = attribute_values(quantize), attribute_values(node)
        if any(q_attrs.get(a, default) != dq_attrs.get(a, default)
               for a, default in (("axis", 1), ("block_size", 0))):
            return None
        if set(dq_attrs) - set(_DEQUANTIZE_ATTRIBUTES):
            return None  # a newer DequantizeLinear's output type: not the pair's value
        attributes = {k: v for k, v in q_attrs.items() if k in _QUANTIZE_ATTRIBUTES}
        fake = self._node(value, quantize.input[1], _input(quantize, 2), node, attributes)
        self.replaced_levels.add(quantize.output[0])
        return fake, FakeQuantization(node.output[0], value, fake.input[1], fake.input[2])

    def _integer_weight(self, node: onnx.NodeProto
                        ) -> tuple[onnx.NodeProto, FakeQuantization] | None:
        if not self.dequantize_weights:
            return None
        quantized, scale, zero_point = node.input[0], node.input[1], _input(node, 2)
        tensor = self.initializers.get(quantized)
        if tensor is None or tensor.data_type not in INTEGER_RANGES:
            return None
        scale_value = self.facts.constants.get(scale)
        zero_value = self.facts.constants.get(zero_point) if zero_point else np.zeros((), int)
        if scale_value is None or zero_value is None:
            return None
        attributes = {k: v for k, v in attribute_values(node).items()
                      if k in _DEQUANTIZE_ATTRIBUTES}
        if not zero_point and tensor.data_type != onnx.TensorProto.UINT8:
            if self.opset < 21:  # QuantizeLinear's output type is its zero point's
                return None
            attributes["output_dtype"] = tensor.data_type
        weight = _dequantized(numpy_helper.to_array(tensor), scale_value, zero_value,
                              attributes.get("axis", 1), attributes.get("block_size", 0))
        name = self.names.fresh(f"{quantized}_float")
        self.graph.initializer.append(numpy_helper.from_array(weight, name))
        self.replaced_weights.add(quantized)
        fake = self._node(name, scale, zero_point, node, attributes)
        return fake, FakeQuantization(node.output[0], name, scale, fake.input[2], weight=name)

    def _same(self, first: str, second: str) -> bool:
        """Whether two inputs are the same value: one name, or equal constants."""
        if first == second:
            return True
        a, b = self.facts.constants.get(first), self.facts.constants.get(second)
        return a is not None and b is not None and a.dtype == b.dtype \
            and a.shape == b.shape and bool(np.array_equal(a, b))

    # -- emitting ----------------------------------------------------------------------
    def _node(self, value: str, scale: str, zero_point: str, dequantize: onnx.NodeProto,
              attributes: dict) -> onnx.NodeProto:
        """The FakeQuantizeLinear node; an absent zero point is given explicitly (0 of the
        quantized type: uint8, or ``output_dtype``), since onnxruntime 1.32 does not run a
        function called without an optional input as 1.19 does."""
        schema = onnx.defs.get_schema("QuantizeLinear", self.opset)
        kept = {k: v for k, v in attributes.items() if k in schema.attributes}
        if not zero_point:
            elem_type = kept.pop("output_dtype", 0) or onnx.TensorProto.UINT8
            zero_point = self.names.fresh(f"{value}_zero_point")
            self.graph.initializer.append(numpy_helper.from_array(
                np.zeros((), helper.tensor_dtype_to_np_dtype(elem_type)), zero_point))
        inputs = [value, scale, zero_point]
        return helper.make_node(FAKE_QUANTIZE, inputs, [dequantize.output[0]],
                                name=dequantize.name, domain=FAKE_QUANTIZE_DOMAIN,
                                doc_string=dequantize.doc_string, **kept)

    def _drop_unread(self) -> None:
        """The QuantizeLinear nodes and integer weights the rewrites read instead of, where
        nothing reads them any more."""
        read = {name for node in self.graph.node for name in node.input} | self.outputs
        nodes = [node for node in self.graph.node
                 if not (node.output[0] in self.replaced_levels and node.output[0] not in read)]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        read = {name for node in self.graph.node for name in node.input} | self.outputs
        kept = [t for t in self.graph.initializer
                if t.name in read or t.name not in self.replaced_weights]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept)

    def _declare_function(self) -> None:
        """The function ``lossgraph.FakeQuantizeLinear(x, scale, zero_point)``: the pair,
        its attributes passed on by reference."""
        if not any(o.domain == FAKE_QUANTIZE_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(FAKE_QUANTIZE_DOMAIN, 1))
        if any(f.domain == FAKE_QUANTIZE_DOMAIN and f.name == FAKE_QUANTIZE
               for f in self.model.functions):
            return
        quantize = onnx.defs.get_schema("QuantizeLinear", self.opset).attributes
        dequantize = onnx.defs.get_schema("DequantizeLinear", self.opset).attributes
        names = [a for a in _QUANTIZE_ATTRIBUTES if a in quantize]

        def by_reference(node: onnx.NodeProto, schema) -> onnx.NodeProto:
            for name in names:
                if name in schema and (node.op_type == "QuantizeLinear"
                                       or name in _DEQUANTIZE_ATTRIBUTES):
                    node.attribute.append(onnx.AttributeProto(
                        name=name, ref_attr_name=name, type=schema[name].type))
            return node

        body = [by_reference(helper.make_node("QuantizeLinear", ["x", "scale", "zero_point"],
                                              ["quantized"]), quantize),
                by_reference(helper.make_node("DequantizeLinear",
                                              ["quantized", "scale", "zero_point"], ["y"]),
                             dequantize)]
        function = helper.make_function(
            FAKE_QUANTIZE_DOMAIN, FAKE_QUANTIZE, ["x", "scale", "zero_point"], ["y"], body,
            [helper.make_opsetid("", self.opset)], attributes=names,
            doc_string="DequantizeLinear(QuantizeLinear(x, scale, zero_point), scale, "
                       "zero_point): fake quantization, differentiated with the "
                       "straight-through estimator (lossgraph.passes.quantization)")
        self.model.functions.append(function)


def _input(node: onnx.NodeProto, position: int) -> str:
    return node.input[position] if position < len(node.input) else ""


def _dequantized(levels: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int,
                 block: int) -> np.ndarray:
    """``(levels - zero_point) scale`` in the scale's type, the scale and zero point
    broadcast per tensor, along ``axis``, or per ``block`` elements along it."""
    scale, zero_point = np.asarray(scale), np.asarray(zero_point)
    rank = levels.ndim
    axis %= max(rank, 1)

    def spread(value: np.ndarray) -> np.ndarray:
        if value.ndim == 0 or value.size == 1 and block == 0:
            return value.reshape(())
        if block:
            value = np.repeat(value, block, axis=axis)
            return np.take(value, np.arange(levels.shape[axis]), axis=axis)
        shape = [1] * rank
        shape[axis] = -1
        return value.reshape(shape)

    difference = levels.astype(np.int64) - spread(zero_point).astype(np.int64)
    return (difference.astype(scale.dtype) * spread(scale)).astype(scale.dtype)
