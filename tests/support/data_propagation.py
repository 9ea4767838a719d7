"""What the tests of shape inference with data propagation share (tests/graphs/test_facts.py
and tests/speed/test_specialize_batch.py): a program whose epoch graph packs more weights
than ``LONG_VECTOR``, the models onnx's data propagation is called on, the long vectors in
them, and a model's types and nodes to compare."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import lossgraph
from lossgraph.graphs import all_graphs, known_shapes
from lossgraph.optim import Adam

#: onnx's data propagation costs in proportion to a static 1-D tensor's length from here
#: (lossgraph.graphs.LONG_VECTOR)
LONG = 4096


def wide_program(fuse: str = "epoch") -> lossgraph.TrainingProgram:
    """A layer of 80 x 64 weights, then one output: its epoch graph packs 5,249 values,
    more than LONG_VECTOR."""
    rng = np.random.default_rng(0)
    weights = {"w1": (80, 64), "b1": (64,), "w2": (64, 1)}
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]),
         onnx.helper.make_node("Add", ["h", "b1"], ["a"]),
         onnx.helper.make_node("Relu", ["a"], ["r"]),
         onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])], "wide",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 80])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])],
        [onnx.numpy_helper.from_array(rng.normal(size=shape).astype(np.float32) * 0.1, name)
         for name, shape in weights.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)],
                                   ir_version=8)
    return lossgraph.compile_program(model, optimizer=Adam(0.01), fuse=fuse)


def types(model: onnx.ModelProto) -> list[dict[str, bytes]]:
    """The declared type of every value, by graph (subgraphs included)."""
    return [{v.name: v.type.SerializeToString() for v in (*g.value_info, *g.input, *g.output)}
            for g in all_graphs(model.graph)]


def nodes(model: onnx.ModelProto) -> list[tuple]:
    """Every node of every graph: op, inputs, outputs, attributes but graphs."""
    return [(n.op_type, tuple(n.input), tuple(n.output),
             tuple(a.SerializeToString() for a in n.attribute if not a.g.node))
            for g in all_graphs(model.graph) for n in g.node]


def recording_data_propagation(monkeypatch: pytest.MonkeyPatch) -> list[onnx.ModelProto]:
    """The models onnx's shape inference with data propagation is called on, from now."""
    seen: list[onnx.ModelProto] = []
    real = onnx.shape_inference.infer_shapes

    def recording(model, *args, **kwargs):
        if kwargs.get("data_prop"):
            seen.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    return seen


def long_vectors(models: list[onnx.ModelProto]) -> list[str]:
    """The outputs of nodes (not Constants) of ``models`` that are 1-D of LONG values or more."""
    return [n.output[0] for graph, shapes in _shaped_graphs(models) for n in graph.node
            if n.op_type != "Constant" and len(n.output) == 1
            and _long(shapes.get(n.output[0]))]


def long_vector_readers(models: list[onnx.ModelProto]) -> list[str]:
    """The outputs of 1-D vectors that nodes of ``models`` compute from a 1-D value of LONG
    values or more (``Shape`` and ``Size`` but read its length): onnx's data propagation
    holds as many dimensions, known values or not."""
    found = []
    for graph, shapes in _shaped_graphs(models):
        long = {name for name, shape in shapes.items() if _long(shape)}
        found += [n.output[0] for n in graph.node
                  if n.op_type not in ("Shape", "Size") and len(n.output) == 1
                  and len(shapes.get(n.output[0]) or []) == 1 and long.intersection(n.input)]
    return found


def _shaped_graphs(models: list[onnx.ModelProto]):
    """``(graph, its values' shapes from inference without data propagation)`` for every
    graph of ``models``, subgraphs included."""
    for given in models:
        plain = onnx.shape_inference.infer_shapes(given)
        for graph, shaped in zip(all_graphs(given.graph), all_graphs(plain.graph)):
            yield graph, known_shapes(shaped)


def _long(shape) -> bool:
    """Whether ``shape`` is 1-D of LONG values or more."""
    return len(shape or []) == 1 and (shape[0] or 0) >= LONG
