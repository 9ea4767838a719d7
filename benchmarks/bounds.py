"""The bounds and the floor: what onnxruntime can reach at best, and what no
implementation can beat; never peers.

- ``hand_graph_bound``: the same epoch as one hand-minimized graph of standard ops,
  ``Scan(step, batches)`` with ``step`` = forward, backward and Nesterov update written
  out by hand; the bound for any compiler of standard ONNX on this runtime.
- the matrix products alone, over the same batches: each step's products (``a @ W``
  forward, ``a^T @ upstream`` per weight, ``upstream @ W^T`` between layers) and nothing
  else, in three libraries: ``onnxruntime_products`` (a ``Scan`` graph, onnxruntime's
  best forms), ``numpy_products`` and ``torch_products`` (``matmul(out=)`` step by step
  in Python). Every training step does these products, so the fastest of the three at a
  batch size is the **floor** of that cell: no implementation on this machine trains
  faster.

A one-output layer's weight gradient ``column^T @ matrix`` takes, in onnxruntime, the form
lossgraph's specialization gives it: ``ReduceSum(MatMul(column[p, 1, n/p],
matrix[p, n/p, k]), 0)`` when ``row_product_parts(n) = p``, else ``MatMul(column[1, n],
matrix)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks.peers import TORCH_THREADS
from benchmarks.problems import (
    LEARNING_RATE,
    MOMENTUM,
    Epoch,
    Implementation,
    Problem,
    Unavailable,
    Weights,
    not_compared,
)
from lossgraph.runtime.session import create_session
from lossgraph.speed import row_product_parts


def hand_graph_bound(problem: Problem, batch: int) -> Implementation:
    """The same epoch as one hand-minimized graph of standard ops, run by onnxruntime.

    The weights and velocities travel as two flat vectors (one update for all weights),
    the learning rate and 2/batch are constants (2/batch shaped (1, 1): onnxruntime
    broadcasts a scalar against an (N, 1) tensor element by element), the loss is
    ReduceSumSquare: 20-odd nodes per step.
    """
    session, feeds = scan_session(_hand_graph(problem, batch), problem, batch)
    feeds["theta"] = np.concatenate([w.ravel() for w in problem.weights])
    feeds["velocity"] = np.zeros(sum(w.size for w in problem.weights), np.float32)

    def epoch() -> None:
        feeds["theta"], feeds["velocity"], _ = session.run(None, feeds)

    def weights() -> Weights:
        ends = np.cumsum([w.size for w in problem.weights])[:-1]
        return [part.reshape(w.shape) for part, w in
                zip(np.split(feeds["theta"], ends), problem.weights)]

    return epoch, weights


def _hand_graph(problem: Problem, batch: int) -> onnx.ModelProto:
    """Scan over (batches, batch, features): forward, backward and Nesterov by hand."""
    node = helper.make_node
    shapes = [w.shape for w in problem.weights]
    sizes = [w.size for w in problem.weights]

    def const(name: str, value: Any, dtype: Any = np.float32) -> onnx.NodeProto:
        return node("Constant", [], [name], value=numpy_helper.from_array(
            np.asarray(value, dtype), name))

    body = [const("ones", np.ones(batch)), const("m", MOMENTUM),
            const("lr", LEARNING_RATE), const("scale", np.full((1, 1), 2.0 / batch)),
            const("inverse_batch", 1.0 / batch), const("sizes", sizes, np.int64),
            const("flat", [-1], np.int64),
            node("Split", ["theta", "sizes"], [f"part{i}" for i in range(len(sizes))], axis=0)]
    weights = []
    for i, shape in enumerate(shapes):
        if len(shape) == 1:
            weights.append(f"part{i}")
            continue
        body += [const(f"shape{i}", shape, np.int64),
                 node("Reshape", [f"part{i}", f"shape{i}"], [f"w{i}"])]
        weights.append(f"w{i}")
    layers = list(zip(weights[::2], weights[1::2]))
    if len(layers) > 1:
        body.append(const("zero", np.zeros((1, 1))))
    inputs = ["x"]
    for j, (W, b) in enumerate(layers):  # relu between layers
        body.append(node("Gemm", [inputs[-1], W, b], [f"z{j}"]))
        if j < len(layers) - 1:
            body.append(node("Relu", [f"z{j}"], [f"a{j}"]))
            inputs.append(f"a{j}")
    body += [node("Sub", [f"z{len(layers) - 1}", "y_in"], ["error"]),
             node("ReduceSumSquare", ["error"], ["sse"], keepdims=0),
             node("Mul", ["sse", "inverse_batch"], ["loss"]),
             node("Mul", ["error", "scale"], ["g_out"])]
    grads, upstream = [], "g_out"
    for j in reversed(range(len(layers))):
        if shapes[2 * j][1] == 1:  # one output: a column's sum, a row times the inputs
            body += [node("ReduceSum", [upstream], [f"db{j}_sum"], keepdims=0),
                     node("Reshape", [f"db{j}_sum", "flat"], [f"db{j}"]),
                     *_row_product(upstream, inputs[j], f"dW{j}", batch, shapes[2 * j][0])]
        else:
            body += [node("Gemm", [inputs[j], upstream], [f"dW{j}"], transA=1),
                     node("MatMul", ["ones", upstream], [f"db{j}"])]
        body.append(node("Reshape", [f"dW{j}", "flat"], [f"dW{j}_flat"]))
        grads = [f"dW{j}_flat", f"db{j}", *grads]
        if j > 0:  # through the relu before this layer; a relu output > 0 iff its input > 0
            body += [node("Gemm", [upstream, layers[j][0]], [f"da{j}"], transB=1),
                     node("Greater", [inputs[j], "zero"], [f"on{j}"]),
                     node("Cast", [f"on{j}"], [f"mask{j}"], to=TensorProto.FLOAT),
                     node("Mul", [f"da{j}", f"mask{j}"], [f"g{j}"])]
            upstream = f"g{j}"
    body += [node("Concat", grads, ["grad"], axis=0),  # v = m v + g; w -= lr (g + m v)
             node("Mul", ["velocity", "m"], ["mv"]),
             node("Add", ["mv", "grad"], ["velocity_new"]),
             node("Mul", ["velocity_new", "m"], ["mv_new"]),
             node("Add", ["grad", "mv_new"], ["step"]),
             node("Mul", ["step", "lr"], ["delta"]),
             node("Sub", ["theta", "delta"], ["theta_new"])]
    total = sum(sizes)
    return _epoch_scan(body, problem, batch, {"theta": [total], "velocity": [total]}, "loss")


def _row_product(column: str, matrix: str, output: str, rows: int,
                 columns: int) -> list[onnx.NodeProto]:
    """``column^T @ matrix`` as lossgraph's specialization computes it: split into parts
    of the rows, multiplied as one batched MatMul and summed, when the rows are many."""
    node = helper.make_node
    parts = row_product_parts(rows)
    if parts is None:
        return [node("Constant", [], [f"{output}_row"], value=numpy_helper.from_array(
                    np.array([1, rows], np.int64))),
                node("Reshape", [column, f"{output}_row"], [f"{output}_r"]),
                node("MatMul", [f"{output}_r", matrix], [output])]
    shapes = {"row": [parts, 1, rows // parts], "matrix": [parts, rows // parts, columns],
              "axis": [0]}
    return [*(node("Constant", [], [f"{output}_{k}"], value=numpy_helper.from_array(
                np.array(v, np.int64))) for k, v in shapes.items()),
            node("Reshape", [column, f"{output}_row"], [f"{output}_r"]),
            node("Reshape", [matrix, f"{output}_matrix"], [f"{output}_m"]),
            node("MatMul", [f"{output}_r", f"{output}_m"], [f"{output}_parts"]),
            node("ReduceSum", [f"{output}_parts", f"{output}_axis"], [output], keepdims=0)]


def onnxruntime_products(problem: Problem, batch: int) -> Implementation:
    """Only the matrix products of each step, in onnxruntime: a floor, not a training.

    One run of :func:`products_graph` per epoch, a ``Scan`` over the batches. Every step
    of any implementation does these products (forward, the weight gradients and the
    backward pass between layers); onnxruntime's take this long on their own, so no
    graph run by onnxruntime can train faster than this row. The weights stay put (there
    is no update), so there are no weights to check.
    """
    session, feeds = scan_session(products_graph(problem, batch), problem, batch)
    for j, w in enumerate(problem.weights[::2]):
        feeds[f"W{j}"], feeds[f"dW{j}"] = w, np.zeros_like(w)

    def epoch() -> None:
        session.run(None, feeds)

    return epoch, not_compared


def numpy_products(problem: Problem, batch: int) -> Implementation:
    """The same products as :func:`onnxruntime_products`, with numpy's BLAS, step by step."""
    epoch, _ = products_loop(problem, batch, np.matmul, np.asarray)
    return epoch, not_compared


def torch_products(problem: Problem, batch: int) -> Implementation:
    """The same products with torch's BLAS, step by step, on as many threads as the torch
    peer (``torch.mm(out=)`` on tensors sharing numpy's memory)."""
    try:
        import torch
    except ImportError as error:
        raise Unavailable("torch is not installed") from error
    torch.set_num_threads(TORCH_THREADS)
    epoch, _ = products_loop(problem, batch, torch.mm, torch.from_numpy)
    return epoch, not_compared


def products_loop(problem: Problem, batch: int, matmul: Callable[..., Any],
                  wrap: Callable[[np.ndarray], Any]) -> tuple[Epoch, list[Any]]:
    """An epoch of each step's matrix products in a Python loop over the batches, and the
    weight gradients' buffers (after an epoch, the last step's gradients).

    ``matmul(a, b, out=c)`` writes into buffers made once; ``wrap`` turns a numpy array
    into the library's array sharing its memory (the batches are views of ``problem.X``,
    nothing is copied). Per step, per layer ``a @ W``, then from the last layer down
    ``a^T @ upstream`` and, but for the first, ``upstream @ W^T``; the last output stands
    in for the loss gradient.
    """
    layers = [wrap(np.ascontiguousarray(w)) for w in problem.weights[::2]]
    outputs = [wrap(np.empty((batch, w.shape[1]), np.float32)) for w in layers]
    upstreams = [wrap(np.empty((batch, w.shape[0]), np.float32)) for w in layers]
    grads = [wrap(np.empty(tuple(w.shape), np.float32)) for w in layers]
    batches = [wrap(problem.X[start:start + batch])
               for start in range(0, len(problem.X), batch)]

    def epoch() -> None:
        for x in batches:
            inputs = [x]
            for w, out in zip(layers, outputs):
                inputs.append(matmul(inputs[-1], w, out=out))
            upstream = inputs.pop()
            for j in reversed(range(len(layers))):
                matmul(inputs[j].T, upstream, out=grads[j])
                if j > 0:
                    upstream = matmul(upstream, layers[j].T, out=upstreams[j])

    return epoch, grads


def products_graph(problem: Problem, batch: int) -> onnx.ModelProto:
    """Scan over (batches, batch, features) doing each step's matrix products, nothing more.

    The last layer's output stands in for the loss gradient. Each weight gradient is a
    carried value, so that onnxruntime keeps every product. The weights are inputs the
    body reads, as in training (constants would let onnxruntime prepack them).
    """
    node = helper.make_node
    layers = problem.weights[::2]
    body, inputs = [], ["x"]
    for j in range(len(layers)):
        body.append(node("MatMul", [inputs[-1], f"W{j}"], [f"z{j}"]))
        inputs.append(f"z{j}")
    upstream = inputs.pop()
    for j in reversed(range(len(layers))):
        rows, columns = layers[j].shape
        if columns == 1:  # in the form training uses, see _hand_graph
            body += [*_row_product(upstream, inputs[j], f"dW{j}_row", batch, rows),
                     node("Constant", [], [f"dW{j}_shape"], value=numpy_helper.from_array(
                         np.array([rows, 1], np.int64))),
                     node("Reshape", [f"dW{j}_row", f"dW{j}_shape"], [f"dW{j}_new"])]
        else:
            body.append(node("Gemm", [inputs[j], upstream], [f"dW{j}_new"], transA=1))
        if j > 0:
            body.append(node("Gemm", [upstream, f"W{j}"], [f"da{j}"], transB=1))
            upstream = f"da{j}"
    shapes = {f"W{j}": list(w.shape) for j, w in enumerate(layers)}
    return _epoch_scan(body, problem, batch, {f"d{w}": shape for w, shape in shapes.items()},
                       read=shapes)


def scan_session(model: onnx.ModelProto, problem: Problem,
                 batch: int) -> tuple[Any, dict[str, np.ndarray]]:
    """An onnxruntime session for a model from :func:`_epoch_scan`, and its data feeds."""
    try:
        session = create_session(model)
    except ImportError as error:  # lossgraph's RuntimeUnavailableError
        raise Unavailable("onnxruntime is not installed") from error
    n, features = problem.X.shape
    return session, {"X": problem.X.reshape(n // batch, batch, features),
                     "y": problem.y.reshape(n // batch, batch, 1)}


def _tensor(name: str, *shape: int | str) -> onnx.ValueInfoProto:
    """Value info of a float tensor whose dimensions are sizes or names."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _epoch_scan(body: list[onnx.NodeProto], problem: Problem, batch: int,
                carried: dict[str, list[int]], per_step: str | None = None,
                read: dict[str, list[int]] | None = None) -> onnx.ModelProto:
    """A model running ``body`` as a Scan over the epoch's batches of X (``x`` in the
    body) and y (``y_in``). ``carried`` values are given by shape, and ``body`` computes
    the next value of each, ``<name>_new``; ``per_step`` is stacked over the steps;
    ``read`` are more inputs, by shape, that the body reads as they are."""
    read = read or {}
    features = problem.X.shape[1]
    stacked = [per_step] if per_step else []
    graph = helper.make_graph(
        body, "step", [*(_tensor(name, *shape) for name, shape in carried.items()),
                       _tensor("x", batch, features), _tensor("y_in", batch, 1)],
        [*(_tensor(f"{name}_new", *shape) for name, shape in carried.items()),
         *(_tensor(name) for name in stacked)])
    scan = helper.make_node("Scan", [*carried, "X", "y"],
                            [*(f"{name}_out" for name in carried), *stacked],
                            num_scan_inputs=2, body=graph)
    outer = helper.make_graph(
        [scan], "epoch", [*(_tensor(name, *shape) for name, shape in (carried | read).items()),
                          _tensor("X", "batches", batch, features),
                          _tensor("y", "batches", batch, 1)],
        [*(_tensor(f"{name}_out", *shape) for name, shape in carried.items()),
         *(_tensor(name, "batches") for name in stacked)])
    model = helper.make_model(outer, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model
