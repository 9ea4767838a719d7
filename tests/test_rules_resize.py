"""Gradients of Resize (lossgraph/autodiff/rules/indexing.py): the adjoint of the
interpolation onnxruntime computes, for every mode, coordinate transformation, antialias,
``axes`` and ``keep_aspect_ratio_policy``, with shapes static or known at run time only.

Resize is linear in ``x``, so central differences with a large step (0.5) are exact up to
float32 rounding: the checks compare at 1e-4 (onnxruntime has no double Resize).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from support.gradcheck import attributes_text, check_gradients, cotangent, loss_model
from support.models import dims, model

import lossgraph
from lossgraph.errors import UnsupportedModelError

X_SHAPE = (2, 3, 5, 7)
#: x with every dim known at run time only, or with a static shape
DYNAMIC = "(float[N, C, H, W] x) => (float[N, C, A, B] y)"
STATIC = "(float[2, 3, 5, 7] x) => (float[N, C, A, B] y)"
#: scales 0.6 and 1.5 on the image axes: 5 -> 3 and 7 -> 10, with exact ties of the
#: nearest modes at 0.6 (half_pixel: (1 + 0.5) / 0.6 - 0.5 = 2 in float32)
SCALES = [1, 1, 0.6, 1.5]
ROI = [0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2]  # crops axis 2, reaches outside axis 3


def ints(name: str, values) -> str:
    return f"{name} = Constant <value = int64[{len(values)}] {{{dims(values)}}}> () "


def floats(name: str, values) -> str:
    return f"{name} = Constant <value = float[{len(values)}] {{{dims(values)}}}> () "


def resize_model(signature: str, attributes: dict, *, scales=None, sizes=None, roi=None,
                 opset: int = 18) -> onnx.ModelProto:
    """``y = Resize(x, roi, scales | sizes)``; sizes computed from ``Shape(x)``: the first
    two its own and the last two 3 and 11 (``sizes="shape"``, as torch exports
    ``F.interpolate(size=...)``) or twice its own (``sizes="twice"``)."""
    body = floats("r", roi) if roi is not None else ""
    if scales is not None:
        body += floats("s", scales)
        args = "x, r, s" if roi is not None else "x, , s"
    else:
        if sizes in ("shape", "twice"):
            body += (ints("start", [0]) + ints("end", [2]) + ints("last", [4]) +
                     ints("image", [3, 11]) + ints("two", [2]) +
                     "shape = Shape(x) kept = Slice(shape, start, end) "
                     "own = Slice(shape, end, last) twice = Mul(own, two) ")
            body += f"z = Concat <axis = 0> (kept, {'image' if sizes == 'shape' else 'twice'}) "
        else:
            body += ints("z", sizes)
        args = "x, r, , z" if roi is not None else "x, , , z"
    return model(signature, body + f"y = Resize {attributes_text(attributes)} ({args})",
                 opset=opset)


def check_resize(net: onnx.ModelProto, **options) -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).normal(size=X_SHAPE).astype(np.float32)
    return check_gradients(net, {"x": x}, rtol=1e-4, atol=1e-4, eps=0.5, **options)


# id: (attributes, {"scales": ...} or {"sizes": ...}, opset)
CASES = {
    **{f"nearest_{m}": ({"mode": "nearest", "nearest_mode": m}, {"scales": SCALES}, 13)
       for m in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")},
    "nearest_asymmetric_floor": ({"mode": "nearest", "nearest_mode": "floor",
                                  "coordinate_transformation_mode": "asymmetric"},
                                 {"scales": SCALES}, 13),
    "linear_half_pixel": ({"mode": "linear"}, {"scales": SCALES}, 13),
    "linear_pytorch_half_pixel": ({"mode": "linear",
                                   "coordinate_transformation_mode": "pytorch_half_pixel"},
                                  {"scales": [1, 1, 0.2, 1.5]}, 13),
    "linear_asymmetric": ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
                          {"scales": SCALES}, 13),
    "linear_align_corners_whole_scales": (
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        {"scales": [1, 1, 2, 3]}, 13),
    "cubic_align_corners_sizes": (
        {"mode": "cubic", "coordinate_transformation_mode": "align_corners"},
        {"sizes": [2, 3, 3, 11]}, 13),
    "cubic_half_pixel": ({"mode": "cubic"}, {"scales": SCALES}, 13),
    "cubic_a_exclude_outside": ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
                                {"scales": SCALES}, 13),
    "linear_antialias": ({"mode": "linear", "antialias": 1}, {"scales": [1, 1, 0.6, 0.5]}, 18),
    "cubic_antialias": ({"mode": "cubic", "antialias": 1}, {"scales": [1, 1, 0.6, 0.5]}, 18),
    **{f"{m}_half_pixel_symmetric": ({"mode": m, "nearest_mode": "floor",
                                      "coordinate_transformation_mode": "half_pixel_symmetric"},
                                     {"scales": SCALES}, 19)
       for m in ("nearest", "linear", "cubic")},
    "axes_3_2": ({"mode": "linear", "axes": [3, 2]}, {"scales": [1.5, 0.6]}, 18),
    **{f"{m}_{policy}": ({"mode": m, "axes": [2, 3], "keep_aspect_ratio_policy": policy},
                         {"sizes": [3, 11]}, 18)
       for m in ("nearest", "cubic") for policy in ("not_larger", "not_smaller")},
}


@pytest.mark.parametrize("signature", [DYNAMIC, STATIC], ids=["run_time_shape", "static_shape"])
@pytest.mark.parametrize("case", list(CASES))
def test_resize_gradient_is_the_adjoint_of_onnxruntimes_interpolation(case, signature):
    attributes, values, opset = CASES[case]
    check_resize(resize_model(signature, attributes, opset=opset, **values), ort=False)


@pytest.mark.parametrize("signature", [DYNAMIC, STATIC], ids=["run_time_shape", "static_shape"])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("opset", [13, 18])
def test_tf_crop_and_resize_gradient_skips_the_extrapolated_outputs(signature, mode, opset):
    attributes = {"mode": mode, "coordinate_transformation_mode": "tf_crop_and_resize",
                  "extrapolation_value": 10.0}
    check_resize(resize_model(signature, attributes, sizes=[2, 3, 3, 11], roi=ROI, opset=opset),
                 ort=False)


def _gradient_nodes(net: onnx.ModelProto) -> list[onnx.NodeProto]:
    x = np.zeros(X_SHAPE, np.float32)
    graph = lossgraph.gradient(loss_model(net, {"x": x}), weights=["x"],
                               loss_name="gradcheck_loss")
    return [n for n in graph.graph.node if n.name.startswith("grad/")]


def test_axes_with_scale_one_cost_nothing():
    """Scales (1, 1, 2, 2) with every dim known at run time only: one interpolation matrix
    (EyeLike, Resize) and one product per image axis, nothing for the batch and channels."""
    net = resize_model(DYNAMIC, {"mode": "linear"}, scales=[1, 1, 2, 2])
    ops = [n.op_type for n in _gradient_nodes(net)]
    assert ops.count("EyeLike") == ops.count("Resize") == ops.count("MatMul") == 2
    assert "If" not in ops and "Einsum" not in ops


@pytest.mark.parametrize("sizes, decided_at_run_time", [("shape", 2), ("twice", 4)])
def test_sizes_computed_from_the_input_shape_are_resized_or_kept_at_run_time(
        sizes, decided_at_run_time):
    """torch's exports of ``F.interpolate(size=...)`` compute the batch and channel sizes
    from ``Shape(x)``: each axis whose size is computed at run time is contracted in
    ``If(kept)``, whose kept branch is the gradient as it is. Sizes 3 and 11 are known:
    those axes are resized; twice the image size is not: resized inside the If."""
    net = resize_model(DYNAMIC, {"mode": "linear"}, sizes=sizes)
    branches = [n for n in _gradient_nodes(net) if n.op_type == "If"]
    assert len(branches) == decided_at_run_time
    for node in branches:
        kept = next(a.g for a in node.attribute if a.name == "then_branch")
        assert [n.op_type for n in kept.node] == ["Identity"]
    check_resize(net, ort=False)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_align_corners_with_a_fractional_output_size_is_refused(rng, mode):
    """4 x 0.6 = 2.4: onnxruntime maps coordinates with 2, the ONNX specification with 2.4
    (their forwards differ), so no gradient can match both: a named error."""
    net = model("(float[1, 1, 4, 4] x) => (float[1, 1, 2, 2] y)",
                "s = Constant <value = float[4] {1, 1, 0.6, 0.6}> () "
                f'y = Resize <mode = "{mode}", coordinate_transformation_mode = '
                '"align_corners"> (x, , s)', opset=13)
    with pytest.raises(UnsupportedModelError, match="align_corners.*Give the Resize sizes"):
        check_gradients(net, {"x": rng.normal(size=(1, 1, 4, 4)).astype(np.float32)})


@pytest.mark.parametrize("signature, coordinates, match", [
    (DYNAMIC, "align_corners", "input size unknown until run time and scale 0.6"),
    (STATIC, "tf_crop_and_resize", r"7 x scale 1.5 is not a whole number.*sizes \(here 10\)"),
])
def test_a_scale_whose_output_size_may_not_be_whole_is_refused(signature, coordinates, match):
    """The same disagreement for tf_crop_and_resize, and for a scale that is not whole
    where the input size is known at run time only."""
    net = resize_model(signature, {"mode": "linear",
                                   "coordinate_transformation_mode": coordinates},
                       scales=SCALES, roi=ROI if coordinates == "tf_crop_and_resize" else None)
    with pytest.raises(UnsupportedModelError, match=match):
        check_resize(net)


# -- static shapes, also against onnxruntime-training's GradientGraphBuilder -----------
RESIZES = [
    ('mode = "nearest"', [1, 1, 2, 2]),
    ('mode = "nearest", coordinate_transformation_mode = "half_pixel", '
     'nearest_mode = "round_prefer_ceil"', [1, 1, 1.5, 2.5]),
    ('mode = "linear"', [1, 1, 2, 2]),
    ('mode = "linear", coordinate_transformation_mode = "align_corners"', [1, 1, 1.5, 2]),
    ('mode = "linear", coordinate_transformation_mode = "asymmetric"', [1, 1, 0.5, 3]),
    ('mode = "linear", coordinate_transformation_mode = "pytorch_half_pixel"', [1, 1, 2, 0.5]),
    ('mode = "cubic"', [1, 1, 2, 1.5]),
]


@pytest.mark.parametrize("attributes, scales", RESIZES)
def test_resize_gradient_is_the_adjoint_of_the_interpolation(rng, attributes, scales):
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    out = [int(np.floor(d * s)) for d, s in zip(x.shape, scales)]
    net = model(f"(float[2, 3, 4, 5] x) => (float[{dims(out)}] y)",
                f"s = Constant <value = float[4] {{{dims(scales)}}}> () "
                f"y = Resize <{attributes}> (x, , s)", opset=13)
    check_gradients(net, {"x": x}, ort="auto", rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_align_corners_downsampling_with_sizes(rng, mode):
    x = rng.normal(size=(1, 1, 4, 5)).astype(np.float32)
    net = model("(float[1, 1, 4, 5] x) => (float[1, 1, 2, 3] y)",
                ints("z", [1, 1, 2, 3]) + f'y = Resize <mode = "{mode}", '
                'coordinate_transformation_mode = "align_corners"> (x, , , z)', opset=13)
    check_gradients(net, {"x": x}, ort="auto", rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_gradient_with_sizes(rng, mode):
    x = rng.normal(size=(1, 2, 3, 4)).astype(np.float32)
    net = model("(float[1, 2, 3, 4] x) => (float[1, 2, 7, 2] y)",
                ints("z", [1, 2, 7, 2]) + f'y = Resize <mode = "{mode}"> (x, , , z)', opset=13)
    check_gradients(net, {"x": x}, ort="auto", rtol=1e-3, atol=1e-3)


def test_resize_gradient_with_axes_at_opset_18(rng):
    x = rng.normal(size=(2, 3, 4)).astype(np.float32)
    net = model("(float[2, 3, 4] x) => (float[2, 6, 8] y)",
                'c = Constant <value = float[2] {2, 2}> () '
                'y = Resize <mode = "linear", axes = [1, 2]> (x, , c)', opset=18)
    check_gradients(net, {"x": x}, ort="auto", rtol=1e-3, atol=1e-3)


# -- torch -------------------------------------------------------------------------------
#: (mode, align_corners, F.interpolate's size or scale_factor)
INTERPOLATIONS = [("nearest", None, {"scale_factor": 2}), ("nearest", None, {"size": (7, 4)}),
                  *((mode, corners, how) for mode in ("bilinear", "bicubic")
                    for corners in (False, True)
                    for how in ({"scale_factor": 2}, {"size": (7, 4)}))]


def _export(module, example, opset: int = 17) -> onnx.ModelProto:
    """torch's legacy (TorchScript) export, the batch and image axes free."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(module, (torch.from_numpy(example),), buffer, dynamo=False,
                          opset_version=opset, input_names=["x"], output_names=["y"],
                          do_constant_folding=False,
                          dynamic_axes={"x": {0: "N", 2: "H", 3: "W"},
                                        "y": {0: "N", 2: "H2", 3: "W2"}})
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.torch
@pytest.mark.parametrize("mode, align_corners, how", INTERPOLATIONS)
def test_resize_gradient_matches_torch_interpolate(mode, align_corners, how):
    """``F.interpolate`` exported with free batch and image axes: lossgraph's gradient at an
    image size other than the export's equals torch autograd's."""
    torch = pytest.importorskip("torch")

    class Interpolate(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, mode=mode, align_corners=align_corners,
                                                   **how)

    rng = np.random.default_rng(0)
    exported = _export(Interpolate(), rng.normal(size=(2, 2, 4, 6)).astype(np.float32))
    x = rng.normal(size=(3, 2, 5, 3)).astype(np.float32)
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    y = Interpolate()(tx)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float32).astype(np.float64))
     ).sum().backward()
    check_gradients(exported, {"x": x}, reference={"x": tx.grad.numpy()}, rtol=1e-4,
                    atol=1e-4, eps=0.5, ort=False)


@pytest.mark.torch
@pytest.mark.parametrize("upsampling", ["upsample_nearest", "upsample_bilinear",
                                        "interpolate_bicubic_size", "interpolate_align_corners"])
def test_upsampling_with_free_batch_and_image_sizes_trains_like_torch(upsampling):
    """A 1x1 Conv then ``nn.Upsample`` or ``F.interpolate``, exported with free batch and
    image axes at 4 x 6, trains on 5 x 3 images like torch.optim.SGD, step for step, on
    batches of 8, 5 and 3 rows."""
    torch = pytest.importorskip("torch")
    from support.torch_steps import assert_sgd_steps_like_torch

    from lossgraph.optim import SGD

    nn, F = torch.nn, torch.nn.functional

    class Upsampling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 1)
            self.upsample = {"upsample_nearest": nn.Upsample(scale_factor=2),
                             "upsample_bilinear": nn.Upsample(scale_factor=2, mode="bilinear"),
                             }.get(upsampling)

        def forward(self, x):
            h = self.conv(x)
            if self.upsample is not None:
                return self.upsample(h)
            if upsampling == "interpolate_bicubic_size":
                return F.interpolate(h, size=(7, 4), mode="bicubic", align_corners=False)
            return F.interpolate(h, size=(7, 4), mode="bilinear", align_corners=True)

    torch.manual_seed(0)
    net = Upsampling()
    rng = np.random.default_rng(0)
    exported = _export(net, rng.normal(size=(2, 2, 4, 6)).astype(np.float32))
    X = rng.normal(size=(16, 2, 5, 3)).astype(np.float32)
    with torch.no_grad():
        shape = net(torch.from_numpy(X)).shape
    y = rng.normal(size=tuple(shape)).astype(np.float32)
    program = lossgraph.compile_program(exported, weights=["conv.weight", "conv.bias"],
                                        optimizer=SGD(0.1))
    assert_sgd_steps_like_torch(lossgraph.Trainer(program), net, 0.1, X, y, rows=(8, 5, 3))
