"""The forms chosen for onnxruntime's speed on convolutional networks compute what the plain
forms compute: the MaxPool gradient of windows that tile their input (nn.py's rule), the
convolution weight gradient by unfolding (lossgraph/speed/unfold_conv_grads.py) and the
ReLU mask (activation.py's rule); ties, zeros, denormals and infinities included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from gradcheck import attributes_text, check_op, cotangent, loss_model
from models import TEXT_TYPE, model

import lossgraph
from lossgraph.runtime.session import create_session
from lossgraph.speed import (
    ConcatScatteredSlabs,
    FoldBatchIntoProducts,
    UnfoldConvWeightGradients,
)

F32 = np.float32


def _model(op: str, x: np.ndarray, attrs, free_batch: bool = False, opset: int = 17
           ) -> onnx.ModelProto:
    """``y = op<attrs>(x)``, the batch axis of x free when ``free_batch``."""
    dims = ["N" if free_batch and a == 0 else str(d) for a, d in enumerate(x.shape)]
    outputs = ", ".join(f"y{a}" for a in range(x.ndim))
    kind = TEXT_TYPE[x.dtype]
    return model(f"({kind}[{', '.join(dims)}] x) => ({kind}[{outputs}] y)",
                 f"y = {op}{attributes_text(attrs)}(x)", opset=opset)


def _gradient(net: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, onnx.ModelProto]:
    """lossgraph's gradient of ``sum(y * R)`` with respect to x (gradcheck's cotangent R),
    and the gradient graph."""
    graph = lossgraph.gradient(loss_model(net, {"x": x}), weights=["x"],
                               loss_name="gradcheck_loss")
    (dx,) = create_session(graph).run(["x_grad"], {"x": x})
    return dx, graph


# -------------------------------------------------------------------- MaxPool, tiled


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
    net = _model("MaxPool", x, {"kernel_shape": kernel, "strides": kernel}, free_batch)
    dx, graph = _gradient(net, x)
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
    dx, _ = _gradient(_model("MaxPool", x, {"kernel_shape": kernel, "strides": kernel}), x)
    np.testing.assert_array_equal(dx, tx.grad.numpy())


def test_tiled_max_pool_gradient_reuses_the_nodes_indices(rng):
    """A MaxPool that outputs its Indices scatters through them: no ArgMax."""
    x = _with_ties(rng, (2, 3, 6, 4))
    net = model("(float[2, 3, 6, 4] x) => (float[2, 3, 3, 2] y, int64[2, 3, 3, 2] i)",
                "y, i = MaxPool<kernel_shape=[2, 2], strides=[2, 2]>(x)")
    dx, graph = _gradient(net, x)
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
        _, graph = _gradient(_model("MaxPool", x, attrs), x)
        assert "ScatterElements" in {n.op_type for n in graph.graph.node}, attrs


# ----------------------------------------------------- convolution weight gradients


def _conv_gradient_model(x_shape, w_shape, attrs, free_batch: bool) -> onnx.ModelProto:
    """The gradient graph of ``sum(sin(Conv(x, W)))`` with respect to W and x."""
    dims = ["N" if free_batch else str(x_shape[0]), *map(str, x_shape[1:])]
    net = model(f"(float[{', '.join(dims)}] x, float[{', '.join(map(str, w_shape))}] w) "
                "=> (float loss)", f"y = Conv{attributes_text(attrs)}(x, w)  s = Sin(y)  "
                "loss = ReduceSum<keepdims=0>(s)", opset=17)
    return lossgraph.gradient(net, weights=["w", "x"], loss_name="loss")


UNFOLDED = [
    ((2, 3, 7, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((3, 1, 8, 8), (5, 1, 3, 3), {}),
    ((2, 3, 9, 8), (4, 3, 3, 2), {"pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 9, 9), (3, 2, 2, 3), {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 2]}),
    ((2, 4, 5, 6), (3, 4, 1, 1), {}),
    ((2, 4, 6, 6), (3, 4, 1, 1), {"strides": [2, 2]}),
    ((2, 3, 10), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((1, 2, 4, 5, 4), (3, 2, 2, 2, 2), {"pads": [1, 0, 1, 0, 1, 0]}),
    ((2, 3, 7, 7), (4, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
]


@pytest.mark.parametrize("free_batch", [False, True], ids=["static", "free_batch"])
@pytest.mark.parametrize("x_shape, w_shape, attrs", UNFOLDED)
def test_unfolded_weight_gradient_equals_the_conv_form(rng, x_shape, w_shape, attrs, free_batch):
    plain = _conv_gradient_model(x_shape, w_shape, attrs, free_batch)
    result = UnfoldConvWeightGradients()(plain)
    assert result.changed
    produced = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert not [n for n in result.model.graph.node if n.op_type == "Conv"
                and produced.get(n.input[1]) == "Transpose"]  # no Conv over swapped axes
    feeds = {"x": rng.normal(size=x_shape).astype(F32), "w": rng.normal(size=w_shape).astype(F32)}
    expected = create_session(plain).run(["w_grad", "x_grad"], feeds)
    got = create_session(result.model).run(["w_grad", "x_grad"], feeds)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], expected[1])  # the input gradient is untouched


@pytest.mark.torch
def test_a_cnn_with_unfolded_weight_gradients_trains_like_torch(rng):
    """compile_program runs the pass: the step graph has no Conv over swapped axes, and an
    exported CNN (3x3 and 1x1 convolutions, max pooling) trains to torch's weights."""
    import torch

    from benchmarks.model_speed import WORKLOADS, make_problem, run_workload

    problem = make_problem(WORKLOADS["cnn"], steps=3, quick=True)
    threads = torch.get_num_threads()
    try:
        result = run_workload(problem, steps=3, repeat=1, threads=1)
    finally:
        torch.set_num_threads(threads)
    for name, check in result.checks.items():
        assert check["weights_compared"] == check["weights"] > 0, name
        assert check["max_abs_difference"] < 1e-5 < check["torch_moved"], (name, check)
    step = lossgraph.compile_program(problem.model).graphs["train_step"]
    assert "MaxUnpool" in {n.op_type for n in step.graph.node}
    produced = {o: n.op_type for n in step.graph.node for o in n.output}
    assert not [n for n in step.graph.node if n.op_type == "Conv"
                and produced.get(n.input[1]) == "Transpose"]


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((2, 3, 9, 9), (4, 3, 5, 5), {"pads": [2, 2, 2, 2]}),      # 25 taps: slower unfolded
    ((2, 4, 6, 6), (4, 2, 3, 3), {"group": 2}),                 # grouped
])
def test_other_weight_gradients_keep_the_conv_form(x_shape, w_shape, attrs):
    plain = _conv_gradient_model(x_shape, w_shape, attrs, free_batch=False)
    assert not UnfoldConvWeightGradients()(plain).changed


# ------------------------------------------ sequence weight gradients, attention splits


def _plain_and_rewritten(text: str, weights: list[str], rewrite) -> tuple:
    """The gradient of the one-graph model ``text`` (loss output ``loss``) and that
    gradient after ``rewrite``."""
    plain = lossgraph.gradient(onnx.parser.parse_model(text), weights=weights,
                               loss_name="loss")
    return plain, rewrite(plain)


def _same_outputs(plain: onnx.ModelProto, rewritten: onnx.ModelProto, feeds) -> None:
    names = [o.name for o in plain.graph.output]
    for name, ours, theirs in zip(names, create_session(rewritten).run(names, feeds),
                                  create_session(plain).run(names, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)


SEQUENCE_LINEAR = """<ir_version: 8, opset_import: ["" : 17]>
g ({x_type} x, float[{d}, 3] w, float[3] b) => (float loss) {{
    h = MatMul(x, w)  y = Add(h, b)  s = Sin(y)  loss = ReduceSum<keepdims=0>(s)
}}"""


@pytest.mark.parametrize("x_type, shape", [("float[N, 5, 4]", (6, 5, 4)),
                                           ("float[2, 3, 5, 4]", (2, 3, 5, 4)),
                                           ("float[N, S, 4]", (3, 7, 4))])
def test_a_sequence_weight_gradient_is_one_product_over_all_rows(rng, x_type, shape):
    plain, result = _plain_and_rewritten(SEQUENCE_LINEAR.format(x_type=x_type, d=4),
                                         ["w", "b", "x"], FoldBatchIntoProducts())
    assert result.changed
    assert "Gemm" in {n.op_type for n in result.model.graph.node}
    feeds = {"x": rng.normal(size=shape).astype(F32), "w": rng.normal(size=(4, 3)).astype(F32),
             "b": rng.normal(size=3).astype(F32)}
    _same_outputs(plain, result.model, feeds)


def test_a_broadcast_batched_product_keeps_its_form():
    """``x[2, 5, 4] @ w[1, 4, 3]``: w's gradient sums over x's batch, a's and b's leading
    dims agree only after broadcasting."""
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 5, 4] x, float[1, 4, 3] w) => (float loss) {
        y = MatMul(x, w)  s = Sin(y)  loss = ReduceSum<keepdims=0>(s) }"""
    _, result = _plain_and_rewritten(text, ["w"], FoldBatchIntoProducts())
    assert not result.changed


SPLIT = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{k}, 4, 2] x) => (float loss) <{indices}> {{
    {body}
    loss = ReduceSum<keepdims=0>(p)
}}"""


def _split_model(indices: list[int], k: int = 3) -> str:
    """``loss = sum(prod_i sin(x[i_j]))`` over Gathers of scalar constants ``i_j``."""
    constants = ", ".join(f"int64 i{j} = {{{i}}}" for j, i in enumerate(indices))
    body = "  ".join(f"a{j} = Gather(x, i{j})  s{j} = Sin(a{j})" for j in range(len(indices)))
    product = "s0"
    for j in range(1, len(indices)):
        body += f"  m{j} = Mul({product}, s{j})"
        product = f"m{j}"
    body += f"  p = Identity({product})"
    return SPLIT.format(k=k, indices=constants, body=body)


@pytest.mark.parametrize("indices", [[0, 1, 2], [2, 0, 1], [-1, 0, 1]])
def test_slabs_split_by_gathers_have_their_gradients_concatenated(rng, indices):
    plain, result = _plain_and_rewritten(_split_model(indices), ["x"], ConcatScatteredSlabs())
    assert result.changed
    ops = [n.op_type for n in result.model.graph.node]
    assert "Concat" in ops and "ScatterND" not in ops
    _same_outputs(plain, result.model, {"x": rng.normal(size=(3, 4, 2)).astype(F32)})


@pytest.mark.parametrize("indices", [[0, 1], [0, 1, 1]])
def test_slabs_that_do_not_fill_the_tensor_keep_their_scatters(indices):
    _, result = _plain_and_rewritten(_split_model(indices), ["x"], ConcatScatteredSlabs())
    assert not result.changed
