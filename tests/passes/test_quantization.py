"""StraightThroughQuantization (lossgraph/passes/quantization.py): each QuantizeLinear ->
DequantizeLinear pair of a float weight becomes a FakeQuantizeLinear node, whose gradient is
the straight-through estimator (tests/autodiff/rules/test_quantization.py); other pairs are
left alone, a shared QuantizeLinear kept, a missing zero point made explicit, an integer
weight named with the way out (dequantize_weights=True). A quantization-aware model trains
like torch's fake-quantize modules, and alike in every fusion mode."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.inliner
import pytest
from onnx import helper, numpy_helper
from support.gradcheck import cotangent, forward, vjp
from support.models import model, model_of_graph

from lossgraph import Trainer, compile_program, gradient, trainable_initializers
from lossgraph.errors import DTypeMismatchError
from lossgraph.optim import SGD
from lossgraph.passes import StraightThroughQuantization, straight_through_quantization
from lossgraph.passes.quantization import FakeQuantization

F32 = np.float32


def test_the_pass_leaves_other_pairs_alone_and_keeps_a_shared_quantize(rng):
    """A pair with another scale for the dequantization is a requantization, not a fake
    quantization: left alone. A QuantizeLinear others read too stays for them."""
    net = model("(float[4] x, float s, float t, uint8 z) => (float[4] y, float[4] u, uint8[4] q)",
                "q = QuantizeLinear(x, s, z)\n y = DequantizeLinear(q, s, z)\n"
                " u = DequantizeLinear(q, t, z)", opset=13)
    result = StraightThroughQuantization()(net)
    assert [n.op_type for n in result.model.graph.node] == [
        "QuantizeLinear", "FakeQuantizeLinear", "DequantizeLinear"]
    assert result.report == (FakeQuantization("y", "x", "s", "z"),)
    feeds = {"x": rng.normal(size=4).astype(F32), "s": np.array(0.1, F32),
             "t": np.array(0.2, F32), "z": np.array(7, np.uint8)}
    for output in ("y", "u", "q"):
        np.testing.assert_array_equal(forward(result.model, feeds, output),
                                      forward(net, feeds, output))
    plain = model("(float[4] x) => (float[4] y)", "y = Relu(x)", opset=13)
    assert not StraightThroughQuantization()(plain).changed


def test_a_pair_without_zero_point_gets_an_explicit_one(rng):
    """QuantizeLinear without a zero point quantizes to uint8 around 0: the fake
    quantization is called with that zero point (onnxruntime 1.32 runs a function called
    without an optional input otherwise than 1.19)."""
    net = model("(float[6] x, float s) => (float[6] y)",
                "q = QuantizeLinear(x, s)\n y = DequantizeLinear(q, s)", opset=13)
    fake = straight_through_quantization(net)
    feeds = {"x": np.linspace(-1, 3, 6).astype(F32), "s": np.array(0.01, F32)}
    np.testing.assert_array_equal(forward(fake, feeds), forward(net, feeds))
    level = np.round(feeds["x"] / 0.01)
    np.testing.assert_array_equal(vjp(fake, feeds, ["x"])["x"],
                                  cotangent((6,), F32) * ((level >= 0) & (level <= 255)))


def test_an_integer_weight_names_the_pass_and_dequantize_weights_trains_it(rng):
    """A model that stores only the quantized integers: asking for their gradient says how
    to get a float weight; dequantize_weights=True makes it, (q - z) s per channel, which
    fake-quantizes back to q exactly."""
    levels = rng.integers(-100, 100, size=(3, 4)).astype(np.int8)
    scale = rng.uniform(0.01, 0.05, size=4).astype(F32)
    zero = rng.integers(-5, 5, size=4).astype(np.int8)
    text = (f"<int8[3, 4] w_q = {{{', '.join(map(str, levels.ravel()))}}}, "
            f"float[4] s = {{{', '.join(map(str, scale))}}}, "
            f"int8[4] z = {{{', '.join(map(str, zero))}}}>")
    net = model(f"(float[2, 3] x) => (float[2, 4] y) {text}",
                "w = DequantizeLinear<axis = 1>(w_q, s, z)\n y = MatMul(x, w)", opset=13)
    with pytest.raises(DTypeMismatchError, match="dequantize_weights=True.*'w_q_float'"):
        gradient(net, weights=["w_q"], outputs=["y"])
    result = StraightThroughQuantization(dequantize_weights=True)(net)
    fake = result.model
    assert result.report == (FakeQuantization("w", "w_q_float", "s", "z", weight="w_q_float"),)
    assert "w_q" not in {t.name for t in fake.graph.initializer}
    assert trainable_initializers(fake) == ["w_q_float"]  # the scale is not trained
    x = rng.normal(size=(2, 3)).astype(F32)
    np.testing.assert_allclose(forward(fake, {"x": x}), forward(net, {"x": x}), rtol=1e-6)
    weight = next(numpy_helper.to_array(t) for t in fake.graph.initializer
                  if t.name == "w_q_float")
    np.testing.assert_array_equal(np.round(weight / scale) + zero, levels)
    grads = vjp(fake, {"x": x}, ["w_q_float"])  # all inside the range: x^T R
    np.testing.assert_allclose(grads["w_q_float"], x.T @ cotangent((2, 4), F32), rtol=1e-5)


@pytest.mark.torch
def test_a_qat_model_trains_like_torch_with_fake_quantize_modules():
    """Linear layers whose weights (per channel, int8) and activation (per tensor, uint8,
    a zero point past 0) go through QuantizeLinear -> DequantizeLinear, with the scales
    torch's FakeQuantize observers calibrated, then frozen: after the pass, SGD steps of
    the compiled program equal torch's, the scales fixed as torch keeps them. The exported
    model keeps the fake quantizations; inlined, they are the pairs again."""
    import torch
    from support.torch_steps import assert_sgd_steps_like_torch
    from torch.ao.quantization import (
        FakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
    )

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
            self.w1 = FakeQuantize(MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                   quant_max=127, dtype=torch.qint8,
                                   qscheme=torch.per_channel_symmetric, ch_axis=0)
            self.act = FakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                    dtype=torch.quint8, qscheme=torch.per_tensor_affine)
            self.w2 = FakeQuantize(MovingAverageMinMaxObserver, quant_min=-128, quant_max=127,
                                   dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)

        def forward(self, x):
            h = torch.tanh(torch.nn.functional.linear(x, self.w1(self.fc1.weight),
                                                      self.fc1.bias))
            return torch.nn.functional.linear(self.act(h), self.w2(self.fc2.weight),
                                              self.fc2.bias)

    torch.manual_seed(0)
    net = Net()
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 4)).astype(F32)
    y = (X @ rng.normal(size=(4, 1)) * 0.5).astype(F32)
    with torch.no_grad():
        net(torch.from_numpy(X))  # the observers calibrate the scales, then stay
    for fake_quantize in (net.w1, net.act, net.w2):
        fake_quantize.disable_observer()
    assert int(net.act.zero_point) > 0

    def array(value, dtype=F32):
        return value.detach().numpy().astype(dtype)

    weights = {"w1": array(net.fc1.weight), "b1": array(net.fc1.bias),
               "w2": array(net.fc2.weight), "b2": array(net.fc2.bias),
               "s1": array(net.w1.scale), "z1": array(net.w1.zero_point, np.int8),
               "sa": array(net.act.scale).reshape(()),
               "za": array(net.act.zero_point, np.uint8).reshape(()),
               "s2": array(net.w2.scale).reshape(()),
               "z2": array(net.w2.zero_point, np.int8).reshape(())}
    nodes = [helper.make_node("QuantizeLinear", ["w1", "s1", "z1"], ["w1_q"], axis=0),
             helper.make_node("DequantizeLinear", ["w1_q", "s1", "z1"], ["w1_fq"], axis=0),
             helper.make_node("Gemm", ["x", "w1_fq", "b1"], ["h"], transB=1),
             helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("QuantizeLinear", ["t", "sa", "za"], ["t_q"]),
             helper.make_node("DequantizeLinear", ["t_q", "sa", "za"], ["t_fq"]),
             helper.make_node("QuantizeLinear", ["w2", "s2", "z2"], ["w2_q"]),
             helper.make_node("DequantizeLinear", ["w2_q", "s2", "z2"], ["w2_fq"]),
             helper.make_node("Gemm", ["t_fq", "w2_fq", "b2"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "qat", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    qdq = model_of_graph(graph, opset=13)
    with torch.no_grad():
        np.testing.assert_allclose(forward(qdq, {"x": X}), net(torch.from_numpy(X)).numpy(),
                                   rtol=1e-5, atol=1e-6)
    fake = straight_through_quantization(qdq)
    assert trainable_initializers(fake) == ["w1", "b1", "w2", "b2"]
    trainer = Trainer(compile_program(fake, optimizer=SGD(0.1)))
    assert_sgd_steps_like_torch(trainer, net, 0.1, X, y)
    exported = trainer.to_inference_model()  # the standard Q/DQ pairs again
    ops = [n.op_type for n in exported.graph.node]
    assert ops.count("QuantizeLinear") == ops.count("DequantizeLinear") == 3
    assert "FakeQuantizeLinear" not in ops and not exported.functions
    assert {o.domain for o in exported.opset_import} <= {"", "ai.onnx"}
    np.testing.assert_array_equal(forward(exported, {"x": X}), trainer.predict(X))


def test_a_fake_quantized_model_trains_alike_in_every_fusion_mode(rng):
    """The function travels with every graph of the program: step, epoch and the
    separate mode's forward and backward halves train alike."""
    weights = rng.normal(size=(3, 1)).astype(F32)
    net = model(f"(float[N, 3] x) => (float[N, 1] y) <float[3, 1] w = "
                f"{{{', '.join(map(str, weights.ravel()))}}}, float s = {{0.01}}, "
                "int8 z = {0}>",
                "q = QuantizeLinear(w, s, z)\n wd = DequantizeLinear(q, s, z)\n y = MatMul(x, wd)",
                opset=13)
    fake = straight_through_quantization(net)
    X = rng.normal(size=(64, 3)).astype(F32)
    y = X @ np.array([[1.0], [-2.0], [0.5]], F32)
    predictions = []
    for fuse in ("step", "epoch", "separate"):
        trainer = Trainer(compile_program(fake, optimizer=SGD(0.05), fuse=fuse))
        trainer.fit(X, y, epochs=3, batch_size=16, shuffle=False, progress=False)
        predictions.append(trainer.predict(X))
    assert np.abs(predictions[0] - forward(net, {"x": X})).max() > 0.1  # it trained
    for other in predictions[1:]:
        np.testing.assert_allclose(other, predictions[0], rtol=1e-6, atol=1e-6)
