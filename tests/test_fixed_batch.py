"""Models exported with a fixed batch (torch.onnx.export's default: ``float[2, 4]``).

:class:`~lossgraph.passes.GeneralizeBatch` frees the batch where the graph proves which
shape constants hold it, and the freed model computes, at any batch size, what the
exported one computes on each run of its own batch size; a constant that merely equals
the batch (a hidden width of 2 at a batch of 2) is left alone. Where nothing proves it,
the program keeps the batch and trains, evaluates and predicts in runs of exactly that
many rows (each epoch's last, short batch left out, as torch's ``drop_last=True``),
equal to the freed program fed the same batches. The torch exports themselves are in
tests/test_torch_fixed_batch.py.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

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
from lossgraph.passes import GeneralizeBatch
from lossgraph.passes.fixed_batch import export_calls, fixed_batch
from lossgraph.runtime.graph_function import GraphFunction
from lossgraph.runtime.session import create_session

HEADER = '<ir_version: 8, opset_import: ["" : 18]>'


def parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(HEADER + text)


def weights(shape: tuple[int, ...], seed: int) -> str:
    """``shape`` values of a fixed random draw, as ONNX text."""
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape)))
    return ", ".join(f"{v:.4f}" for v in values)


def hidden_width_two(batch: int = 2) -> onnx.ModelProto:
    """``x @ w`` of 4 columns viewed as (batch, 2, 2), summed over its middle axis: the
    exporter wrote the view's target as ``[batch, 2, 2]``, so at a batch of 2 the hidden
    width 2 equals the batch."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 2] y)
          <float[3, 4] w = {{{weights((3, 4), 0)}}}, int64[3] view = {{{batch}, 2, 2}},
           int64[1] middle = {{1}}> {{
            h = MatMul(x, w)
            r = Reshape(h, view)
            y = ReduceSum <keepdims: int = 0> (r, middle)
        }}""")


def flatten_to_linear(batch: int, allowzero: int = 1) -> onnx.ModelProto:
    """A (batch, 2, 3) input flattened by ``Reshape(x, [batch, 6])`` (dynamo writes
    ``allowzero=1``) into a linear layer of 3 outputs."""
    return parse(f"""
        g (float[{batch}, 2, 3] x) => (float[{batch}, 3] y)
          <float[6, 3] w = {{{weights((6, 3), 1)}}}, float[3] b = {{0.1, -0.2, 0.3}},
           int64[2] flat = {{{batch}, 6}}> {{
            h = Reshape <allowzero: int = {allowzero}> (x, flat)
            m = MatMul(h, w)
            y = Add(m, b)
        }}""")


def unflatten(batch: int = 2) -> onnx.ModelProto:
    """(batch, 12) viewed as (batch, 4, 3) (``allowzero=1``, as dynamo writes it), summed
    over its middle axis."""
    return parse(f"""
        g (float[{batch}, 12] x) => (float[{batch}, 3] y)
          <int64[3] view = {{{batch}, 4, 3}}, int64[1] middle = {{1}}> {{
            r = Reshape <allowzero: int = 1> (x, view)
            y = ReduceSum <keepdims: int = 0> (r, middle)
        }}""")


def batch_merged(batch: int = 2) -> onnx.ModelProto:
    """The batch merged with an axis: (batch, 4, 3) -> (batch * 4, 3), a product, then
    back to (batch, 4 * 2): the second Reshape splits ``4 * batch`` rows into two axes,
    and which one holds the batch is not known from shapes (the first holds it here)."""
    return parse(f"""
        g (float[{batch}, 4, 3] x) => (float[{batch}, 8] y)
          <float[3, 2] w = {{{weights((3, 2), 2)}}}, int64[2] rows = {{{4 * batch}, 3}},
           int64[2] back = {{{batch}, 8}}> {{
            r = Reshape(x, rows)
            m = MatMul(r, w)
            y = Reshape(m, back)
        }}""")


def expanded(batch: int = 2) -> onnx.ModelProto:
    """``Expand(x[batch, 1, 3], [batch, 4, 3])``: the batch axis expanded to itself."""
    return parse(f"""
        g (float[{batch}, 1, 3] x) => (float[{batch}, 4] y)
          <float[3] w = {{0.5, -1.0, 2.0}}, int64[3] shape = {{{batch}, 4, 3}},
           int64[1] last = {{2}}> {{
            e = Expand(x, shape)
            m = Mul(e, w)
            y = ReduceSum <keepdims: int = 0> (m, last)
        }}""")


def per_row_constant(batch: int = 2) -> onnx.ModelProto:
    """The input times a constant with a row of its own for each row of the exported
    batch: it has no value for other rows, so the batch stays."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 3] y)
          <float[{batch}, 3] c = {{{weights((batch, 3), 4)}}}> {{
            y = Mul(x, c)
        }}""")


def concat_token(batch: int = 2) -> onnx.ModelProto:
    """A learned token prepended to each row's sequence: the exporter folded
    ``token.expand(batch, -1, -1)`` into a constant of the batch's rows, all equal."""
    token = ", ".join(["0.5, -1.0, 2.0"] * batch)
    return parse(f"""
        g (float[{batch}, 4, 3] x) => (float[{batch}, 3] y)
          <float[{batch}, 1, 3] token = {{{token}}}, int64[1] middle = {{1}}> {{
            s = Concat <axis: int = 1> (token, x)
            y = ReduceMean <keepdims: int = 0> (s, middle)
        }}""")


def constant_mask(batch: int = 2) -> onnx.ModelProto:
    """A mask made from nothing, ``ConstantOfShape([batch, 3])``, times the input: it
    meets the input's batch axis in the Mul, and its rows are all equal."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 3] y)
          <int64[2] shape = {{{batch}, 3}}, float[3] w = {{1.0, 2.0, 3.0}}> {{
            ones = ConstantOfShape <value: tensor = float[1] {{1.0}}> (shape)
            m = Mul(x, ones)
            y = Mul(m, w)
        }}""")


def split_batch() -> onnx.ModelProto:
    """(4, 3) rows of a batch of 4 reshaped to (2, 2, 3) and summed over the middle axis:
    which of the two axes of 2 is the batch is not known (at 4 rows it mixes rows)."""
    return parse(f"""
        g (float[4, 3] x) => (float[4, 3] y)
          <float[3, 3] w = {{{weights((3, 3), 3)}}}, int64[3] split = {{2, 2, 3}},
           int64[2] back = {{4, 3}}> {{
            m = MatMul(x, w)
            r = Reshape(m, split)
            y = Reshape(r, back)
        }}""")


def unsqueezed_one() -> onnx.ModelProto:
    """A batch of 1 reshaped to ``[1, 1, 6]``: either 1 may be the batch."""
    return parse("""
        g (float[1, 6] x) => (float[1, 1, 6] y) <int64[3] shape = {1, 1, 6}> {
            y = Reshape(x, shape)
        }""")


def run(model: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    session = create_session(model)
    return session.run(None, {session.get_inputs()[0].name: X})[0]


def by_runs(model: onnx.ModelProto, X: np.ndarray, batch: int) -> np.ndarray:
    """The exported model on ``X`` in runs of its own ``batch`` rows."""
    return np.concatenate([run(model, X[i:i + batch]) for i in range(0, len(X), batch)])


def target(model: onnx.ModelProto, node: int) -> list[int]:
    graph = model.graph
    name = graph.node[node].input[1]
    return onnx.numpy_helper.to_array(next(t for t in graph.initializer if t.name == name)
                                      ).tolist()


def free_dims(model: onnx.ModelProto) -> list:
    return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.input, *model.graph.output)]


# -- the pass ------------------------------------------------------------------------------


@pytest.mark.parametrize("build, batch, rewrites", [
    (hidden_width_two, 2, ["Reshape 'r' [2, 2, 2] -> [0, 2, 2]"]),
    (hidden_width_two, 1, ["Reshape 'r' [1, 2, 2] -> [0, 2, 2]"]),
    (lambda b: flatten_to_linear(b, allowzero=1), 2, ["Reshape 'h' [2, 6] -> [-1, 6]"]),
    (lambda b: flatten_to_linear(b, allowzero=0), 2, ["Reshape 'h' [2, 6] -> [0, 6]"]),
    # at a batch of 1, [1, 6] also reads as one row of all the rows' values: the axis
    # that holds the batch alone is the batch's
    (lambda b: flatten_to_linear(b, allowzero=1), 1, ["Reshape 'h' [1, 6] -> [-1, 6]"]),
    (unflatten, 2, ["Reshape 'r' [2, 4, 3] -> [-1, 4, 3]"]),
    (expanded, 2, ["Expand 'e' [2, 4, 3] -> [1, 4, 3]"]),
    (constant_mask, 2, ["ConstantOfShape 'ones' [2, 3] -> [1, 3]"]),
    (concat_token, 2, ["Concat 's' reads 'token' of shape [2, 1, 3] as its one row "
                       "[1, 1, 3], expanded to the rows of 'x'"]),
    (concat_token, 1, ["Concat 's' reads 'token' expanded to the rows of 'x'"]),
])
def test_a_proven_batch_is_freed_and_computes_what_each_run_of_the_export_does(
        build, batch, rewrites):
    model = build(batch)
    given = model.SerializeToString()
    result = GeneralizeBatch()(model)
    assert model.SerializeToString() == given
    assert result.report.freed and result.report.batch == batch
    assert [str(r) for r in result.report.rewrites] == rewrites
    assert all(dims[0] == "batch" for dims in free_dims(result.model))
    X = np.random.default_rng(0).standard_normal(
        (6, *[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim[1:]])
    ).astype(np.float32)
    np.testing.assert_allclose(run(result.model, X), by_runs(model, X, batch), rtol=1e-6,
                               atol=1e-6)


def test_a_constant_equal_to_the_batch_elsewhere_is_not_rewritten():
    """The hidden width 2 at a batch of 2 stays: only the view's batch axis reads it."""
    freed = GeneralizeBatch()(hidden_width_two(2)).model
    reshape = next(i for i, n in enumerate(freed.graph.node) if n.op_type == "Reshape")
    assert target(freed, reshape) == [0, 2, 2]


def test_the_exporters_stale_shapes_are_dropped_and_the_rest_kept():
    model = flatten_to_linear(2)
    model.graph.value_info.extend([
        onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [2, 6]),
        onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [6, 3])])
    freed = GeneralizeBatch()(model).model
    assert [v.name for v in freed.graph.value_info] == ["w"]


@pytest.mark.parametrize("build, reason", [
    (per_row_constant, "Mul 'y'"),
    (split_batch, "splits the batch across axes"),
    (batch_merged, "Reshape 'y' splits the batch across axes ([8, 2] -> [2, 8])"),
    (unsqueezed_one, "Reshape 'y' fits the batch at 2 of its axes ([1, 6] -> [1, 1, 6])"),
])
def test_an_unproven_batch_is_kept_with_the_reason_or_refused_when_strict(build, reason):
    model = build()
    result = GeneralizeBatch()(model)
    assert not result.changed and not result.report.freed
    assert reason in result.report.reason
    assert result.model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == \
        model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
    with pytest.raises(UnsupportedModelError, match="cannot free it") as error:
        GeneralizeBatch(strict=True)(model)
    for call in export_calls(["x"], ["y"]):
        assert call in str(error.value)


def test_a_free_batch_is_left_alone():
    model = parse("""g (float[N, 2] x) => (float[N, 2] y) { y = Relu(x) }""")
    result = GeneralizeBatch()(model)
    assert result.report is None and not result.changed
    assert fixed_batch(model) is None


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
        "model      = given model -> GeneralizeBatch: its fixed batch of 2 rows freed "
        "(Reshape 'h' [2, 6] -> [-1, 6])")
    with pytest.warns(FixedBatchWarning, match="cannot prove"):
        kept = lossgraph.describe_plan(per_row_constant())
    assert kept.splitlines()[0].startswith(
        "model      = given model -> GeneralizeBatch: its fixed batch of 2 rows kept: it "
        "trains in batches of exactly 2 rows (")
    assert lossgraph.describe_plan(flatten_to_linear(2), fixed_batch="keep").splitlines()[0] \
        == ("model      = given model: its fixed batch of 2 rows kept: it trains in batches "
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
