"""trainable_initializers: which weights a loss can train."""

from __future__ import annotations

import onnx
from support.models import ROUNDED

from lossgraph import add_loss_output, trainable_initializers

MIXED = """
    <ir_version: 8, opset_import: ["" : 18]>
    net (float[N, 4] x) => (float[N, 2] y, int64[N] label)
    <float[4, 2] w = {1, 2, 3, 4, 5, 6, 7, 8}, float[2] b = {0, 1}, float scale = {2.0},
     int64[2] shape = {-1, 2}, float[2] unused = {3, 3}, int64[2] classes = {7, 9},
     float[2] mean = {0, 0}, float[2] var = {1, 1}>
    {
        h = MatMul(x, w)
        hb = Add(h, b)
        hs = Mul(hb, scale)
        y = Reshape(hs, shape)
        idx = ArgMax <axis = 1, keepdims = 0> (y)
        label = Gather(classes, idx)
    }
"""


def test_float_weights_on_differentiable_paths_are_trainable_in_graph_order():
    assert trainable_initializers(onnx.parser.parse_model(MIXED)) == ["w", "b"]


def test_shapes_class_lists_scalars_and_unused_tensors_are_excluded():
    trainable = trainable_initializers(onnx.parser.parse_model(MIXED))
    assert not {"shape", "classes", "scale", "unused"} & set(trainable)


def test_batch_normalization_statistics_are_not_trainable():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        bn (float[N, 2, 3] x) => (float[N, 2, 3] y)
        <float[2] gamma = {1, 1}, float[2] beta = {0, 0}, float[2] mean = {0, 0},
         float[2] var = {1, 1}>
        { y = BatchNormalization(x, gamma, beta, mean, var) }
    """)
    assert trainable_initializers(model) == ["gamma", "beta"]


def test_only_weights_reaching_the_loss_count_once_a_loss_is_added():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        two (float[N, 2] x) => (float[N, 2] y, float[N, 2] z)
        <float[2] a = {1, 2}, float[2] c = {3, 4}>
        { y = Mul(x, a)
          z = Mul(x, c) }
    """)
    assert trainable_initializers(model) == ["a", "c"]
    assert trainable_initializers(add_loss_output(model, output_index="z")) == ["c"]


def test_weights_captured_by_a_subgraph_are_trainable():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        branchy (float[N, 2] x, bool flag) => (float[N, 2] y)
        <float[2] a = {1, 2}>
        { y = If(flag) <
              then_branch = g1 () => (float[N, 2] t) { t = Mul(x, a) },
              else_branch = g2 () => (float[N, 2] e) { e = Identity(x) } > }
    """)
    assert trainable_initializers(model) == ["a"]


def test_differentiable_constants_of_losses_and_encodings_are_not_trainable():
    """Class weights and one-hot values carry gradients (asked for by name) but are not
    weights to train, like batch-normalization statistics."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        net (float[N, 3] x, int64[N] label, int64[N] code) => (float loss)
        <float[3, 3] w = {1, 0, 0, 0, 1, 0, 0, 0, 1}, float[3] class_weight = {1, 2, 1},
         float[2] off_on = {0, 1}, int64 depth = {3}>
        {
            scores = MatMul(x, w)
            hot = OneHot(code, depth, off_on)
            shifted = Add(scores, hot)
            loss = SoftmaxCrossEntropyLoss(shifted, label, class_weight)
        }
    """)
    assert trainable_initializers(model) == ["w"]


def test_stuck_weights_reach_the_loss_only_through_zero_gradient_ops():
    """w reaches the loss only through Round (h's other reader, u, feeds no output), v only
    through Sign, b directly; once u feeds the output, w has a live path too."""
    from lossgraph.analysis import stuck_weights

    model = add_loss_output(onnx.parser.parse_model(ROUNDED))
    stuck = stuck_weights(model, ["w", "v", "b"])
    assert [(s.name, s.node.op_type) for s in stuck] == [("w", "Round"), ("v", "Sign")]
    assert stuck[0].describe() == "'w' -> [MatMul] -> 'h' -> [Round] -> 'r' -> ... -> 'loss'"
    live = onnx.parser.parse_model(ROUNDED.replace("y = Add(t, b)", "y = Add(u, b)"))
    assert [s.name for s in stuck_weights(add_loss_output(live), ["w", "v", "b"])] == ["v"]


#: Every layer that holds a bias or a normalization's scale and shift, in one graph: a bias
#: added after a MatMul, a LayerNormalization, a Gemm's C, and a layer norm written out in
#: ops as torch's exporter writes it below opset 17 (scale g, shift s).
NORMALIZED = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 4] x) => (float[N, 2] y)
    <float[4, 3] w1 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, float[3] b1 = {1, 2, 3},
     float[3] scale = {1, 1, 2}, float[3] shift = {0, 1, 0}, float[3, 2] w2 = {1, 2, 3, 4, 5, 6},
     float[2] b2 = {1, 2}, float[2] g = {2, 3}, float[2] s = {1, 0}>
    {
        h = MatMul(x, w1)
        biased = Add(h, b1)
        normed = LayerNormalization(biased, scale, shift)
        z = Gemm(normed, w2, b2)
        axes = Constant<value = int64[1] {-1}>()
        mean = ReduceMean(z, axes)
        centred = Sub(z, mean)
        two = Constant<value = float {2.0}>()
        squared = Pow(centred, two)
        variance = ReduceMean(squared, axes)
        eps = Constant<value = float {1e-5}>()
        shifted = Add(variance, eps)
        deviation = Sqrt(shifted)
        unit = Div(centred, deviation)
        scaled = Mul(unit, g)
        y = Add(scaled, s)
    }
"""


def test_no_decay_weights_are_the_biases_and_normalization_weights_found_from_the_ops():
    from lossgraph.analysis import no_decay_weights

    model = onnx.parser.parse_model(NORMALIZED)
    weights = trainable_initializers(model)
    assert weights == ["w1", "b1", "scale", "shift", "w2", "b2", "g", "s"]
    assert no_decay_weights(model, weights) == ["b1", "scale", "shift", "b2", "g", "s"]
    assert no_decay_weights(model, ["w2", "b2"]) == ["b2"]  # among the weights given only
