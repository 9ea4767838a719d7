"""Gradients of DFT, RotaryEmbedding, AffineGrid, TensorScatter, the optional ops and
the ai.onnx.ml ops ArrayFeatureExtractor and Binarizer (lossgraph/autodiff/rules/
signal.py, geometry.py, cache.py, optional.py, ml.py), and the ops declared without a
derivative (declared in lossgraph/autodiff/registry.py's not_differentiable).

Ops of opsets 22 and later load only in onnxruntime 1.20 and later: checked against
finite differences there (skipped with the training build); the torch comparisons run
the gradient graph with the ONNX reference implementation instead.
"""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients, cotangent, finite_differences, loss_model
from support.models import dims, model, signature

import lossgraph
from lossgraph.autodiff.registry import not_differentiable_ops, not_differentiable_reason
from lossgraph.errors import NoGradientError, UnsupportedModelError
from lossgraph.runtime.session import create_session
from lossgraph.target import use_target

F32, F64 = np.float32, np.float64


def _newer_runtime() -> contextlib.AbstractContextManager:
    import onnxruntime

    if tuple(int(p) for p in onnxruntime.__version__.split(".")[:2]) < (1, 20):
        pytest.skip("onnxruntime-training 1.19 loads opsets up to 21; this op is opset 22+")
    return use_target("onnxruntime")


def _reference_vjp(net: onnx.ModelProto, feeds: dict, wrt: list[str], output: str = "y"
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """lossgraph's vector-Jacobian product for the fixed cotangent, and the forward
    output, both run by the ONNX reference implementation."""
    with use_target("onnxruntime"):
        graph = lossgraph.gradient(net, weights=wrt, outputs=[output])
    y = np.asarray(ReferenceEvaluator(net).run([output], feeds)[0])
    seed = graph.graph.input[len(net.graph.input)].name
    values = ReferenceEvaluator(graph).run([f"{w}_grad" for w in wrt],
                                           {**feeds, seed: cotangent(y.shape, y.dtype)})
    return dict(zip(wrt, values)), y


def _numeric(forward, x: np.ndarray, r: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of sum(forward(x) r)."""
    grad = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = np.sum((forward(plus) - forward(minus)) * r) / (2 * eps)
    return grad


def _check_with_foreign_forward(net: onnx.ModelProto, feeds: dict, reference: dict,
                                eps: float = 1e-6, rtol: float = 1e-6,
                                atol: float = 1e-7) -> dict[str, np.ndarray]:
    """The gradient of sum(y R) against central differences and ``reference``, for a
    forward of another domain (gradcheck.check_gradients wants every node standard;
    the gradient's own nodes are)."""
    with_loss = loss_model(net, feeds)
    graph = lossgraph.gradient(with_loss, weights=list(reference), loss_name="gradcheck_loss")
    forward_nodes = len(with_loss.graph.node)
    assert all(n.domain in ("", "ai.onnx") for n in graph.graph.node[forward_nodes:])
    got = dict(zip(reference, create_session(graph).run([f"{w}_grad" for w in reference],
                                                          feeds)))
    for w, expected in reference.items():
        numeric = finite_differences(with_loss, feeds, w, eps)
        np.testing.assert_allclose(got[w], numeric, rtol=rtol, atol=atol, err_msg=w)
        np.testing.assert_allclose(got[w], expected, rtol=rtol, atol=atol, err_msg=w)
    return got


# --------------------------------------------------------------------------- DFT
def _dft_model(x: np.ndarray, out_shape: tuple, attrs: str = "", length: int | None = None,
               axis: int | None = None, opset: int = 20) -> onnx.ModelProto:
    constants, args = [], ["x"]
    if length is not None:
        constants.append(f"int64 n = {{{length}}}")
    if opset >= 20:
        args.append("n" if length is not None else "")
        if axis is not None:
            constants.append(f"int64 a = {{{axis}}}")
            args.append("a")
    else:
        args.append("n" if length is not None else "")
        if axis is not None:
            attrs = f"{attrs}, axis = {axis}" if attrs else f"axis = {axis}"
    while args and not args[-1]:
        args.pop()
    sig = signature({"x": x}, f"double[{dims(out_shape)}] y")
    if constants:
        sig += " <" + ", ".join(constants) + ">"
    return model(sig, f"y = DFT {'<' + attrs + '>' if attrs else ''} ({', '.join(args)})",
                 opset=opset)


DFT_CASES = [
    # (input shape, output shape, attributes, dft_length, axis, opset)
    ((2, 8, 2), (2, 8, 2), "", None, None, 20),  # complex, the default axis -2
    ((2, 8, 1), (2, 8, 2), "", None, None, 20),  # real input
    ((2, 8, 2), (2, 8, 2), "inverse = 1", None, None, 20),
    ((2, 8, 1), (2, 5, 2), "onesided = 1", None, None, 20),  # rfft
    ((2, 7, 1), (2, 4, 2), "onesided = 1", None, None, 20),  # rfft, odd length
    ((2, 6, 2), (2, 9, 2), "", 9, None, 20),  # zero-padded to n
    ((2, 9, 2), (2, 6, 2), "inverse = 1", 6, None, 20),  # cut to n
    ((3, 4, 5, 2), (3, 4, 5, 2), "", None, 2, 20),  # another axis
    ((3, 5, 4, 1), (3, 5, 3, 2), "onesided = 1", None, -2, 20),
    ((2, 8, 2), (2, 8, 2), "", None, 1, 17),  # opset 17: axis attribute
    ((3, 4, 5, 1), (3, 4, 8, 2), "", 8, 2, 17),
]


@pytest.mark.parametrize("shape, out_shape, attrs, length, axis, opset", DFT_CASES)
def test_dft_gradient_matches_finite_differences(rng, shape, out_shape, attrs, length, axis,
                                                 opset):
    x = rng.normal(size=shape)
    net = _dft_model(x, out_shape, attrs, length, axis, opset)
    check_gradients(net, {"x": x})


@pytest.mark.parametrize("n", [8, 7])
def test_one_sided_inverse_dft_is_the_adjoint_of_irfft(rng, n):
    """irfft: a half spectrum in, a real signal of length n out; the imaginary parts at
    frequency 0 (and n/2 for even n) do not matter and get zero. onnxruntime has no
    kernel for it: the reference implementation runs the graphs."""
    half = n // 2 + 1
    x = rng.normal(size=(2, half, 2))
    net = _dft_model(x, (2, n, 1), "inverse = 1, onesided = 1", n)
    grads, y = _reference_vjp(net, {"x": x}, ["x"])
    r = cotangent(y.shape, y.dtype)

    def irfft(value):
        return np.fft.irfft(value[..., 0] + 1j * value[..., 1], n=n, axis=1)[..., None]

    np.testing.assert_allclose(y, irfft(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["x"], _numeric(irfft, x, r), rtol=1e-6, atol=1e-8)
    assert grads["x"][:, 0, 1].tolist() == [0.0, 0.0]


def test_dft_gradient_needs_a_constant_length():
    net = model("(double[2, 8, 2] x, int64 n) => (double[2, N, 2] y)", "y = DFT(x, n)",
                opset=20)
    with pytest.raises(UnsupportedModelError, match="dft_length"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["fft", "ifft", "rfft"])
def test_dft_gradient_matches_torch_fft(rng, kind):
    import torch

    complex_input = kind != "rfft"
    x = rng.normal(size=(3, 8, 2 if complex_input else 1))
    attrs = {"fft": "", "ifft": "inverse = 1", "rfft": "onesided = 1"}[kind]
    out = (3, 5, 2) if kind == "rfft" else (3, 8, 2)
    net = _dft_model(x, out, attrs)
    tx = torch.tensor(x, requires_grad=True)
    signal = torch.view_as_complex(tx) if complex_input else tx[..., 0]
    y = torch.view_as_real(getattr(torch.fft, kind)(signal, dim=1))
    (y * torch.from_numpy(cotangent(out, F64))).sum().backward()
    check_gradients(net, {"x": x}, reference={"x": tx.grad.numpy()})


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
    with _newer_runtime():
        check_gradients(_rotary_model(feeds, attrs), feeds, eps=1e-2)


@pytest.mark.parametrize("shape, attrs, with_positions", ROTARY_CASES)
def test_rotary_embedding_gradient_matches_the_specification(rng, shape, attrs, with_positions):
    """Run by the reference implementation, against central differences of the
    specification's formula in float64."""
    feeds = _rotary_feeds(rng, shape, attrs, with_positions)
    wrt = ["x", "cos", "sin"]
    grads, y = _reference_vjp(_rotary_model(feeds, attrs), feeds, wrt)
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

        np.testing.assert_allclose(grads[name], _numeric(forward, values[name], r), rtol=1e-5,
                                   atol=1e-5, err_msg=name)


@pytest.mark.torch
def test_rotary_embedding_gradient_matches_torch(rng):
    import torch

    attrs = {"interleaved": 1}
    feeds = _rotary_feeds(rng, (2, 3, 4, 8), attrs, True)
    grads, y = _reference_vjp(_rotary_model(feeds, attrs), feeds, ["x", "cos", "sin"])
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


# ------------------------------------------------------------------- TensorScatter
SCATTER_CASES = [
    ((2, 6, 3), (2, 2, 3), "linear", -2, [1, 4]),
    ((2, 5, 3), (2, 3, 3), "circular", -2, [3, 0]),
    ((2, 3, 6), (2, 3, 4), "circular", 2, [5, 1]),  # wraps around
    ((2, 2, 5, 3), (2, 2, 2, 3), "linear", 2, None),  # no write indices: from 0
]


@pytest.mark.parametrize("cache, update, mode, axis, writes", SCATTER_CASES)
def test_tensor_scatter_gradient_matches_finite_differences(rng, cache, update, mode, axis,
                                                            writes):
    feeds = {"past": rng.normal(size=cache), "u": rng.normal(size=update)}
    args = "past, u"
    sig = signature(feeds, f"double[{dims(cache)}] y")
    if writes is not None:
        sig += f" <int64[2] w = {{{', '.join(map(str, writes))}}}>"
        args += ", w"
    net = model(sig, f'y = TensorScatter <mode = "{mode}", axis = {axis}> ({args})', opset=24)
    with _newer_runtime():
        grads = check_gradients(net, feeds)
    ones = {"past": np.ones(cache), "u": np.zeros(update)}
    written = np.asarray(ReferenceEvaluator(net).run(None, ones)[0]) == 0
    np.testing.assert_array_equal(grads["past"][written], 0)  # overwritten: no gradient
    assert np.all(grads["past"][~written] != 0)


# ------------------------------------------------------------------- optional ops
def test_optional_get_element_of_a_tensor_is_the_identity(rng):
    x = rng.normal(size=(4,))
    net = model("(double[4] x) => (double[4] y)", "e = OptionalGetElement(x) y = Sin(e)",
                opset=18)
    check_gradients(net, {"x": x}, reference={"x": np.cos(x) * cotangent(x.shape, F64)})


# ----------------------------------------------------------------------- ai.onnx.ml
@pytest.mark.parametrize("shape, indices", [((3, 5), [4, 0, 4]), ((2, 2, 4), [1]),
                                            ((5,), [3, 3, 0])])
def test_array_feature_extractor_gradient_gathers_back(rng, shape, indices):
    x = rng.normal(size=shape)
    out = (*shape[:-1], len(indices)) if len(shape) > 1 else (1, len(indices))
    net = model(f"(double[{dims(shape)}] x) => (double[{dims(out)}] y) "
                f"<int64[{len(indices)}] i = {{{', '.join(map(str, indices))}}}>",
                "y = ai.onnx.ml.ArrayFeatureExtractor(x, i)", opset=18, domains={"ai.onnx.ml": 3})
    r = cotangent(out, F64).reshape(*shape[:-1], len(indices))
    expected = np.zeros(shape)
    for k, index in enumerate(indices):
        expected[..., index] += r[..., k]
    _check_with_foreign_forward(net, {"x": x}, {"x": expected})


def test_binarizer_gradient_is_zero(rng):
    """onnxruntime's Binarizer is float32 only."""
    x = rng.normal(size=(3, 4)).astype(F32)
    x[np.abs(x - 0.1) < 0.05] = 0.5  # away from the threshold
    net = model("(float[3, 4] x) => (float[3, 4] y)",
                "y = ai.onnx.ml.Binarizer <threshold = 0.1> (x)", opset=18,
                domains={"ai.onnx.ml": 3})
    _check_with_foreign_forward(net, {"x": x}, {"x": np.zeros_like(x)}, eps=1e-3)


# ------------------------------------------------------------- not differentiable
NOT_DIFFERENTIABLE_MODELS = [
    ("Unique", "(double[6] x) => (double[N] y)", "y = Unique(x)", 18, {}),
    ("Bernoulli", "(double[6] x) => (double[6] y)", "y = Bernoulli(x)", 18, {}),
    ("MelWeightMatrix", "(float lo) => (float[5, 4] y) <int64 m = {4}, int64 n = {8}, "
     "int64 r = {8000}, float hi = {3000}>", "y = MelWeightMatrix(m, n, r, lo, hi)", 18, {}),
    ("TreeEnsemble", "(double[2, 3] x) => (double[2, 1] y)",
     "y = ai.onnx.ml.TreeEnsemble <aggregate_function = 1, leaf_targetids = [0, 0], "
     "leaf_weights = double[2] {1.0, 2.0}, nodes_falseleafs = [1], nodes_falsenodeids = [1], "
     "nodes_featureids = [0], nodes_modes = uint8[1] {0}, nodes_splits = double[1] {0.5}, "
     "nodes_trueleafs = [1], nodes_truenodeids = [0], n_targets = 1, "
     "post_transform = 0, tree_roots = [0]> (x)", 18, {"ai.onnx.ml": 5}),
    ("Momentum", "(float r, int64 t, double[3] w, double[3] g, double[3] v) => "
     "(double[3] w2, double[3] v2)",
     'w2, v2 = ai.onnx.preview.training.Momentum <alpha = 0.9, beta = 1.0, mode = "standard",'
     " norm_coefficient = 0.0> (r, t, w, g, v)", 18, {"ai.onnx.preview.training": 1}),
]


@pytest.mark.parametrize("op, sig, body, opset, domains", NOT_DIFFERENTIABLE_MODELS)
def test_ops_without_a_derivative_worth_having_are_named_not_differentiable(op, sig, body,
                                                                            opset, domains):
    net = model(sig, body, opset=opset, domains=domains)
    x = net.graph.input[0].name if op != "Momentum" else "w"
    with pytest.raises(NoGradientError, match=op):
        lossgraph.gradient(net, weights=[x], outputs=[net.graph.output[0].name])
    domain = next(iter(domains), "")
    assert not_differentiable_reason(op, domain)


def test_every_op_declared_not_differentiable_exists_and_has_no_rule():
    for (domain, op), reason in not_differentiable_ops().items():
        assert onnx.defs.has(op, domain), (domain, op)
        assert lossgraph.autodiff.registry.find_rule(op, domain, 100) is None, (domain, op)
        assert reason and len(reason) < 200


def test_float_outputs_of_the_rules_here_run_in_float32_too(rng):
    """The rules emit constants in the forward's type: a float32 DFT model."""
    x = rng.normal(size=(2, 6, 2)).astype(np.float32)
    net = _dft_model(x, (2, 6, 2), "inverse = 1")
    net.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    seed = graph.graph.input[1].name
    got = create_session(graph).run(["x_grad"], {"x": x, seed: np.ones((2, 6, 2), np.float32)})
    assert got[0].dtype == np.float32
