"""Gradients of convolutions, pooling and normalizations (lossgraph/autodiff/rules/nn.py).

onnxruntime's CPU Conv, ConvTranspose, AveragePool, Global*Pool and
InstanceNormalization have no double kernels: those are checked in float32 with the
harness's float tolerances (finite differences with eps=1e-2 on moderate values).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gradcheck import check_gradients, check_op, cotangent
from models import model, signature

import lossgraph
from lossgraph.errors import UnsupportedModelError

F32 = np.float32




# --------------------------------------------------------------------------- Conv
CONV_CASES = [
    # (x shape, w shape, attrs)
    ((2, 3, 6, 5), (4, 3, 3, 2), {}),
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 9, 8), (3, 2, 2, 3), {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 2]}),
    ((2, 4, 6, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ((1, 6, 7, 5), (3, 2, 2, 2), {"group": 3, "strides": [2, 2]}),
    ((2, 4, 7, 7), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 6, 7), (3, 2, 2, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((2, 2, 7, 6), (2, 2, 3, 2), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((2, 3, 9), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((3, 4, 8), (2, 2, 2), {"group": 2, "strides": [3]}),
]


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_CASES)
def test_conv_gradients_for_strides_pads_dilations_groups(rng, x_shape, w_shape, attrs,
                                                          with_bias):
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5}
    if with_bias:
        feeds["b"] = rng.normal(size=w_shape[0]).astype(F32)
    # onnxruntime-training's ConvGrad ignores auto_pad SAME_* (finite differences agree
    # with lossgraph there, ConvGrad does not): compare with it only for explicit pads.
    same = attrs.get("auto_pad", "").startswith("SAME")
    grads = check_op("Conv", feeds, attrs, eps=1e-2, ort=False if same else True)
    assert set(grads) == set(feeds)


@pytest.mark.torch
@pytest.mark.parametrize("x_shape, w_shape, attrs",
                         [c for c in CONV_CASES if "auto_pad" not in c[2]])
def test_conv_gradients_match_torch(rng, x_shape, w_shape, attrs):
    import torch

    x = rng.normal(size=x_shape).astype(F32)
    w = rng.normal(size=w_shape).astype(F32) * 0.5
    n = len(x_shape) - 2
    pads = attrs.get("pads", [0] * 2 * n)
    # torch pads symmetrically: pad explicitly first
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    torch_pad = []
    for i in reversed(range(n)):
        torch_pad += [pads[i], pads[n + i]]
    conv = torch.nn.functional.conv2d if n == 2 else torch.nn.functional.conv1d
    y = conv(torch.nn.functional.pad(tx, torch_pad), tw, stride=attrs.get("strides", 1),
             dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
    (y * torch.from_numpy(cotangent(y.shape, F32))).sum().backward()
    check_op("Conv", {"x": x, "w": w}, attrs, eps=1e-2,
              reference={"x": tx.grad.numpy(), "w": tw.grad.numpy()})


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 4, 5), (3, 2, 3, 3), {}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 1], "pads": [1, 0, 0, 1]}),
    ((2, 4, 3, 3), (4, 1, 2, 2), {"group": 2, "strides": [2, 2], "output_padding": [1, 0],
                                  "dilations": [1, 2]}),
    ((2, 3, 5), (3, 2, 3), {"strides": [2], "pads": [1, 1], "output_padding": [1]}),
])
def test_conv_transpose_gradients(rng, x_shape, w_shape, attrs):
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5,
             "b": rng.normal(size=w_shape[1] * attrs.get("group", 1)).astype(F32)}
    check_op("ConvTranspose", feeds, attrs, eps=1e-2)


def test_conv_transpose_with_output_shape_is_unsupported(rng):
    feeds = {"x": rng.normal(size=(1, 2, 3, 3)).astype(F32),
             "w": rng.normal(size=(2, 2, 3, 3)).astype(F32)}
    with pytest.raises(UnsupportedModelError, match="explicit pads"):
        check_op("ConvTranspose", feeds, {"strides": [2, 2], "output_shape": [6, 6]})


# ------------------------------------------------------------------------ pooling
def _distinct(rng, shape, dtype=F32):
    """Values far apart from each other (no ties, no near-ties for max)."""
    values = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1
    return (values - values.mean()).astype(dtype)


MAXPOOL_CASES = [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [1, 1]}, (1, 2, 5, 5), 18),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, (2, 2, 5, 4), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "strides": [1, 2]}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 7), 18),
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 2, 4, 4), 13),
    ({"kernel_shape": [2, 3], "strides": [2, 3]}, (1, 2, 5, 7), 15),
]


@pytest.mark.parametrize("dtype", [np.float64, F32])
@pytest.mark.parametrize("attrs, shape, opset", MAXPOOL_CASES)
def test_max_pool_routes_gradient_to_the_argmax(rng, attrs, shape, opset, dtype):
    x = _distinct(rng, shape, dtype)
    check_op("MaxPool", {"x": x}, attrs, opset=opset, eps=1e-2 if dtype == F32 else 1e-6)


def test_max_pool_with_overlapping_windows_needs_opset_16(rng):
    x = _distinct(rng, (1, 1, 4, 4))
    with pytest.raises(UnsupportedModelError, match="opset 16"):
        check_op("MaxPool", {"x": x}, {"kernel_shape": [3, 3]}, opset=15)


@pytest.mark.parametrize("attrs, shape, opset", [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [1, 2]}, (1, 2, 5, 6), 13),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, (2, 2, 5, 4), 18),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1},
     (2, 2, 5, 4), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER",
      "count_include_pad": 1}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 1, 0, 1]}, (1, 2, 6, 6), 19),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 7), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 7, 7), 18),
])
def test_average_pool_gradient_is_the_exact_adjoint(rng, attrs, shape, opset):
    x = rng.normal(size=shape).astype(F32)
    check_op("AveragePool", {"x": x}, attrs, opset=opset, eps=1e-2)


def test_average_pool_ceil_mode_that_changes_the_shape_is_unsupported(rng):
    x = rng.normal(size=(1, 1, 6, 6)).astype(F32)
    with pytest.raises(UnsupportedModelError, match="ceil_mode"):
        check_op("AveragePool", {"x": x}, {"kernel_shape": [3, 3], "strides": [2, 2],
                                           "ceil_mode": 1})


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 7), (1, 2, 2, 3, 2)])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pools(rng, op, shape):
    x = _distinct(rng, shape)
    check_op(op, {"x": x}, {}, eps=1e-2, ort=True if op == "GlobalAveragePool" else "auto")


# ----------------------------------------------------------------- normalizations
def _bn_feeds(rng, shape):
    c = shape[1]
    return {"x": rng.normal(size=shape), "scale": rng.normal(size=c),
            "b": rng.normal(size=c), "mean": rng.normal(size=c) * 0.3,
            "var": rng.uniform(0.5, 1.5, size=c)}


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (2, 3, 2, 4)])
@pytest.mark.parametrize("opset", [13, 15, 18])
def test_batch_normalization_inference(rng, shape, opset):
    c = shape[1]
    feeds = _bn_feeds(rng, shape)
    grads = check_op("BatchNormalization", feeds, {"epsilon": 1e-3}, opset=opset)
    inv = 1 / np.sqrt(feeds["var"] + 1e-3)
    r = cotangent(shape, np.float64)
    axes = tuple(i for i in range(len(shape)) if i != 1)
    per_channel = (c,) + (1,) * (len(shape) - 2)
    xhat = (feeds["x"] - feeds["mean"].reshape(per_channel)) * inv.reshape(per_channel)
    np.testing.assert_allclose(grads["scale"], (r * xhat).sum(axis=axes), rtol=1e-9)
    # the statistics: y = scale (x - mean) inv + b
    np.testing.assert_allclose(grads["mean"], -r.sum(axis=axes) * feeds["scale"] * inv,
                               rtol=1e-9)
    np.testing.assert_allclose(grads["var"], -0.5 * (r * xhat).sum(axis=axes)
                               * feeds["scale"] * inv**2, rtol=1e-9)


@pytest.mark.parametrize("output", ["y", "rm", "rv"])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 2, 3)])
def test_batch_normalization_training_mode_uses_batch_statistics(rng, shape, output):
    """y uses the batch statistics; the running statistics rm = 0.8 mean + 0.2 mu and
    rv = 0.8 var + 0.2 s^2 (biased) carry gradients to x, mean and var."""
    feeds = _bn_feeds(rng, shape)
    body = ("y, rm, rv = BatchNormalization<training_mode=1, epsilon=1e-3, momentum=0.8>"
            "(x, scale, b, mean, var)")
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"double[{dims}] y, double[c] rm, double[c] rv"), body, opset=15)
    grads = check_gradients(net, feeds, output=output)
    r = cotangent((shape[1],), np.float64)
    if output == "rm":
        momentum = float(np.float32(0.8))  # a float attribute
        np.testing.assert_allclose(grads["mean"], momentum * r, rtol=1e-12)
    if output == "y":
        np.testing.assert_array_equal(grads["mean"], np.zeros(shape[1]))


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 2, 3, 4), (1, 3, 4)])
def test_instance_normalization(rng, shape):
    c = shape[1]
    feeds = {"x": rng.normal(size=shape).astype(F32),
             "scale": rng.normal(size=c).astype(F32), "b": rng.normal(size=c).astype(F32)}
    check_op("InstanceNormalization", feeds, {"epsilon": 1e-2}, eps=1e-2, rtol=5e-3,
              atol=5e-3)


@pytest.mark.parametrize("shape, axis, scale_shape, with_bias", [
    ((3, 4), -1, (4,), True),
    ((2, 3, 4), -1, (4,), False),
    ((2, 3, 4), 1, (3, 4), True),
    ((2, 3, 4), -2, (1, 3, 4), True),
    ((2, 3, 4), -1, (1, 4), True),
    ((2, 3, 2, 2), 2, (2, 2), True),
    ((3, 5), 0, (3, 5), True),
])
def test_layer_normalization(rng, shape, axis, scale_shape, with_bias):
    feeds = {"x": rng.normal(size=shape), "scale": rng.normal(size=scale_shape)}
    if with_bias:
        feeds["b"] = rng.normal(size=scale_shape)
    check_op("LayerNormalization", feeds, {"axis": axis, "epsilon": 1e-3}, opset=17)


@pytest.mark.parametrize("output", ["mean", "inv_std"])
@pytest.mark.parametrize("shape, axis", [((3, 4), -1), ((2, 3, 4), 1), ((2, 3, 2, 2), 2)])
def test_layer_normalization_statistics_outputs(rng, shape, axis, output):
    """Mean and InvStdDev = (var + eps)^-1/2 over axes [axis, rank), as gradients to x.

    float32: onnxruntime 1.19 has no LayerNormalization with double statistics."""
    scale_shape = shape[axis:]
    feeds = {"x": rng.normal(size=shape).astype(F32),
             "scale": rng.normal(size=scale_shape).astype(F32),
             "b": rng.normal(size=scale_shape).astype(F32)}
    body = f"y, mean, inv_std = LayerNormalization<axis={axis}, epsilon=1e-1>(x, scale, b)"
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    stats = ",".join(f"s{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"float[{dims}] y, float[{stats}] mean, float[{stats}] inv_std"),
                body, opset=17)
    grads = check_gradients(net, feeds, output=output, eps=1e-2, rtol=5e-3, atol=5e-3)
    axes = tuple(range(axis % len(shape), len(shape)))
    r = cotangent(np.mean(feeds["x"], axis=axes, keepdims=True).shape, F32)
    n = np.prod([shape[a] for a in axes])
    if output == "mean":
        np.testing.assert_allclose(grads["x"], np.broadcast_to(r / n, shape), rtol=1e-5)


@pytest.mark.parametrize("shape, groups", [((2, 4, 3), 2), ((2, 6, 2, 2), 3), ((1, 4, 5), 4),
                                           ((2, 3, 4), 1)])
def test_group_normalization_with_per_channel_scale(rng, shape, groups):
    feeds = {"x": rng.normal(size=shape), "scale": rng.normal(size=shape[1]),
             "b": rng.normal(size=shape[1])}
    # stash_type=11: statistics in double (the default stashes them in float32)
    check_op("GroupNormalization", feeds, {"num_groups": groups, "epsilon": 1e-3,
                                            "stash_type": 11}, opset=21)


def test_group_normalization_in_float32_with_default_stash_type(rng):
    feeds = {"x": rng.normal(size=(2, 6, 4)).astype(F32),
             "scale": rng.normal(size=6).astype(F32), "b": rng.normal(size=6).astype(F32)}
    check_op("GroupNormalization", feeds, {"num_groups": 3, "epsilon": 1e-2}, opset=21,
              eps=1e-2, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape, axis", [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1)])
def test_lp_normalization(rng, shape, axis, p):
    x = rng.uniform(0.2, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    check_op("LpNormalization", {"x": x}, {"axis": axis, "p": p})


# ------------------------------------------------------------------ golden CNN
@pytest.mark.torch
def test_golden_cnn_weight_gradients_match_torch():
    import recipes
    import torch
    from conftest import GOLDEN_MODELS

    model = onnx.load(str(GOLDEN_MODELS / "torch_cnn.onnx"))
    with_loss = lossgraph.add_loss_output(model, "multiclass_log_loss", from_logits=True)
    graph = lossgraph.gradient(with_loss)
    X, y, _, _ = recipes.dataset("torch_cnn")
    X, y = X[:16], y[:16]

    import onnxruntime

    session = onnxruntime.InferenceSession(graph.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    feeds = {i.name: None for i in session.get_inputs()}
    label = next(n for n in feeds if n != "input")
    outputs = [o.name for o in session.get_outputs()]
    result = dict(zip(outputs, session.run(None, {"input": X, label: y})))

    net = recipes.fit_estimator("torch_cnn")
    logits = net(torch.from_numpy(X))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(result[outputs[0]], loss.item(), rtol=1e-5)
    expected = dict(net.named_parameters())
    names = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    for name in names:
        np.testing.assert_allclose(result[f"{name}_grad"], expected[name].grad.numpy(),
                                   rtol=1e-4, atol=1e-6, err_msg=name)
