"""Gradients of shape and layout ops (lossgraph/autodiff/rules/shape.py); CenterCropPad's pads
what was cropped and crops what was padded."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients, cotangent
from support.models import dims, model


def rand(rng, *shape):
    return rng.normal(size=shape)


@pytest.mark.parametrize("target", [[6, 4], [-1, 2, 3], [2, 0, 4], [24]])
def test_reshape_gradient_restores_the_input_layout(rng, target):
    x = rand(rng, 2, 3, 4)
    out = np.reshape(x, [x.shape[i] if t == 0 else t for i, t in enumerate(target)]).shape
    net = model(f"(double[2, 3, 4] x) => (double[{dims(out)}] y)",
                f"s = Constant <value = int64[{len(target)}] {{{dims(target)}}}> () "
                "y = Reshape(x, s)", opset=14)
    ref = cotangent(out, np.float64).reshape(x.shape)
    check_gradients(net, {"x": x}, reference={"x": ref}, ort=True)


def test_reshape_of_an_empty_tensor_with_allowzero_has_an_empty_gradient(rng):
    """(0, 3, 4) -> (3, 4, 0) with allowzero=1: the gradient is empty, shaped like x (a
    Reshape to x's shape (0, 3, 4) would copy dy's first dim, 3, into it)."""
    x = np.zeros((0, 3, 4))
    net = model("(double[0, 3, 4] x) => (double[3, 4, 0] y)",
                "s = Constant <value = int64[3] {3, 4, 0}> () "
                "y = Reshape <allowzero = 1> (x, s)", opset=14)
    grads = check_gradients(net, {"x": x}, ort=False)
    assert grads["x"].shape == (0, 3, 4)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten_gradient_for_every_axis(rng, axis):
    x = rand(rng, 2, 3, 4)
    a = axis % 3
    out = (int(np.prod(x.shape[:a])), int(np.prod(x.shape[a:])))
    net = model(f"(double[2, 3, 4] x) => (double[{dims(out)}] y)",
                f"y = Flatten <axis = {axis}> (x)", opset=13)
    check_gradients(net, {"x": x}, ort=True)


@pytest.mark.parametrize("opset", [13, 18])
def test_squeeze_and_unsqueeze_gradients(rng, opset):
    x = rand(rng, 3, 1, 4)
    net = model("(double[3, 1, 4] x) => (double[3, 4, 1] y)",
                "a = Constant <value = int64[1] {-2}> () b = Constant <value = int64[1] {2}> () "
                "s = Squeeze(x, a) y = Unsqueeze(s, b)", opset=opset)
    check_gradients(net, {"x": x}, ort=True)


def test_squeeze_without_axes_gradient(rng):
    x = rand(rng, 1, 3, 1)
    net = model("(double[1, 3, 1] x) => (double[3] y)", "y = Squeeze(x)", opset=13)
    check_gradients(net, {"x": x}, ort=True)


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1], [1, 2, 0]])
def test_transpose_gradient_applies_the_inverse_permutation(rng, perm):
    x = rand(rng, 2, 3, 4)
    out = x.transpose(perm).shape
    attr = f"<perm = [{dims(perm)}]> " if perm else ""
    net = model(f"(double[2, 3, 4] x) => (double[{dims(out)}] y)", f"y = Transpose {attr}(x)",
                opset=13)
    ref = cotangent(out, np.float64).transpose(np.argsort(perm) if perm else None)
    check_gradients(net, {"x": x}, reference={"x": ref}, ort=True)


@pytest.mark.parametrize("xshape, target", [
    ([3, 1], [2, 3, 4]), ([1, 4], [3, 4]), ([4], [2, 3, 4]), ([2, 1, 4], [1, 3, 1]),
    ([2, 3], [2, 3])])
def test_expand_gradient_sums_over_broadcast_axes(rng, xshape, target):
    x = rand(rng, *xshape)
    out = np.broadcast_shapes(tuple(xshape), tuple(target))
    net = model(f"(double[{dims(xshape)}] x) => (double[{dims(out)}] y)",
                f"s = Constant <value = int64[{len(target)}] {{{dims(target)}}}> () "
                "y = Expand(x, s)", opset=13)
    check_gradients(net, {"x": x}, ort=True)


@pytest.mark.parametrize("repeats", [[2, 3], [1, 2], [3, 1], [1, 1]])
def test_tile_gradient_sums_the_copies(rng, repeats):
    x = rand(rng, 2, 3)
    out = np.tile(x, repeats).shape
    net = model(f"(double[2, 3] x) => (double[{dims(out)}] y)",
                f"r = Constant <value = int64[2] {{{dims(repeats)}}}> () y = Tile(x, r)", opset=13)
    ref = cotangent(out, np.float64).reshape(repeats[0], 2, repeats[1], 3).sum(axis=(0, 2))
    check_gradients(net, {"x": x}, reference={"x": ref}, ort=True)


def test_tile_gradient_with_a_symbolic_batch_dim(rng):
    x = rand(rng, 2, 3)
    net = model("(double[N, 3] x) => (double[M, 6] y)",
                "r = Constant <value = int64[2] {2, 2}> () y = Tile(x, r)", opset=13)
    check_gradients(net, {"x": x}, ort=True)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_gradient_splits_dy_per_input(rng, axis):
    shapes = [[2, 3], [2, 3], [2, 3]]
    a = axis % 2
    for i, s in enumerate(shapes):
        s[a] = i + 1
    xs = {f"x{i}": rand(rng, *s) for i, s in enumerate(shapes)}
    out = np.concatenate(list(xs.values()), axis=a).shape
    sig = ", ".join(f"double[{dims(s)}] x{i}" for i, s in enumerate(shapes))
    net = model(f"({sig}) => (double[{dims(out)}] y)",
                f"y = Concat <axis = {axis}> (x0, x1, x2)", opset=13)
    check_gradients(net, xs, ort=True)


def test_concat_gradient_with_symbolic_sizes(rng):
    xs = {"a": rand(rng, 2, 3), "b": rand(rng, 4, 3)}
    net = model("(double[N, 3] a, double[M, 3] b) => (double[K, 3] y)",
                "y = Concat <axis = 0> (a, b)", opset=13)
    check_gradients(net, xs, ort=True)


def test_concat_gradient_reaches_a_repeated_input(rng):
    x = rand(rng, 2, 3)
    net = model("(double[2, 3] x) => (double[2, 6] y)", "y = Concat <axis = 1> (x, x)", opset=13)
    check_gradients(net, {"x": x}, ort="auto")  # the builder rejects a repeated input


@pytest.mark.parametrize("opset", [13, 18])
def test_split_gradient_fills_unused_outputs_with_zeros(rng, opset):
    x = rand(rng, 2, 5)
    net = model("(double[2, 5] x) => (double[2, 2] y)",
                "s = Constant <value = int64[2] {2, 3}> () a, b = Split <axis = -1> (x, s) "
                "y = Mul(a, a)", opset=opset)
    check_gradients(net, {"x": x}, ort="auto")


def test_split_gradient_with_both_outputs_used(rng):
    x = rand(rng, 4, 3)
    net = model("(double[4, 3] x) => (double[2, 3] y)",
                "a, b = Split(x) y = Mul(a, b)", opset=13)
    check_gradients(net, {"x": x}, ort=True)


def test_split_gradient_with_num_outputs_at_opset_18(rng):
    x = rand(rng, 2, 6)
    net = model("(double[2, 6] x) => (double[2, 2] y)",
                "a, b, c = Split <axis = 1, num_outputs = 3> (x) y = Sub(c, a)", opset=18)
    check_gradients(net, {"x": x}, ort="auto")


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_gradient_in_both_modes(rng, mode):
    x = rand(rng, 1, 8, 2, 3)
    net = model("(double[1, 8, 2, 3] x) => (double[1, 2, 4, 6] y)",
                f'y = DepthToSpace <blocksize = 2, mode = "{mode}"> (x)', opset=13)
    check_gradients(net, {"x": x}, ort="auto")


def test_space_to_depth_gradient(rng):
    x = rand(rng, 2, 2, 4, 6)
    net = model("(double[2, 2, 4, 6] x) => (double[2, 8, 2, 3] y)",
                "y = SpaceToDepth <blocksize = 2> (x)", opset=13)
    check_gradients(net, {"x": x}, ort="auto")


# ------------------------------------------------------------------ CenterCropPad
# pad what was cropped, crop what was padded
CASES = [  # x shape, target sizes, axes
    ((5, 6), [3, 6], None),           # crop, even difference
    ((5, 6), [2, 6], None),           # crop, odd difference: the window starts left
    ((3, 4), [6, 4], None),           # pad, odd difference: the extra zero is right
    ((3, 4), [7, 2], None),           # pad one axis, crop the other
    ((2, 5, 4, 3), [2, 7], [1, 2]),   # axes
    ((4, 5, 3), [3, 4], [-3, -2]),    # negative axes (an HWC image)
]


@pytest.mark.parametrize("shape, sizes, axes", CASES)
def test_center_crop_pad_gradient_is_its_adjoint(rng, shape, sizes, axes):
    x = rand(rng, *shape)
    attrs = "" if axes is None else f"<axes = [{dims(axes)}]>"
    evaluator_model = model(
        f"(double[{dims(shape)}] x, int64[{len(sizes)}] s) => (double y)",
        f"y = CenterCropPad {attrs} (x, s)")
    s = np.array(sizes, dtype=np.int64)
    y = ReferenceEvaluator(evaluator_model).run(None, {"x": x, "s": s})[0]
    net = model(f"(double[{dims(shape)}] x, int64[{len(sizes)}] s) => "
                f"(double[{dims(y.shape)}] y)", f"y = CenterCropPad {attrs} (x, s)")
    # the adjoint of a linear map: <dy, A e_k> for every unit vector e_k of x
    r = cotangent(y.shape, np.float64)
    evaluator = ReferenceEvaluator(evaluator_model)
    expected = np.zeros(x.shape)
    for k in np.ndindex(x.shape):
        unit = np.zeros(x.shape)
        unit[k] = 1
        expected[k] = np.sum(r * evaluator.run(None, {"x": unit, "s": s})[0])
    check_gradients(net, {"x": x, "s": s}, wrt=["x"], reference={"x": expected})


def test_center_crop_pad_gradient_with_dims_known_at_run_time_only(rng):
    x = rand(rng, 3, 6)
    net = model("(double[N, M] x, int64[2] s) => (double[P, Q] y)",
                "y = CenterCropPad (x, s)")
    check_gradients(net, {"x": x, "s": np.array([6, 3])}, wrt=["x"])
