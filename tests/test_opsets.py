"""Models at an opset their target does not load are moved to one it loads where their ops
keep their meaning (lossgraph.opsets, the pass ConvertOpset), and refused by name where they
would not; every fix an error suggests is run here.

The classification of the op versions after opset 21 is checked against onnx's own schemas:
every version onnx defines is classified, and a change classified as one of element types
keeps the op's inputs and outputs and adds no attribute without a default.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx.defs
import pytest
from support.environment import HAS_SKL2ONNX, HAS_TRAINING
from support.models import CHANGED_OPS, changed_op_model, image_scaler, model

import lossgraph
from lossgraph.errors import InvalidModelError, UnsupportedModelError
from lossgraph.opsets import CHANGES, MEANING, NEW_OPS, TYPES, op_versions, to_opset
from lossgraph.passes import ConvertOpset
from lossgraph.target import DEFAULT_TARGET, TARGETS, check_opset, release_target

needs_skl2onnx = pytest.mark.skipif(not HAS_SKL2ONNX, reason="needs skl2onnx")


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def loads_here(target_name: str) -> bool:
    """Whether the installed onnxruntime loads what ``target_name`` emits."""
    runtime = release_target(_ort_version(), HAS_TRAINING)
    target = TARGETS[target_name]
    return runtime is not None and target.max_opset <= runtime.max_opset \
        and target.ir_version <= runtime.ir_version


def run(model_proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def reference(model_proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """What onnx's reference implementation computes (it knows every opset onnx defines)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model_proto).run(None, feeds)


def trains(program: lossgraph.TrainingProgram, X: np.ndarray, y: np.ndarray) -> list[float]:
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=2, batch_size=8, progress=False)
    return trainer.train_losses_


# -- the table, from onnx's schemas ---------------------------------------------------------


def _versions_after_21() -> set[tuple[str, int]]:
    return {(s.name, s.since_version) for s in onnx.defs.get_all_schemas_with_history()
            if s.domain == "" and s.since_version > 21}


def test_every_op_version_after_opset_21_is_classified():
    """onnx's schemas list which op versions came after opset 21: each is a change
    classified in CHANGES, or a version of an op opset 21 lacks (NEW_OPS)."""
    versions = _versions_after_21()
    existed = {(op, v) for op, v in versions if v in op_versions(op) and any(
        w <= 21 for w in op_versions(op))}
    new = {(op, v) for op, v in versions if (op, v) not in existed}
    assert existed == set(CHANGES), (sorted(existed - set(CHANGES)), sorted(set(CHANGES) - existed))
    assert {op for op, _ in new} == set(NEW_OPS)
    assert {op: min(v for o, v in new if o == op) for op in NEW_OPS} == NEW_OPS


def _schema(op: str, version: int) -> onnx.defs.OpSchema:
    return onnx.defs.get_schema(op, version, "")


@pytest.mark.parametrize("key", sorted(CHANGES), ids=lambda key: f"{key[0]}-{key[1]}")
def test_a_change_of_types_keeps_the_ops_inputs_outputs_and_attributes(key):
    """What the schemas show of each change classified as one of element types: the same
    inputs and outputs, and any attribute added has a default (the older behaviour)."""
    change = CHANGES[key]
    assert change.kind in (TYPES, MEANING)
    if change.kind == MEANING:
        return
    op, version = key
    newer = _schema(op, version)
    older = _schema(op, max(v for v in op_versions(op) if v < version))
    assert [i.name for i in newer.inputs] == [i.name for i in older.inputs]
    assert [o.name for o in newer.outputs] == [o.name for o in older.outputs]
    assert set(older.attributes) <= set(newer.attributes)
    for name in set(newer.attributes) - set(older.attributes):
        assert newer.attributes[name].default_value.name == name, name


# -- lowering ---------------------------------------------------------------------------------


#: Ops whose opset 22 and 25 versions add element types only, at opset 25 (Cast's
#: round_mode of opset 24 given at its default, which lowering drops).
TYPES_ONLY = model(
    "(float[N, 1, 6, 6] x) => (float[N, 8] y) <float[2, 1, 3, 3] k = {1, 0, -1, 2, 0, -2, 1, 0,"
    " -1, 0.5, 0.5, 0.5, 0, 0, 0, -0.5, -0.5, -0.5}, int64[2] shape = {0, 8}>",
    "c = Conv(x, k)  m = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (c) "
    "s = Sin(m)  p = Softplus(s)  e = Elu(p)  r = Reshape(e, shape) "
    "t = Transpose <perm = [1, 0]> (r)  u = Transpose <perm = [1, 0]> (t) "
    "y = Cast <to = 1, round_mode = \"up\"> (u)", opset=25)


def test_a_model_whose_ops_only_gained_types_is_lowered_and_computes_the_same():
    feeds = {"x": np.random.default_rng(0).normal(size=(3, 1, 6, 6)).astype(np.float32)}
    result = ConvertOpset()(TYPES_ONLY)
    lowered, move = result.model, result.report
    assert [(o.domain, o.version) for o in lowered.opset_import] == [("", 21)]
    assert (move.source, move.result, move.direction) == (25, 21, "lowered")
    assert move.dropped == ["the ai.onnx Cast node making 'y': round_mode, its default"]
    assert not [a for n in lowered.graph.node for a in n.attribute if a.name == "round_mode"]
    assert set(move.crossed) == {"Conv", "MaxPool", "Sin", "Softplus", "Elu", "Reshape",
                                 "Transpose", "Cast"}
    assert "Conv opset 22: bfloat16 added" in str(move)
    np.testing.assert_allclose(run(lowered, feeds)[0], reference(TYPES_ONLY, feeds)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(CHANGED_OPS))
def test_an_op_that_would_change_meaning_or_load_nowhere_is_refused_by_name(kind):
    version = CHANGED_OPS[kind][0]
    with pytest.raises(UnsupportedModelError) as caught:
        lossgraph.compile_program(changed_op_model(kind))
    message = str(caught.value)
    op = {"pool": "AveragePool", "swish": "Swish", "fp4": "Cast", "crd": "SpaceToDepth"}[kind]
    why = {"pool": "opset 22 changed it: with ceil_mode=1 a window that would start in the "
                   "right padding is ignored",
           "swish": "Swish is an op of opset 24, which opset 21 does not have",
           "fp4": "its output 'c' is tensor(float4e2m1), which opset 21's Cast does not take",
           "crd": "it sets mode='CRD', an attribute that opset 13's SpaceToDepth does not have"}
    assert f"ai.onnx {op} node" in message and f"from ai.onnx opset {version} to 21" in message
    assert why[kind] in message
    assert "Export the model at ai.onnx opset 21 or older" in message
    # a type the older opset lacks is no reason to pick a runtime that loads the newer one
    assert ("Or emit for a target that loads" in message) == (kind != "fp4")


@pytest.mark.parametrize("kind,target", [("pool", "onnxruntime-1.21"),
                                         ("swish", "onnxruntime-1.24"),
                                         ("crd", "onnxruntime-1.32")])
def test_emitting_for_the_suggested_target_trains_where_that_onnxruntime_runs(kind, target):
    """The error's second fix: the suggested target compiles; its program trains on the
    onnxruntime it names and is refused by name by the training build, as the message
    says."""
    message = ""
    try:
        lossgraph.compile_program(changed_op_model(kind))
    except UnsupportedModelError as error:
        message = str(error)
    assert f"compile_program(..., target='{target}')" in message
    assert f"Its graphs run on {TARGETS[target].description}, not on onnxruntime's training " \
           "build" in message
    program = lossgraph.compile_program(changed_op_model(kind), target=target)
    shape = {"pool": (1, 5, 5), "swish": (4,), "crd": (4, 2, 2)}[kind]
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, *shape)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    if loads_here(target):
        losses = trains(program, X, y)
        assert losses[-1] < losses[0]
    else:
        with pytest.raises(UnsupportedModelError, match="newer than the installed"):
            lossgraph.Trainer(program)


def test_exporting_at_the_suggested_opset_compiles():
    """The error's first fix, for the two ops that have an older form: the AveragePool at
    opset 21, Swish written as x * Sigmoid(x)."""
    rng = np.random.default_rng(0)
    pool = lossgraph.compile_program(changed_op_model("pool", opset=21))
    swish = lossgraph.compile_program(model(
        "(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
        "g = Sigmoid(x)  s = Mul(x, g)  y = MatMul(s, w)", opset=21))
    y = rng.normal(size=(16, 1)).astype(np.float32)
    assert trains(pool, rng.normal(size=(16, 1, 5, 5)).astype(np.float32), y)
    assert trains(swish, rng.normal(size=(16, 4)).astype(np.float32), y)


@pytest.mark.torch
def test_torchs_export_at_the_suggested_opset_needs_no_lowering():
    """torch.onnx.export(..., opset_version=21), as the error says: SiLU as Sigmoid and Mul."""
    import io

    import torch

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.SiLU(), torch.nn.Linear(3, 1))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 4),), buffer, opset_version=21, dynamo=False,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    exported = onnx.load_from_string(buffer.getvalue())
    assert max(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx")) <= 21
    program = lossgraph.compile_program(exported)
    assert program.notes.opset.direction == "kept"


# -- duplicate imports -----------------------------------------------------------------------


def _twice(model_proto: onnx.ModelProto, *versions: int) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model_proto)
    del copy.opset_import[:]
    copy.opset_import.extend(onnx.helper.make_opsetid("", v) for v in versions)
    return copy


def test_an_opset_imported_twice_at_versions_that_mean_the_same_becomes_one_entry():
    """onnx.version_converter.convert_version changes only the first of skl2onnx's two
    entries: 21 and 22, under which the nodes mean the same."""
    same = _twice(model("(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
                        "y = MatMul(x, w)", opset=21), 21, 22)
    result = ConvertOpset()(same)
    assert [(o.domain, o.version) for o in result.model.opset_import] == [("", 21)]
    assert result.report.imported == (21, 22) and result.changed


def test_an_opset_imported_twice_at_versions_that_differ_is_refused_and_the_fix_works():
    conflict = _twice(changed_op_model("pool", opset=21), 22, 21)
    with pytest.raises(InvalidModelError) as caught:
        lossgraph.compile_program(conflict)
    message = str(caught.value)
    assert "imports the domain 'ai.onnx' twice, as opsets 22 and 21" in message
    assert "del model.opset_import[i] for the other" in message
    del conflict.opset_import[0]  # the nodes were written for 21
    assert lossgraph.compile_program(conflict).notes.opset.direction == "kept"


# -- raising ---------------------------------------------------------------------------------


def test_an_older_opset_is_raised_by_onnxs_version_converter_and_computes_the_same():
    old = model("(float[N, 3] x) => (float[N, 3] y, float[N] s) <float[3, 3] w = {1, 2, 3, 4, "
                "5, 6, 7, 8, 9}>", "h = MatMul(x, w)  y = Softmax <axis = 1> (h) "
                "s = ReduceSum <axes = [1], keepdims = 0> (y)", opset=9)
    result = ConvertOpset()(old)
    assert (result.report.source, result.report.result, result.report.direction) == (
        9, 13, "raised")
    feeds = {"x": np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)}
    for ours, theirs in zip(run(result.model, feeds), reference(old, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_an_op_onnx_removed_cannot_be_raised_and_the_fix_works():
    with pytest.raises(UnsupportedModelError) as caught:
        lossgraph.convert_opset(image_scaler())
    assert "opset 13 has no ImageScaler" in str(caught.value)
    assert "Export the model at ai.onnx opset 13 or newer" in str(caught.value)
    scaled = model("(float[N, 1, 1, 4] x) => (float[N, 1, 1, 1] y) <float[4, 1] w = {1, 2, 3, "
                   "4}, float two = {2}>", "s = Mul(x, two)  y = MatMul(s, w)", opset=13)
    lossgraph.compile_program(scaled)  # the same model exported at opset 13


def test_an_opset_onnx_does_not_define_is_refused_and_the_fix_works():
    linear = model("(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
                   "y = MatMul(x, w)", opset=onnx.defs.onnx_opset_version())
    future = _twice(linear, onnx.defs.onnx_opset_version() + 1)
    with pytest.raises(UnsupportedModelError, match="Export it at ai.onnx opset "
                                                    f"{onnx.defs.onnx_opset_version()}"):
        lossgraph.compile_program(future, target="onnxruntime-latest")
    lossgraph.compile_program(linear, target="onnxruntime-latest")


# -- every other message that advised converting ---------------------------------------------


def test_check_opset_advises_convert_opset_which_works():
    at_22 = _twice(model("(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
                         "y = MatMul(x, w)", opset=22), 22)
    with pytest.raises(UnsupportedModelError, match=r"lossgraph.convert_opset\(model\)"):
        check_opset(at_22, DEFAULT_TARGET)
    assert check_opset(lossgraph.convert_opset(at_22), DEFAULT_TARGET) == 21


def test_training_artifacts_of_a_program_for_a_newer_opset_advise_what_works(tmp_path):
    from lossgraph.export import to_ort_artifacts

    at_22 = model("(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
                  "y = MatMul(x, w)", opset=22)
    newer = lossgraph.compile_program(at_22, target="onnxruntime-1.21")
    with pytest.raises(UnsupportedModelError, match="pass the model itself to to_ort_artifacts"):
        to_ort_artifacts(newer, tmp_path / "newer")
    to_ort_artifacts(lossgraph.compile_program(at_22), tmp_path / "compiled")
    to_ort_artifacts(at_22, tmp_path / "model")


# -- the runtime's own check -----------------------------------------------------------------


@needs_skl2onnx
def test_a_program_the_installed_onnxruntime_cannot_load_is_named_and_its_fixes_work():
    """The issue's report: skl2onnx's default LinearRegression compiled for
    onnxruntime-1.21 ended `lossgraph train` with onnxruntime's "Opset 22 is under
    development" as an internal error. The Trainer refuses such a program by name before
    any work (lossgraph.runtime.session.check_loadable, since issue 24); both fixes it
    names work: the default target (which lowers opset 22 now), and an onnxruntime that
    loads opset 22 (the plain 1.32 environment trains it)."""
    X, y, linear = _linear_regression()
    program = lossgraph.compile_program(linear, target="onnxruntime-1.21")
    if HAS_TRAINING:
        with pytest.raises(UnsupportedModelError) as caught:
            lossgraph.Trainer(program)
        message = str(caught.value)
        assert "pip install 'onnxruntime>=1.21' in an environment without the training build" \
            in message
        assert "compile_program(..., target='onnxruntime-training-1.19')" in message
        program = lossgraph.compile_program(linear, target="onnxruntime-training-1.19")
    losses = trains(program, X, y)
    assert losses[-1] < losses[0]


def _linear_regression() -> tuple[np.ndarray, np.ndarray, onnx.ModelProto]:
    """skl2onnx's default export of a LinearRegression (opset 22, ai.onnx listed twice)."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LinearRegression

    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 3)).astype(np.float32)
    y = (X @ np.array([[1.5], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    exported = to_onnx(LinearRegression().fit(X, y[:, 0] * 0.5), X[:1])
    return X, y, exported


@needs_skl2onnx
def test_skl2onnx_default_export_lowers_and_the_issues_first_advice_works_too():
    """skl2onnx 1.20's default: ai.onnx 22 listed twice. Compiled as it is; and the issue's
    first advice, onnx.version_converter.convert_version(model, 21), which changes one entry
    only, now compiles too (the two entries mean the same for its ops)."""
    _, _, exported = _linear_regression()
    assert [o.version for o in exported.opset_import if o.domain == ""] == [22, 22]
    program = lossgraph.compile_program(exported)
    assert str(program.notes.opset) == ("ai.onnx opset 22 lowered to 21: none of its ai.onnx "
                                        "ops changed in between")
    assert all(max(o.version for o in g.opset_import if o.domain == "") == 21
               for g in [*program.graphs.values(), program.inference_model])
    converted = onnx.version_converter.convert_version(exported, 21)
    assert sorted(o.version for o in converted.opset_import if o.domain == "") == [21, 22]
    lossgraph.compile_program(converted)


def test_to_opset_moves_a_model_in_place_between_two_opsets():
    at_25 = onnx.ModelProto()
    at_25.CopyFrom(TYPES_ONLY)
    move = to_opset(at_25, 22)
    assert (move.source, move.result) == (25, 22)
    assert [o.version for o in at_25.opset_import] == [22]
    assert "Conv" not in move.crossed  # Conv-22 is the same at 22 and 25


@needs_skl2onnx
def test_lossgraph_train_names_a_program_this_onnxruntime_cannot_load(tmp_path, monkeypatch,
                                                                      capsys):
    """The issue's command line, as a user types it: no internal error. The training build
    refuses the program by name (exit status 2); onnxruntime 1.32 trains it."""
    from lossgraph.cli import main

    X, y, linear = _linear_regression()
    onnx.save(linear, tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", X=X, y=y)
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "model.onnx", "-o", "program", "--target", "onnxruntime-1.21"]) == 0
    status = main(["train", "program", "--data", "data.npz", "-o", "trained.onnx",
                   "--no-progress"])
    error = capsys.readouterr().err
    assert "internal error" not in error
    if HAS_TRAINING:
        assert status == 2
        assert "is ai.onnx opset 22 (it loads up to 21), newer than the installed " \
               "onnxruntime-training 1.19.2 loads" in error
        assert main(["compile", "model.onnx", "-o", "default"]) == 0  # its advice
        assert main(["train", "default", "--data", "data.npz", "-o", "trained.onnx",
                     "--no-progress"]) == 0
    else:
        assert status == 0, error


@needs_skl2onnx
@pytest.mark.parametrize("opset", [13, 21])
def test_skl2onnx_at_the_opset_an_error_names_needs_no_conversion(opset):
    """The errors' "skl2onnx: to_onnx(..., target_opset=N)": skl2onnx writes exactly N
    (listed twice without the ZipMap), which compiles as it is."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    X, _, _ = _linear_regression()
    labels = (X[:, 0] > 0).astype(np.int64)
    classifier = LogisticRegression().fit(X, labels)
    for options in ({}, {"options": {"zipmap": False}}):
        exported = to_onnx(classifier, X[:1], target_opset=opset, **options)
        move = lossgraph.compile_program(exported).notes.opset
        assert (move.source, move.direction) == (opset, "kept")
