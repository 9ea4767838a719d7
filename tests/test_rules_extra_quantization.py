"""Gradient of DequantizeLinear with respect to its scale
(lossgraph/autodiff/rules/quantization.py), and no straight-through estimator."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_gradients, cotangent
from models import model

from lossgraph import gradient
from lossgraph.errors import NoGradientError

F32 = np.float32


def _expected(x, zero, r, reduce_axes, shape):
    """sum of R (x - z) over what each scale multiplies."""
    product = r * (x.astype(np.float64) - zero)
    return np.sum(product, axis=reduce_axes).reshape(shape).astype(F32)


def test_per_tensor_scale_gradient(rng):
    x = rng.integers(0, 255, size=(3, 4)).astype(np.uint8)
    scale, zero = np.array(0.05, F32), np.array(128, np.uint8)
    net = model("(uint8[3, 4] x, float s, uint8 z) => (float[3, 4] y)",
                "y = DequantizeLinear(x, s, z)", opset=13)
    r = cotangent((3, 4), F32)
    expected = np.array(np.sum(r * (x.astype(np.float64) - 128)), F32)
    check_gradients(net, {"x": x, "s": scale, "z": zero}, wrt=["s"], eps=1e-3,
                    reference={"s": expected})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_axis_scale_gradient(rng, axis):
    shape = (3, 4, 2)
    x = rng.integers(-100, 100, size=shape).astype(np.int8)
    size = shape[axis]
    scale = rng.uniform(0.01, 0.1, size=size).astype(F32)
    zero = rng.integers(-5, 5, size=size).astype(np.int8)
    net = model(f"(int8[3, 4, 2] x, float[{size}] s, int8[{size}] z) => (float[3, 4, 2] y)",
                f"y = DequantizeLinear <axis = {axis}> (x, s, z)", opset=19)
    r = cotangent(shape, F32)
    keep = axis % 3
    broadcast = [1, 1, 1]
    broadcast[keep] = size
    axes = tuple(a for a in range(3) if a != keep)
    expected = _expected(x, zero.reshape(broadcast), r, axes, (size,))
    check_gradients(net, {"x": x, "s": scale, "z": zero}, wrt=["s"], eps=1e-3,
                    reference={"s": expected})


def test_int32_without_zero_point(rng):
    x = rng.integers(-1000, 1000, size=(5,)).astype(np.int32)
    net = model("(int32[5] x, float s) => (float[5] y)", "y = DequantizeLinear(x, s)",
                opset=13)
    r = cotangent((5,), F32)
    check_gradients(net, {"x": x, "s": np.array(0.001, F32)}, wrt=["s"], eps=1e-3,
                    reference={"s": np.array(np.sum(r * x), F32)})


def test_one_element_scale_is_per_tensor(rng):
    x = rng.integers(0, 255, size=(3, 4)).astype(np.uint8)
    net = model("(uint8[3, 4] x, float[1] s, uint8[1] z) => (float[3, 4] y)",
                "y = DequantizeLinear(x, s, z)", opset=19)
    r = cotangent((3, 4), F32)
    check_gradients(net, {"x": x, "s": np.array([0.02], F32), "z": np.array([3], np.uint8)},
                    wrt=["s"], eps=1e-3,
                    reference={"s": np.array([np.sum(r * (x.astype(np.float64) - 3))], F32)})


@pytest.mark.parametrize("axis, block", [(1, 2), (1, 3), (0, 2)])
def test_blocked_scale_gradient(rng, axis, block):
    """Blocks of ``block`` elements along ``axis``; with 5 elements and blocks of 2 or 3
    the last block is partial."""
    shape = (4, 5)
    x = rng.integers(0, 255, size=shape).astype(np.uint8)
    blocks = -(-shape[axis] // block)
    s_shape = list(shape)
    s_shape[axis] = blocks
    scale = rng.uniform(0.01, 0.1, size=s_shape).astype(F32)
    zero = rng.integers(0, 10, size=s_shape).astype(np.uint8)
    dims = ", ".join(str(d) for d in s_shape)
    net = model(f"(uint8[4, 5] x, float[{dims}] s, uint8[{dims}] z) => (float[4, 5] y)",
                f"y = DequantizeLinear <axis = {axis}, block_size = {block}> (x, s, z)",
                opset=21)
    r = cotangent(shape, F32)
    full = np.repeat(zero, block, axis=axis).take(range(shape[axis]), axis=axis)
    product = r * (x.astype(np.float64) - full)
    expected = np.zeros(s_shape)
    for k in range(blocks):
        index = [slice(None)] * 2
        index[axis] = slice(k * block, (k + 1) * block)
        out = [slice(None)] * 2
        out[axis] = k
        expected[tuple(out)] = np.sum(product[tuple(index)], axis=axis)
    check_gradients(net, {"x": x, "s": scale, "z": zero}, wrt=["s"], eps=1e-3,
                    reference={"s": expected.astype(F32)})


def test_a_weight_through_quantize_linear_gets_no_straight_through_gradient(rng):
    """Quantization rounds: the derivative is 0 almost everywhere. Treating the pair as
    the identity (a straight-through estimator) would be a choice: lossgraph names the
    QuantizeLinear that blocks the weight instead of making it silently."""
    net = model("(float[3] w, float s, uint8 z) => (float[3] y)",
                "q = QuantizeLinear(w, s, z)\n y = DequantizeLinear(q, s, z)", opset=13)
    with pytest.raises(NoGradientError, match="QuantizeLinear"):
        gradient(net, weights=["w"], outputs=["y"])
    # the scale still gets its gradient, through DequantizeLinear only
    graph = gradient(net, weights=["s"], outputs=["y"])
    assert "s_grad" in [o.name for o in graph.graph.output]
