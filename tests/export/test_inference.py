"""The inference export: every source gives the same model, with the trained weights as
initializers and nothing of training left; it passes the checker, predicts what the
trainer predicts, loads in the onnxruntime of this environment (plain onnxruntime in the
second test environment), and large weights go to an external data file that lossgraph
never writes over when it did not write it."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import recipes
from onnx import helper, numpy_helper
from support.environment import GOLDEN_MODELS

import lossgraph
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidDataError,
    InvalidProgramError,
    ShapeMismatchError,
    UnknownNameError,
    UnsafeWriteError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.export import inference, save_inference_model, to_inference_model
from lossgraph.optim import SGD, Momentum
from lossgraph.passes import StripTraining
from lossgraph.target import DEFAULT_TARGET, resolve_target, use_target

GOLDEN = GOLDEN_MODELS
#: golden model -> compile_program options
GOLDEN_LOSSES: dict[str, dict[str, Any]] = {
    "skl_mlp_regressor": {},
    "skl_mlp_classifier": {"loss": "multiclass_log_loss"},
    "torch_cnn": {"loss": "multiclass_log_loss", "loss_options": {"from_logits": True}},
    "hand_linear": {},
}


def golden(name: str) -> onnx.ModelProto:
    return onnx.load(GOLDEN / f"{name}.onnx")


def labels(y: np.ndarray) -> np.ndarray:
    return y.reshape(-1, 1) if y.dtype.kind == "f" else y


@functools.cache
def trained(name: str) -> tuple[lossgraph.Trainer, np.ndarray]:
    """A golden model trained a few steps with momentum (so the state holds optimizer
    states too), and test features. Tests only read the trainer."""
    X, y, X_test, _ = recipes.dataset(name)
    program = lossgraph.compile_program(golden(name), optimizer=Momentum(0.05),
                                        **GOLDEN_LOSSES[name])
    trainer = lossgraph.Trainer(program).fit(X, labels(y), epochs=1, batch_size=50,
                                             random_state=0, progress=False)
    return trainer, X_test


def wide_model() -> onnx.ModelProto:
    """An MLP whose first weight (16x32 floats) is large enough for external data, between
    small initializers, so the export must keep the initializers' order."""
    rng = np.random.default_rng(7)
    weights = {"W1": rng.normal(size=(16, 32)), "b1": rng.normal(size=32) * 0.1,
               "W2": rng.normal(size=(32, 4)) * 0.2, "b2": rng.normal(size=4) * 0.1}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["z"]),
             helper.make_node("Add", ["z", "b2"], ["y"])]
    graph = helper.make_graph(
        nodes, "wide", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@functools.cache
def trained_wide() -> tuple[lossgraph.Trainer, np.ndarray]:
    rng = np.random.default_rng(8)
    X = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.normal(size=(64, 4)).astype(np.float32)
    program = lossgraph.compile_program(wide_model(), optimizer=SGD(0.05))
    return lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=16, random_state=0,
                                          progress=False), X


def predictions(model: onnx.ModelProto | str | os.PathLike, X: np.ndarray,
                output: str) -> np.ndarray:
    """``output`` of ``model`` on ``X`` in a plain inference session of this environment."""
    import onnxruntime

    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else os.fspath(model)
    session = onnxruntime.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run([output], {session.get_inputs()[0].name: X})[0]


def save_program_with_state(trainer: lossgraph.Trainer, folder: Path) -> Path:
    program = trainer.program
    return lossgraph.TrainingProgram(program.graphs, program.manifest, trainer.state,
                                     program.inference_model).save(folder)


# -- every source kind -------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*GOLDEN_LOSSES, "wide"])
def test_every_source_kind_gives_the_same_model(name, tmp_path):
    trainer, _ = trained_wide() if name == "wide" else trained(name)
    model = wide_model() if name == "wide" else golden(name)
    options = {} if name == "wide" else GOLDEN_LOSSES[name]
    loss_model = lossgraph.add_loss_output(model, options.get("loss", "squared_error"),
                                           **options.get("loss_options", {}))
    trainer.save_checkpoint(tmp_path / "checkpoint")
    save_program_with_state(trainer, tmp_path / "program")
    onnx.save(loss_model, tmp_path / "loss.onnx")
    state = trainer.state  # weights and the optimizer's velocities (skipped)
    expected = to_inference_model(trainer).SerializeToString()
    sources = {
        "program and state": (trainer.program, state),
        "program folder": (tmp_path / "program", None),
        "checkpoint folder": (str(tmp_path / "checkpoint"), None),
        "inference model and state": (model, state_of_weights(trainer)),
        "loss model and state": (loss_model, state_of_weights(trainer)),
        "loss model bytes and state": (loss_model.SerializeToString(), state_of_weights(trainer)),
        "loss model file and state": (tmp_path / "loss.onnx", state_of_weights(trainer)),
    }
    for what, (source, given) in sources.items():
        assert to_inference_model(source, given).SerializeToString() == expected, what
    # Nothing to strip in these models: the trainer's own export agrees byte for byte.
    assert trainer.to_inference_model().SerializeToString() == expected


def test_a_programs_own_export_is_the_export_and_fills_what_a_state_lacks():
    """TrainingProgram.to_inference_model is lossgraph.export.to_inference_model: a state
    without some weight keeps the program's value for it; NaN weights are refused."""
    trainer, _ = trained("hand_linear")
    program, state = trainer.program, trainer.state
    partial = {program.weights[0]: state[program.weights[0]]}
    assert program.to_inference_model(partial).SerializeToString() == \
        to_inference_model(program, partial).SerializeToString()
    values = {t.name: numpy_helper.to_array(t)
              for t in program.to_inference_model(partial).graph.initializer}
    np.testing.assert_array_equal(values[program.weights[0]], state[program.weights[0]])
    np.testing.assert_array_equal(values[program.weights[1]], program.state[program.weights[1]])
    with pytest.raises(InvalidDataError, match="NaN or infinite"):
        program.to_inference_model({program.weights[0]: np.full_like(partial[
            program.weights[0]], np.nan)})


def state_of_weights(trainer: lossgraph.Trainer) -> dict[str, np.ndarray]:
    state = trainer.state
    return {w: state[w] for w in trainer.program.weights}


def test_a_program_without_state_exports_its_own_state():
    trainer, _ = trained("hand_linear")
    program = trainer.program
    exported = to_inference_model(program)
    values = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for weight in program.weights:
        np.testing.assert_array_equal(values[weight], program.state[weight])
        assert not np.array_equal(values[weight], trainer.state[weight])  # trained since


# -- golden models -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_LOSSES)
def test_a_trained_golden_model_exports_with_nothing_of_training_left(name):
    trainer, X_test = trained(name)
    program = trainer.program
    exported = to_inference_model(trainer)
    onnx.checker.check_model(exported, full_check=True)
    original = golden(name)
    assert [i.name for i in exported.graph.input] == [i.name for i in original.graph.input]
    assert [o.name for o in exported.graph.output] == [o.name for o in original.graph.output]
    assert not [p.key for p in exported.metadata_props if p.key.startswith("lossgraph.")]
    assert exported.ir_version == DEFAULT_TARGET.ir_version
    assert {o.domain for o in exported.opset_import} <= {"", "ai.onnx.ml"}
    assert all(node.domain in ("", "ai.onnx.ml") for node in exported.graph.node)
    values = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for weight in program.weights:
        np.testing.assert_array_equal(values[weight], trainer.state[weight])
    assert any(not np.array_equal(values[w], program.state[w]) for w in program.weights)
    prediction = program.manifest["roles"]["prediction"]
    np.testing.assert_allclose(predictions(exported, X_test, prediction),
                               trainer.predict(X_test), rtol=1e-5, atol=1e-6)


def test_the_export_predicts_what_the_trainer_predicts_with_large_weights():
    trainer, X = trained_wide()
    exported = to_inference_model(trainer)
    assert [t.name for t in exported.graph.initializer] == ["W1", "b1", "W2", "b2"]
    assert [i.name for i in exported.graph.input] == ["x"]
    np.testing.assert_allclose(predictions(exported, X, "y"), trainer.predict(X), rtol=1e-5,
                               atol=1e-6)


# -- BatchNormalization and Dropout in training mode ------------------------------------------

BN_DROPOUT = """<ir_version: 10, opset_import: ["" : 18]>
bn_dropout (float[N, 4] x) => (float[N, 3] y)
<float[4] scale = {1.0, 0.5, 2.0, 1.5}, float[4] shift = {0.1, -0.2, 0.3, 0.0},
 float[4] mean = {0.5, -0.5, 1.0, 0.0}, float[4] var = {1.0, 2.0, 0.5, 4.0},
 float[4, 3] W = {0.1, 0.2, -0.3, 0.4, -0.5, 0.6, 0.7, 0.8, -0.9, 1.0, 0.1, -0.2},
 float[3] B = {0.01, 0.02, 0.03}, float ratio = {0.25}, bool training = {1}>
{
  h, running_mean, running_var = BatchNormalization <training_mode: int = 1> (x, scale, shift,
                                                                               mean, var)
  a = Relu(h)
  d, mask = Dropout(a, ratio, training)
  z = MatMul(d, W)
  y = Add(z, B)
}"""


def eval_mode_reference(state: dict[str, np.ndarray], X: np.ndarray) -> np.ndarray:
    """BatchNormalization with its running statistics, Dropout as the identity: numpy."""
    model = onnx.parser.parse_model(BN_DROPOUT)
    p = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer} | state
    h = p["scale"] * (X - p["mean"]) / np.sqrt(p["var"] + 1e-5) + p["shift"]
    return np.maximum(h, 0) @ p["W"] + p["B"]


def test_batch_normalization_and_dropout_export_in_inference_mode():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.normal(size=(64, 3)).astype(np.float32)
    program = lossgraph.compile_program(onnx.parser.parse_model(BN_DROPOUT), optimizer=SGD(0.05))
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=16, random_state=0,
                                             progress=False)
    exported = to_inference_model(trainer)
    onnx.checker.check_model(exported, full_check=True)
    ops = {node.op_type: node for node in exported.graph.node}
    assert "Dropout" not in ops and ops["Identity"].input[0] == "a"
    norm = ops["BatchNormalization"]
    assert list(norm.output) == ["h"]
    assert helper.get_attribute_value(norm.attribute[0]) == 0
    names = {t.name for t in exported.graph.initializer}
    assert {"ratio", "training"}.isdisjoint(names)
    # the trained weights and the running statistics training updated (buffers)
    assert program.buffers == ["mean", "var"]
    state = {w: trainer.state[w] for w in [*program.weights, *program.buffers]}
    assert not np.array_equal(state["scale"], program.state["scale"])
    assert not np.array_equal(state["mean"], program.state["mean"])
    expected = eval_mode_reference(state, X)
    np.testing.assert_allclose(predictions(exported, X, "y"), expected, rtol=1e-5, atol=1e-5)
    # The same rows give the same predictions: nothing random is left.
    np.testing.assert_array_equal(predictions(exported, X, "y"), predictions(exported, X, "y"))


def test_a_dropout_whose_mask_is_read_keeps_it_with_a_constant_false_flag():
    model = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 5] x, bool train) => (float[N, 5] y)
    <float ratio = {0.5}>
    {
      d, mask = Dropout(x, ratio, train)
      keep = Cast <to: int = 1> (mask)
      y = Mul(d, keep)
    }""")
    before = model.SerializeToString()
    result = StripTraining()(model)
    assert model.SerializeToString() == before
    exported = result.model
    assert [i.name for i in exported.graph.input] == ["x"]  # the training flag is gone
    dropout = next(n for n in exported.graph.node if n.op_type == "Dropout")
    flag = next(t for t in exported.graph.initializer if t.name == dropout.input[2])
    assert not numpy_helper.to_array(flag)
    assert result.report["inference_mode"] == ["Dropout#0"]
    assert result.report["inputs"] == ["train"]
    X = np.random.default_rng(1).normal(size=(7, 5)).astype(np.float32)
    np.testing.assert_array_equal(predictions(exported, X, "y"), X)


def test_a_dropout_flag_from_a_constant_node_goes_with_the_dropout():
    model = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 5] x) => (float[N, 5] y)
    {
      train = Constant <value = bool {1}> ()
      rate = Constant <value = float {0.3}> ()
      y, mask = Dropout(x, rate, train)
    }""")
    result = StripTraining()(model)
    assert [n.op_type for n in result.model.graph.node] == ["Identity"]
    assert sorted(result.report["nodes"]) == ["Constant#0", "Constant#1"]


def test_a_dropout_already_in_inference_mode_and_unrelated_values_are_left_alone():
    model = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 5] x) => (float[N, 5] y)
    <bool off = {0}, float unused = {2.0}>
    {
      y = Dropout(x, unused, off)
      spare = Constant <value = float {1.0}> ()
    }""")
    result = StripTraining()(model)
    assert not result.changed
    assert [n.op_type for n in result.model.graph.node] == ["Dropout", "Constant"]


def test_running_statistics_returned_as_outputs_are_removed_and_read_ones_refused():
    outputs = """<ir_version: 10, opset_import: ["" : 18]>
    g (float[N, 2] x) => (float[N, 2] y, float[2] rm)
    <float[2] s = {1, 1}, float[2] b = {0, 0}, float[2] m = {0, 0}, float[2] v = {1, 1}>
    {
      y, rm, rv = BatchNormalization <training_mode: int = 1> (x, s, b, m, v)
      EXTRA
    }"""
    result = StripTraining()(onnx.parser.parse_model(outputs.replace("EXTRA", "")))
    assert [o.name for o in result.model.graph.output] == ["y"]
    assert result.report["outputs"] == ["rm"]
    read = outputs.replace("EXTRA", "twice = Add(rv, rv)")
    with pytest.raises(UnsupportedModelError, match="'rv'"):
        StripTraining()(onnx.parser.parse_model(read))


def test_an_opset_13_batch_normalization_in_training_mode_keeps_one_output():
    model = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 13]>
    g (float[N, 2] x) => (float[N, 2] y)
    <float[2] s = {1, 2}, float[2] b = {0, 1}, float[2] m = {0, 1}, float[2] v = {1, 4}>
    {
      y, rm, rv, sm, sv = BatchNormalization (x, s, b, m, v)
    }""")
    exported = StripTraining()(model).model
    assert list(exported.graph.node[0].output) == ["y"]
    X = np.array([[1.0, 3.0], [0.0, 1.0]], np.float32)
    expected = (X - [0, 1]) / np.sqrt(np.array([1, 4]) + 1e-5) * [1, 2] + [0, 1]
    np.testing.assert_allclose(predictions(exported, X, "y"), expected, rtol=1e-6)


def test_the_loss_its_inputs_and_the_roles_record_go():
    loss_model = lossgraph.add_loss_output(golden("hand_linear"), weight_name="w",
                                           penalty={"W": 0.1})
    result = StripTraining()(loss_model)
    assert result.report["loss"] == "loss"
    assert result.report["inputs"] == ["label", "w"]
    assert result.report["outputs"] == ["loss"]
    assert result.report["metadata"] == ["lossgraph.roles"]
    assert result.model.SerializeToString() == StripTraining()(golden("hand_linear")).model \
        .SerializeToString()


def test_training_graphs_are_refused_with_the_way_to_export():
    trainer, _ = trained("hand_linear")
    with pytest.raises(UnsupportedModelError, match="training graph.*to_inference_model"):
        to_inference_model(trainer.program.graphs["train_step"], state_of_weights(trainer))


# -- weights ----------------------------------------------------------------------------------


def test_weights_given_for_graph_inputs_become_initializers():
    trainer, X = trained_wide()
    predict = trainer.program.graphs["predict"]  # weights as inputs, as a runner feeds them
    exported = to_inference_model(predict, state_of_weights(trainer))
    onnx.checker.check_model(exported, full_check=True)
    assert [i.name for i in exported.graph.input] == ["x"]
    assert {"W1", "b1", "W2", "b2"} <= {t.name for t in exported.graph.initializer}
    np.testing.assert_allclose(predictions(exported, X, "y"), trainer.predict(X), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize(("state", "error", "match"), [
    ({"W_": np.zeros((6, 1), np.float32)}, UnknownNameError, "'W_'.*Did you mean 'W'"),
    ({"W": np.zeros((6, 1), np.float64)}, DTypeMismatchError, "'W' is float64.*float32"),
    ({"W": np.zeros((6, 2), np.float32)}, ShapeMismatchError, r"'W' has shape \[6, 2\]"),
    ({"W": np.full((6, 1), np.nan, np.float32)}, InvalidDataError, "'W' holds NaN"),
    ([("W", np.zeros((6, 1), np.float32))], UnsupportedOptionError, "dict of arrays"),
])
def test_bad_weights_are_named_errors(state, error, match):
    trainer, _ = trained("hand_linear")
    with pytest.raises(error, match=match):
        to_inference_model(trainer, state)


@pytest.mark.parametrize(("source", "error"), [
    (42, UnsupportedOptionError),
    ("folder", InvalidProgramError),
])
def test_bad_sources_are_named_errors(source, error, tmp_path):
    if source == "folder":
        source = tmp_path
        (tmp_path / "notes.txt").write_text("not a program")
    with pytest.raises(error):
        to_inference_model(source)


def test_nothing_the_user_gave_is_changed(tmp_path):
    trainer, X = trained_wide()
    program = trainer.program
    graphs = {name: graph.SerializeToString() for name, graph in program.graphs.items()}
    inference_model = program.inference_model.SerializeToString()
    initial = {name: value.copy() for name, value in program.state.items()}
    live, predicted = trainer.state, trainer.predict(X)
    model = wide_model()
    given = model.SerializeToString()
    state = state_of_weights(trainer)
    copies = {name: value.copy() for name, value in state.items()}
    to_inference_model(trainer)
    to_inference_model(program, state)
    to_inference_model(model, state)
    save_inference_model(trainer, tmp_path / "m.onnx", external_data=True)
    assert {n: g.SerializeToString() for n, g in program.graphs.items()} == graphs
    assert program.inference_model.SerializeToString() == inference_model
    assert model.SerializeToString() == given
    for name, value in initial.items():
        np.testing.assert_array_equal(program.state[name], value)
    for name, value in live.items():
        np.testing.assert_array_equal(trainer.state[name], value)
    for name, value in copies.items():
        np.testing.assert_array_equal(state[name], value)
    np.testing.assert_array_equal(trainer.predict(X), predicted)


# -- targets ----------------------------------------------------------------------------------

OPSET_23 = """<ir_version: 10, opset_import: ["" : 23]>
g (float[N, 2] x) => (float[N, 2] y) <float[2] w = {1, 2}> { y = Mul(x, w) }"""


def test_the_export_follows_the_target():
    model = onnx.parser.parse_model(OPSET_23)
    # the default target loads opset 21: Mul means the same there, the export is lowered
    assert [(o.domain, o.version) for o in to_inference_model(model).opset_import] == [("", 21)]
    by_option = to_inference_model(model, target="onnxruntime")
    with use_target("onnxruntime"):
        by_block = to_inference_model(model)
    assert by_option.SerializeToString() == by_block.SerializeToString()
    assert by_option.ir_version == resolve_target("onnxruntime").ir_version
    assert [(o.domain, o.version) for o in by_option.opset_import] == [("", 23)]


# -- files and external data ------------------------------------------------------------------


def test_external_data_round_trip(tmp_path):
    trainer, X = trained_wide()
    path = save_inference_model(trainer, tmp_path / "wide.onnx", external_data=True)
    assert path == (tmp_path / "wide.onnx").absolute()
    assert sorted(os.listdir(tmp_path)) == ["wide.onnx", "wide.onnx.data"]
    data = (tmp_path / "wide.onnx.data").read_bytes()
    assert data.startswith(inference.DATA_MAGIC)
    assert (tmp_path / "wide.onnx").stat().st_size < 16 * 32 * 4  # W1 is in the data file
    bare = onnx.load(path, load_external_data=False)
    w1 = next(t for t in bare.graph.initializer if t.name == "W1")
    assert {e.key: e.value for e in w1.external_data}["location"] == "wide.onnx.data"
    assert [t.name for t in bare.graph.initializer] == ["W1", "b1", "W2", "b2"]
    assert any(p.key == "lossgraph.written_by" for p in bare.metadata_props)
    onnx.checker.check_model(str(path), full_check=True)
    loaded = onnx.load(path)
    np.testing.assert_array_equal(numpy_helper.to_array(
        next(t for t in loaded.graph.initializer if t.name == "W1")), trainer.state["W1"])
    expected = predictions(to_inference_model(trainer), X, "y")
    np.testing.assert_array_equal(predictions(path, X, "y"), expected)
    np.testing.assert_array_equal(predictions(loaded, X, "y"), expected)
    # What lossgraph writes, lossgraph reads back (the data file from the model's folder).
    assert to_inference_model(path).SerializeToString() == to_inference_model(
        trainer).SerializeToString()


@pytest.mark.parametrize("external_data", [False, True])
def test_the_saved_model_merges_lora_adapters_large_ones_too(tmp_path, external_data):
    """save_inference_model(merge=True) writes to_inference_model(merge=True)'s model: the
    base graph, W1 + delta (W1, A and B large: kept apart while exported); by default the
    adapters' branch stays."""
    from lossgraph.adapters import LoRA, read_adapters

    rng = np.random.default_rng(8)
    X, y = rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 4)).astype(
        np.float32)
    program = lossgraph.compile_program(wide_model(), optimizer=SGD(0.05),
                                        adapters=LoRA(rank=16, alpha=4, targets=["W1"]))
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=8, progress=False)
    path = save_inference_model(trainer, tmp_path / "merged.onnx", merge=True,
                                external_data=external_data)
    merged, base = onnx.load(path), wide_model()
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in base.graph.node]
    assert [t.name for t in merged.graph.initializer] == ["W1", "b1", "W2", "b2"]
    assert not read_adapters(merged) and len(merged.graph.input) == 1
    expected = to_inference_model(trainer, merge=True)
    for ours, theirs in zip(merged.graph.initializer, expected.graph.initializer):
        np.testing.assert_array_equal(numpy_helper.to_array(ours), numpy_helper.to_array(theirs))
    assert not np.allclose(numpy_helper.to_array(merged.graph.initializer[0]),
                           numpy_helper.to_array(base.graph.initializer[0]), atol=1e-4)
    np.testing.assert_allclose(predictions(path, X, "y"), trainer.predict(X), rtol=1e-5,
                               atol=1e-5)
    kept = onnx.load(save_inference_model(trainer, tmp_path / "kept.onnx"))
    assert read_adapters(kept) and len(kept.graph.node) > len(base.graph.node)


def test_external_data_is_chosen_when_the_model_would_exceed_the_size_limit(tmp_path):
    trainer, _ = trained_wide()
    save_inference_model(trainer, tmp_path / "big.onnx", size_limit=1000)
    save_inference_model(trainer, tmp_path / "small.onnx", size_limit=100_000)
    save_inference_model(trainer, tmp_path / "default.onnx")
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data", "default.onnx",
                                            "small.onnx"]
    inline = onnx.load(tmp_path / "small.onnx", load_external_data=False)
    assert not any(t.external_data for t in inline.graph.initializer)


def test_a_model_over_the_protobuf_limit_is_refused_in_memory(monkeypatch, tmp_path):
    trainer, _ = trained_wide()
    monkeypatch.setattr(lossgraph.inference, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(UnsupportedModelError, match="save_inference_model"):
        to_inference_model(trainer)
    with pytest.raises(UnsupportedOptionError, match="external_data=False"):
        save_inference_model(trainer, tmp_path / "m.onnx", external_data=False)
    assert not list(tmp_path.iterdir())
    save_inference_model(trainer, tmp_path / "m.onnx")  # external data, whatever size_limit
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]


def test_files_lossgraph_did_not_write_are_never_replaced(tmp_path):
    trainer, _ = trained_wide()
    data = tmp_path / "m.onnx.data"
    data.write_bytes(b"someone else's weights")
    with pytest.raises(UnsafeWriteError, match="m.onnx.data"):
        save_inference_model(trainer, tmp_path / "m.onnx", external_data=True)
    assert data.read_bytes() == b"someone else's weights"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx.data"]
    onnx.save(wide_model(), tmp_path / "theirs.onnx")
    theirs = (tmp_path / "theirs.onnx").read_bytes()
    with pytest.raises(UnsafeWriteError, match="theirs.onnx"):
        save_inference_model(trainer, tmp_path / "theirs.onnx")
    assert (tmp_path / "theirs.onnx").read_bytes() == theirs
    save_inference_model(trainer, tmp_path / "m.onnx", external_data=True, overwrite=True)
    assert data.read_bytes().startswith(inference.DATA_MAGIC)


def test_lossgraph_replaces_its_own_files(tmp_path):
    trainer, X = trained_wide()
    first = save_inference_model(trainer.program, tmp_path / "m.onnx", external_data=True)
    save_inference_model(trainer, first, external_data=True)
    np.testing.assert_array_equal(predictions(first, X, "y"), trainer.predict(X))
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]


@pytest.mark.parametrize(("option", "match"), [
    ({"external_data": "yes"}, "external_data"),
    ({"size_limit": -1}, "size_limit"),
    ({"overwrite": 1}, "overwrite"),
])
def test_bad_save_options_are_named_errors(option, match, tmp_path):
    trainer, _ = trained("hand_linear")
    with pytest.raises(UnsupportedOptionError, match=match):
        save_inference_model(trainer, tmp_path / "m.onnx", **option)
    assert not list(tmp_path.iterdir())
