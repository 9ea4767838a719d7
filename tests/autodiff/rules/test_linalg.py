"""Gradient rules of MatMul, Gemm, Einsum and Det (lossgraph/autodiff/rules/linalg.py), checked
by tests/support/gradcheck.py.

Det: dX = dy C, C the cofactors. onnxruntime has a float Det kernel only: checked in float32
with the harness's float tolerances, against finite differences, torch and the closed form
``dy det(X) X^-T``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.gradcheck import check_gradients, cotangent
from support.models import model, signature

from lossgraph import gradient
from lossgraph.errors import UnsupportedModelError

F32 = np.float32

DTYPES = {"float": np.float32, "double": np.float64}


def typed(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join(str(d) for d in shape)}]" if len(shape) else dtype


def binary_model(op: str, a_shape, b_shape, out_shape, dtype: str = "double",
                 opset: int = 18, attrs: str = "", c_shape=None) -> str:
    c_input = f", {typed(dtype, c_shape)} c" if c_shape is not None else ""
    c_arg = ", c" if c_shape is not None else ""
    attributes = f"<{attrs}>" if attrs else ""
    return f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({typed(dtype, a_shape)} a, {typed(dtype, b_shape)} b{c_input})
            => ({typed(dtype, out_shape)} y) {{
            y = {op}{attributes}(a, b{c_arg})
        }}
    """


# -- MatMul ----------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((3,), (3,)),            # dot product: scalar output
    ((3,), (3, 4)),          # 1-D left operand
    ((2, 3), (3,)),          # 1-D right operand
    ((2, 3), (3, 4)),
    ((4, 3), (3, 1)),        # a column right operand, as a linear model's weight
    ((3,), (3, 1)),          # 1-D times a column
    ((5, 2, 3), (3, 4)),     # batched times matrix
    ((2, 3), (5, 3, 4)),     # matrix times batched
    ((2, 1, 2, 3), (3, 3, 4)),  # batch broadcasting with size-1 and missing axes
    ((3,), (2, 3, 4)),       # 1-D times batched
    ((2, 2, 3), (3,)),       # batched times 1-D
]


@pytest.mark.parametrize("dtype", ["float", "double"])
@pytest.mark.parametrize("a_shape, b_shape", MATMUL_SHAPES)
def test_matmul_gradient_matches_finite_differences_and_onnxruntime(a_shape, b_shape, dtype,
                                                                     rng):
    np_dtype = DTYPES[dtype]
    a = rng.normal(size=a_shape).astype(np_dtype)
    b = rng.normal(size=b_shape).astype(np_dtype)
    out = np.matmul(a, b).shape
    # onnxruntime-training's MatMul gradient fails shape inference for some 1-D operands
    ort = True if len(a_shape) > 1 and len(b_shape) > 1 else "auto"
    check_gradients(binary_model("MatMul", a_shape, b_shape, out, dtype), {"a": a, "b": b},
                    ort=ort)


@pytest.mark.parametrize("opset", [13, 21])
def test_matmul_gradient_at_opset_bounds(opset, rng):
    a, b = rng.normal(size=(4, 2, 3)), rng.normal(size=(4, 3, 2))
    check_gradients(binary_model("MatMul", a.shape, b.shape, (4, 2, 2), opset=opset),
                    {"a": a, "b": b}, ort="auto")


# -- Gemm ------------------------------------------------------------------------------

M, K, N = 3, 4, 2


def gemm_inputs(rng, trans_a, trans_b, c_shape, dtype=np.float64):
    inputs = {
        "a": rng.normal(size=(K, M) if trans_a else (M, K)).astype(dtype),
        "b": rng.normal(size=(N, K) if trans_b else (K, N)).astype(dtype),
    }
    if c_shape is not None:
        inputs["c"] = rng.normal(size=c_shape).astype(dtype)
    return inputs


def gemm_model(inputs, attrs, c_shape, dtype="double", opset=13):
    return binary_model("Gemm", inputs["a"].shape, inputs["b"].shape, (M, N), dtype,
                        opset=opset, attrs=attrs, c_shape=c_shape)


@pytest.mark.parametrize("alpha, beta, trans_a, trans_b",
                         list(itertools.product([1.0, 0.5], [1.0, -2.0], [0, 1], [0, 1])))
def test_gemm_gradient_for_every_alpha_beta_transpose_combination(alpha, beta, trans_a,
                                                                   trans_b, rng):
    inputs = gemm_inputs(rng, trans_a, trans_b, (M, N))
    attrs = f"alpha={alpha}, beta={beta}, transA={trans_a}, transB={trans_b}"
    check_gradients(gemm_model(inputs, attrs, (M, N)), inputs, ort=True)


@pytest.mark.parametrize("c_shape", [(N,), (1, N), (M, N), (M, 1), (), None],
                         ids=["N", "1xN", "MxN", "Mx1", "scalar", "no-C"])
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_bias_gradient_is_summed_to_the_shape_of_c(c_shape, trans_a, trans_b, rng):
    inputs = gemm_inputs(rng, trans_a, trans_b, c_shape)
    attrs = f"alpha=1.5, beta=0.25, transA={trans_a}, transB={trans_b}"
    # onnxruntime-training's Gemm gradient emits an invalid graph for a scalar C
    check_gradients(gemm_model(inputs, attrs, c_shape), inputs,
                    ort="auto" if c_shape == () else True)


@pytest.mark.parametrize("opset", [13, 21])
def test_gemm_float32_default_attributes(opset, rng):
    inputs = gemm_inputs(rng, 0, 1, (N,), np.float32)
    check_gradients(gemm_model(inputs, "transB=1", (N,), "float", opset), inputs, ort=True)


# -- Einsum ----------------------------------------------------------------------------

EINSUMS = [
    ("ij,jk->ik", [(2, 3), (3, 4)]),
    ("ij,jk", [(2, 3), (3, 4)]),               # implicit output
    ("bij,bkj->bik", [(2, 3, 4), (2, 5, 4)]),
    ("i,i->", [(4,), (4,)]),                   # scalar output
    ("i,j->ij", [(3,), (2,)]),                 # outer product
    ("ij->ji", [(2, 3)]),
    ("ij->i", [(2, 3)]),                       # a letter only one operand has
    ("ij->", [(2, 3)]),
    ("ij,ij->ij", [(2, 3), (2, 3)]),
    ("ij,jk,kl->il", [(2, 3), (3, 2), (2, 4)]),
    ("abc,cd->a", [(2, 3, 4), (4, 2)]),
    ("ii->i", [(3, 3)]),                       # diagonal
    ("ii", [(3, 3)]),                          # trace, implicit
    ("ii,ij->j", [(3, 3), (3, 2)]),
    # onnx shape inference wants equal ranks under the ellipsis; size-1 dims broadcast
    ("...ij,...jk->...ik", [(2, 2, 3), (1, 3, 4)]),
    ("...ij,...jk->...ik", [(2, 1, 2, 3), (2, 3, 3, 4)]),
    ("...ij,...jk", [(5, 2, 3), (5, 3, 4)]),             # implicit output with ellipsis
    ("i...,i...->...", [(3, 2), (3, 2)]),
    ("...i,...i->...", [(2, 1, 4), (1, 3, 4)]),
    ("...ij->...", [(2, 3, 4)]),
    ("bi, bj -> bij", [(2, 3), (2, 4)]),       # spaces
]


@pytest.mark.parametrize("equation, shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum_gradient_matches_finite_differences(equation, shapes, rng):
    letters = "abcdef"
    inputs = {letters[i]: rng.normal(size=s) for i, s in enumerate(shapes)}
    out = np.einsum(equation.replace(" ", ""), *inputs.values()).shape
    args = ", ".join(inputs)
    params = ", ".join(f"{typed('double', s)} {n}" for n, s in zip(inputs, shapes))
    model = f"""
        <ir_version: 8, opset_import: ["" : 13]>
        g ({params}) => ({typed('double', out)} y) {{
            y = Einsum<equation="{equation}">({args})
        }}
    """
    check_gradients(model, inputs, ort="auto")


@pytest.mark.torch
def test_einsum_gradient_matches_torch_autograd(rng):
    import torch

    shapes = [(2, 1, 3, 4), (1, 5, 4, 2)]
    a, b = (rng.normal(size=s) for s in shapes)
    model = """
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[2, 1, 3, 4] a, double[1, 5, 4, 2] b) => (double[2, 5, 3, 2] y) {
            y = Einsum<equation="...ij,...jk->...ik">(a, b)
        }
    """
    ta = torch.tensor(a, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    y = torch.einsum("...ij,...jk->...ik", ta, tb)
    y.backward(torch.tensor(cotangent(tuple(y.shape), np.float64)))
    check_gradients(model, {"a": a, "b": b}, reference={"a": ta.grad.numpy(),
                                                        "b": tb.grad.numpy()})


def test_einsum_diagonal_with_symbolic_size_is_a_clear_error():
    import onnx

    from lossgraph import gradient
    from lossgraph.errors import UnsupportedModelError

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[N, N] a) => (double[N] y) {
            y = Einsum<equation="ii->i">(a)
            loss = ReduceSum<keepdims=0>(y)
        }
    """)
    model.graph.output.append(onnx.helper.make_tensor_value_info("loss", 11, []))
    with pytest.raises(UnsupportedModelError, match="repeated subscript"):
        gradient(model, weights=["a"], loss_name="loss")


# -- Det ---------------------------------------------------------
def _det_model(x: np.ndarray, opset: int = 18):
    out = ", ".join(str(d) for d in x.shape[:-2])
    return model(signature({"x": x}, f"float[{out}] y" if out else "float y"), "y = Det(x)",
                 opset=opset)


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 3), (2, 1, 2, 2)])
def test_det_gradient_is_the_cofactor_matrix(rng, shape):
    x = rng.normal(size=shape).astype(F32)
    y_shape = shape[:-2]
    r = cotangent(y_shape, np.float64)
    x64 = x.astype(np.float64)
    # d det(X) = det(X) X^-T where X is invertible
    expected = (np.asarray(r) * np.linalg.det(x64))[..., None, None] \
        * np.swapaxes(np.linalg.inv(x64), -1, -2)
    check_gradients(_det_model(x), {"x": x}, eps=1e-2, reference={"x": expected.astype(F32)})


def test_det_gradient_of_a_singular_matrix_is_finite(rng):
    """The adjugate exists where the inverse does not: a rank-1 3x3 matrix has a nonzero
    cofactor matrix (rank 2 has, rank 1 gives zeros); dy det X X^-T would be NaN."""
    u, v = rng.normal(size=(3, 1)), rng.normal(size=(1, 3))
    w = rng.normal(size=(3, 1))
    x = (u @ v + w @ rng.normal(size=(1, 3))).astype(F32)  # rank 2
    grads = check_gradients(_det_model(x), {"x": x}, eps=1e-2)
    assert np.all(np.isfinite(grads["x"])) and np.abs(grads["x"]).max() > 1e-3


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4)])
def test_det_gradient_matches_torch(rng, shape):
    import torch

    x = rng.normal(size=shape).astype(F32)
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.linalg.det(tx)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_gradients(_det_model(x), {"x": x}, eps=1e-2,
                    reference={"x": tx.grad.numpy().astype(F32)})


def test_det_of_an_unknown_matrix_size_is_a_named_error():
    net = model("(float[N, M, M] x) => (float[N] y)", "y = Det(x)")
    with pytest.raises(UnsupportedModelError, match="static matrix size"):
        gradient(net, weights=["x"], outputs=["y"])
