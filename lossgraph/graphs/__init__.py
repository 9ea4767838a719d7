"""ONNX graphs as the passes see them, one module per concern:

- :mod:`.queries`: node attributes, subgraphs, the names used anywhere, the values a graph
  reads from outside, readers, shortest paths;
- :mod:`.index`: :class:`GraphIndex`, each value's producer and readers, built once;
- :mod:`.facts`: :class:`ForwardFacts`, what shape inference (and the rank rules it lacks)
  knows of a model's values;
- :mod:`.weights`: the tensors a model stores, and the model without its weights' data;
- :mod:`.held`: :class:`HeldWeights`, a model's large weights held apart while passes run;
- :mod:`.spans`: where in a model file each initializer's bytes lie;
- :mod:`.types`: element types, dtypes, opsets, the default domain;
- :mod:`.rename`: :func:`rename_values`, the one in-place rewrite the passes share.

Every name is importable from ``lossgraph.graphs`` itself.
"""

from .facts import LONG_VECTOR, ForwardFacts, all_value_types, infer_shapes_with_data
from .held import HeldWeights, is_held, tensor_array
from .index import GraphIndex, shortest_path
from .queries import (
    all_graphs,
    attribute_value,
    attribute_values,
    captured_values,
    constant_value,
    initializer_arrays,
    known_shapes,
    names_in_graph,
    node_reads,
    outer_references,
    subgraphs,
    torch_name_scopes,
    values_read,
)
from .rename import rename_values
from .types import (
    FLOAT_TYPES,
    Shape,
    canonical_domain,
    elem_type_name,
    is_default_domain,
    is_onnx_op,
    np_dtype,
    opset_version,
    weights_dtype,
)
from .weights import (
    held_apart,
    put_back,
    stored_tensors,
    with_weight_data,
    without_weight_data,
)

__all__ = [
    "FLOAT_TYPES", "Shape", "ForwardFacts", "all_value_types", "GraphIndex", "attribute_values",
    "attribute_value", "constant_value", "subgraphs", "all_graphs", "names_in_graph",
    "values_read", "torch_name_scopes",
    "outer_references", "node_reads", "captured_values", "stored_tensors",
    "with_weight_data", "without_weight_data",
    "HeldWeights", "is_held", "tensor_array", "held_apart", "put_back",
    "shortest_path", "elem_type_name", "np_dtype", "weights_dtype", "opset_version",
    "initializer_arrays", "rename_values", "known_shapes", "is_default_domain",
    "canonical_domain", "is_onnx_op", "infer_shapes_with_data", "LONG_VECTOR",
]
