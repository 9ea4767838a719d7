"""Targets: named and explicit targets resolve; every kind of graph lossgraph emits loads
in the onnxruntime of this environment (CI runs the suite on onnxruntime-training 1.19
and on current onnxruntime); the op check refuses, at emit time, what a target cannot
load, and its verdict agrees with the runtime's (docs/reference/targets.md)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.environment import GOLDEN_MODELS, HAS_TRAINING
from support.linear import LINEAR, linear_data, linear_program

import lossgraph
from lossgraph.compat import (
    AbsoluteLearningLoss,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    SquareLearningLoss,
)
from lossgraph.errors import UnsupportedModelError, UnsupportedOptionError
from lossgraph.models import check_emitted
from lossgraph.optim import SGD, Adam, AdamW, Momentum, update_graph
from lossgraph.penalties import penalty_graph
from lossgraph.speed import SpecializeBatch
from lossgraph.surgery import split_gradient
from lossgraph.target import (
    DEFAULT_TARGET,
    LATEST,
    TARGETS,
    Target,
    check_ops,
    loading_target,
    resolve_target,
    use_target,
)

GOLDEN = ["hand_linear", "skl_mlp_regressor", "skl_logistic_multiclass", "torch_cnn"]
CLASSIFIERS = {"skl_logistic_multiclass", "torch_cnn"}
FUSES = ["separate", "step", "epoch"]
RELEASES = [name for name in TARGETS if name.startswith("onnxruntime-1.")]
WEIGHTS = {"coef": np.zeros((4, 1), np.float32), "intercept": np.zeros(1, np.float32)}


# -- helpers ----------------------------------------------------------------------------------


def _onnxruntime():
    return pytest.importorskip("onnxruntime", reason="needs onnxruntime to load the graphs")


def installed() -> Target:
    """The named target of the onnxruntime installed here (its measured limits)."""
    ort = _onnxruntime()
    if HAS_TRAINING:
        return TARGETS["onnxruntime-training-1.19"]
    release = "onnxruntime-" + ".".join(ort.__version__.split(".")[:2])
    if release not in TARGETS:
        pytest.skip(f"onnxruntime {ort.__version__} is not measured: add its limits to "
                    "lossgraph.target._RELEASES and docs/reference/targets.md")
    return TARGETS[release]


def load_error(model: onnx.ModelProto) -> str | None:
    """None when onnxruntime loads ``model`` here, else the first line of its error."""
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types vary by release
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def predicted_to_load(model: onnx.ModelProto, runtime: Target) -> bool:
    """lossgraph's verdict: the IR version and every op of ``model`` suit ``runtime``."""
    if model.ir_version > runtime.ir_version:
        return False
    try:
        check_ops(model, runtime)
    except UnsupportedModelError:
        return False
    return True


def assert_loads(graphs: dict[str, onnx.ModelProto], target: Target = DEFAULT_TARGET) -> None:
    """Every graph carries the target's IR version and loads in this environment's
    onnxruntime, as lossgraph's check predicts."""
    runtime = installed()
    for kind, model in graphs.items():
        assert model.ir_version == target.ir_version, kind
        check_ops(model, target)
        assert predicted_to_load(model, runtime), kind
        assert load_error(model) is None, f"{kind}: {load_error(model)}"


def golden(name: str) -> onnx.ModelProto:
    return onnx.load(str(GOLDEN_MODELS / f"{name}.onnx"))


def compile_golden(name: str, fuse: str, **options) -> lossgraph.TrainingProgram:
    """The golden model compiled with a penalty on its first weight (none for the "ort"
    backend, which has no gradient for the penalty's norms)."""
    model = golden(name)
    first = lossgraph.trainable_initializers(lossgraph.lower_ml_ops(model))[0]
    penalty = None if options.get("backend") == "ort" else {first: {"l1": 0.01, "l2": 0.01}}
    # the torch CNN's output is its logits (a Gemm), which the log loss reads from_logits
    loss_options = {"from_logits": True} if name == "torch_cnn" else None
    return lossgraph.compile_program(
        model, loss="multiclass_log_loss" if name in CLASSIFIERS else "squared_error",
        loss_options=loss_options, fuse=fuse, penalty=penalty,
        optimizer=Momentum(0.01, nesterov=True), **options)


def program_graphs(program: lossgraph.TrainingProgram) -> Iterator[tuple[str, onnx.ModelProto]]:
    """The program's graphs, its inference model, and what the Trainer makes of them: the
    graphs specialized to a batch size, and separate mode's gradient cut in two."""
    yield from program.graphs.items()
    yield "inference model", program.to_inference_model()
    for name in ("train_step", "gradient"):
        if name in program.graphs:
            yield f"{name} for batch 4", SpecializeBatch(4)(program.graphs[name]).model
    if program.fuse == "separate":
        halves = split_gradient(program.graphs["gradient"],
                                program.io("gradient", "prediction"),
                                program.io("gradient", "prediction_grad"))
        yield "forward half", halves.forward
        yield "backward half", halves.backward


def relu_model(opset: int, ir_version: int) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def one_node_model(op_type: str, opset: int, domain: str = "", name: str = "n") -> onnx.ModelProto:
    """``y = op_type(x)`` importing ai.onnx ``opset`` (and ``domain`` version 1)."""
    node = helper.make_node(op_type, ["x"], ["y"], name=name, domain=domain)
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    imports = [helper.make_opsetid("", opset)]
    if domain:
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports)


needs_opset_24 = pytest.mark.skipif(onnx.defs.onnx_opset_version() < 24,
                                    reason="needs onnx 1.19 or newer (ai.onnx opset 24: Swish)")
needs_opset_26 = pytest.mark.skipif(onnx.defs.onnx_opset_version() < 26,
                                    reason="needs onnx 1.21 or newer (ai.onnx opset 26: CumProd)")


# -- every kind of emitted graph loads here ---------------------------------------------------


@pytest.mark.parametrize("fuse", FUSES)
@pytest.mark.parametrize("name", GOLDEN)
def test_program_graphs_of_every_fuse_mode_load(name, fuse):
    program = compile_golden(name, fuse)
    assert_loads(dict(program_graphs(program)))


@pytest.mark.parametrize("fuse", FUSES)
@pytest.mark.parametrize("name", ["hand_linear", "skl_mlp_regressor"])
def test_the_trainers_inference_export_loads_and_predicts_as_the_trainer(name, fuse, rng):
    program = compile_golden(name, fuse)
    features = program.inference_model.graph.input[0]
    width = features.type.tensor_type.shape.dim[1].dim_value
    X = rng.normal(size=(40, width)).astype(np.float32)
    y = rng.normal(size=40).astype(np.float32)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=16, progress=False)
    exported = trainer.to_inference_model()
    assert_loads({"Trainer.to_inference_model": exported})
    ort = _onnxruntime()
    session = ort.InferenceSession(exported.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (predicted,) = session.run(None, {features.name: X})
    np.testing.assert_allclose(predicted.ravel(), np.ravel(trainer.predict(X)), rtol=1e-5,
                               atol=1e-6)


def test_standalone_penalty_and_update_graphs_load():
    graphs = {"penalty": penalty_graph(WEIGHTS, {"coef": {"l1": 0.1, "l2": 0.2}})}
    for optimizer in (SGD(), Momentum(nesterov=True), Adam(), AdamW()):
        for opset in (DEFAULT_TARGET.min_opset, 18, DEFAULT_TARGET.max_opset):
            graphs[f"{type(optimizer).__name__} update, opset {opset}"] = update_graph(
                optimizer, WEIGHTS, opset)
    assert_loads(graphs)


def test_compat_loss_penalty_and_learning_rate_graphs_load():
    graphs = {}
    for loss in (SquareLearningLoss(), AbsoluteLearningLoss(), ElasticLearningLoss(),
                 NegLogLearningLoss()):
        graphs[type(loss).__name__] = loss.build_onnx_function()
        graphs[f"{type(loss).__name__} weighted"] = loss.build_onnx_function(
            weight_name="weight")
    graphs["ElasticLearningPenalty"] = ElasticLearningPenalty().build_onnx_function(WEIGHTS)
    for rate in (LearningRateSGD(), LearningRateSGDNesterov()):
        graphs[type(rate).__name__] = rate.build_onnx_function(WEIGHTS)
    assert_loads(graphs)


def _to_ort_artifacts():
    try:
        from lossgraph.export import to_ort_artifacts
    except ImportError as exc:  # the export package may be absent from a partial checkout
        pytest.skip(f"lossgraph.export.to_ort_artifacts is not importable: {exc}")
    return to_ort_artifacts


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ort_artifacts_load_where_the_op_check_says(optimizer, tmp_path):
    """The eval model (standard ops) loads everywhere; the training and optimizer models
    hold com.microsoft training ops: they load on the training build, and the op check
    refuses them for plain onnxruntime, whose loader refuses them too."""
    to_ort_artifacts = _to_ort_artifacts()
    written = to_ort_artifacts(onnx.parser.parse_model(LINEAR), tmp_path / "artifacts",
                               optimizer=optimizer)
    runtime = installed()
    for path in (written.training_model, written.eval_model, written.optimizer_model):
        model = onnx.load(str(path))
        assert model.ir_version == DEFAULT_TARGET.ir_version
        check_ops(model, DEFAULT_TARGET)
        predicted = predicted_to_load(model, runtime)
        assert predicted == (load_error(model) is None), (path.name, load_error(model))
        if path == written.eval_model or HAS_TRAINING:
            assert predicted, path.name
        else:
            with pytest.raises(UnsupportedModelError, match="com.microsoft"):
                check_ops(model, LATEST)


@pytest.mark.training
@pytest.mark.parametrize("fuse", FUSES)
def test_ort_backend_graphs_load_on_the_training_build_only(fuse):
    program = compile_golden("skl_mlp_regressor", fuse, backend="ort")
    graphs = dict(program.graphs)
    assert_loads(graphs)
    microsoft = {kind for kind, model in graphs.items()
                 if any(n.domain == "com.microsoft" for n in model.graph.node)}
    assert microsoft
    for kind in microsoft:
        with pytest.raises(UnsupportedModelError, match="com.microsoft .* has no kernel"):
            check_ops(graphs[kind], TARGETS["onnxruntime-1.19"])


@pytest.mark.training
def test_the_ort_backend_for_a_plain_onnxruntime_target_is_an_error_at_compile_time():
    with pytest.raises(UnsupportedModelError,
                       match=r"is com\.microsoft \w+, which target 'onnxruntime-1\.20'.*training"):
        compile_golden("skl_mlp_regressor", "step", backend="ort", target="onnxruntime-1.20")


# -- every named target: its graphs load from its release on, and only there -------------------


@pytest.mark.parametrize("name", [*RELEASES, "default", "onnxruntime", "onnxruntime-latest"])
def test_graphs_for_each_target_load_exactly_where_the_target_says(name):
    """A program compiled for a target at its newest opset carries the target's IR
    version; it loads here exactly when the measured limits of this runtime say so."""
    target = TARGETS[name]
    if onnx.defs.onnx_opset_version() < target.max_opset:
        pytest.skip(f"this onnx ({onnx.__version__}) does not know opset {target.max_opset}")
    model = onnx.parser.parse_model(LINEAR.replace('"" : 18', f'"" : {target.max_opset}'))
    program = lossgraph.compile_program(model, fuse="epoch", target=name)
    runtime = installed()
    for kind, graph in program.graphs.items():
        assert graph.ir_version == target.ir_version
        assert graph.opset_import[0].version == target.max_opset
        expected = target.ir_version <= runtime.ir_version and \
            target.max_opset <= runtime.max_opset
        assert predicted_to_load(graph, runtime) == expected, kind
        assert (load_error(graph) is None) == expected, (kind, load_error(graph))


def test_the_limits_measured_for_this_runtime_still_hold():
    """The installed onnxruntime loads its IR version and opset, and neither one more."""
    runtime = installed()
    assert load_error(relu_model(runtime.max_opset, runtime.ir_version)) is None
    assert load_error(relu_model(13, runtime.ir_version + 1)) is not None
    assert load_error(relu_model(runtime.max_opset + 1, min(runtime.ir_version, 10))) is not None


# -- resolution ---------------------------------------------------------------------------------


def test_named_targets_resolve_to_their_measured_limits():
    assert resolve_target(None) is DEFAULT_TARGET is TARGETS["default"]
    assert TARGETS["onnxruntime-training-1.19"] is DEFAULT_TARGET and DEFAULT_TARGET.training
    assert (DEFAULT_TARGET.ir_version, DEFAULT_TARGET.max_opset) == (10, 21)
    assert resolve_target("onnxruntime-latest") is LATEST is TARGETS[RELEASES[-1]]
    assert (TARGETS["onnxruntime-1.20"].ir_version, TARGETS["onnxruntime-1.20"].max_opset) == \
        (10, 21)
    legacy = TARGETS["onnxruntime"]  # the first name for plain onnxruntime, kept as it was
    assert (legacy.ir_version, legacy.max_opset, legacy.training) == (10, 25, False)
    for name in RELEASES:
        assert resolve_target(name).name == name and not TARGETS[name].training


def test_release_limits_never_decrease():
    targets = [TARGETS[name] for name in RELEASES]
    for older, newer in zip(targets, targets[1:]):
        assert older.ir_version <= newer.ir_version
        assert older.max_opset <= newer.max_opset
        assert older.microsoft_ops <= newer.microsoft_ops


def test_explicit_pairs_resolve_to_targets():
    pair = resolve_target("ir9-opset19")
    assert (pair.ir_version, pair.max_opset, pair.min_opset, pair.training) == (9, 19, 13, False)
    assert pair == Target(ir_version=9, max_opset=19) and pair.name == pair.pair == "ir9-opset19"
    assert str(pair) == "target 'ir9-opset19' (IR 9, ai.onnx opsets 13 to 19)"
    given = Target(ir_version=8, max_opset=17)
    assert resolve_target(given) is given


def test_compile_for_an_explicit_pair_stamps_its_ir_version_and_loads():
    program = lossgraph.compile_program(golden("hand_linear"), fuse="step", target="ir7-opset13")
    assert_loads(dict(program.graphs), Target(ir_version=7, max_opset=13))


@pytest.mark.parametrize(("target", "message"), [
    ("onnxruntime-lates", "Did you mean 'onnxruntime-latest'"),
    ("onnxruntime-1.99", r"Did you mean 'onnxruntime-1\.\d+'"),
    ("mars", "Or an explicit pair of IR version and newest ai.onnx opset, such as 'ir10-opset21'"),
    ("ir10-opset", "Unknown target 'ir10-opset'"),
    ("ir10-opset12", "max_opset must be at least 13"),
    ("ir6-opset21", "needs IR version 7 or newer"),
    (f"ir{onnx.IR_VERSION + 1}-opset21", "newer than this onnx"),
    (21, "target=21 must be a name"),
])
def test_unknown_or_impossible_targets_are_option_errors(target, message):
    with pytest.raises(UnsupportedOptionError, match=message):
        resolve_target(target)
    with pytest.raises(UnsupportedOptionError, match=message):
        lossgraph.compile_program(onnx.parser.parse_model(LINEAR), target=target)


@pytest.mark.parametrize("fields", [{"ir_version": True, "max_opset": 21},
                                    {"ir_version": 10, "max_opset": "21"},
                                    {"ir_version": 10, "max_opset": 21, "min_opset": 0}])
def test_a_target_with_a_field_that_is_not_a_positive_int_is_an_error(fields):
    with pytest.raises(UnsupportedOptionError, match="must be a positive int"):
        Target(**fields)


# -- the op check ---------------------------------------------------------------------------------


@needs_opset_24
def test_an_op_newer_than_the_target_is_an_error_naming_op_node_and_target():
    model = one_node_model("Swish", 24, name="swish_1")
    with pytest.raises(UnsupportedModelError) as caught:
        check_ops(model, TARGETS["onnxruntime-1.23"])
    message = str(caught.value)
    for part in ("Node 'swish_1'", "Swish", "opset 24", "'onnxruntime-1.23'",
                 "target='onnxruntime-1.24'"):
        assert part in message, (part, message)
    check_ops(model, TARGETS["onnxruntime-1.24"])


@needs_opset_26
def test_the_op_check_sees_subgraphs_and_functions():
    """If of opset 26 is If-25, which onnxruntime 1.24 knows; CumProd in its branch is
    not. A function's body is checked at the function's own opset."""
    inner = one_node_model("CumProd", 26, name="inner_cumprod").graph
    inner.name = "then"
    del inner.input[:]  # a branch reads the outer x
    branch = helper.make_node("If", ["c"], ["y"], name="if", then_branch=inner,
                              else_branch=inner)
    graph = helper.make_graph(
        [branch], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    nested = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    with pytest.raises(UnsupportedModelError,
                       match="Node 'inner_cumprod' is ai.onnx CumProd, defined in opset 26"):
        check_ops(nested, TARGETS["onnxruntime-1.24"])
    with pytest.raises(UnsupportedModelError, match="Node 'if' is ai.onnx If, defined in opset 25"):
        check_ops(nested, TARGETS["onnxruntime-1.23"])  # If changed in 24 and 25

    function = helper.make_function(
        "custom", "act", ["x"], ["y"], [helper.make_node("Swish", ["x"], ["y"], name="fswish")],
        [helper.make_opsetid("", 24)])
    caller = one_node_model("act", 24, domain="custom", name="call")
    caller.functions.append(function)
    with pytest.raises(UnsupportedModelError, match="Node 'fswish' is ai.onnx Swish"):
        check_ops(caller, TARGETS["onnxruntime-1.23"])


def test_an_opset_import_newer_than_the_target_is_an_error():
    model = relu_model(22, 10)
    with pytest.raises(UnsupportedModelError,
                       match="imports ai.onnx opset 22; target 'onnxruntime-1.20'.*"
                             "target='onnxruntime-1.21'"):
        check_ops(model, TARGETS["onnxruntime-1.20"])
    check_ops(model, TARGETS["onnxruntime-1.21"])


def test_com_microsoft_training_ops_are_refused_for_plain_onnxruntime_only():
    grad = one_node_model("ReluGrad", 17, domain="com.microsoft", name="relu_grad")
    with pytest.raises(UnsupportedModelError,
                       match=f"Node 'relu_grad' is com.microsoft ReluGrad, which target "
                             f"'{LATEST.name}'.*training build"):
        check_ops(grad, LATEST)
    check_ops(grad, DEFAULT_TARGET)  # the training build runs it
    check_ops(grad, Target(ir_version=10, max_opset=21))  # a bare pair says nothing of it
    check_ops(one_node_model("FusedMatMul", 17, domain="com.microsoft"), LATEST)
    check_ops(one_node_model("MoE", 17, domain="com.microsoft"), TARGETS["onnxruntime-1.23"])
    with pytest.raises(UnsupportedModelError, match="com.microsoft MoE"):
        check_ops(one_node_model("MoE", 17, domain="com.microsoft"), TARGETS["onnxruntime-1.22"])


@needs_opset_24
def test_emitted_models_are_checked_where_they_are_finalized():
    model = one_node_model("Swish", 24, name="swish")
    with use_target("onnxruntime-1.23"), pytest.raises(UnsupportedModelError, match="Swish"):
        check_emitted(model, "a test")
    with use_target("onnxruntime-1.24"):
        check_emitted(model, "a test")
    assert model.ir_version == TARGETS["onnxruntime-1.24"].ir_version


def test_a_pass_cannot_emit_a_graph_its_target_cannot_load():
    """The standalone penalty graph is opset 18: a target stopping at 17 refuses it at
    emit time, and so does separate mode, which emits it."""
    with use_target("ir8-opset17"), pytest.raises(
            UnsupportedModelError, match="opset 18; target 'ir8-opset17'"):
        penalty_graph(WEIGHTS, {"coef": 0.1})
    # separate mode's loss graph takes the model's opset; its update graph (opset 18) does not
    with pytest.raises(UnsupportedOptionError, match="opset=18 .*target 'ir8-opset17'"):
        compile_golden("hand_linear", "separate", target="ir8-opset17")


def test_graphs_cut_after_compiling_are_checked_for_the_runtimes_that_load_them():
    """Outside any use_target (the Trainer cutting or specializing a program's graph), a
    model is checked for the most widely loadable target that loads its opset."""
    newer = onnx.parser.parse_model(LINEAR.replace('"" : 18', '"" : 22'))
    assert loading_target(newer) is TARGETS["onnxruntime-1.21"]
    assert loading_target(onnx.parser.parse_model(LINEAR)) is DEFAULT_TARGET
    program = lossgraph.compile_program(newer, fuse="separate", target="onnxruntime-1.21")
    graphs = dict(program_graphs(program))
    assert all(g.opset_import[0].version in (18, 22) and g.ir_version == 10
               for g in graphs.values())


def test_the_op_check_is_cached_per_op_type(monkeypatch):
    """One schema lookup per op type and opset, whatever the number of nodes."""
    from lossgraph import target as target_module

    target_module._since.cache_clear()
    calls = []
    real = onnx.defs.get_schema
    monkeypatch.setattr(onnx.defs, "get_schema",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(200)]
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("v200", TensorProto.FLOAT, [2])])
    check_ops(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]))
    assert calls == [("Relu", 19, "")]


@pytest.mark.parametrize("fuse", FUSES)
def test_every_graph_derived_from_a_program_keeps_its_ir_version(fuse):
    """A program for target 'onnxruntime' (IR 10, opset 23 here): the graphs the Trainer
    specializes or cuts stay IR 10, not the IR 11 of the first release loading opset 23."""
    newer = onnx.parser.parse_model(LINEAR.replace('"" : 18', '"" : 23'))
    program = lossgraph.compile_program(newer, fuse=fuse, target="onnxruntime")
    assert {name: g.ir_version for name, g in program_graphs(program)} == {
        name: 10 for name, _ in program_graphs(program)}


def test_a_model_newer_than_a_runtime_loads_is_named_with_the_releases_that_load_it():
    from lossgraph.target import check_loads

    newer = onnx.parser.parse_model(LINEAR.replace('"" : 18', '"" : 23'))
    newer.ir_version = 11
    with pytest.raises(UnsupportedModelError) as error:
        check_loads(newer, DEFAULT_TARGET, "The program's 'predict' graph",
                    "onnxruntime-training 1.19.2")
    assert str(error.value).startswith(
        "The program's 'predict' graph is IR version 11 (it loads up to 10) and ai.onnx opset "
        "23 (it loads up to 21), newer than the installed onnxruntime-training 1.19.2 loads: "
        "onnxruntime 1.23 or later loads it (pip install 'onnxruntime>=1.23'")
    check_loads(onnx.parser.parse_model(LINEAR), DEFAULT_TARGET, "model", "runtime")


@pytest.mark.training
def test_a_program_the_installed_onnxruntime_cannot_load_is_refused_by_the_trainer():
    """Before any work: not onnxruntime's raw IR or opset error at the first fit or
    predict."""
    newer = onnx.parser.parse_model(LINEAR.replace('"" : 18', '"" : 23'))
    program = lossgraph.compile_program(newer, target="onnxruntime")
    with pytest.raises(UnsupportedModelError, match=(
            r"'evaluate' graph is ai.onnx opset 23 \(it loads up to 21\), newer than the "
            r"installed onnxruntime-training 1.19.2 loads")):
        lossgraph.Trainer(program)


# -- the target compile_program emits for --------------------------------------------------------

OPSET_23 = LINEAR.replace('"" : 18', '"" : 23')


@pytest.fixture(scope="module")
def data():
    return linear_data(205, seed=11)


def test_default_target_lowers_a_newer_opset_whose_ops_mean_the_same(data):
    """MatMul and Add are the same at opsets 21 and 23: compile lowers the model to the
    default target's opset 21 (ConvertOpset; what it refuses is in tests/test_opsets.py)."""
    prog = lossgraph.compile_program(onnx.parser.parse_model(OPSET_23), optimizer=SGD(0.05))
    assert str(prog.notes.opset).startswith("ai.onnx opset 23 lowered to 21")
    assert all([(o.domain, o.version) for o in g.opset_import] == [("", 21)]
               for g in prog.graphs.values())
    X, y = data
    trainer = lossgraph.Trainer(prog).fit(X, y, epochs=3, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def test_onnxruntime_target_emits_newer_opsets(data):
    from support.environment import HAS_TRAINING

    prog = lossgraph.compile_program(onnx.parser.parse_model(OPSET_23), target="onnxruntime",
                             optimizer=SGD(0.05))
    assert all(g.opset_import[0].version == 23 and g.ir_version == 10
               for g in prog.graphs.values())
    if HAS_TRAINING:
        pytest.skip("onnxruntime-training 1.19 loads opsets up to 21 only")
    X, y = data
    trainer = lossgraph.Trainer(prog).fit(X, y, epochs=3, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def test_unknown_target_is_an_error():
    with pytest.raises(UnsupportedOptionError, match="Unknown target 'onnxruntime-2'"):
        linear_program(target="onnxruntime-2")
