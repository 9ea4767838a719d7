"""Gradients of convolutions, pooling and normalizations (lossgraph/autodiff/rules/nn.py).

onnxruntime's CPU Conv, ConvTranspose, AveragePool, Global*Pool, InstanceNormalization,
LpPool and LRN have no double kernels: those are checked in float32 with the harness's float
tolerances (finite differences with eps=1e-2 on moderate values), and against torch.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from support.environment import has
from support.gradcheck import attributes_text, check_gradients, check_op, cotangent, loss_model
from support.models import TEXT_TYPE, model, signature

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.runtime.session import create_session
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


# ------------------------------------------------------ against the reference evaluator
def vjp_against_the_reference(net, x: np.ndarray, forward=None, eps: float = 1e-6,
                              rtol: float = 1e-6, atol: float = 1e-8) -> np.ndarray:
    """lossgraph's gradient of sum(y R) with respect to ``x`` (the model's one input),
    run in onnxruntime without the forward node, against central differences of
    ``forward`` (default: the ONNX reference implementation): for attribute values
    onnxruntime's own kernel refuses (LRN: even sizes, ranks other than 4) or types it
    lacks (double)."""
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    seed, grad = graph.graph.input[1].name, graph.graph.output[-1].name
    kept = [n for n in graph.graph.node if n.op_type != net.graph.node[-1].op_type]
    pruned = helper.make_model(
        helper.make_graph(kept, "vjp", list(graph.graph.input), [graph.graph.output[-1]],
                          list(graph.graph.initializer)),
        opset_imports=list(graph.opset_import), ir_version=graph.ir_version)
    if forward is None:
        evaluator = ReferenceEvaluator(net)

        def forward(value):
            return evaluator.run(None, {"x": value})[0]

    r = cotangent(forward(x).shape, x.dtype)
    got = create_session(pruned).run([grad], {"x": x, seed: r})[0]

    def loss(value):
        return float(np.sum(forward(value) * r))

    numeric = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = (loss(plus) - loss(minus)) / (2 * eps)
    np.testing.assert_allclose(got, numeric, rtol=rtol, atol=atol)
    return got


def _away_from_zero(rng, shape):
    """Values with |x| in [0.5, 1.5]: the norms' slopes are smooth over the FD step."""
    return (rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1, 1], size=shape)).astype(F32)


# ------------------------------------------------------------------------- LpPool
LPPOOL_CASES = [
    ({"kernel_shape": [2, 2]}, (2, 3, 4, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 1], "p": 3}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [2, 3], "pads": [1, 0, 1, 2], "p": 1}, (1, 2, 5, 4), 18),
    ({"kernel_shape": [2, 2], "dilations": [2, 1], "pads": [1, 1, 0, 1]}, (1, 2, 6, 6), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, (1, 2, 6, 5), 18),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER", "p": 4},
     (1, 1, 5, 6), 18),
    ({"kernel_shape": [3], "strides": [2], "ceil_mode": 1}, (2, 2, 6), 18),  # partial window
    ({"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 0, 0, 0]},
     (1, 2, 6, 5), 18),
    ({"kernel_shape": [2], "strides": [3]}, (1, 2, 7), 13),  # the last element in no window
    ({"kernel_shape": [2, 2, 2]}, (1, 1, 3, 3, 4), 13),
]


@pytest.mark.parametrize("attrs, shape, opset", LPPOOL_CASES)
def test_lp_pool_gradient(rng, attrs, shape, opset):
    x = _away_from_zero(rng, shape)
    check_op("LpPool", {"x": x}, attrs, opset=opset, eps=1e-2)


def test_lp_pool_gradient_is_zero_not_nan_where_a_window_is_zero(rng):
    x = _away_from_zero(rng, (1, 1, 4, 4))
    x[0, 0, :2, :2] = 0  # the first window's norm is 0
    grads = check_op("LpPool", {"x": x}, {"kernel_shape": [2, 2], "strides": [2, 2]},
                      eps=1e-2)
    assert np.all(np.isfinite(grads["x"]))
    np.testing.assert_array_equal(grads["x"][0, 0, :2, :2], 0)


@pytest.mark.torch
@pytest.mark.parametrize("p, kernel, stride", [(2, 2, 2), (3, 3, 1), (1, 2, 1)])
def test_lp_pool_gradient_matches_torch(rng, p, kernel, stride):
    """torch's lp_pool2d is (sum x^p)^(1/p), without |x|: compared on positive inputs."""
    import torch

    x = np.abs(_away_from_zero(rng, (2, 3, 6, 6)))
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.nn.functional.lp_pool2d(tx, p, kernel, stride)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_op("LpPool", {"x": x}, {"kernel_shape": [kernel] * 2, "strides": [stride] * 2,
                                   "p": p}, eps=1e-2,
              reference={"x": tx.grad.numpy().astype(F32)})


# ---------------------------------------------------------------------------- LRN
LRN_CASES = [
    ({"size": 3}, (2, 5, 3, 2)),
    ({"size": 5, "alpha": 0.3, "beta": 1.2, "bias": 2.0}, (2, 6, 2, 2)),
    ({"size": 7, "alpha": 1.0, "beta": 0.75}, (1, 3, 2, 2)),  # window wider than C
]


@pytest.mark.parametrize("attrs, shape", LRN_CASES)
def test_lrn_gradient(rng, attrs, shape):
    x = rng.normal(size=shape).astype(F32)
    check_op("LRN", {"x": x}, attrs, eps=1e-2)


def _lrn(x: np.ndarray, size: int, alpha: float = 1e-4, beta: float = 0.75,
         bias: float = 1.0) -> np.ndarray:
    """LRN as the specification writes it, for any rank."""
    channels = x.shape[1]
    square_sum = np.zeros_like(x)
    for c in range(channels):
        low, high = max(0, c - (size - 1) // 2), min(channels - 1, c + -(-(size - 1) // 2))
        square_sum[:, c] = np.sum(x[:, low:high + 1] ** 2, axis=1)
    return x / (bias + alpha / size * square_sum) ** beta


@pytest.mark.parametrize("attrs, shape", [
    ({"size": 2, "alpha": 0.5, "beta": 0.6, "bias": 1.5}, (2, 4, 3, 2)),  # window c..c+1
    ({"size": 4, "alpha": 1.0, "beta": 0.75}, (1, 5, 2, 3)),               # c-1..c+2
    ({"size": 4, "alpha": 1.0, "beta": 0.75}, (1, 3, 2, 2, 2)),            # 5-D
    ({"size": 3, "alpha": 0.2}, (3, 4)),                                   # 2-D
    ({"size": 2, "alpha": 0.7, "bias": 0.5}, (2, 3, 4)),                   # 3-D
])
def test_lrn_gradient_for_even_sizes_and_other_ranks(rng, attrs, shape):
    """onnxruntime's LRN takes odd sizes and 4-D inputs only, and the ONNX reference
    implementation (onnx 1.23) loops over the batch instead of the channels: checked
    against the specification's formula (itself checked against onnxruntime's kernel)."""
    x = rng.normal(size=shape)
    dims = ", ".join(str(d) for d in shape)
    net = model(f"(double[{dims}] x) => (double[{dims}] y)",
                f"y = LRN {attributes_text(attrs)} (x)", opset=13)
    vjp_against_the_reference(net, x, lambda v: _lrn(v, **attrs))


def test_the_lrn_formula_of_these_tests_is_onnxruntimes(rng):
    x = rng.normal(size=(2, 5, 3, 2)).astype(F32)
    net = model("(float[2, 5, 3, 2] x) => (float[2, 5, 3, 2] y)",
                "y = LRN <size = 3, alpha = 0.5, beta = 0.6, bias = 1.5> (x)", opset=13)
    np.testing.assert_allclose(create_session(net).run(None, {"x": x})[0],
                               _lrn(x.astype(np.float64), 3, 0.5, 0.6, 1.5), rtol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("size", [3, 5])
def test_lrn_gradient_matches_torch(rng, size):
    import torch

    x = rng.normal(size=(2, 6, 3, 3)).astype(F32)
    attrs = {"size": size, "alpha": 0.4, "beta": 0.8, "bias": 1.3}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = torch.nn.functional.local_response_norm(tx, size, alpha=0.4, beta=0.8, k=1.3)
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    check_op("LRN", {"x": x}, attrs, eps=1e-2, reference={"x": tx.grad.numpy().astype(F32)})


# ---------------------------------------------------------------------- MaxUnpool
def _max_unpool_model(x_shape, i_value: np.ndarray | None, attrs: dict, out_shape,
                      opset: int = 18):
    dims = ", ".join(str(d) for d in x_shape)
    out = ", ".join(str(d) for d in out_shape)
    if i_value is None:  # the indices computed at run time, by a MaxPool
        return model(f"(float[{dims}] x, float[{out}] z) => (float[{out}] y)",
                     f"p, i = MaxPool {attributes_text(attrs)} (z)\n"
                     f"y = MaxUnpool {attributes_text(attrs)} (x, i)",
                     opset=opset)
    values = ", ".join(str(int(v)) for v in i_value.reshape(-1))
    return model(f"(float[{dims}] x) => (float[{out}] y)",
                 f"i = Constant <value = int64[{dims}] {{{values}}}> ()\n"
                 f"y = MaxUnpool {attributes_text(attrs)} (x, i)", opset=opset)


def test_max_unpool_gradient_gathers_dy_at_the_indices(rng):
    x = rng.normal(size=(1, 2, 2, 2)).astype(F32)
    i = np.array([0, 3, 9, 14, 16, 22, 25, 31]).reshape(1, 2, 2, 2)
    net = _max_unpool_model(x.shape, i, {"kernel_shape": [2, 2], "strides": [2, 2]},
                            (1, 2, 4, 4))
    r = cotangent((1, 2, 4, 4), F32)
    grads = check_gradients(net, {"x": x}, eps=1e-2)
    np.testing.assert_allclose(grads["x"].reshape(-1), r.reshape(-1)[i.reshape(-1)])


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_with_repeated_indices_routes_dy_to_the_surviving_write(rng, opset):
    """Overlapping MaxPool windows repeat an index; the last write survives, and only it
    gets the gradient (finite differences agree: the others do not reach y)."""
    x = rng.normal(size=(1, 1, 2, 2)).astype(F32)
    i = np.array([5, 5, 9, 5]).reshape(1, 1, 2, 2)
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1]}
    net = _max_unpool_model(x.shape, i, attrs, (1, 1, 4, 4), opset=opset)
    grads = check_gradients(net, {"x": x}, eps=1e-2)
    assert grads["x"][0, 0, 0, 0] == grads["x"][0, 0, 0, 1] == 0


@pytest.mark.parametrize("opset", [13, 18])
def test_max_unpool_after_a_max_pool_with_overlapping_windows(rng, opset):
    z = rng.permutation(36).reshape(1, 1, 6, 6).astype(F32)  # distinct: no ties
    attrs = {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}
    net = _max_unpool_model((1, 1, 6, 6), None, attrs, (1, 1, 6, 6), opset=opset)
    check_gradients(net, {"x": rng.normal(size=(1, 1, 6, 6)).astype(F32), "z": z}, wrt=["x"],
                    eps=1e-2)


def test_max_unpool_with_a_larger_output_shape_is_a_named_error():
    net = model("(float[1, 1, 2, 2] x) => (float[1, 1, 5, 5] y)",
                "i = Constant <value = int64[1, 1, 2, 2] {5, 7, 13, 15}> ()\n"
                "s = Constant <value = int64[4] {1, 1, 5, 5}> ()\n"
                "y = MaxUnpool <kernel_shape = [2, 2], strides = [2, 2]> (x, i, s)", opset=18)
    with pytest.raises(UnsupportedModelError, match="output_shape"):
        lossgraph.gradient(net, weights=["x"], outputs=["y"])


# ------------------------------------------------------------------------- Col2Im
COL2IM_CASES = [  # image, block, attrs, channels
    ([5, 5], [2, 2], {}, 1),
    ([5, 5], [2, 3], {"strides": [2, 1]}, 2),
    ([4, 5], [2, 2], {"pads": [1, 0, 1, 2]}, 2),
    ([6, 6], [2, 2], {"dilations": [2, 2], "strides": [2, 1]}, 1),
    ([3, 3, 2], [2, 2, 1], {"pads": [0, 1, 0, 1, 0, 1]}, 1),
    ([7], [3], {"strides": [2], "pads": [1, 1]}, 3),
]


def _col2im_model(x_shape, channels: int, image, block, attrs, kind: str = "float"):
    n = len(image)
    img = ", ".join(str(d) for d in image)
    blk = ", ".join(str(d) for d in block)
    return model(f"({kind}[{', '.join(str(d) for d in x_shape)}] x) => "
                 f"({kind}[{x_shape[0]}, {channels}, {img}] y)",
                 f"i = Constant <value = int64[{n}] {{{img}}}> ()\n"
                 f"b = Constant <value = int64[{n}] {{{blk}}}> ()\n"
                 f"y = Col2Im {attributes_text(attrs)} (x, i, b)", opset=18)


def _col2im_input_shape(channels: int, image, block, attrs) -> tuple[int, int, int]:
    n = len(image)
    pads = attrs.get("pads", [0] * 2 * n)
    dilations, strides = attrs.get("dilations", [1] * n), attrs.get("strides", [1] * n)
    counts = [(image[i] + pads[i] + pads[n + i] - dilations[i] * (block[i] - 1) - 1)
              // strides[i] + 1 for i in range(n)]
    return 2, channels * int(np.prod(block)), int(np.prod(counts))


@pytest.mark.parametrize("image, block, attrs, channels", COL2IM_CASES)
def test_col2im_gradient_is_the_unfold_of_dy(rng, image, block, attrs, channels):
    """Against onnxruntime in 2-D, and the ONNX reference implementation (in float64) in
    1-D and 3-D, where onnxruntime's Col2Im (1.19 and 1.3x) mishandles pads and strides."""
    shape = _col2im_input_shape(channels, image, block, attrs)
    x = rng.normal(size=shape)
    if len(image) != 2:
        model_64 = _col2im_model(shape, channels, image, block, attrs, "double")
        vjp_against_the_reference(model_64, x)
        return
    check_gradients(_col2im_model(shape, channels, image, block, attrs), {"x": x.astype(F32)},
                    eps=1e-2)


@pytest.mark.torch
@pytest.mark.parametrize("image, block, attrs, channels",
                         [c for c in COL2IM_CASES if len(c[0]) == 2])
def test_col2im_gradient_matches_torch_unfold(rng, image, block, attrs, channels):
    import torch

    shape = _col2im_input_shape(channels, image, block, attrs)
    x = rng.normal(size=shape).astype(F32)
    tx = torch.tensor(x, requires_grad=True)
    pads = attrs.get("pads", [0, 0, 0, 0])
    padded = [d + pads[i] + pads[2 + i] for i, d in enumerate(image)]
    y = torch.nn.functional.fold(tx, padded, block, dilation=attrs.get("dilations", 1),
                                 stride=attrs.get("strides", 1))
    y = y[:, :, pads[0]:pads[0] + image[0], pads[1]:pads[1] + image[1]]  # the image proper
    (y * torch.from_numpy(cotangent(tuple(y.shape), F32))).sum().backward()
    check_gradients(_col2im_model(shape, channels, image, block, attrs), {"x": x}, eps=1e-2,
                    reference={"x": tx.grad.numpy()})


# -------------------------------------------------------------------- MaxPool, tiled
# The gradient of windows that tile their input, in the form chosen for onnxruntime's speed
# (docs/benchmarks.md): the same numbers as the plain form; ties, zeros, denormals and
# infinities included.
def _one_op_model(op: str, x: np.ndarray, attrs, free_batch: bool = False, opset: int = 17
                  ) -> onnx.ModelProto:
    """``y = op<attrs>(x)``, the batch axis of x free when ``free_batch``."""
    dims = ["N" if free_batch and a == 0 else str(d) for a, d in enumerate(x.shape)]
    outputs = ", ".join(f"y{a}" for a in range(x.ndim))
    kind = TEXT_TYPE[x.dtype]
    return model(f"({kind}[{', '.join(dims)}] x) => ({kind}[{outputs}] y)",
                 f"y = {op}{attributes_text(attrs)}(x)", opset=opset)


def _x_gradient(net: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, onnx.ModelProto]:
    """lossgraph's gradient of ``sum(y * R)`` with respect to x (gradcheck's cotangent R),
    and the gradient graph."""
    graph = lossgraph.gradient(loss_model(net, {"x": x}), weights=["x"],
                               loss_name="gradcheck_loss")
    (dx,) = create_session(graph).run(["x_grad"], {"x": x})
    return dx, graph


def _tiled_max_pool_grad(x: np.ndarray, kernel: list[int], dy: np.ndarray) -> np.ndarray:
    """numpy: each window's ``dy`` to its first maximum in row-major order (torch's and
    onnxruntime's choice among ties); the remainder of an axis past the last window gets 0."""
    n = len(kernel)
    counts = [s // k for s, k in zip(x.shape[2:], kernel)]
    dx = np.zeros_like(x)
    for window in np.ndindex(*x.shape[:2], *counts):
        lead, place = window[:2], window[2:]
        region = tuple(slice(p * k, (p + 1) * k) for p, k in zip(place, kernel))
        values = x[(*lead, *region)]
        first = np.unravel_index(int(np.argmax(values.reshape(-1))), values.shape)
        target = tuple(p * k + f for p, k, f in zip(place, kernel, first))
        dx[(*lead, *target)] = dy[window]
        assert n == len(first)
    return dx


def _with_ties(rng, shape, dtype=F32) -> np.ndarray:
    """Values on a coarse grid (many equal maxima in a window), a constant block, zeros as
    after a ReLU."""
    x = np.maximum(np.round(rng.normal(size=shape) * 2) / 2, 0).astype(dtype)
    x[:, :, :3] = 1.5
    return x


TILED = [
    ((2, 3, 8, 6), [2, 2]),
    ((2, 2, 7, 8), [2, 3]),        # remainders in no window
    ((3, 4, 9), [3]),
    ((1, 2, 4, 6, 4), [2, 3, 2]),
]


@pytest.mark.parametrize("dtype", [F32, np.float64])
@pytest.mark.parametrize("shape, kernel", TILED)
@pytest.mark.parametrize("free_batch", [False, True], ids=["static", "free_batch"])
def test_tiled_max_pool_gradient_goes_to_the_first_maximum_of_each_window(
        rng, shape, kernel, free_batch, dtype):
    x = _with_ties(rng, shape, dtype)
    net = _one_op_model("MaxPool", x, {"kernel_shape": kernel, "strides": kernel}, free_batch)
    dx, graph = _x_gradient(net, x)
    assert "ArgMax" in {n.op_type for n in graph.graph.node}
    assert not [n for n in graph.graph.node if n.op_type == "MaxPool" and len(n.output) > 1]
    dy = cotangent([*shape[:2], *(s // k for s, k in zip(shape[2:], kernel))], dtype)
    np.testing.assert_array_equal(dx, _tiled_max_pool_grad(x, kernel, dy))


@pytest.mark.torch
@pytest.mark.parametrize("shape, kernel", TILED)
def test_tiled_max_pool_gradient_equals_torch_with_ties(rng, shape, kernel):
    import torch

    x = _with_ties(rng, shape)
    pool = {1: torch.nn.functional.max_pool1d, 2: torch.nn.functional.max_pool2d,
            3: torch.nn.functional.max_pool3d}[len(kernel)]
    tx = torch.tensor(x, requires_grad=True)
    y = pool(tx, kernel_size=kernel, stride=kernel)
    (y * torch.from_numpy(cotangent(y.shape, F32))).sum().backward()
    dx, _ = _x_gradient(_one_op_model("MaxPool", x, {"kernel_shape": kernel, "strides": kernel}), x)
    np.testing.assert_array_equal(dx, tx.grad.numpy())


def test_tiled_max_pool_gradient_reuses_the_nodes_indices(rng):
    """A MaxPool that outputs its Indices scatters through them: no ArgMax."""
    x = _with_ties(rng, (2, 3, 6, 4))
    net = model("(float[2, 3, 6, 4] x) => (float[2, 3, 3, 2] y, int64[2, 3, 3, 2] i)",
                "y, i = MaxPool<kernel_shape=[2, 2], strides=[2, 2]>(x)")
    dx, graph = _x_gradient(net, x)
    assert "ArgMax" not in {n.op_type for n in graph.graph.node}
    np.testing.assert_array_equal(dx, _tiled_max_pool_grad(x, [2, 2], cotangent((2, 3, 3, 2),
                                                                                 F32)))


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [2, 3], "strides": [2, 3]},
])
def test_tiled_max_pool_gradient_against_finite_differences(rng, attrs):
    values = rng.permutation(2 * 3 * 5 * 7).reshape(2, 3, 5, 7) * 0.1
    check_op("MaxPool", {"x": values.astype(np.float64)}, attrs, opset=17)


def test_overlapping_or_padded_max_pool_keeps_the_scatter_form(rng):
    x = _with_ties(rng, (1, 2, 6, 6))
    for attrs in ({"kernel_shape": [3, 3], "strides": [2, 2]},
                  {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                  {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}):
        _, graph = _x_gradient(_one_op_model("MaxPool", x, attrs), x)
        assert "ScatterElements" in {n.op_type for n in graph.graph.node}, attrs
