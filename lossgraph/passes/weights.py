"""Which tensors are weights: trainable initializers become graph inputs
(:class:`WeightsToInputs`), ``Constant`` nodes named as weights become initializers
(:class:`ConstantsToInitializers`).

    initializer W (value v)   ->   graph input W   (v returned, to be fed at run time)
    W = Constant(value=v)     ->   initializer W (value v)

Training graphs take their weights as inputs so a runner can keep them in device
buffers and swap input and output buffers between steps without copies; the
initial values travel in the training program's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ..errors import UnknownNameError, UnsupportedModelError, suggest
from ..graphs import is_onnx_op, tensor_array
from .contract import Pass, PassResult, name_fields

__all__ = ["ConstantsToInitializers", "WeightsToInputs"]


@dataclass(frozen=True)
class WeightsToInputs(Pass[dict[str, np.ndarray]]):
    """Turn the initializers ``weights`` into graph inputs (appended in that order); the
    report is their values by name."""

    weights: Sequence[str]

    def __post_init__(self) -> None:
        name_fields(self, "weights")

    def call(self, model: onnx.ModelProto) -> PassResult:
        return PassResult(model, _lift(model, list(self.weights)))


def _lift(model: onnx.ModelProto, names: list[str]) -> dict[str, np.ndarray]:
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    for name in names:
        if name not in initializers:
            raise UnknownNameError(
                f"{name!r} is not an initializer of the model."
                + suggest(name, list(initializers), "initializers")
            )
    chosen = set(names)
    values = {name: tensor_array(initializers[name]) for name in names}
    for name, value in values.items():
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(value))[0])
            raise UnsupportedModelError(
                f"Weight {name!r} holds {value[at] if at else value} at index {at}: a weight "
                "that is not finite stays so whatever the updates (its gradient is infinite "
                "or NaN), and a loss that clips its probabilities can hide it while the "
                "training seems to run. Give the model finite weights (or leave this one out "
                "of weights=).")
    kept = [t for t in graph.initializer if t.name not in chosen]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    declared = {i.name for i in graph.input}
    for name in names:
        if name not in declared:  # IR < 4 models may list initializers as inputs already
            tensor = initializers[name]
            graph.input.append(
                helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    return values


@dataclass(frozen=True)
class ConstantsToInitializers(Pass[list[str]]):
    """Turn the ``Constant`` nodes giving ``names`` into initializers of those names (and
    the same values), so that they can be trained: an exporter may fold what was a
    parameter into a constant (:func:`~lossgraph.analysis.constant_weights`), and
    ``compile_program(weights=[...])`` naming its output trains it. The report is the names
    made initializers."""

    names: Sequence[str]

    def __post_init__(self) -> None:
        name_fields(self, "names")

    def call(self, model: onnx.ModelProto) -> PassResult:
        graph = model.graph
        wanted = set(self.names)
        tensors, kept = {}, []
        for node in graph.node:
            value = next((a.t for a in node.attribute if a.name == "value"), None) \
                if is_onnx_op(node, "Constant") and node.output[0] in wanted else None
            if value is None:
                kept.append(node)
                continue
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value)
            tensor.name = node.output[0]
            tensors[tensor.name] = tensor
        missing = [name for name in self.names if name not in tensors]
        if missing:
            constants = [n.output[0] for n in graph.node if is_onnx_op(n, "Constant")]
            raise UnknownNameError(
                f"{missing[0]!r} is not the output of a Constant node holding a tensor."
                + suggest(missing[0], constants, "Constant outputs"))
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(tensors[name] for name in self.names)
        return PassResult(model, list(self.names))
