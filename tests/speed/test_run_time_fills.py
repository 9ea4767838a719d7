"""LargeFillsAtRunTime (lossgraph/speed/run_time_fills.py): a large fill whose shape a
runtime knows before the run reads an empty slice of an input instead, so that
onnxruntime cannot fold it into a constant it stores; the values are unchanged."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import lossgraph
from lossgraph.autodiff.context import RUN_TIME_FILL_VALUES
from lossgraph.optim import SGD
from lossgraph.speed import LargeFillsAtRunTime, SpecializeBatch
from lossgraph.speed.run_time_fills import _known_before_the_run


def _fills_known_before_the_run(model: onnx.ModelProto) -> dict[str, int]:
    """The ConstantOfShape outputs of the main graph a runtime could fold, with their
    number of values."""
    graph = model.graph
    inferred = onnx.shape_inference.infer_shapes(model).graph
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None
                       for d in v.type.tensor_type.shape.dim]
              for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    known = _known_before_the_run(graph, {t.name for t in graph.initializer}, shapes)
    return {node.output[0]: int(np.prod(shapes[node.output[0]]))
            for node in graph.node
            if node.op_type == "ConstantOfShape" and node.input[0] in known}


def _fills_model() -> onnx.ModelProto:
    """z = x + zeros[600, 512] (307,200 values: large), w = step + ones[4] (small)."""
    fill = numpy_helper.from_array(np.zeros(1, np.float32), "value")
    nodes = [helper.make_node("ConstantOfShape", ["large_shape"], ["zeros"], value=fill),
             helper.make_node("Add", ["x", "zeros"], ["z"]),
             helper.make_node("ConstantOfShape", ["small_shape"], ["ones"],
                              value=numpy_helper.from_array(np.ones(1, np.float32), "value")),
             helper.make_node("Add", ["step", "ones"], ["w"])]
    graph = helper.make_graph(
        nodes, "fills",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [600, 512]),
         helper.make_tensor_value_info("step", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [600, 512]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array([600, 512], np.int64), "large_shape"),
         numpy_helper.from_array(np.array([4], np.int64), "small_shape")])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def test_a_large_fill_reads_an_input_and_computes_the_same(run_model):
    model = _fills_model()
    assert _fills_known_before_the_run(model) == {"zeros": 600 * 512, "ones": 4}
    result = LargeFillsAtRunTime()(model)
    assert result.changed
    assert _fills_known_before_the_run(result.model) == {"ones": 4}
    feeds = {"x": np.random.default_rng(0).random((600, 512), dtype=np.float32),
             "step": np.array(3, np.float32)}
    before, after = run_model(model, feeds), run_model(result.model, feeds)
    for name in ("z", "w"):
        np.testing.assert_array_equal(after[name], before[name])
    again = LargeFillsAtRunTime()(result.model)  # nothing left for a runtime to fold
    assert not again.changed


def test_a_fill_the_batch_makes_large_stays_a_run_time_fill_once_specialized(run_model):
    """A cross-entropy's gradient over many classes scatters into zeros the size of the
    logits: of symbolic size in the compiled graph, of static size once the Trainer fixes
    the batch, where onnxruntime would store them; the specialized step reads an input
    there, and computes what the general graph computes."""
    classes, rows = RUN_TIME_FILL_VALUES // 4 + 1, 4
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(3, classes)).astype(np.float32) * 0.01
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(weight, "W")])
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    program = lossgraph.compile_program(model, loss="multiclass_log_loss",
                                        loss_options={"from_logits": True},
                                        optimizer=SGD(0.1), fuse="step")
    general = program.graphs["train_step"]
    specialized = SpecializeBatch(rows)(general).model
    assert not [name for name, size in _fills_known_before_the_run(specialized).items()
                if size >= RUN_TIME_FILL_VALUES]
    feeds = {"x": rng.normal(size=(rows, 3)).astype(np.float32),
             "label": rng.integers(0, classes, size=rows).astype(np.int64),
             **program.state}
    for role, value in (("learning_rate", np.array(0.1, np.float32)),
                        ("step", np.array(1, np.int64))):
        feeds[program.io("train_step", role)[0]] = value
    names = [o.name for o in general.graph.output]
    expected = run_model(general, feeds)
    got = run_model(specialized, feeds)
    for name in names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7,
                                   err_msg=name)
