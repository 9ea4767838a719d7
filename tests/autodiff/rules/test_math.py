"""Gradient rules of elementwise math (lossgraph/autodiff/rules/math.py): unary functions, the
piecewise-constant ops, Mod, Cast, Pow, Clip, Min/Max, Sum/Mean and Where."""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import away_from_zero, check_gradients, cotangent, loss_model, reduce_to
from support.models import dims, model, signature

from lossgraph import gradient

F64, F32 = np.float64, np.float32
TYPE = {F64: "double", F32: "float"}


def uniform(rng, low, high, shape, dtype=F64):
    return rng.uniform(low, high, size=shape).astype(dtype)


def between_integers(rng, shape, dtype=F64):
    """Values at least 0.1 away from integers and half-integers (Floor/Ceil/Round kinks)."""
    base = rng.integers(-3, 3, size=shape) + rng.choice([0.2, 0.3, 0.7, 0.8], size=shape)
    return base.astype(dtype)


# -------------------------------------------------------------- unary functions
# op -> (sampler, derivative f'(x), dtype, onnxruntime-training's builder supports it).
# float32 where the onnxruntime kernel has no double version.
UNARY = {
    "Abs": (away_from_zero, np.sign, F64, True),
    "Exp": (lambda r, s, d=F64: uniform(r, -2, 2, s, d), np.exp, F64, True),
    "Log": (lambda r, s, d=F64: uniform(r, 0.3, 3, s, d), lambda x: 1 / x, F64, True),
    "Sqrt": (lambda r, s, d=F64: uniform(r, 0.3, 3, s, d), lambda x: 0.5 / np.sqrt(x), F64, True),
    "Reciprocal": (away_from_zero, lambda x: -1 / x**2, F64, True),
    "Sin": (lambda r, s, d=F64: uniform(r, -3, 3, s, d), np.cos, F64, True),
    "Cos": (lambda r, s, d=F64: uniform(r, -3, 3, s, d), lambda x: -np.sin(x), F32, True),
    "Tan": (lambda r, s, d=F64: uniform(r, -1.2, 1.2, s, d), lambda x: 1 / np.cos(x) ** 2, F32,
            False),
    "Asin": (lambda r, s, d=F64: uniform(r, -0.8, 0.8, s, d), lambda x: 1 / np.sqrt(1 - x**2),
             F32, False),
    "Acos": (lambda r, s, d=F64: uniform(r, -0.8, 0.8, s, d), lambda x: -1 / np.sqrt(1 - x**2),
             F32, False),
    "Atan": (lambda r, s, d=F64: uniform(r, -3, 3, s, d), lambda x: 1 / (1 + x**2), F32, False),
    "Sinh": (lambda r, s, d=F64: uniform(r, -2, 2, s, d), np.cosh, F32, False),
    "Cosh": (lambda r, s, d=F64: uniform(r, -2, 2, s, d), np.sinh, F32, False),
    "Tanh": (lambda r, s, d=F64: uniform(r, -2, 2, s, d), lambda x: 1 - np.tanh(x) ** 2, F64,
             True),
    "Asinh": (lambda r, s, d=F64: uniform(r, -3, 3, s, d), lambda x: 1 / np.sqrt(x**2 + 1), F32,
              False),
    "Acosh": (lambda r, s, d=F64: uniform(r, 1.3, 3, s, d), lambda x: 1 / np.sqrt(x**2 - 1), F32,
              False),
    "Atanh": (lambda r, s, d=F64: uniform(r, -0.7, 0.7, s, d), lambda x: 1 / (1 - x**2), F32,
              False),
    "Erf": (lambda r, s, d=F64: uniform(r, -2, 2, s, d),
            lambda x: 2 / np.sqrt(np.pi) * np.exp(-x**2), F32, True),
}


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_gradient_matches_derivative(op, opset, rng):
    sampler, derivative, dtype, ort_supported = UNARY[op]
    x = sampler(rng, (3, 4), dtype)
    net = model(signature({"x": x}, f"{TYPE[dtype]}[3, 4] y"), f"y = {op}(x)", opset=opset)
    expected = (derivative(x.astype(F64)) * cotangent(x.shape, dtype)).astype(dtype)
    check_gradients(net, {"x": x}, reference={"x": expected}, ort=ort_supported or "auto")


@pytest.mark.torch
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_gradient_matches_torch_autograd(op, rng):
    import torch

    sampler, _, dtype, _ = UNARY[op]
    x = sampler(rng, (2, 3), dtype)
    net = model(signature({"x": x}, f"{TYPE[dtype]}[2, 3] y"), f"y = {op}(x)")
    fn = getattr(torch, op.lower())
    t = torch.tensor(x, requires_grad=True)
    (fn(t) * torch.tensor(cotangent(x.shape, dtype))).sum().backward()
    check_gradients(net, {"x": x}, reference={"x": t.grad.numpy()}, ort=False)


def test_sin_gradient_in_double_avoids_the_cos_kernel(rng):
    x = uniform(rng, -3, 3, (5,))
    net = model(signature({"x": x}, "double[5] y"), "y = Sin(x)")
    graph = gradient(loss_model(net, {"x": x}), weights=["x"], loss_name="gradcheck_loss")
    assert "Cos" not in {n.op_type for n in graph.graph.node}
    check_gradients(net, {"x": x})


@pytest.mark.parametrize("op", ["Sign", "Floor", "Ceil", "Round"])
@pytest.mark.parametrize("opset", [13, 21])
def test_piecewise_constant_ops_give_zero_gradient(op, opset, rng):
    x = between_integers(rng, (3, 4))
    net = model(signature({"x": x}, "double[3, 4] y"), f"y = {op}(x)", opset=opset)
    grads = check_gradients(net, {"x": x}, ort="auto")
    np.testing.assert_array_equal(grads["x"], np.zeros_like(x))


@pytest.mark.parametrize("op", ["Sign", "Floor", "Ceil", "Round"])
def test_piecewise_constant_ops_keep_the_path_differentiable(op, rng):
    # y = op(x) * x: only the direct x term contributes.
    x = between_integers(rng, (2, 3))
    net = model(signature({"x": x}, "double[2, 3] y"), f"f = {op}(x)\n y = Mul(f, x)")
    expected = getattr(np, op.lower() if op != "Round" else "round")(x) * cotangent(x.shape, F64)
    check_gradients(net, {"x": x}, reference={"x": expected}, ort="auto")


def test_hardmax_gives_zero_gradient(rng):
    """float32: onnxruntime has no double Hardmax."""
    x = (rng.permutation(12).reshape(3, 4) * 0.5).astype(F32)  # distinct: no tie near eps
    net = model(signature({"x": x}, "float[3, 4] y"), "y = Hardmax(x)")
    grads = check_gradients(net, {"x": x}, ort="auto")
    np.testing.assert_array_equal(grads["x"], np.zeros_like(x))


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1), (3,))])
def test_mod_fmod_gradients(shapes, rng):
    """fmod(a, b) = a - b trunc(a / b): da = dy, db = -dy trunc(a / b) (a / b kept off
    the integers, where fmod jumps)."""
    b = away_from_zero(rng, shapes[1])
    out = np.broadcast_shapes(*shapes)
    quotient = rng.integers(-3, 4, size=out) + rng.uniform(0.2, 0.8, size=out)
    a = (quotient * np.broadcast_to(b, out))[tuple(slice(0, d) for d in shapes[0])]
    a = np.ascontiguousarray(np.broadcast_to(a, shapes[0]) if a.shape != shapes[0] else a)
    net = model(signature({"a": a, "b": b}, f"double[{dims(out)}] y"),
                "y = Mod <fmod = 1> (a, b)")
    r = cotangent(out, F64)
    expected = {"a": reduce_to(r, a.shape).reshape(a.shape),
                "b": reduce_to(-r * np.trunc(a / b), b.shape).reshape(b.shape)}
    check_gradients(net, {"a": a, "b": b}, reference=expected, ort=False)


# ------------------------------------------------------------------------ Cast
def test_cast_float_to_double_casts_the_gradient_back(rng):
    x = rng.normal(size=(3, 4)).astype(F32)
    net = model(signature({"x": x}, "double[3, 4] y"), "y = Cast<to = 11>(x)")
    # ort=False: the double loss is out of reach of onnxruntime-training's builder
    grads = check_gradients(net, {"x": x}, ort=False)
    assert grads["x"].dtype == F32


def test_cast_to_the_same_type_passes_the_gradient_through(rng):
    x = rng.normal(size=(3, 4))
    net = model(signature({"x": x}, "double[3, 4] y"), "c = Cast<to = 11>(x)\n y = Mul(c, c)")
    check_gradients(net, {"x": x}, reference={"x": 2 * x * cotangent(x.shape, F64)})


def test_cast_of_an_integer_input_gives_no_gradient_to_it(rng):
    n = rng.integers(-3, 4, size=(3, 4)).astype(np.int64)
    w = rng.normal(size=(4,))
    net = model(signature({"n": n, "w": w}, "double[3, 4] y"),
                "c = Cast<to = 11>(n)\n y = Mul(c, w)")
    expected = (n * cotangent((3, 4), F64)).sum(axis=0)
    check_gradients(net, {"n": n, "w": w}, wrt=["w"], reference={"w": expected})


# ------------------------------------------------------------------------- Pow
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((4,), (2, 1, 4)),
                                    ((2, 3), ())])
@pytest.mark.parametrize("opset", [13, 18])
def test_pow_gradients_for_base_and_exponent_with_broadcasting(shapes, opset, rng):
    a = uniform(rng, 0.5, 2.0, shapes[0])
    b = uniform(rng, -1.5, 2.5, shapes[1])
    out = np.broadcast_shapes(a.shape, b.shape)
    net = model(signature({"a": a, "b": b}, f"double[{dims(out)}] y"), "y = Pow(a, b)",
                opset=opset)
    r = cotangent(out, F64)
    da = reduce_to(r * b * a ** (b - 1), a.shape).reshape(a.shape)
    db = reduce_to(r * a**b * np.log(a), b.shape)
    # onnxruntime-training has no gradient for Pow's exponent: compared where it can
    check_gradients(net, {"a": a, "b": b}, reference={"a": da, "b": db.reshape(b.shape)},
                    ort="auto")


@pytest.mark.parametrize("k", [0.0, 1.0, 2.0, 3.0, 0.5, -1.5])
def test_pow_with_a_constant_exponent(k, rng):
    a = uniform(rng, 0.5, 2.0, (3, 4))
    net = model(f"(double[3, 4] a) => (double[3, 4] y) <double k = {{{k}}}>", "y = Pow(a, k)")
    expected = k * a ** (k - 1) * cotangent(a.shape, F64)
    check_gradients(net, {"a": a}, reference={"a": expected}, ort=True)


def test_pow_with_an_integer_exponent_differentiates_the_base_only(rng):
    a = away_from_zero(rng, (3, 4))
    b = rng.integers(0, 4, size=(4,)).astype(np.int64)
    net = model(signature({"a": a, "b": b}, "double[3, 4] y"), "y = Pow(a, b)")
    expected = b * a ** (b - 1.0) * cotangent(a.shape, F64)
    # onnxruntime-training 1.19 emits an ill-typed Sub for an integer exponent: no comparison
    check_gradients(net, {"a": a, "b": b}, reference={"a": expected}, ort="auto")


def test_pow_at_a_zero_base_differentiates_the_base_where_the_derivative_exists(rng):
    """d a^b / da = b a^(b-1) is 0 at a = 0 for b = 0 (a^0 = 1) and b > 1, 1 for b = 1."""
    a = np.array([[0.0, 0.0, 0.0, 0.0], [-1.2, 0.7, 1.5, -0.4]])
    b = np.array([[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 3.0, 1.0]])
    net = model(signature({"a": a, "b": b}, "double[2, 4] y"), "y = Pow(a, b)")
    exponent = np.where(b == 0, 0.0, b - 1)
    expected = np.where(b == 0, 0.0, b * a**exponent) * cotangent(a.shape, F64)
    # ort=False: onnxruntime-training's own Pow gradient is NaN at a = b = 0
    grads = check_gradients(net, {"a": a, "b": b}, wrt=["a"], reference={"a": expected},
                            ort=False)
    assert np.all(np.isfinite(grads["a"]))


def test_pow_at_a_zero_base_differentiates_a_positive_exponent(rng):
    """d a^b / db = a^b log(a) tends to 0 as a -> 0 for b > 0: 0^b is 0 near b."""
    a = np.array([[0.0, 0.0, 0.0], [0.5, 1.5, 2.0]])
    b = np.array([[0.5, 1.0, 2.5], [1.5, -0.5, 2.0]])
    net = model(signature({"a": a, "b": b}, "double[2, 3] y"), "y = Pow(a, b)")
    expected = np.where(a == 0, 0.0, a**b * np.log(np.where(a == 0, 1.0, a)))
    check_gradients(net, {"a": a, "b": b}, wrt=["b"],
                    reference={"b": expected * cotangent(a.shape, F64)})


@pytest.mark.torch
def test_pow_at_a_zero_base_matches_torch_autograd():
    import torch

    a = np.array([0.0, 0.0, 0.0, 2.0])
    b = np.array([0.0, 1.0, 2.5, 3.0])
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    (torch.pow(ta, tb) * torch.tensor(cotangent((4,), F64))).sum().backward()
    net = model(signature({"a": a, "b": b}, "double[4] y"), "y = Pow(a, b)")
    graph = gradient(loss_model(net, {"a": a, "b": b}), weights=["a", "b"],
                     loss_name="gradcheck_loss")
    import onnxruntime

    session = onnxruntime.InferenceSession(graph.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    da, db = session.run(["a_grad", "b_grad"], {"a": a, "b": b})
    np.testing.assert_allclose(da, ta.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-12)


# ------------------------------------------------------------------------ Clip
def clip_inputs(rng, shape=(4, 5)):
    """x values at least 0.05 away from the bounds lo = -0.5 and hi = 0.6."""
    x = rng.choice([-1.0, -0.7, -0.3, 0.0, 0.4, 0.9, 1.3], size=shape)
    x = x + rng.uniform(-0.1, 0.1, size=shape)
    return x, np.array(-0.5), np.array(0.6)


@pytest.mark.parametrize("opset", [13, 21])
def test_clip_passes_gradient_inside_bounds_and_to_the_bound_it_hits(opset, rng):
    x, lo, hi = clip_inputs(rng)
    net = model(signature({"x": x, "lo": lo, "hi": hi}, "double[4, 5] y"), "y = Clip(x, lo, hi)",
                opset=opset)
    r = cotangent(x.shape, F64)
    expected = {"x": r * ((x >= lo) & (x <= hi)), "lo": (r * (x < lo)).sum(),
                "hi": (r * (x > hi)).sum()}
    check_gradients(net, {"x": x, "lo": lo, "hi": hi}, reference=expected, ort="auto")


def test_clip_with_lo_above_hi_gives_everything_to_hi(rng):
    """Clip = Min(Max(x, lo), hi): with lo > hi every output is hi (onnxruntime and the
    ONNX reference agree), so hi gets all of dy and x and lo nothing."""
    x = rng.uniform(-2, 2, size=(3, 4))
    lo, hi = np.array(1.0), np.array(-1.0)
    net = model(signature({"x": x, "lo": lo, "hi": hi}, "double[3, 4] y"), "y = Clip(x, lo, hi)")
    r = cotangent(x.shape, F64)
    check_gradients(net, {"x": x, "lo": lo, "hi": hi}, ort=False, reference={
        "x": np.zeros_like(x), "lo": np.array(0.0), "hi": np.array(r.sum())})


def test_clip_with_only_a_lower_bound(rng):
    x, lo, _ = clip_inputs(rng)
    net = model(signature({"x": x, "lo": lo}, "double[4, 5] y"), "y = Clip(x, lo)")
    r = cotangent(x.shape, F64)
    check_gradients(net, {"x": x, "lo": lo},
                    reference={"x": r * (x >= lo), "lo": (r * (x < lo)).sum()}, ort="auto")


def test_clip_with_only_an_upper_bound(rng):
    x, _, hi = clip_inputs(rng)
    net = model(signature({"x": x, "hi": hi}, "double[4, 5] y"), 'y = Clip(x, "", hi)')
    r = cotangent(x.shape, F64)
    check_gradients(net, {"x": x, "hi": hi},
                    reference={"x": r * (x <= hi), "hi": (r * (x > hi)).sum()}, ort="auto")


def test_clip_without_bounds_is_the_identity(rng):
    x = rng.normal(size=(3,))
    net = model(signature({"x": x}, "double[3] y"), "y = Clip(x)")
    check_gradients(net, {"x": x}, reference={"x": cotangent((3,), F64)}, ort=True)


def test_clip_with_constant_bounds_differentiates_x_only(rng):
    x, _, _ = clip_inputs(rng)
    net = model("(double[4, 5] x) => (double[4, 5] y) <double lo = {-0.5}, double hi = {0.6}>",
                "y = Clip(x, lo, hi)")
    r = cotangent(x.shape, F64)
    check_gradients(net, {"x": x}, reference={"x": r * ((x >= -0.5) & (x <= 0.6))}, ort=True)


# --------------------------------------------------------------------- Min/Max
SHAPE_SETS = [
    [(3, 4)],
    [(3, 4), (3, 4)],
    [(3, 4), (4,)],
    [(3, 1), (1, 4)],
    [(2, 3, 4), (3, 1), ()],
]


def distinct_inputs(rng, shapes):
    """Inputs whose broadcast values never tie (all values drawn from one permutation)."""
    total = sum(int(np.prod(s)) for s in shapes)
    values = rng.permutation(total) * 0.1 - total * 0.05
    arrays, start = [], 0
    for s in shapes:
        n = int(np.prod(s))
        arrays.append(values[start:start + n].reshape(s))
        start += n
    return {f"x{i}": a for i, a in enumerate(arrays)}


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("op", ["Min", "Max"])
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=lambda s: "_".join(map(str, s)))
def test_min_max_gradient_goes_to_the_selected_input(op, shapes, opset, rng):
    inputs = distinct_inputs(rng, shapes)
    out = np.broadcast_shapes(*shapes)
    net = model(signature(inputs, f"double[{dims(out)}] y"), f"y = {op}({', '.join(inputs)})",
                opset=opset)
    stacked = np.stack([np.broadcast_to(v, out) for v in inputs.values()])
    chosen = (np.argmin if op == "Min" else np.argmax)(stacked, axis=0)
    r = cotangent(out, F64)
    expected = {k: reduce_to(r * (chosen == i), v.shape).reshape(v.shape)
                for i, (k, v) in enumerate(inputs.items())}
    check_gradients(net, inputs, reference=expected, ort=True)


@pytest.mark.parametrize("op", ["Min", "Max"])
def test_min_max_ties_give_the_whole_gradient_to_the_first_tied_input(op, rng):
    a = rng.normal(size=(3, 4))
    b = a.copy()
    b[0] = a[0] + (1.0 if op == "Min" else -1.0)  # row 0: a selected alone
    c = a.copy()  # a, b, c all tie on rows 1 and 2
    net = model(signature({"a": a, "b": b, "c": c}, "double[3, 4] y"), f"y = {op}(a, b, c)")
    inputs = {"a": a, "b": b, "c": c}
    graph = gradient(loss_model(net, inputs), weights=["a", "b", "c"], loss_name="gradcheck_loss")
    import onnxruntime

    session = onnxruntime.InferenceSession(graph.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    da, db, dc = session.run(["a_grad", "b_grad", "c_grad"], inputs)
    r = cotangent((3, 4), F64)
    np.testing.assert_allclose(da, r)
    np.testing.assert_array_equal(db, np.zeros_like(b))
    np.testing.assert_array_equal(dc, np.zeros_like(c))


# -------------------------------------------------------------------- Sum/Mean
@pytest.mark.parametrize("op", ["Sum", "Mean"])
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=lambda s: "_".join(map(str, s)))
def test_sum_and_mean_spread_the_gradient_over_all_inputs(op, shapes, rng):
    dtype = F32 if op == "Mean" else F64  # onnxruntime 1.19 has no double Mean kernel
    inputs = {f"x{i}": rng.normal(size=s).astype(dtype) for i, s in enumerate(shapes)}
    out = np.broadcast_shapes(*shapes)
    net = model(signature(inputs, f"{TYPE[dtype]}[{dims(out)}] y"),
                f"y = {op}({', '.join(inputs)})")
    r = cotangent(out, dtype) / (len(shapes) if op == "Mean" else 1)
    expected = {k: reduce_to(r, v.shape).reshape(v.shape) for k, v in inputs.items()}
    check_gradients(net, inputs, reference=expected, ort="auto")


# ----------------------------------------------------------------------- Where
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3, 4), (4,), ()),
                                    ((4,), (3, 1), (1, 4)), ((2, 1, 4), (3, 4), (2, 3, 1))],
                         ids=str)
def test_where_routes_the_gradient_by_the_condition(shapes, rng):
    cs, as_, bs = shapes
    c = rng.random(cs) > 0.5
    a, b = rng.normal(size=as_), rng.normal(size=bs)
    out = np.broadcast_shapes(cs, as_, bs)
    inputs = {"c": c, "a": a, "b": b}
    net = model(signature(inputs, f"double[{dims(out)}] y"), "y = Where(c, a, b)")
    r = cotangent(out, F64)
    mask = np.broadcast_to(c, out)
    expected = {"a": reduce_to(r * mask, as_).reshape(as_),
                "b": reduce_to(r * ~mask, bs).reshape(bs)}
    # onnxruntime-training's Where gradient breaks shape inference when inputs broadcast
    same_shapes = len(set(shapes)) == 1
    check_gradients(net, inputs, reference=expected, ort=True if same_shapes else "auto")
