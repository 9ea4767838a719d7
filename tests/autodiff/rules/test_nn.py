"""Gradients of convolutions, pooling and normalizations (lossgraph/autodiff/rules/nn.py).

onnxruntime's CPU Conv, ConvTranspose, AveragePool, Global*Pool and
InstanceNormalization have no double kernels: those are checked in float32 with the
harness's float tolerances (finite differences with eps=1e-2 on moderate values).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import has
from support.gradcheck import attributes_text, check_gradients, check_op, cotangent
from support.models import TEXT_TYPE, model, signature

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.target import use_target

F32 = np.float32




# --------------------------------------------------------------------------- Conv
CONV_CASES = [
    # (x shape, w shape, attrs)
    ((2, 3, 6, 5), (4, 3, 3, 2), {}),
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 9, 8), (3, 2, 2, 3), {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 2]}),
    ((2, 4, 6, 6), (6, 2, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    ((1, 6, 7, 5), (3, 2, 2, 2), {"group": 3, "strides": [2, 2]}),
    ((2, 4, 7, 7), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 6, 7), (3, 2, 2, 3), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((2, 2, 7, 6), (2, 2, 3, 2), {"auto_pad": "VALID", "strides": [2, 2]}),
    ((2, 3, 9), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((3, 4, 8), (2, 2, 2), {"group": 2, "strides": [3]}),
]


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("x_shape, w_shape, attrs", CONV_CASES)
def test_conv_gradients_for_strides_pads_dilations_groups(rng, x_shape, w_shape, attrs,
                                                          with_bias):
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5}
    if with_bias:
        feeds["b"] = rng.normal(size=w_shape[0]).astype(F32)
    # onnxruntime-training's ConvGrad ignores auto_pad SAME_* (finite differences agree
    # with lossgraph there, ConvGrad does not): compare with it only for explicit pads.
    same = attrs.get("auto_pad", "").startswith("SAME")
    grads = check_op("Conv", feeds, attrs, eps=1e-2, ort=False if same else True)
    assert set(grads) == set(feeds)


@pytest.mark.torch
@pytest.mark.parametrize("x_shape, w_shape, attrs",
                         [c for c in CONV_CASES if "auto_pad" not in c[2]])
def test_conv_gradients_match_torch(rng, x_shape, w_shape, attrs):
    import torch

    x = rng.normal(size=x_shape).astype(F32)
    w = rng.normal(size=w_shape).astype(F32) * 0.5
    n = len(x_shape) - 2
    pads = attrs.get("pads", [0] * 2 * n)
    # torch pads symmetrically: pad explicitly first
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    torch_pad = []
    for i in reversed(range(n)):
        torch_pad += [pads[i], pads[n + i]]
    conv = torch.nn.functional.conv2d if n == 2 else torch.nn.functional.conv1d
    y = conv(torch.nn.functional.pad(tx, torch_pad), tw, stride=attrs.get("strides", 1),
             dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
    (y * torch.from_numpy(cotangent(y.shape, F32))).sum().backward()
    check_op("Conv", {"x": x, "w": w}, attrs, eps=1e-2,
              reference={"x": tx.grad.numpy(), "w": tw.grad.numpy()})


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 4, 5), (3, 2, 3, 3), {}),
    ((1, 2, 3, 4), (2, 3, 3, 2), {"strides": [2, 1], "pads": [1, 0, 0, 1]}),
    ((2, 4, 3, 3), (4, 1, 2, 2), {"group": 2, "strides": [2, 2], "output_padding": [1, 0],
                                  "dilations": [1, 2]}),
    ((2, 3, 5), (3, 2, 3), {"strides": [2], "pads": [1, 1], "output_padding": [1]}),
])
def test_conv_transpose_gradients(rng, x_shape, w_shape, attrs):
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5,
             "b": rng.normal(size=w_shape[1] * attrs.get("group", 1)).astype(F32)}
    check_op("ConvTranspose", feeds, attrs, eps=1e-2)


def _op_with_free_dims(op: str, feeds, attrs, free: dict[str, list[int]], opset: int = 18):
    """The one-node model ``y = op<attrs>(feeds...)`` whose inputs leave the axes ``free``
    lists (per input) to the run time: shape inference sees symbols there."""
    def declared(name, value):
        dims = [f"{name}_d{a}" if a in free.get(name, []) else str(n)
                for a, n in enumerate(value.shape)]
        return f"{TEXT_TYPE[value.dtype]}[{', '.join(dims)}] {name}"

    first = next(iter(feeds.values()))
    outputs = ", ".join(f"y_d{a}" for a in range(first.ndim))
    signature_text = (f"({', '.join(declared(k, v) for k, v in feeds.items())}) => "
                      f"({TEXT_TYPE[first.dtype]}[{outputs}] y)")
    return model(signature_text, f"y = {op}{attributes_text(attrs)}({', '.join(feeds)})",
                 opset=opset)


def _torch_conv_transpose(x, w, b, strides, dilations, group, pads, output_padding):
    """torch's uncropped conv_transpose (output padding appended), cropped by ``pads``
    (an end pad below 0 appends zeros), plus the bias: ONNX's ConvTranspose."""
    import torch

    n = x.ndim - 2
    full = {1: torch.nn.functional.conv_transpose1d,
            2: torch.nn.functional.conv_transpose2d}[n](x, w, stride=strides, dilation=dilations,
                                                       groups=group)
    crop = []
    for i in reversed(range(n)):  # F.pad lists the last dim first; negative pads crop
        crop += [-pads[i], output_padding[i] - pads[n + i]]
    y = torch.nn.functional.pad(full, crop)
    return y if b is None else y + b.reshape(1, -1, *[1] * n)


# (x shape, w shape, attrs, the pads onnxruntime resolves them to)
CONV_TRANSPOSE_RESOLVED = [
    ((1, 2, 3, 4), (2, 3, 3, 4), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, [0, 1, 1, 1]),
    ((2, 2, 3, 3), (2, 2, 3, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 1],
                                  "dilations": [2, 1]}, [2, 1, 1, 0]),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}, [0, 0, 0, 0]),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [6, 8]}, [1, 1, 0, 0]),
    ((1, 2, 3, 4), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [5, 7]}, [1, 1, 1, 1]),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [8, 8]}, [0, 0, -1, -1]),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 3],
                                  "output_shape": [6, 8]}, [0, 0, 1, 1]),
    ((1, 4, 3, 3), (4, 1, 2, 2), {"auto_pad": "SAME_LOWER", "strides": [3, 2], "group": 2,
                                  "output_padding": [1, 1], "output_shape": [8, 6]},
     [1, 1, 0, 0]),
    ((2, 3, 4), (3, 2, 3), {"strides": [3], "output_padding": [2], "output_shape": [13]},
     [1, 0]),
    ((2, 3, 4), (3, 2, 3), {"strides": [3], "output_shape": [14]}, [0, -2]),
]


@pytest.mark.parametrize("x_shape, w_shape, attrs, pads", CONV_TRANSPOSE_RESOLVED)
def test_conv_transpose_with_auto_pad_or_output_shape(rng, x_shape, w_shape, attrs, pads):
    """auto_pad and output_shape resolved to the pads onnxruntime crops by (an end pad
    below 0: zeros appended past the full output); against finite differences, and where
    torch is installed its uncropped conv_transpose cropped so."""
    group = attrs.get("group", 1)
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5,
             "b": rng.normal(size=w_shape[1] * group).astype(F32)}
    reference = None
    if has("torch"):
        import torch

        n = len(x_shape) - 2
        tensors = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
        y = _torch_conv_transpose(tensors["x"], tensors["w"], tensors["b"],
                                  attrs.get("strides", [1] * n), attrs.get("dilations", [1] * n),
                                  group, pads, attrs.get("output_padding", [0] * n))
        (y * torch.from_numpy(cotangent(y.shape, F32))).sum().backward()
        reference = {k: t.grad.numpy() for k, t in tensors.items()}
    # onnxruntime-training's ConvTransposeGrad ignores auto_pad and output_shape
    check_op("ConvTranspose", feeds, attrs, eps=1e-2, ort=False, reference=reference)


@pytest.mark.parametrize("attrs, why", [
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2], "output_padding": [1, 1]}, "shapes differ"),
    ({"auto_pad": "SAME_LOWER", "strides": [3, 3]}, "shapes differ"),
    ({"strides": [2, 2], "output_shape": [6, 7]}, "a stride or more"),
])
def test_conv_transpose_where_runtimes_and_shape_inference_disagree_is_refused(rng, attrs, why):
    """auto_pad SAME: onnxruntime's output is the full one where that is not input size
    times stride; an output_shape a stride or more past the full output: onnxruntime 1.32
    rejects it, 1.19 scrambles the output."""
    feeds = {"x": rng.normal(size=(1, 2, 2, 2)).astype(F32),
             "w": rng.normal(size=(2, 2, 2, 2)).astype(F32)}
    net = _op_with_free_dims("ConvTranspose", feeds, attrs, {})
    with pytest.raises(UnsupportedModelError, match=why):
        lossgraph.gradient(net, weights=["x", "w"], outputs=["y"])


def test_conv_transpose_output_shape_needs_static_spatial_dims(rng):
    feeds = {"x": rng.normal(size=(1, 2, 3, 3)).astype(F32),
             "w": rng.normal(size=(2, 2, 3, 3)).astype(F32)}
    net = _op_with_free_dims("ConvTranspose", feeds, {"strides": [2, 2], "output_shape": [6, 6]},
                             {"x": [2, 3]})
    with pytest.raises(UnsupportedModelError, match="static spatial dims"):
        lossgraph.gradient(net, weights=["w"], outputs=["y"])


# the batch and spatial dims left to the run time
FREE_DIMS_CASES = [
    ("Conv", (2, 3, 7, 6), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ("Conv", (1, 4, 9, 8), (4, 2, 2, 3), {"strides": [2, 3], "dilations": [2, 1],
                                          "pads": [1, 1, 0, 2], "group": 2}),
    ("Conv", (2, 2, 7, 6), (3, 2, 3, 3), {"auto_pad": "SAME_LOWER"}),
    ("Conv", (2, 2, 7, 6), (3, 2, 3, 2), {"auto_pad": "VALID", "strides": [3, 2]}),
    ("ConvTranspose", (2, 4, 3, 4), (4, 1, 3, 3), {"strides": [2, 3], "pads": [1, 0, 0, 1],
                                                   "output_padding": [1, 2], "group": 2}),
    ("ConvTranspose", (1, 2, 3, 4), (2, 3, 3, 4), {"auto_pad": "SAME_UPPER",
                                                   "strides": [2, 2]}),
]


@pytest.mark.parametrize("free", [{"x": [0]}, {"x": [0, 2, 3]}], ids=["batch", "all"])
@pytest.mark.parametrize("op, x_shape, w_shape, attrs", FREE_DIMS_CASES)
def test_convolutions_with_dims_known_at_run_time_only(rng, op, x_shape, w_shape, attrs, free):
    """Batch and spatial dims left to the run time: the transposes are cut to x's size."""
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5}
    check_gradients(_op_with_free_dims(op, feeds, attrs, free), feeds, eps=1e-2, ort=False)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 2, 7, 6), (3, 2, 3, 3), {"strides": [2, 2]}),
    ((1, 4, 8, 9), (4, 2, 2, 4), {"strides": [3, 2], "group": 2}),  # no dilations with SAME
])
def test_conv_same_with_strides_on_dims_known_at_run_time(rng, auto_pad, x_shape, w_shape,
                                                         attrs):
    """auto_pad SAME with a stride above 1 pads by an amount that depends on the size:
    computed at run time, for each size fed (two here, one model)."""
    attrs = {**attrs, "auto_pad": auto_pad}
    feeds = {"x": rng.normal(size=x_shape).astype(F32),
             "w": rng.normal(size=w_shape).astype(F32) * 0.5,
             "b": rng.normal(size=w_shape[0]).astype(F32)}
    net = _op_with_free_dims("Conv", feeds, attrs, {"x": [0, 2, 3]})
    check_gradients(net, feeds, eps=1e-2, ort=False)
    shorter = {**feeds, "x": rng.normal(size=(*x_shape[:2], x_shape[2] - 1, x_shape[3] + 1)
                                        ).astype(F32)}
    check_gradients(net, shorter, eps=1e-2, ort=False,
                    reference=check_op("Conv", shorter, attrs, eps=1e-2, ort=False))


# ------------------------------------------------------------------------ pooling
def _distinct(rng, shape, dtype=F32):
    """Values far apart from each other (no ties, no near-ties for max)."""
    values = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1
    return (values - values.mean()).astype(dtype)


MAXPOOL_CASES = [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [1, 1]}, (1, 2, 5, 5), 18),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, (2, 2, 5, 4), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "strides": [1, 2]}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 7), 18),
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, (2, 2, 4, 4), 13),
    ({"kernel_shape": [2, 3], "strides": [2, 3]}, (1, 2, 5, 7), 15),
]


@pytest.mark.parametrize("dtype", [np.float64, F32])
@pytest.mark.parametrize("attrs, shape, opset", MAXPOOL_CASES)
def test_max_pool_routes_gradient_to_the_argmax(rng, attrs, shape, opset, dtype):
    x = _distinct(rng, shape, dtype)
    check_op("MaxPool", {"x": x}, attrs, opset=opset, eps=1e-2 if dtype == F32 else 1e-6)


def test_max_pool_with_overlapping_windows_needs_opset_16(rng):
    x = _distinct(rng, (1, 1, 4, 4))
    with pytest.raises(UnsupportedModelError, match="opset 16"):
        check_op("MaxPool", {"x": x}, {"kernel_shape": [3, 3]}, opset=15)


@pytest.mark.parametrize("attrs, shape, opset", [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [1, 2]}, (1, 2, 5, 6), 13),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, (2, 2, 5, 4), 18),
    ({"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1},
     (2, 2, 5, 4), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER",
      "count_include_pad": 1}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 1, 0, 1]}, (1, 2, 6, 6), 19),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 7), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, (1, 2, 7, 7), 18),
])
def test_average_pool_gradient_is_the_exact_adjoint(rng, attrs, shape, opset):
    x = rng.normal(size=shape).astype(F32)
    check_op("AveragePool", {"x": x}, attrs, opset=opset, eps=1e-2)


def _torch_pool_grads(op: str, x: np.ndarray, attrs) -> np.ndarray:
    """dL/dx of torch's avg_pool2d or max_pool2d (symmetric pads) for the cotangent."""
    import torch

    tx = torch.tensor(x, requires_grad=True)
    options = dict(kernel_size=attrs["kernel_shape"], stride=attrs["strides"],
                   padding=attrs.get("pads", [0] * 4)[:2], ceil_mode=bool(attrs["ceil_mode"]))
    if op == "AveragePool":
        y = torch.nn.functional.avg_pool2d(
            tx, count_include_pad=bool(attrs.get("count_include_pad", 0)), **options)
    else:
        y = torch.nn.functional.max_pool2d(tx, **options)
    (y * torch.from_numpy(cotangent(y.shape, x.dtype))).sum().backward()
    return tx.grad.numpy()


def _runs_specified_ceil_average() -> bool:
    import onnxruntime

    return tuple(int(p) for p in onnxruntime.__version__.split(".")[:2]) >= (1, 32)


AVERAGE_CEIL_CASES = [
    # (shape, attrs, whether onnxruntime 1.19 averages the last windows otherwise)
    ((1, 2, 6, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, False),
    ((2, 2, 6, 7), {"kernel_shape": [3, 2], "strides": [2, 2]}, False),
    ((1, 2, 6, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                    "count_include_pad": 1}, True),   # a window past the end pad
    ((2, 1, 7, 6), {"kernel_shape": [2, 3], "strides": [2, 2], "count_include_pad": 1}, True),
]


@pytest.mark.parametrize("shape, attrs, differs", AVERAGE_CEIL_CASES)
def test_average_pool_ceil_mode_averages_as_specified(rng, shape, attrs, differs):
    """ceil_mode's last windows are averaged over their taps inside x (count_include_pad=1:
    inside x and its pads), as the specification, torch and onnxruntime 1.32 do; where
    onnxruntime 1.19 averages them otherwise (count_include_pad=1: it divides by the whole
    kernel), only a target of newer runtimes gets a gradient. Against finite differences,
    and torch where installed."""
    attrs = {**attrs, "ceil_mode": 1}
    x = rng.normal(size=shape).astype(F32)
    expected = {"x": _torch_pool_grads("AveragePool", x, attrs)} if has("torch") else None
    if differs:
        with pytest.raises(UnsupportedModelError, match="target='onnxruntime-1.32'"):
            check_op("AveragePool", {"x": x}, attrs, eps=1e-2)
        if not _runs_specified_ceil_average():
            pytest.skip("onnxruntime 1.19 averages these windows otherwise: checked on 1.32")
        with use_target("onnxruntime-1.32"):
            check_op("AveragePool", {"x": x}, attrs, opset=21, eps=1e-2, reference=expected)
    else:
        check_op("AveragePool", {"x": x}, attrs, eps=1e-2, reference=expected)


@pytest.mark.parametrize("free", [{"x": [0]}, {"x": [0, 2, 3]}], ids=["batch", "all"])
@pytest.mark.parametrize("op, attrs", [
    ("AveragePool", {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 3], "pads": [1, 1, 0, 2],
                     "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 1]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                 "ceil_mode": 1}),
    ("LpPool", {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [0, 1, 1, 0], "p": 2}),
])
def test_pooling_with_dims_known_at_run_time_only(rng, op, attrs, free):
    """count_include_pad=0 with pads counts each window's taps at run time (a Conv of
    ones); the adjoint of the window sums is cut to x's size."""
    x = _distinct(rng, (2, 2, 7, 8))
    check_gradients(_op_with_free_dims(op, {"x": x}, attrs, free, opset=19), {"x": x},
                    eps=1e-2, ort=False)


def test_average_pool_with_a_ceil_mode_window_starting_in_the_end_pad_is_refused(rng):
    """Shape inference before opset 22 and onnxruntime 1.19 keep that window, onnxruntime
    1.32 and torch drop it."""
    x = rng.normal(size=(1, 2, 5, 5)).astype(F32)
    net = _op_with_free_dims("AveragePool", {"x": x}, {"kernel_shape": [2, 2], "strides": [3, 3],
                                                       "pads": [1, 1, 1, 1], "ceil_mode": 1}, {})
    with pytest.raises(UnsupportedModelError, match="starts in the end pad"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


@pytest.mark.parametrize("free", [{"x": [0]}, {"x": [0, 2, 3]}], ids=["batch", "all"])
def test_average_pool_ceil_mode_needs_static_spatial_dims(rng, free):
    """Which windows run past x depends on its size: a dynamic batch is fine."""
    x = rng.normal(size=(2, 2, 7, 8)).astype(F32)
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}
    net = _op_with_free_dims("AveragePool", {"x": x}, attrs, free)
    if free["x"] == [0]:
        check_gradients(net, {"x": x}, eps=1e-2, ort=False)
    else:
        with pytest.raises(UnsupportedModelError, match="static spatial dims"):
            lossgraph.gradient(net, weights=["x"], outputs=["y"])


@pytest.mark.torch
@pytest.mark.parametrize("shape, attrs", [
    ((1, 2, 6, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 2, 7, 6), {"kernel_shape": [2, 3], "strides": [2, 2]}),
])
def test_max_pool_ceil_mode_matches_torch(rng, shape, attrs):
    attrs = {**attrs, "ceil_mode": 1}
    x = _distinct(rng, shape)
    check_op("MaxPool", {"x": x}, attrs, eps=1e-2,
             reference={"x": _torch_pool_grads("MaxPool", x, attrs)})


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 7), (1, 2, 2, 3, 2)])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pools(rng, op, shape):
    x = _distinct(rng, shape)
    check_op(op, {"x": x}, {}, eps=1e-2, ort=True if op == "GlobalAveragePool" else "auto")


# ----------------------------------------------------------------- normalizations
def _bn_feeds(rng, shape):
    c = shape[1]
    return {"x": rng.normal(size=shape), "scale": rng.normal(size=c),
            "b": rng.normal(size=c), "mean": rng.normal(size=c) * 0.3,
            "var": rng.uniform(0.5, 1.5, size=c)}


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (2, 3, 2, 4)])
@pytest.mark.parametrize("opset", [13, 15, 18])
def test_batch_normalization_inference(rng, shape, opset):
    c = shape[1]
    feeds = _bn_feeds(rng, shape)
    grads = check_op("BatchNormalization", feeds, {"epsilon": 1e-3}, opset=opset)
    inv = 1 / np.sqrt(feeds["var"] + 1e-3)
    r = cotangent(shape, np.float64)
    axes = tuple(i for i in range(len(shape)) if i != 1)
    per_channel = (c,) + (1,) * (len(shape) - 2)
    xhat = (feeds["x"] - feeds["mean"].reshape(per_channel)) * inv.reshape(per_channel)
    np.testing.assert_allclose(grads["scale"], (r * xhat).sum(axis=axes), rtol=1e-9)
    # the statistics: y = scale (x - mean) inv + b
    np.testing.assert_allclose(grads["mean"], -r.sum(axis=axes) * feeds["scale"] * inv,
                               rtol=1e-9)
    np.testing.assert_allclose(grads["var"], -0.5 * (r * xhat).sum(axis=axes)
                               * feeds["scale"] * inv**2, rtol=1e-9)


@pytest.mark.parametrize("output", ["y", "rm", "rv"])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 2, 3)])
def test_batch_normalization_training_mode_uses_batch_statistics(rng, shape, output):
    """y uses the batch statistics; the running statistics rm = 0.8 mean + 0.2 mu and
    rv = 0.8 var + 0.2 s^2 (biased) carry gradients to x, mean and var."""
    feeds = _bn_feeds(rng, shape)
    body = ("y, rm, rv = BatchNormalization<training_mode=1, epsilon=1e-3, momentum=0.8>"
            "(x, scale, b, mean, var)")
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"double[{dims}] y, double[c] rm, double[c] rv"), body, opset=15)
    grads = check_gradients(net, feeds, output=output)
    r = cotangent((shape[1],), np.float64)
    if output == "rm":
        momentum = float(np.float32(0.8))  # a float attribute
        np.testing.assert_allclose(grads["mean"], momentum * r, rtol=1e-12)
    if output == "y":
        np.testing.assert_array_equal(grads["mean"], np.zeros(shape[1]))


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 2, 3, 4), (1, 3, 4)])
def test_instance_normalization(rng, shape):
    c = shape[1]
    feeds = {"x": rng.normal(size=shape).astype(F32),
             "scale": rng.normal(size=c).astype(F32), "b": rng.normal(size=c).astype(F32)}
    check_op("InstanceNormalization", feeds, {"epsilon": 1e-2}, eps=1e-2, rtol=5e-3,
              atol=5e-3)


@pytest.mark.parametrize("shape, axis, scale_shape, with_bias", [
    ((3, 4), -1, (4,), True),
    ((2, 3, 4), -1, (4,), False),
    ((2, 3, 4), 1, (3, 4), True),
    ((2, 3, 4), -2, (1, 3, 4), True),
    ((2, 3, 4), -1, (1, 4), True),
    ((2, 3, 2, 2), 2, (2, 2), True),
    ((3, 5), 0, (3, 5), True),
])
def test_layer_normalization(rng, shape, axis, scale_shape, with_bias):
    feeds = {"x": rng.normal(size=shape), "scale": rng.normal(size=scale_shape)}
    if with_bias:
        feeds["b"] = rng.normal(size=scale_shape)
    check_op("LayerNormalization", feeds, {"axis": axis, "epsilon": 1e-3}, opset=17)


@pytest.mark.parametrize("output", ["mean", "inv_std"])
@pytest.mark.parametrize("shape, axis", [((3, 4), -1), ((2, 3, 4), 1), ((2, 3, 2, 2), 2)])
def test_layer_normalization_statistics_outputs(rng, shape, axis, output):
    """Mean and InvStdDev = (var + eps)^-1/2 over axes [axis, rank), as gradients to x.

    float32: onnxruntime 1.19 has no LayerNormalization with double statistics."""
    scale_shape = shape[axis:]
    feeds = {"x": rng.normal(size=shape).astype(F32),
             "scale": rng.normal(size=scale_shape).astype(F32),
             "b": rng.normal(size=scale_shape).astype(F32)}
    body = f"y, mean, inv_std = LayerNormalization<axis={axis}, epsilon=1e-1>(x, scale, b)"
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    stats = ",".join(f"s{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"float[{dims}] y, float[{stats}] mean, float[{stats}] inv_std"),
                body, opset=17)
    grads = check_gradients(net, feeds, output=output, eps=1e-2, rtol=5e-3, atol=5e-3)
    axes = tuple(range(axis % len(shape), len(shape)))
    r = cotangent(np.mean(feeds["x"], axis=axes, keepdims=True).shape, F32)
    n = np.prod([shape[a] for a in axes])
    if output == "mean":
        np.testing.assert_allclose(grads["x"], np.broadcast_to(r / n, shape), rtol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("shape, axis", [((3, 4), -1), ((2, 3, 4), 1), ((2, 3, 2, 2), 2)])
def test_layer_normalization_statistics_read_downstream_match_torch(rng, shape, axis):
    """z = y InvStdDev + Mean: the gradients through all three outputs at once, against
    finite differences and torch's autograd of the explicit statistics."""
    import torch

    scale_shape = shape[axis:]
    feeds = {"x": rng.normal(size=shape).astype(F32),
             "scale": rng.normal(size=scale_shape).astype(F32),
             "b": rng.normal(size=scale_shape).astype(F32)}
    body = (f"y, mean, inv_std = LayerNormalization<axis={axis}, epsilon=1e-1>(x, scale, b)\n"
            "scaled = Mul(y, inv_std)\n z = Add(scaled, mean)")
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"float[{dims}] z"), body, opset=17)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    axes = tuple(range(axis % len(shape), len(shape)))
    mean = t["x"].mean(dim=axes, keepdim=True)
    inv = ((t["x"] - mean).pow(2).mean(dim=axes, keepdim=True) + 0.1).rsqrt()
    z = ((t["x"] - mean) * inv * t["scale"] + t["b"]) * inv + mean
    (z * torch.from_numpy(cotangent(shape, F32))).sum().backward()
    # onnxruntime-training's LayerNormalizationGrad drops the statistics' gradients
    check_gradients(net, feeds, eps=1e-2, rtol=5e-3, atol=5e-3, ort=False,
                    reference={k: v.grad.numpy() for k, v in t.items()})


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 2, 3)])
def test_batch_normalization_running_statistics_read_downstream_match_torch(rng, shape):
    """z = y running_var' + running_mean' (training mode, the new running statistics
    m stat + (1 - m) batch stat, the variance biased as in ONNX): gradients to x, scale,
    B and the running statistics, against finite differences and torch's autograd of the
    formula."""
    import torch

    feeds = _bn_feeds(rng, shape)
    spatial = list(range(1, len(shape) - 1))  # the statistics (C,) as (C, 1, ..., 1)
    axes = f"axes = Constant<value = int64[{len(spatial)}] {{{', '.join(map(str, spatial))}}}>()"
    spread = "rm_c = Unsqueeze(rm, axes)\n rv_c = Unsqueeze(rv, axes)" if spatial \
        else "rm_c = Identity(rm)\n rv_c = Identity(rv)"
    body = (f"{axes}\n y, rm, rv = BatchNormalization<training_mode=1, epsilon=1e-3, "
            f"momentum=0.8>(x, scale, b, mean, var)\n {spread}\n"
            " scaled = Mul(y, rv_c)\n z = Add(scaled, rm_c)")
    dims = ",".join(f"d{i}" for i in range(len(shape)))
    net = model(signature(feeds, f"double[{dims}] z"), body, opset=15)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    axes = [0, *range(2, len(shape))]
    view = (1, shape[1], *[1] * (len(shape) - 2))
    mu = t["x"].mean(dim=axes, keepdim=True)
    s2 = (t["x"] - mu).pow(2).mean(dim=axes, keepdim=True)
    y = (t["x"] - mu) / (s2 + 1e-3).sqrt() * t["scale"].reshape(view) + t["b"].reshape(view)
    m = float(np.float32(0.8))  # a float attribute
    rm = m * t["mean"].reshape(view) + (1 - m) * mu
    rv = m * t["var"].reshape(view) + (1 - m) * s2
    (((y * rv + rm) * torch.from_numpy(cotangent(shape, np.float64))).sum()).backward()
    check_gradients(net, feeds, reference={k: v.grad.numpy() for k, v in t.items()})


@pytest.mark.parametrize("shape, groups", [((2, 4, 3), 2), ((2, 6, 2, 2), 3), ((1, 4, 5), 4),
                                           ((2, 3, 4), 1)])
def test_group_normalization_with_per_channel_scale(rng, shape, groups):
    feeds = {"x": rng.normal(size=shape), "scale": rng.normal(size=shape[1]),
             "b": rng.normal(size=shape[1])}
    # stash_type=11: statistics in double (the default stashes them in float32)
    check_op("GroupNormalization", feeds, {"num_groups": groups, "epsilon": 1e-3,
                                            "stash_type": 11}, opset=21)


def test_group_normalization_with_dims_known_at_run_time(rng):
    feeds = {"x": rng.normal(size=(2, 6, 3, 2)), "scale": rng.normal(size=6),
             "b": rng.normal(size=6)}
    attrs = {"num_groups": 3, "epsilon": 1e-3, "stash_type": 11}
    check_gradients(_op_with_free_dims("GroupNormalization", feeds, attrs, {"x": [0, 2, 3]},
                                       opset=21), feeds)


def test_group_normalization_in_float32_with_default_stash_type(rng):
    feeds = {"x": rng.normal(size=(2, 6, 4)).astype(F32),
             "scale": rng.normal(size=6).astype(F32), "b": rng.normal(size=6).astype(F32)}
    check_op("GroupNormalization", feeds, {"num_groups": 3, "epsilon": 1e-2}, opset=21,
              eps=1e-2, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape, axis", [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1)])
def test_lp_normalization(rng, shape, axis, p):
    x = rng.uniform(0.2, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    check_op("LpNormalization", {"x": x}, {"axis": axis, "p": p})


# ------------------------------------------------------------------ golden CNN
@pytest.mark.torch
def test_golden_cnn_weight_gradients_match_torch():
    import recipes
    import torch
    from support.environment import GOLDEN_MODELS

    model = onnx.load(str(GOLDEN_MODELS / "torch_cnn.onnx"))
    with_loss = lossgraph.add_loss_output(model, "multiclass_log_loss", from_logits=True)
    graph = lossgraph.gradient(with_loss)
    X, y, _, _ = recipes.dataset("torch_cnn")
    X, y = X[:16], y[:16]

    import onnxruntime

    session = onnxruntime.InferenceSession(graph.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    feeds = {i.name: None for i in session.get_inputs()}
    label = next(n for n in feeds if n != "input")
    outputs = [o.name for o in session.get_outputs()]
    result = dict(zip(outputs, session.run(None, {"input": X, label: y})))

    net = recipes.fit_estimator("torch_cnn")
    logits = net(torch.from_numpy(X))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(result[outputs[0]], loss.item(), rtol=1e-5)
    expected = dict(net.named_parameters())
    names = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    for name in names:
        np.testing.assert_allclose(result[f"{name}_grad"], expected[name].grad.numpy(),
                                   rtol=1e-4, atol=1e-6, err_msg=name)
