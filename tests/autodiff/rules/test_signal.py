"""Gradient of DFT (lossgraph/autodiff/rules/signal.py), against finite differences, the
one-sided inverse's adjoint and torch.fft; the rules emit constants in the forward's type."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients, cotangent, numeric_vjp, reference_vjp
from support.models import dims, model, signature

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.runtime.session import create_session

F64 = np.float64


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
    grads, y = reference_vjp(net, {"x": x}, ["x"])
    r = cotangent(y.shape, y.dtype)

    def irfft(value):
        return np.fft.irfft(value[..., 0] + 1j * value[..., 1], n=n, axis=1)[..., None]

    np.testing.assert_allclose(y, irfft(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["x"], numeric_vjp(irfft, x, r), rtol=1e-6, atol=1e-8)
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


def test_float_outputs_of_the_rules_here_run_in_float32_too(rng):
    """The rules emit constants in the forward's type: a float32 DFT model."""
    x = rng.normal(size=(2, 6, 2)).astype(np.float32)
    net = _dft_model(x, (2, 6, 2), "inverse = 1")
    net.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    seed = graph.graph.input[1].name
    got = create_session(graph).run(["x_grad"], {"x": x, seed: np.ones((2, 6, 2), np.float32)})
    assert got[0].dtype == np.float32
