"""ZipMapToTensor: a classifier's ZipMap output replaced by the probability tensor it zips::

    output_probability = ZipMap(probabilities)     (a list of {class: probability} maps)
        becomes
    probabilities                                  (float, (N, classes)), the same position

skl2onnx ends every classifier with a ``ZipMap`` unless told ``options={'zipmap': False}``:
a sequence of maps, which no loss reads and no gradient passes. The tensor it zips holds
the same numbers, one row per sample, one column per class in the classifier's order.
:func:`~lossgraph.compile_program` trains on that tensor (the loss model, and its ``predict``
graph returns it), and keeps the ZipMap in the exported inference model, so the trained
model answers as the one given did. The report maps each replaced output to its tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..graphs import ForwardFacts, GraphIndex, attribute_value
from .contract import Pass, PassResult

__all__ = ["ZipMapToTensor", "zipped_outputs"]

ML_DOMAIN = "ai.onnx.ml"


def zipped_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """The outputs of ``model`` a ZipMap makes, each with the tensor it zips."""
    index = GraphIndex(model.graph.node)
    zipped = {}
    for output in model.graph.output:
        node = index.producer(output.name)
        if node is not None and node.domain == ML_DOMAIN and node.op_type == "ZipMap":
            zipped[output.name] = node.input[0]
    return zipped


def zipped_node(model: onnx.ModelProto, output: str) -> onnx.NodeProto:
    """The ZipMap node making ``output``."""
    return next(node for node in model.graph.node if output in node.output)


def _zipped_type(inferred: onnx.TypeProto | None, node: onnx.NodeProto) -> onnx.TypeProto:
    """The zipped tensor's type: shape inference's, else what ZipMap takes (onnx's
    specification: a float tensor, one column per class label)."""
    if inferred is not None and inferred.tensor_type.elem_type:
        return inferred
    labels = attribute_value(node, "classlabels_int64s") or attribute_value(
        node, "classlabels_strings") or []
    return onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT,
                                              [None, len(labels) or None])


@dataclass(frozen=True)
class ZipMapToTensor(Pass[dict[str, str]]):
    """Each output a ZipMap makes replaced by the tensor it zips (module docstring)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        zipped = zipped_outputs(model)
        if not zipped:
            return PassResult(model, {}, changed=False)
        graph = model.graph
        types = ForwardFacts.of(model).types
        outputs = []
        for output in graph.output:
            tensor = zipped.get(output.name)
            if tensor is None:
                outputs.append(output)
                continue
            if any(o.name == tensor for o in graph.output):
                continue  # the tensor is an output already
            outputs.append(onnx.helper.make_value_info(tensor, _zipped_type(
                types.get(tensor), zipped_node(model, output.name))))
        del graph.output[:]
        graph.output.extend(outputs)
        read = {name for node in graph.node for name in node.input} | {o.name for o in outputs}
        kept = [n for n in graph.node if not (n.domain == ML_DOMAIN and n.op_type == "ZipMap"
                                             and not any(o in read for o in n.output))]
        del graph.node[:]
        graph.node.extend(kept)
        return PassResult(model, zipped)
