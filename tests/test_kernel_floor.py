"""The heavy-kernel floors of benchmarks/kernel_floor.py take the kernels of the step they
bound: the floor graph's nodes compute, from the feeds it gets, what the same nodes
compute in lossgraph's full step graph (a tiny CNN and a tiny attention block, run in
onnxruntime); constants stay constants, heavy nodes chained stay chained, and torch's
floor has a step's convolutions and products, its network left as it was. No timings."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import model

import lossgraph
from benchmarks.kernel_floor import HEAVY_OPS, heavy_kernel_floor, step_graph
from lossgraph.errors import UnsupportedModelError
from lossgraph.optim import SGD

F32 = np.float32

CNN = ("(float[N, 1, 6, 6] x) => (float[N, 2] y)", """
    h1 = Conv <pads = [1, 1, 1, 1]> (x, w1, b1)
    r1 = Relu(h1)
    p1 = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (r1)
    h2 = Conv <pads = [1, 1, 1, 1]> (p1, w2, b2)
    r2 = Relu(h2)
    f = Flatten(r2)
    y = Gemm <transB = 1> (f, w3, b3)
""", {"w1": (2, 1, 3, 3), "b1": (2,), "w2": (3, 2, 3, 3), "b2": (3,), "w3": (2, 27),
      "b3": (2,)})

ATTENTION = ("(float[N, 4, 8] x) => (float[N, 1] y)", """
    q = MatMul(x, wq)
    k = MatMul(x, wk)
    v = MatMul(x, wv)
    kt = Transpose <perm = [0, 2, 1]> (k)
    s = MatMul(q, kt)
    p = Softmax <axis = -1> (s)
    o = MatMul(p, v)
    a = MatMul(o, wo)
    h = Add(x, a)
    e = MatMul(h, w1)
    f = Relu(e)
    z = MatMul(f, w2)
    y = ReduceMean <axes = [1], keepdims = 0> (z)
""", {"wq": (8, 8), "wk": (8, 8), "wv": (8, 8), "wo": (8, 8), "w1": (8, 16), "w2": (16, 1)})


def _net(rng: np.random.Generator, signature: str, body: str,
         weights: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """The model ``signature { body }`` (opset 17) with random weights of those shapes."""
    net = model(signature, body, opset=17)
    net.graph.initializer.extend(numpy_helper.from_array(
        (rng.standard_normal(shape) * 0.3).astype(F32), name) for name, shape in weights.items())
    return net


def _node_outputs(step: onnx.ModelProto, feeds: dict[str, np.ndarray],
                  names: list[str]) -> dict[str, np.ndarray]:
    """What the full step graph computes for ``names`` (made its outputs) on ``feeds``."""
    probe = onnx.ModelProto()
    probe.CopyFrom(step)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    from lossgraph.runtime.session import create_session

    return dict(zip(names, create_session(probe).run(names, feeds)))


def _floor_of(rng: np.random.Generator, case: tuple, rows: tuple[int, ...], outputs: int):
    program = lossgraph.compile_program(_net(rng, *case), optimizer=SGD(0.01), fuse="step")
    data = {"feature": rng.random((3, *rows), dtype=F32),
            "label": rng.standard_normal((3, outputs)).astype(F32)}
    step, feeds = step_graph(program, data, 0.01)
    return step, feeds, heavy_kernel_floor(step, feeds)


def _assert_same_as_step(step: onnx.ModelProto, feeds: dict[str, np.ndarray], floor,
                         run_model) -> None:
    computed = run_model(floor.model, floor.feeds)
    expected = _node_outputs(step, feeds, list(computed))
    for name, value in expected.items():
        np.testing.assert_allclose(computed[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_cnn_floor_computes_the_step_graphs_convolutions_and_products(rng, run_model):
    step, feeds, floor = _floor_of(rng, CNN, (1, 6, 6), 2)
    _assert_same_as_step(step, feeds, floor, run_model)
    assert set(floor.kernels) <= HEAVY_OPS
    # two forward Convs and the two weight gradients unfolded (a grouped Conv of one-hot
    # kernels, a batched MatMul each); one input gradient (x needs none); the Gemms
    assert floor.kernels["Conv"] == 4 and floor.kernels["ConvTranspose"] == 1
    assert floor.kernels["MatMul"] >= 2 and floor.kernels["Gemm"] >= 1
    grouped = [n for n in floor.model.graph.node if n.op_type == "Conv" and any(
        a.name == "group" and a.i > 1 for a in n.attribute)]
    assert grouped, "the unfolding's grouped Conv is part of the floor"
    stored = {t.name for t in floor.model.graph.initializer}
    assert {n.input[1] for n in grouped} <= stored, "its one-hot kernels stay constants"
    assert {i.name for i in floor.model.graph.input} == set(floor.feeds)
    assert not stored & set(floor.feeds)
    assert floor.left_out == 0


def test_an_attention_floor_computes_the_step_graphs_products(rng, run_model):
    step, feeds, floor = _floor_of(rng, ATTENTION, (4, 8), 1)
    _assert_same_as_step(step, feeds, floor, run_model)
    assert set(floor.kernels) <= {"MatMul", "Gemm"}
    step_products = sum(n.op_type in ("MatMul", "Gemm") for n in step.graph.node)
    assert sum(floor.kernels.values()) == step_products


def test_chained_heavy_nodes_stay_chained_and_constant_products_are_left_out(rng, run_model):
    net = model("(float[3, 4] x, float[4, 5] w) => (float[3, 2] y)", """
        a = MatMul(x, w)
        b = MatMul(a, m)
        c = MatMul(k1, k2)
        y = Add(b, c)
    """)
    constants = {"m": rng.standard_normal((5, 2)).astype(F32),
                 "k1": rng.standard_normal((3, 6)).astype(F32),
                 "k2": rng.standard_normal((6, 2)).astype(F32)}
    net.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    feeds = {"x": rng.standard_normal((3, 4)).astype(F32),
             "w": rng.standard_normal((4, 5)).astype(F32)}
    floor = heavy_kernel_floor(net, feeds)
    assert [list(n.input) for n in floor.model.graph.node] == [["x", "w"], ["a", "m"]]
    assert set(floor.feeds) == {"x", "w"}
    assert [t.name for t in floor.model.graph.initializer] == ["m"]
    computed = run_model(floor.model, floor.feeds)
    np.testing.assert_allclose(computed["b"], feeds["x"] @ feeds["w"] @ constants["m"],
                               rtol=1e-5)


def test_a_graph_without_heavy_nodes_has_no_floor():
    net = model("(float[3] x) => (float[3] y)", "y = Relu(x)")
    with pytest.raises(UnsupportedModelError, match="no heavy-kernel floor"):
        heavy_kernel_floor(net, {"x": np.ones(3, F32)})


@pytest.mark.torch
def test_torchs_floor_has_the_steps_kernels_and_leaves_the_network_as_it_was():
    import torch

    from benchmarks.kernel_floor import torch_heavy_kernels

    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(),
                        nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 36, 2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    kernels = torch_heavy_kernels(net, np.random.default_rng(0).random((4, 1, 6, 6), F32))
    # the first Conv's input is data: its backward gives the weight gradient only
    assert kernels.kernels == {"conv2d": 2, "convolution_backward": 2, "linear": 1, "mm": 2}
    results = [call() for call in kernels.calls]
    assert results[1][0] is None and results[1][1].shape == net[0].weight.shape
    assert results[3][0].shape == (4, 2, 6, 6) and results[3][1].shape == net[3].weight.shape
    assert results[5].shape == net[5].weight.T.shape and results[6].shape == (4, 108)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                            nn.Linear(8, 1))
    kernels = torch_heavy_kernels(encoder, np.ones((3, 4, 8), F32))
    # per layer 4 projections (each a linear and two mm, but the first layer's input
    # projection's input gradient), 6 attention products; the head
    assert kernels.kernels == {"linear": 9, "mm": 17, "bmm": 12}
    kernels.step()

    with pytest.raises(UnsupportedModelError, match="LSTM"):
        torch_heavy_kernels(nn.LSTM(3, 4, batch_first=True), np.ones((2, 5, 3), F32))


def test_a_lora_floor_reads_the_programs_frozen_weights_from_its_store(run_model):
    """A LoRA step graph is light (its frozen base weight, 64 KiB, in the program's store,
    not in the graph): the floor takes its value from the store, a constant as before."""
    from support.frozen import frozen_data, frozen_program

    from lossgraph.graphs import is_held

    program, (X, y) = frozen_program("lora"), frozen_data()
    step, feeds = step_graph(program, {"feature": X, "label": y}, 0.01)
    assert any(is_held(tensor) for tensor in step.graph.initializer)
    floor = heavy_kernel_floor(step, feeds)
    stored = {tensor.name: tensor for tensor in floor.model.graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(stored["fc1.weight"]),
                                  program.frozen["fc1.weight"])
    _assert_same_as_step(step, feeds, floor, run_model)
