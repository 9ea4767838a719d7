"""Batch specialization: the epoch graph a Trainer runs for one batch size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from linear_data import LINEAR, linear_data

import lossgraph
from lossgraph.optim import Adam, Momentum
from lossgraph.runtime.specialize import specialize_batch


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
    program = lossgraph.compile(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                loss_options={"weight_name": "w"} if weighted else None,
                                fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    specialized = specialize_batch(general, 20)
    onnx.checker.check_model(specialized, full_check=True)
    (scan,) = [n for n in specialized.graph.node if n.op_type == "Scan"]
    body = scan.attribute[0].g
    assert not [n for n in body.node if n.op_type in ("Shape", "Size")]
    assert any(  # the general graph is left as it wasn.op_type in ("Shape", "Size") for n in
               next(n for n in general.graph.node if n.op_type == "Scan").attribute[0].g.node)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 20, 6, weights)
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_trainer_switching_batch_sizes_equals_step_by_step_training():
    X, y = linear_data(100, seed=4)
    states = []
    for mode in ("step", "epoch"):
        program = lossgraph.compile(onnx.parser.parse_model(LINEAR),
                                    optimizer=Momentum(0.02, momentum=0.9), fuse=mode)
        trainer = lossgraph.Trainer(program)
        for batch in (32, 10, 32):  # a new batch size replaces the specialized session
            trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=True, random_state=batch,
                        progress=False, warm_start=True)
        states.append(trainer.state)
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_reshape_to_the_shape_a_value_already_has_becomes_identity(run_model):
    model = onnx.parser.parse_model("""
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
    program = lossgraph.compile(model, optimizer=Momentum(0.05), fuse="epoch")
    specialized = specialize_batch(program.graphs["train_epoch_ordered"], 10)
    body = next(n for n in specialized.graph.node if n.op_type == "Scan").attribute[0].g
    (forward,) = [n for n in body.node if n.input and n.input[0] == "t_in_step"]
    assert forward.op_type == "Identity"
    X, y = linear_data(40, seed=5)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 10, 4)
    expected = run_model(program.graphs["train_epoch_ordered"], feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_specialized_step_graph_folds_its_shapes_and_computes_the_same(run_model):
    program = lossgraph.compile(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                fuse="step")
    general = program.graphs["train_step"]
    specialized = specialize_batch(general, 16)
    onnx.checker.check_model(specialized, full_check=True)
    assert [i.type.tensor_type.shape.dim[0].dim_value for i in specialized.graph.input
            if i.name in ("x", "label")] == [16, 16]
    assert any(n.op_type in ("Shape", "Size") for n in general.graph.node)
    assert not [n for n in specialized.graph.node if n.op_type in ("Shape", "Size")]
    X, y = linear_data(16, seed=6)
    feeds = {"x": X, "label": y.reshape(-1, 1), **program.state,
             program.io("train_step", "learning_rate")[0]: np.array(0.05, np.float32),
             program.io("train_step", "step")[0]: np.array(1, np.int64)}
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_only_full_batches_of_an_array_fit_run_a_specialized_step_graph():
    X, y = linear_data(100, seed=7)
    program = lossgraph.compile(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.02),
                                fuse="step")
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=1, batch_size=32, shuffle=False, progress=False)
    assert sorted(trainer._sessions, key=str) == [("train_step", 32), ("train_step", None)]
    streamed = [(X[a:b], y[a:b]) for a, b in [(0, 7), (7, 30), (30, 100)]]
    trainer.fit(streamed, epochs=2, progress=False, warm_start=True)  # no session per size
    assert sorted(trainer._sessions, key=str) == [("train_step", 32), ("train_step", None)]



@pytest.mark.parametrize("batch, parts", [(1000, 4), (2000, 8), (1009, None), (500, None)])
def test_a_long_one_row_product_is_split_into_parts_that_compute_the_same(run_model, batch,
                                                                          parts):
    """The weight gradient of a one-output layer, ``row[1, batch] @ x[batch, 4]``, runs as
    ``parts`` products of ``batch / parts`` rows summed (onnxruntime threads those), when
    the batch is long enough and divides into parts of at least 250 rows."""
    program = lossgraph.compile(onnx.parser.parse_model(LINEAR),
                                optimizer=Momentum(0.02, momentum=0.9), fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    specialized = specialize_batch(general, batch)
    onnx.checker.check_model(specialized, full_check=True)
    body = next(n for n in specialized.graph.node if n.op_type == "Scan").attribute[0].g
    shapes = [onnx.numpy_helper.to_array(i).tolist() for i in body.initializer]
    split = [s for s in shapes if isinstance(s, list) and len(s) == 3 and s[1] == 1]
    assert split == ([[parts, 1, batch // parts]] if parts else [])
    X, y = linear_data(2 * batch, seed=8)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, batch, 2)
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
