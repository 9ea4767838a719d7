"""Gradients of LpPool and LRN (lossgraph/autodiff/rules/nn.py).

onnxruntime has float kernels only for LpPool and LRN: checked in float32 with the
harness's float tolerances (finite differences with eps=1e-2), and against torch.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from support.gradcheck import attributes_text, check_gradients, check_op, cotangent
from support.models import model

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.runtime.session import create_session

F32 = np.float32


def vjp_against_the_reference(net, x: np.ndarray, forward=None, eps: float = 1e-6,
                              rtol: float = 1e-6, atol: float = 1e-8) -> np.ndarray:
    """lossgraph's gradient of sum(y R) with respect to ``x`` (the model's one input),
    run in onnxruntime without the forward node, against central differences of
    ``forward`` (default: the ONNX reference implementation): for attribute values
    onnxruntime's own kernel refuses (LRN: even sizes, ranks other than 4) or types it
    lacks (double)."""
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    seed, grad = graph.graph.input[1].name, graph.graph.output[-1].name
    kept = [n for n in graph.graph.node if n.op_type != net.graph.node[-1].op_type]
    pruned = helper.make_model(
        helper.make_graph(kept, "vjp", list(graph.graph.input), [graph.graph.output[-1]],
                          list(graph.graph.initializer)),
        opset_imports=list(graph.opset_import), ir_version=graph.ir_version)
    if forward is None:
        evaluator = ReferenceEvaluator(net)

        def forward(value):
            return evaluator.run(None, {"x": value})[0]

    r = cotangent(forward(x).shape, x.dtype)
    got = create_session(pruned).run([grad], {"x": x, seed: r})[0]

    def loss(value):
        return float(np.sum(forward(value) * r))

    numeric = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = (loss(plus) - loss(minus)) / (2 * eps)
    np.testing.assert_allclose(got, numeric, rtol=rtol, atol=atol)
    return got




def _away_from_zero(rng, shape):
    """Values with |x| in [0.5, 1.5]: the norms' slopes are smooth over the FD step."""
    return (rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1, 1], size=shape)).astype(F32)


# ------------------------------------------------------------------------- LpPool
LPPOOL_CASES = [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 1], "p": 3}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [2, 3], "pads": [1, 0, 1, 2], "p": 1}, (1, 2, 5, 4), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 1, 0, 1]}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER", "p": 4},
     (1, 1, 5, 6), 18),
    ({"kernel_shape": [3], "strides": [2], "ceil_mode": 1}, (2, 2, 6), 18),  # partial window
    ({"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 0, 0, 0]},
     (1, 2, 6, 5), 18),
    ({"kernel_shape": [2], "strides": [3]}, (1, 2, 7), 13),  # the last element in no window
    ({"kernel_shape": [2, 2, 2]}, (1, 1, 3, 3, 4), 13),
]


@pytest.mark.parametrize("attrs, shape, opset", LPPOOL_CASES)
def test_lp_pool_gradient(rng, attrs, shape, opset):
    x = _away_from_zero(rng, shape)
    check_op("LpPool", {"x": x}, attrs, opset=opset, eps=1e-2)


def test_lp_pool_gradient_is_zero_not_nan_where_a_window_is_zero(rng):
    x = _away_from_zero(rng, (1, 1, 4, 4))
    x[0, 0, :2, :2] = 0  # the first window's norm is 0
    grads = check_op("LpPool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2]},
                      eps=1e-2)
    assert np.all(np.isfinite(grads["x"]))
    np.testing.assert_array_equal(grads["x"][0, 0, :2, :2], 0)


@pytest.mark.torch
@pytest.mark.parametrize("p, kernel, stride", [(2, 2, 2), (3, 3, 1), (1, 2, 1)])
def test_lp_pool_gradient_matches_torch(rng, p, kernel, stride):
    """torch's lp_pool2d is (sum x^p)^(1/p), without |x|: compared on positive inputs."""
    import torch

    x = np.abs(_away_from_zero(rng, (2, 3, 6, 6)))
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.nn.functional.lp_pool2d(tx, p, kernel, stride)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_op("LpPool", {"x": x}, {"kernel_shape": [kernel] * 2, "strides": [stride] * 2,
                                   "p": p}, eps=1e-2,
              reference={"x": tx.grad.numpy().astype(F32)})


# ---------------------------------------------------------------------------- LRN
LRN_CASES = [
    ({"size": 3}, (2, 5, 3, 2)),
    ({"size": 5, "alpha": 0.3, "beta": 1.2, "bias": 2.0}, (2, 6, 2, 2)),
    ({"size": 7, "alpha": 1.0, "beta": 0.75}, (1, 3, 2, 2)),  # window wider than C
]


@pytest.mark.parametrize("attrs, shape", LRN_CASES)
def test_lrn_gradient(rng, attrs, shape):
    x = rng.normal(size=shape).astype(F32)
    check_op("LRN", {"x": x}, attrs, eps=1e-2)


def _lrn(x: np.ndarray, size: int, alpha: float = 1e-4, beta: float = 0.75,
         bias: float = 1.0) -> np.ndarray:
    """LRN as the specification writes it, for any rank."""
    channels = x.shape[1]
    square_sum = np.zeros_like(x)
    for c in range(channels):
        low, high = max(0, c - (size - 1) // 2), min(channels - 1, c + -(-(size - 1) // 2))
        square_sum[:, c] = np.sum(x[:, low:high + 1] ** 2, axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


@pytest.mark.parametrize("attrs, shape", [
    ({"size": 2, "alpha": 0.5, "beta": 0.6, "bias": 1.5}, (2, 4, 3, 2)),  # window c..c+1
    ({"size": 4, "alpha": 1.0, "beta": 0.75}, (1, 5, 2, 3)),               # c-1..c+2
    ({"size": 4, "alpha": 1.0, "beta": 0.75}, (1, 3, 2, 2, 2)),            # 5-D
    ({"size": 3, "alpha": 0.2}, (3, 4)),                                   # 2-D
    ({"size": 2, "alpha": 0.7, "bias": 0.5}, (2, 3, 4)),                   # 3-D
])
def test_lrn_gradient_for_even_sizes_and_other_ranks(rng, attrs, shape):
    """onnxruntime's LRN takes odd sizes and 4-D inputs only, and the ONNX reference
    implementation (onnx 1.23) loops over the batch instead of the channels: checked
    against the specification's formula (itself checked against onnxruntime's kernel)."""
    x = rng.normal(size=shape)
    dims = ", ".join(str(d) for d in shape)
    net = model(f"(double[{dims}] x) => (double[{dims}] y)",
                f"y = LRN {attributes_text(attrs)} (x)", opset=13)
    vjp_against_the_reference(net, x, lambda v: _lrn(v, **attrs))


def test_the_lrn_formula_of_these_tests_is_onnxruntimes(rng):
    x = rng.normal(size=(2, 5, 3, 2)).astype(F32)
    net = model("(float[2, 5, 3, 2] x) => (float[2, 5, 3, 2] y)",
                "y = LRN <size = 3, alpha = 0.5, beta = 0.6, bias = 1.5> (x)", opset=13)
    np.testing.assert_allclose(create_session(net).run(None, {"x": x})[0],
                               _lrn(x.astype(np.float64), 3, 0.5, 0.6, 1.5), rtol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("size", [3, 5])
def test_lrn_gradient_matches_torch(rng, size):
    import torch

    x = rng.normal(size=(2, 6, 3, 3)).astype(F32)
    attrs = {"size": size, "alpha": 0.4, "beta": 0.8, "bias": 1.3}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.nn.functional.local_response_norm(tx, size, alpha=0.4, beta=0.8, k=1.3)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_op("LRN", {"x": x}, attrs, eps=1e-2, reference={"x": tx.grad.numpy().astype(F32)})


# ---------------------------------------------------------------------- MaxUnpool
def _max_unpool_model(x_shape, i_value: np.ndarray | None, attrs: dict, out_shape,
                      opset: int = 18):
    dims = ", ".join(str(d) for d in x_shape)
    out = ", ".join(str(d) for d in out_shape)
    if i_value is None:  # the indices computed at run time, by a MaxPool
        return model(f"(float[{dims}] x, float[{out}] z) => (float[{out}] y)",
                     f"p, i = MaxPool {attributes_text(attrs)} (z)\n"
                     f"y = MaxUnpool {attributes_text(attrs)} (x, i)",
                     opset=opset)
    values = ", ".join(str(int(v)) for v in i_value.reshape(-1))
    return model(f"(float[{dims}] x) => (float[{out}] y)",
                 f"i = Constant <value = int64[{dims}] {{{values}}}> ()\n"
                 f"y = MaxUnpool {attributes_text(attrs)} (x, i)", opset=opset)


def test_max_unpool_gradient_gathers_dy_at_the_indices(rng):
    x = rng.normal(size=(1, 2, 2, 2)).astype(F32)
    i = np.array([0, 3, 9, 14, 16, 22, 25, 31]).reshape(1, 2, 2, 2)
    net = _max_unpool_model(x.shape, i, {"kernel_shape": [2, 2], "strides": [2, 2]},
                            (1, 2, 4, 4))
    r = cotangent((1, 2, 4, 4), F32)
    grads = check_gradients(net, {"x": x}, eps=1e-2)
    np.testing.assert_allclose(grads["x"].reshape(-1), r.reshape(-1)[i.reshape(-1)])


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_with_repeated_indices_routes_dy_to_the_surviving_write(rng, opset):
    """Overlapping MaxPool windows repeat an index; the last write survives, and only it
    gets the gradient (finite differences agree: the others do not reach y)."""
    x = rng.normal(size=(1, 1, 2, 2)).astype(F32)
    i = np.array([5, 5, 9, 5]).reshape(1, 1, 2, 2)
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1]}
    net = _max_unpool_model(x.shape, i, attrs, (1, 1, 4, 4), opset=opset)
    grads = check_gradients(net, {"x": x}, eps=1e-2)
    assert grads["x"][0, 0, 0, 0] == grads["x"][0, 0, 0, 1] == 0


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_after_a_max_pool_with_overlapping_windows(rng, opset):
    z = rng.permutation(36).reshape(1, 1, 6, 6).astype(F32)  # distinct: no ties
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}
    net = _max_unpool_model((1, 1, 6, 6), None, attrs, (1, 1, 6, 6), opset=opset)
    check_gradients(net, {"x": rng.normal(size=(1, 1, 6, 6)).astype(F32), "z": z}, wrt=["x"],
                    eps=1e-2)


def test_max_unpool_with_a_larger_output_shape_is_a_named_error():
    net = model("(float[1, 1, 2, 2] x) => (float[1, 1, 5, 5] y)",
                "i = Constant <value = int64[1, 1, 2, 2] {5, 7, 13, 15}> ()\n"
                "s = Constant <value = int64[4] {1, 1, 5, 5}> ()\n"
                "y = MaxUnpool <kernel_shape = [2, 2], strides = [2, 2]> (x, i, s)", opset=18)
    with pytest.raises(UnsupportedModelError, match="output_shape"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


# ------------------------------------------------------------------------- Col2Im
COL2IM_CASES = [  # image, block, attrs, channels
    ([5, 5], [2, 2], {}, 1),
    ([5, 5], [2, 3], {"strides": [2, 1]}, 2),
    ([4, 5], [2, 2], {"pads": [1, 0, 1, 2]}, 2),
    ([6, 6], [2, 2], {"dilations": [2, 2], "strides": [2, 1]}, 1),
    ([3, 3, 2], [2, 2, 1], {"pads": [0, 1, 0, 1, 0, 1]}, 1),
    ([7], [3], {"strides": [2], "pads": [1, 1]}, 3),
]


def _col2im_model(x_shape, channels: int, image, block, attrs, kind: str = "float"):
    n = len(image)
    img = ", ".join(str(d) for d in image)
    blk = ", ".join(str(d) for d in block)
    return model(f"({kind}[{', '.join(str(d) for d in x_shape)}] x) => "
                 f"({kind}[{x_shape[0]}, {channels}, {img}] y)",
                 f"i = Constant <value = int64[{n}] {{{img}}}> ()\n"
                 f"b = Constant <value = int64[{n}] {{{blk}}}> ()\n"
                 f"y = Col2Im {attributes_text(attrs)} (x, i, b)", opset=18)


def _col2im_input_shape(channels: int, image, block, attrs) -> tuple[int, int, int]:
    n = len(image)
    pads = attrs.get("pads", [0] * 2 * n)
    dilations, strides = attrs.get("dilations", [1] * n), attrs.get("strides", [1] * n)
    counts = [(image[i] + pads[i] + pads[n + i] - dilations[i] * (block[i] - 1) - 1)
              // strides[i] + 1 for i in range(n)]
    return 2, channels * int(np.prod(block)), int(np.prod(counts))


@pytest.mark.parametrize("image, block, attrs, channels", COL2IM_CASES)
def test_col2im_gradient_is_the_unfold_of_dy(rng, image, block, attrs, channels):
    """Against onnxruntime in 2-D, and the ONNX reference implementation (in float64) in
    1-D and 3-D, where onnxruntime's Col2Im (1.19 and 1.3x) mishandles pads and strides."""
    shape = _col2im_input_shape(channels, image, block, attrs)
    x = rng.normal(size=shape)
    if len(image) != 2:
        model_64 = _col2im_model(shape, channels, image, block, attrs, "double")
        vjp_against_the_reference(model_64, x)
        return
    check_gradients(_col2im_model(shape, channels, image, block, attrs), {"x": x.astype(F32)},
                    eps=1e-2)


@pytest.mark.torch
@pytest.mark.parametrize("image, block, attrs, channels",
                         [c for c in COL2IM_CASES if len(c[0]) == 2])
def test_col2im_gradient_matches_torch_unfold(rng, image, block, attrs, channels):
    import torch

    shape = _col2im_input_shape(channels, image, block, attrs)
    x = rng.normal(size=shape).astype(F32)
    tx = torch.tensor(x, requires_grad=True)
    pads = attrs.get("pads", [0, 0, 0, 0])
    padded = [d + pads[i] + pads[2 + i] for i, d in enumerate(image)]
    y = torch.nn.functional.fold(tx, padded, block, dilation=attrs.get("dilations", 1),
                                 stride=attrs.get("strides", 1))
    y = y[:, :, pads[0]:pads[0] + image[0], pads[1]:pads[1] + image[1]]  # the image proper
    (y * torch.from_numpy(cotangent(tuple(y.shape), F32))).sum().backward()
    check_gradients(_col2im_model(shape, channels, image, block, attrs), {"x": x}, eps=1e-2,
                    reference={"x": tx.grad.numpy()})
