"""Gradients of RotaryEmbedding and AffineGrid (lossgraph/autodiff/rules/geometry.py).

RotaryEmbedding is of opset 23, which loads only in onnxruntime 1.20 and later: checked
against finite differences there (skipped with the training build); the torch comparisons
run the gradient graph with the ONNX reference implementation instead."""

from __future__ import annotations

import numpy as np
import pytest
from support.environment import newer_runtime
from support.gradcheck import check_gradients, cotangent, numeric_vjp, reference_vjp
from support.models import dims, model, signature

import lossgraph
from lossgraph.target import use_target

F32, F64 = np.float32, np.float64


# ---------------------------------------------------------------- RotaryEmbedding
def _rotary(x, cos, sin, positions=None, interleaved=0, rotary_dim=0, num_heads=0):
    """RotaryEmbedding as the specification writes it (numpy or torch)."""
    lib = np if isinstance(x, np.ndarray) else __import__("torch")
    rank3 = x.ndim == 3
    if rank3:
        x = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    else:
        x = x.permute(0, 2, 1, 3) if lib is not np else x.transpose(0, 2, 1, 3)
    rot = rotary_dim or x.shape[-1]
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cos, sin = cos[..., None, : rot // 2], sin[..., None, : rot // 2]
    part, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., : rot // 2], part[..., rot // 2:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = lib.stack([real, imag], -1).reshape(part.shape)
    else:
        rotated = lib.concatenate([real, imag], -1) if lib is np else lib.cat([real, imag], -1)
    out = lib.concatenate([rotated, rest], -1) if lib is np else lib.cat([rotated, rest], -1)
    if rank3:
        return out.reshape(out.shape[0], out.shape[1], -1)
    return out.transpose(0, 2, 1, 3) if lib is np else out.permute(0, 2, 1, 3)


ROTARY_CASES = [
    # (x shape, attributes, with position ids)
    ((2, 3, 4, 8), {}, True),
    ((2, 3, 4, 8), {"interleaved": 1}, True),
    ((2, 3, 4, 8), {"rotary_embedding_dim": 4}, True),
    ((2, 3, 4, 8), {"rotary_embedding_dim": 4, "interleaved": 1}, False),
    ((2, 4, 12), {"num_heads": 3}, True),  # (B, S, H D)
    ((2, 4, 12), {"num_heads": 2, "interleaved": 1}, False),
]


def _rotary_feeds(rng, shape, attrs, with_positions):
    """Inputs; the caches rotary_embedding_dim / 2 wide."""
    sequence = shape[2] if len(shape) == 4 else shape[1]
    head = shape[3] if len(shape) == 4 else shape[2] // attrs["num_heads"]
    half = attrs.get("rotary_embedding_dim", head) // 2
    feeds = {"x": rng.normal(size=shape).astype(F32)}
    if with_positions:
        feeds["cos"] = rng.normal(size=(10, half)).astype(F32)
        feeds["sin"] = rng.normal(size=(10, half)).astype(F32)
        feeds["p"] = rng.integers(0, 10, size=(shape[0], sequence))
        feeds["p"][0, :2] = 7  # a repeated position: its cache rows add up
    else:
        feeds["cos"] = rng.normal(size=(shape[0], sequence, half)).astype(F32)
        feeds["sin"] = rng.normal(size=(shape[0], sequence, half)).astype(F32)
    return feeds


def _rotary_model(feeds, attrs):
    text = ", ".join(f"{k} = {v}" for k, v in attrs.items())
    return model(signature(feeds, f"float[{dims(feeds['x'].shape)}] y"),
                 f"y = RotaryEmbedding {'<' + text + '>' if text else ''} ({', '.join(feeds)})",
                 opset=23)


@pytest.mark.parametrize("shape, attrs, with_positions", ROTARY_CASES)
def test_rotary_embedding_gradient_matches_finite_differences(rng, shape, attrs, with_positions):
    """RotaryEmbedding is defined for float, float16 and bfloat16 only: in float32."""
    feeds = _rotary_feeds(rng, shape, attrs, with_positions)
    with newer_runtime():
        check_gradients(_rotary_model(feeds, attrs), feeds, eps=1e-2)


@pytest.mark.parametrize("shape, attrs, with_positions", ROTARY_CASES)
def test_rotary_embedding_gradient_matches_the_specification(rng, shape, attrs, with_positions):
    """Run by the reference implementation, against central differences of the
    specification's formula in float64."""
    feeds = _rotary_feeds(rng, shape, attrs, with_positions)
    wrt = ["x", "cos", "sin"]
    grads, y = reference_vjp(_rotary_model(feeds, attrs), feeds, wrt)
    r = cotangent(y.shape, y.dtype)
    positions = feeds.get("p")
    options = {"interleaved": attrs.get("interleaved", 0),
               "rotary_dim": attrs.get("rotary_embedding_dim", 0),
               "num_heads": attrs.get("num_heads", 0)}
    values = {k: feeds[k].astype(F64) for k in wrt}
    np.testing.assert_allclose(y, _rotary(*values.values(), positions, **options), rtol=1e-5,
                               atol=1e-6)
    for name in wrt:
        def forward(value, name=name):
            return _rotary(*{**values, name: value}.values(), positions, **options)

        np.testing.assert_allclose(grads[name], numeric_vjp(forward, values[name], r), rtol=1e-5,
                                   atol=1e-5, err_msg=name)


@pytest.mark.torch
def test_rotary_embedding_gradient_matches_torch(rng):
    import torch

    attrs = {"interleaved": 1}
    feeds = _rotary_feeds(rng, (2, 3, 4, 8), attrs, True)
    grads, y = reference_vjp(_rotary_model(feeds, attrs), feeds, ["x", "cos", "sin"])
    tensors = {k: torch.tensor(feeds[k], requires_grad=True) for k in ("x", "cos", "sin")}
    out = _rotary(*tensors.values(), torch.from_numpy(feeds["p"]), interleaved=1)
    (out * torch.from_numpy(cotangent(y.shape, y.dtype))).sum().backward()
    for name, tensor in tensors.items():
        np.testing.assert_allclose(grads[name], tensor.grad.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_rotary_embedding_input_gradient_is_the_inverse_rotation(rng):
    """dx = RotaryEmbedding(dy, cos, -sin): one node of the op itself."""
    feeds = _rotary_feeds(rng, (1, 2, 3, 4), {}, True)
    with use_target("onnxruntime"):
        graph = lossgraph.gradient(_rotary_model(feeds, {}), weights=["x"], outputs=["y"])
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and "ScatterND" not in ops


# ---------------------------------------------------------------------- AffineGrid
AFFINE_CASES = [((2, 2, 3), [2, 3, 4, 5], 0), ((2, 2, 3), [2, 1, 3, 4], 1),
                ((1, 3, 4), [1, 2, 2, 3, 4], 0), ((2, 3, 4), [2, 1, 3, 2, 2], 1)]


@pytest.mark.parametrize("theta_shape, size, align", AFFINE_CASES)
def test_affine_grid_gradient_matches_finite_differences(rng, theta_shape, size, align):
    theta = rng.normal(size=theta_shape)
    out = [size[0], *size[2:], len(size) - 2]
    net = model(f"(double[{dims(theta_shape)}] theta) => (double[{dims(out)}] y) "
                f"<int64[{len(size)}] size = {{{', '.join(map(str, size))}}}>",
                f"y = AffineGrid <align_corners = {align}> (theta, size)", opset=20)
    check_gradients(net, {"theta": theta})


@pytest.mark.torch
@pytest.mark.parametrize("theta_shape, size, align", AFFINE_CASES)
def test_affine_grid_gradient_matches_torch(rng, theta_shape, size, align):
    import torch

    theta = rng.normal(size=theta_shape)
    out = [size[0], *size[2:], len(size) - 2]
    net = model(f"(double[{dims(theta_shape)}] theta) => (double[{dims(out)}] y) "
                f"<int64[{len(size)}] size = {{{', '.join(map(str, size))}}}>",
                f"y = AffineGrid <align_corners = {align}> (theta, size)", opset=20)
    tt = torch.tensor(theta, requires_grad=True)
    grid = torch.nn.functional.affine_grid(tt, size, align_corners=bool(align))
    (grid * torch.from_numpy(cotangent(tuple(out), F64))).sum().backward()
    check_gradients(net, {"theta": theta}, reference={"theta": tt.grad.numpy()})
