"""lossgraph.models: what every public function accepts as a model. Here, the
onnx-graphsurgeon graph (the bad files and bytes are in test_bad_inputs' catalogue)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph
import lossgraph.compat
from lossgraph.errors import InvalidModelError
from lossgraph.models import as_model

gs = pytest.importorskip("onnx_graphsurgeon")

GOLDEN = GOLDEN_MODELS


def graph_of(name: str, infer_shapes: bool = False):
    model = onnx.load(GOLDEN / f"{name}.onnx")
    return gs.import_onnx(onnx.shape_inference.infer_shapes(model) if infer_shapes else model)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, {"X": x})[0]


def regression_rows() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(40, 5)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def exported(graph) -> bytes:
    return gs.export_onnx(graph).SerializeToString()


@pytest.mark.parametrize("accept", [
    lambda m: lossgraph.add_loss_output(m).SerializeToString(),
    lambda m: lossgraph.gradient(lossgraph.add_loss_output(m)).SerializeToString(),
    lambda m: lossgraph.trainable_initializers(m),
    lambda m: lossgraph.alphabetize_initializers(m)[0].SerializeToString(),
    lambda m: {name: g.SerializeToString()
               for name, g in lossgraph.compile_program(m, fuse="epoch").graphs.items()},
    lambda m: lossgraph.describe_plan(m),
    lambda m: {name: value.tobytes() for name, value in lossgraph.compat
               .OrtGradientForwardBackwardOptimizer(m, max_iter=2, random_state=0)
               .fit(*regression_rows()).get_state().items()},
], ids=["add_loss_output", "gradient", "trainable_initializers", "alphabetize_initializers",
        "compile_program", "describe_plan", "onnxcustom-estimator"])
def test_a_graphsurgeon_graph_is_accepted_as_its_export_is(accept):
    graph = graph_of("skl_mlp_regressor")
    assert accept(graph) == accept(gs.export_onnx(graph))


def test_the_initializers_keep_the_order_gs_export_writes():
    # gs exports initializers in the order nodes first read them, not the file's order
    graph = graph_of("skl_sgd_classifier")
    stored = [t.name for t in onnx.load(GOLDEN / "skl_sgd_classifier.onnx").graph.initializer]
    written = [t.name for t in gs.export_onnx(graph).graph.initializer]
    assert written != stored
    assert [t.name for t in as_model(graph).graph.initializer] == written


def test_a_node_appended_out_of_order_is_sorted_without_changing_the_users_graph():
    graph = graph_of("skl_mlp_regressor")
    prediction = graph.outputs[0]
    scaled = gs.Variable("scaled", dtype=np.float32, shape=prediction.shape)
    two = gs.Constant("two", np.array(2, np.float32))
    graph.nodes.insert(0, gs.Node("Mul", inputs=[prediction, two], outputs=[scaled]))
    graph.outputs = [scaled]
    before = exported(graph)

    model = as_model(graph)
    assert [n.op_type for n in model.graph.node][-2:] == ["Reshape", "Mul"]
    assert [n.op for n in graph.nodes][0] == "Mul" and exported(graph) == before
    x = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    original = run(onnx.load(GOLDEN / "skl_mlp_regressor.onnx"), x)
    np.testing.assert_allclose(run(lossgraph.compile_program(graph).inference_model, x),
                               2 * original, rtol=1e-6)


def test_a_model_cut_at_a_tensor_trains_its_head():
    graph = graph_of("skl_mlp_regressor", infer_shapes=True)
    graph.inputs = [graph.tensors()["next_activations"]]
    graph.cleanup()
    program = lossgraph.compile_program(graph, optimizer=lossgraph.optim.SGD(0.05))
    assert program.weights == ["coefficient1", "intercepts1"]
    rng = np.random.default_rng(0)
    features = rng.normal(size=(256, 16)).astype(np.float32)
    target = features @ rng.normal(size=(16, 1)).astype(np.float32)
    trainer = lossgraph.Trainer(program)
    first = trainer.evaluate(features, target)
    trainer.fit(features, target, epochs=20, batch_size=32, progress=False)
    assert trainer.evaluate(features, target) < first / 10


def test_an_input_without_a_dtype_is_refused_naming_the_fix():
    graph = graph_of("skl_mlp_regressor")
    graph.inputs = [graph.tensors()["next_activations"]]
    graph.cleanup()
    with pytest.raises(InvalidModelError, match="input 'next_activations' has no dtype.*"
                                                "infer_shapes"):
        lossgraph.compile_program(graph)


def test_an_export_failure_is_an_invalid_model_error(monkeypatch):
    def refuse(graph, **kwargs):
        raise RuntimeError("no exporter today")

    monkeypatch.setattr(gs, "export_onnx", refuse)
    with pytest.raises(InvalidModelError, match="onnx-graphsurgeon could not export the graph: "
                                                "no exporter today"):
        as_model(graph_of("hand_linear"))


def test_onnx_graphsurgeon_is_imported_only_for_its_graphs():
    script = ("import sys, onnx, lossgraph\n"
              f"lossgraph.compile_program(onnx.load({str(GOLDEN / 'hand_linear.onnx')!r}))\n"
              "print('onnx_graphsurgeon' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
