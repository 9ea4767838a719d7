"""Gradients of indexing ops (lossgraph/autodiff/rules/indexing.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_gradients, cotangent
from models import dims, model

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.graphs import attribute_values


def ints(name: str, values) -> str:
    return f"{name} = Constant <value = int64[{len(values)}] {{{dims(values)}}}> () "


def rand(rng, *shape):
    return rng.normal(size=shape)


# ------------------------------------------------------------------------------ Slice
SLICES = [  # starts, ends, axes, steps
    ([1], [3], None, None),
    ([0, 1], [2, -1], [0, 2], None),
    ([-3], [100], [-1], None),
    ([0, 4], [3, 0], [0, 2], [2, -1]),
    ([-1], [-100], [1], [-2]),
    ([1, 0], [3, 5], [2, 1], [3, 2]),
    ([3], [1], [0], None),
]


def _slice_model(opset, x_sig, starts, ends, axes, steps, y_sig):
    body = ints("s", starts) + ints("e", ends)
    args = "x, s, e"
    if axes is not None or steps is not None:
        body += ints("a", axes if axes is not None else list(range(len(starts))))
        args += ", a"
    if steps is not None:
        body += ints("t", steps)
        args += ", t"
    return model(f"({x_sig} x) => ({y_sig} y)", body + f"y = Slice({args})", opset=opset)


def _numpy_slice(x, starts, ends, axes, steps):
    index = [slice(None)] * x.ndim
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    for s, e, a, t in zip(starts, ends, axes, steps):
        index[a] = slice(s, e, t)
    return tuple(index)


@pytest.mark.parametrize("starts, ends, axes, steps", SLICES)
def test_slice_gradient_scatters_dy_back(rng, starts, ends, axes, steps):
    x = rand(rng, 4, 3, 5)
    index = _numpy_slice(x, starts, ends, axes, steps)
    out = x[index].shape
    net = _slice_model(13, "double[4, 3, 5]", starts, ends, axes, steps, f"double[{dims(out)}]")
    ref = np.zeros_like(x)
    ref[index] = cotangent(out, np.float64)
    # onnxruntime-training's SliceGrad fails on negative steps and empty slices
    plain = all(t > 0 for t in steps or [1]) and 0 not in out
    check_gradients(net, {"x": x}, reference={"x": ref}, ort=True if plain else False)


@pytest.mark.parametrize("starts, ends, axes, steps", SLICES[1:5])
def test_slice_gradient_with_symbolic_shape(rng, starts, ends, axes, steps):
    x = rand(rng, 4, 3, 5)
    net = _slice_model(13, "double[N, 3, M]", starts, ends, axes, steps, "double[A, B, C]")
    check_gradients(net, {"x": x}, ort=True if all(t > 0 for t in steps or [1]) else False)


def test_slice_gradient_unit_steps_matches_onnxruntime(rng):
    x = rand(rng, 4, 3, 5)
    net = _slice_model(13, "double[4, 3, 5]", [1, 1], [3, 4], [0, 2], None, "double[2, 3, 3]")
    check_gradients(net, {"x": x}, ort=True)


# -------------------------------------------------------------------------------- Pad
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("pads", [[1, 0, 2, 3], [0, 2, 0, 1], [-1, 1, 0, -2]])
def test_pad_gradient_crops_dy(rng, opset, pads):
    x = rand(rng, 3, 4)
    out = (3 + pads[0] + pads[2], 4 + pads[1] + pads[3])
    net = model(f"(double[3, 4] x) => (double[{dims(out)}] y)",
                ints("p", pads) + 'y = Pad <mode = "constant"> (x, p)', opset=opset)
    check_gradients(net, {"x": x}, ort=True)


def test_pad_gradient_reaches_the_constant_value(rng):
    x, c = rand(rng, 3, 4), np.array(0.7)
    net = model("(double[3, 4] x, double c) => (double[4, 7] y)",
                ints("p", [1, 0, 0, 3]) + "y = Pad(x, p, c)", opset=13)
    check_gradients(net, {"x": x, "c": c}, ort="auto")


def test_pad_gradient_with_axes_at_opset_18(rng):
    x = rand(rng, 2, 3, 4)
    net = model("(double[2, 3, 4] x) => (double[2, 3, 7] y)",
                ints("p", [2, 1]) + ints("a", [-1]) + "y = Pad(x, p, , a)", opset=18)
    check_gradients(net, {"x": x}, ort="auto")


def test_pad_gradient_in_reflect_mode_is_a_clear_error(rng):
    net = model("(double[3, 4] x) => (double[5, 4] y)",
                ints("p", [1, 0, 1, 0]) + 'y = Pad <mode = "reflect"> (x, p)', opset=13)
    with pytest.raises(UnsupportedModelError, match="reflect"):
        check_gradients(net, {"x": rand(rng, 3, 4)})


# ----------------------------------------------------------------------------- Gather
@pytest.mark.parametrize("opset", [13, 16])
@pytest.mark.parametrize("axis, indices", [
    (0, [[0, 2], [2, -1]]), (1, [1, 1, 0]), (-1, [[3], [-4]]), (1, 2)])
def test_gather_gradient_accumulates_duplicate_indices(rng, opset, axis, indices):
    x = rand(rng, 3, 4, 2)[:, :, 0] if axis == -1 else rand(rng, 3, 4, 2)
    i = np.array(indices, dtype=np.int64)
    out = np.take(x, i, axis=axis).shape
    isig = f"int64[{dims(i.shape)}] i" if i.ndim else "int64 i"
    net = model(f"(double[{dims(x.shape)}] x, {isig}) => (double[{dims(out)}] y)",
                f"y = Gather <axis = {axis}> (x, i)", opset=opset)
    ref = np.zeros_like(x)
    moved = np.moveaxis(ref, axis, 0)
    dy = cotangent(out, np.float64)
    a = axis % x.ndim
    dy_moved = np.moveaxis(dy.reshape(x.shape[:a] + (-1,) + x.shape[a + 1:]), a, 0)
    np.add.at(moved, i.reshape(-1) % x.shape[a], dy_moved)
    check_gradients(net, {"x": x, "i": i}, wrt=["x"], reference={"x": ref}, ort=True)


def test_gather_gradient_with_int32_indices_and_symbolic_shape(rng):
    x, i = rand(rng, 5, 3), np.array([4, 0, 4, -5], dtype=np.int32)
    net = model("(double[N, 3] x, int32[K] i) => (double[K, 3] y)", "y = Gather(x, i)", opset=16)
    check_gradients(net, {"x": x, "i": i}, wrt=["x"], ort=True)


def test_gather_gradient_matches_onnxruntime(rng):
    x, i = rand(rng, 5, 3), np.array([[4, 0], [1, 2]], dtype=np.int64)
    net = model("(double[5, 3] x, int64[2, 2] i) => (double[2, 2, 3] y)", "y = Gather(x, i)",
                opset=16)
    check_gradients(net, {"x": x, "i": i}, wrt=["x"], ort=True)


def _scatters(net) -> list[tuple[str, str]]:
    """(op type, reduction) of every scatter in the gradient of ``net`` with respect to x."""
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    return [(n.op_type, attribute_values(n).get("reduction", "none"))
            for n in graph.graph.node if n.op_type.startswith("Scatter")]


@pytest.mark.parametrize("signature, indices, scatter", [
    ("(double[5, 3] x, int64[K] i) => (double[K, 3] y)", None, "ScatterElements"),
    ("(double[5, 3] x, int64[2, 2] i) => (double[2, 2, 3] y)", None, "ScatterElements"),
    ("(double[5, 3] x) => (double[3, 3] y)", [4, 0, -1], "ScatterElements"),  # 4 twice
    ("(double[5, 3] x) => (double[3, 3] y)", [4, 0, 1], "ScatterND"),
    ("(double[5, 3] x, int64[1] i) => (double[1, 3] y)", None, "ScatterND"),
])
def test_gather_gradient_adds_repeatable_indices_in_order(rng, signature, indices, scatter):
    """onnxruntime's ScatterND(add) races when two threads add into one row (module doc of
    the rules): indices that can repeat are added by a ScatterElements, in order; constant
    distinct ones and a single index keep the ScatterND, which then has nothing to race."""
    body = "y = Gather(x, i)" if indices is None else ints("i", indices) + "y = Gather(x, i)"
    net = model(signature, body, opset=16)
    assert _scatters(net) == [(scatter, "add")]
    feeds = {"x": rand(rng, 5, 3)}
    if indices is None:
        rows = net.graph.input[1].type.tensor_type.shape.dim
        feeds["i"] = np.zeros([d.dim_value or 4 for d in rows], np.int64)
    check_gradients(net, feeds, wrt=["x"])


@pytest.mark.parametrize("signature, indices, scatter", [
    ("(double[3, 4, 2] x, int64[3, 2] i) => (double[3, 2] y)", None, "ScatterElements"),
    # (0, 1) twice
    ("(double[3, 4, 2] x) => (double[2, 2] y)", [[0, 1], [-3, 1]], "ScatterElements"),
    ("(double[3, 4, 2] x) => (double[2, 2] y)", [[0, 1], [2, 3]], "ScatterND"),
    ("(double[3, 4, 2] x, int64[2] i) => (double[2] y)", None, "ScatterND"),
])
def test_gather_nd_gradient_adds_repeatable_indices_in_order(rng, signature, indices, scatter):
    body = "y = GatherND(x, i)"
    if indices is not None:
        flat = np.array(indices).reshape(-1).tolist()
        body = (f"i = Constant <value = int64[2, 2] {{{dims(flat)}}}> () " + body)
    net = model(signature, body, opset=16)
    assert _scatters(net) == [(scatter, "add")]
    feeds = {"x": rand(rng, 3, 4, 2)}
    if indices is None:
        feeds["i"] = np.zeros([d.dim_value for d in net.graph.input[1].type.tensor_type.shape
                               .dim], np.int64)
    check_gradients(net, feeds, wrt=["x"])


@pytest.mark.parametrize("opset", [13, 16])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_gradient_accumulates_duplicates(rng, opset, axis):
    x = rand(rng, 3, 4)
    a = axis % 2
    ishape = (3, 4)
    i = rng.integers(-x.shape[a], x.shape[a], size=ishape)
    net = model("(double[3, 4] x, int64[3, 4] i) => (double[3, 4] y)",
                f"y = GatherElements <axis = {axis}> (x, i)", opset=opset)
    ref = np.zeros_like(x)
    dy = cotangent(ishape, np.float64)
    for pos in np.ndindex(ishape):
        target = list(pos)
        target[a] = i[pos] % x.shape[a]
        ref[tuple(target)] += dy[pos]
    check_gradients(net, {"x": x, "i": i}, wrt=["x"], reference={"x": ref}, ort=True)


@pytest.mark.parametrize("opset", [13, 16])
def test_gather_elements_gradient_with_smaller_indices(rng, opset):
    x, i = rand(rng, 3, 4), np.array([[0, 2], [2, 2]], dtype=np.int64)
    net = model("(double[3, 4] x, int64[2, 2] i) => (double[2, 2] y)",
                "y = GatherElements <axis = 0> (x, i)", opset=opset)
    check_gradients(net, {"x": x, "i": i}, wrt=["x"], ort=True)


@pytest.mark.parametrize("opset", [13, 16])
@pytest.mark.parametrize("signature, indices", [
    ("(double[3, 4, 2] x, int64[3, 2] i) => (double[3, 2] y)",
     [[0, 1], [2, -1], [0, 1]]),
    ("(double[d0, d1, d2] x, int64[2, 2, 3] i) => (double[2, 2] y)",
     [[[0, 1, 1], [2, 3, 0]], [[0, 1, 1], [1, -4, -1]]]),
    ("(double[d0, d1, d2] x, int64[2] i) => (double[2] y)", [2, -1]),
    ("(double[3, 4, 2] x, int64[2, 1] i) => (double[2, 4, 2] y)", [[0], [0]]),
])
def test_gather_nd_gradient_accumulates_duplicates(rng, opset, signature, indices):
    """ScatterND with reduction add from opset 16; before, OneHot of the flat positions
    times dy (symbolic shapes included)."""
    net = model(signature, "y = GatherND(x, i)", opset=opset)
    check_gradients(net, {"x": rand(rng, 3, 4, 2), "i": np.array(indices, np.int64)},
                    wrt=["x"], ort=opset == 16)


def test_gather_nd_gradient_with_batch_dims_is_a_clear_error(rng):
    net = model("(double[2, 3] x, int64[2, 1] i) => (double[2] y)",
                "y = GatherND <batch_dims = 1> (x, i)", opset=13)
    with pytest.raises(UnsupportedModelError, match="batch_dims"):
        check_gradients(net, {"x": rand(rng, 2, 3), "i": np.array([[0], [2]])}, wrt=["x"])


# ---------------------------------------------------------------------------- Scatter
@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_nd_gradients_for_data_and_updates(rng, reduction):
    x, u = rand(rng, 4, 3), rand(rng, 2, 3)
    i = np.array([[3], [1]], dtype=np.int64)
    net = model("(double[4, 3] x, int64[2, 1] i, double[2, 3] u) => (double[4, 3] y)",
                f'y = ScatterND <reduction = "{reduction}"> (x, i, u)', opset=16)
    # onnxruntime-training's builder ignores reduction="add" (its dx is wrong there)
    check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"],
                    ort=True if reduction == "none" else False)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements_gradients_for_data_and_updates(rng, axis, reduction):
    x, u = rand(rng, 3, 4), rand(rng, 2, 3)
    i = np.array([[2, 0, 1], [0, 1, 2]], dtype=np.int64) if axis == 0 else \
        np.array([[3, 0, 1], [0, 2, 3]], dtype=np.int64)
    net = model("(double[3, 4] x, int64[2, 3] i, double[2, 3] u) => (double[3, 4] y)",
                f'y = ScatterElements <axis = {axis}, reduction = "{reduction}"> (x, i, u)',
                opset=16)
    # onnxruntime-training's builder ignores reduction="add" (its dx is wrong there)
    check_gradients(net, {"x": x, "i": i, "u": u}, wrt=["x", "u"],
                    ort=True if reduction == "none" else False)


# ------------------------------------------------------------------------ TopK, Trilu
@pytest.mark.parametrize("axis, largest", [(-1, 1), (0, 0), (1, 1)])
def test_topk_gradient_flows_to_the_selected_elements(rng, axis, largest):
    x = rng.permutation(12).reshape(3, 4).astype(np.float64) + rng.uniform(0, 0.1, (3, 4))
    out = [3, 4]
    out[axis] = 2
    net = model(f"(double[3, 4] x) => (double[{dims(out)}] v, int64[{dims(out)}] j)",
                ints("k", [2]) + f"v, j = TopK <axis = {axis}, largest = {largest}> (x, k)",
                opset=13)
    check_gradients(net, {"x": x}, ort=True)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, -1, 2])
def test_trilu_gradient_masks_dy(rng, upper, k):
    x = rand(rng, 2, 3, 4)
    body = f"k = Constant <value = int64 {{{k}}}> () " if k is not None else ""
    args = "x, k" if k is not None else "x"
    net = model("(double[2, 3, 4] x) => (double[2, 3, 4] y)",
                body + f"y = Trilu <upper = {upper}> ({args})", opset=14)
    ref_fn = np.triu if upper else np.tril
    ref = ref_fn(cotangent((2, 3, 4), np.float64), k or 0)
    check_gradients(net, {"x": x}, reference={"x": ref}, ort=True)


# ----------------------------------------------------------------------------- OneHot
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_values_get_the_sums_of_dy_off_and_on(rng, axis):
    """float32: onnxruntime has no OneHot with double values."""
    i = np.array([[0, 2, -1], [1, 1, 3]])
    values = np.array([0.3, 1.7], np.float32)
    shape = list(i.shape)
    shape.insert(axis % 3, 4)
    net = model(f"(int64[2, 3] i, float[2] v) => (float[{dims(shape)}] y)",
                "d = Constant <value = int64 {4}> () "
                f"y = OneHot <axis = {axis}> (i, d, v)", opset=13)
    hot = np.moveaxis(np.eye(4)[i % 4], -1, axis % 3)
    r = cotangent(tuple(shape), np.float32)
    expected = np.array([(r * (1 - hot)).sum(), (r * hot).sum()], np.float32)
    check_gradients(net, {"i": i, "v": values}, wrt=["v"], reference={"v": expected})
