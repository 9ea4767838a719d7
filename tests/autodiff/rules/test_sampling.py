"""Gradients of the sampling ops (lossgraph/autodiff/rules/sampling.py): GridSample with
respect to the input and the grid (every mode, padding mode and align_corners), RoiAlign and
DeformConv.

onnxruntime's GridSample has a double kernel from opset 20 (checked in float64 with
tight tolerances) and cubic mode in 2-D only (3-D cubic is checked against the ONNX
reference implementation).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients, cotangent
from support.models import dims, model

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.runtime.session import create_session

F32 = np.float32


def _grid_sample(x_shape, grid_shape, attrs: str, kind: str = "double", opset: int = 20):
    out = (x_shape[0], x_shape[1], *grid_shape[1:-1])
    return model(f"({kind}[{dims(x_shape)}] x, {kind}[{dims(grid_shape)}] grid) => "
                 f"({kind}[{dims(out)}] y)", f"y = GridSample <{attrs}> (x, grid)", opset=opset)


def vjp_without_the_forward(net, feeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    """lossgraph's gradients of sum(y R) (R the harness's cotangent of y's shape, from
    the ONNX reference implementation), run in onnxruntime without the forward node,
    for forwards onnxruntime cannot run (3-D cubic GridSample, DeformConv on 1.19)."""
    graph = lossgraph.gradient(net, weights=list(wrt), outputs=["y"])
    seed = graph.graph.input[len(net.graph.input)].name
    forward = net.graph.node[-1].op_type
    kept = [n for n in graph.graph.node if n.op_type != forward]
    outputs = [o for o in graph.graph.output if o.name.endswith("_grad")]
    pruned = helper.make_model(
        helper.make_graph(kept, "vjp", list(graph.graph.input), outputs,
                          list(graph.graph.initializer)),
        opset_imports=list(graph.opset_import), ir_version=graph.ir_version)
    y = ReferenceEvaluator(net).run(None, feeds)[0]
    r = cotangent(y.shape, y.dtype)
    names = [f"{w}_grad" for w in wrt]
    return dict(zip(wrt, create_session(pruned).run(names, {**feeds, seed: r})))


def reference_differences(net, feeds: dict, name: str, step: float,
                          every: int = 1) -> np.ndarray:
    """Central differences of sum(y R) with respect to ``feeds[name]``, y from the ONNX
    reference implementation; at every ``every``-th element only (NaN elsewhere), as the
    reference implementation is slow."""
    evaluator = ReferenceEvaluator(net)
    y = evaluator.run(None, feeds)[0]
    r = cotangent(y.shape, y.dtype)
    numeric = np.full(feeds[name].shape, np.nan)
    for flat in range(0, numeric.size, every):
        index = np.unravel_index(flat, numeric.shape)
        moved = []
        for sign in (1, -1):
            value = {k: np.array(v, copy=True) for k, v in feeds.items()}
            value[name][index] += sign * step
            moved.append(np.sum(evaluator.run(None, value)[0] * r))
        numeric[index] = (moved[0] - moved[1]) / (2 * step)
    return numeric


def _attrs(mode: str, padding: str, align: int) -> str:
    return f'mode = "{mode}", padding_mode = "{padding}", align_corners = {align}'


def _feeds(rng, x_shape, grid_shape, dtype=np.float64):
    """A grid reaching past the image on every side (-1.3 to 1.3), so every padding mode
    is exercised."""
    return {"x": rng.normal(size=x_shape).astype(dtype),
            "grid": rng.uniform(-1.3, 1.3, size=grid_shape).astype(dtype)}


COMBINATIONS = [c for c in itertools.product(["linear", "nearest", "cubic"],
                                             ["zeros", "border", "reflection"], [0, 1])
                if c[:2] != ("cubic", "border")]


@pytest.mark.parametrize("mode, padding, align", COMBINATIONS)
def test_grid_sample_2d_gradients(rng, mode, padding, align):
    x_shape, grid_shape = (2, 2, 4, 5), (2, 3, 2, 2)
    check_gradients(_grid_sample(x_shape, grid_shape, _attrs(mode, padding, align)),
                    _feeds(rng, x_shape, grid_shape))


@pytest.mark.parametrize("mode, padding, align", [
    ("bilinear", "zeros", 0), ("bicubic", "reflection", 1), ("nearest", "border", 0)])
def test_grid_sample_opset_16_names_in_float(rng, mode, padding, align):
    x_shape, grid_shape = (1, 2, 3, 4), (1, 2, 3, 2)
    check_gradients(_grid_sample(x_shape, grid_shape, _attrs(mode, padding, align), "float",
                                 opset=16),
                    _feeds(rng, x_shape, grid_shape, F32), eps=1e-3, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode, padding, align",
                         [c for c in COMBINATIONS if c[0] != "cubic"])
def test_grid_sample_3d_gradients(rng, mode, padding, align):
    x_shape, grid_shape = (1, 2, 3, 4, 3), (1, 2, 2, 1, 3)
    check_gradients(_grid_sample(x_shape, grid_shape, _attrs(mode, padding, align)),
                    _feeds(rng, x_shape, grid_shape))


@pytest.mark.parametrize("padding, align", [("zeros", 0), ("reflection", 1)])
def test_grid_sample_3d_cubic_against_the_reference_implementation(rng, padding, align):
    """onnxruntime runs cubic mode in 2-D only; the specification in any dimension."""
    x_shape, grid_shape = (1, 1, 3, 4, 3), (1, 2, 1, 1, 3)
    net = _grid_sample(x_shape, grid_shape, _attrs("cubic", padding, align))
    feeds = _feeds(rng, x_shape, grid_shape)
    got = vjp_without_the_forward(net, feeds, ["x", "grid"])
    for name in ("x", "grid"):
        # the reference computes positions in float32: a step of 1e-3 stays above its
        # rounding
        numeric = reference_differences(net, feeds, name, 1e-3)
        np.testing.assert_allclose(got[name], numeric, rtol=1e-3, atol=1e-3)


@pytest.mark.torch
@pytest.mark.parametrize("mode, padding, align", [
    c for c in itertools.product(["bilinear", "nearest", "bicubic"],
                                 ["zeros", "border", "reflection"], [0, 1])
    if c[:2] != ("bicubic", "border")])
def test_grid_sample_gradients_match_torch(rng, mode, padding, align):
    import torch

    x_shape, grid_shape = (2, 2, 4, 5), (2, 3, 2, 2)
    feeds = _feeds(rng, x_shape, grid_shape)
    tx = torch.tensor(feeds["x"], requires_grad=True)
    tg = torch.tensor(feeds["grid"], requires_grad=True)
    y = torch.nn.functional.grid_sample(tx, tg, mode=mode, padding_mode=padding,
                                        align_corners=bool(align))
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    onnx_mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    check_gradients(_grid_sample(x_shape, grid_shape, _attrs(onnx_mode, padding, align)),
                    feeds, reference={"x": tx.grad.numpy(), "grid": tg.grad.numpy()})


def test_grid_sample_cubic_with_border_padding_is_a_named_error(rng):
    """onnxruntime and torch clamp each cubic tap, the ONNX reference implementation the
    sampling position: the forwards differ, so no gradient is claimed for either."""
    net = _grid_sample((1, 1, 3, 3), (1, 2, 2, 2), _attrs("cubic", "border", 0))
    with pytest.raises(UnsupportedModelError, match="border"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


# ---------------------------------------------------------------------- RoiAlign
ROIS = np.array([[0.5, 1.0, 4.2, 5.1],   # inside
                 [-1.0, -2.0, 3.0, 2.5],  # past the top left corner
                 [2.0, 2.0, 9.0, 8.0],    # past the bottom right corner
                 [1.0, 1.0, 1.2, 1.5]])   # smaller than a bin
BATCH = np.array([0, 1, 1, 0], np.int64)


def _roi_align(mode: str, transform: str, sampling: int, constant_rois: bool,
               kind: str = "double"):
    attrs = (f'mode = "{mode}", coordinate_transformation_mode = "{transform}", '
             f"sampling_ratio = {sampling}, output_height = 2, output_width = 3, "
             "spatial_scale = 0.8")
    body = f"y = RoiAlign <{attrs}> (x, rois, b)"
    if constant_rois:
        values = ", ".join(str(v) for v in ROIS.reshape(-1))
        body = f"rois = Constant <value = {kind}[4, 4] {{{values}}}> ()\n" + body
        inputs = f"{kind}[2, 3, 6, 7] x, int64[4] b"
    else:
        inputs = f"{kind}[2, 3, 6, 7] x, {kind}[4, 4] rois, int64[4] b"
    return model(f"({inputs}) => ({kind}[4, 3, 2, 3] y)", body, opset=16)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("transform", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling, constant_rois", [(0, True), (2, True), (1, False),
                                                     (2, False)])
def test_roi_align_gradient_with_respect_to_x(rng, mode, transform, sampling, constant_rois):
    x = rng.normal(size=(2, 3, 6, 7))
    feeds = {"x": x, "b": BATCH} if constant_rois else {"x": x, "rois": ROIS, "b": BATCH}
    check_gradients(_roi_align(mode, transform, sampling, constant_rois), feeds, wrt=["x"])


def test_roi_align_rois_carry_no_gradient(rng):
    """The regions are constants of the sampling, as torchvision's roi_align treats them:
    asking for their gradient is a named error, not a silent zero."""
    net = _roi_align("avg", "half_pixel", 2, constant_rois=False)
    with pytest.raises(lossgraph.errors.NoGradientError,
                       match="'rois' enters it as input 1.*constants of the sampling"):
        lossgraph.gradient(net, weights=["rois"], outputs=["y"])


def test_roi_align_with_adaptive_sampling_needs_constant_rois():
    net = _roi_align("avg", "half_pixel", 0, constant_rois=False)
    with pytest.raises(UnsupportedModelError, match="sampling_ratio"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


# -------------------------------------------------------------------- DeformConv
def _ort_runs_deform_conv() -> bool:
    net = model("(float[1, 1, 2, 2] x, float[1, 1, 1, 1] w, float[1, 2, 2, 2] o) => "
                "(float[1, 1, 2, 2] y)", "y = DeformConv (x, w, o)", opset=19)
    try:
        create_session(net)
    except Exception:
        return False
    return True


def _deform_conv(x_shape, w_shape, attrs: dict, bias: bool, mask: bool, rng):
    n, _, height, width = x_shape
    oc, _, kh, kw = w_shape
    pads = attrs.get("pads", [0, 0, 0, 0])
    strides, dilations = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    oh = (height + pads[0] + pads[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (width + pads[1] + pads[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    groups = attrs.get("offset_group", 1)
    feeds = {"x": rng.normal(size=x_shape), "w": rng.normal(size=w_shape),
             "offset": rng.normal(size=(n, groups * kh * kw * 2, oh, ow)) * 0.7}
    args = "x, w, offset"
    if bias:
        feeds["b"] = rng.normal(size=oc)
    if bias or mask:
        args += ", b" if bias else ", "
    if mask:
        feeds["m"] = rng.uniform(0.2, 1.0, size=(n, groups * kh * kw, oh, ow))
        args += ", m"
    inputs = ", ".join(f"double[{dims(v.shape)}] {k}" for k, v in feeds.items())
    text = ", ".join(f"{k} = {v}" if not isinstance(v, list) else f"{k} = [{dims(v)}]"
                     for k, v in attrs.items())
    net = model(f"({inputs}) => (double[{n}, {oc}, {oh}, {ow}] y)",
                f"y = DeformConv <{text}> ({args})" if text else f"y = DeformConv ({args})",
                opset=19)
    return net, feeds


DEFORM_CASES = [  # x, w, attrs, bias, mask
    ((1, 2, 3, 3), (2, 2, 2, 2), {}, False, False),
    ((1, 4, 4, 3), (4, 2, 2, 2), {"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1],
                                  "strides": [2, 1], "dilations": [1, 2]}, True, True),
    ((1, 2, 3, 4), (1, 2, 3, 3), {"offset_group": 2, "pads": [1, 1, 1, 1]}, False, True),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs, bias, mask", DEFORM_CASES)
def test_deform_conv_gradients_against_the_reference_implementation(
        rng, x_shape, w_shape, attrs, bias, mask):
    """Every input, against central differences of the ONNX reference implementation
    (onnxruntime 1.19 has no DeformConv kernel). The reference samples at positions
    rounded to float32: the offsets' step is 1e-3, above that rounding."""
    net, feeds = _deform_conv(x_shape, w_shape, attrs, bias, mask, rng)
    wrt = [k for k in feeds]
    got = vjp_without_the_forward(net, feeds, wrt)
    for name in wrt:
        step, tolerance = (1e-3, 1e-3) if name == "offset" else (1e-6, 1e-5)
        every = max(1, feeds[name].size // 24)  # about 24 elements of each input
        numeric = reference_differences(net, feeds, name, step, every)
        compared = ~np.isnan(numeric)
        np.testing.assert_allclose(got[name][compared], numeric[compared], rtol=tolerance,
                                   atol=tolerance, err_msg=name)


def test_deform_conv_offset_gradient_on_the_pixel_grid_is_the_central_difference(rng):
    """Integer offsets put every sample on a kink of the bilinear interpolation: the
    rule's slope is the mean of the one-sided ones, which central differences measure."""
    net, feeds = _deform_conv((1, 1, 3, 3), (1, 1, 2, 2), {"pads": [1, 1, 1, 1]}, False,
                              False, rng)
    feeds["offset"] = np.round(feeds["offset"] * 2)
    got = vjp_without_the_forward(net, feeds, ["offset"])
    numeric = reference_differences(net, feeds, "offset", 1e-3, every=3)
    compared = ~np.isnan(numeric)
    # one-sided slopes differ from the central one by O(1); the reference's float32
    # positions leave about 1e-4
    np.testing.assert_allclose(got["offset"][compared], numeric[compared], rtol=1e-3,
                               atol=1e-3)


@pytest.mark.skipif(not _ort_runs_deform_conv(), reason="this onnxruntime has no DeformConv "
                    "kernel (1.19)")
@pytest.mark.parametrize("x_shape, w_shape, attrs, bias, mask", DEFORM_CASES)
def test_deform_conv_gradients_against_onnxruntime(rng, x_shape, w_shape, attrs, bias, mask):
    net, feeds = _deform_conv(x_shape, w_shape, attrs, bias, mask, rng)
    check_gradients(net, feeds)
