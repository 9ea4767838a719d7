"""SpecializeBatch (lossgraph/speed/specialize_batch.py): a step or epoch graph with its batch
fixed, then FoldStaticShapes and SplitRowProducts, as the compiler and the Trainer apply it;
it computes what the general graph computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.data_propagation import long_vectors, recording_data_propagation, wide_program
from support.environment import GOLDEN_MODELS
from support.linear import LINEAR, linear_data
from support.models import gelu_mlp
from support.rewrites import scan_body, specialized_step

import lossgraph
from lossgraph.errors import UnsupportedOptionError
from lossgraph.optim import Adam, Momentum
from lossgraph.speed import SpecializeBatch


def _epoch_feeds(program, graph, X, y, batch, batches, sample_weight=None):
    rows = batch * batches
    data = {"x": X[:rows], "label": y[:rows].reshape(-1, 1)}
    if sample_weight is not None:
        data["w"] = sample_weight[:rows]
    feeds = {**data, **program.state}
    feeds[program.io(graph, "learning_rates")[0]] = np.full(batches, 0.05, np.float32)
    feeds[program.io(graph, "step")[0]] = np.array(1, np.int64)
    return feeds


@pytest.mark.parametrize("weighted", [False, True])
def test_specialized_epoch_has_no_shape_arithmetic_and_computes_the_same(run_model, weighted):
    X, y = linear_data(120, seed=3)
    weights = np.linspace(0.5, 1.5, 120, dtype=np.float32) if weighted else None
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                loss_options={"weight_name": "w"} if weighted else None,
                                fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    result = SpecializeBatch(20)(general)
    assert result.changed
    assert not [n for n in scan_body(result.model).node if n.op_type in ("Shape", "Size")]
    assert any(n.op_type in ("Shape", "Size") for n in scan_body(general).node)  # untouched
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 20, 6, weights)
    expected = run_model(general, feeds)
    for name, value in run_model(result.model, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_specialization_is_a_pipeline_of_the_rewrites():
    assert str(SpecializeBatch(16)) == "SpecializeBatch(batch=16)"
    with pytest.raises(UnsupportedOptionError, match="batch size must be an int >= 1"):
        SpecializeBatch(0)


def test_a_trainer_switching_batch_sizes_equals_step_by_step_training():
    X, y = linear_data(100, seed=4)
    states = []
    for mode in ("step", "epoch"):
        program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                    optimizer=Momentum(0.02, momentum=0.9), fuse=mode)
        trainer = lossgraph.Trainer(program)
        for batch in (32, 10, 32):  # a new batch size replaces the specialized session
            trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=True, random_state=batch,
                        progress=False, warm_start=True)
        states.append(trainer.state)
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_reshape_to_the_shape_a_value_already_has_becomes_identity(run_model):
    given = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        reshaped (float[N, 4] x) => (float[N, 1] y)
        <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5},
         int64[2] column = {-1, 1}>
        {
            h = MatMul(x, coef)
            t = Add(h, intercept)
            y = Reshape(t, column)
        }
    """)
    program = lossgraph.compile_program(given, optimizer=Momentum(0.05), fuse="epoch")
    specialized = SpecializeBatch(10)(program.graphs["train_epoch_ordered"]).model
    (forward,) = [n for n in scan_body(specialized).node if n.input and n.input[0] == "t_in_step"]
    assert forward.op_type == "Identity"
    X, y = linear_data(40, seed=5)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 10, 4)
    expected = run_model(program.graphs["train_epoch_ordered"], feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_specialized_step_graph_folds_its_shapes_and_computes_the_same(run_model):
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                fuse="step")
    X, y = linear_data(16, seed=6)
    specialized = specialized_step(program, 16, {"x": X, "label": y.reshape(-1, 1)}, run_model)
    assert [i.type.tensor_type.shape.dim[0].dim_value for i in specialized.graph.input
            if i.name in ("x", "label")] == [16, 16]
    assert any(n.op_type in ("Shape", "Size") for n in program.graphs["train_step"].graph.node)
    assert not [n for n in specialized.graph.node if n.op_type in ("Shape", "Size")]


def test_a_specialized_step_runs_no_node_whose_output_nothing_reads(run_model):
    """A value the backward recomputes only to read its shape: once the shape folds, the
    copy goes (onnxruntime would run it last, holding what it reads until then). The
    numbers are the general graph's to float rounding: the folded ``Reshape`` changes
    which kernels onnxruntime runs, without the fold as with it."""
    program = lossgraph.compile_program(gelu_mlp(viewed=True), loss="squared_error",
                                        optimizer=Momentum(0.05), fuse="step",
                                        recompute="activations")
    rng = np.random.default_rng(3)
    data = {"x": rng.standard_normal((16, 3)).astype(np.float32),
            "label": rng.standard_normal((16, 1)).astype(np.float32)}
    graph = specialized_step(program, 16, data, run_model, rtol=1e-5, atol=1e-7).graph
    read = {v for n in graph.node for v in n.input} | {o.name for o in graph.output}
    assert any("_recomputed" in n.name for n in program.graphs["train_step"].graph.node)
    assert not [n.name for n in graph.node if n.op_type != "Constant"
                and not any(o in read for o in n.output)]


def test_a_long_batch_splits_the_weight_gradients_and_computes_the_same(run_model):
    """At 5000 rows the hidden layer's ``x^T @ dz`` and its bias gradient's row of ones are
    split across threads (SplitRowProducts); the step's numbers stay the general graph's to
    float rounding."""
    program = lossgraph.compile_program(onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx"),
                                        optimizer=Adam(0.05), fuse="step")
    rng = np.random.default_rng(7)
    data = {"X": rng.normal(size=(5000, 5)).astype(np.float32),
            "label": rng.normal(size=(5000, 1)).astype(np.float32)}
    specialized = specialized_step(program, 5000, data, run_model, rtol=1e-5, atol=1e-6)
    splits = {n.name.split("/split/")[0] for n in specialized.graph.node if "/split/" in n.name}
    assert len(splits) == 3  # x^T dz, the bias gradient's ones @ dz, and h^T g (one column)


def test_a_step_graph_for_current_onnxruntime_alone_specializes_too():
    newer = LINEAR.replace('"" : 18', '"" : 23')
    program = lossgraph.compile_program(onnx.parser.parse_model(newer), target="onnxruntime",
                                optimizer=Momentum(0.05))
    specialized = SpecializeBatch(16)(program.graphs["train_step"]).model
    assert specialized.opset_import[0].version == 23


def test_only_full_batches_of_an_array_fit_run_a_specialized_step_graph():
    X, y = linear_data(100, seed=7)
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.02),
                                fuse="step")
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=1, batch_size=32, shuffle=False, progress=False)
    specialized = [("train_step", 32), ("train_step", None)]
    assert sorted(trainer.engine.open_sessions, key=str) == specialized
    streamed = [(X[a:b], y[a:b]) for a, b in [(0, 7), (7, 30), (30, 100)]]
    trainer.fit(streamed, epochs=2, progress=False, warm_start=True)  # no session per size
    assert sorted(trainer.engine.open_sessions, key=str) == specialized


@pytest.mark.parametrize("batch, parts", [(1000, 4), (2000, 8), (1009, None), (500, None)])
def test_a_long_one_row_product_of_a_specialized_epoch_is_split(run_model, batch, parts):
    """The weight gradient of a one-output layer, ``row[1, batch] @ x[batch, 4]``, runs as
    ``parts`` products of ``batch / parts`` rows summed (onnxruntime threads those), when
    the batch is long enough and divides into parts of at least 250 rows."""
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                optimizer=Momentum(0.02, momentum=0.9), fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    specialized = SpecializeBatch(batch)(general).model
    body = scan_body(specialized)
    shapes = [onnx.numpy_helper.to_array(i).tolist() for i in body.initializer]
    split = [s for s in shapes if isinstance(s, list) and len(s) == 3 and s[1] == 1]
    assert split == ([[parts, 1, batch // parts]] if parts else [])
    X, y = linear_data(2 * batch, seed=8)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, batch, 2)
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_specializing_a_named_batch_fixes_it_in_the_outputs_too():
    """A dimension name stands for one size in the whole graph: the outputs that carry the
    inputs' batch name get the batch size, the others keep theirs."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 3] x, float[M, 3] z) => (float[N, 3] y, float[M, 3] w, float[K] k)
        { y = Relu(x)  w = Relu(z)  k = Shape(x) }""")
    model.graph.output[2].type.tensor_type.elem_type = onnx.TensorProto.INT64
    special = SpecializeBatch(4)(model).model
    dims = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim]
            for o in special.graph.output}
    assert dims == {"y": [4, 3], "w": [4, 3], "k": ["K"]}


def test_a_scalar_read_only_in_its_wide_form_is_not_left_behind():
    """onnxruntime warns of initializers no node reads: widening leaves none."""
    from lossgraph.graphs import all_graphs, values_read

    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    for fuse in ("step", "epoch", "separate"):
        program = lossgraph.compile_program(model, fuse=fuse)
        for name, graph in program.graphs.items():
            read = values_read(graph.graph)
            for body in all_graphs(graph.graph):
                unread = [t.name for t in body.initializer if t.name not in read]
                assert not unread, (fuse, name, unread)


def test_a_scan_of_the_model_itself_is_not_taken_for_the_epoch_scan():
    """Only the epoch graph's Scan (its signature names the learning rates it scans) gets
    the batch size on its scanned inputs; a step graph holding a Scan of its own (a
    recurrent layer's) is specialized on its data inputs."""
    body = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["s", "e"], ["s_new"]),
         onnx.helper.make_node("Identity", ["s_new"], ["o"])], "body",
        [onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, ["B", 3])],
        [onnx.helper.make_tensor_value_info("s_new", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, ["B", 3])])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body,
                               num_scan_inputs=1)], "g",
        [onnx.helper.make_tensor_value_info("s0", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", "B", 3])],
        [onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("ys", onnx.TensorProto.FLOAT, ["T", "B", 3])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    model.ir_version = 8
    special = SpecializeBatch(5)(model).model
    dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in special.graph.input]
    assert dims == [[5, 3], [5, "B", 3]]  # the graph's own inputs, not the body's
    body_dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
                 for i in special.graph.node[0].attribute[0].g.input]
    assert body_dims == [["B", 3], ["B", 3]]


# -- shape inference with data propagation, the packed weights kept out ---------------------

def test_specializing_never_propagates_data_through_the_packed_weights(monkeypatch):
    """onnx's data propagation holds every static 1-D tensor element by element: on
    ResNet-18's epoch graph (11 million packed weights) each of SpecializeBatch's three
    calls took 5 s, against 0.01 s on its step graph. The packing and the update of the
    packed vectors never reach it."""
    epoch = wide_program().graphs["train_epoch"]
    seen = recording_data_propagation(monkeypatch)
    SpecializeBatch(8)(epoch)
    monkeypatch.undo()
    assert seen and not long_vectors(seen), long_vectors(seen)


@pytest.mark.parametrize("graph", ["train_step", "train_epoch", "train_epoch_ordered"])
@pytest.mark.parametrize("batch", [8, 3000])
def test_specializing_without_the_long_vectors_gives_the_same_graph(monkeypatch, graph, batch):
    """SpecializeBatch folds and splits exactly what onnx's own data propagation over the
    packed vectors lets it fold and split, byte for byte."""
    import lossgraph.speed.scopes as scopes

    general = wide_program().graphs[graph]
    fast = SpecializeBatch(batch)(general).model
    monkeypatch.setattr(scopes, "infer_shapes_with_data",
                        lambda m: onnx.shape_inference.infer_shapes(m, data_prop=True))
    assert fast.SerializeToString() == SpecializeBatch(batch)(general).model.SerializeToString()
