"""UnfoldConvWeightGradients (lossgraph/speed/unfold_conv_grads.py): a convolution's weight
gradient as a product of the unfolded input computes what the Conv form computes (a CNN so
rewritten trains like torch); other weight gradients keep the Conv form."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import attributes_text
from support.models import model

import lossgraph
from lossgraph.runtime.session import create_session
from lossgraph.speed import UnfoldConvWeightGradients

F32 = np.float32

def _conv_gradient_model(x_shape, w_shape, attrs, free_batch: bool) -> onnx.ModelProto:
    """The gradient graph of ``sum(sin(Conv(x, W)))`` with respect to W and x."""
    dims = ["N" if free_batch else str(x_shape[0]), *map(str, x_shape[1:])]
    net = model(f"(float[{', '.join(dims)}] x, float[{', '.join(map(str, w_shape))}] w) "
                "=> (float loss)", f"y = Conv{attributes_text(attrs)}(x, w)  s = Sin(y)  "
                "loss = ReduceSum<keepdims=0>(s)", opset=17)
    return lossgraph.gradient(net, weights=["w", "x"], loss_name="loss")


UNFOLDED = [
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((3, 1, 8, 8), (5, 1, 3, 3), {}),
    ((2, 3, 9, 8), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 9, 9), (3, 2, 2, 3), {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 2]}),
    ((2, 4, 5, 6), (3, 4, 1, 1), {}),
    ((2, 4, 6, 6), (3, 4, 1, 1), {"strides": [2, 2]}),
    ((2, 3, 10), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((1, 2, 4, 5, 4), (3, 2, 2, 2, 2), {"pads": [1, 0, 1, 0, 1, 0]}),
    ((2, 3, 7, 7), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    # few pixels, many channels (ResNet-18's last blocks): one product over all rows
    ((3, 8, 3, 3), (6, 8, 3, 3), {}),
    ((2, 8, 4, 4), (9, 8, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ((3, 16, 2, 2), (12, 16, 1, 1), {"strides": [2, 2]}),
    ((2, 6, 3), (7, 6, 3), {"pads": [1, 0]}),
]


@pytest.mark.parametrize("free_batch", [False, True], ids=["static", "free_batch"])
@pytest.mark.parametrize("x_shape, w_shape, attrs", UNFOLDED)
def test_unfolded_weight_gradient_equals_the_conv_form(rng, x_shape, w_shape, attrs, free_batch):
    plain = _conv_gradient_model(x_shape, w_shape, attrs, free_batch)
    result = UnfoldConvWeightGradients()(plain)
    assert result.changed
    produced = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert not [n for n in result.model.graph.node if n.op_type == "Conv"
                and produced.get(n.input[1]) == "Transpose"]  # no Conv over swapped axes
    feeds = {"x": rng.normal(size=x_shape).astype(F32), "w": rng.normal(size=w_shape).astype(F32)}
    expected = create_session(plain).run(["w_grad", "x_grad"], feeds)
    got = create_session(result.model).run(["w_grad", "x_grad"], feeds)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], expected[1])  # the input gradient is untouched


@pytest.mark.parametrize("x_shape, w_shape, attrs, one_product", [
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, False),  # 42 pixels, 27 x 4 taps
    ((3, 8, 3, 3), (6, 8, 3, 3), {}, True),                        # 1 pixel, 72 x 6
    ((3, 16, 2, 2), (12, 16, 1, 1), {"strides": [2, 2]}, True),    # 1 pixel, 16 x 12
])
def test_the_form_moving_fewer_values_is_chosen(x_shape, w_shape, attrs, one_product):
    """Batched products and their sum where dy has many pixels against the gradient's
    size (a small CNN), one Gemm over all rows where it has few (a deep layer)."""
    plain = _conv_gradient_model(x_shape, w_shape, attrs, free_batch=True)
    rewritten = UnfoldConvWeightGradients()(plain).model

    def count(graph: onnx.GraphProto, op_type: str) -> int:
        return sum(n.op_type == op_type for n in graph.node)

    assert count(rewritten.graph, "Gemm") == int(one_product)
    assert count(rewritten.graph, "ReduceSum") - count(plain.graph, "ReduceSum") == int(
        not one_product)


@pytest.mark.torch
def test_a_cnn_with_unfolded_weight_gradients_trains_like_torch(rng):
    """compile_program runs the pass: the step graph has no Conv over swapped axes, and an
    exported CNN (3x3 and 1x1 convolutions, max pooling) trains to torch's weights."""
    import torch

    from benchmarks.model_speed import WORKLOADS, make_problem, run_workload

    problem = make_problem(WORKLOADS["cnn"], steps=3, quick=True)
    threads = torch.get_num_threads()
    try:
        result = run_workload(problem, steps=3, repeat=1, threads=1)
    finally:
        torch.set_num_threads(threads)
    for name, check in result.checks.items():
        assert check["weights_compared"] == check["weights"] > 0, name
        assert check["max_abs_difference"] < 1e-5 < check["torch_moved"], (name, check)
    step = lossgraph.compile_program(problem.model).graphs["train_step"]
    assert "MaxUnpool" in {n.op_type for n in step.graph.node}
    produced = {o: n.op_type for n in step.graph.node for o in n.output}
    assert not [n for n in step.graph.node if n.op_type == "Conv"
                and produced.get(n.input[1]) == "Transpose"]


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 9, 9), (4, 3, 5, 5), {"pads": [2, 2, 2, 2]}),      # 25 taps: slower unfolded
    ((2, 4, 6, 6), (4, 2, 3, 3), {"group": 2}),                 # grouped
])
def test_other_weight_gradients_keep_the_conv_form(x_shape, w_shape, attrs):
    plain = _conv_gradient_model(x_shape, w_shape, attrs, free_batch=False)
    assert not UnfoldConvWeightGradients()(plain).changed
