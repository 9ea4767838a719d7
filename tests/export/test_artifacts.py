"""onnxruntime's training artifacts (lossgraph.export.to_ort_artifacts) and its checkpoint
flatbuffer (lossgraph.export.ort_checkpoint).

Without the training build: the layout onnxruntime's Module and Optimizer read, the eval
model's loss, the checkpoint's bytes and reader, determinism within and across the two
environments, refused optimizers and folders. With it (and torch, which
``onnxruntime.training`` imports): onnxruntime trains from lossgraph's artifacts to the
weights lossgraph's Trainer reaches, and the facts about the format the design relies on.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.environment import GOLDEN_MODELS, ROOT
from support.linear import linear_model

import lossgraph
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidProgramError,
    NameCollisionError,
    UnsafeWriteError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.export import read_ort_checkpoint, to_ort_artifacts
from lossgraph.export.artifacts import artifacts_plan
from lossgraph.export.ort_checkpoint import (
    OptimizerGroup,
    OrtCheckpoint,
    checkpoint_bytes,
    parse_ort_checkpoint,
    write_ort_checkpoint,
)
from lossgraph.optim import SGD, Adam, AdamW, Momentum
from lossgraph.passes import InferenceMode
from lossgraph.passes.plan import PlanRunner
from lossgraph.target import DEFAULT_TARGET, use_target

MLP = GOLDEN_MODELS / "skl_mlp_regressor.onnx"  # 5 -> 16 (relu) -> 1, four weights
LINEAR = GOLDEN_MODELS / "hand_linear.onnx"  # 6 -> 1, weights W, B
LOWERED = GOLDEN_MODELS / "skl_linear_regression.onnx"  # ai.onnx.ml LinearRegressor
FEATURES = {MLP: 5, LINEAR: 6, LOWERED: 6}
FILES = ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"]


def data(model: Path, rows: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, FEATURES[model])).astype(np.float32)
    y = (X.sum(axis=1, keepdims=True) + rng.normal(scale=0.1, size=(rows, 1))).astype(np.float32)
    return X, y


def digests(paths) -> dict[str, str]:
    return {Path(p).name: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def mlp_adamw(tmp_path_factory) -> tuple[lossgraph.TrainingProgram, object]:
    """The MLP compiled with AdamW, and its artifacts (read-only for the tests below)."""
    optimizer = AdamW(0.01, weight_decay=0.1)
    folder = tmp_path_factory.mktemp("artifacts") / "mlp"
    paths = to_ort_artifacts(MLP, folder, optimizer=optimizer, properties={"epochs": 0})
    return lossgraph.compile_program(MLP, optimizer=optimizer), paths


def test_the_plan_declares_every_file_and_builds_what_is_written(mlp_adamw):
    program, paths = mlp_adamw
    plan = artifacts_plan(program)
    assert str(plan).splitlines() == [
        "training_model.onnx  = evaluate -> Gradient(weights=('coefficient', 'intercepts', "
        "'coefficient1', 'intercepts1')) -> SumRowsByProduct -> WidenScalarConstants -> "
        "AccumulateGradients",
        "eval_model.onnx      = evaluate -> InferenceMode",
        "optimizer_model.onnx = OrtOptimizerGraph(op_type='AdamWOptimizer', attributes=("
        "('alpha', 0.9), ('beta', 0.999), ('epsilon', 1e-08), ('weight_decay', 0.1), "
        "('correct_bias', 1), ('adam_mode', 0)), opset=18)"]
    with use_target(DEFAULT_TARGET):
        built = PlanRunner({"evaluate": program.graphs["evaluate"]}).build_all(plan)
    written = onnx.load(paths.eval_model)
    assert written.graph.SerializeToString() == built["eval_model.onnx"].model.graph \
        .SerializeToString()
    with pytest.raises(UnsupportedOptionError, match="Momentum"):
        artifacts_plan(program, Momentum(0.01))


# -- the layout onnxruntime reads -----------------------------------------------------------


def test_training_model_takes_weights_buffers_and_reset_flag_and_gives_loss_first(mlp_adamw):
    program, paths = mlp_adamw
    model = onnx.load(paths.training_model)
    weights = program.weights
    inputs = [i.name for i in model.graph.input]
    assert inputs == ["X", "label", *weights, *(f"{w}_grad.accumulation.buffer" for w in weights),
                      "lazy_reset_grad"]
    types = {i.name: i.type.tensor_type for i in model.graph.input}
    for w in weights:
        shape = [d.dim_value for d in types[f"{w}_grad.accumulation.buffer"].shape.dim]
        assert shape == list(program.state[w].shape)
    assert types["lazy_reset_grad"].elem_type == TensorProto.BOOL
    assert [d.dim_value for d in types["lazy_reset_grad"].shape.dim] == [1]
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["loss", "variable", *(f"{w}_grad.accumulation.out" for w in weights)]
    flags = [o for o in model.graph.output if o.name.endswith(".accumulation.out")]
    assert all(o.type.tensor_type.elem_type == TensorProto.BOOL for o in flags)
    accumulators = [n for n in model.graph.node if n.op_type == "InPlaceAccumulatorV2"]
    assert [(n.domain, n.input[0], n.input[2], n.output[0]) for n in accumulators] == [
        ("com.microsoft", f"{w}_grad.accumulation.buffer", "lazy_reset_grad",
         f"{w}_grad.accumulation.out") for w in weights]
    gradients = {n.input[1] for n in accumulators}
    assert gradients == {f"{w}_grad" for w in weights}
    # the gradients themselves are lossgraph's standard ops: the accumulators are the only
    # com.microsoft nodes
    assert {n.domain for n in model.graph.node if n not in accumulators} == {""}
    assert model.ir_version == 10
    assert {o.domain: o.version for o in model.opset_import} == {"": 18, "com.microsoft": 1}
    read = {i for n in model.graph.node for i in n.input}
    assert all(t.name in read for t in model.graph.initializer)  # nothing left for ORT to prune
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize(("optimizer", "op_type", "attributes"), [
    (SGD(0.05), "SGDOptimizerV2", {}),
    (AdamW(0.01, beta1=0.8, beta2=0.99, epsilon=1e-7, weight_decay=0.1), "AdamWOptimizer",
     {"alpha": 0.8, "beta": 0.99, "epsilon": 1e-7, "weight_decay": 0.1, "correct_bias": 1,
      "adam_mode": 0}),
    (Adam(0.01), "AdamWOptimizer", {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8,
                                    "weight_decay": 0.0, "correct_bias": 1, "adam_mode": 0}),
], ids=["SGD", "AdamW", "Adam"])
def test_optimizer_model_is_one_microsoft_op_over_the_inputs_onnxruntime_feeds(
        tmp_path, optimizer, op_type, attributes):
    paths = to_ort_artifacts(LINEAR, tmp_path / "a", optimizer=optimizer)
    model = onnx.load(paths.optimizer_model)
    expected = ["learning_rate", "step", "params", "gradients", "first_order_moments"]
    if op_type == "AdamWOptimizer":
        expected.append("second_order_moments")
    assert [i.name for i in model.graph.input] == expected
    scalars = {i.name: (i.type.tensor_type.elem_type, [d.dim_value for d in
                                                        i.type.tensor_type.shape.dim])
               for i in model.graph.input[:2]}
    assert scalars == {"learning_rate": (TensorProto.FLOAT, [1]),
                       "step": (TensorProto.INT64, [1])}
    for sequence in model.graph.input[2:]:
        assert sequence.type.sequence_type.elem_type.tensor_type.elem_type == TensorProto.FLOAT
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == ("com.microsoft", op_type)
    found = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert found == pytest.approx(attributes)
    assert model.ir_version == 10


@pytest.mark.parametrize("optimizer", [
    Momentum(0.01), Momentum(0.01, nesterov=True), SGD(0.01, learning_rate_schedule="invscaling"),
    SGD(0.01, learning_rate_schedule="optimal")], ids=["momentum", "nesterov", "invscaling",
                                                       "optimal"])
def test_optimizers_without_an_onnxruntime_op_are_refused_before_anything_is_written(
        tmp_path, optimizer):
    with pytest.raises(UnsupportedOptionError) as caught:
        to_ort_artifacts(LINEAR, tmp_path / "a", optimizer=optimizer)
    message = str(caught.value)
    assert type(optimizer).__name__ in message and "AdamW" in message
    assert not (tmp_path / "a").exists()


def test_a_clipping_program_clips_in_the_optimizer_model_before_the_op(tmp_path):
    """max_grad_norm (the program's, or a compile option): InplaceClipGradNorm on the
    gradients, the op reading its output; the inputs onnxruntime feeds are unchanged."""
    program = lossgraph.compile_program(LINEAR, optimizer=AdamW(0.01), max_grad_norm=0.5)
    for source, options in ((program, {}), (LINEAR, {"max_grad_norm": 0.5})):
        paths = to_ort_artifacts(source, tmp_path / str(len(options)), optimizer=AdamW(0.01),
                                 **options)
        model = onnx.load(paths.optimizer_model)
        clip, update = model.graph.node
        assert (clip.op_type, list(clip.input), clip.domain) == (
            "InplaceClipGradNorm", ["gradients"], "com.microsoft")
        assert helper.get_attribute_value(clip.attribute[0]) == pytest.approx(0.5)
        assert update.input[3] == clip.output[0]
        assert model.graph.input[3].name == "gradients"


def test_a_programs_momentum_is_refused_unless_another_optimizer_is_given(tmp_path):
    program = lossgraph.compile_program(LINEAR, optimizer=Momentum(0.01))
    with pytest.raises(UnsupportedOptionError, match="Momentum"):
        to_ort_artifacts(program, tmp_path / "a")
    paths = to_ort_artifacts(program, tmp_path / "b", optimizer=SGD(0.01))
    assert onnx.load(paths.optimizer_model).graph.node[0].op_type == "SGDOptimizerV2"


def test_eval_model_gives_the_loss_of_lossgraphs_evaluate_graph(tmp_path, run_model):
    penalty = {"W": {"l1": 0.01, "l2": 0.1}}
    program = lossgraph.compile_program(LINEAR, penalty=penalty)
    paths = to_ort_artifacts(LINEAR, tmp_path / "a", penalty=penalty)
    X, y = data(LINEAR)
    feeds = {"X": X, "label": y, **program.state}
    expected = run_model(program.graphs["evaluate"], feeds)["loss"]
    found = run_model(paths.eval_model, feeds)["loss"]
    assert found == pytest.approx(expected, rel=1e-6)
    plain = float(np.mean((X @ program.state["W"] + program.state["B"] - y) ** 2))
    assert found > plain  # the penalty is in the loss
    model = onnx.load(paths.eval_model)
    assert [i.name for i in model.graph.input] == ["X", "label", "W", "B"]
    assert not any(p.key.startswith("lossgraph.") for p in model.metadata_props)


def test_eval_model_runs_dropout_and_batch_normalization_in_inference_mode():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        net (float[N, 3] x) => (float[N, 3] y)
        <float[3] scale = {1, 1, 1}, float[3] bias = {0, 0, 0}, float[3] mean = {0, 0, 0},
         float[3] var = {1, 1, 1}, float ratio = {0.5}, bool on = {1}>
        { n, running_mean, running_var = BatchNormalization <training_mode = 1> (x, scale,
                                                                    bias, mean, var)
          y, mask = Dropout(n, ratio, on) }""")
    converted = InferenceMode()(model).model  # what to_ort_artifacts runs on the eval model
    batch_norm, dropout = converted.graph.node
    assert helper.get_attribute_value(batch_norm.attribute[0]) == 0
    assert list(batch_norm.output) == ["n"]
    assert (dropout.op_type, list(dropout.input)) == ("Identity", ["n"])  # its mask unread
    assert model.graph.node[1].input[2] == "on"  # the caller's model is not changed


# -- the checkpoint ----------------------------------------------------------------------------


def test_checkpoint_holds_the_weights_and_adams_group_and_properties(mlp_adamw):
    program, paths = mlp_adamw
    checkpoint = read_ort_checkpoint(paths.checkpoint)
    assert list(checkpoint) == program.weights
    for w in program.weights:
        assert checkpoint[w].dtype == np.float32
        np.testing.assert_array_equal(checkpoint[w], program.state[w])
    assert checkpoint.frozen == {}
    (group,) = checkpoint.optimizer_groups
    assert (group.name, group.step) == ("group0", 0)
    assert group.initial_learning_rate == pytest.approx(0.01)
    assert list(group.states) == program.weights
    for w, moments in group.states.items():
        assert list(moments) == ["momentum0", "momentum1"]
        assert all(m.shape == program.state[w].shape and not m.any() for m in moments.values())
    assert checkpoint.properties == {"epochs": 0}
    assert paths.checkpoint.read_bytes()[4:8] == b"ODTC"


def test_a_programs_adam_moments_and_step_go_into_the_checkpoint(tmp_path):
    program = lossgraph.compile_program(LINEAR, optimizer=Adam(0.01))
    trainer = lossgraph.Trainer(program).fit(*data(LINEAR), epochs=1, batch_size=16,
                                            shuffle=False)
    reached = lossgraph.TrainingProgram(program.graphs, program.manifest, trainer.state,
                                        program.inference_model)
    paths = to_ort_artifacts(reached, tmp_path / "a", step=trainer.steps_)
    (group,) = read_ort_checkpoint(paths.checkpoint).optimizer_groups
    assert group.step == trainer.steps_ == 3
    np.testing.assert_array_equal(group.states["W"]["momentum0"], trainer.state["W_m"])
    np.testing.assert_array_equal(group.states["B"]["momentum1"], trainer.state["B_v"])
    assert group.states["W"]["momentum0"].any()


CHECKPOINT = OrtCheckpoint(
    trainable={"W": np.array([[0.5], [-0.25]], np.float32), "B": np.array([0.125], np.float32)},
    frozen={"scale": np.array([2, 3], np.int64)},
    optimizer_groups=[OptimizerGroup(step=7, initial_learning_rate=0.5, states={
        "W": {"momentum0": np.array([[1.0], [2.0]], np.float32)},
        "B": {"momentum0": np.array([3.0], np.float32)}})],
    properties={"epoch": 3, "best": 0.5, "name": "mse"})
#: The bytes lossgraph writes for CHECKPOINT (onnxruntime-training 1.19.2 loads them: see
#: test_onnxruntime_loads_lossgraphs_checkpoint). A change here changes every checkpoint.
CHECKPOINT_SHA256 = "e93bab1fcf179ef65543feeeb58484a452ac1fe6c739e9d3f6f4a4030959bc70"


def test_checkpoint_bytes_are_pinned_and_round_trip_through_the_reader():
    data = checkpoint_bytes(CHECKPOINT)
    assert hashlib.sha256(data).hexdigest() == CHECKPOINT_SHA256
    read = parse_ort_checkpoint(data)
    assert {k: v.tolist() for k, v in read.trainable.items()} == {"W": [[0.5], [-0.25]],
                                                                  "B": [0.125]}
    assert read.frozen["scale"].dtype == np.int64 and read["scale"].tolist() == [2, 3]
    (group,) = read.optimizer_groups
    assert (group.name, group.step, group.initial_learning_rate) == ("group0", 7, 0.5)
    assert group.states["B"]["momentum0"].tolist() == [3.0]
    assert read.properties == {"epoch": 3, "best": 0.5, "name": "mse"}
    assert checkpoint_bytes(read) == data


@pytest.mark.parametrize(("damage", "match"), [
    (lambda b: b[:40], "damaged|outside|past the end"),
    (lambda b: b[:4] + b"ORTM" + b[8:], "ODTC"),
    (lambda b: b"", "ODTC"),
], ids=["truncated", "other identifier", "empty"])
def test_damaged_checkpoints_are_named_errors(tmp_path, damage, match):
    path = tmp_path / "checkpoint"
    path.write_bytes(damage(checkpoint_bytes(CHECKPOINT)))
    with pytest.raises(InvalidProgramError, match=match):
        read_ort_checkpoint(path)


def test_checkpoint_writer_refuses_what_the_format_cannot_hold(tmp_path):
    with pytest.raises(UnsupportedOptionError, match="property 'flag'"):
        checkpoint_bytes(OrtCheckpoint({"W": np.zeros(2, np.float32)}, properties={"flag": True}))
    with pytest.raises(UnsupportedOptionError, match="'s'"):
        checkpoint_bytes(OrtCheckpoint({"s": np.array(["a"])}))
    path = write_ort_checkpoint(tmp_path / "ck", CHECKPOINT)
    with pytest.raises(UnsafeWriteError):  # a checkpoint file carries no mark: never replaced
        write_ort_checkpoint(path, CHECKPOINT)


# -- determinism and folders -----------------------------------------------------------------


def test_writing_twice_gives_identical_bytes_and_rewrites_its_own_folder(tmp_path):
    first = to_ort_artifacts(MLP, tmp_path / "a", optimizer=AdamW(0.01))
    second = to_ort_artifacts(MLP, tmp_path / "b", optimizer=AdamW(0.01))
    assert [p.name for p in first] == FILES
    assert digests(first) == digests(second)
    again = to_ort_artifacts(MLP, tmp_path / "a", optimizer=SGD(0.1))  # lossgraph's own folder
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(FILES)
    assert onnx.load(again.optimizer_model).graph.node[0].op_type == "SGDOptimizerV2"


SCRIPT = """
import hashlib, sys
from pathlib import Path
from lossgraph.export import to_ort_artifacts
from lossgraph.optim import AdamW
paths = to_ort_artifacts(sys.argv[1], sys.argv[2], optimizer=AdamW(0.01), penalty={"W": 0.1})
for p in paths:
    print(p.name, hashlib.sha256(p.read_bytes()).hexdigest())
"""


def test_the_other_environment_writes_the_same_bytes(tmp_path):
    """The training environment (.venv) and the plain one (.venv313) beside the repository
    write byte-identical artifacts; skipped where the other one is absent."""
    ours = Path(sys.prefix).name
    other = ROOT / (".venv313" if ours != ".venv313" else ".venv") / "bin" / "python"
    if not other.exists():
        pytest.skip(f"no other environment at {other}")
    here = to_ort_artifacts(LINEAR, tmp_path / "here", optimizer=AdamW(0.01), penalty={"W": 0.1})
    result = subprocess.run([str(other), "-c", SCRIPT, str(LINEAR), str(tmp_path / "there")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    there = dict(line.split() for line in result.stdout.splitlines())
    assert there == digests(here)


def test_a_foreign_folder_is_refused_and_left_untouched(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(UnsafeWriteError, match="notes.txt"):
        to_ort_artifacts(LINEAR, folder)
    assert listing(folder) == {"notes.txt": b"keep me"}


def test_an_artifacts_folder_with_a_file_lossgraph_did_not_write_is_left_untouched(tmp_path):
    folder = tmp_path / "a"
    to_ort_artifacts(LINEAR, folder)
    (folder / "inference.onnx").write_bytes(b"user's")
    before = listing(folder)
    with pytest.raises(UnsafeWriteError, match="inference.onnx"):
        to_ort_artifacts(LINEAR, folder)
    assert listing(folder) == before


def test_a_checkpoint_saved_over_lossgraphs_is_never_replaced(tmp_path):
    """onnxruntime's CheckpointState.save_checkpoint into the folder holds trained state."""
    folder = tmp_path / "a"
    paths = to_ort_artifacts(LINEAR, folder)
    trained = read_ort_checkpoint(paths.checkpoint)
    trained.trainable["W"] = trained["W"] + 1
    paths.checkpoint.write_bytes(checkpoint_bytes(trained))
    before = listing(folder)
    with pytest.raises(UnsafeWriteError, match="checkpoint"):
        to_ort_artifacts(LINEAR, folder)
    assert listing(folder) == before


def test_options_are_checked(tmp_path):
    program = lossgraph.compile_program(LINEAR)
    with pytest.raises(UnsupportedOptionError, match="carries its weights, loss"):
        to_ort_artifacts(program, tmp_path / "a", loss="absolute_error")
    with pytest.raises(UnsupportedOptionError, match="no option 'fuse'"):
        to_ort_artifacts(LINEAR, tmp_path / "a", fuse="epoch")
    with pytest.raises(UnsupportedOptionError, match="step"):
        to_ort_artifacts(LINEAR, tmp_path / "a", step=-1)
    with pytest.raises(UnsupportedOptionError, match="property 'epoch'"):
        to_ort_artifacts(LINEAR, tmp_path / "a", properties={"epoch": [1]})
    with pytest.raises(DTypeMismatchError, match="float32"):
        to_ort_artifacts(GOLDEN_MODELS / "skl_mlp_regressor_double.onnx", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_models_the_training_build_cannot_run_are_named_errors(tmp_path):
    newer = linear_model((0.5, -0.25, 1), 0.1, opset=23, ir_version=10)
    program = lossgraph.compile_program(newer, target="onnxruntime")
    with pytest.raises(UnsupportedModelError, match="onnxruntime-training 1.19.*opsets 13 to 21"):
        to_ort_artifacts(program, tmp_path / "a")
    clash = linear_model((0.5, -0.25, 1), 0.1, hidden="lazy_reset_grad")
    with pytest.raises(NameCollisionError, match="'lazy_reset_grad'.*reserves"):
        to_ort_artifacts(clash, tmp_path / "a")
    assert not (tmp_path / "a").exists()


# -- onnxruntime's training API runs them (training build) ----------------------------------

def ort_train(paths, optimizer, X, y, epochs: int, batch: int):
    """Train with onnxruntime.training.api as its documentation does, in batch order."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(str(paths.checkpoint))
    module = Module(str(paths.training_model), state, str(paths.eval_model))
    runner = Optimizer(str(paths.optimizer_model), module)
    assert runner.get_learning_rate() == pytest.approx(1e-3)  # whatever the checkpoint says
    runner.set_learning_rate(optimizer.learning_rate)
    module.train()
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            module(X[start:start + batch], y[start:start + batch])
            runner.step()
            module.lazy_reset_grad()
    return state, module


@pytest.mark.parametrize(("model", "optimizer", "penalty"), [
    (MLP, SGD(0.05), None),
    (MLP, AdamW(0.01, weight_decay=0.1), None),
    (MLP, Adam(0.02), {"coefficient": {"l1": 0.01, "l2": 0.1}}),
    (LINEAR, SGD(0.05), {"W": 0.1}),
    (LOWERED, AdamW(0.05, weight_decay=0.5), None),
], ids=["mlp-sgd", "mlp-adamw", "mlp-adam-penalty", "linear-sgd-penalty", "lowered-adamw"])
@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_trains_to_the_weights_lossgraphs_trainer_reaches(
        tmp_path, run_model, model, optimizer, penalty):
    """Same batches in the same order (shuffle=False, a last batch of 8 rows): the same
    weights to float32 rounding; then onnxruntime's inference export predicts like
    lossgraph's, and the eval model scores like lossgraph's evaluate graph."""
    X, y = data(model)
    program = lossgraph.compile_program(model, optimizer=optimizer, penalty=penalty, fuse="step")
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=3, batch_size=16, shuffle=False)
    paths = to_ort_artifacts(model, tmp_path / "a", optimizer=optimizer, penalty=penalty)
    state, module = ort_train(paths, optimizer, X, y, epochs=3, batch=16)
    for w in program.weights:
        np.testing.assert_allclose(state.parameters[w].data, trainer.state[w], rtol=1e-5,
                                   atol=1e-5, err_msg=w)
        assert not np.array_equal(trainer.state[w], program.state[w]), w  # it trained
    module.eval()
    assert float(module(X, y)[0]) == pytest.approx(trainer.evaluate(X, y), rel=1e-5)
    output = program.manifest["roles"]["prediction"]
    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), [output])
    exported = run_model(tmp_path / "inference.onnx", {"X": X})[output]
    expected = run_model(trainer.to_inference_model(), {"X": X})[output]
    np.testing.assert_allclose(exported, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("optimizer", [SGD(0.05), AdamW(0.01)], ids=["sgd", "adamw"])
@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_clips_the_gradients_as_lossgraphs_trainer_does(tmp_path, optimizer):
    """max_grad_norm=0.3 clips every step here (asserted): onnxruntime's
    InplaceClipGradNorm trains to the Trainer's weights, not to the unclipped ones."""
    X, y = data(MLP)
    y = 3 * y
    program = lossgraph.compile_program(MLP, optimizer=optimizer, max_grad_norm=0.3)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=16, shuffle=False)
    assert min(trainer.grad_norms_) > 0.3
    state, _ = ort_train(to_ort_artifacts(program, tmp_path / "a"), optimizer, X, y, epochs=2,
                         batch=16)
    for w in program.weights:
        np.testing.assert_allclose(state.parameters[w].data, trainer.state[w], rtol=1e-5,
                                   atol=1e-6, err_msg=w)


@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_loads_lossgraphs_checkpoint_and_lossgraph_reads_onnxruntimes(tmp_path):
    from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint(str(write_ort_checkpoint(tmp_path / "ck",
                                                                     CHECKPOINT)))
    for name, value in CHECKPOINT.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)
    assert state.parameters["W"].requires_grad and not state.parameters["scale"].requires_grad
    assert dict(state.properties) == CHECKPOINT.properties

    X, y = data(LINEAR)
    paths = to_ort_artifacts(LINEAR, tmp_path / "a", optimizer=AdamW(0.01))
    state, module = ort_train(paths, AdamW(0.01), X, y, epochs=1, batch=16)
    state.properties["epoch"] = 1
    CheckpointState.save_checkpoint(state, str(tmp_path / "theirs"), include_optimizer_state=True)
    theirs = read_ort_checkpoint(tmp_path / "theirs")  # written by onnxruntime itself
    assert sorted(theirs) == ["B", "W"]
    for name in ("W", "B"):
        np.testing.assert_array_equal(theirs[name], state.parameters[name].data)
    (group,) = theirs.optimizer_groups
    assert (group.name, group.step) == ("group0", 3)
    assert sorted(group.states["W"]) == ["momentum0", "momentum1"]
    assert group.states["W"]["momentum0"].any()
    assert theirs.properties == {"epoch": 1}


@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_resumes_the_step_and_moments_the_checkpoint_holds(tmp_path):
    """A program's reached Adam state, exported with its step, continues in onnxruntime
    exactly as lossgraph's Trainer continues it."""
    X, y = data(LINEAR)
    optimizer = Adam(0.02)
    program = lossgraph.compile_program(LINEAR, optimizer=optimizer)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=16, shuffle=False)
    reached = lossgraph.TrainingProgram(program.graphs, program.manifest, trainer.state,
                                        program.inference_model)
    paths = to_ort_artifacts(reached, tmp_path / "a", step=trainer.steps_)
    trainer.fit(X, y, epochs=1, batch_size=16, shuffle=False, warm_start=True)
    state, _ = ort_train(paths, optimizer, X, y, epochs=1, batch=16)
    for w in ("W", "B"):
        np.testing.assert_allclose(state.parameters[w].data, trainer.state[w], rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_refuses_what_the_format_forbids(tmp_path):
    """The facts the layout relies on: Module wants a gradient buffer per trainable weight,
    Optimizer wants its inputs by these names, onnxruntime-training 1.19 reads IR 10 at most."""
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    paths = to_ort_artifacts(LINEAR, tmp_path / "a", optimizer=AdamW(0.01))
    state = CheckpointState.load_checkpoint(str(paths.checkpoint))
    training = onnx.load(paths.training_model)
    graph = training.graph
    keep = [n for n in graph.node if n.output[0] != "W_grad.accumulation.out"]
    del graph.node[:]
    graph.node.extend(keep)
    for field in (graph.input, graph.output):
        kept = [v for v in field if not v.name.startswith("W_grad.accumulation")]
        del field[:]
        field.extend(kept)
    onnx.save(training, tmp_path / "no_buffer.onnx")
    with pytest.raises(RuntimeError, match="W"):
        Module(str(tmp_path / "no_buffer.onnx"), state)

    module = Module(str(paths.training_model), state)
    renamed = onnx.load(paths.optimizer_model)
    renamed.graph.input[4].name = "moments"
    renamed.graph.node[0].input[4] = "moments"
    onnx.save(renamed, tmp_path / "renamed.onnx")
    with pytest.raises(RuntimeError, match="first_order_moments"):
        Optimizer(str(tmp_path / "renamed.onnx"), module)

    newer = onnx.load(paths.training_model)
    newer.ir_version = 11
    onnx.save(newer, tmp_path / "ir11.onnx")
    with pytest.raises(RuntimeError, match="IR version"):
        Module(str(tmp_path / "ir11.onnx"), state)


@pytest.mark.training
@pytest.mark.torch
def test_gradients_accumulate_in_their_buffers_until_lazy_reset_grad(tmp_path, run_model):
    from onnxruntime.training.api import CheckpointState, Module

    program = lossgraph.compile_program(LINEAR)
    paths = to_ort_artifacts(program, tmp_path / "a")
    gradients = lossgraph.gradient(program.graphs["evaluate"], weights=["W"])
    X, y = data(LINEAR, rows=30)
    batches = [(X[i:i + 10], y[i:i + 10]) for i in (0, 10, 20)]
    g1, g2, g3 = (run_model(gradients, {"X": a, "label": b, **program.state})["W_grad"]
                  for a, b in batches)
    state = CheckpointState.load_checkpoint(str(paths.checkpoint))
    module = Module(str(paths.training_model), state)
    module.train()
    module(*batches[0])
    np.testing.assert_allclose(state.parameters["W"].grad, g1, rtol=1e-5, atol=1e-7)
    module(*batches[1])  # no optimizer step, no reset: accumulated
    np.testing.assert_allclose(state.parameters["W"].grad, g1 + g2, rtol=1e-5, atol=1e-7)
    module.lazy_reset_grad()
    module(*batches[2])
    np.testing.assert_allclose(state.parameters["W"].grad, g3, rtol=1e-5, atol=1e-7)


def test_an_artifacts_folder_exports_the_inference_model_with_its_checkpoints_weights(tmp_path,
                                                                                    run_model):
    """The inference export reads an artifacts folder: the eval model with the checkpoint's
    weights, nothing of training left; it predicts like the Trainer with those weights."""
    from lossgraph.export import to_inference_model

    X, y = data(MLP)
    paths = to_ort_artifacts(onnx.load(MLP), tmp_path / "artifacts", optimizer=SGD(0.05))
    program = lossgraph.compile_program(onnx.load(MLP), optimizer=SGD(0.05))
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=10, shuffle=False,
                                             progress=False)
    checkpoint = read_ort_checkpoint(paths.checkpoint)
    trained = OrtCheckpoint(trainable={w: trainer.state[w] for w in checkpoint.trainable},
                            optimizer_groups=checkpoint.optimizer_groups)
    write_ort_checkpoint(paths.checkpoint, trained, overwrite=True)  # as a device would
    exported = to_inference_model(tmp_path / "artifacts")
    assert [i.name for i in exported.graph.input] == ["X"]
    assert {o.name for o in exported.graph.output} == {o.name for o in onnx.load(MLP).graph.output}
    assert not any(p.key.startswith("lossgraph.") for p in exported.metadata_props)
    expected = trainer.predict(X)
    output = program.manifest["roles"]["prediction"]
    np.testing.assert_allclose(run_model(exported, {"X": X})[output], expected, rtol=1e-5,
                               atol=1e-6)
