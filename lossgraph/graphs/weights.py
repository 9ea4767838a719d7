"""A model's weights apart from its graph: every tensor it stores, and the model without
its large weights' data for onnx's checker and shape inference.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import helper

from .held import HOLD_MIN_BYTES, copy_fields, held_tensors, is_held, well_formed_weight
from .queries import all_graphs

__all__ = ["stored_tensors", "with_weight_data", "without_weight_data"]


def stored_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor the model stores, which onnx may keep in external files: initializers
    (sparse ones' values too) and attribute tensors, of the graph and its subgraphs."""
    for graph in all_graphs(model.graph):
        yield from graph.initializer
        yield from (sparse.values for sparse in graph.sparse_initializer)
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.HasField("t"):
                    yield attribute.t
                yield from attribute.tensors


#: Smaller tensors keep their data: they cost less to serialize than to set aside, and
#: shape inference reads small constants (a Reshape target, Resize scales), never a weight.
_WEIGHT_MIN_BYTES = HOLD_MIN_BYTES


def without_weight_data(model: onnx.ModelProto, min_bytes: int = _WEIGHT_MIN_BYTES
                        ) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """``model`` without the data of its weights, for onnx's checker and shape inference,
    which serialize the whole model on each call (a BERT-base model's 440 MB, dozens of
    times in one compile); and the tensors set aside.

    Each large floating-point initializer of the main graph becomes a graph input of its
    type (same name, element type and dims), so that both see the same types. Only tensors
    whose data the checker would accept are set aside (raw data of exactly the declared
    size, no other value field, not external), and the weights a store holds
    (:class:`~lossgraph.graphs.HeldWeights`): any other is left in, for the checker to
    report; so is every tensor of a model of IR version 3, which must list its
    initializers as inputs. A held weight of a nested graph (a frozen weight in an epoch
    graph's Scan body) becomes an input of the main graph, which the nested graph reads
    from its outer scope (names are unique across graphs). ``model`` itself is returned
    when nothing is set aside; it is never changed. ``min_bytes``: the size from which a
    weight is set aside (a caller that infers shapes many times sets aside smaller ones
    too).
    """
    graph = model.graph
    if model.ir_version < 4:
        return model, []
    inputs = {value.name for value in graph.input}
    heavy = [tensor for tensor in graph.initializer if tensor.name not in inputs
             and (is_held(tensor) or well_formed_weight(tensor, min_bytes))]
    nested = [tensor for sub in list(all_graphs(graph))[1:] for tensor in sub.initializer
              if is_held(tensor)]
    if not heavy and not nested:
        return model, []
    light = onnx.ModelProto()
    copy_fields(model, light, skip="graph")
    copy_fields(graph, light.graph, skip="initializer")
    aside = {tensor.name for tensor in (*heavy, *nested)}
    light.graph.initializer.extend(t for t in graph.initializer if t.name not in aside)
    for sub in list(all_graphs(light.graph))[1:] if nested else ():
        kept = [t for t in sub.initializer if t.name not in aside]
        del sub.initializer[:]
        sub.initializer.extend(kept)
    light.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                             for t in (*heavy, *nested))
    return light, [*heavy, *nested]


def with_weight_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the data of its held weights (:class:`HeldWeights`) put back: a copy,
    or ``model`` itself when it holds none."""
    if not any(True for _ in held_tensors(stored_tensors(model))):
        return model
    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    for tensor, store, key in list(held_tensors(stored_tensors(whole))):
        store.put_back(tensor, key)
    return whole
