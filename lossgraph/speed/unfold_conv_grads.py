"""A convolution's weight gradient as a batched matrix product over the unfolded input::

    Transpose(Conv(Transpose(x, 1 0 2 ..), Transpose(dy, 1 0 2 ..)) [-> Slice to k], 1 0 2 ..)
        ->  Reshape(Transpose(ReduceSum(MatMul(U, Transpose(dy3, 0 2 1)), axes=0)), [O, C, k])

    U   = Reshape(Conv(x, E, group=C), [N, C K, P])     the unfolded x (im2col): E holds C
                                                        copies of the K one-hot kernels of
                                                        shape k, with the strides, dilations
                                                        and pads that slide x under dy
    dy3 = Reshape(dy, [N, O, P])

(``K = prod(k)``, ``P`` dy's spatial size; for a 1x1 kernel with stride 1 and no pads U is
x itself). Where dy has few pixels against the gradient's size, ``P (C K + O) < C K O``
(a deep layer: ResNet-18's last blocks at 32x32 have P = 1), the N batched products of
``C K x O`` and their sum move more values than transposing U and dy, and the gradient is
one product over all ``N P`` rows instead::

    Reshape(Gemm(Reshape(Transpose(dy3, 1 0 2), [O, N P]),
                 Reshape(Transpose(U, 1 0 2), [C K, N P]), transB=1), [O, C, k])

The pattern is what the Conv gradient rule emits for a weight gradient
(``dW = Conv(x^T, dy^T)`` with the forward's strides and dilations swapped, batch as
channels): for every ``n`` and kernel offset ``a``, ``dW[o, c, a] = sum_(n, u) dy[n, o, u]
x_pad[n, c, u s + a d]``, and ``U[n, (c, a), u] = x_pad[n, c, u s + a d]``.

What is rewritten, so that the result is provably the same: a group-1 ``Conv`` without
bias or auto_pad, both of whose inputs are ``Transpose(perm=[1, 0, 2, ...])`` outputs, read
only by a ``Transpose(perm=[1, 0, 2, ...])`` (or by a ``Slice`` from 0 on the spatial axes
read only by one), on float32 values whose channel and spatial dims are static; the
unfolding must land on dy's spatial size exactly, and the kernel have at most
:data:`MAX_KERNEL_ELEMENTS` elements.

Why (onnxruntime 1.19 and 1.32, one thread, CPU time, interleaved): onnxruntime runs that
Conv as a GEMM as narrow as the kernel (9 columns for 3x3) over a reduction as long as the
batch's pixels. As above: 0.53x its time on 64x16x14x14 -> 32 channels (the small CNN's
second layer: 2.4 against 4.6 ms), 0.63x on 64x1x28x28 -> 16, 0.43-0.49x on 32x16x32x32,
32x3x32x32 and 8x64x56x56, 0.68x on 32x128x8x8, 0.23x for 1x1 kernels; but 1.08x for 5x5
and 1.24-1.55x for 7x7 kernels (the unfolded input grows with the kernel), hence the
limit. The one product over all rows: ResNet-18's step (batch 4, 32x32, one thread, CPU
time) from 1.88x torch eager's to 0.94x, the batched products' ``ReduceSum`` and
``Transpose`` having taken 45 of its 107 ms; on the small CNN (P = 196) the batched form
stays, which was faster there. The one-hot kernels are grouped (one group per channel):
onnxruntime's NCHWc layout transformer takes an ungrouped Conv of constant kernels and
makes the unfolding 3x slower with its reordering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from ..builder import GraphBuilder
from ..graphs import (
    GraphIndex,
    attribute_values,
    is_onnx_op,
)
from ..names import NameAuthority
from ..passes.contract import Pass, PassResult
from .rewriting import constant_ints, replace_nodes
from .scopes import rewrite_typed_scopes

__all__ = ["MAX_KERNEL_ELEMENTS", "UnfoldConvWeightGradients"]

#: Kernels of more elements keep onnxruntime's Conv (5x5: 1.08x, 7x7: 1.24-1.55x slower
#: unfolded; 3x3 and smaller: 0.23-0.68x).
MAX_KERNEL_ELEMENTS = 9

_SWAP_PREFIX = [1, 0]


@dataclass(frozen=True)
class UnfoldConvWeightGradients(Pass[None]):
    """Convolution weight gradients ``Conv(x^T, dy^T)^T`` as a product of the unfolded x
    and dy (module doc)."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        return rewrite_typed_scopes(model, "Conv", False, _rewrite)


@dataclass(frozen=True)
class _Match:
    """A weight-gradient Conv and what replaces it."""

    last: onnx.NodeProto  # the Transpose back, whose output the rewrite computes
    x: str
    dy: str
    channels: int
    kernel: list[int]
    strides: list[int]  # of the unfolding: the Conv's dilations
    dilations: list[int]  # of the unfolding: the Conv's strides
    pads: list[int]
    outputs: int | None  # dy's channels O (None: unknown)
    pixels: int  # dy's spatial size P


def _is_swap(node: onnx.NodeProto | None) -> bool:
    if node is None or not is_onnx_op(node, "Transpose"):
        return False
    perm = list(attribute_values(node).get("perm", []))
    return perm[:2] == _SWAP_PREFIX and perm[2:] == list(range(2, len(perm)))




def _recognize(graph: onnx.GraphProto, conv: onnx.NodeProto, index: GraphIndex,
               outputs: set[str], shapes: dict[str, list[int | None]],
               types: dict[str, int]) -> _Match | None:
    """The match of ``conv`` when it is a weight gradient the pass rewrites (module doc)."""
    if not is_onnx_op(conv, "Conv") or len(conv.input) != 2:
        return None
    attributes = attribute_values(conv)
    if attributes.get("group", 1) != 1 or attributes.get("auto_pad", "NOTSET") not in (
            "NOTSET", ""):
        return None
    swaps = [index.producer(name) for name in conv.input]
    if not all(_is_swap(s) for s in swaps):
        return None
    x, dy = (s.input[0] for s in swaps)  # type: ignore[union-attr]
    x_shape, dy_shape = shapes.get(x), shapes.get(dy)
    if (x_shape is None or dy_shape is None or len(x_shape) != len(dy_shape)
            or None in x_shape[1:] or None in dy_shape[2:]
            or types.get(x) != TensorProto.FLOAT or types.get(dy) != TensorProto.FLOAT):
        return None
    n = len(x_shape) - 2
    result = conv.output[0]
    reader = index.read_once(result)
    if result in outputs or reader is None:
        return None
    kernel = shapes.get(result, [None] * (n + 2))[2:]
    if is_onnx_op(reader, "Slice"):
        starts, ends = (constant_ints(graph, name) for name in reader.input[1:3])
        axes = constant_ints(graph, reader.input[3]) if len(reader.input) > 3 else None
        steps = constant_ints(graph, reader.input[4]) if len(reader.input) > 4 else None
        if (starts != [0] * n or axes != list(range(2, n + 2)) or ends is None
                or steps not in (None, [1] * n) or reader.output[0] in outputs
                or index.read_once(reader.output[0]) is None):
            return None
        kernel = ends
        reader = index.read_once(reader.output[0])
    if not _is_swap(reader) or None in kernel or any(k < 1 for k in kernel):
        return None
    kernel = [int(k) for k in kernel]  # type: ignore[arg-type]
    if int(np.prod(kernel)) > MAX_KERNEL_ELEMENTS:
        return None
    # the unfolding slides x with the forward's strides and dilations (the Conv's dilations
    # and strides), and must give dy's spatial size
    strides = list(attributes.get("dilations", [1] * n))
    dilations = list(attributes.get("strides", [1] * n))
    pads = list(attributes.get("pads", [0] * 2 * n))
    sizes = [(x_shape[2 + i] + pads[i] + pads[n + i] - ((kernel[i] - 1) * dilations[i] + 1))
             // strides[i] + 1 for i in range(n)]  # type: ignore[operator]
    if sizes != dy_shape[2:]:
        return None
    return _Match(reader, x, dy, int(x_shape[1]), kernel,  # type: ignore[arg-type]
                  strides, dilations, pads, dy_shape[1],
                  int(np.prod(dy_shape[2:])))  # type: ignore[arg-type]


def _unfolded_gradient(g: GraphBuilder, m: _Match) -> str:
    """dW of the match, shaped (O, C, *kernel) (module doc)."""
    n, elements = len(m.kernel), int(np.prod(m.kernel))
    identity = (elements == 1 and m.strides == [1] * n and not any(m.pads))
    if identity:  # a 1x1 kernel over every pixel: x unfolds to itself
        unfolded = m.x
    else:
        one_hot = np.eye(elements, dtype=np.float32).reshape(elements, 1, *m.kernel)
        kernels = g.const(np.tile(one_hot, (m.channels, *[1] * (n + 1))), np.float32,
                          "one_hot_kernels")
        unfolded = g.Conv(m.x, kernels, group=m.channels if m.channels != 1 else None,
                          strides=m.strides if m.strides != [1] * n else None,
                          dilations=m.dilations if m.dilations != [1] * n else None,
                          pads=m.pads if any(m.pads) else None, hint="unfolded")
    columns = m.channels * elements
    unfolded = g.Reshape(unfolded, g.ints([0, columns, -1], "shape"))
    dy = g.Reshape(m.dy, g.ints([0, 0, -1], "shape"))  # (N, O, P)
    shape = g.ints([0, m.channels, *m.kernel], "shape")
    if _one_product(m, columns):  # (O, N P) @ (C K, N P)^T
        rows = g.Reshape(g.Transpose(dy, perm=[1, 0, 2]), g.ints([0, -1], "shape"))
        taps = g.Reshape(g.Transpose(unfolded, perm=[1, 0, 2]), g.ints([0, -1], "shape"))
        return g.Reshape(g.Gemm(rows, taps, transB=1, hint="unfolded_product"), shape)
    rows = g.Transpose(dy, perm=[0, 2, 1])
    products = g.MatMul(unfolded, rows, hint="unfolded_products")  # (N, C K, O)
    total = g.reduce("ReduceSum", products, [0], keepdims=0, hint="unfolded_sum")
    return g.Reshape(g.Transpose(total, perm=[1, 0]), shape)


def _one_product(m: _Match, columns: int) -> bool:
    """True when one product over all N P rows moves less than the batched products and
    their sum: the former transposes the unfolded x and dy (N P (C K + O) values), the
    latter writes and sums N products of C K x O (deep layers on few pixels: ResNet-18's
    last blocks at 32x32 have P = 1, where the batched form spent a third of the step)."""
    return m.outputs is not None and m.pixels * (columns + m.outputs) < columns * m.outputs


def _rewrite(graph: onnx.GraphProto, shapes: dict[str, list[int | None]],
             types: dict[str, int], names: NameAuthority, opset: int) -> bool:
    """Rewrite ``graph``'s weight-gradient Convs in place, dropping the nodes only they
    read; True if any."""
    index = GraphIndex(graph.node)
    outputs = {o.name for o in graph.output}
    matches = {}
    for node in graph.node:
        match = _recognize(graph, node, index, outputs, shapes, types)
        if match is not None:
            matches[match.last.output[0]] = match
    if not matches:
        return False
    g = GraphBuilder(names, opset, prefix="unfold/")

    def emit(node: onnx.NodeProto) -> list[str] | None:
        match = matches.get(node.output[0]) if node.output else None
        if match is None:
            return None
        g.rename(_unfolded_gradient(g, match), node.output[0], uses=False)
        # what computed only for the replaced Transpose (a Transpose of x may have others)
        return [match.last.input[0]]

    return replace_nodes(graph, g, emit)
