"""Small test models, written in ONNX text syntax and read by ``onnx.parser``.

    model("(double[3, 4] x, double[4] w) => (double[3, 4] y)", "y = Mul(x, w)", opset=18)

is the model of the graph ``g (double[3, 4] x, double[4] w) => (double[3, 4] y) { y = Mul(x, w) }``
importing ai.onnx at opset 18 (and any ``domains={"ai.onnx.ml": 3}``), at the lowest IR
version that opset allows. :func:`model_of_graph` wraps a ``GraphProto`` built otherwise
(``onnx.helper``) the same way; :func:`parse_model` reads a whole model's text, scalars
included; :func:`signature` writes a signature from example arrays.
:data:`UNSORTED` is a model whose weights' alphabetical order differs from their graph
order, read in ``If`` branches; :data:`NET` a dense layer whose weights' order differs too;
:data:`ROUNDED` a model whose weights reach its output only through ops of zero gradient;
:data:`CHANGED_OPS` (:func:`changed_op_model`) models whose ops changed meaning or arrived
after opset 21; :func:`image_scaler` one at opset 7 with an op onnx removed;
:func:`large_weights_model` one whose weight is large enough to be set aside for onnx's
checker and held apart while compile's passes run (``lossgraph.graphs.HeldWeights``), and
:func:`read_state_model` one large enough for a program to read its state from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: The element type of an array as ONNX text spells it.
TEXT_TYPE = {np.dtype(np.float64): "double", np.dtype(np.float32): "float",
             np.dtype(bool): "bool", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}


def ir_version(opset: int) -> int:
    """The lowest IR version the checker accepts with ai.onnx ``opset`` (10 from opset 21)."""
    return 10 if opset >= 21 else 8


def model_of_graph(graph: onnx.GraphProto, *, opset: int = 18,
                   domains: Mapping[str, int] | None = None) -> onnx.ModelProto:
    """``graph`` as a model importing ai.onnx ``opset`` first, then each of ``domains``."""
    imports = [helper.make_opsetid("", opset),
               *(helper.make_opsetid(name, version) for name, version in (domains or {}).items())]
    return helper.make_model(graph, ir_version=ir_version(opset), opset_imports=imports)


def model(signature: str, body: str, *, opset: int = 18,
          domains: Mapping[str, int] | None = None) -> onnx.ModelProto:
    """The model of graph ``g signature { body }`` (ONNX text syntax).

    ``signature`` is ``(inputs) => (outputs)``, optionally followed by initializers
    ``<double k = {2}>``; ``body`` is the nodes, one ``y = Op <attr = 1> (x)`` each.
    """
    return model_of_graph(onnx.parser.parse_graph(f"g {signature} {{ {body} }}"),
                          opset=opset, domains=domains)


def parse_model(text: str) -> onnx.ModelProto:
    """A whole model in ONNX text syntax, its ``double[]`` values given the scalar shape the
    parser leaves out."""
    parsed = onnx.parser.parse_model(text)
    for value in (*parsed.graph.input, *parsed.graph.output):
        if not value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.SetInParent()
    return parsed


def dims(shape: Iterable[int | str]) -> str:
    """``3, 4`` for shape (3, 4), as written between the brackets of ``double[3, 4]``."""
    return ", ".join(str(d) for d in shape)


def declaration(name: str, array: np.ndarray) -> str:
    """``double[3, 4] x`` for an input ``x`` shaped and typed like ``array``."""
    kind = TEXT_TYPE[array.dtype]
    return f"{kind} {name}" if array.ndim == 0 else f"{kind}[{dims(array.shape)}] {name}"


def signature(inputs: Mapping[str, np.ndarray], outputs: str) -> str:
    """``(double[3, 4] x, ...) => (outputs)``: the inputs declared like their example arrays."""
    return f"({', '.join(declaration(k, v) for k, v in inputs.items())}) => ({outputs})"


# Weights named so that alphabetical order (a_bias, z_weight) differs from graph order.
UNSORTED = """
    <ir_version: 8, opset_import: ["" : 18]>
    net (float[N, 3] x, bool flag) => (float[N, 2] y)
    <float[3, 2] z_weight = {1, 2, 3, 4, 5, 6}, float[2] a_bias = {0.5, -0.5}>
    {
        h = MatMul(x, z_weight)
        y = If(flag) <
            then_branch = g1 () => (float[N, 2] t) { t = Add(h, a_bias) },
            else_branch = g2 () => (float[N, 2] e) { e = Sub(h, a_bias) }
        >
    }
"""


#: A dense layer of two outputs whose weights' alphabetical order (a_bias, z_weight) differs
#: from their graph order, the command-line tests' model (tests/cli/conftest.py's model_file).
NET = """
    <ir_version: 8, opset_import: ["" : 18]>
    net (float[N, 3] x) => (float[N, 2] y)
    <float[3, 2] z_weight = {1, 2, 3, 4, 5, 6}, float[2] a_bias = {0.5, -0.5}>
    { h = MatMul(x, z_weight)
      y = Add(h, a_bias) }
"""


#: Weights w and v reach y only through Round and Sign, whose gradient is zero wherever it
#: exists: training can never change them (b learns).
ROUNDED = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 2] x) => (float[N, 1] y)
    <float[2, 1] w = {1, 2}, float[2, 1] v = {3, 4}, float[1] b = {0.5}>
    {
        h = MatMul(x, w)
        r = Round(h)
        k = MatMul(x, v)
        s = Sign(k)
        t = Add(r, s)
        u = Add(t, h)
        y = Add(t, b)
    }
"""


#: Models whose ops changed after opset 21, by what each shows, as ``(opset, signature,
#: body)`` for :func:`model`; each trains its weight ``w`` behind the changed op (which no
#: gradient passes). ``pool``: AveragePool with ceil_mode=1, whose meaning opset 22 changed;
#: ``swish``: Swish, an op of opset 24; ``fp4``: a Cast through float4e2m1, a type of opset
#: 23; ``crd``: SpaceToDepth's mode, an attribute of opset 28, not at its default.
CHANGED_OPS: dict[str, tuple[int, str, str]] = {
    "pool": (22, "(float[N, 1, 5, 5] x) => (float[N, 1] y) <float[9, 1] w = {1, 2, 3, 4, 5, 6, "
                 "7, 8, 9}>",
             "p = AveragePool <kernel_shape = [2, 2], strides = [2, 2], ceil_mode = 1> (x) "
             "f = Flatten(p)  y = MatMul(f, w)"),
    "swish": (24, "(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
              "s = Swish(x)  y = MatMul(s, w)"),
    "fp4": (23, "(float[N, 4] x) => (float[N, 1] y) <float[4, 1] w = {1, 2, 3, 4}>",
            "c = Cast <to = 23> (x)  d = Cast <to = 1> (c)  y = MatMul(d, w)"),
    "crd": (28, "(float[N, 4, 2, 2] x) => (float[N, 1] y) <float[16, 1] w = {1, 2, 3, 4, 5, 6, "
                "7, 8, 9, 10, 11, 12, 13, 14, 15, 16}>",
            "s = SpaceToDepth <blocksize = 2, mode = \"CRD\"> (x)  f = Flatten(s)  "
            "y = MatMul(f, w)"),
}


def changed_op_model(kind: str, opset: int | None = None) -> onnx.ModelProto:
    """The model of :data:`CHANGED_OPS` ``kind``, at its opset or at ``opset``."""
    version, signature_text, body = CHANGED_OPS[kind]
    return model(signature_text, body, opset=opset or version)


def image_scaler() -> onnx.ModelProto:
    """An opset 7 model with ImageScaler, an experimental op onnx removed at opset 10."""
    node = helper.make_node("ImageScaler", ["x"], ["s"], name="scale", scale=2.0)
    product = helper.make_node("MatMul", ["s", "w"], ["y"])
    graph = helper.make_graph(
        [node, product], "old", [helper.make_tensor_value_info("x", 1, ["N", 1, 1, 4])],
        [helper.make_tensor_value_info("y", 1, ["N", 1, 1, 1])],
        [helper.make_tensor("w", 1, [4, 1], [1.0, 2.0, 3.0, 4.0])])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 7)])


#: The shapes of :func:`large_weights_model`'s float32 weights: ``W`` 128 KiB, large enough
#: to be set aside (``lossgraph.graphs.without_weight_data``) and held apart, ``S`` 2 KiB.
BIG, SMALL = (256, 128), (128, 4)


def large_weights_model(big: onnx.TensorProto | None = None, copied: bool = False
                        ) -> onnx.ModelProto:
    """``y = Reshape(x @ W, shape) @ S``: a large weight ``W`` (or ``big``), a small one
    ``S`` and an int64 constant that shape inference reads; ``copied``: ``x @ W + x @ C``,
    ``C`` a copy of ``W`` (what ``lossgraph.analysis.folded_weights`` reports)."""
    from onnx import TensorProto, numpy_helper

    rng = np.random.default_rng(0)
    weights = [big or numpy_helper.from_array(rng.standard_normal(BIG, np.float32), "W"),
               numpy_helper.from_array(rng.standard_normal(SMALL, np.float32), "S"),
               numpy_helper.from_array(np.array([-1, 128], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Reshape", ["h", "shape"], ["r"]),  # reads its constant
             helper.make_node("MatMul", ["r", "S"], ["y"])]
    if copied:
        weights.append(numpy_helper.from_array(numpy_helper.to_array(weights[0]), "C"))
        nodes[:1] = [helper.make_node("MatMul", ["x", "W"], ["w"]),
                     helper.make_node("MatMul", ["x", "C"], ["c"]),
                     helper.make_node("Add", ["w", "c"], ["h"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", BIG[0]])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["N", 4])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def saved(model: onnx.ModelProto, path, external: bool = False):
    """``model`` saved at ``path`` (``external``: its tensors of 1 KiB and more in the
    data file ``m.data`` beside it; ``model`` is not changed); the path."""
    if external:  # onnx.save moves the data out of the model it is given: a copy
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save(copy, path, save_as_external_data=True, location="m.data",
                  size_threshold=1024)
    else:
        onnx.save(model, path)
    return path


def read_state_model() -> onnx.ModelProto:
    """:func:`large_weights_model` whose ``W`` is 64 MiB (256 x 65536), the size from which
    a program compiled from the ModelProto reads its initial state from it
    (``lossgraph.initial_state.READ_MIN_BYTES``) rather than keep a copy."""
    wide = np.random.default_rng(1).standard_normal((BIG[0], 2**16), np.float32) / 256
    return large_weights_model(numpy_helper.from_array(wide, "W"))


def residual_stack(layers: int = 8, width: int = 16, outputs: int = 1) -> onnx.ModelProto:
    """``h_k = tanh(h_{k-1} W_k) + h_{k-1}`` for ``layers`` layers from ``h_{-1} = x``,
    then ``y = h W_out`` (``outputs`` columns): float32, a free batch, a cut (a value every
    path passes through) after each layer, for recomputation's segments."""
    rng = np.random.default_rng(0)
    initializers, nodes, h = [], [], "x"
    for k in range(layers):
        initializers.append(numpy_helper.from_array(
            (rng.normal(size=(width, width)) / 4).astype(np.float32), f"W{k}"))
        nodes += [helper.make_node("MatMul", [h, f"W{k}"], [f"a{k}"]),
                  helper.make_node("Tanh", [f"a{k}"], [f"t{k}"]),
                  helper.make_node("Add", [f"t{k}", h], [f"h{k}"])]
        h = f"h{k}"
    initializers.append(numpy_helper.from_array(
        rng.normal(size=(width, outputs)).astype(np.float32), "W_out"))
    nodes.append(helper.make_node("MatMul", [h, "W_out"], ["y"]))
    graph = helper.make_graph(
        nodes, "residual_stack",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", outputs])],
        initializers)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def tower(dropout: bool = False, norm: bool = False) -> onnx.ModelProto:
    """x -> tanh(x W1) = h1 -> tanh(h1 W2) + h1 = h2 (a residual) -> sigmoid -> y = . W3:
    three segments, float32, a free batch, whose backward reads W2 and W3 (the products
    with the activations' gradients); ``dropout``: a training-mode Dropout on h1; ``norm``:
    a training-mode BatchNormalization before the first Tanh (running statistics, buffers
    the training graphs write)."""
    rng = np.random.default_rng(0)
    weights = {"W1": rng.normal(size=(3, 4)), "W2": rng.normal(size=(4, 4)) / 2,
               "W3": rng.normal(size=(4, 1))}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a1"]),
             helper.make_node("Tanh", ["a1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "W2"], ["a2"]),
             helper.make_node("Tanh", ["a2"], ["t2"]),
             helper.make_node("Add", ["t2", "h1"], ["h2"]),
             helper.make_node("Sigmoid", ["h2"], ["s"]),
             helper.make_node("MatMul", ["s", "W3"], ["y"])]
    constants = {}
    if dropout:
        nodes[2].input[0] = "d1"
        nodes.insert(2, helper.make_node("Dropout", ["h1", "ratio", "training"], ["d1"],
                                         seed=3))
        constants.update(ratio=np.array(0.25, np.float32), training=np.array(True))
    if norm:
        weights.update(scale=np.ones(4), bias=np.zeros(4), mean=np.zeros(4), var=np.ones(4))
        nodes[1].input[0] = "n1"
        nodes.insert(1, helper.make_node("BatchNormalization",
                                         ["a1", "scale", "bias", "mean", "var"],
                                         ["n1", "mean_out", "var_out"], training_mode=1))
    initializers = [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()]
    initializers += [numpy_helper.from_array(v, n) for n, v in constants.items()]
    graph = helper.make_graph(
        nodes, "tower", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])], initializers)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def embedding_bag(vocabulary: int = 50, width: int = 4, tokens: int = 6) -> onnx.ModelProto:
    """ids (int64, ``tokens`` a row) -> the mean of their rows of ``table`` (a vocabulary by
    ``width`` embedding, read by a Gather alone) -> y = . W: float32, a free batch."""
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(rng.normal(size=(vocabulary, width)).astype(np.float32), "table"),
        numpy_helper.from_array(rng.normal(size=(width, 1)).astype(np.float32), "W")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("ReduceMean", ["e"], ["m"], axes=[1], keepdims=0),
             helper.make_node("MatMul", ["m", "W"], ["y"])]
    graph = helper.make_graph(
        nodes, "embedding_bag",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", tokens])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])], initializers)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def gelu_mlp(width: int = 8, viewed: bool = False) -> onnx.ModelProto:
    """x -> x W1 + b1 = a -> GELU as torch's exporter decomposes it,
    ``Mul(Mul(a, Add(Erf(Div(a, sqrt 2)), 1)), 0.5)`` = g -> y = g W2: float32, a free
    batch. The backward reads ``a`` and three of the GELU's intermediates (``u``, ``b``,
    ``g``), each computed from ``a`` by elementwise ops. ``viewed``: the product reads
    ``f = Reshape(g, Shape(a))`` instead of ``g``, as GPT-2's exported ``Conv1D`` reads a
    reshaped GELU output (the backward then reads ``f``, and ``g`` for its shape)."""
    rng = np.random.default_rng(0)
    arrays = {"W1": rng.normal(size=(3, width)), "b1": rng.normal(size=width) / 4,
              "W2": rng.normal(size=(width, 1)) / 2}
    initializers = [numpy_helper.from_array(w.astype(np.float32), n) for n, w in arrays.items()]
    initializers += [numpy_helper.from_array(np.array(v, np.float32), n)
                     for n, v in (("root2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["p"]),
             helper.make_node("Add", ["p", "b1"], ["a"]),
             helper.make_node("Div", ["a", "root2"], ["u"]),
             helper.make_node("Erf", ["u"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["b"]),
             helper.make_node("Mul", ["a", "b"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["g"])]
    if viewed:
        nodes += [helper.make_node("Shape", ["a"], ["s"]),
                  helper.make_node("Reshape", ["g", "s"], ["f"])]
    nodes.append(helper.make_node("MatMul", ["f" if viewed else "g", "W2"], ["y"]))
    graph = helper.make_graph(
        nodes, "gelu_mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])], initializers)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
