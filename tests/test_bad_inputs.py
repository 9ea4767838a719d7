"""The catalogue of bad inputs: each gets a LossgraphError that names the culprit, before any work.

Every case is ``Case(id, input, provoke, error, fragment)``: ``provoke(ctx)`` feeds the bad
input to lossgraph, which must raise ``error`` (a :class:`~lossgraph.errors.LossgraphError`
subclass) whose message holds ``fragment`` (the file, tensor, node, option or row at
fault). Trainers a case makes through ``ctx`` must be untouched afterwards (no step, the
program's state), except for the divergence cases, which train on purpose.

docs/reference/errors.md lists the catalogue; ``python tests/test_bad_inputs.py`` prints
that table with the messages of this run. The decisions behind the accepted inputs
(lists, DataFrames, one name for a list of names, optimizers by name) are tested at the
end.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.external_data_helper import set_external_data
from support.catalogue import Row, assert_listed, message_of, print_table
from support.linear import LINEAR, linear_data
from support.models import changed_op_model, image_scaler, read_state_model, tower

import lossgraph
from lossgraph.adapters import LoRA
from lossgraph.errors import (
    AdapterMismatchError,
    ConvergenceError,
    DTypeMismatchError,
    InvalidDataError,
    InvalidModelError,
    InvalidProgramError,
    LossgraphError,
    MissingGradientError,
    ModelChangedError,
    NoGradientError,
    RuntimeUnavailableError,
    ShapeMismatchError,
    UnknownNameError,
    UnsafeWriteError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.export import to_ort_artifacts
from lossgraph.optim import SGD, Adam, AdamW, Momentum, update_graph
from lossgraph.penalties import Penalty
from lossgraph.schedules import Cosine, Linear, OneCycle

X, Y = linear_data(205, seed=11)
GOLDEN = Path(__file__).resolve().parents[1] / "golden_models"


# -- models the cases start from -------------------------------------------------------------

def parse(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(text)


def linear(*replacements: tuple[str, str]) -> onnx.ModelProto:
    """The shared linear model, its text changed by ``(old, new)`` replacements."""
    text = LINEAR
    for old, new in replacements:
        text = text.replace(old, new)
    return parse(text)


#: The linear model as torch's default export writes it: a batch fixed at 2 rows.
FIXED_BATCH = ("float[N, 4] x) => (float[N, 1] y)", "float[2, 4] x) => (float[2, 1] y)")
#: A fixed batch of 2 scaled by a constant with a row of its own for each of the 2 rows:
#: it has no value for other rows, so the batch cannot be freed.
MASKED = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[2, 4] x) => (float[2, 1] y)
      <float[4, 1] coef = {0.1, -0.2, 0.3, 0.4}, float[2, 4] scale = {1, 2, 3, 4, 5, 6, 7, 8}> {
        m = Mul(x, scale)
        y = MatMul(m, coef)
    }"""


#: A 3-class softmax classifier (cross-entropy labels 0..2) and a binary sigmoid one.
CLASSIFIER = """
    <ir_version: 8, opset_import: ["" : 18]>
    clf (float[N, 4] x) => (float[N, 3] p)
    <float[4, 3] w = {0.1, 0, 0, 0, 0.1, 0, 0, 0, 0.1, 0.1, 0.1, 0.1}>
    { z = MatMul(x, w)
      p = Softmax <axis = 1> (z) }
"""
BINARY = """
    <ir_version: 8, opset_import: ["" : 18]>
    clf (float[N, 4] x) => (float[N, 1] p)
    <float[4, 1] w = {0.1, -0.1, 0.2, 0}>
    { z = MatMul(x, w)
      p = Sigmoid(z) }
"""


#: A Conv of two groups, and a product of an int8 weight dequantized (LoRA cases).
GROUPED_CONV = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 2, 3, 3] x) => (float[N, 2, 3, 3] y)
    <float[2, 1, 1, 1] k = {1, 2}> { y = Conv <group = 2> (x, k) }
"""
DILATED_CONV = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 1, 5, 5] x) => (float[N, 2, 5, 5] y)
    <float[2, 1, 3, 3] k = {1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9}>
    { y = Conv <dilations = [2, 2], pads = [2, 2, 2, 2]> (x, k) }
"""
QUANTIZED = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 2] y)
    <int8[4, 2] q = {1, 2, 3, 4, 5, 6, 7, 8}, float s = {0.1}, int8 z = {0}>
    { w = DequantizeLinear(q, s, z)  y = MatMul(x, w) }
"""


def with_roles(text: str) -> onnx.ModelProto:
    model = linear()
    helper.set_model_props(model, {"lossgraph.roles": text})
    return model


def zipmap_classifier() -> onnx.ModelProto:
    """What skl2onnx writes for a classifier by default: labels and a ZipMap of probabilities."""
    return parse("""
        <ir_version: 8, opset_import: ["" : 18, "ai.onnx.ml" : 3]>
        clf (float[N, 4] x) => (int64[N] label, seq(map(int64, float)) output_probability)
        <float[4, 2] coef = {1, 2, 3, 4, 5, 6, 7, 8}>
        { z = MatMul(x, coef)
          p = Softmax <axis = 1> (z)
          label = ArgMax <axis = 1, keepdims = 0> (p)
          output_probability = ai.onnx.ml.ZipMap <classlabels_int64s = [0, 1]> (p) }
    """)


def tree_ensemble() -> onnx.ModelProto:
    """A one-split regression tree, as skl2onnx converts a DecisionTreeRegressor."""
    node = helper.make_node(
        "TreeEnsembleRegressor", ["x"], ["y"], name="tree", domain="ai.onnx.ml", n_targets=1,
        nodes_featureids=[0, 0, 0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
        nodes_nodeids=[0, 1, 2], nodes_treeids=[0, 0, 0], nodes_truenodeids=[1, 0, 0],
        nodes_falsenodeids=[2, 0, 0], nodes_values=[0.5, 0.0, 0.0], target_ids=[0, 0],
        target_nodeids=[1, 2], target_treeids=[0, 0], target_weights=[1.0, 2.0])
    graph = helper.make_graph([node], "tree", [helper.make_tensor_value_info("x", 1, ["N", 4])],
                              [helper.make_tensor_value_info("y", 1, ["N", 1])])
    return helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.ml", 3)])


CUSTOM_OP = """
    <ir_version: 8, opset_import: ["" : 18, "com.example" : 1]>
    g (float[N, 4] x) => (float[N, 1] y)
    <float[4, 1] coef = {1, 2, 3, 4}>
    { h = MatMul(x, coef)
      y = com.example.Scale(h) }
"""


# -- models the fuzzer found (tests/test_fuzz.py), each reduced to a few lines -------------


def with_tensor(name: str, change: Callable[[onnx.TensorProto], object]) -> onnx.ModelProto:
    """The linear model with its initializer ``name`` changed in place by ``change``."""
    model = linear()
    change(next(t for t in model.graph.initializer if t.name == name))
    return model


def untyped_graphsurgeon_cut() -> object:
    """scikit-learn's MLP regressor cut after its first layer, imported without inferred
    shapes: the new input has no dtype."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(onnx.load(GOLDEN / "skl_mlp_regressor.onnx"))
    graph.inputs = [graph.tensors()["add_result"]]
    return graph.cleanup()


def with_graph(change: Callable[[onnx.ModelProto], object]) -> onnx.ModelProto:
    model = linear()
    change(model)
    return model


def raw_and_longer(tensor: onnx.TensorProto) -> None:
    """The tensor stored as raw data, 4 bytes longer than its shape needs."""
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    tensor.raw_data += b"\0\0\0\0"


def with_inf(tensor: onnx.TensorProto) -> None:
    """The weight's second value made infinite."""
    value = numpy_helper.to_array(tensor).copy()
    value.reshape(-1)[1] = np.inf
    tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))


def binary_with_inf() -> onnx.ModelProto:
    model = parse(BINARY)
    with_inf(model.graph.initializer[0])
    return model


def cast_to(model: onnx.ModelProto, to: int) -> None:
    """``y = Cast(y_before, to=to)`` at the end of the graph."""
    model.graph.node[-1].output[0] = "y_before"
    model.graph.node.append(helper.make_node("Cast", ["y_before"], ["y"], to=to))


#: skl2onnx's LinearRegressor, its output declared of rank 1 where it computes (N, 1).
REGRESSOR_OF_RANK_1 = """
    <ir_version: 8, opset_import: ["" : 18, "ai.onnx.ml" : 1]>
    reg (float[N, 4] x) => (float[N] y)
    { y = ai.onnx.ml.LinearRegressor <coefficients = [0.1, -0.2, 0.3, 0.0],
                                      intercepts = [0.5]> (x) }
"""
#: A Reshape to a constant 8 rows, the output declared with the batch's N rows.
FIXED_ROWS = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 1] y)
    <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, int64[2] rows = {8, 1}>
    { h = MatMul(x, coef)
      y = Reshape(h, rows) }
"""
#: Gemm's C of shape (4,) added to a (N, 3) product: onnx's checker does not look.
GEMM_BAD_BIAS = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 3] y)
    <float[3, 4] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, float[4] c = {1, 2, 3, 4}>
    { y = Gemm <transB = 1> (x, w, c) }
"""
#: A Conv reading 2 channels with a weight for 1: onnx's checker does not look.
CONV_CHANNELS = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 2, 5, 5] x) => (float[N, 1, 3, 3] y)
    <float[1, 1, 3, 3] w = {1, 2, 3, 4, 5, 6, 7, 8, 9}>
    { y = Conv(x, w) }
"""
#: An op of the user's own domain feeding a MaxPool: its output has no type onnx can infer.
UNTYPED_BY_CUSTOM_OP = """
    <ir_version: 8, opset_import: ["" : 18, "com.example" : 1]>
    g (float[N, 1, 4, 4] x) => (float[N, 1, 2, 2] y) <float[1] scale = {2}>
    { s = Mul(x, scale)
      h = com.example.Foo(s)
      y = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (h) }
"""


def name_not_utf8() -> bytes:
    """The linear model's bytes with its first node's name made of a byte that is not
    UTF-8 (one bit flipped in a copy): protobuf parses it, onnx's checker passes it."""
    model = linear()
    model.graph.node[0].name = "NODENAME"
    return model.SerializeToString().replace(b"NODENAME", b"NODE\xe2AME")


#: Rows mixed: (N, 1) + (N, 4) is (N, 4), reshaped to (4N, 1), declared (?, 1) or (N, 1).
MIXED_ROWS = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[?, 4] x) => (float[?, 1] y)
    <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, int64[2] column = {-1, 1}>
    { h = MatMul(x, coef)
      s = Add(h, x)
      y = Reshape(s, column) }
"""


def external_model(folder: Path, location: str, data_at: Path | None = None) -> Path:
    """``folder/model.onnx`` whose weight ``coef`` is stored at ``location``; the data file
    is written at ``data_at`` (None: nowhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = linear()
    tensor = next(t for t in model.graph.initializer if t.name == "coef")
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), "coef"))
    raw = tensor.raw_data
    set_external_data(tensor, location)
    tensor.ClearField("raw_data")
    if data_at is not None:
        data_at.parent.mkdir(parents=True, exist_ok=True)
        data_at.write_bytes(raw)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


# -- the context a case runs in ---------------------------------------------------------------


@dataclass
class Context:
    """What a case may use: a temporary folder, and trainers that are checked untouched."""

    tmp: Path
    trainers: list[lossgraph.Trainer] = field(default_factory=list)

    def program(self, model: onnx.ModelProto | None = None, **options: Any):
        options.setdefault("optimizer", Momentum(0.01, nesterov=True))
        return lossgraph.compile_program(model if model is not None else linear(), **options)

    def trainer(self, model: onnx.ModelProto | None = None, **options: Any) -> lossgraph.Trainer:
        trainer = lossgraph.Trainer(self.program(model, **options))
        self.trainers.append(trainer)
        return trainer

    def fit(self, X: Any = X, y: Any = Y, model: onnx.ModelProto | None = None,
            compile_options: dict | None = None, **fit_options: Any) -> lossgraph.Trainer:
        fit_options.setdefault("progress", False)
        fit_options.setdefault("batch_size", 10)
        return self.trainer(model, **(compile_options or {})).fit(X, y, **fit_options)

    def file(self, name: str, content: bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content)
        return path


@dataclass(frozen=True)
class Case:
    id: str
    input: str
    provoke: Callable[[Context], Any]
    error: type[LossgraphError]
    fragment: str
    trains: bool = False  # a divergence case: trains until the bad step, on purpose


def _lora_trainer(c: Context, alpha: float = 2.0) -> lossgraph.Trainer:
    """A trainer of rank-1 adapters on the linear model's coef (no module path)."""
    return c.trainer(adapters=LoRA(rank=1, alpha=alpha, targets=["coef"]))


def _npz(c: Context, **arrays: np.ndarray) -> Path:
    np.savez(c.tmp / "arrays.npz", **arrays)
    return c.tmp / "arrays.npz"


def _other_run(c: Context) -> Path:
    """A checkpoint_dir another fit (of another trainer) saved into."""
    lossgraph.Trainer(c.program()).fit(X, Y, batch_size=50, progress=False,
                                       checkpoint_dir=c.tmp / "run", keep_best=False)
    return c.tmp / "run"


def _changed_after_compile() -> lossgraph.TrainingProgram:
    """A program compiled from a ModelProto large enough that it reads its initial state
    from it, the model's weight changed since."""
    model = read_state_model()
    program = lossgraph.compile_program(model, loss="squared_error")
    weight = model.graph.initializer[0]
    weight.raw_data = weight.raw_data[:-4] + b"\0\0\0\0"
    return program


def _file_changed_after_compile(c: Context) -> lossgraph.TrainingProgram:
    """A program compiled from a model file large enough that it reads its initial state
    from it, the weight's last value written over in the file since."""
    from lossgraph.graphs.spans import initializer_spans

    path = c.tmp / "big.onnx"
    onnx.save(read_state_model(), path)
    program = lossgraph.compile_program(path, loss="squared_error")
    span = initializer_spans(path)["W"]
    with open(path, "r+b") as file:
        file.seek(span.offset + span.length - 4)
        file.write(b"\0\0\0\0")
    return program


def with_value(array: np.ndarray, row: int, value: float, column: int | None = None):
    copy = array.copy()
    if column is None:
        copy[row] = value
    else:
        copy[row, column] = value
    return copy


def diverge(ctx: Context, mode: str, bad_row: int = 35) -> None:
    """One good epoch, then an epoch whose row ``bad_row`` overflows the loss."""
    trainer = ctx.trainer(fuse=mode)
    trainer.fit(X, Y, epochs=1, batch_size=10, shuffle=False, progress=False)
    trainer.fit(with_value(X, bad_row, 1e20), Y, epochs=1, batch_size=10, shuffle=False,
                warm_start=True, progress=False)


def truncated(ctx: Context) -> None:
    data = linear().SerializeToString()
    lossgraph.compile_program(ctx.file("cut.onnx", data[:len(data) // 2]))


def link_out(ctx: Context) -> None:
    """External data through a link inside the folder to a file outside it."""
    path = external_model(ctx.tmp / "m", "link.bin")
    outside = ctx.file("real.bin", np.zeros(4, np.float32).tobytes())
    os.symlink(outside, ctx.tmp / "m" / "link.bin")
    lossgraph.compile_program(path)


def one_shot(ctx: Context) -> None:
    batches = ((X[i:i + 50], Y[i:i + 50]) for i in range(0, len(X), 50))
    ctx.trainer().fit(batches, epochs=2, progress=False)


class Frame:
    """A DataFrame stand-in of mixed column types (pandas gives object arrays for them)."""

    def to_numpy(self) -> np.ndarray:
        return np.array([[1.0, "a", 2.0, 3.0]] * 3, dtype=object)


CASES: list[Case] = [
    # -- model files ------------------------------------------------------------------------
    Case("file-not-onnx", "a text file given as the model",
         lambda c: lossgraph.compile_program(c.file("notes.onnx", b"my thesis, chapter 1\n")),
         InvalidModelError, "notes.onnx' is not an ONNX model"),
    Case("file-truncated", "the first half of a model file",
         truncated, InvalidModelError, "cut.onnx' is not an ONNX model, or is cut short"),
    Case("file-empty", "an empty file",
         lambda c: lossgraph.compile_program(c.file("empty.onnx", b"")),
         InvalidModelError, "empty.onnx' is empty"),
    Case("bytes-empty", "empty bytes", lambda c: lossgraph.compile_program(b""),
         InvalidModelError, "serialized model is empty"),
    Case("bytes-no-graph", "bytes that parse as a ModelProto without a graph",
         lambda c: lossgraph.compile_program(b"\x08\x0a"), InvalidModelError, "it has no graph"),
    Case("file-missing", "a path where no file is",
         lambda c: lossgraph.compile_program(c.tmp / "missing.onnx"), InvalidModelError,
         "No ONNX file at"),
    Case("file-is-folder", "a folder given as the model file",
         lambda c: lossgraph.compile_program(c.tmp), InvalidModelError, "is a folder"),
    Case("model-not-a-model", "a number given as the model", lambda c: lossgraph.compile_program(3),
         InvalidModelError, "got int"),
    Case("graphsurgeon-untyped-input", "an onnx-graphsurgeon graph cut at a tensor of unknown "
         "dtype", lambda c: lossgraph.compile_program(untyped_graphsurgeon_cut()),
         InvalidModelError, "input 'add_result' has no dtype"),
    Case("external-data-missing", "a weight in an external file that is not there",
         lambda c: lossgraph.compile_program(external_model(c.tmp / "m", "coef.bin")),
         InvalidModelError, "'coef.bin', which does not exist"),
    Case("external-data-outside", "an external data location leading out of the folder (..)",
         lambda c: lossgraph.compile_program(external_model(c.tmp / "m", "../secret.bin",
                                                    c.tmp / "secret.bin")),
         InvalidModelError, "outside the model's folder"),
    Case("external-data-absolute", "an absolute external data location",
         lambda c: lossgraph.compile_program(external_model(c.tmp / "m", str(c.tmp / "abs.bin"),
                                                    c.tmp / "abs.bin")),
         InvalidModelError, "must be a file name relative to the model's folder"),
    Case("external-data-link-out", "an external data file that links out of the folder",
         link_out, InvalidModelError, "outside the model's folder"),
    Case("external-data-not-loaded", "a ModelProto loaded without its external data",
         lambda c: lossgraph.compile_program(onnx.load(
             external_model(c.tmp / "m", "coef.bin", c.tmp / "m" / "coef.bin"),
             load_external_data=False)),
         InvalidModelError, "'coef.bin', which was not loaded"),
    # -- models ------------------------------------------------------------------------------
    Case("model-invalid", "a node reading a value nothing defines",
         lambda c: lossgraph.compile_program(linear(("MatMul(x, coef)", "MatMul(x, kofe)"))),
         InvalidModelError, "not a valid ONNX model"),
    Case("model-empty-graph", "a graph without nodes",
         lambda c: lossgraph.compile_program(parse("""<ir_version: 8, opset_import: ["" : 18]>
             g (float[N, 4] x) => (float[N, 4] x) { }""")),
         UnsupportedModelError, "has no nodes"),
    Case("model-no-initializers", "weights kept in Constant nodes",
         lambda c: lossgraph.compile_program(parse("""<ir_version: 8, opset_import: ["" : 18]>
             g (float[N, 4] x) => (float[N, 1] y) {
                 c = Constant <value = float[4, 1] {1, 2, 3, 4}> ()
                 y = MatMul(x, c) }""")),
         UnsupportedModelError, "Constant nodes ('c')"),
    Case("model-no-trainable-weights", "only integer initializers",
         lambda c: lossgraph.compile_program(parse("""<ir_version: 8, opset_import: ["" : 18]>
             g (float[N, 4] x) => (float[N, 4] y) <int64[1] axis = {1}> {
                 y = Relu(x) }""")),
         UnsupportedModelError, "'axis' (int64[1])"),
    Case("model-fixed-batch-unproven", "fixed_batch='generalize' on a constant with a row "
         "per exported row", lambda c: c.program(parse(MASKED), fixed_batch="generalize"),
         UnsupportedModelError, "batch is fixed at 2 rows, and lossgraph cannot free it"),
    Case("model-fixed-batch-and-free", "inputs float[2, 4] x and float[N, 4] z",
         lambda c: c.program(linear(FIXED_BATCH, ("float[2, 4] x)", "float[2, 4] x, "
                                                  "float[N, 4] z)"))),
         UnsupportedModelError, "Input 'x' has a fixed batch dimension of 2, but input 'z''s "
         "is free"),
    Case("model-fixed-batch-output-not-rows", "input float[2, 4], output float[1, 1]",
         lambda c: c.program(linear(FIXED_BATCH, ("(float[2, 1] y)", "(float[1, 1] y)"))),
         UnsupportedModelError, "Output 'y' has shape (1, 1), but the inputs' batch is fixed "
         "at 2 rows"),
    Case("fixed-batch-unknown", "fixed_batch='never'",
         lambda c: c.program(fixed_batch="never"), UnsupportedOptionError,
         "fixed_batch='never'"),
    Case("model-scalar-input", "a data input without a batch axis",
         lambda c: lossgraph.compile_program(linear(("float[N, 4] x)", "float[N, 4] x, float t)"))),
         UnsupportedModelError, "Input 't' is a scalar"),
    Case("model-zipmap", "add_loss_output on a skl2onnx classifier with its default ZipMap",
         lambda c: lossgraph.add_loss_output(zipmap_classifier(), "multiclass_log_loss"),
         UnsupportedModelError, "lossgraph.passes.ZipMapToTensor()"),
    Case("loss-squared-error-on-probabilities", "loss='squared_error' on a softmax output",
         lambda c: lossgraph.compile_program(parse(CLASSIFIER), loss="squared_error"),
         UnsupportedOptionError, "Use loss='multiclass_log_loss'"),
    Case("loss-log-loss-on-values", "loss='binary_log_loss' on a regression's MatMul output",
         lambda c: lossgraph.compile_program(linear(), loss="binary_log_loss"),
         UnsupportedOptionError, "for a regression loss='squared_error'"),
    Case("loss-logits-on-probabilities", "loss='logistic' on a sigmoid output",
         lambda c: lossgraph.compile_program(parse(BINARY), loss="logistic"),
         UnsupportedOptionError, "Use loss='binary_log_loss'"),
    Case("model-tree-ensemble", "an ai.onnx.ml TreeEnsembleRegressor",
         lambda c: lossgraph.compile_program(tree_ensemble()), UnsupportedModelError,
         "Node 'tree' is an ai.onnx.ml TreeEnsembleRegressor"),
    Case("model-opset-too-old", "ai.onnx opset 7 with ImageScaler, an op onnx removed",
         lambda c: lossgraph.compile_program(image_scaler()), UnsupportedModelError,
         "opset 13 has no ImageScaler"),
    Case("model-opset-meaning-changed", "AveragePool with ceil_mode=1 at opset 22, for the "
                                        "default target (opset 21)",
         lambda c: lossgraph.compile_program(changed_op_model("pool")), UnsupportedModelError,
         "opset 22 changed it: with ceil_mode=1"),
    Case("model-opset-new-op", "Swish (an op of opset 24) for the default target",
         lambda c: lossgraph.compile_program(changed_op_model("swish")), UnsupportedModelError,
         "Swish is an op of opset 24, which opset 21 does not have"),
    Case("model-opset-new-type", "a Cast to float4e2m1 (a type of opset 23) for the default "
                                 "target",
         lambda c: lossgraph.compile_program(changed_op_model("fp4")), UnsupportedModelError,
         "is tensor(float4e2m1), which opset 21's Cast does not take"),
    Case("model-opset-new-attribute", "SpaceToDepth with mode='CRD' (an attribute of opset 28) "
                                      "for the default target",
         lambda c: lossgraph.compile_program(changed_op_model("crd")), UnsupportedModelError,
         "it sets mode='CRD'"),
    Case("model-opset-too-new", "ai.onnx opset 29, newer than any target",
         lambda c: lossgraph.compile_program(linear(('"" : 18', '"" : 29')),
                                             target="onnxruntime-latest"),
         UnsupportedModelError, "opset 29"),
    Case("model-op-without-rule", "an op of the user's own domain between a weight and the loss",
         lambda c: lossgraph.compile_program(parse(CUSTOM_OP)), MissingGradientError,
         "op 'Scale'"),
    Case("model-roles-not-json", "a lossgraph.roles metadata entry that is not JSON",
         lambda c: lossgraph.compile_program(with_roles("{loss: loss}")), InvalidModelError,
         "'lossgraph.roles' is not JSON"),
    Case("model-roles-not-an-object", "a lossgraph.roles entry that is a JSON list",
         lambda c: lossgraph.compile_program(with_roles('["loss"]')), InvalidModelError,
         "must be a JSON object"),
    Case("model-roles-unknown-tensor", "lossgraph.roles naming a loss the model lacks",
         lambda c: lossgraph.compile_program(with_roles(
             '{"loss": "cost", "label": "x", "prediction": "y"}'), loss=None),
         InvalidModelError, "names 'cost' as the loss"),
    Case("model-loss-none-without-loss", "loss=None for an inference model",
         lambda c: lossgraph.compile_program(linear(), loss=None), UnsupportedModelError,
         "records no loss output"),
    Case("model-has-loss-already", "a model with a loss, compiled with a loss name",
         lambda c: lossgraph.compile_program(lossgraph.add_loss_output(linear())),
         UnsupportedModelError, "pass loss=None"),
    Case("model-mixed-float-weights", "float and double weights in one model",
         lambda c: lossgraph.compile_program(parse("""<ir_version: 8, opset_import: ["" : 18]>
             g (float[N, 2] x) => (float[N, 2] y) <float[2] a = {1, 2}, double[2] d = {3, 4}> {
                 e = Cast <to = 1> (d)
                 t = Mul(x, a)
                 y = Add(t, e) }""")),
         UnsupportedModelError, "'a' is float32, 'd' is float64"),
    Case("model-cross-entropy-one-column", "cross_entropy on a one-column output",
         lambda c: lossgraph.compile_program(parse(BINARY), loss="multiclass_log_loss"),
         ShapeMismatchError, "at least 2 classes"),
    # -- compile options ---------------------------------------------------------------------
    Case("loss-unknown", "loss='squred_error'",
         lambda c: c.program(loss="squred_error"), UnsupportedOptionError,
         "Did you mean 'squared_error'"),
    Case("loss-wrong-type", "loss=3", lambda c: c.program(loss=3), UnsupportedOptionError,
         "loss=3 must be a loss name"),
    Case("loss-options-unknown-key", "loss_options={'dleta': 2.0} for huber",
         lambda c: c.program(loss="huber", loss_options={"dleta": 2.0}),
         UnsupportedOptionError, "no key 'dleta'"),
    Case("loss-options-compile-key", "loss_options={'score_name': 'l1'}",
         lambda c: c.program(loss_options={"score_name": "l1"}), UnsupportedOptionError,
         "pass it to compile itself as loss="),
    Case("loss-options-not-a-dict", "loss_options=['reduction', 'sum']",
         lambda c: c.program(loss_options=["reduction", "sum"]), UnsupportedOptionError,
         "loss_options=['reduction', 'sum'] must be a dict"),
    Case("loss-options-bad-value", "loss_options={'delta': 'wide'} for huber",
         lambda c: c.program(loss="huber", loss_options={"delta": "wide"}),
         UnsupportedOptionError, "delta='wide'"),
    Case("loss-class-weight-negative", "loss_options={'class_weight': [1, -1, 1]}",
         lambda c: c.program(parse(CLASSIFIER), loss_options={"class_weight": [1, -1, 1]}),
         UnsupportedOptionError, "class_weight=[1, -1, 1] of loss='multiclass_log_loss' must"),
    Case("loss-class-weight-wrong-length", "two class weights for three classes",
         lambda c: c.program(parse(CLASSIFIER), loss_options={"class_weight": [1, 2]}),
         UnsupportedOptionError, "class_weight has 2 weights but output 'p' has 3 classes"),
    Case("loss-class-weight-balanced", "class_weight='balanced' (compile sees no labels)",
         lambda c: c.program(parse(CLASSIFIER), loss_options={"class_weight": "balanced"}),
         UnsupportedOptionError, "lossgraph.balanced_class_weight(y_train)"),
    Case("loss-label-smoothing-one", "loss_options={'label_smoothing': 1.0}",
         lambda c: c.program(parse(CLASSIFIER), loss_options={"label_smoothing": 1.0}),
         UnsupportedOptionError, "label_smoothing=1.0 of loss='multiclass_log_loss' must be a "
                                 "number in [0, 1)"),
    Case("loss-pos-weight-negative", "loss_options={'pos_weight': -2} for a sigmoid output",
         lambda c: c.program(parse(BINARY), loss_options={"pos_weight": -2}),
         UnsupportedOptionError, "pos_weight=-2 of loss='binary_log_loss' must be a finite"),
    Case("balanced-class-weight-missing-class", "balanced_class_weight([0, 2, 2]): no class 1",
         lambda c: lossgraph.balanced_class_weight([0, 2, 2]), InvalidDataError,
         "y holds no label of class 1"),
    Case("loss-options-without-loss", "loss_options with loss=None",
         lambda c: c.program(lossgraph.add_loss_output(linear()), loss=None,
                             loss_options={"reduction": "sum"}),
         UnsupportedOptionError, "no effect with loss=None"),
    Case("penalty-not-a-dict", "penalty=0.1", lambda c: c.program(penalty=0.1),
         UnsupportedOptionError, "penalty=0.1 must be a dict by weight name"),
    Case("penalty-bad-key", "penalty={'coef': {'l3': 1}}",
         lambda c: c.program(penalty={"coef": {"l3": 1}}), UnsupportedOptionError,
         "unknown key 'l3'"),
    Case("penalty-negative", "penalty={'coef': -0.1}",
         lambda c: c.program(penalty={"coef": -0.1}), UnsupportedOptionError, "l2=-0.1"),
    Case("penalty-a-string", "penalty={'coef': '0.1'}",
         lambda c: c.program(penalty={"coef": "0.1"}), UnsupportedOptionError,
         "Penalty coefficient l2='0.1' on 'coef' must be a finite number >= 0"),
    Case("penalty-unknown-weight", "penalty={'coeff': 0.1}",
         lambda c: c.program(penalty={"coeff": 0.1}), UnknownNameError, "Did you mean 'coef'"),
    Case("penalty-frozen-weight", "a penalty on a weight that is not trained",
         lambda c: c.program(weights=["intercept"], penalty={"coef": 0.1}),
         UnsupportedOptionError, "penalty names 'coef', which is not trained"),
    Case("optimizer-unknown-name", "optimizer='adamm'",
         lambda c: c.program(optimizer="adamm"), UnsupportedOptionError, "Did you mean 'Adam'"),
    Case("optimizer-class", "optimizer=Adam (the class)",
         lambda c: c.program(optimizer=Adam), UnsupportedOptionError,
         "optimizer=Adam is a class"),
    Case("optimizer-dict-unknown-option", "optimizer={'type': 'Adam', 'lr': 0.1}",
         lambda c: c.program(optimizer={"type": "Adam", "lr": 0.1}), UnsupportedOptionError,
         "Adam has no option 'lr'"),
    Case("optimizer-wrong-type", "optimizer=0.01", lambda c: c.program(optimizer=0.01),
         UnsupportedOptionError, "optimizer=0.01 is not an optimizer"),
    Case("optimizer-bad-hyper-parameter", "SGD(learning_rate=-1)",
         lambda c: c.program(optimizer=SGD(-1)), UnsupportedOptionError,
         "learning_rate=-1"),
    Case("fuse-unknown", "fuse='scan'", lambda c: c.program(fuse="scan"),
         UnsupportedOptionError, "fuse='scan'"),
    Case("fuse-wrong-type", "fuse=1", lambda c: c.program(fuse=1), UnsupportedOptionError,
         "fuse=1 is not accepted"),
    Case("target-unknown", "target='onnxruntime-2'",
         lambda c: c.program(target="onnxruntime-2"), UnsupportedOptionError,
         "Unknown target 'onnxruntime-2'"),
    Case("target-wrong-type", "target=21", lambda c: c.program(target=21),
         UnsupportedOptionError, "target=21 must be a name"),
    Case("backend-unknown", "backend='torch'", lambda c: c.program(backend="torch"),
         UnsupportedOptionError, "backend='torch' is not accepted"),
    Case("no-weight-can-learn", "every weight reaches the loss through Round",
         lambda c: c.program(linear(("y = Add(h, intercept)",
                                     "r = Round(h)\n s = Sign(intercept)\n y = Add(r, s)"))),
         NoGradientError, "No weight can learn: 'coef', 'intercept' reach the loss"),
    Case("weights-empty", "weights=[]", lambda c: c.program(weights=[]),
         UnsupportedOptionError,
         "weights=[] names no weight. Leave weights=None for every trainable initializer, or "
         "name some. The trainable weights: 'coef', 'intercept'."),
    Case("gradient-weights-empty", "lossgraph.gradient(weights=[])",
         lambda c: lossgraph.gradient(lossgraph.add_loss_output(linear()), weights=[]),
         UnsupportedOptionError, "The trainable weights: 'coef', 'intercept'."),
    Case("gradient-outputs-empty", "lossgraph.gradient(outputs=[])",
         lambda c: lossgraph.gradient(linear(), outputs=[]),
         UnsupportedOptionError, "outputs=[] names no output"),
    Case("weights-duplicate", "weights=['coef', 'coef']",
         lambda c: c.program(weights=["coef", "coef"]), UnsupportedOptionError,
         "names 'coef' more than once"),
    Case("weights-misspelt-name", "weights='cof' (one name, misspelt)",
         lambda c: c.program(weights="cof"), UnknownNameError, "'cof' is not an initializer"),
    Case("weights-not-a-name", "weights=[0]", lambda c: c.program(weights=[0]),
         UnsupportedOptionError, "weights holds 0 (int)"),
    Case("weights-an-input", "weights=['x'] (a data input)",
         lambda c: c.program(weights=["x"]), UnknownNameError, "'x' is not an initializer"),
    Case("untie-misspelt-name", "untie=['cof'] (misspelt)",
         lambda c: c.program(untie=["cof"]), UnknownNameError,
         "untie names 'cof', which is not an initializer of the model. Did you mean 'coef'?"),
    Case("untie-one-reader", "untie='coef', an initializer one layer reads",
         lambda c: c.program(untie="coef"), UnsupportedOptionError,
         "untie names 'coef', which one layer reads: there is nothing to untie"),
    Case("untie-not-a-name", "untie=3", lambda c: c.program(untie=3), UnsupportedOptionError,
         "untie=3 must be 'auto'"),
    *[Case(f"accumulation-steps-{label}", f"compile_program(accumulation_steps={value!r})",
           lambda c, v=value: c.program(accumulation_steps=v), UnsupportedOptionError,
           f"accumulation_steps={value!r}")
      for label, value in [("zero", 0), ("float", 2.5), ("bool", True)]],
    Case("accumulation-own-loss", "accumulation_steps=4 with loss=None (the model's own loss)",
         lambda c: c.program(lossgraph.add_loss_output(linear(), "squared_error"), loss=None,
                             accumulation_steps=4), UnsupportedOptionError,
         "accumulation_steps=4 needs lossgraph to add the loss"),
    *[Case(f"max-grad-norm-{label}", f"max_grad_norm={value!r}",
           lambda c, v=value: c.program(max_grad_norm=v), UnsupportedOptionError,
           f"max_grad_norm={value!r} must be")
      for label, value in [("zero", 0), ("negative", -1.0), ("nan", float("nan")),
                           ("string", "1.0"), ("bool", True)]],
    *[Case(f"ema-decay-{label}", f"ema_decay={value!r}",
           lambda c, v=value: c.program(ema_decay=v), UnsupportedOptionError,
           f"ema_decay={value!r} must")
      for label, value in [("one", 1.0), ("negative", -0.1), ("infinite", float("inf")),
                           ("string", "0.99")]],
    Case("ema-without-average", "predict(X, ema=True), compiled without ema_decay",
         lambda c: c.trainer().predict(X, ema=True), UnsupportedOptionError,
         "compile with ema_decay=..."),
    Case("ema-not-bool", "evaluate(X, y, ema='yes')",
         lambda c: c.trainer(ema_decay=0.9).evaluate(X, Y, ema="yes"), UnsupportedOptionError,
         "ema='yes' must be True or False"),
    Case("ema-export-of-a-model", "to_inference_model(model, ema=True)",
         lambda c: lossgraph.export.to_inference_model(linear(), ema=True),
         UnsupportedOptionError, "pass a Trainer, a TrainingProgram"),
    Case("ema-export-with-state", "to_inference_model(trainer, state, ema=True)",
         lambda c: lossgraph.export.to_inference_model(
             (t := c.trainer(ema_decay=0.9)), t.state, ema=True),
         UnsupportedOptionError, "state= would override them"),
    Case("ema-in-ort-artifacts", "to_ort_artifacts(model, folder, ema_decay=0.99)",
         lambda c: lossgraph.export.to_ort_artifacts(linear(), c.tmp / "a", ema_decay=0.99),
         UnsupportedOptionError, "cannot keep an EMA of the weights"),
    *[Case(f"recompute-{label}", f"compile_program(recompute={value!r})",
           lambda c, v=value: c.program(recompute=v), UnsupportedOptionError,
           f"recompute={value!r}")
      for label, value in [("not-a-choice", "all"), ("empty", []), ("twice", ["a", "a"]),
                           ("not-a-name", [3]), ("budget-above-one", 1.5),
                           ("budget-zero", 0.0)]],
    Case("recompute-budget-out-of-reach", "recompute=0.05 on a tower of two layers",
         lambda c: lossgraph.compile_program(tower(), loss="squared_error", recompute=0.05),
         UnsupportedOptionError, "with every segment but the last recomputed the backward "
         "still holds 65% of them here"),
    Case("recompute-unknown-tensor", "recompute=['nowhere'] (no forward value)",
         lambda c: c.program(recompute=["nowhere"]), UnknownNameError,
         "recompute= names 'nowhere', which is not a value the forward computes"),
    # -- LoRA adapters -------------------------------------------------------------------------
    Case("adapters-not-lora", "compile_program(adapters={'rank': 8})",
         lambda c: c.program(adapters={"rank": 8}), UnsupportedOptionError,
         "must be a lossgraph.LoRA(...)"),
    *[Case(f"lora-{label}", f"LoRA({option}={value!r})",
           lambda c, o=option, v=value: LoRA(**{o: v}), UnsupportedOptionError,
           f"LoRA: {option}={value!r}")
      for label, option, value in [("rank-zero", "rank", 0), ("alpha-zero", "alpha", 0),
                                   ("dropout-one", "dropout", 1.0),
                                   ("init-unknown", "init", "xavier"),
                                   ("ops-unknown", "ops", "Einsum"),
                                   ("targets-not-names", "targets", 3),
                                   ("targets-bad-pattern", "targets", "(")]],
    Case("lora-target-not-a-product", "LoRA(targets=['intercept']) (an Add's operand)",
         lambda c: c.program(adapters=LoRA(rank=1, targets=["intercept"])),
         UnsupportedModelError, "'intercept', which is not the weight of a product (read by Add"),
    Case("lora-rank-too-large", "LoRA(rank=2) on a [4, 1] weight",
         lambda c: c.program(adapters=LoRA(rank=2)), UnsupportedOptionError,
         "rank=2 is larger than the smaller side (1) of 'coef'"),
    Case("lora-targets-match-nothing", "LoRA(targets=['query']) on a model without it",
         lambda c: c.program(adapters=LoRA(rank=1, targets=["query"])), UnknownNameError,
         "matches no weight of a product"),
    Case("lora-grouped-conv", "LoRA on a Conv with group=2",
         lambda c: lossgraph.add_lora(parse(GROUPED_CONV), targets=["k"], rank=1),
         UnsupportedModelError, "group=2"),
    Case("lora-dilated-conv", "LoRA on a 3x3 Conv with dilations=[2, 2]",
         lambda c: lossgraph.add_lora(parse(DILATED_CONV), targets=["k"], rank=1),
         UnsupportedModelError, "dilations=[2, 2]: PEFT's conv LoRA"),
    Case("lora-merge-quantized-base", "to_inference_model(merge=True), a DequantizeLinear base",
         lambda c: c.trainer(parse(QUANTIZED), adapters=LoRA(rank=1)).to_inference_model(
             merge=True), UnsupportedOptionError, "whose base 'q' is quantized"),
    # -- adapter files (lossgraph.export.adapters) ---------------------------------------------
    Case("adapters-export-without-adapters", "export_adapters(trainer of a program without)",
         lambda c: lossgraph.export_adapters(c.trainer(), c.tmp / "a.npz"),
         UnsupportedOptionError, "The program has no adapters"),
    Case("adapters-export-unknown-suffix", "export_adapters(trainer, 'adapters.pt')",
         lambda c: lossgraph.export_adapters(_lora_trainer(c), c.tmp / "adapters.pt"),
         UnsupportedOptionError, "Cannot tell the adapter format"),
    Case("adapters-export-unknown-format", "export_adapters(..., format='bin')",
         lambda c: lossgraph.export_adapters(_lora_trainer(c), c.tmp / "a", format="bin"),
         UnsupportedOptionError, "format='.bin' is not accepted"),
    Case("adapters-peft-config-other-name", "peft_config=True to 'lora.safetensors'",
         lambda c: lossgraph.export_adapters(_lora_trainer(c), c.tmp / "lora.safetensors",
                                             peft_config=True),
         UnsupportedOptionError, "reads only a folder's adapter_model.safetensors"),
    Case("adapters-peft-config-no-module", "peft_config=True, an adapter of no module path",
         lambda c: lossgraph.export_adapters(_lora_trainer(c), c.tmp /
                                             "adapter_model.safetensors", peft_config=True),
         UnsupportedOptionError, "the adapter on 'coef' has no torch module path"),
    Case("adapters-export-over-users-file", "export_adapters over a file lossgraph did not write",
         lambda c: lossgraph.export_adapters(_lora_trainer(c), c.file("a.npz", b"mine")),
         UnsafeWriteError, "was not written by lossgraph"),
    Case("adapters-load-missing-file", "load_adapters(trainer, 'none.npz')",
         lambda c: lossgraph.load_adapters(_lora_trainer(c), c.tmp / "none.npz"),
         InvalidProgramError, "There is no adapter file"),
    Case("adapters-load-damaged-safetensors", "a .safetensors file that is not one",
         lambda c: lossgraph.load_adapters(_lora_trainer(c), c.file("a.safetensors", b"x")),
         InvalidProgramError, "is not a safetensors file"),
    Case("adapters-load-into-a-model", "load_adapters(model, path)",
         lambda c: lossgraph.load_adapters(linear(), c.tmp / "a.npz"),
         UnsupportedOptionError, "Cannot load adapters into a ModelProto"),
    Case("adapters-load-other-alpha", "a file of LoRA(alpha=2) into a LoRA(alpha=4) program",
         lambda c: lossgraph.load_adapters(_lora_trainer(c, alpha=4.0), lossgraph.export_adapters(
             _lora_trainer(c), c.tmp / "a.npz")),
         AdapterMismatchError, "has alpha 2.0 in the file, 4.0 here"),
    Case("adapters-load-other-tensors", "an .npz of other tensors",
         lambda c: lossgraph.load_adapters(_lora_trainer(c), _npz(c, other=np.zeros(1))),
         AdapterMismatchError, "has no tensor 'coef.lora_A'"),
    # -- fit options -------------------------------------------------------------------------
    Case("fit-accumulation-steps-zero", "fit(accumulation_steps=0)",
         lambda c: c.fit(accumulation_steps=0, compile_options={"accumulation_steps": 2}),
         UnsupportedOptionError, "accumulation_steps=0 must be >= 1"),
    Case("fit-accumulation-not-compiled", "fit(accumulation_steps=4), compiled without",
         lambda c: c.fit(accumulation_steps=4), UnsupportedOptionError,
         "compile it with accumulation_steps"),
    *[Case(f"batch-size-{label}", f"batch_size={value!r}",
           lambda c, v=value: c.fit(batch_size=v), UnsupportedOptionError,
           f"batch_size={value!r}")
      for label, value in [("zero", 0), ("negative", -5), ("float", 2.5), ("string", "10"),
                           ("bool", True)]],
    *[Case(f"epochs-{label}", f"epochs={value!r}",
           lambda c, v=value: c.fit(epochs=v), UnsupportedOptionError, f"epochs={value!r}")
      for label, value in [("negative", -1), ("float", 1.5), ("string", "2"), ("bool", True)]],
    *[Case(f"random-state-{label}", f"random_state={value!r}",
           lambda c, v=value: c.fit(random_state=v), UnsupportedOptionError,
           f"random_state={value!r}")
      for label, value in [("negative", -1), ("float", 0.5), ("string", "seed")]],
    Case("shuffle-not-bool", "shuffle='no'", lambda c: c.fit(shuffle="no"),
         UnsupportedOptionError, "shuffle='no' must be True or False"),
    Case("callback-not-callable", "callbacks=[print, 1]",
         lambda c: c.fit(callbacks=[print, 1]), UnsupportedOptionError,
         "callbacks[1]=1 is not callable"),
    Case("callbacks-not-a-list", "callbacks=3", lambda c: c.fit(callbacks=3),
         UnsupportedOptionError, "callbacks=3 must be a list"),
    *[Case(f"max-steps-{label}", f"max_steps={value!r}",
           lambda c, v=value: c.fit(max_steps=v), UnsupportedOptionError, f"max_steps={value!r}")
      for label, value in [("negative", -1), ("float", 2.5)]],
    Case("max-steps-one-shot-iterator", "max_steps=20 over a one-shot iterator of batches",
         lambda c: c.fit(iter([(X[:10], Y[:10])]), None, max_steps=20), InvalidDataError,
         "cannot be replayed for max_steps=20 over epochs"),
    Case("checkpoint-every-zero", "checkpoint_every=0",
         lambda c: c.fit(checkpoint_dir=c.tmp / "ck", checkpoint_every=0, keep_best=False),
         UnsupportedOptionError, "checkpoint_every=0 must be >= 1"),
    Case("keep-last-zero", "keep_last=0",
         lambda c: c.fit(checkpoint_dir=c.tmp / "ck", keep_last=0, keep_best=False),
         UnsupportedOptionError, "keep_last=0 must be >= 1"),
    Case("keep-best-not-bool", "keep_best='yes'",
         lambda c: c.fit(checkpoint_dir=c.tmp / "ck", keep_best="yes"),
         UnsupportedOptionError, "keep_best='yes' must be True or False"),
    Case("keep-best-without-validation", "keep_best=True (monitor 'val_loss') without "
         "validation_data", lambda c: c.fit(checkpoint_dir=c.tmp / "ck"),
         UnsupportedOptionError, "monitor='val_loss' is a validation value, but fit has no "
         "validation_data"),
    Case("monitor-unknown", "monitor='val_los' (misspelt)",
         lambda c: c.fit(checkpoint_dir=c.tmp / "ck", monitor="val_los",
                         validation_data=(X, Y)), UnknownNameError,
         "monitor='val_los': the epoch logs hold no 'validation_los', only 'loss', "
         "'validation_loss'. Did you mean 'validation_loss'?"),
    Case("monitor-empty", "monitor=''", lambda c: c.fit(checkpoint_dir=c.tmp / "ck", monitor=""),
         UnsupportedOptionError, "monitor='' must name a value of the epoch logs"),
    Case("checkpoint-options-without-folder", "keep_last=5 without checkpoint_dir",
         lambda c: c.fit(keep_last=5), UnsupportedOptionError,
         "keep_last=5 without checkpoint_dir"),
    Case("checkpoint-dir-not-a-path", "checkpoint_dir=3",
         lambda c: c.fit(checkpoint_dir=3), UnsupportedOptionError,
         "checkpoint_dir=3 must be a path"),
    Case("checkpoint-dir-a-file", "checkpoint_dir naming a file",
         lambda c: c.fit(checkpoint_dir=c.file("ck", b"x"), keep_best=False), UnsafeWriteError,
         "is not a folder"),
    Case("checkpoint-dir-of-another-run", "a checkpoint_dir holding a later run's checkpoints",
         lambda c: c.fit(checkpoint_dir=_other_run(c), keep_best=False), UnsafeWriteError,
         "past step 0 this fit starts from: another run's checkpoints"),
    Case("csv-logger-unknown-per", "CSVLogger(path, per='batch')",
         lambda c: lossgraph.CSVLogger(c.tmp / "log.csv", per="batch"),
         UnsupportedOptionError, "per='batch'"),
    Case("csv-logger-over-a-users-file", "CSVLogger over a CSV file lossgraph did not write",
         lambda c: lossgraph.CSVLogger(c.file("mine.csv", b"a,b\n1,2\n")), UnsafeWriteError,
         "exists and was not written by lossgraph"),
    Case("trainer-of-a-model", "Trainer(model) instead of Trainer(program)",
         lambda c: lossgraph.Trainer(linear()), UnsupportedOptionError,
         "Trainer(lossgraph.compile_program(model))"),
    Case("keep-previous-state-not-a-flag", "Trainer(program, keep_previous_state='no')",
         lambda c: lossgraph.Trainer(c.program(), keep_previous_state="no"),
         UnsupportedOptionError, "keep_previous_state='no' must be True or False"),
    Case("in-place-and-keep-previous-state", "Trainer(program, in_place=True, "
         "keep_previous_state=True)",
         lambda c: lossgraph.Trainer(c.program(), in_place=True, keep_previous_state=True),
         UnsupportedOptionError, "no state before the last step can be kept"),
    Case("model-file-changed-after-compile", "Trainer(program) of a 64 MiB model file "
         "written into after compile_program",
         lambda c: lossgraph.Trainer(_file_changed_after_compile(c)), ModelChangedError,
         "big.onnx' this program was compiled from changed after compile: its "
         "initializer 'W' is not the value compiled"),
    Case("model-changed-after-compile", "Trainer(program) of a 64 MiB ModelProto "
         "changed after compile_program",
         lambda c: lossgraph.Trainer(_changed_after_compile()), ModelChangedError,
         "The model this program was compiled from changed after compile: its initializer "
         "'W' is not the value compiled"),
    Case("providers-unknown", "providers=['NoSuchExecutionProvider']",
         lambda c: lossgraph.Trainer(c.program(), providers=["NoSuchExecutionProvider"]),
         UnsupportedOptionError, "'NoSuchExecutionProvider', which this onnxruntime does not"),
    Case("session-setting-unknown", "Trainer(program, session_options={'intra_op_threads': 1})",
         lambda c: lossgraph.Trainer(c.program(), session_options={"intra_op_threads": 1}),
         UnsupportedOptionError, "SessionOptions has no 'intra_op_threads'"),
    Case("session-options-not-options", "Trainer(program, session_options=4)",
         lambda c: lossgraph.Trainer(c.program(), session_options=4),
         UnsupportedOptionError, "session_options=4 must be a dict of settings"),
    # -- data --------------------------------------------------------------------------------
    Case("x-beyond-float32", "float64 X holding 1e39 (beyond float32) for a float32 model",
         lambda c: c.fit(with_value(X.astype(np.float64), 7, 1e39, column=2)), InvalidDataError,
         "X holds 1e+39 at row 7, column 2, beyond the range of float32 (largest "
         "3.4028235e+38): input 'x' of the model is float32 of shape (N, 4)"),
    Case("y-beyond-float32", "float64 y holding -1e300 for a float32 model",
         lambda c: c.fit(y=with_value(Y.astype(np.float64), 12, -1e300)), InvalidDataError,
         "y holds -1e+300 at row 12, beyond the range of float32"),
    Case("validation-x-beyond-float32", "validation_data X beyond float32",
         lambda c: c.fit(validation_data=(with_value(X.astype(np.float64), 0, 4e38, 0), Y)),
         InvalidDataError, "validation_data X holds 4e+38 at row 0, column 0, beyond"),
    Case("x-list-beyond-float32", "a list of rows holding 1e39",
         lambda c: c.fit([[1.0, 2.0, 3.0, 1e39]], [1.0]), InvalidDataError,
         "X holds 1e+39 at row 0, column 3, beyond the range of float32"),
    Case("x-complex", "complex X", lambda c: c.fit(X.astype(np.complex128)),
         DTypeMismatchError, "X holds complex128 values; input 'x' of the model is float32"),
    Case("x-wrong-width", "X with 5 features for a 4-feature model",
         lambda c: c.fit(np.ones((len(X), 5), np.float32)), ShapeMismatchError,
         "X has shape (205, 5) but input 'x' of the model is float32 of shape (N, 4)"),
    Case("x-one-dimensional", "a 1-D X", lambda c: c.fit(X[:, 0].copy()), ShapeMismatchError,
         "X has shape (205,)"),
    Case("x-strings", "X of strings", lambda c: c.fit(np.full((len(X), 4), "a")),
         DTypeMismatchError, "X holds <U1 values, not numbers"),
    Case("x-mixed-frame", "a DataFrame with a text column", lambda c: c.fit(Frame(), Y[:3]),
         DTypeMismatchError, "X holds object values"),
    Case("x-ragged-list", "a list of rows of different lengths",
         lambda c: c.fit([[1.0, 2.0, 3.0, 4.0], [1.0]], [1.0, 2.0]), InvalidDataError,
         "rows differ in length"),
    Case("y-wrong-shape", "y of shape (N, 2) for an (N, 1) output",
         lambda c: c.fit(y=np.ones((len(X), 2), np.float32)), ShapeMismatchError,
         "y has shape (205, 2)"),
    Case("y-wrong-rank-named-dims", "y of rank 3 for an output declared float[batch, K]",
         lambda c: c.fit(y=np.ones((len(X), 1, 1), np.float32),
                         model=linear(("float[N, 1] y", "float[batch, K] y"))),
         ShapeMismatchError, "input 'label' of the model is float32 of shape (batch, K)"),
    Case("rows-differ", "205 rows of X, 204 labels", lambda c: c.fit(y=Y[:-1]),
         ShapeMismatchError, "different numbers of rows: {'x': 205, 'label': 204}"),
    Case("data-empty", "X and y without rows", lambda c: c.fit(X[:0], Y[:0]),
         InvalidDataError, "X has no rows"),
    Case("data-empty-list", "X=[]", lambda c: c.fit([], []), InvalidDataError,
         "X has no rows"),
    Case("y-missing", "fit(X) without labels", lambda c: c.fit(y=None), InvalidDataError,
         "y is missing"),
    Case("x-nan", "NaN in X (row 37)", lambda c: c.fit(with_value(X, 37, np.nan, 2)),
         InvalidDataError, "X holds nan at row 37, column 2"),
    Case("x-inf-last-partial-batch", "inf in the last, partial batch (row 204 of 205)",
         lambda c: c.fit(with_value(X, 204, np.inf, 0), batch_size=10, shuffle=False),
         InvalidDataError, "X holds inf at row 204"),
    Case("y-nan-shuffled", "NaN in y with shuffling",
         lambda c: c.fit(y=with_value(Y, 3, np.nan), shuffle=True, random_state=0),
         InvalidDataError, "y holds nan at row 3"),
    Case("sample-weight-nan", "NaN sample weight",
         lambda c: c.fit(sample_weight=with_value(np.ones(len(X), np.float32), 9, np.nan),
                         compile_options={"loss_options": {"weight_name": "w"}}),
         InvalidDataError, "sample_weight holds nan at row 9"),
    Case("sample-weight-negative", "a negative sample weight",
         lambda c: c.fit(sample_weight=with_value(np.ones(len(X), np.float32), 5, -1.0),
                         compile_options={"loss_options": {"weight_name": "w"}}),
         InvalidDataError, "sample_weight is negative at row 5"),
    Case("sample-weight-all-zero", "sample weights all zero",
         lambda c: c.fit(sample_weight=np.zeros(len(X), np.float32),
                         compile_options={"loss_options": {"weight_name": "w"}}),
         InvalidDataError, "sample_weight is all zero"),
    Case("sample-weights-zero-batch", "a batch whose sample weights are all zero (0/0 mean)",
         lambda c: c.fit(sample_weight=with_value(np.ones(len(X), np.float32), slice(0, 10), 0),
                         shuffle=False, compile_options={"loss_options": {"weight_name": "w"}}),
         InvalidDataError, "The sample weights of epoch 0, batch 0 are all zero"),
    Case("sample-weight-without-input", "sample_weight for a program without a weight input",
         lambda c: c.fit(sample_weight=np.ones(len(X), np.float32)), UnsupportedOptionError,
         "loss_options={'weight_name': 'sample_weight'}"),
    Case("sample-weight-wrong-shape", "sample weights of shape (N, 1)",
         lambda c: c.fit(sample_weight=np.ones((len(X), 1), np.float32),
                         compile_options={"loss_options": {"weight_name": "w"}}),
         ShapeMismatchError, "sample_weight has shape (205, 1)"),
    Case("validation-nan", "NaN in validation_data's X",
         lambda c: c.fit(validation_data=(with_value(X[:50], 7, np.nan, 1), Y[:50])),
         InvalidDataError, "validation_data X holds nan at row 7, column 1"),
    Case("validation-not-a-tuple", "validation_data=X_val",
         lambda c: c.fit(validation_data=X[:50]), InvalidDataError,
         "validation_data must be a tuple (X, y)"),
    Case("validation-one-item", "validation_data=(X_val,)",
         lambda c: c.fit(validation_data=(X[:50],)), InvalidDataError, "got 1 item."),
    Case("labels-out-of-range", "class label 3 for a 3-class cross_entropy model",
         lambda c: c.fit(y=with_value(np.zeros(len(X), np.int64), 11, 3), model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}),
         InvalidDataError, "class label 3 at row 11, but the model's classes are 0..2"),
    Case("labels-negative", "class label -1",
         lambda c: c.fit(y=with_value(np.zeros(len(X), np.int64), 4, -1), model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}),
         InvalidDataError, "class label -1 at row 4"),
    Case("labels-not-binary", "label 2 for the binary log loss",
         lambda c: c.fit(y=with_value(np.zeros(len(X), np.int64), 8, 2), model=parse(BINARY),
                         compile_options={"loss": "binary_log_loss"}),
         InvalidDataError, "class label 2 at row 8, but the model's classes are 0..1"),
    Case("labels-float", "float labels for a classification loss",
         lambda c: c.fit(y=np.zeros(len(X), np.float32), model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}),
         DTypeMismatchError, "y is float32 but input 'label' of the model is int64"),
    Case("labels-beyond-int64", "uint64 class labels beyond int64",
         lambda c: c.fit(y=with_value(np.zeros(len(X), np.uint64), 5, 2**64 - 1),
                         model=parse(CLASSIFIER), compile_options={"loss": "multiclass_log_loss"}),
         InvalidDataError, "y holds 18446744073709551615 at row 5, beyond the range of int64"),
    Case("labels-fractional-list", "a list of labels [0.5, ...] for class indices",
         lambda c: c.fit(X[:2], [0.5, 1.0], model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}),
         DTypeMismatchError, "y holds 0.5 at row 0, not a whole number"),
    Case("batches-with-separate-y", "a list of (X, y) batches and a separate y",
         lambda c: c.fit([(X[:100], Y[:100]), (X[100:], Y[100:])], Y), InvalidDataError,
         "leave y and sample_weight out"),
    Case("metrics-unknown", "metrics=['acuracy']",
         lambda c: c.fit(metrics=["acuracy"]), UnknownNameError,
         "metrics names 'acuracy', not a metric. Did you mean 'accuracy'?"),
    Case("metrics-not-a-list", "metrics=3",
         lambda c: c.fit(metrics=3), UnsupportedOptionError, "must be a list of metric names"),
    Case("metrics-twice", "metrics=['mae', 'mae']",
         lambda c: c.fit(metrics=["mae", "mae"]), UnsupportedOptionError, "names 'mae' twice"),
    Case("metrics-for-classes-on-a-regression", "metrics=['accuracy'] with float labels",
         lambda c: c.fit(metrics=["accuracy"]), UnsupportedOptionError,
         "labels are regression targets (float): use 'mae', 'rmse' or 'r2'"),
    Case("metrics-for-values-on-classes", "metrics=['mae'] with class labels",
         lambda c: c.fit(y=np.zeros(len(X), np.int64), model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}, metrics=["mae"]),
         UnsupportedOptionError, "labels are class indices: use 'accuracy'"),
    Case("metrics-f1-of-three-classes", "metrics=['f1'] for 3 classes",
         lambda c: c.fit(y=np.zeros(len(X), np.int64), model=parse(CLASSIFIER),
                         compile_options={"loss": "multiclass_log_loss"}, metrics=["f1"]),
         UnsupportedOptionError, "binary F1 (class 1 against 0), but the prediction has 3"),
    Case("metrics-top-k-of-one-column", "metrics=['top_2_accuracy'] for one probability",
         lambda c: c.fit(y=np.zeros(len(X), np.int64), model=parse(BINARY),
                         compile_options={"loss": "binary_log_loss"},
                         metrics=["top_2_accuracy"]),
         UnsupportedOptionError, "ranks a score per class, but the prediction has one column"),
    Case("validation-fraction-out-of-range", "validation_fraction=1.5",
         lambda c: c.fit(validation_fraction=1.5), UnsupportedOptionError,
         "validation_fraction=1.5 must be a number between 0 and 1"),
    Case("validation-fraction-and-data", "validation_fraction and validation_data",
         lambda c: c.fit(validation_fraction=0.1, validation_data=(X[:5], Y[:5])),
         UnsupportedOptionError, "takes arrays and no validation_data"),
    Case("validation-fraction-all-rows", "validation_fraction=0.9 of 3 rows",
         lambda c: c.fit(X[:3], Y[:3], validation_fraction=0.9), InvalidDataError,
         "of 3 rows holds out 3"),
    Case("validation-fraction-class-too-rare", "validation_fraction with a class of one row",
         lambda c: c.fit(y=with_value(np.zeros(len(X), np.int64), 3, 1), model=parse(BINARY),
                         compile_options={"loss": "binary_log_loss"}, validation_fraction=0.1),
         InvalidDataError, "the rarest has 1, 21 are held out"),
    Case("early-stopping-not-an-object", "early_stopping=5",
         lambda c: c.fit(early_stopping=5), UnsupportedOptionError,
         "must be an EarlyStopping(...)"),
    Case("early-stopping-patience-zero", "EarlyStopping(patience=0)",
         lambda c: lossgraph.EarlyStopping(patience=0), UnsupportedOptionError,
         "patience=0 must be >= 1"),
    Case("early-stopping-min-delta-negative", "EarlyStopping(min_delta=-0.1)",
         lambda c: lossgraph.EarlyStopping(min_delta=-0.1), UnsupportedOptionError,
         "min_delta=-0.1 must be a finite number >= 0"),
    Case("early-stopping-mode-unknown", "EarlyStopping(mode='maximum')",
         lambda c: lossgraph.EarlyStopping(mode="maximum"), UnsupportedOptionError,
         "mode='maximum' is not accepted. Did you mean 'max'?"),
    Case("early-stopping-without-validation", "EarlyStopping() and no validation data",
         lambda c: c.fit(early_stopping=lossgraph.EarlyStopping()), UnsupportedOptionError,
         "watches validation data, but the fit has none: pass validation_fraction=0.1"),
    Case("early-stopping-misspelt", "EarlyStopping('validation_los')",
         lambda c: c.fit(validation_fraction=0.1,
                         early_stopping=lossgraph.EarlyStopping("validation_los")),
         UnknownNameError, "Did you mean 'validation_loss'?"),
    Case("early-stopping-metric-not-computed", "EarlyStopping('validation_mae') without it",
         lambda c: c.fit(validation_fraction=0.1,
                         early_stopping=lossgraph.EarlyStopping("validation_mae")),
         UnsupportedOptionError, "the fit does not compute: pass metrics=['mae']"),
    Case("early-stopping-training-metric-of-batches", "EarlyStopping('mae') over streamed batches",
         lambda c: c.fit([(X[:100], Y[:100]), (X[100:], Y[100:])], None, metrics=["mae"],
                         early_stopping=lossgraph.EarlyStopping("mae")),
         UnsupportedOptionError, "which a fit over streamed batches does not compute"),
    Case("compat-n-iter-no-change-zero", "OrtGradientForwardBackwardOptimizer(n_iter_no_change=0)",
         lambda c: lossgraph.OrtGradientForwardBackwardOptimizer(
             linear(), n_iter_no_change=0, tol=0.01).fit(X, Y), UnsupportedOptionError,
         "n_iter_no_change=0 must be >= 1"),
    Case("compat-tol-negative", "OrtGradientForwardBackwardOptimizer(tol=-1)",
         lambda c: lossgraph.OrtGradientForwardBackwardOptimizer(linear(), tol=-1).fit(X, Y),
         UnsupportedOptionError, "tol=-1 must be a finite number >= 0"),
    Case("compat-early-stopping-without-tol", "early_stopping=True with tol=None",
         lambda c: lossgraph.OrtGradientForwardBackwardOptimizer(
             linear(), early_stopping=True).fit(X, Y), UnsupportedOptionError,
         "early_stopping=True stops when the validation score improves by less than tol"),
    Case("generator-with-separate-y", "a generator of batches and a separate y",
         lambda c: c.fit(((X, Y) for _ in range(2)), Y), InvalidDataError,
         "iterable of (X, y[, sample_weight]) batches"),
    Case("batch-not-a-tuple", "a list of arrays without labels",
         lambda c: c.fit([X[:100], X[100:]], None), InvalidDataError,
         "Batch 0 is not an (X, y)"),
    Case("batch-nan", "NaN in the second streamed batch (checked when it comes)",
         lambda c: c.fit([(X[:50], Y[:50]), (with_value(X[50:100], 2, np.nan, 0), Y[50:100])],
                         None), InvalidDataError, "batch 1 X holds nan at row 2", trains=True),
    Case("batches-empty", "an empty iterable of batches",
         lambda c: c.fit(iter([]), None), InvalidDataError, "The iterable of batches was empty"),
    Case("batches-one-shot", "a one-shot generator for two epochs", one_shot, InvalidDataError,
         "function that returns a new iterator"),
    Case("x-dict-unknown-input", "X as a dict naming an input the model lacks",
         lambda c: c.fit({"z": X}), UnknownNameError, "X names 'z', not a feature input"),
    Case("fit-fixed-batch-size", "batch_size=10 for a batch kept at 2 rows",
         lambda c: c.fit(model=linear(FIXED_BATCH), compile_options={"fixed_batch": "keep"}),
         UnsupportedOptionError, "batch_size=10, but the model's batch is fixed at 2 rows"),
    Case("fit-fixed-batch-one-row", "one row for a batch kept at 2 rows",
         lambda c: c.fit(X[:1], Y[:1], model=linear(FIXED_BATCH), batch_size=None,
                         compile_options={"fixed_batch": "keep"}),
         InvalidDataError, "X has 1 row, but the model's batch is fixed at 2 rows"),
    Case("validation-fixed-batch-rows", "5 validation rows for a batch kept at 2 rows",
         lambda c: c.fit(X[:4], Y[:4], model=linear(FIXED_BATCH), batch_size=None,
                         validation_data=(X[:5], Y[:5]),
                         compile_options={"fixed_batch": "keep"}),
         InvalidDataError, "validation_data has 5 rows, not a multiple of 2"),
    Case("batch-fixed-batch-size", "a streamed batch of 3 rows for a batch kept at 2 rows",
         lambda c: c.fit([(X[:2], Y[:2]), (X[2:5], Y[2:5])], None, model=linear(FIXED_BATCH),
                         batch_size=None, compile_options={"fixed_batch": "keep"}),
         InvalidDataError, "Batch 1 has 3 rows, but the model's batch is fixed at 2 rows",
         trains=True),
    Case("predict-fixed-batch-rows", "predict on 205 rows for a batch kept at 2 rows",
         lambda c: c.trainer(linear(FIXED_BATCH), fixed_batch="keep").predict(X),
         InvalidDataError, "X has 205 rows, not a multiple of 2"),
    Case("evaluate-fixed-batch-sum", "evaluate 4 rows of a sum loss, a batch kept at 2 rows",
         lambda c: c.trainer(linear(FIXED_BATCH), fixed_batch="keep",
                             loss_options={"reduction": "sum"}).evaluate(X[:4], Y[:4]),
         UnsupportedOptionError, "only a mean loss (reduction 'mean', lossgraph's loss) "
         "combines exactly across runs; this one is reduction 'sum'"),
    Case("predict-wrong-width", "predict on 3 features",
         lambda c: c.trainer().predict(X[:, :3]), ShapeMismatchError, "X has shape (205, 3)"),
    Case("score-nan", "score on NaN labels",
         lambda c: c.trainer().evaluate(X, with_value(Y, 0, np.nan)), InvalidDataError,
         "y holds nan at row 0"),
    Case("set-state-unknown-name", "set_state({'cof': ...})",
         lambda c: c.trainer().set_state({"cof": np.zeros((4, 1), np.float32)}),
         UnknownNameError, "Did you mean 'coef'"),
    Case("set-state-nan", "set_state with NaN weights",
         lambda c: c.trainer().set_state({"coef": np.full((4, 1), np.nan, np.float32)}),
         InvalidDataError, "State 'coef' holds NaN"),
    # -- found by the fuzzer (tests/test_fuzz.py) ---------------------------------------------
    Case("model-weight-raw-data-too-long", "a weight's raw data 4 bytes longer than its shape",
         lambda c: c.program(with_tensor("coef", raw_and_longer)), InvalidModelError,
         "stores the tensor 'coef' (float[4, 1], 16 bytes) in 20 bytes"),
    Case("model-weight-values-not-its-shape", "a weight of shape (1,) holding 2 values",
         lambda c: c.program(with_tensor("intercept", lambda t: t.float_data.append(0.7))),
         InvalidModelError, "'intercept' (float[1], 1 values) with 2 values"),
    Case("model-ml-opset-unknown", "ai.onnx.ml opset 26 (onnx defines 1 to 5)",
         lambda c: c.program(with_graph(lambda m: m.opset_import.append(
             helper.make_opsetid("ai.onnx.ml", 26)))),
         UnsupportedModelError, "version 26 of the domain 'ai.onnx.ml'"),
    Case("model-opset-imported-twice", "ai.onnx imported as opsets 18 and 13 (Add changed "
                                       "in between)",
         lambda c: c.program(with_graph(lambda m: m.opset_import.append(
             helper.make_opsetid("", 13)))),
         InvalidModelError, "imports the domain 'ai.onnx' twice, as opsets 18 and 13"),
    Case("model-cast-to-no-type", "a Cast to element type 2**40",
         lambda c: c.program(with_graph(lambda m: cast_to(m, 1 << 40))), InvalidModelError,
         "not a valid ONNX model: Invalid tensor data type"),
    Case("model-output-without-type", "an output of element type 0 (undefined)",
         lambda c: c.program(with_graph(lambda m: setattr(
             m.graph.output[0].type.tensor_type, "elem_type", 0))),
         InvalidModelError, "Output 'y' has no element type"),
    Case("model-output-fixed-batch", "an output declared float[2147483648, 1] (onnx hung)",
         lambda c: c.program(linear(("=> (float[N, 1] y)", "=> (float[2147483648, 1] y)"))),
         UnsupportedModelError, "Output 'y' has a fixed batch dimension of 2147483648"),
    Case("model-output-named-like-the-batch", "an output declared float[N, N] that is (N, 1)",
         lambda c: c.program(linear(("=> (float[N, 1] y)", "=> (float[N, N] y)"))),
         InvalidModelError, "Output 'y' is declared of shape (N, N), but the Add node computes "
         "it of shape (N, 1)"),
    Case("model-output-fixed-rows", "a Reshape to 8 rows, the output declared float[N, 1]",
         lambda c: c.program(parse(FIXED_ROWS)), InvalidModelError,
         "the Reshape node computes it of shape (8, 1)"),
    Case("model-ml-output-of-another-rank", "a LinearRegressor's (N, 1) output declared float[N]",
         lambda c: c.program(parse(REGRESSOR_OF_RANK_1)), InvalidModelError,
         "Output 'y' is declared of shape (N), but LinearRegressor node"),
    Case("model-gemm-bias-not-broadcastable", "a Gemm adding C of shape (4,) to (N, 3)",
         lambda c: c.program(parse(GEMM_BAD_BIAS)), InvalidModelError,
         "'c' of shape (4,) does not broadcast to 'y'"),
    Case("model-conv-channels-not-the-weights", "a Conv of 2 input channels, weight for 1",
         lambda c: c.program(parse(CONV_CHANNELS)), InvalidModelError,
         "reads 'x' with 2 channels, but its weight 'w' of shape (1, 1, 3, 3) takes 1"),
    Case("trainable-initializers-of-an-invalid-model",
         "trainable_initializers of a model whose node's domain is not imported",
         lambda c: lossgraph.trainable_initializers(with_graph(
             lambda m: setattr(m.graph.node[1], "domain", "com.microsoft"))),
         InvalidModelError, "The model given to trainable_initializers is not a valid ONNX"),
    Case("model-weight-not-finite", "a weight holding inf (the clipped log loss stayed finite)",
         lambda c: c.fit(y=np.zeros(len(X), np.int64), model=binary_with_inf(),
                         compile_options={"loss": "binary_log_loss"}),
         UnsupportedModelError, "Weight 'w' holds inf at index (1, 0)"),
    Case("model-name-not-utf8", "model bytes with a node name that is not UTF-8",
         lambda c: c.program(name_not_utf8()), InvalidModelError,
         "model.graph.node[0].name is not UTF-8 text"),
    Case("model-type-unknown-after-custom-op", "an op of the user's domain feeding a MaxPool",
         lambda c: c.program(parse(UNTYPED_BY_CUSTOM_OP)), UnsupportedModelError,
         "The element type of 'h' is unknown after shape inference"),
    Case("optimizer-adam-epsilon-zero", "Adam(epsilon=0): NaN weights, the loss still finite",
         lambda c: c.program(optimizer=Adam(epsilon=0.0)), UnsupportedOptionError,
         "Adam: epsilon=0: the update divides 0 by 0"),
    Case("optimizer-adam-epsilon-zero-in-float32", "Adam(epsilon=1e-50) for float32 weights",
         lambda c: c.program(optimizer=Adam(epsilon=1e-50)), UnsupportedOptionError,
         "epsilon=1e-50 is 0 in float32"),
    *[Case(f"fit-rows-mixed-{mode}", f"a Reshape mixing rows (4N rows out), fuse={mode!r}",
           lambda c, m=mode: c.fit(model=parse(MIXED_ROWS), compile_options={"fuse": m}),
           UnsupportedModelError, fragment)
      for mode, fragment in (("step", "For batches of 10 rows, the model's shapes contradict"),
                             ("separate", "computes its output 'y' of shape (40, 1)"))],
    # -- schedules and decay groups ----------------------------------------------------------
    Case("schedule-warmup-past-total", "Linear(0.1, total_steps=10, warmup_steps=20)",
         lambda c: c.program(optimizer=AdamW(Linear(0.1, total_steps=10, warmup_steps=20))),
         UnsupportedOptionError, "warmup_steps=20 exceeds total_steps=10"),
    Case("schedule-end-above-peak", "Cosine(0.01, 100, end=0.1)",
         lambda c: c.program(optimizer=SGD(Cosine(0.01, 100, end=0.1))), UnsupportedOptionError,
         "Cosine: end=0.1 must lie in [0, 0.01]"),
    Case("schedule-steps-not-an-integer", "Linear(0.1, total_steps=10.5)",
         lambda c: c.program(optimizer=SGD(Linear(0.1, total_steps=10.5))),
         UnsupportedOptionError, "Linear: total_steps=10.5 must be an integer >= 0"),
    Case("schedule-one-cycle-pct-start", "OneCycle(0.1, 100, pct_start=1.0)",
         lambda c: c.program(optimizer=SGD(OneCycle(0.1, 100, pct_start=1.0))),
         UnsupportedOptionError, "OneCycle: pct_start=1.0 must lie in (0, 1)"),
    Case("schedule-dict-missing-argument",
         "optimizer={'type': 'AdamW', 'learning_rate': {'type': 'Linear', 'peak': 0.001}}",
         lambda c: c.program(optimizer={"type": "AdamW", "learning_rate": {
             "type": "Linear", "peak": 0.001}}), UnsupportedOptionError,
         "Linear needs total_steps"),
    Case("schedule-dict-unknown-type", "learning_rate={'type': 'Cosin', 'peak': 0.1}",
         lambda c: c.program(optimizer={"type": "SGD", "learning_rate": {
             "type": "Cosin", "peak": 0.1}}), UnsupportedOptionError, "Did you mean 'Cosine'"),
    Case("schedule-learning-rate-a-string", "AdamW(learning_rate='1e-3')",
         lambda c: c.program(optimizer=AdamW("1e-3")), UnsupportedOptionError,
         "must be a finite number >= 0 or a lossgraph.schedules schedule"),
    Case("schedule-and-sgd-invscaling",
         "SGD(Linear(0.1, 100), learning_rate_schedule='invscaling')",
         lambda c: c.program(optimizer=SGD(Linear(0.1, 100),
                                           learning_rate_schedule="invscaling")),
         UnsupportedOptionError, "learning_rate is a schedule (Linear)"),
    Case("schedule-one-cycle-past-its-steps", "OneCycle(total_steps=5) trained for 21 steps",
         lambda c: c.fit(compile_options={"optimizer": SGD(OneCycle(0.01, 5))}),
         UnsupportedOptionError, "has no rate for update 7", trains=True),
    Case("decay-exclusion-matches-nothing", "AdamW(exclude_from_weight_decay=['bias'])",
         lambda c: c.program(optimizer=AdamW(exclude_from_weight_decay=["bias"])),
         UnknownNameError, "holds 'bias', which names no trained weight"),
    Case("decay-exclusion-not-names", "AdamW(exclude_from_weight_decay=3)",
         lambda c: c.program(optimizer=AdamW(exclude_from_weight_decay=3)),
         UnsupportedOptionError, "exclude_from_weight_decay=3 must be 'auto'"),
    Case("decay-exclusion-bad-expression", "AdamW(exclude_from_weight_decay=['coef('])",
         lambda c: c.program(optimizer=AdamW(exclude_from_weight_decay=["coef("])),
         UnsupportedOptionError, "'coef(' is neither a weight's name nor a regular expression"),
    Case("decay-auto-without-a-graph", "update_graph(AdamW(exclude_from_weight_decay='auto'))",
         lambda c: update_graph(AdamW(exclude_from_weight_decay="auto"),
                                {"w": np.ones(2, np.float32)}),
         UnsupportedOptionError, "compile_program resolves it"),
    Case("penalty-every-weight-negative", "Penalty(l2=-0.1)",
         lambda c: c.program(penalty=Penalty(l2=-0.1)), UnsupportedOptionError,
         "Penalty: l2=-0.1 must be a finite number >= 0"),
    Case("penalty-every-weight-in-add-loss-output", "add_loss_output(model, penalty=Penalty())",
         lambda c: lossgraph.add_loss_output(linear(), penalty=Penalty(l2=0.1)),
         UnsupportedOptionError, "applies to every trained weight"),
    Case("artifacts-with-a-schedule", "to_ort_artifacts(optimizer=AdamW(Linear(...)))",
         lambda c: to_ort_artifacts(linear(), c.tmp / "a",
                                    optimizer=AdamW(Linear(1e-3, total_steps=100))),
         UnsupportedOptionError, "cannot be exported to onnxruntime's training artifacts"),
    Case("artifacts-with-decay-groups",
         "to_ort_artifacts(optimizer=AdamW(exclude_from_weight_decay='auto'))",
         lambda c: to_ort_artifacts(linear(), c.tmp / "a",
                                    optimizer=AdamW(exclude_from_weight_decay="auto")),
         UnsupportedOptionError, "one AdamWOptimizer op with one weight_decay"),
    # -- divergence --------------------------------------------------------------------------
    *[Case(f"diverge-{mode}", f"a loss overflowing at epoch 1, batch 3 (fuse={mode!r})",
           lambda c, m=mode: diverge(c, m), ConvergenceError, "epoch 1, batch 3", trains=True)
      for mode in ("separate", "step", "epoch")],
    Case("diverge-last-partial-batch", "a loss overflowing in the last, partial batch",
         lambda c: diverge(c, "epoch", bad_row=203), ConvergenceError, "epoch 1, batch 20",
         trains=True),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_every_bad_input_gets_a_named_lossgraph_error_before_any_work(case, tmp_path):
    ctx = Context(tmp_path)
    with pytest.raises(LossgraphError) as caught:
        case.provoke(ctx)
    assert type(caught.value) is case.error, caught.value
    assert case.fragment in str(caught.value)
    if not case.trains:
        for trainer in ctx.trainers:
            assert trainer.steps_ == 0 and trainer.epochs_ == 0
            for name, value in trainer.program.state.items():
                np.testing.assert_array_equal(trainer.state[name], value, err_msg=name)


def test_catalogue_ids_are_unique_and_at_least_forty():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 40


def test_every_catalogue_case_is_listed_in_the_errors_page():
    assert_listed((case.id for case in CASES), __file__)


# -- divergence keeps the last good state ----------------------------------------------------


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_a_diverging_fit_keeps_the_last_state_whose_loss_was_finite(mode, tmp_path):
    """The failing step's loss is that of the state the step before made: the state
    before that step is kept (epoch mode: the epoch's start, whose first loss was finite)."""
    ctx = Context(tmp_path)
    with pytest.raises(ConvergenceError, match="epoch 1, batch 3"):
        diverge(ctx, mode)
    (trainer,) = ctx.trainers
    expected = lossgraph.Trainer(trainer.program)
    expected.fit(X, Y, epochs=1, batch_size=10, shuffle=False, progress=False)
    if mode != "epoch":  # two of the three good steps before the failing one; epoch mode: none
        expected.fit(X[:20], Y[:20], epochs=1, batch_size=10, shuffle=False, warm_start=True,
                     progress=False)
    assert trainer.steps_ == expected.steps_ and trainer.epochs_ == 1
    for name, value in expected.state.items():
        np.testing.assert_array_equal(trainer.state[name], value, err_msg=name)


def test_nan_written_into_checked_data_is_still_named_by_row():
    """Arrays checked once are not checked again on the next fit; a NaN written into one
    in between makes the loss NaN, and the error still names its row."""
    data = X.copy()
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear(), optimizer=SGD(0.01)))
    trainer.fit(data, Y, batch_size=10, shuffle=False, progress=False)
    data[57, 1] = np.nan
    with pytest.raises(InvalidDataError, match="row 57, epoch 1, batch 5"):
        trainer.fit(data, Y, batch_size=10, shuffle=False, warm_start=True, progress=False)


# -- inputs accepted on purpose ----------------------------------------------------------------


def trained(X_data: Any = X, y_data: Any = Y, **fit_options: Any) -> dict[str, np.ndarray]:
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear(), optimizer=SGD(0.01)))
    fit_options = {"epochs": 2, "batch_size": 20, "random_state": 0, "progress": False,
                   **fit_options}
    return trainer.fit(X_data, y_data, **fit_options).state


REFERENCE = trained()


def assert_same_state(state: dict[str, np.ndarray]) -> None:
    for name, value in REFERENCE.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def test_python_lists_train_like_arrays_in_the_models_dtype():
    assert_same_state(trained(X.tolist(), Y.tolist()))


class ArrayLike:
    """An object that is not an ndarray but converts to one (a torch tensor, an xarray...)."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._array


class ToNumpy(ArrayLike):
    """A pandas-like object: ``to_numpy()`` only."""

    __array__ = None  # type: ignore[assignment]

    def to_numpy(self) -> np.ndarray:
        return self._array


@pytest.mark.parametrize("wrap", [ArrayLike, ToNumpy])
def test_array_like_objects_train_like_arrays(wrap):
    assert_same_state(trained(wrap(X), wrap(Y)))


def test_pandas_frames_train_like_arrays():
    pandas = pytest.importorskip("pandas")
    assert_same_state(trained(pandas.DataFrame(X), pandas.Series(Y)))


@pytest.mark.parametrize("layout", ["fortran", "strided", "read-only"])
def test_any_memory_layout_trains_the_same_and_the_data_is_never_written(layout):
    if layout == "fortran":
        data = np.asfortranarray(X)
    elif layout == "strided":
        data = np.repeat(X, 2, axis=1)[:, ::2]
    else:
        data = X.copy()
        data.setflags(write=False)
    labels = Y.copy()
    labels.setflags(write=False)
    before = data.copy()
    assert_same_state(trained(data, labels))
    np.testing.assert_array_equal(data, before)


def test_an_optimizer_by_name_or_dict_form_equals_the_instance():
    programs = [lossgraph.compile_program(linear(), optimizer=optimizer)
                for optimizer in (Adam(), "adam", "Adam", {"type": "Adam"})]
    assert all(p.manifest["optimizer"] == programs[0].manifest["optimizer"] for p in programs)


def test_a_single_weight_name_is_one_weight_never_letters():
    assert lossgraph.compile_program(linear(), weights="coef").weights == ["coef"]


def test_a_single_callable_is_one_callback():
    seen = []
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear()))
    trainer.fit(X, Y, epochs=2, progress=False, callbacks=lambda t, e, logs: seen.append(e))
    assert seen == [0, 1]


def test_zero_epochs_train_nothing():
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear())).fit(X, Y, epochs=0,
                                                                         progress=False)
    assert trainer.steps_ == 0 and trainer.train_losses_ == []


def test_a_model_that_imputes_missing_values_takes_nan_features():
    imputing = parse("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x) => (float[N, 1] y)
        <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5}, float zero = {0}>
        { missing = IsNaN(x)
          filled = Where(missing, zero, x)
          h = MatMul(filled, coef)
          y = Add(h, intercept) }""")
    trainer = lossgraph.Trainer(lossgraph.compile_program(imputing, optimizer=SGD(0.01)))
    trainer.fit(with_value(X, 3, np.nan, 1), Y, epochs=2, progress=False)
    assert all(np.isfinite(v).all() for v in trainer.state.values())
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def test_opsets_are_checked_at_compile_time_not_when_loading(tmp_path):
    path = tmp_path / "old.onnx"
    onnx.save(linear(('"" : 18', '"" : 9')), path)
    assert lossgraph.models.as_model(path).opset_import[0].version == 9
    program = lossgraph.compile_program(path)  # raised to the target's oldest by compile
    assert str(program.notes.opset) == "ai.onnx opset 9 raised to 13 by onnx's version converter"


def test_compile_with_the_ort_backend_needs_the_training_build_before_reading_the_model(
        tmp_path):
    from support.environment import HAS_TRAINING

    if HAS_TRAINING:
        pytest.skip("the training build is installed here")
    with pytest.raises(RuntimeUnavailableError, match="backend='ort' needs"):
        lossgraph.compile_program(tmp_path / "not-even-there.onnx", backend="ort")


def test_external_data_inside_the_model_folder_loads(tmp_path):
    path = external_model(tmp_path / "m", "weights/coef.bin", tmp_path / "m" / "weights" /
                          "coef.bin")
    program = lossgraph.compile_program(path)
    np.testing.assert_array_equal(program.state["coef"].ravel(),
                                  np.array([0.1, -0.2, 0.3, 0.0], np.float32))


def test_external_data_of_an_in_memory_model_is_never_read_from_the_current_folder(
        tmp_path, monkeypatch):
    """onnx would read ``coef.bin`` from the current directory for a ModelProto."""
    path = external_model(tmp_path / "m", "coef.bin", tmp_path / "m" / "coef.bin")
    monkeypatch.chdir(tmp_path / "m")
    with pytest.raises(InvalidModelError, match="was not loaded"):
        lossgraph.models.as_model(onnx.load(path, load_external_data=False))


# -- the table in docs/reference/errors.md -----------------------------------------------------


def catalogue_rows(tmp: Path) -> Iterator[Row]:
    """The catalogue's rows, with the messages of this run."""
    for case in CASES:
        folder = tmp / case.id
        folder.mkdir()
        try:
            case.provoke(Context(folder))
        except LossgraphError as error:
            message = message_of(error, folder)
        else:
            message = "(no error: the catalogue is broken)"
        yield case.id, case.input, case.error.__name__, message


if __name__ == "__main__":
    print_table(catalogue_rows)
