"""Gradient rules of the reductions and CumSum, checked by tests/support/gradcheck.py.

Each model reduces one input; gradients are compared with finite differences and,
where onnxruntime-training's builder differentiates the op, with its gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import _session, check_gradients, cotangent, loss_model
from support.models import model

from lossgraph import gradient

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]
#: onnxruntime-training's GradientGraphBuilder differentiates these (enforced comparison).
#: (Its ReduceL2 and ReduceLogSumExp gradients only work with the opset-18 axes input,
#: and not for a full reduction to a scalar.)
ORT_SUPPORTED = {13: {"ReduceSum", "ReduceMean"},
                 18: {"ReduceSum", "ReduceMean", "ReduceL2", "ReduceLogSumExp"}}
#: onnxruntime 1.19 has no double kernel for these (at opset 13, or at all for ReduceProd).
#: Its ReduceL2 computes in float precision even for double, too coarse for finite differences.
NO_DOUBLE = {13: {"ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum"},
             18: {"ReduceProd", "ReduceL2"}}


def gradient_of(model: str, inputs: dict) -> dict:
    """lossgraph's gradient of ``sum(y * cotangent)``, without finite differences."""
    graph = gradient(loss_model(model, inputs), weights=list(inputs), loss_name="gradcheck_loss")
    return dict(zip(inputs, _session(graph).run([f"{w}_grad" for w in inputs], inputs)))


def axes_as_input(op: str, opset: int) -> bool:
    return opset >= 18 or (op == "ReduceSum" and opset >= 13)


def reduce_model(op: str, opset: int, shape, axes, keepdims: int, dtype: str,
                 noop: int | None = None) -> str:
    rank = len(shape)
    attrs = [f"keepdims={keepdims}"]
    if noop is not None:
        attrs.append(f"noop_with_empty_axes={noop}")
    if axes is None:
        reduced, call = list(range(rank)), f"y = {op}<{', '.join(attrs)}>(x)"
        if noop:  # onnxruntime 1.19 wants the empty axes input present
            reduced = []
            call = (f"a = Constant<value = int64[0] {{}}>()\n"
                    f"y = {op}<{', '.join(attrs)}>(x, a)")
    elif axes_as_input(op, opset):
        values = ", ".join(str(a) for a in axes)
        reduced = [a % rank for a in axes]
        call = (f"a = Constant<value = int64[{len(axes)}] {{{values}}}>()\n"
                f"y = {op}<{', '.join(attrs)}>(x, a)")
    else:
        attrs.append(f"axes=[{', '.join(str(a) for a in axes)}]")
        reduced = [a % rank for a in axes]
        call = f"y = {op}<{', '.join(attrs)}>(x)"
    out = [1 if i in reduced else d for i, d in enumerate(shape)] if keepdims else \
        [d for i, d in enumerate(shape) if i not in reduced]
    if noop and axes is None:
        out = list(shape)
    def typed(s):
        return f"{dtype}[{', '.join(str(d) for d in s)}]" if s else dtype

    return f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({typed(shape)} x) => ({typed(out)} y) {{
            {call}
        }}
    """


def sample(op: str, shape, rng, dtype) -> np.ndarray:
    if op in ("ReduceLogSum", "ReduceProd"):
        x = rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1, 1], size=shape)
        if op == "ReduceLogSum":
            x = np.abs(x)
    elif op in ("ReduceL1",):
        x = rng.uniform(0.2, 1.0, size=shape) * rng.choice([-1, 1], size=shape)
    else:
        x = rng.normal(size=shape)
    return x.astype(dtype)


def tolerances(op: str, dtype) -> dict:
    if dtype == np.float32:
        return {"rtol": 5e-3, "atol": 5e-3, "eps": 1e-2 if op != "ReduceProd" else 1e-3}
    return {}


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("axes, keepdims", [
    ([1], 1), ([1], 0), ([-1], 0), ([0, 2], 1), ([2, -3], 0), (None, 0), (None, 1),
])
def test_reduction_gradient_matches_finite_differences(op, opset, axes, keepdims, rng):
    dtype_name = "float" if op in NO_DOUBLE[opset] else "double"
    dtype = np.float32 if dtype_name == "float" else np.float64
    shape = (2, 3, 4)
    x = sample(op, shape, rng, dtype)
    model = reduce_model(op, opset, shape, axes, keepdims, dtype_name)
    enforced = op in ORT_SUPPORTED[opset] and (op in ORT_SUPPORTED[13] or axes or keepdims)
    check_gradients(model, {"x": x}, ort=True if enforced else "auto", **tolerances(op, dtype))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin",
                                "ReduceLogSumExp"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_noop_with_empty_axes_passes_the_gradient_through(op, keepdims, rng):
    opset = 13 if op == "ReduceSum" else 18
    model = reduce_model(op, opset, (3, 2), None, keepdims, "double", noop=1)
    grads = check_gradients(model, {"x": rng.normal(size=(3, 2))}, ort="auto")
    np.testing.assert_allclose(grads["x"], cotangent((3, 2), np.float64))


@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum"])
def test_noop_with_empty_axes_is_the_elementwise_derivative(op, rng):
    pytest.importorskip("onnxruntime")
    import onnxruntime

    if onnxruntime.__version__.startswith("1.19"):
        pytest.skip("onnxruntime 1.19 does not follow the spec for this op with empty axes")
    model = reduce_model(op, 18, (3, 2), None, 1, "double", noop=1)
    check_gradients(model, {"x": sample("ReduceLogSum", (3, 2), rng, np.float64)}, ort=False)


def test_reduce_sum_axes_attribute_form_before_opset_13_input_form_after(rng):
    x = rng.normal(size=(3, 4))
    check_gradients(reduce_model("ReduceSum", 13, (3, 4), [0], 0, "double"), {"x": x},
                    ort=True)
    check_gradients(reduce_model("ReduceMean", 17, (3, 4), [0], 0, "double"), {"x": x},
                    ort=True)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_extremum_ties_share_the_gradient_evenly(op, rng):
    x = np.array([[1.0, 3.0, 3.0], [-2.0, -2.0, 0.5]])
    if op == "ReduceMin":
        x = -x
    model = reduce_model(op, 18, (2, 3), [1], 0, "double")
    dy = cotangent((2,), np.float64)
    expected = np.array([[0, dy[0] / 2, dy[0] / 2], [0, 0, dy[1]]])
    np.testing.assert_allclose(gradient_of(model, {"x": x})["x"], expected)


@pytest.mark.parametrize("zeros", [[], [(0, 1)], [(0, 1), (1, 2)], [(0, 0), (0, 2)]])
def test_reduce_prod_is_exact_with_zeros(zeros, rng):
    x = rng.uniform(0.5, 1.5, size=(2, 3)).astype(np.float32)
    for index in zeros:
        x[index] = 0
    model = reduce_model("ReduceProd", 18, (2, 3), [1], 0, "float")
    # the product is linear in each element, so central differences are exact at 0
    grads = check_gradients(model, {"x": x}, eps=1e-3)
    assert np.all(np.isfinite(grads["x"]))


def test_reduce_l2_gradient_is_zero_where_the_norm_is_zero(rng):
    x = rng.normal(size=(3, 2)).astype(np.float32)
    x[1] = 0
    model = reduce_model("ReduceL2", 18, (3, 2), [1], 0, "float")
    grads = gradient_of(model, {"x": x})["x"]
    assert np.all(np.isfinite(grads))
    np.testing.assert_array_equal(grads[1], 0)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_cumsum_gradient_is_the_opposite_cumsum(exclusive, reverse, axis, rng):
    model = f"""
        <ir_version: 8, opset_import: ["" : 14]>
        g (double[3, 4] x) => (double[3, 4] y) {{
            a = Constant<value = int64 {{{axis}}}>()
            y = CumSum<exclusive={exclusive}, reverse={reverse}>(x, a)
        }}
    """
    check_gradients(model, {"x": rng.normal(size=(3, 4))})


def test_cumsum_axis_may_be_a_graph_input(rng):
    model = """
        <ir_version: 8, opset_import: ["" : 14]>
        g (double[3, 4] x, int32 a) => (double[3, 4] y) {
            y = CumSum<reverse=1>(x, a)
        }
    """
    check_gradients(model, {"x": rng.normal(size=(3, 4)), "a": np.array(1, np.int32)},
                    wrt=["x"])


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
def test_keepdims_reduction_over_axes_computed_at_run_time(op, rng):
    """axes = Range(1, rank): not a constant; with keepdims=1, dy broadcasts as it is,
    and the reduced value's rank (which onnx's shape inference leaves unknown) is x's."""
    x = rng.normal(size=(2, 3, 4))
    text = f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[2, 3, 4] x) => (double[2, 1, 1] y) {{
            one = Constant <value = int64 {{1}}> ()
            s = Shape(x)
            rank = Size(s)
            axes = Range(one, rank, one)
            m = {op} <keepdims = 1> (x, axes)
            y = Mul(m, m)
        }}
    """
    m = x.sum(axis=(1, 2), keepdims=True) / (12 if op == "ReduceMean" else 1)
    expected = np.broadcast_to(2 * m * cotangent((2, 1, 1), np.float64)
                               / (12 if op == "ReduceMean" else 1), x.shape)
    check_gradients(text, {"x": x}, reference={"x": expected}, ort=False)


@pytest.mark.parametrize("axes, attributes", [
    ([1], "keepdims = 0"),
    ([0, -1], "keepdims = 1"),
    ([], "keepdims = 0"),                           # all axes
    ([], "keepdims = 0, noop_with_empty_axes = 1"),  # none: elementwise
])
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reductions_over_axes_computed_at_run_time(rng, op, axes, attributes):
    """The axes are an input of the graph: the gradient takes them at run time (float32
    where onnxruntime 1.19 has no exact double kernel, as above)."""
    import onnxruntime

    noop = "noop" in attributes
    if noop and op in ("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum") \
            and onnxruntime.__version__.startswith("1.19"):
        pytest.skip("onnxruntime 1.19 does not follow the spec for this op with empty axes")
    dtype, kind = (np.float32, "float") if op in NO_DOUBLE[18] else (np.float64, "double")
    rank = 2 if noop or "keepdims = 1" in attributes else 2 - len(axes) if axes else 0
    dims = ", ".join(f"d{i}" for i in range(rank))
    output = f"{kind}[{dims}] y" if rank else f"{kind} y"
    net = model(f"({kind}[N, 4] x, int64[{len(axes)}] a) => ({output})",
                f"y = {op} <{attributes}> (x, a)", opset=18)
    check_gradients(net, {"x": sample(op, (3, 4), rng, dtype),
                          "a": np.array(axes, dtype=np.int64)},
                    wrt=["x"], ort=False, **tolerances(op, dtype))
