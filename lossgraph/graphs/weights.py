"""A model's weights apart from its graph: every tensor it stores, the model without its
large weights' data for onnx's checker and shape inference, and the model without the
data of the weights a program holds anyway (:func:`held_apart`, :func:`put_back`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnx
from onnx import helper

from .held import (
    HOLD_MIN_BYTES,
    copy_fields,
    held_in,
    held_tensors,
    is_held,
    well_formed_weight,
)
from .queries import all_graphs

__all__ = ["stored_tensors", "with_weight_data", "without_weight_data", "held_apart",
           "put_back"]


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


def without_weight_data(model: onnx.ModelProto, min_bytes: int = HOLD_MIN_BYTES
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


def held_apart(model: onnx.ModelProto, values: Mapping[str, np.ndarray]
               ) -> tuple[onnx.ModelProto, frozenset[str]]:
    """A copy of ``model`` without the data of the main graph's initializers that ``values``
    holds byte for byte (raw data only), and their names: :func:`put_back` restores the
    model exactly from ``values``. A program keeps its inference model so, since its state
    holds the weights (one copy of each, not two). The copy is made tensor by tensor, never
    the whole model at once. A held weight (:class:`HeldWeights`, a light model of compile)
    whose value is its store's array is set aside without reading its data; any other
    stays held (a frozen weight: the program's graphs read it from the same store)."""
    graph = model.graph
    light = onnx.ModelProto()
    copy_fields(model, light, skip="graph")
    copy_fields(graph, light.graph, skip="initializer")
    apart = set()
    for tensor in graph.initializer:
        kept = light.graph.initializer.add()
        found = held_in(tensor)
        if found is not None and values.get(tensor.name) is found[0].array(found[1]):
            copy_fields(tensor, kept, skip="raw_data")
            found[0].unmark(kept, found[1])
            apart.add(tensor.name)
        elif found is None and _holds(tensor, values.get(tensor.name)):
            copy_fields(tensor, kept, skip="raw_data")
            apart.add(tensor.name)
        else:
            kept.CopyFrom(tensor)
    return light, frozenset(apart)


def put_back(model: onnx.ModelProto, values: Mapping[str, np.ndarray], names: frozenset[str]
             ) -> onnx.ModelProto:
    """A copy of ``model`` (from :func:`held_apart`) with the data of its initializers
    ``names`` taken from ``values``, and of its held weights from their store: the model
    :func:`held_apart` was given, to the byte, with every weight's data."""
    whole = onnx.ModelProto()
    copy_fields(model, whole, skip="graph")
    copy_fields(model.graph, whole.graph, skip="initializer")
    for tensor in model.graph.initializer:
        restored = whole.graph.initializer.add()
        found = held_in(tensor)
        if found is not None:
            copy_fields(tensor, restored, skip="raw_data")
            found[0].put_back(restored, found[1])
            continue
        restored.CopyFrom(tensor)
        if tensor.name in names:
            restored.raw_data = np.ascontiguousarray(values[tensor.name]).tobytes()
    return with_weight_data(whole)  # held weights of nested graphs


def _holds(tensor: onnx.TensorProto, value: np.ndarray | None) -> bool:
    """Whether ``value`` is ``tensor``'s data, byte for byte, held as raw data."""
    if value is None or not tensor.HasField("raw_data") or tuple(tensor.dims) != value.shape:
        return False
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type != \
            helper.np_dtype_to_tensor_dtype(value.dtype):
        return False
    return len(tensor.raw_data) == value.nbytes and \
        np.array_equal(np.frombuffer(tensor.raw_data, np.uint8),
                       np.ascontiguousarray(value).reshape(-1).view(np.uint8))
