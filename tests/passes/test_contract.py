"""The contract every pass keeps, checked once for all of them (fusion modes included):

- **pure**: the model given is never mutated;
- **valid**: every model emitted passes the full ONNX checker;
- **deterministic**: the same input and options give byte-identical output in one
  process, and in fresh processes with other hash seeds;

and a checkpoint resumed in a new process continues training bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS, ROOT
from support.models import UNSORTED

import lossgraph
from lossgraph.adapters import LoRA
from lossgraph.errors import UnsupportedModelError
from lossgraph.export.artifacts import AccumulateGradients
from lossgraph.optim import SGD, Adam, Momentum, update_graph
from lossgraph.passes import (
    AddLoRA,
    AddLossOutput,
    AlphabetizeInitializers,
    ConstantsToInitializers,
    ConvertOpset,
    EpochGraph,
    GeneralizeBatch,
    Gradient,
    GroupGradients,
    LowerMlOps,
    PackWeights,
    Pass,
    PassResult,
    Pipeline,
    Recompute,
    RemoveLossOutput,
    StepGraph,
    StripTraining,
    SumGradients,
    UntieWeights,
    WeightsToInputs,
)
from lossgraph.passes.expand_functions import ExpandFunctions
from lossgraph.passes.in_place import WriteInPlace
from lossgraph.passes.quantization import StraightThroughQuantization
from lossgraph.passes.recompute import UpdatesInBackwardOrder
from lossgraph.passes.running_stats import RunningStatistics
from lossgraph.passes.sequences import SequencesToTensors
from lossgraph.passes.stabilize import StabilizeNumerics
from lossgraph.passes.strip import InferenceMode
from lossgraph.passes.zipmap import ZipMapToTensor
from lossgraph.penalties import penalty_graph
from lossgraph.speed import (
    ConcatScatteredSlabs,
    FoldBatchIntoProducts,
    FoldStaticShapes,
    SpecializeBatch,
    SplitRowProducts,
    SumRowsByProduct,
    TransposedProducts,
    UnfoldConvWeightGradients,
    WidenScalarConstants,
)

GOLDEN = GOLDEN_MODELS
#: What a fresh interpreter puts on sys.path to import this file: its folder and tests/.
HERE = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]


def golden(name: str) -> onnx.ModelProto:
    return onnx.load(GOLDEN / f"{name}.onnx")


def with_loss(name: str, score: str = "squared_error") -> onnx.ModelProto:
    return lossgraph.add_loss_output(lossgraph.lower_ml_ops(golden(name)), score)


def with_gradients(name: str) -> onnx.ModelProto:
    """A golden model's loss model with its weights as inputs, and their gradients."""
    weights = lossgraph.trainable_initializers(with_loss(name))
    return Gradient(weights)(WeightsToInputs(weights)(with_loss(name)).model).model


def compiled(fuse: str, **options: Any) -> Callable[[onnx.ModelProto], Any]:
    return lambda model: lossgraph.compile_program(model, fuse=fuse, **options)


def step_graph_of(name: str) -> onnx.ModelProto:
    return lossgraph.compile_program(golden(name), optimizer=Momentum(0.01)).graphs["train_step"]


WEIGHTS = {"coef": np.ones((3, 1), np.float32), "bias": np.zeros(1, np.float32)}


def _write_in_place() -> WriteInPlace:
    """WriteInPlace of step_graph_of("skl_mlp_regressor")'s state and loss."""
    program = lossgraph.compile_program(golden("skl_mlp_regressor"), optimizer=Momentum(0.01))
    return WriteInPlace(program.state_updates("train_step"), program.io("train_step", "loss")[0])


#: name -> (the input model, the pass applied to it). Every pass of lossgraph.passes, the
#: optimization passes, the standalone graphs, and compile_program in every fusion mode.
PASSES: dict[str, tuple[Callable[[], onnx.ModelProto | None], Callable[[Any], Any]]] = {
    "LowerMlOps": (lambda: golden("skl_logistic_multiclass"), LowerMlOps()),
    "ConvertOpset (lowered, skl2onnx's duplicate entry)": (lambda: onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 22, "" : 22]> g (float[N, 1, 4, 4] x)
        => (float[N, 1, 2, 2] y) <float[1, 1, 3, 3] k = {1, 0, 1, 0, 1, 0, 1, 0, 1}> {
            c = Conv <pads = [1, 1, 1, 1]> (x, k)  s = Softplus(c)
            y = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (s) }"""), ConvertOpset()),
    "ConvertOpset (raised)": (lambda: onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 9]> g (float[N, 3] x) => (float[N, 3] y,
        float[N] s) { y = Softmax <axis = 1> (x)  s = ReduceSum <axes = [1], keepdims = 0> (y)
        }"""), ConvertOpset()),
    "ZipMapToTensor": (lambda: onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18, "ai.onnx.ml" : 3]>
        clf (float[N, 4] x) => (int64[N] label, seq(map(int64, float)) probabilities)
        <float[4, 2] coef = {1, 2, 3, 4, 5, 6, 7, 8}> { z = MatMul(x, coef)
        p = Softmax <axis = 1> (z)  label = ArgMax <axis = 1, keepdims = 0> (p)
        probabilities = ai.onnx.ml.ZipMap <classlabels_int64s = [0, 1]> (p) }"""),
        ZipMapToTensor()),
    "GeneralizeBatch": (lambda: onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2, 4] x) => (float[2, 3] y)
          <float[4, 6] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                            20, 21, 22, 23, 24}, int64[3] t = {2, 2, 3}, int64[1] a = {1}> {
            h = MatMul(x, w)
            r = Reshape(h, t)
            y = ReduceSum <keepdims: int = 0> (r, a)
        }"""), GeneralizeBatch()),
    "AddLossOutput": (lambda: golden("hand_mlp_tanh_double"),
                      AddLossOutput("huber", penalty={"W1": 0.1})),
    "AddLossOutput multiclass_log_loss": (
        lambda: lossgraph.lower_ml_ops(golden("skl_mlp_classifier")),
        AddLossOutput("multiclass_log_loss")),
    "AddLossOutput elastic, float32, 1-D, sample weight, sum": (
        lambda: onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
            g (float[N, 3] x) => (float[N] y) <float[3, 1] w = {1, 2, 3}, int64[1] last = {1}>
            {
                h = MatMul(x, w)
                y = Squeeze(h, last)
            }"""),
        AddLossOutput("elastic", weight_name="w_row", reduction="sum",
                      options={"l1_weight": 0.3, "l2_weight": 0.7})),
    "RemoveLossOutput": (lambda: lossgraph.add_loss_output(golden("skl_mlp_regressor"),
                                                           weight_name="w",
                                                 penalty={"coefficient": 0.1}),
                         RemoveLossOutput()),
    "StripTraining": (lambda: lossgraph.add_loss_output(onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y) <float[2] s = {1, 2}, float[2] b = {0, 1},
        float[2] m = {0, 1}, float[2] v = {1, 4}, float r = {0.5}, bool t = {1}> {
            h, rm, rv = BatchNormalization <training_mode: int = 1> (x, s, b, m, v)
            y, mask = Dropout(h, r, t) }"""), weight_name="w"), StripTraining()),
    "InferenceMode": (lambda: PASSES["StripTraining"][0](), InferenceMode()),
    "AccumulateGradients": (lambda: with_gradients("hand_mlp_tanh_double"),
                            AccumulateGradients()),
    "RunningStatistics": (lambda: WeightsToInputs(["m", "v"])(PASSES["StripTraining"][0]()).model,
                          RunningStatistics()),
    "LowerMlOps LinearRegressor": (lambda: golden("skl_linear_regression"), LowerMlOps()),
    "LowerMlOps LinearClassifier binary": (lambda: golden("skl_logistic_binary"), LowerMlOps()),
    "AlphabetizeInitializers": (lambda: golden("skl_mlp_regressor"), AlphabetizeInitializers()),
    "AlphabetizeInitializers in If branches": (
        lambda: onnx.parser.parse_model(UNSORTED),
        AlphabetizeInitializers()),
    "WeightsToInputs": (lambda: with_loss("hand_linear"), WeightsToInputs(["W", "B"])),
    "ConstantsToInitializers": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 18]> g (float[N, 2] x) => (float[N, 2] y) {
            c = Constant <value = float[2, 2] {1, 2, 3, 4}> ()  y = MatMul(x, c) }"""),
        ConstantsToInitializers(["c"])),
    "UntieWeights": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 18]> g (float[N, 2] x) => (float[N, 2] y) <float[2] s = {1, 1},
        float[2] b = {0, 0}> { h = LayerNormalization(x, s, b)  t = Identity(s)
        u = Identity(b)  y = LayerNormalization(h, t, u)  }"""), UntieWeights(["s", "b"])),
    "ExpandFunctions": (lambda: onnx.parser.parse_model("""<ir_version: 8, opset_import: [
        "" : 18, "local" : 1]> g (float[N, 3] x) => (float[N, 3] y, float s) {
            y = local.SiLU <alpha: float = 2.0> (x)   q, s, z = DynamicQuantizeLinear(y) }
        <domain: "local", opset_import: ["" : 18]> SiLU <alpha> (x) => (y) {
            a = Constant <value_float: float = @alpha> () ax = Mul(a, x) s = Sigmoid(ax)
            y = Mul(x, s) }
        """), ExpandFunctions()),
    "AddLoRA (MatMul, Gemm transB, dropout)": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 18]> g (float[N, 3] x) => (float[N, 2] y) <float[3, 4] w = {1, 2, 3,
        4, 5, 6, 7, 8, 9, 10, 11, 12}, float[2, 4] v = {1, 2, 3, 4, 5, 6, 7, 8}> {
            h = MatMul(x, w)  r = Relu(h)  y = Gemm <transB = 1> (r, v) }"""),
        AddLoRA(LoRA(rank=2, dropout=0.1, targets=["w", "v"]))),
    "AddLoRA (Conv)": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 18]> g (float[N, 2, 4, 4] x) => (float[N, 3, 4, 4] y)
        <float[3, 2, 1, 1] k = {1, 2, 3, 4, 5, 6}> { y = Conv <pads = [0, 0, 0, 0]> (x, k) }"""),
        AddLoRA(LoRA(rank=2, init="gaussian", ops=("Conv",)))),
    "StabilizeNumerics": (lambda: with_loss("skl_sgd_classifier", "multiclass_log_loss"),
                          StabilizeNumerics()),
    "StabilizeNumerics (ort backend, double, in an If branch)": (
        lambda: onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (double[N, 3] x, bool c) => (double[N, 3] y) {
            y = If(c) <then_branch = t () => (double[N, 3] a) { s = Sigmoid(x)  l = Log(s)
                                                               a = Neg(l) },
                       else_branch = f () => (double[N, 3] b) {
                           one = Constant<value = double {1}>()  r = Sigmoid(x)
                           d = Sub(one, r)  b = Log(d) }> }"""),
        StabilizeNumerics("ort")),
    "SequencesToTensors": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 18]> g (float[N, 5] x) => (float[N, 2] y, float[N, 5] c, int64 n)
        <int64 two = {2}, int64 last = {-1}> {
            s = SplitToSequence<axis = 1>(x, two)  a = SequenceAt(s, last)  n = SequenceLength(s)
            z = Constant<value = int64 {0}>()  b = SequenceAt(s, z)  y = Add(a, b)
            c = ConcatFromSequence<axis = 1>(s) }"""), SequencesToTensors()),
    "StraightThroughQuantization": (lambda: onnx.parser.parse_model("""<ir_version: 8,
        opset_import: ["" : 13]> g (float[N, 2] x) => (float[N, 2] y)
        <float[2, 2] w = {0.5, -1, 2, 0.1}, float[2] s = {0.01, 0.02}, int8[2] z = {0, 1},
         float sa = {0.05}, uint8 za = {128}, int8[2, 2] v = {3, -4, 5, 6}> {
            wq = QuantizeLinear<axis = 0>(w, s, z)  wd = DequantizeLinear<axis = 0>(wq, s, z)
            h = MatMul(x, wd)  hq = QuantizeLinear(h, sa, za)  hd = DequantizeLinear(hq, sa, za)
            vd = DequantizeLinear<axis = 0>(v, s, z)  y = MatMul(hd, vd) }"""),
        StraightThroughQuantization(dequantize_weights=True)),
    "Gradient": (lambda: with_loss("torch_cnn"), Gradient()),
    "Gradient (vector-Jacobian)": (lambda: golden("hand_broadcast_reuse"),
                                   Gradient(outputs=["Y"])),
    "Gradient (ort backend)": (lambda: with_loss("hand_linear"), Gradient(backend="ort")),
    "StepGraph": (lambda: with_gradients("skl_mlp_regressor"), StepGraph(Adam(0.01))),
    "PackWeights": (lambda: with_gradients("skl_mlp_regressor"), PackWeights(Momentum(0.01))),
    "SumGradients": (lambda: with_gradients("skl_mlp_regressor"), SumGradients()),
    "Recompute": (lambda: with_gradients("skl_mlp_regressor"), Recompute("auto")),
    "UpdatesInBackwardOrder": (lambda: StepGraph(Adam(0.01))(
        with_gradients("skl_mlp_regressor")).model, UpdatesInBackwardOrder()),
    "GroupGradients": (lambda: SumGradients()(PackWeights(Adam(0.01))(
        with_gradients("hand_linear")).model).model, GroupGradients()),
    "EpochGraph": (lambda: StepGraph(Momentum(0.01, nesterov=True))(
        PackWeights(Momentum(0.01, nesterov=True))(with_gradients("hand_linear")).model).model,
        EpochGraph()),
    "SumRowsByProduct": (lambda: lossgraph.gradient(with_loss("skl_mlp_regressor")),
                         SumRowsByProduct()),
    "WidenScalarConstants": (lambda: step_graph_of("skl_mlp_regressor"), WidenScalarConstants()),
    "UnfoldConvWeightGradients": (lambda: with_gradients("torch_cnn"),
                                  UnfoldConvWeightGradients()),
    "FoldBatchIntoProducts": (lambda: lossgraph.gradient(onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18]> g (float[N, 5, 3] x) => (float loss)
        <float[3, 2] w = {1, 2, 3, 4, 5, 6}> { y = MatMul(x, w)  loss = ReduceSum<keepdims=0>(y)
        }"""), weights=["w"], loss_name="loss"), FoldBatchIntoProducts()),
    "ConcatScatteredSlabs": (lambda: lossgraph.gradient(onnx.parser.parse_model(
        """<ir_version: 8, opset_import: ["" : 18]> g (float[2, 3] x) => (float loss)
        <int64 i = {0}, int64 j = {1}> { a = Gather(x, i)  b = Gather(x, j)  c = Mul(a, b)
        loss = ReduceSum<keepdims=0>(c) }"""), weights=["x"], loss_name="loss"),
                             ConcatScatteredSlabs()),
    "FoldStaticShapes": (lambda: onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[4, 3] x) => (float[4, 3] y, int64 n) { s = Shape(x) n = Size(x) y = Reshape(x, s) }
        """), FoldStaticShapes()),
    "SplitRowProducts": (lambda: onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[1, 1000] row, float[1000, 3] m) => (float[1, 3] y) { y = MatMul(row, m) }
        """), SplitRowProducts()),
    "TransposedProducts": (lambda: onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[5, 3] a, float[5, 4] b) => (float[4, 3] y) {
            p = Gemm<transA=1>(a, b)  y = Transpose<perm=[1, 0]>(p) }
        """), TransposedProducts()),
    "SpecializeBatch": (lambda: step_graph_of("skl_mlp_regressor"), SpecializeBatch(16)),
    "WriteInPlace": (lambda: step_graph_of("skl_mlp_regressor"), _write_in_place()),
    "penalty_graph": (lambda: None, lambda _: penalty_graph(WEIGHTS, {"coef": {"l1": 0.1}})),
    "update_graph": (lambda: None, lambda _: update_graph(Adam(0.01), WEIGHTS)),
    **{f"compile fuse={fuse}": (lambda: golden("skl_mlp_classifier"),
                                compiled(fuse, loss="multiclass_log_loss",
                                         penalty={"coefficient": 1e-3},
                                         optimizer=Momentum(0.01, nesterov=True)))
       for fuse in ("step", "epoch", "separate")},
}
MARKS = {"Gradient (ort backend)": pytest.mark.training}


def _models(result: Any) -> list[onnx.ModelProto]:
    """Every model a pass returned."""
    if isinstance(result, onnx.ModelProto):
        return [result]
    if isinstance(result, PassResult):
        return [result.model]
    if isinstance(result, lossgraph.TrainingProgram):
        return [*result.graphs.values(), result.inference_model]
    if isinstance(result, tuple):
        return [m for item in result for m in _models(item)]
    return []


def fingerprint(result: Any) -> Any:
    """A JSON-ready digest of everything a pass returned, order included."""
    if isinstance(result, onnx.ModelProto):
        return hashlib.sha256(result.SerializeToString()).hexdigest()
    if isinstance(result, np.ndarray):
        return [result.dtype.str, list(result.shape),
                hashlib.sha256(np.ascontiguousarray(result).tobytes()).hexdigest()]
    if isinstance(result, lossgraph.TrainingProgram):
        return fingerprint((result.graphs, result.manifest, result.state, result.inference_model))
    if isinstance(result, Mapping):  # a dict, or a program's graphs
        return [[key, fingerprint(value)] for key, value in result.items()]
    if isinstance(result, (tuple, list)):
        return [fingerprint(item) for item in result]
    if dataclasses.is_dataclass(result):
        return fingerprint(dataclasses.asdict(result))
    return json.loads(json.dumps(result))


def digests(names: list[str]) -> dict[str, Any]:
    """Fingerprints of the named passes' results (run in a fresh process by the tests)."""
    return {name: fingerprint(PASSES[name][1](PASSES[name][0]())) for name in names}


CASES = [pytest.param(name, marks=MARKS.get(name, ())) for name in PASSES]


@pytest.mark.parametrize("name", CASES)
def test_every_pass_is_pure_valid_and_deterministic(name):
    make_input, run = PASSES[name]
    model = make_input()
    before = None if model is None else model.SerializeToString()
    first, second = run(model), run(model)
    if model is not None:
        assert model.SerializeToString() == before, "the pass mutated its input"
    assert fingerprint(first) == fingerprint(second)
    emitted = _models(first)
    assert emitted
    for emitted_model in emitted:
        onnx.checker.check_model(emitted_model, full_check=True)


@pytest.mark.parametrize(("step", "given", "missing"), [
    (StepGraph(SGD()), lambda: golden("hand_linear"), "records no loss"),
    (PackWeights(SGD()), lambda: with_loss("hand_linear"), "records no gradients"),
    (SumGradients(), lambda: with_loss("hand_linear"), "records no gradients"),
    (AccumulateGradients(), lambda: with_loss("hand_linear"), "records no gradients"),
    (EpochGraph(), lambda: with_gradients("hand_linear"), "no step graph signature"),
    (EpochGraph(), lambda: compiled("epoch")(golden("hand_linear")).graphs["train_epoch"],
     "an epoch graph cannot be wrapped again"),
])
def test_a_pass_names_the_precondition_its_input_misses(step, given, missing):
    with pytest.raises(UnsupportedModelError,
                       match=f"{step.name} needs {step.requires[0].description}: .*{missing}"):
        step(given())


def test_a_pipeline_checks_each_intermediate_model_once(monkeypatch):
    """The model given is checked once; each pass proves only the model it emits."""
    from lossgraph.passes import contract

    checked, emitted = [], []
    monkeypatch.setattr(contract, "check_model", lambda model, what: checked.append(what))
    real_emitted = contract.check_emitted
    monkeypatch.setattr(contract, "check_emitted",
                        lambda model, what: emitted.append(what) or real_emitted(model, what))
    weights = ["W", "B"]
    result = Pipeline((AddLossOutput("squared_error"), WeightsToInputs(weights),
                       Gradient(weights)))(golden("hand_linear"))
    assert checked == ["The model given to AddLossOutput"]
    assert emitted == ["AddLossOutput", "WeightsToInputs", "Gradient"]
    assert list(result.report.of(WeightsToInputs)) == weights
    assert result.report.of(Gradient) == {"W": "W_grad", "B": "B_grad"}
    with pytest.raises(lossgraph.errors.InternalError, match="No StepGraph report"):
        result.report.of(StepGraph)


def test_every_pass_class_of_lossgraph_is_checked_here():
    def subclasses(cls: type) -> set[type]:
        return {c for s in cls.__subclasses__() for c in {s, *subclasses(s)}}

    ours = {c.__name__ for c in subclasses(Pass) if c.__module__.startswith("lossgraph.")}
    checked = {type(run).__name__ for _, run in PASSES.values()}
    assert ours - {"Pipeline"} <= checked, sorted(ours - checked)


def _available(name: str) -> bool:
    from support.environment import has

    return name not in MARKS or has("training")


@pytest.mark.slow
@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_every_pass_gives_the_same_bytes_in_another_process_and_hash_seed(hash_seed):
    names = [name for name in PASSES if _available(name)]
    here = digests(names)
    script = (f"import sys, json; sys.path[:0] = {HERE!r}; "
              f"import test_contract as t; print(json.dumps(t.digests({names!r})))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
    there = json.loads(result.stdout.strip().splitlines()[-1])
    for name in names:
        assert there[name] == json.loads(json.dumps(here[name])), name


RESUME = textwrap.dedent("""
    import sys, numpy as np, lossgraph
    sys.path[:0] = {here!r}
    from test_contract import resume_data
    X, y = resume_data()
    trainer = lossgraph.Trainer.load_checkpoint({checkpoint!r})
    trainer.fit(X, y, epochs=2, batch_size=7, warm_start=True, progress=False)
    np.savez({out!r}, losses=np.array(trainer.train_losses_), **trainer.state)
""")


def resume_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    X = rng.normal(size=(59, 6)).astype(np.float32)
    return X, (X @ rng.normal(size=(6, 1))).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_a_checkpoint_resumed_in_a_new_process_continues_bit_for_bit(tmp_path, fuse):
    X, y = resume_data()
    program = lossgraph.compile_program(golden("hand_linear"), penalty={"W": 0.01}, fuse=fuse,
                                optimizer=Adam(0.01) if fuse != "separate" else SGD(0.01))
    straight = lossgraph.Trainer(program).fit(X, y, epochs=3, batch_size=7, random_state=5,
                                              progress=False)
    first = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=7, random_state=5,
                                           progress=False)
    first.save_checkpoint(tmp_path / "ckpt")
    script = RESUME.format(here=HERE, checkpoint=str(tmp_path / "ckpt"),
                           out=str(tmp_path / "resumed.npz"))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "99"})
    with np.load(tmp_path / "resumed.npz") as resumed:
        np.testing.assert_array_equal(resumed["losses"], straight.train_losses_)
        for name, value in straight.state.items():
            np.testing.assert_array_equal(resumed[name], value, err_msg=name)
