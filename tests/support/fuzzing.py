"""What tests/test_fuzz.py fuzzes lossgraph with: the examples of each family (models,
options, storage, cli), the property each fuzzed call must keep, and a sandbox process
that survives a native crash or a hang.

The property: every call ends in a lossgraph error (a :class:`~lossgraph.errors.LossgraphError`
other than :class:`~lossgraph.errors.InternalError`, which says "a bug in lossgraph") or in a
correct result; never a raw exception, a hang, or a native crash of onnxruntime.

Examples draw their choices through a :class:`Chooser`, so that hypothesis drives them in
the tests (and shrinks a failure to a small one) and plain ``random`` drives them in a
quick exploration outside pytest, each example in the sandbox, failures saved::

    python tests/support/fuzzing.py FAMILY EXAMPLES SEED [FOLDER]    # e.g. storage 500 7

Each mutation edits a copy of a golden model and returns one line saying what it did: a
failure prints the lines, a reproduction in words.
"""

from __future__ import annotations

import functools
import math
import os
import random
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor

GOLDEN_MODELS = Path(__file__).resolve().parents[2] / "golden_models"
GOLDEN = sorted(p.stem for p in GOLDEN_MODELS.glob("*.onnx"))


def golden_bytes(name: str) -> bytes:
    return (GOLDEN_MODELS / f"{name}.onnx").read_bytes()


def golden_loss(name: str) -> str:
    """The loss each golden model trains with (golden_models/README.md)."""
    if name == "skl_logistic_binary":
        return "binary_log_loss"
    if "classifier" in name or "logistic" in name:
        return "multiclass_log_loss"
    return "squared_error"


def golden_classes(name: str) -> int:
    return 2 if "binary" in name else 3


# -- choices ------------------------------------------------------------------------------------


class Chooser(Protocol):
    """Where a mutation's choices come from (hypothesis, or ``random`` for exploration)."""

    def integer(self, lo: int, hi: int) -> int: ...

    def choice(self, options: Sequence[Any]) -> Any: ...


class RandomChooser:
    """Choices from ``random.Random(seed)``."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.random.randint(lo, hi)

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self.random.randrange(len(options))]


class TapeChooser:
    """Choices read from a tape of numbers drawn beforehand (so that a mutation can be
    drawn in one process and made in another, where the model is)."""

    def __init__(self, tape: Sequence[int]) -> None:
        self.tape, self.at = list(tape) or [0], 0

    def _next(self) -> int:
        value = self.tape[self.at % len(self.tape)]
        self.at += 1
        return value

    def integer(self, lo: int, hi: int) -> int:
        return lo + self._next() % (hi - lo + 1)

    def choice(self, options: Sequence[Any]) -> Any:
        return options[self._next() % len(options)]


# -- model mutations ----------------------------------------------------------------------------

#: Values a dimension is set to: the small, the odd, the huge and the symbolic.
DIMS: tuple[int | str, ...] = (-1, 0, 1, 2, 3, 7, 1 << 31, 1 << 40, "N", "M", "")
#: Element types: every TensorProto.DataType number and a few past the last.
DTYPES = tuple(range(0, 26))
INTS = (-(1 << 40), -3, -1, 0, 1, 2, 3, 5, 1 << 31, 1 << 40)
FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-30, 0.5, 2.0, 1e30)
ML_OP_TYPES = ("LinearRegressor", "LinearClassifier", "Normalizer", "ZipMap", "Scaler",
               "ArrayFeatureExtractor", "Binarizer", "Imputer")
OP_TYPES = ("Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Relu", "Sigmoid", "Tanh", "Softmax",
            "Exp", "Log", "Reshape", "Cast", "Identity", "ArgMax", "ReduceSum", "Conv",
            "MaxPool", "BatchNormalization", "Flatten", "Concat", "Transpose", "Gather",
            "Loop", "If", "NoSuchOp", *ML_OP_TYPES)
DOMAINS = ("", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "com.example")


def _repeated(field: FieldDescriptor) -> bool:
    """Whether ``field`` is repeated (protobuf 7 dropped ``FieldDescriptor.label``)."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _messages(message: Any, path: str = "model") -> list[tuple[str, Any]]:
    """Every message inside ``message`` (itself first) with its path, in field order."""
    found = [(path, message)]
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if _repeated(field):
            if field.message_type.GetOptions().map_entry:
                continue
            for index, item in enumerate(value):
                found += _messages(item, f"{path}.{field.name}[{index}]")
        else:
            found += _messages(value, f"{path}.{field.name}")
    return found


def _value_infos(graph: onnx.GraphProto) -> list[tuple[str, onnx.ValueInfoProto]]:
    return ([(f"input {v.name!r}", v) for v in graph.input]
            + [(f"output {v.name!r}", v) for v in graph.output]
            + [(f"value_info {v.name!r}", v) for v in graph.value_info])


def _value_names(graph: onnx.GraphProto) -> list[str]:
    names = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    names += [o for n in graph.node for o in n.output]
    return sorted(set(names))


def drop_field(model: onnx.ModelProto, draw: Chooser) -> str:
    """Clear one field of one message (or remove one item of a repeated field)."""
    candidates = [(path, m) for path, m in _messages(model) if m.ListFields()]
    if not candidates:
        return "no field to drop"
    path, message = draw.choice(candidates)
    field, value = draw.choice(message.ListFields())
    if _repeated(field) and len(value) > 1 and draw.choice(
            (True, False)):
        index = draw.integer(0, len(value) - 1)
        del value[index]
        return f"{path}.{field.name}[{index}] removed"
    message.ClearField(field.name)
    return f"{path}.{field.name} cleared"


def change_dim(model: onnx.ModelProto, draw: Chooser) -> str:
    """Change, add or remove one dimension of a declared shape or of a weight."""
    graph = model.graph
    shapes = [(what, v.type.tensor_type.shape) for what, v in _value_infos(graph)
              if v.type.HasField("tensor_type")]
    weights = [(f"initializer {t.name!r}", t) for t in graph.initializer]
    if weights and (not shapes or draw.choice((True, False))):
        what, tensor = draw.choice(weights)
        action = draw.choice(("set", "add", "remove"))
        if action == "remove" and tensor.dims:
            index = draw.integer(0, len(tensor.dims) - 1)
            del tensor.dims[index]
            return f"{what}: dims[{index}] removed"
        value = draw.choice([d for d in DIMS if isinstance(d, int)])
        if action == "set" and tensor.dims:
            index = draw.integer(0, len(tensor.dims) - 1)
            tensor.dims[index] = value
            return f"{what}: dims[{index}] = {value}"
        tensor.dims.append(value)
        return f"{what}: dim {value} appended"
    if not shapes:
        return "no shape to change"
    what, shape = draw.choice(shapes)
    action = draw.choice(("set", "add", "remove", "clear"))
    if action == "clear":
        shape.Clear()
        return f"{what}: shape cleared (rank unknown)"
    if action == "remove" and shape.dim:
        index = draw.integer(0, len(shape.dim) - 1)
        del shape.dim[index]
        return f"{what}: dim {index} removed"
    value = draw.choice(DIMS)
    if action == "set" and shape.dim:
        index = draw.integer(0, len(shape.dim) - 1)
        dim = shape.dim[index]
    else:
        index, dim = len(shape.dim), shape.dim.add()
    if isinstance(value, int):
        dim.dim_value = value
    else:
        dim.dim_param = value
    return f"{what}: dim {index} = {value!r}"


def swap_dtype(model: onnx.ModelProto, draw: Chooser) -> str:
    """Give a declared value, a weight or a Cast another element type."""
    graph = model.graph
    targets: list[tuple[str, Any, str]] = [
        (what, v.type.tensor_type, "elem_type") for what, v in _value_infos(graph)
        if v.type.HasField("tensor_type")]
    targets += [(f"initializer {t.name!r}", t, "data_type") for t in graph.initializer]
    targets += [(f"node {n.name or n.op_type!r} attribute {a.name!r}", a, "i")
                for n in graph.node for a in n.attribute if a.name in ("to", "dtype")]
    if not targets:
        return "no type to swap"
    what, message, field = draw.choice(targets)
    value = draw.choice(DTYPES)
    setattr(message, field, value)
    return f"{what}: {field} = {value}"


def rewire(model: onnx.ModelProto, draw: Chooser) -> str:
    """Point a node's input or output at another value; or drop, copy or move a node."""
    graph = model.graph
    if not graph.node:
        return "no node to rewire"
    index = draw.integer(0, len(graph.node) - 1)
    node = graph.node[index]
    action = draw.choice(("input", "output", "drop", "duplicate", "move"))
    names = [*_value_names(graph), "", "nowhere"]
    if action == "input" and node.input:
        slot = draw.integer(0, len(node.input) - 1)
        node.input[slot] = draw.choice(names)
        return f"node {index} ({node.op_type}) input {slot} = {node.input[slot]!r}"
    if action == "output" and node.output:
        slot = draw.integer(0, len(node.output) - 1)
        node.output[slot] = draw.choice(names)
        return f"node {index} ({node.op_type}) output {slot} = {node.output[slot]!r}"
    if action == "drop":
        del graph.node[index]
        return f"node {index} ({node.op_type}) removed"
    if action == "duplicate":
        graph.node.insert(draw.integer(0, len(graph.node)), node)
        return f"node {index} ({node.op_type}) duplicated"
    to = draw.integer(0, len(graph.node) - 1)
    moved = onnx.NodeProto()
    moved.CopyFrom(node)
    del graph.node[index]
    graph.node.insert(to, moved)
    return f"node {index} ({moved.op_type}) moved to {to}"


def corrupt_attribute(model: onnx.ModelProto, draw: Chooser) -> str:
    """Change, retype, drop or add an attribute of a node."""
    graph = model.graph
    if not graph.node:
        return "no node to corrupt"
    index = draw.integer(0, len(graph.node) - 1)
    node = graph.node[index]
    where = f"node {index} ({node.op_type})"
    if not node.attribute or draw.integer(0, 5) == 0:
        name = draw.choice(("axis", "alpha", "transA", "kernel_shape", "perm", "to", "junk"))
        attribute = onnx.helper.make_attribute(
            name, draw.choice((draw.choice(INTS), draw.choice(FLOATS), [1, 2], "x")))
        node.attribute.append(attribute)
        return f"{where}: attribute {name!r} = {onnx.helper.get_attribute_value(attribute)!r} added"
    slot = draw.integer(0, len(node.attribute) - 1)
    attribute = node.attribute[slot]
    action = draw.choice(("value", "value", "value", "type", "drop"))
    if action == "drop":
        del node.attribute[slot]
        return f"{where}: attribute {attribute.name!r} removed"
    if action == "type":
        attribute.type = draw.choice(range(0, 15))
        return f"{where}: attribute {attribute.name!r} type = {attribute.type}"
    kind = attribute.type
    if kind == onnx.AttributeProto.INT:
        attribute.i = draw.choice(INTS)
        return f"{where}: attribute {attribute.name!r} = {attribute.i}"
    if kind == onnx.AttributeProto.FLOAT:
        attribute.f = draw.choice(FLOATS)
        return f"{where}: attribute {attribute.name!r} = {attribute.f}"
    if kind == onnx.AttributeProto.INTS:
        values = list(attribute.ints)
        if values and draw.choice((True, False)):
            values[draw.integer(0, len(values) - 1)] = draw.choice(INTS)
        elif values and draw.choice((True, False)):
            values.pop()
        else:
            values.append(draw.choice(INTS))
        attribute.ClearField("ints")
        attribute.ints.extend(values)
        return f"{where}: attribute {attribute.name!r} = {values}"
    if kind == onnx.AttributeProto.FLOATS:
        values = list(attribute.floats)
        if values:
            values[draw.integer(0, len(values) - 1)] = draw.choice(FLOATS)
        if draw.choice((True, False)):
            values = values[:draw.integer(0, len(values))]
        attribute.ClearField("floats")
        attribute.floats.extend(values)
        return f"{where}: attribute {attribute.name!r} = {values}"
    if kind == onnx.AttributeProto.STRING:
        attribute.s = draw.choice((b"", b"SOFTMAX", b"LOGISTIC", b"NONE", b"junk"))
        return f"{where}: attribute {attribute.name!r} = {attribute.s!r}"
    if kind == onnx.AttributeProto.STRINGS:
        values = list(attribute.strings)
        if values and draw.choice((True, False)):
            values.pop()
        else:
            values.append(b"junk")
        attribute.ClearField("strings")
        attribute.strings.extend(values)
        return f"{where}: attribute {attribute.name!r} = {values}"
    if kind == onnx.AttributeProto.TENSOR:
        tensor = attribute.t
        if tensor.raw_data:
            tensor.raw_data = tensor.raw_data[:draw.integer(0, len(tensor.raw_data) - 1)]
            return f"{where}: attribute {attribute.name!r} tensor data truncated"
        tensor.data_type = draw.choice(DTYPES)
        return f"{where}: attribute {attribute.name!r} tensor data_type = {tensor.data_type}"
    del node.attribute[slot]
    return f"{where}: attribute {attribute.name!r} removed"


def change_opset(model: onnx.ModelProto, draw: Chooser) -> str:
    """Change the IR version, an opset version, or the imported domains."""
    action = draw.choice(("ir", "version", "version", "drop", "add"))
    if action == "ir":
        model.ir_version = draw.integer(0, 16)
        return f"ir_version = {model.ir_version}"
    if action == "drop" and model.opset_import:
        index = draw.integer(0, len(model.opset_import) - 1)
        domain = model.opset_import[index].domain
        del model.opset_import[index]
        return f"opset_import of domain {domain!r} removed"
    if action == "add":
        domain = draw.choice(DOMAINS)
        version = draw.integer(0, 30)
        model.opset_import.add(domain=domain, version=version)
        return f"opset_import ({domain!r}, {version}) added"
    if not model.opset_import:
        return "no opset to change"
    entry = model.opset_import[draw.integer(0, len(model.opset_import) - 1)]
    entry.version = draw.integer(-1, 30)
    return f"opset of domain {entry.domain!r} = {entry.version}"


_DATA_FIELDS = ("float_data", "double_data", "int32_data", "int64_data", "uint64_data",
                "string_data")


def truncate_initializer(model: onnx.ModelProto, draw: Chooser) -> str:
    """Cut a weight's data short (or empty it)."""
    weights = list(model.graph.initializer)
    if not weights:
        return "no initializer to truncate"
    tensor = draw.choice(weights)
    if tensor.raw_data:
        keep = draw.integer(0, len(tensor.raw_data) - 1)
        tensor.raw_data = tensor.raw_data[:keep]
        return f"initializer {tensor.name!r}: raw_data cut to {keep} bytes"
    for name in _DATA_FIELDS:
        values = getattr(tensor, name)
        if len(values):
            keep = draw.integer(0, len(values) - 1)
            del values[keep:]
            return f"initializer {tensor.name!r}: {name} cut to {keep} values"
    tensor.raw_data = b"\x00" * draw.integer(1, 9)
    return f"initializer {tensor.name!r}: {len(tensor.raw_data)} bytes of raw_data added"


def swap_op(model: onnx.ModelProto, draw: Chooser) -> str:
    """Give a node another op type or domain."""
    graph = model.graph
    if not graph.node:
        return "no node to change"
    index = draw.integer(0, len(graph.node) - 1)
    node = graph.node[index]
    if draw.integer(0, 3) == 0:
        node.domain = draw.choice(DOMAINS)
        return f"node {index} ({node.op_type}) domain = {node.domain!r}"
    before, node.op_type = node.op_type, draw.choice(OP_TYPES)
    if node.op_type in ML_OP_TYPES:  # an ai.onnx.ml op, with its domain imported
        node.domain = "ai.onnx.ml"
        if not any(o.domain == "ai.onnx.ml" for o in model.opset_import):
            model.opset_import.add(domain="ai.onnx.ml", version=1)
    return f"node {index} ({before}) op_type = {node.op_type!r} (domain {node.domain!r})"


MUTATIONS: dict[str, Callable[[onnx.ModelProto, Chooser], str]] = {
    "drop_field": drop_field,
    "change_dim": change_dim,
    "swap_dtype": swap_dtype,
    "rewire": rewire,
    "corrupt_attribute": corrupt_attribute,
    "change_opset": change_opset,
    "truncate_initializer": truncate_initializer,
    "swap_op": swap_op,
}


def flip_bytes(data: bytes, draw: Chooser) -> tuple[bytes, str]:
    """A few bytes of the serialized model changed: a damaged file that may still parse
    (a name that is not UTF-8, a length or a tag off by some bits)."""
    flipped = bytearray(data)
    where = []
    for _ in range(draw.integer(1, 3)):
        at = draw.integer(0, len(flipped) - 1)
        flipped[at] ^= draw.integer(1, 255)
        where.append(at)
    return bytes(flipped), f"bytes {where} of the file flipped"


def mutate(name: str, draw: Chooser, count: int) -> tuple[bytes, list[str]]:
    """Golden model ``name`` with ``count`` mutations (now and then its bytes flipped
    after them): its bytes and what was done."""
    model = onnx.load_model_from_string(golden_bytes(name))
    done = []
    for _ in range(count):
        kind = draw.choice(sorted(MUTATIONS))
        done.append(f"{kind}: {MUTATIONS[kind](model, draw)}")
    data = model.SerializeToString()
    if draw.integer(0, 7) == 0:
        data, flipped = flip_bytes(data, draw)
        done.append(flipped)
    return data, done


# -- the property ------------------------------------------------------------------------------


class Finding(AssertionError):
    """A fuzzed call broke the property."""


def accepted(error: BaseException) -> bool:
    """A lossgraph error that is not a lossgraph bug."""
    from lossgraph.errors import InternalError, LossgraphError

    return isinstance(error, LossgraphError) and not isinstance(error, InternalError)


def feature_data(name: str, rows: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of features for golden model ``name``, shaped and typed as it takes them."""
    model = onnx.load_model_from_string(golden_bytes(name))
    tensor = model.graph.input[0].type.tensor_type
    shape = [rows, *(d.dim_value for d in tensor.shape.dim[1:])]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def label_data(program: Any, rows: int, classes: int, seed: int = 1) -> np.ndarray:
    """Labels for ``program``, as its manifest declares them (an unknown dim is 1)."""
    entry = program.manifest["graphs"]["evaluate"]
    label = next(v for v in entry["inputs"] if v["role"] == "label")
    shape = [rows, *(d if isinstance(d, int) and d >= 0 else 1 for d in label["shape"][1:])]
    dtype = np.dtype(label["dtype"])
    rng = np.random.default_rng(seed)
    if dtype.kind in "iu":
        return rng.integers(0, classes, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def compile_and_train(name: str, model: bytes, fuse: str) -> str:
    """Compile a mutated golden model, then train it, predict and export: a lossgraph error
    at any stage, or every stage runs. Returns the outcome in a few words; raises anything
    else (a raw exception) as it is."""
    import lossgraph
    from lossgraph.optim import SGD

    try:
        program = lossgraph.compile_program(model, loss=golden_loss(name), fuse=fuse,
                                            optimizer=SGD(0.01))
    except Exception as error:
        if accepted(error):
            return f"compile refused: {type(error).__name__}"
        raise
    X = feature_data(name, 10)
    try:
        y = label_data(program, 10, golden_classes(name))
        trainer = lossgraph.Trainer(program)
        trainer.fit(X, y, epochs=1, batch_size=4, progress=False)
        trainer.evaluate(X, y)
        return _finite_result(trainer, X)
    except Exception as error:
        if accepted(error):
            return f"training refused: {type(error).__name__}"
        raise


# -- options of compile_program and fit --------------------------------------------------------
#
# Options are drawn as plain, picklable tokens (a value, or a string naming one that the
# worker builds: an array, a function, an optimizer instance), so that an example can be
# sent to the sandbox, and printed as its reproduction.

NUMBERS = (0.01, 0.5, 0.0, 1.0, -1.0, 1e10, math.nan, math.inf, "0.1", True, None)
HYPER = {
    "learning_rate": NUMBERS, "momentum": (0.9, 0.0, 1.0, 1.5, -0.1, math.nan),
    "nesterov": (True, False, 1, "yes"), "beta1": (0.9, 0.0, 1.0, -1.0, math.nan),
    "beta2": (0.999, 0.0, 1.0, 2.0, math.nan), "epsilon": (1e-8, 0.0, -1.0, math.nan),
    "weight_decay": (0.01, 0.0, -1.0, math.nan),
    "learning_rate_schedule": ("constant", "invscaling", "optimal", "nope", 3),
    "eta0": (None, 0.1, 0.0, -1.0, math.nan), "power_t": (0.25, 0.0, -1.0, math.nan),
    "alpha": (1e-4, 0.0, -1.0, math.nan), "lr": (0.1,),
}
OPTIMIZER_HYPER = {
    "SGD": ("learning_rate", "learning_rate_schedule", "eta0", "power_t", "alpha", "lr"),
    "Momentum": ("learning_rate", "momentum", "nesterov", "lr"),
    "Adam": ("learning_rate", "beta1", "beta2", "epsilon", "lr"),
    "AdamW": ("learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "lr"),
}
#: Per option of compile_program: values it takes (tokens; "@..." is built by the worker),
#: then values it must refuse.
COMPILE_OPTIONS: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "weights": ((None, "@first", "@all", "@last"),
                ("nope", "@first-and-nope", "@empty", "@first-twice", 3, "@dict", "@bytes",
                 "@constant", "@mixed")),
    "loss": (("@golden", "@golden", "squared_error", "half_squared_error", "absolute_error",
              "elastic", "huber", "binary_log_loss", "logistic", "multiclass_log_loss", "l1",
              "l2"), (None, "nope", "", 3)),
    "loss_options": ((None, {}, {"reduction": "sum"}, {"delta": 0.5}, {"eps": 1e-7},
                      {"weight_name": "w"}, {"output_index": 0}, {"output_index": 1},
                      {"ignore_index": -100}, {"from_logits": True},
                      {"l1_weight": 0.3, "l2_weight": 0.0}, {"loss_name": "@output"}),
                     ({"reduction": "none"}, {"reduction": "x"}, {"reduction": 3},
                      {"delta": -1.0}, {"delta": math.nan}, {"eps": "x"}, {"weight_name": 3},
                      {"weight_name": "X"}, {"label_name": "X"}, {"label_name": ""},
                      {"output_index": -1}, {"output_index": 5}, {"output_index": "a"},
                      {"ignore_index": 1.5}, {"from_logits": "yes"},
                      {"l1_weight": 0.3, "l2_weight": -1.0}, {"nope": 1}, "reduction",
                      ["sum"], {"label_smoothing": 1.0}, {"class_weight": [-1.0, 1.0]},
                      {"class_weight": "balanced"}, {"pos_weight": -1.0})),
    "penalty": ((None, {}, "@first:0.1", "@first:l1l2", "@all:0.01"),
                ("@first:-1", "@first:nan", "@first:str", "@first:l3", "@first:true",
                 {"nope": 0.1}, 0.1, ["coef"])),
    "optimizer": ((None, "sgd", "adam", "adamw", "momentum", "Adam", "@instance", "@instance",
                   "@dict", "@dict"), ("nope", 0.01, "@class")),
    "backend": (("onnx", "onnx", "ort"), ("tf", 3, None)),
    "fuse": (("step", "epoch", "separate"), ("turbo", None, 1)),
    "untie": ((None, False, True, "auto"), ("nope", 3, [], ["nope"])),
    "target": ((None, "default", "onnxruntime-latest", "onnxruntime-1.23", "onnxruntime",
                "ir10-opset21", "@Target"),
               ("ir9-opset13", "ir10-opset12", "ir99-opset21", "ir10-opset99", "mars", 3)),
}
#: Per option of fit: values it takes, then values it must refuse (or that may fail).
FIT_OPTIONS: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "X": (("good", "list", "dict"),
          ("float16", "wide", "nan", "empty", "3d", "strings", "none", "dict-unknown",
           "scalar")),
    "y": (("good", "flat", "list"),
          ("column", "other-dtype", "short", "nan", "none", "big-class", "negative-class",
           "strings")),
    "sample_weight": (("none", "ones"), ("zeros", "negative", "nan", "2d", "short")),
    "epochs": ((1, 2, 0), (-1, 1.5, True, "2", None)),
    "batch_size": ((4, 1, 3, 7, 1000), (0, -1, 2.5, True, "4", None, 1 << 63)),
    "shuffle": ((True, False), (0, 1, "yes", None)),
    "random_state": ((None, 0, 7, "@rng"), (-1, 1.5, "s", 1 << 64)),
    "validation_data": (("none", "good"),
                        ("x-only", "one-tuple", "four-tuple", "narrow", "nan", "strings")),
    "callbacks": (("none", "empty", "one", "list", "stop"), ("string", "list-of-int")),
    "epoch_learning_rate": (("none", "const"),
                            ("nan", "string", "negative", "inf", "not-callable")),
    "progress": ((False, None), ("no",)),
    "warm_start": ((False, True), (1, "y")),
}


def _draw_options(draw: Chooser, pools: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]],
                  always: Sequence[str] = ()) -> dict[str, Any]:
    """Some options (those of ``always`` and about a third of the others) with values they
    take; in half of the examples one of them with a value it must refuse instead."""
    chosen = [o for o in pools if o in always or draw.integer(0, 2) == 0]
    tokens = {option: draw.choice(pools[option][0]) for option in chosen}
    if draw.integer(0, 1):
        bad = draw.choice(sorted(pools))
        tokens[bad] = draw.choice(pools[bad][1])
    return tokens


@functools.cache
def _weights_of(name: str) -> tuple[list[str], list[str]]:
    """The golden model's trained weights (by default) and its other initializers."""
    import lossgraph
    from lossgraph.models import as_model

    model = as_model(golden_bytes(name))
    lowered = lossgraph.lower_ml_ops(model)
    trained = lossgraph.compile_program(lowered, loss=golden_loss(name)).weights
    others = [t.name for t in lowered.graph.initializer if t.name not in trained]
    return trained, others


def _compile_value(option: str, token: Any, name: str, extra: Any) -> Any:
    """The value of a compile option from its token (``extra``: what the token needs)."""
    from lossgraph import optim
    from lossgraph.target import Target

    trained, others = _weights_of(name)
    first = trained[0]
    if not isinstance(token, str) or not token.startswith("@"):
        return token
    if option == "weights":
        return {"@first": first, "@all": trained, "@last": [trained[-1]],
                "@first-and-nope": [first, "nope"], "@empty": [],
                "@first-twice": [first, first], "@dict": {first: 1},
                "@bytes": first.encode(), "@constant": others[:1] or ["nope"],
                "@mixed": [first, 3]}[token]
    if option == "loss":
        return golden_loss(name)
    if option == "loss_options":
        return token
    if option == "penalty":
        target, value = token[1:].split(":")
        names = trained if target == "all" else [first]
        coefficient = {"0.1": 0.1, "0.01": 0.01, "-1": -1.0, "nan": math.nan, "str": "0.1",
                       "l1l2": {"l1": 0.01, "l2": 0.1}, "l3": {"l3": 1.0},
                       "true": True}[value]
        return {n: coefficient for n in names}
    if option == "optimizer":
        kind, hyper = extra
        if token == "@class":
            return getattr(optim, kind)
        if token == "@dict":
            return {"type": kind, **hyper}
        return getattr(optim, kind)(**hyper)
    if option == "target":
        return Target(**extra)
    raise AssertionError(token)


def _fit_value(option: str, token: Any, X: np.ndarray, y: np.ndarray) -> Any:
    rows = len(X)
    if option == "X":
        return {"good": X, "list": X.tolist(), "float16": X.astype(np.float16),
                "wide": np.concatenate([X, X[:, :1]], axis=1), "nan": _with_nan(X),
                "empty": X[:0], "3d": X[:, :, None], "strings": X.astype(str), "none": None,
                "dict": {"@input": X}, "dict-unknown": {"nope": X}, "scalar": 1.0}[token]
    if option == "y":
        other = np.float32 if y.dtype.kind in "iu" else np.int64
        return {"good": y, "flat": y.reshape(rows, -1)[:, 0],
                "column": y.reshape(rows, -1)[:, :1], "other-dtype": y.astype(other),
                "short": y[:-1], "nan": _with_nan(y), "none": None,
                "big-class": np.full_like(y, 99), "negative-class": np.full_like(y, -2),
                "strings": y.astype(str), "list": y.tolist()}[token]
    if option == "sample_weight":
        return {"none": None, "ones": np.ones(rows, X.dtype), "zeros": np.zeros(rows, X.dtype),
                "negative": -np.ones(rows, X.dtype), "nan": _with_nan(np.ones(rows, X.dtype)),
                "2d": np.ones((rows, 2), X.dtype), "short": np.ones(rows - 1, X.dtype)}[token]
    if option == "random_state" and token == "@rng":
        return np.random.default_rng(0)
    if option == "validation_data":
        return {"none": None, "good": (X, y), "x-only": X, "one-tuple": (X,),
                "four-tuple": (X, y, None, None), "narrow": (X[:, :1], y),
                "nan": (_with_nan(X), y), "strings": ("a", "b")}[token]
    if option == "callbacks":
        return {"none": None, "empty": [], "one": lambda t, e, logs: None,
                "list": [lambda t, e, logs: None], "string": "print",
                "list-of-int": [3], "stop": lambda t, e, logs: True}[token]
    if option == "epoch_learning_rate":
        return {"none": None, "const": lambda e: 0.01, "nan": lambda e: math.nan,
                "string": lambda e: "fast", "negative": lambda e: -1.0,
                "inf": lambda e: math.inf, "not-callable": 0.01}[token]
    return token


def _with_nan(array: np.ndarray) -> np.ndarray:
    copy = array.astype(np.float32) if array.dtype.kind not in "f" else array.copy()
    copy.reshape(-1)[len(copy.reshape(-1)) // 2] = np.nan
    return copy


def _finite_result(trainer: Any, X: Any) -> str:
    """After a fit that returned: finite losses and weights, and predictions that run
    (a fit that diverged raises ConvergenceError; it never returns NaN weights)."""
    if not all(math.isfinite(v) for v in trainer.train_losses_):
        raise Finding(f"fit returned with non-finite losses {trainer.train_losses_}")
    bad = [n for n, v in trainer.state.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
    if bad:
        raise Finding(f"fit returned with non-finite weights or states {bad}")
    trainer.predict(X)
    onnx.checker.check_model(trainer.to_inference_model(), full_check=True)
    return "trained"


def compile_and_fit(name: str, compile_tokens: dict[str, Any], extras: dict[str, Any],
                    fit_tokens: dict[str, Any]) -> str:
    """Compile golden model ``name`` with the options ``compile_tokens`` give, then fit it
    with those of ``fit_tokens``: a lossgraph error, or a fit that returns finite numbers
    and a model that predicts and exports."""
    import lossgraph

    try:
        options = {option: _compile_value(option, token, name, extras.get(option))
                   for option, token in compile_tokens.items()}
        if options.get("loss_options") and "loss_name" in options["loss_options"]:
            options["loss_options"] = {"loss_name": "variable"}
        program = lossgraph.compile_program(golden_bytes(name), **options)
    except Exception as error:
        if accepted(error):
            return f"compile refused: {type(error).__name__}"
        raise
    X = feature_data(name, 10)
    input_name = program.manifest["graphs"]["evaluate"]["inputs"][0]["name"]
    try:
        y = label_data(program, 10, golden_classes(name))
        fit = {option: _fit_value(option, token, X, y) for option, token in fit_tokens.items()}
        if isinstance(fit.get("X"), dict) and "@input" in fit["X"]:
            fit["X"] = {input_name: fit["X"]["@input"]}
        trainer = lossgraph.Trainer(program)
        trainer.fit(**fit)
        return _finite_result(trainer, X)
    except Exception as error:
        if accepted(error):
            return f"fit refused: {type(error).__name__}"
        raise


# -- damaged program and checkpoint folders ----------------------------------------------------

#: JSON values a manifest or trainer.json entry is replaced with.
JSON_VALUES: tuple[Any, ...] = (None, 0, -1, 1.5, 1e308, "", "x", "float32", "N", "step",
                                "../evaluate.onnx", [], {}, True, [1, 2], {"a": 1})
BYTE_DAMAGE = ("truncate", "flip", "replace", "append", "insert", "delete", "json", "json",
               "mutate", "mutate")
CHECKSUMS = ("keep", "drop", "recompute")


def _json_mutation(value: Any, path: Sequence[int], action: int, replacement: Any) -> Any:
    """``value`` with the entry at ``path`` (each step an index into the keys or items,
    taken modulo their number) dropped, replaced, or swapped with its neighbour."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return replacement
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)]
    if len(path) == 1 or not isinstance(value[key], (dict, list)) or not value[key]:
        if action == 0:  # drop
            if isinstance(value, dict):
                del value[key]
            else:
                value.pop(key)
            return value
        if action == 1 and len(keys) > 1:  # swap with the next entry's value
            other = keys[(keys.index(key) + 1) % len(keys)]
            value[key], value[other] = value[other], value[key]
            return value
        value[key] = replacement
        return value
    value[key] = _json_mutation(value[key], path[1:], action, replacement)
    return value


def _damage(folder: Path, damage: dict[str, Any]) -> str:
    """Apply ``damage`` to one file of a program or checkpoint folder; what was done."""
    import hashlib
    import json

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    target = files[damage["file"] % len(files)]
    data = target.read_bytes()
    op = damage["op"]
    where = int(damage["at"] * len(data)) if data else 0
    if op == "truncate":
        target.write_bytes(data[:where])
    elif op == "flip":
        flipped = bytearray(data)
        for offset, xor in damage["flips"]:
            if flipped:
                flipped[int(offset * len(flipped)) % len(flipped)] ^= xor or 1
        target.write_bytes(bytes(flipped))
    elif op == "replace":
        target.write_bytes(damage["bytes"])
    elif op == "append":
        target.write_bytes(data + damage["bytes"])
    elif op == "insert":
        target.write_bytes(data[:where] + damage["bytes"] + data[where:])
    elif op == "delete":
        target.unlink()
    elif op == "mutate":  # an ONNX file edited as a model (a graph onnxruntime then loads)
        try:
            model = onnx.load_model_from_string(data)
        except Exception:  # noqa: BLE001  not a model: left as it is
            model = None
        if model is not None and model.HasField("graph"):
            tape = TapeChooser(damage["tape"])
            kind = tape.choice(sorted(MUTATIONS))
            done = MUTATIONS[kind](model, tape)
            target.write_bytes(model.SerializeToString())
            op = f"mutate ({kind}: {done})"
    elif op == "json":
        try:
            value = json.loads(data)
        except ValueError:
            value = None
        if value is not None:
            value = _json_mutation(value, damage["path"], damage["action"],
                                   damage["replacement"])
            target.write_text(json.dumps(value))
    manifest_path = target.parent / "manifest.json"
    if damage["checksums"] != "keep" and manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:
            manifest = None
        if isinstance(manifest, dict):
            if damage["checksums"] == "drop":
                manifest.pop("files", None)
            else:
                manifest["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                     for p in sorted(target.parent.iterdir()) if p.is_file()
                                     and p.name != "manifest.json"}
            manifest_path.write_text(json.dumps(manifest))
    return f"{op} {target.relative_to(folder)} (checksums: {damage['checksums']})"


_SCRATCH: Any = None


def _scratch() -> Path:
    """A folder for what the examples of this process share (removed when it exits)."""
    global _SCRATCH
    if _SCRATCH is None:
        import tempfile

        _SCRATCH = tempfile.TemporaryDirectory(prefix="lossgraph-fuzz-")
    return Path(_SCRATCH.name)


@functools.cache
def _program(name: str, fuse: str = "step") -> Any:
    """Golden model ``name``'s program (SGD at 0.01), compiled once per process."""
    import lossgraph
    from lossgraph.optim import SGD

    return lossgraph.compile_program(golden_bytes(name), loss=golden_loss(name),
                                     optimizer=SGD(0.01), fuse=fuse)


@functools.cache
def _data(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Ten rows of features and labels for golden model ``name``."""
    return feature_data(name, 10), label_data(_program(name), 10, golden_classes(name))


@functools.cache
def _intact(name: str, fuse: str, kind: str) -> Path:
    """The intact program folder (or checkpoint folder, after one ``_train``), saved once."""
    import lossgraph

    folder = _scratch() / f"{kind}-{name}-{fuse}"
    if kind == "program":
        _program(name, fuse).save(folder)
    else:
        _train(lossgraph.Trainer(_program(name, fuse)), *_data(name)).save_checkpoint(folder)
    return folder


@functools.cache
def _reference(name: str, fuse: str) -> dict[str, np.ndarray]:
    """The state the intact program reaches by one ``_train`` from its initial state."""
    import lossgraph

    return _train(lossgraph.Trainer(_program(name, fuse)), *_data(name)).state


def _train(trainer: Any, X: np.ndarray, y: np.ndarray, warm: bool = False) -> Any:
    return trainer.fit(X, y, epochs=1, batch_size=4, shuffle=False, progress=False,
                       warm_start=warm)


def load_damaged(name: str, fuse: str, kind: str, damage: dict[str, Any]) -> str:
    """Damage one file of golden model ``name``'s program folder (or of a checkpoint of it)
    and load it: a lossgraph error, or a program that trains to the numbers the intact one
    reaches (a checkpoint: from the state it holds) and exports a valid model. A file
    whose checksum was recomputed is an edit: it may train to other numbers, but still
    trains, predicts and exports without an error outside lossgraph's."""
    import shutil
    import tempfile

    import lossgraph

    X, y = _data(name)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / kind
        shutil.copytree(_intact(name, fuse, kind), folder)
        done = _damage(folder, damage)
        try:
            if kind == "program":
                trainer = lossgraph.Trainer(lossgraph.TrainingProgram.load(folder))
                expected = _reference(name, fuse)
                trained = _train(trainer, X, y).state
            else:
                trainer = lossgraph.Trainer.load_checkpoint(folder)
                start = lossgraph.Trainer(_program(name, fuse))
                start.set_state(trainer.state)
                expected = _train(start, X, y, warm=True).state
                trained = _train(trainer, X, y, warm=True).state
            trainer.predict(X)
            exported = trainer.to_inference_model()
        except Exception as error:
            if accepted(error):
                return f"load refused: {type(error).__name__}"
            raise
    onnx.checker.check_model(exported, full_check=True)
    if damage["checksums"] == "recompute":
        # The file and its checksum agree: an edit made on purpose, which lossgraph
        # checks against the manifest but cannot tell from the program intended
        # (errors.md, Decisions: "What a checksum proves"). It ran cleanly above.
        return "loaded an edited program"
    if sorted(trained) != sorted(expected):
        raise Finding(f"{done}: the loaded program trains {sorted(trained)}, the intact one "
                      f"{sorted(expected)}")
    for weight, value in expected.items():
        if trained[weight].shape != value.shape or not np.allclose(
                trained[weight], value, rtol=1e-5, atol=1e-6):
            raise Finding(f"{done}: the loaded program trains {weight!r} to other numbers "
                          "than the intact one (a silently wrong program)")
    return "loaded and trained alike"


# -- the command line ---------------------------------------------------------------------------

#: Arguments: "@..." names a file or folder the worker prepares (see run_cli).
CLI_PATHS = ("@model", "@model", "@mutated", "@junk", "@cut-model", "@empty", "@missing",
             "@program", "@damaged-program", "@checkpoint", "@folder", "@data.npz",
             "@data.csv", "@bad.npz", "@bad.csv", "@data-folder", "@out.onnx", "@out",
             "@out.json", "@out.png")
MODEL_PATHS = ("@model", "@model", "@mutated", "@mutated", "@junk", "@cut-model", "@empty",
               "@missing", "@program", "@folder")
PROGRAM_PATHS = ("@program", "@program", "@damaged-program", "@damaged-program",
                 "@checkpoint", "@model", "@missing", "@folder", "@junk")
DATA_PATHS = ("@data.npz", "@data.npz", "@data.csv", "@data-folder", "@bad.npz", "@bad.csv",
              "@missing", "@junk", "@folder")
OUTPUT_FILES = ("@out.onnx", "@out.onnx", "@out.json", "@model", "@missing", "@folder",
                "@program")
OUTPUT_FOLDERS = ("@out", "@out", "@program", "@checkpoint", "@folder", "@model",
                  "@damaged-program")
CLI_OPTIONS: dict[str, tuple[str, ...]] = {
    "--force": (), "--json": (), "--format": ("program", "ort-artifacts", "zip"),
    "--weights": ("@weight", "nope", "@weight @weight", "x"),
    "--loss": ("squared_error", "huber", "multiclass_log_loss", "nope", "none"),
    "--loss-option": ("delta=0.5", "delta", "delta=x", "=1", "eps=-1", "eps=nan"),
    "--weight-name": ("w", "X", ""), "--optimizer": (
        "sgd", "adam", "nesterov", "momentum", "turbo", '{"type": "Adam"}', "{",
        '{"type": "SGD", "learning_rate": -1}', "[]", '{"type": 3}'),
    "--learning-rate": ("0.01", "-1", "nan", "inf", "x", "1e400"),
    "--momentum": ("0.9", "1.5", "nan", "x"), "--penalty-l1": ("0.1", "-1", "nan"),
    "--penalty-l2": ("0.1", "x", "inf"), "--penalty": ('{"@weight": 0.1}', "{}", "[1]",
                                                     "x", '{"@weight": {"l3": 1}}', "null"),
    "--backend": ("onnx", "ort", "tf"), "--fuse": ("step", "epoch", "separate", "turbo"),
    "--target": ("default", "onnxruntime-latest", "ir10-opset21", "mars", "ir99-opset1"),
    "--data": DATA_PATHS, "--features": ("c0", "c0 c1", "X", "x"),
    "--label": ("y", "label", "c0"), "--sample-weight": ("w", "c1"),
    "--validation-split": ("0.2", "0", "1", "0.01", "x", "nan"),
    "--epochs": ("1", "2", "0", "-1", "x", "1.5"),
    "--batch-size": ("4", "0", "-2", "x", "100000000000000000000"),
    "--no-shuffle": (), "--random-state": ("0", "-1", "x", "99999999999999999999999"),
    "--resume": ("@checkpoint", "@checkpoint", "@program", "@missing", "@damaged-program"),
    "--checkpoint": OUTPUT_FOLDERS, "--history": OUTPUT_FILES, "--plot": OUTPUT_FILES,
    "--progress": (), "--no-progress": (), "--external-data": (),
    "--loss-name": ("loss", "variable", ""), "--label-name": ("label", "X"),
    "--output-index": ("0", "1", "-1", "9", "x"), "--reduction": ("mean", "sum", "none"),
    "--outputs": ("@output", "nope"),
    "--help": (), "--version": (),
}
#: Per command: its positional argument's paths, its output's, and its options.
CLI_COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "inspect": (MODEL_PATHS, (), ("--json",)),
    "compile": (MODEL_PATHS, OUTPUT_FOLDERS, (
        "--force", "--format", "--weights", "--loss", "--loss-option", "--weight-name",
        "--optimizer", "--learning-rate", "--momentum", "--penalty-l1", "--penalty-l2",
        "--penalty", "--backend", "--fuse", "--target")),
    "train": (PROGRAM_PATHS, OUTPUT_FILES, (
        "--force", "--data", "--data", "--features", "--label", "--sample-weight",
        "--validation-split", "--epochs", "--batch-size", "--no-shuffle", "--random-state",
        "--resume", "--checkpoint", "--history", "--plot", "--progress", "--no-progress")),
    "export": (PROGRAM_PATHS, OUTPUT_FILES, ("--force", "--external-data", "--target")),
    "add-loss": (MODEL_PATHS, OUTPUT_FILES, (
        "--force", "--loss", "--loss-name", "--label-name", "--weight-name", "--output-index",
        "--reduction", "--penalty", "--loss-option")),
    "gradient": (MODEL_PATHS, OUTPUT_FILES, (
        "--force", "--weights", "--loss-name", "--outputs", "--backend")),
    "lower-ml": (MODEL_PATHS, OUTPUT_FILES, ("--force",)),
    "alphabetize": (MODEL_PATHS, OUTPUT_FILES, ("--force",)),
    "trainable": (MODEL_PATHS, (), ()),
    "ops": ((), (), ()),
}


@functools.cache
def _cli_template(name: str) -> Path:
    """The files every command line of golden model ``name`` may name, prepared once:
    the model, a program, a checkpoint, data files (.npz, .npy folder, .csv)."""
    import lossgraph

    folder = _scratch() / f"cli-{name}"
    folder.mkdir()
    model = golden_bytes(name)
    (folder / "model.onnx").write_bytes(model)
    (folder / "cut-model.onnx").write_bytes(model[:len(model) // 2])
    (folder / "empty.onnx").write_bytes(b"")
    X, y = _data(name)
    _program(name).save(folder / "program")
    _train(lossgraph.Trainer(_program(name)), X, y).save_checkpoint(folder / "checkpoint")
    np.savez(folder / "data.npz", X=X, y=y)
    (folder / "data-folder").mkdir()
    np.save(folder / "data-folder" / "X.npy", X)
    np.save(folder / "data-folder" / "y.npy", y)
    columns = [f"c{i}" for i in range(X.reshape(len(X), -1).shape[1])]
    table = np.concatenate([X.reshape(len(X), -1), y.reshape(len(y), -1)[:, :1]], axis=1)
    (folder / "data.csv").write_text(",".join([*columns, "y"]) + "\n" + "\n".join(
        ",".join(repr(float(v)) for v in row) for row in table) + "\n")
    (folder / "folder").mkdir()
    return folder


def _cli_files(tmp: Path, name: str, mutated: bytes, junk: bytes, damage: dict[str, Any]
               ) -> dict[str, str]:
    """The files and folders the command line's ``@`` words name, in ``tmp``: the
    template's, the mutated model, junk and a damaged program folder."""
    import shutil

    shutil.copytree(_cli_template(name), tmp, dirs_exist_ok=True)
    for file, data in (("mutated.onnx", mutated), ("junk.onnx", junk), ("bad.npz", junk),
                       ("bad.csv", junk)):
        (tmp / file).write_bytes(data)
    shutil.copytree(tmp / "program", tmp / "damaged-program")
    _damage(tmp / "damaged-program", damage)
    paths = {f"@{stem}": str(tmp / file) for stem, file in (
        ("model", "model.onnx"), ("mutated", "mutated.onnx"), ("junk", "junk.onnx"),
        ("cut-model", "cut-model.onnx"), ("empty", "empty.onnx"))}
    for token in ("@program", "@damaged-program", "@checkpoint", "@data.npz", "@data.csv",
                  "@data-folder", "@folder", "@bad.npz", "@bad.csv"):
        paths[token] = str(tmp / token[1:])
    for token in ("@missing", "@out.onnx", "@out", "@out.json", "@out.png"):
        paths[token] = str(tmp / ("new-" + token[1:]))
    program = _program(name)
    paths["@weight"] = program.weights[0]
    paths["@output"] = program.manifest["roles"]["prediction"]
    return paths


def run_cli(name: str, words: list[str], mutated: bytes, junk: bytes,
            damage: dict[str, Any]) -> str:
    """``lossgraph WORDS`` (``@`` words replaced by prepared files): exit status 0, or 2
    with one line on stderr that says ``error:``, no traceback, and nothing written."""
    import contextlib
    import io
    import tempfile

    from lossgraph.cli import main

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        paths = _cli_files(tmp, name, mutated, junk, damage)
        argv = []
        for word in words:
            for part in word.split(" "):
                argv.append(paths.get(part, part) if part.startswith("@") else
                            part.replace("@weight", paths["@weight"]))
        before = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv)
        after = {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
    shown = " ".join(argv).replace(folder, "<tmp>")
    message = err.getvalue().replace(folder, "<tmp>")
    if status not in (0, 2):
        raise Finding(f"lossgraph {shown} exited {status}: {message}")
    if "Traceback" in message or "bug in lossgraph" in message:
        raise Finding(f"lossgraph {shown} exited {status}: {message}")
    if status == 2:
        # a warning (a deprecated spelling the line used) is a line of its own, by design
        lines = [line for line in message.splitlines(keepends=True) if ": warning: " not in line]
        if len(lines) != 1 or not lines[0].endswith("\n") or "error:" not in lines[0]:
            raise Finding(f"lossgraph {shown} exited 2 without one error line: {message!r}")
        if after != before:
            changed = sorted(str(p.relative_to(tmp)) for p in set(before) ^ set(after)
                             | {p for p in before if p in after and before[p] != after[p]})
            raise Finding(f"lossgraph {shown} exited 2 but wrote {changed}: {message}")
        return f"exit 2: {message.split('error:')[1].strip()[:60]}"
    return "exit 0"


# -- the sandbox -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a call in the sandbox gave: ``kind`` is "ok" (``detail`` is the call's result),
    "raised" (a raw exception: ``detail`` its traceback), "crashed" (the process died:
    ``detail`` says how) or "hung" (no answer in time)."""

    kind: str
    detail: str


def serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop: ``(function name, args)`` in, ``(kind, detail)`` out."""
    from multiprocessing.connection import Connection

    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    module = sys.modules[__name__]
    while True:
        try:
            function, args = inbox.recv()
        except EOFError:
            return
        try:
            result = getattr(module, function)(*args)
        except BaseException:
            outbox.send(("raised", traceback.format_exc()))
        else:
            outbox.send(("ok", str(result)))


class Sandbox:
    """A worker process that runs functions of this module, so that a native crash or a hang
    of onnxruntime is an outcome, not the end of the test run; it is restarted after one.

    The worker is a fresh interpreter (``python -c``, tests/ and the caller's ``sys.path``
    on its path, importing this module as ``support.fuzzing``), talking over two pipes of
    its own: onnxruntime's native output on stdout and stderr cannot garble the answers."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._process: subprocess.Popen | None = None
        self._inbox: Any = None
        self._outbox: Any = None

    def _start(self) -> None:
        from multiprocessing.connection import Connection

        to_worker, from_parent = os.pipe()
        from_worker, to_parent = os.pipe()
        path = [str(Path(__file__).resolve().parents[1]), *sys.path]
        code = (f"import sys; sys.path[:0] = {path!r}; import support.fuzzing as fuzzing; "
                f"fuzzing.serve({to_worker}, {to_parent})")
        self._process = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=(to_worker, to_parent),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_worker)
        os.close(to_parent)
        self._outbox = Connection(from_parent, readable=False)
        self._inbox = Connection(from_worker, writable=False)

    def call(self, function: str, *args: Any) -> Outcome:
        """``function(*args)`` in the worker."""
        if self._process is None or self._process.poll() is not None:
            self.close()
            self._start()
        try:
            self._outbox.send((function, args))
            answered = self._inbox.poll(self.timeout)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            answered = True  # it died: recv says so below
        if not answered:
            self.close(wait=0)
            return Outcome("hung", f"no answer after {self.timeout:.0f} s")
        try:
            kind, detail = self._inbox.recv()
        except (EOFError, ConnectionResetError):
            assert self._process is not None
            code = self._process.wait(10)
            self.close(wait=0)
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            return Outcome("crashed", f"the worker died ({how})")
        return Outcome(kind, detail)

    def close(self, wait: float = 10) -> None:
        """End the worker: its input closed, it exits (and removes its scratch folder);
        killed if it has not within ``wait`` seconds."""
        if self._process is not None:
            self._outbox.close()
            try:
                self._process.wait(wait)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)
            self._inbox.close()
        self._process = self._inbox = self._outbox = None


def _crash_for_test() -> None:
    """Die as a native crash does (the sandbox's own test)."""
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)


def _hang_for_test() -> None:
    import time

    time.sleep(600)


def _echo_for_test(value: Any) -> Any:
    return value


# -- examples, drawn ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One fuzzed call: the function of this module to run, its arguments, and in words
    what it is (a failure prints it)."""

    function: str
    args: tuple
    words: str


def _bytes(draw: Chooser, longest: int = 64) -> bytes:
    return bytes(draw.integer(0, 255) for _ in range(draw.integer(0, longest)))


def draw_model(draw: Chooser) -> Example:
    """A golden model with one to three mutations, compiled and trained in one fuse mode."""
    name = draw.choice(GOLDEN)
    model, done = mutate(name, draw, draw.integer(1, 3))
    fuse = draw.choice(("step", "epoch", "separate"))
    return Example("compile_and_train", (name, model, fuse),
                   f"{name} (fuse={fuse!r}) with " + "; ".join(done))


def draw_options(draw: Chooser) -> Example:
    """A golden model compiled and fitted with values drawn for some options."""
    name = draw.choice(GOLDEN)
    tokens = _draw_options(draw, COMPILE_OPTIONS, always=("loss",))
    extras: dict[str, Any] = {}
    if tokens.get("optimizer") in ("@class", "@instance", "@dict"):
        kind = draw.choice(sorted(OPTIMIZER_HYPER))
        hyper = {}
        for key in OPTIMIZER_HYPER[kind]:
            # an unknown keyword of a constructor is Python's TypeError: dict forms only
            if draw.integer(0, 2) == 0 and (key != "lr" or tokens["optimizer"] == "@dict"):
                hyper[key] = draw.choice(HYPER[key])
        extras["optimizer"] = (kind, hyper)
    if tokens.get("target") == "@Target":
        extras["target"] = {"ir_version": draw.choice((10, 9, 0, 99, "10")),
                            "max_opset": draw.choice((21, 18, 13, 12, 30)),
                            "training": draw.choice((False, True))}
    fit = _draw_options(draw, FIT_OPTIONS, always=("X", "y", "progress"))
    return Example("compile_and_fit", (name, tokens, extras, fit),
                   f"{name}: compile_program({tokens}, {extras}), fit({fit})")


def draw_damage(draw: Chooser) -> dict[str, Any]:
    op = draw.choice(BYTE_DAMAGE)
    return {"file": draw.integer(0, 30), "op": op, "at": draw.choice((0.0, 0.1, 0.5, 0.9, 0.99)),
            "flips": [(draw.choice((0.0, 0.05, 0.3, 0.5, 0.8, 0.97)), draw.integer(0, 255))
                      for _ in range(draw.integer(1, 4))],
            "bytes": _bytes(draw), "path": [draw.integer(0, 12) for _ in range(draw.integer(1, 6))],
            "action": draw.integer(0, 2), "replacement": draw.choice(JSON_VALUES),
            "tape": [draw.integer(0, 1 << 16) for _ in range(draw.integer(4, 12))],
            "checksums": draw.choice(CHECKSUMS)}


def draw_storage(draw: Chooser) -> Example:
    """A program or checkpoint folder of a golden model with one file damaged, loaded."""
    name = draw.choice(GOLDEN)
    fuse = draw.choice(("step", "epoch", "separate"))
    kind = draw.choice(("program", "checkpoint"))
    damage = draw_damage(draw)
    return Example("load_damaged", (name, fuse, kind, damage),
                   f"{kind} of {name} (fuse={fuse!r}) damaged by {damage}")


def draw_cli(draw: Chooser) -> Example:
    """A command line: a command, its argument and output, and options drawn from the
    command's own (now and then another command's, or none of them)."""
    name = draw.choice(GOLDEN)
    command = draw.choice(sorted(CLI_COMMANDS) + ["", "fly"])
    positional, outputs, options = CLI_COMMANDS.get(command, ((), (), ()))
    words = [command] if command else []
    if positional and draw.integer(0, 9):
        words.append(draw.choice(positional))
    if outputs and draw.integer(0, 9):
        words += ["-o", draw.choice(outputs)]
    if command == "train" and draw.integer(0, 9):
        words += ["--data", draw.choice(DATA_PATHS)]
    for _ in range(draw.integer(0, 4)):
        option = draw.choice(options if options and draw.integer(0, 9) else sorted(CLI_OPTIONS))
        words.append(option)
        if CLI_OPTIONS[option]:
            words.append(draw.choice(CLI_OPTIONS[option]))
    mutated, _ = mutate(name, draw, draw.integer(1, 2))
    return Example("run_cli", (name, words, mutated, _bytes(draw), draw_damage(draw)),
                   f"lossgraph {' '.join(words)} (files of {name})")


FAMILIES: dict[str, Callable[[Chooser], Example]] = {
    "models": draw_model, "options": draw_options, "storage": draw_storage, "cli": draw_cli}


def run_example(example: Example, sandbox: Sandbox | None = None) -> str:
    """Run ``example`` (in ``sandbox`` when given, else here); its outcome, or a
    :class:`Finding` saying how it broke the property."""
    if sandbox is None:
        try:
            return getattr(sys.modules[__name__], example.function)(*example.args)
        except Finding:
            raise
        except Exception as error:
            raise Finding(f"{example.words}\nraised {type(error).__name__}: {error}") from error
    outcome = sandbox.call(example.function, *example.args)
    if outcome.kind != "ok":
        raise Finding(f"{example.words}\n{outcome.kind}: {outcome.detail}")
    return outcome.detail


# -- a quick exploration, outside pytest -----------------------------------------------------


def explore(family: str, examples: int, seed: int, out: Path) -> None:
    """Run ``examples`` random examples of ``family`` in a sandbox; print the tally and save
    each failure's example under ``out``."""
    import pickle

    out.mkdir(parents=True, exist_ok=True)
    sandbox = Sandbox(timeout=60)
    tally: dict[str, int] = {}
    try:
        for index in range(examples):
            example = FAMILIES[family](RandomChooser(seed * 1_000_003 + index))
            try:
                key = run_example(example, sandbox)
            except Finding as finding:
                key = "FINDING"
                stem = out / f"{family}-{seed}-{index}"
                stem.with_suffix(".pickle").write_bytes(
                    pickle.dumps((example.function, example.args, example.words)))
                stem.with_suffix(".txt").write_text(str(finding))
                last = str(finding).strip().splitlines()[-1][:300]
                print(f"[{index}] {example.words[:300]}\n    {last}", flush=True)
            tally[key] = tally.get(key, 0) + 1
    finally:
        sandbox.close()
    for key, count in sorted(tally.items(), key=lambda kv: -kv[1]):
        print(f"{count:6d}  {key}")


if __name__ == "__main__":
    explore(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
            Path(sys.argv[4]) if len(sys.argv) > 4 else Path("/tmp/lossgraph-fuzz"))
