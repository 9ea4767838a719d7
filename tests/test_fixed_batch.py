"""Models exported with a fixed batch (torch.onnx.export's default: ``float[2, 4]``),
through every entry point.

compile_program frees the batch where GeneralizeBatch proves it (tests/passes/
test_fixed_batch.py) and says so (describe_plan, the manifest's ``batch``); where nothing
proves it, the program keeps the batch and trains, evaluates and predicts in runs of
exactly that many rows (each epoch's last, short batch left out, as torch's
``drop_last=True``), equal to the freed program fed the same batches; GraphFunction,
``lossgraph inspect`` and ``compile`` say what is done. The torch exports themselves are
in tests/test_torch_fixed_batch.py.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from support.fixed_batch import by_runs, flatten_to_linear, parse, per_row_constant

import lossgraph
from lossgraph.cli import main
from lossgraph.errors import (
    FixedBatchWarning,
    InvalidDataError,
    InvalidProgramError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.manifest import check_manifest
from lossgraph.passes.fixed_batch import export_calls
from lossgraph.runtime.graph_function import GraphFunction

# -- what compile takes ----------------------------------------------------------------------


@pytest.mark.parametrize("inputs, message", [
    ("float[2, 3] x, float[N, 3] z", "input 'z''s is free"),
    ("float[2, 3] x, float[4, 3] z", "different batch sizes"),
])
def test_data_inputs_that_disagree_on_the_batch_are_refused(inputs, message):
    model = parse(f"""g ({inputs}) => (float[2, 3] y) {{ y = Add(x, z) }}""")
    with pytest.raises(UnsupportedModelError, match=message):
        lossgraph.compile_program(model)


def test_an_output_whose_first_axis_is_not_the_batch_is_refused():
    model = parse("""g (float[2, 3] x) => (float[1, 3] y)
        <int64[1] zero = {0}> { y = ReduceSum <keepdims: int = 1> (x, zero) }""")
    with pytest.raises(UnsupportedModelError, match="one output row per input row"):
        lossgraph.compile_program(model)


def test_a_graph_function_frees_the_batch_or_says_how_to_export_again():
    function = GraphFunction(flatten_to_linear(2))
    X = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32)
    weights = [function.get_initializer(name) for name in function.weights_to_train]
    (prediction,) = function.new_instance().forward([X, *weights])
    np.testing.assert_allclose(prediction, by_runs(flatten_to_linear(1), X, 1), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(UnsupportedModelError, match="dynamic_shapes="):
        GraphFunction(per_row_constant())


# -- compile ---------------------------------------------------------------------------------


def test_describe_plan_shows_what_compile_does_with_the_batch():
    freed = lossgraph.describe_plan(flatten_to_linear(2))
    assert freed.splitlines()[0] == (
        "model           = given model -> GeneralizeBatch: its fixed batch of 2 rows freed "
        "(Reshape 'h' [2, 6] -> [-1, 6])")
    # then the start models, GeneralizeBatch among the passes that made them
    assert freed.splitlines()[1].startswith(
        "loss model      = model -> ConvertOpset -> LowerMlOps -> GeneralizeBatch -> ")
    with pytest.warns(FixedBatchWarning, match="cannot prove"):
        kept = lossgraph.describe_plan(per_row_constant())
    assert kept.splitlines()[0].startswith(
        "model           = given model -> GeneralizeBatch: its fixed batch of 2 rows kept: it "
        "trains in batches of exactly 2 rows (")
    assert lossgraph.describe_plan(flatten_to_linear(2), fixed_batch="keep").splitlines()[0] \
        == ("model           = given model: its fixed batch of 2 rows kept: it trains in batches "
            "of exactly 2 rows (fixed_batch='keep')")
    free = parse("""g (float[N, 2] x) => (float[N, 2] y) <float[2] w = {1, 2}>
                    { y = Mul(x, w) }""")
    assert not lossgraph.describe_plan(free).startswith("model")


def test_the_fixed_batch_option_is_checked_and_generalize_fails_with_the_way_out():
    with pytest.raises(UnsupportedOptionError, match="fixed_batch"):
        lossgraph.compile_program(flatten_to_linear(2), fixed_batch="never")
    with pytest.raises(UnsupportedModelError, match="fixed_batch='auto'"):
        lossgraph.compile_program(per_row_constant(), fixed_batch="generalize")
    program = lossgraph.compile_program(flatten_to_linear(2), fixed_batch="generalize")
    assert program.manifest["batch"]["fixed"] is False


def test_a_kept_batch_warns_once_and_is_recorded():
    with pytest.warns(FixedBatchWarning) as caught:
        program = lossgraph.compile_program(per_row_constant())
    assert len(caught) == 1 and caught[0].filename == __file__
    assert "torch.onnx.export(model, args, path, dynamic_shapes=" in str(caught[0].message)
    record = program.manifest["batch"]
    assert record["size"] == 2 and record["fixed"] and record["loss_reduction"] == "mean"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lossgraph.compile_program(per_row_constant(), fixed_batch="keep")


def test_a_free_model_gets_no_batch_record():
    free = parse("""g (float[N, 2] x) => (float[N, 2] y) <float[2] w = {1, 2}>
                    { y = Mul(x, w) }""")
    assert "batch" not in lossgraph.compile_program(free).manifest


@pytest.mark.parametrize("record, problem", [
    ({"size": 0, "fixed": True, "detail": "", "loss_reduction": "mean"}, "batch size"),
    ({"size": 2, "fixed": "yes", "detail": "", "loss_reduction": "mean"}, "'fixed' must be"),
    ({"size": 2, "fixed": True, "detail": "", "loss_reduction": "max"}, "loss_reduction"),
    ({"size": 2, "fixed": True, "detail": ""}, "'loss_reduction' is missing"),
])
def test_a_damaged_batch_record_is_an_invalid_program(record, problem):
    manifest = json.loads(json.dumps(
        lossgraph.compile_program(flatten_to_linear(2), fixed_batch="keep").manifest))
    manifest["batch"] = record
    with pytest.raises(InvalidProgramError, match=problem):
        check_manifest(manifest)


# -- training at a kept batch ----------------------------------------------------------------


def data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 2, 3)).astype(np.float32)
    return X, rng.standard_normal((rows, 3)).astype(np.float32)


def pair(fuse: str, **options) -> tuple[lossgraph.Trainer, lossgraph.Trainer]:
    """The same model trained at its kept batch of 2, and freed."""
    model = flatten_to_linear(2)
    return (lossgraph.Trainer(lossgraph.compile_program(model, fuse=fuse, fixed_batch="keep",
                                                        **options)),
            lossgraph.Trainer(lossgraph.compile_program(model, fuse=fuse, **options)))


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_a_kept_batch_trains_as_the_freed_model_on_the_same_batches_dropping_the_last(fuse):
    """Seven rows at a batch of 2: three steps an epoch, the last row left out (shuffled,
    another row each epoch), as the freed model trained on the same batches."""
    kept, freed = pair(fuse)
    X, y = data(7)
    kept.fit(X, y, epochs=3, random_state=5)
    assert kept.steps_ == 9
    order = np.random.default_rng(5)
    for epoch in range(3):
        rows = order.permutation(7)[:6]
        freed.fit(X[rows], y[rows], epochs=1, batch_size=2, shuffle=False, warm_start=epoch > 0)
    for name, value in freed.state.items():
        np.testing.assert_allclose(kept.state[name], value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept.train_losses_, freed.train_losses_, rtol=1e-5)
    np.testing.assert_allclose(kept.predict(X[:6]), freed.predict(X[:6]), rtol=1e-5,
                               atol=1e-6)


def test_a_kept_batch_evaluates_in_runs_as_one_mean_with_weights():
    kept, freed = pair("step", loss_options={"weight_name": "row_weight"})
    X, y = data(6)
    weight = np.array([1, 0, 3, 0.5, 2, 0], np.float32)
    assert kept.evaluate(X, y, weight) == pytest.approx(freed.evaluate(X, y, weight), rel=1e-6)
    assert kept.evaluate(X, y) == pytest.approx(freed.evaluate(X, y), rel=1e-6)


def test_a_kept_batch_with_a_sum_loss_evaluates_one_run_only():
    kept, freed = pair("step", loss_options={"reduction": "sum"})
    X, y = data(4)
    assert kept.evaluate(X[:2], y[:2]) == pytest.approx(freed.evaluate(X[:2], y[:2]), rel=1e-6)
    with pytest.raises(UnsupportedOptionError, match="reduction 'sum'"):
        kept.evaluate(X, y)


def test_a_kept_batch_refuses_what_it_cannot_run_before_any_work():
    kept, _ = pair("step")
    X, y = data(5)
    with pytest.raises(UnsupportedOptionError, match="batch_size=4, but the model's batch is "
                                                     "fixed at 2 rows"):
        kept.fit(X, y, batch_size=4)
    with pytest.raises(InvalidDataError, match="X has 1 row, but"):
        kept.fit(X[:1], y[:1])
    with pytest.raises(InvalidDataError, match="validation_data has 5 rows, not a multiple"):
        kept.fit(X[:4], y[:4], validation_data=(X, y))
    assert kept.steps_ == 0
    with pytest.raises(InvalidDataError, match="X has 5 rows, not a multiple of 2"):
        kept.predict(X)
    with pytest.raises(InvalidDataError, match="Batch 1 has 3 rows"):
        kept.fit([(X[:2], y[:2]), (X[2:], y[2:])])
    assert kept.batch_size() == 2 and lossgraph.Trainer(
        lossgraph.compile_program(flatten_to_linear(2))).batch_size() == 32


def test_a_kept_batch_survives_saving_and_loading(tmp_path):
    kept, _ = pair("epoch")
    kept.program.save(tmp_path / "program")
    loaded = lossgraph.Trainer(lossgraph.TrainingProgram.load(tmp_path / "program"))
    assert loaded.engine.fixed_batch == 2
    X, y = data(4)
    loaded.fit(X, y, epochs=2, random_state=0)
    kept.fit(X, y, epochs=2, random_state=0)
    for name, value in kept.state.items():
        np.testing.assert_array_equal(loaded.state[name], value)


# -- the command line ------------------------------------------------------------------------


def test_inspect_reports_a_fixed_batch_and_what_compile_does(tmp_path, capsys):
    for name, model in (("freed", flatten_to_linear(2)), ("kept", per_row_constant())):
        onnx.save(model, tmp_path / f"{name}.onnx")
    assert main(["inspect", str(tmp_path / "freed.onnx")]) == 0
    text = capsys.readouterr().out
    assert ("fixed batch: the inputs fix the batch at 2 rows (as torch.onnx.export writes a "
            "model without dynamic_shapes or dynamic_axes); compile frees it, proven from the "
            "graph (Reshape 'h' [2, 6] -> [-1, 6])") in text
    assert main(["inspect", str(tmp_path / "kept.onnx"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["fixed_batch"]
    assert report["size"] == 2 and not report["freed"] and "Mul 'y'" in report["reason"]
    assert report["export"] == list(export_calls(["x"], ["y"]))
    assert main(["inspect", str(tmp_path / "kept.onnx")]) == 0
    text = capsys.readouterr().out
    assert "compile keeps it" in text and export_calls(["x"], ["y"])[1] in text


def test_compile_and_train_on_the_command_line(tmp_path, capsys):
    onnx.save(per_row_constant(), tmp_path / "kept.onnx")
    X = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=X * 2)
    assert main(["compile", str(tmp_path / "kept.onnx"), "-o", str(tmp_path / "program"),
                 "--fixed-batch", "keep"]) == 0
    assert "the model: its fixed batch of 2 rows kept" in capsys.readouterr().out
    assert main(["train", str(tmp_path / "program"), "--data", str(tmp_path / "data.npz"),
                 "-o", str(tmp_path / "trained.onnx"), "--epochs", "2",
                 "--history", str(tmp_path / "history.json")]) == 0
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["batch_size"] == 2 and history["steps"] == 4
