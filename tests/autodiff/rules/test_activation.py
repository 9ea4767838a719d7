"""Gradient rules of the activations, PRelu and Dropout (lossgraph/autodiff/rules/activation.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients, cotangent, loss_model
from support.models import parse_model

from lossgraph import gradient


def _away_from(x: np.ndarray, kinks, margin: float = 0.05) -> np.ndarray:
    """``x`` with values within ``margin`` of a kink pushed away from it."""
    x = np.array(x, copy=True)
    for kink in kinks:
        near = np.abs(x - kink) < margin
        x[near] = kink + np.where(x[near] >= kink, margin, -margin) * 2
    return x


def _unary(op: str, attrs: str = "", shape=(3, 4), dtype: str = "double", opset: int = 18,
           ir: int = 8) -> str:
    dims = ", ".join(map(str, shape))
    attributes = f"<{attrs}>" if attrs else ""
    return f"""
        <ir_version: {ir}, opset_import: ["" : {opset}]>
        g ({dtype}[{dims}] x) => ({dtype}[{dims}] y) {{ y = {op}{attributes}(x) }}
    """


# ------------------------------------------------------------------- elementwise
UNARY_CASES = [
    # (op, attributes, kinks, opset, dtype, compare with ort-training: True enforces it)
    # onnxruntime runs many activations in double only at opset 18 (as function bodies)
    ("Relu", "", [0.0], 18, "double", True),
    ("Relu", "", [0.0], 13, "float", True),
    ("Sigmoid", "", [], 18, "double", True),
    ("HardSigmoid", "", [-2.5, 2.5], 18, "double", "auto"),
    ("HardSigmoid", "alpha: float = 0.5, beta: float = 0.25", [-0.5, 1.5], 13, "float", "auto"),
    ("LeakyRelu", "", [0.0], 18, "double", True),
    ("LeakyRelu", "alpha: float = 0.3", [0.0], 13, "float", True),
    ("Elu", "", [0.0], 18, "double", "auto"),
    ("Elu", "alpha: float = 0.7", [0.0], 13, "float", "auto"),
    ("Selu", "", [0.0], 18, "double", "auto"),
    ("Selu", "alpha: float = 1.5, gamma: float = 2.0", [0.0], 21, "float", "auto"),
    ("Softplus", "", [], 18, "double", "auto"),
    ("Softplus", "", [], 13, "float", "auto"),
    ("Softsign", "", [0.0], 18, "double", "auto"),
    ("ThresholdedRelu", "", [1.0], 18, "double", "auto"),
    ("ThresholdedRelu", "alpha: float = -0.5", [-0.5], 13, "float", "auto"),
    ("HardSwish", "", [-3.0, 3.0], 18, "double", "auto"),
    ("HardSwish", "", [-3.0, 3.0], 14, "float", "auto"),
    ("Mish", "", [], 18, "double", "auto"),
    ("Mish", "", [], 21, "float", "auto"),
    ("Gelu", "", [], 20, "float", "auto"),
    # onnxruntime-training's GeluGrad ignores approximate="tanh": no comparison
    ("Gelu", 'approximate: string = "tanh"', [], 20, "float", False),
    ("Shrink", "", [-0.5, 0.5], 13, "float", "auto"),
    ("Shrink", "lambd: float = 1.0, bias: float = 0.3", [-1.0, 1.0], 13, "float", "auto"),
]


@pytest.mark.parametrize("op, attrs, kinks, opset, dtype, ort", UNARY_CASES,
                         ids=[f"{c[0]}-opset{c[3]}-{c[4]}-{i}" for i, c in enumerate(UNARY_CASES)])
def test_elementwise_activation_matches_finite_differences(rng, op, attrs, kinks, opset, dtype,
                                                           ort):
    x = _away_from(rng.normal(scale=2.5, size=(3, 4)), kinks)
    x = x.astype(np.float32 if dtype == "float" else np.float64)
    ir = 9 if opset >= 20 else 8
    check_gradients(_unary(op, attrs, opset=opset, ir=ir, dtype=dtype), {"x": x}, ort=ort)


def test_gelu_tanh_in_double_matches_finite_differences(rng):
    # approximate="none" runs in float only: onnxruntime has no double Erf kernel
    x = rng.normal(scale=2.0, size=(3, 4))
    check_gradients(_unary("Gelu", 'approximate: string = "tanh"', opset=20, ir=9), {"x": x},
                    ort=False)


@pytest.mark.parametrize("attrs, kinks", [("", [0.0]), ("alpha: float = 2.0", [0.0])])
def test_celu_matches_finite_differences_in_float32(rng, attrs, kinks):
    # onnxruntime's Celu kernel is float-only
    x = _away_from(rng.normal(scale=2.0, size=(3, 4)), kinks).astype(np.float32)
    check_gradients(_unary("Celu", attrs, dtype="float"), {"x": x})


def test_hard_swish_matches_finite_differences_including_both_saturated_ends(rng):
    x = _away_from(rng.normal(scale=3.0, size=(4, 5)), [-3.0, 3.0])
    x[0, :3] = [-4.5, 0.2, 4.5]
    check_gradients(_unary("HardSwish", shape=(4, 5)), {"x": x})


def test_relu_gradient_is_the_positive_mask(rng):
    x = _away_from(rng.normal(size=(2, 3, 4)), [0.0])
    expected = cotangent((2, 3, 4), np.float64) * (x > 0)
    check_gradients(_unary("Relu", shape=(2, 3, 4)), {"x": x}, reference={"x": expected})


def test_relu_rule_emits_no_where():
    model = loss_model(_unary("Relu"), {"x": np.ones((3, 4))})
    ops = {n.op_type for n in gradient(model, weights=["x"], loss_name="gradcheck_loss").graph.node}
    assert "Where" not in ops and "Cast" in ops


@pytest.mark.torch
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch_autograd(rng, approximate):
    import torch

    x = rng.normal(scale=2.0, size=(3, 4))
    r = cotangent((3, 4), np.float32).astype(np.float64)
    xt = torch.tensor(x, requires_grad=True)
    torch.nn.functional.gelu(xt, approximate=approximate).backward(torch.tensor(r))
    attrs = f'approximate: string = "{approximate}"'
    check_gradients(_unary("Gelu", attrs, opset=20, ir=9, dtype="float"),
                    {"x": x.astype(np.float32)}, ort=False, reference={"x": xt.grad.numpy()})


@pytest.mark.torch
def test_mish_and_selu_match_torch_autograd(rng):
    import torch

    x = _away_from(rng.normal(scale=2.0, size=(3, 4)), [0.0])
    r = torch.tensor(cotangent((3, 4), np.float64))
    for op, fn in [("Mish", torch.nn.functional.mish), ("Selu", torch.nn.functional.selu)]:
        xt = torch.tensor(x, requires_grad=True)
        fn(xt).backward(r)
        check_gradients(_unary(op), {"x": x}, reference={"x": xt.grad.numpy()})


# ------------------------------------------------------------------------- PRelu
@pytest.mark.parametrize("slope_shape", [(3, 4), (4,), (1,), (3, 1), ()])
def test_prelu_gradients_for_input_and_broadcast_slope(rng, slope_shape):
    dims = ", ".join(map(str, slope_shape))
    model = f"""
        <ir_version: 8, opset_import: ["" : 16]>
        g (double[2, 3, 4] x, double[{dims}] s) => (double[2, 3, 4] y) {{ y = PRelu(x, s) }}
    """
    x = _away_from(rng.normal(size=(2, 3, 4)), [0.0])
    s = rng.uniform(0.1, 0.5, size=slope_shape)
    check_gradients(parse_model(model), {"x": x, "s": s})


# ----------------------------------------------------------------------- Dropout
def _dropout(inputs: str, extra: str = "", outputs: str = "y", out_types: str = "") -> str:
    return f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[3, 4] x{extra}) => (double[3, 4] y{out_types}) {{ {outputs} = Dropout({inputs}) }}
    """


def test_dropout_in_inference_mode_is_the_identity(rng):
    x = rng.normal(size=(3, 4))
    r = cotangent((3, 4), np.float64)
    check_gradients(_dropout("x"), {"x": x}, reference={"x": r})


def test_dropout_with_training_mode_false_is_the_identity(rng):
    model = """
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[3, 4] x) => (double[3, 4] y) <double r = {0.5}, bool t = {0}> {
            y = Dropout(x, r, t)
        }
    """
    check_gradients(model, {"x": rng.normal(size=(3, 4))},
                    reference={"x": cotangent((3, 4), np.float64)})


def test_dropout_in_training_mode_with_zero_ratio_matches_finite_differences(rng):
    model = """
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[3, 4] x) => (double[3, 4] y, bool[3, 4] m) <double r = {0.0}, bool t = {1}> {
            y, m = Dropout(x, r, t)
        }
    """
    check_gradients(model, {"x": rng.normal(size=(3, 4))},
                    reference={"x": cotangent((3, 4), np.float64)})


@pytest.mark.parametrize("training_as_input", [False, True])
def test_dropout_in_training_mode_scales_by_the_forward_mask(rng, run_model, training_as_input):
    # The forward is random, so finite differences mean nothing: the gradient must use
    # the mask of the very run that computed it, dx = dy * mask / (1 - ratio).
    if training_as_input:
        header = "(double[6, 5] x, bool t)"
        consts = "<double r = {0.25}>"
    else:
        header = "(double[6, 5] x)"
        consts = "<double r = {0.25}, bool t = {1}>"
    model = f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g {header} => (double[6, 5] y, bool[6, 5] m) {consts} {{
            y, m = Dropout<seed: int = 3>(x, r, t)
        }}
    """
    x = rng.normal(size=(6, 5))
    feeds = {"x": x, "t": np.array(True)} if training_as_input else {"x": x}
    with_loss = loss_model(onnx.parser.parse_model(model), feeds)
    graph = gradient(with_loss, weights=["x"], loss_name="gradcheck_loss")
    onnx.checker.check_model(graph, full_check=True)
    results = run_model(graph, feeds)
    mask = results["m"]
    assert 0 < mask.sum() < mask.size  # some dropped, some kept
    expected = cotangent((6, 5), np.float64) * mask / 0.75
    np.testing.assert_allclose(results["x_grad"], expected, rtol=1e-12)
    np.testing.assert_allclose(results["y"], x * mask / 0.75, rtol=1e-12)
    if training_as_input:  # the same graph in inference mode: identity
        results = run_model(graph, {"x": x, "t": np.array(False)})
        np.testing.assert_allclose(results["x_grad"], cotangent((6, 5), np.float64))
