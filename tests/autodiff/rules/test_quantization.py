"""Gradient of DequantizeLinear with respect to its scale, no straight-through estimator
unless asked, and the straight-through estimator where asked: the gradient of the
FakeQuantizeLinear function StraightThroughQuantization writes
(lossgraph/autodiff/rules/quantization.py), against torch's fake quantization."""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import check_gradients, cotangent, forward, vjp
from support.models import model

from lossgraph import gradient
from lossgraph.errors import NoGradientError
from lossgraph.passes import straight_through_quantization

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
    with pytest.raises(NoGradientError,
                       match="QuantizeLinear.*lossgraph.passes.straight_through_quantization"):
        gradient(net, weights=["w"], outputs=["y"])
    # the scale still gets its gradient, through DequantizeLinear only
    graph = gradient(net, weights=["s"], outputs=["y"])
    assert "s_grad" in [o.name for o in graph.graph.output]


# ------------------------------------------------------------- straight-through estimator
def _pair(kind: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], attrs: str = "",
          opset: int = 13):
    """``y = DequantizeLinear(QuantizeLinear(x, s, z), s, z)`` quantizing to ``kind``."""
    dims = ", ".join(map(str, shape))
    s_dims = f"[{', '.join(map(str, scale_shape))}]" if scale_shape else ""
    return model(f"(float[{dims}] x, float{s_dims} s, {kind}{s_dims} z) => (float[{dims}] y)",
                 f"q = QuantizeLinear{attrs}(x, s, z)\n y = DequantizeLinear{attrs}(q, s, z)",
                 opset=opset)


RANGES = {"int8": (-128, 127, np.int8), "uint8": (0, 255, np.uint8)}


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["int8", "uint8"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_straight_through_gradients_match_torch_fake_quantize(rng, kind, granularity):
    """x: dy where round(x / s) + z is representable, 0 outside, as
    torch.fake_quantize_per_tensor_affine / ..._per_channel_affine; the scale: torch's
    learnable fake quantization (LSQ). Zero points inside the range, values past it."""
    import torch

    qmin, qmax, dtype = RANGES[kind]
    x = (rng.normal(size=(4, 5)) * 3).astype(F32)
    if granularity == "tensor":
        scale, zero = np.array(0.02, F32), np.array(3 if kind == "int8" else 120, dtype)
        net = _pair(kind, (4, 5), ())
    else:
        scale = rng.uniform(0.01, 0.05, size=5).astype(F32)
        zero = rng.integers(qmin // 4 + 10, qmax // 4, size=5).astype(dtype)
        net = _pair(kind, (4, 5), (5,), "<axis = 1>")
    feeds = {"x": x, "s": scale, "z": zero}
    fake = straight_through_quantization(net)
    assert [n.op_type for n in fake.graph.node] == ["FakeQuantizeLinear"]
    np.testing.assert_array_equal(forward(fake, feeds), forward(net, feeds))
    ours = vjp(fake, feeds, ["x", "s"])

    r = torch.from_numpy(cotangent((4, 5), F32))
    tx, tx_lsq = (torch.tensor(x, requires_grad=True) for _ in range(2))
    ts = torch.tensor(scale.reshape(-1), requires_grad=True)
    if granularity == "tensor":
        y = torch.fake_quantize_per_tensor_affine(tx, float(scale), int(zero), qmin, qmax)
        y_lsq = torch._fake_quantize_learnable_per_tensor_affine(
            tx_lsq, ts, torch.tensor([float(zero)]), qmin, qmax, 1.0)
    else:
        y = torch.fake_quantize_per_channel_affine(
            tx, torch.from_numpy(scale), torch.from_numpy(zero.astype(np.int32)), 1, qmin, qmax)
        y_lsq = torch._fake_quantize_learnable_per_channel_affine(
            tx_lsq, ts, torch.from_numpy(zero.astype(F32)), 1, qmin, qmax, 1.0)
    np.testing.assert_array_equal(forward(net, feeds), y.detach().numpy())
    (y * r).sum().backward()
    (y_lsq * r).sum().backward()
    inside = tx.grad.numpy() != 0
    assert 0.3 < inside.mean() < 0.95  # values on both sides of the range
    np.testing.assert_array_equal(ours["x"], tx.grad.numpy())
    np.testing.assert_allclose(ours["s"], ts.grad.numpy().reshape(scale.shape), rtol=1e-5)


def test_blocked_straight_through_gradients(rng):
    """Blocks of 2 along axis 1 (the last one partial): the estimator per element, the
    scale's gradient summed per block (a numpy reference)."""
    x = (rng.normal(size=(3, 5)) * 2).astype(F32)
    scale = rng.uniform(0.02, 0.05, size=(3, 3)).astype(F32)
    zero = rng.integers(-20, 20, size=(3, 3)).astype(np.int8)
    net = _pair("int8", (3, 5), (3, 3), "<axis = 1, block_size = 2>", opset=21)
    feeds = {"x": x, "s": scale, "z": zero}
    fake = straight_through_quantization(net)
    np.testing.assert_array_equal(forward(fake, feeds), forward(net, feeds))
    ours = vjp(fake, feeds, ["x", "s"])
    s_full, z_full = (np.repeat(v, 2, axis=1)[:, :5] for v in (scale, zero))
    level = np.round(x / s_full) + z_full
    inside = (level >= -128) & (level <= 127)
    r = cotangent((3, 5), F32)
    np.testing.assert_array_equal(ours["x"], r * inside)
    steps = np.where(inside, np.round(x / s_full) - x / s_full,
                     np.clip(level, -128, 127) - z_full)
    expected = np.pad(r * steps, [(0, 0), (0, 1)]).reshape(3, 3, 2).sum(axis=2)
    np.testing.assert_allclose(ours["s"], expected, rtol=1e-4, atol=1e-5)
