"""lossgraph/graphs/facts.py: the shapes ``ForwardFacts`` computes from the static dims of a
value whose batch is symbolic, and ``infer_shapes_with_data``.

torch's legacy exporter writes ``x.chunk(2, dim=1)`` as a Slice whose end is
``Div(Shape(x)[1] + 1, 2) * 1``; onnx's data propagation stops at the ``Div``, so the Slice,
and the channels of the grouped Conv after it (torchvision's ShuffleNetV2), had no static
shape, and the Conv's gradient refused the model. ``infer_shapes_with_data`` gives onnx's
types with data propagation, the long float vectors (an epoch graph's packed weights) kept
out of it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.data_propagation import (
    LONG,
    long_vector_readers,
    long_vectors,
    nodes,
    recording_data_propagation,
    types,
    wide_program,
)
from support.models import model
from support.torch_steps import (
    assert_gradients_like_torch,
    assert_steps_like_torch,
    legacy_export,
    make_distinct,
    torch_mse,
)

import lossgraph
from lossgraph.graphs import LONG_VECTOR, ForwardFacts, infer_shapes_with_data
from lossgraph.optim import SGD

#: ``x.chunk(2, dim=1)[0]`` as the legacy exporter writes it, into a grouped Conv
CHUNK = ("(float[N, 4, 6, 6] x) => (float[N, 2, 4, 4] y) "
         "<float[2, 1, 3, 3] w = {" + ", ".join(["0.1"] * 18) + "}, float[2] b = {0.5, -0.5}>",
         "shape = Shape(x) "
         "index = Constant <value = int64[1] {1}> () "
         "channels = Gather <axis = 0> (shape, index) "
         "zero = Constant <value = int64[1] {0}> () "
         "one = Constant <value = int64[1] {1}> () "
         "plus_one = Add(channels, one) "
         "two = Constant <value = int64[1] {2}> () "
         "half = Div(plus_one, two) "
         "end = Mul(half, one) "
         "first = Slice(x, zero, end, one) "
         "y = Conv <group = 2> (first, w, b)")


def test_the_facts_find_the_channels_of_a_slice_ended_by_shape_arithmetic():
    net = model(*CHUNK, opset=17)
    inferred = onnx.shape_inference.infer_shapes(net, data_prop=True).graph
    onnx_alone = {v.name: v.type.tensor_type.shape for v in inferred.value_info}["first"]
    assert not onnx_alone.dim[1].HasField("dim_value")  # why lossgraph computes it
    facts = ForwardFacts.of(net)
    assert facts.shapes["first"][1:] == (2, 6, 6)
    assert isinstance(facts.shapes["first"][0], str)  # the batch stays symbolic
    # only the types are richer: the nodes are the model's, the values are not constants
    assert [n.op_type for n in facts._graph.node] == [n.op_type for n in net.graph.node]
    assert "end" not in facts.constants and "half" not in facts.constants


@pytest.mark.parametrize("body, expected", [
    ("s = Shape(x) i = Constant <value = int64 {-3}> () t = Gather(s, i) ", 4),
    ("s = Shape <start = 1> (x) t = Size(s) ", 3),
    ("s = Shape(x) a = Constant <value = int64[1] {1}> () b = Constant <value = int64[1] {3}> () "
     "t = Slice(s, a, b) ", [4, 6]),
    ("s = Shape <start = -2> (x) c = Cast <to = 6> (s) t = Identity(c) ", [6, 6]),
    ("s = Shape(x) i = Constant <value = int64 {2}> () g = Gather(s, i) "
     "a = Constant <value = int64[1] {0}> () u = Unsqueeze(g, a) t = Squeeze(u, a) ", 6),
    ("s = Shape <start = 2> (x) k = Constant <value = int64[1] {5}> () "
     "t = Concat <axis = 0> (k, s) ", [5, 6, 6]),
], ids=["gather", "size", "slice", "cast", "unsqueeze_squeeze", "concat"])
def test_values_the_static_dims_fix_feed_shapes(body, expected):
    """Each op through which a static dim is followed, its value then the target of a
    Reshape that onnx alone leaves unknown (Div by 1 stops its data propagation)."""
    from lossgraph.graphs.facts import _static_dim_values

    net = model("(float[N, 4, 6, 6] x) => (float[M] y)",
                body + "one = Constant <value = int64 {1}> () q = Div(t, one) "
                "f = Constant <value = int64[1] {-1}> () r = Reshape(q, f) "
                "e = Cast <to = 1> (r) y = Identity(e)", opset=17)
    inferred = onnx.shape_inference.infer_shapes(net, data_prop=True)
    types = {v.name: v.type for v in (*inferred.graph.value_info, *inferred.graph.input)}
    found = _static_dim_values(inferred.graph, types, set())
    np.testing.assert_array_equal(found["t"], expected)
    assert ForwardFacts.of(net).shapes["q"] == np.shape(expected)


def test_a_dim_that_is_not_static_stays_unknown():
    """The batch is not a number: nothing computed from it is folded."""
    net = model("(float[N, 4] x) => (float[K, 2] y)",
                "s = Shape(x) i = Constant <value = int64[1] {0}> () n = Gather(s, i) "
                "two = Constant <value = int64[1] {2}> () h = Div(n, two) "
                "t = Concat <axis = 0> (h, two) y = Reshape(x, t)", opset=17)
    assert not isinstance(ForwardFacts.of(net).shapes["y"][0], int)


def test_the_grouped_conv_after_the_chunk_trains_like_finite_differences(rng):
    """The hand-written chunk: compiled, trained one step (its gradient checked against
    central differences of the loss in float64)."""
    net = model(*CHUNK, opset=17)
    X = rng.normal(size=(3, 4, 6, 6)).astype(np.float32)
    y = rng.normal(size=(3, 2, 4, 4)).astype(np.float32)
    program = lossgraph.compile_program(net, optimizer=SGD(0.1))
    trainer = lossgraph.Trainer(program)
    before = {k: v.astype(np.float64) for k, v in trainer.state.items()}
    trainer.fit(X, y, epochs=1, batch_size=3, shuffle=False, progress=False)
    after = trainer.state

    def loss(w: np.ndarray, b: np.ndarray) -> float:
        import onnx.reference

        weights = {"w": w, "b": b}
        f64 = onnx.ModelProto()
        f64.CopyFrom(net)
        for tensor in f64.graph.initializer:
            tensor.CopyFrom(onnx.numpy_helper.from_array(weights[tensor.name].astype(np.float64),
                                                         tensor.name))
        for value in (*f64.graph.input, *f64.graph.output):
            value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
        out = onnx.reference.ReferenceEvaluator(f64).run(None, {"x": X.astype(np.float64)})[0]
        return float(((out - y) ** 2).mean())

    for name in ("w", "b"):
        gradient = np.zeros_like(before[name])
        for index in np.ndindex(gradient.shape):
            up, down = dict(before), dict(before)
            up[name], down[name] = before[name].copy(), before[name].copy()
            up[name][index] += 1e-6
            down[name][index] -= 1e-6
            gradient[index] = (loss(up["w"], up["b"]) - loss(down["w"], down["b"])) / 2e-6
        np.testing.assert_allclose(after[name], before[name] - 0.1 * gradient, rtol=1e-4,
                                   atol=1e-6, err_msg=name)


# -- torch's exports --------------------------------------------------------------------------

torch_only = pytest.mark.torch


def _legacy_export(net, example: np.ndarray) -> onnx.ModelProto:
    """``net`` exported by the legacy exporter, its batch free, the shape arithmetic left
    unfolded as a dynamic batch leaves it."""
    return legacy_export(net, example, do_constant_folding=False)


def _chunk_net():
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, groups=2)

        def forward(self, x):
            return self.conv(x.chunk(2, dim=1)[0])

    torch.manual_seed(0)
    return Chunk()


@torch_only
def test_the_legacy_chunk_into_a_grouped_conv_has_torchs_gradient_and_trains_like_torch():
    import torch

    net = _chunk_net()
    rng = np.random.default_rng(1)
    X = rng.normal(size=(12, 4, 6, 6)).astype(np.float32)
    y = rng.normal(size=(12, 2, 4, 4)).astype(np.float32)
    exported = _legacy_export(net, X[:2].copy())
    assert any(n.op_type == "Div" for n in exported.graph.node)  # the chunk's arithmetic
    assert_gradients_like_torch(exported, net, X[:5], y[:5])
    for fuse in ("step", "epoch"):
        reference = _chunk_net()
        trainer = lossgraph.Trainer(lossgraph.compile_program(exported, optimizer=SGD(0.1),
                                                              fuse=fuse))
        assert_steps_like_torch(trainer, reference,
                                torch.optim.SGD(reference.parameters(), lr=0.1), X, y,
                                steps=3, rows=4, loss=torch_mse)


@torch_only
def test_torchvisions_shufflenet_v2_blocks_legacy_export_has_torchs_gradient():
    """ShuffleNetV2's blocks (torchvision's own ``InvertedResidual``, the fewest that show
    it: the whole network takes four times as long and checks nothing more) split the
    channels with ``chunk`` and shuffle them with a ``view`` of shape arithmetic; the next
    down-sampling block's depthwise (grouped) Conv reads the shuffled channels. The legacy
    export with a free batch compiles, and its gradient is torch's."""
    torchvision = pytest.importorskip("torchvision", reason="needs torchvision==0.28.0")
    import torch
    from torchvision.models.shufflenetv2 import InvertedResidual

    torch.manual_seed(0)
    net = torch.nn.Sequential(InvertedResidual(3, 8, 2), InvertedResidual(8, 8, 1),
                              InvertedResidual(8, 8, 2), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 3))
    assert isinstance(torchvision.models.shufflenet_v2_x0_5().stage2[0], InvertedResidual)
    make_distinct(net)  # the exporter merges equal initializers (fresh BatchNorm scales)
    net.eval()
    rng = np.random.default_rng(2)
    X = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
    y = rng.normal(size=(2, 3)).astype(np.float32)
    exported = _legacy_export(net, X)
    assert_gradients_like_torch(exported, net, X, y, rtol=1e-3, atol=1e-4)


# -- shape inference with data propagation, the long vectors kept out ------------------------

def test_shape_inference_with_data_gives_onnxs_types_and_the_models_nodes():
    assert LONG_VECTOR == LONG
    epoch = wide_program().graphs["train_epoch"]
    inferred = infer_shapes_with_data(epoch)
    assert types(inferred) == types(onnx.shape_inference.infer_shapes(epoch, data_prop=True))
    assert nodes(inferred) == nodes(epoch)


def test_a_vector_whose_length_only_data_propagation_finds_is_kept_out_too(monkeypatch):
    """A packed gradient can hold a part whose length only data propagation finds (a
    depthwise convolution's weight gradient, computed from shapes): its Concat, and what is
    computed from it, stand first as vectors of unknown length, then of the length onnx's
    inference of the node gives; the types are onnx's all the same."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x, float[5000] v) => (float[M] y) {
            s = Shape(x)  i = Constant <value = int64[1] {1}> ()  n = Gather(s, i)
            t = ConstantOfShape <value = float[1] {1}> (n)
            c = Concat <axis = 0> (v, t)  y = Mul(c, c) }""")
    plain = {v.name: v.type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    assert not plain["c"].tensor_type.shape.dim[0].HasField("dim_value")  # the case
    expected = onnx.shape_inference.infer_shapes(model, data_prop=True)
    seen = recording_data_propagation(monkeypatch)
    inferred = infer_shapes_with_data(model)
    monkeypatch.undo()
    assert types(inferred) == types(expected)
    assert {v.name: v.type.tensor_type.shape.dim[0].dim_value
            for v in (*inferred.graph.value_info, *inferred.graph.output)
            if v.name in "cty"} == {"t": 4, "c": 5004, "y": 5004}
    assert nodes(inferred) == nodes(model)
    assert len(seen) == 2 and not long_vectors(seen)


def test_a_long_integer_vector_is_kept_out_too(monkeypatch):
    """The flat positions a pooling or slicing gradient ranges over, ``Range(0, Size(x))``
    of a static ``x``: int64, so it could hold shape data, but a vector of LONG_VECTOR values
    or more is no shape. onnx held each of its values as a dimension (a small CNN's step
    at batch 64 kept 37 MiB); the types are onnx's all the same."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[64, 8, 4, 4] x) => (int64[8192] y, float[64, 128] z) {
            zero = Constant <value = int64 {0}> ()  one = Constant <value = int64 {1}> ()
            n = Size(x)  p = Range(zero, n, one)  y = Mul(p, p)
            start = Constant <value = int64[1] {0}> ()  end = Constant <value = int64[1] {1}> ()
            s = Shape(x)  b = Slice(s, start, end)  rest = Constant <value = int64[1] {128}> ()
            target = Concat <axis = 0> (b, rest)  z = Reshape(x, target) }""")
    expected = onnx.shape_inference.infer_shapes(model, data_prop=True)
    seen = recording_data_propagation(monkeypatch)
    inferred = infer_shapes_with_data(model)
    monkeypatch.undo()
    assert types(inferred) == types(expected)
    assert nodes(inferred) == nodes(model)
    assert seen and not long_vectors(seen)


@pytest.mark.parametrize("flattened", ["float", "int64"])
def test_a_vector_sliced_from_a_long_one_is_kept_out_too(monkeypatch, flattened):
    """A fill made at each run reads an empty slice of the gradient it mirrors, flattened
    (``GradContext.filled``): onnx's data propagation held the flat vector's every value
    as a dimension once a ``Slice`` or ``Cast`` read it, known or not (a transformer's
    fixed-batch compile peaked at 129 MiB for 1.5 MiB of weights). The types are onnx's,
    the fill's static shape among them."""
    model = onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 18]>
        g ({flattened}[4, 16, 128] x) => (float[4, 16, 128] y) {{
            flat_shape = Constant <value = int64[1] {{-1}}> ()  flat = Reshape(x, flat_shape)
            zero = Constant <value = int64[1] {{0}}> ()  empty = Slice(flat, zero, zero)
            none = Cast <to = 7> (empty)
            dims = Constant <value = int64[3] {{4, 16, 128}}> ()
            shape = Concat <axis = 0> (dims, none)  y = ConstantOfShape(shape) }}""")
    expected = onnx.shape_inference.infer_shapes(model, data_prop=True)
    seen = recording_data_propagation(monkeypatch)
    inferred = infer_shapes_with_data(model)
    facts = ForwardFacts.of(model)
    monkeypatch.undo()
    assert types(inferred) == types(expected)
    assert nodes(inferred) == nodes(model)
    assert facts.shapes["y"] == (4, 16, 128)
    assert seen and not long_vectors(seen) and not long_vector_readers(seen)
