"""How fast does lossgraph train, next to the usual ways of training the same model?

Times ONE EPOCH of minibatch SGD with Nesterov momentum (learning rate 0.01, momentum
0.9, squared error) over N=100,000 rows of 100 float32 features (synthetic regression
data, fixed seed), for an MLP 100-50-1 (relu) and for linear regression, at batch
sizes 100, 1000 and 10000, without shuffling. Every implementation runs in this one
process, on the same data and the same batches:

    scikit-learn   MLPRegressor(solver="sgd", nesterovs_momentum=True) .partial_fit;
                   linear: SGDRegressor.partial_fit (per-sample, no momentum)
    torch eager    nn.Sequential / nn.Linear, torch.optim.SGD(nesterov=True), MSELoss
    ORT on-device  onnxruntime.training artifacts + onnxruntime.training.api
                   (its optimizers are AdamW and SGD: plain SGD here, no momentum)
    numpy          the same Nesterov SGD written by hand (preallocated, in place)
    lossgraph      lossgraph.compile(...) + lossgraph.Trainer(...).fit, per fuse mode

The first four are the peers. Two more rows are bounds, never peers: the same epoch
as one hand-minimized onnxruntime graph, and only the matrix products of each step
(the floor for any graph onnxruntime runs). Cells read "ms/epoch (ratio to the
fastest peer at that batch size)". Each figure is the median of --repeat epochs after one warm-up
epoch; setup (model construction, export, compilation, sessions) is excluded and
reported separately. A peer that cannot run in this environment shows "n/a".

Run:  python benchmarks/training_speed.py [--quick] [--models mlp,linear]
          [--batches 100,1000,10000] [--repeat 3] [--json out.json] [--plot out.png]
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing lossgraph

from lossgraph.errors import UnsafeWriteError  # noqa: E402
from lossgraph.fileio import check_file_target, write_file  # noqa: E402

BENCHMARK_MARK = "lossgraph benchmarks/training_speed.py"

N_ROWS, N_ROWS_QUICK, N_FEATURES, HIDDEN = 100_000, 20_000, 100, 50
LEARNING_RATE, MOMENTUM, SEED = 0.01, 0.9, 0
PEERS = ("scikit-learn", "torch eager", "ORT on-device", "numpy")
FUSE_MODES = ("separate", "step", "epoch")
TORCH_THREADS = 2
CHECK_TOLERANCE = 1e-4  # float32 weights after one epoch, against numpy's
# The targets: lossgraph's best mode against the fastest peer (MLP), against
# numpy by hand (linear); batch size -> the largest ratio that passes.
TARGETS = {"mlp": {100: 0.5, 1000: 0.5, 10000: 0.5},
           "linear": {100: 1.5, 1000: 1.0, 10000: 1.0}}

Epoch = Callable[[], None]
Weights = list[np.ndarray]  # MLP: W1 (100, 50), b1 (50,), W2 (50, 1), b2 (1,); linear: w, b


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds busy on the whole machine, CPU seconds used by this process), Linux only."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    times = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), times.user + times.system


class Unavailable(Exception):
    """This implementation cannot run here; the message says why."""


# -- data, initial weights and ONNX models -----------------------------------------------


@dataclass
class Problem:
    """One model to train: data, the shared initial weights and its ONNX form."""

    name: str  # "mlp" or "linear"
    X: np.ndarray  # (N, 100) float32
    y: np.ndarray  # (N, 1) float32
    weights: Weights  # initial weights, shared by every implementation that can take them
    onnx_model: onnx.ModelProto  # the inference model lossgraph compiles
    weight_names: list[str]  # the ONNX initializers holding `weights`, in the same order
    notes: list[str] = field(default_factory=list)


def make_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    X = rng.standard_normal((n, N_FEATURES), dtype=np.float32)
    coef = rng.standard_normal((N_FEATURES, 1), dtype=np.float32) / np.float32(10)
    noise = rng.standard_normal((n, 1), dtype=np.float32) / np.float32(10)
    return X, np.ascontiguousarray(X @ coef + noise, dtype=np.float32)


def _sklearn_mlp(batch: int, max_iter: int = 1):
    from sklearn.neural_network import MLPRegressor

    return MLPRegressor(hidden_layer_sizes=(HIDDEN,), activation="relu", solver="sgd",
                        nesterovs_momentum=True, momentum=MOMENTUM,
                        learning_rate_init=LEARNING_RATE, learning_rate="constant",
                        batch_size=batch, max_iter=max_iter, shuffle=False, alpha=0.0,
                        random_state=SEED)


def mlp_problem(X: np.ndarray, y: np.ndarray) -> Problem:
    """Initial weights: a scikit-learn MLPRegressor after one epoch (batch 1000)."""
    try:
        from skl2onnx import to_onnx
        from sklearn.exceptions import ConvergenceWarning
    except ImportError:
        rng = np.random.default_rng(SEED + 1)
        bound1, bound2 = np.sqrt(6 / (N_FEATURES + HIDDEN)), np.sqrt(6 / (HIDDEN + 1))
        weights = [rng.uniform(-bound1, bound1, (N_FEATURES, HIDDEN)),
                   rng.uniform(-bound1, bound1, (HIDDEN,)),
                   rng.uniform(-bound2, bound2, (HIDDEN, 1)), rng.uniform(-bound2, bound2, (1,))]
        weights = [w.astype(np.float32) for w in weights]
        return Problem("mlp", X, y, weights, _mlp_by_hand(weights), MLP_NAMES,
                       ["scikit-learn/skl2onnx missing: Glorot-uniform weights, ONNX by hand"])
    estimator = _sklearn_mlp(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator.fit(X, y.ravel())
    weights = [np.array(a, dtype=np.float32) for pair in
               zip(estimator.coefs_, estimator.intercepts_) for a in pair]
    model = to_onnx(estimator, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    if {i.name for i in model.graph.initializer} >= set(MLP_NAMES):
        return Problem("mlp", X, y, weights, model, MLP_NAMES)
    return Problem("mlp", X, y, weights, _mlp_by_hand(weights), MLP_NAMES,
                   ["skl2onnx named the weights differently: ONNX written by hand"])


MLP_NAMES = ["coefficient", "intercepts", "coefficient1", "intercepts1"]  # skl2onnx's names


def _mlp_by_hand(weights: Weights) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["X", "coefficient"], ["h0"]),
             helper.make_node("Add", ["h0", "intercepts"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "coefficient1"], ["p0"]),
             helper.make_node("Add", ["p0", "intercepts1"], ["variable"])]
    return _model(nodes, MLP_NAMES, weights)


def linear_problem(X: np.ndarray, y: np.ndarray) -> Problem:
    """Initial weights: zeros (SGDRegressor's start). ONNX: MatMul + Add."""
    weights = [np.zeros((N_FEATURES, 1), np.float32), np.zeros((1,), np.float32)]
    nodes = [helper.make_node("MatMul", ["X", "coef"], ["product"]),
             helper.make_node("Add", ["product", "intercept"], ["variable"])]
    names = ["coef", "intercept"]
    return Problem("linear", X, y, weights, _model(nodes, names, weights), names)


def _model(nodes, names: list[str], weights: Weights) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "benchmark",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", N_FEATURES])],
        [helper.make_tensor_value_info("variable", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(w, n) for n, w in zip(names, weights)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


# -- the peers -----------------------------------------------------------------------------
# Each factory takes (problem, batch) and returns (epoch, weights): `epoch()` trains one
# epoch from the current state, `weights()` returns the current weights in the Problem's
# order (or None when they cannot be compared with numpy's).


def sklearn_peer(problem: Problem, batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    try:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import SGDRegressor
    except ImportError as error:
        raise Unavailable("scikit-learn is not installed") from error
    X, y = problem.X, problem.y.ravel()
    if problem.name == "mlp":
        estimator = _sklearn_mlp(batch)
    else:
        estimator = SGDRegressor(loss="squared_error", penalty=None, alpha=0.0,
                                 learning_rate="constant", eta0=LEARNING_RATE, shuffle=False,
                                 random_state=SEED, average=False)

    def epoch() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            estimator.partial_fit(X, y)

    return epoch, lambda: None  # its loss is half the squared error: not compared


def torch_peer(problem: Problem, batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    try:
        import torch
    except ImportError as error:
        raise Unavailable("torch is not installed") from error
    torch.set_num_threads(TORCH_THREADS)
    net = _torch_net(problem)
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM,
                                nesterov=True)
    loss_fn = torch.nn.MSELoss()
    X, y = torch.from_numpy(problem.X), torch.from_numpy(problem.y)
    starts = range(0, len(problem.X), batch)

    def epoch() -> None:
        for start in starts:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(net(X[start:start + batch]), y[start:start + batch])
            loss.backward()
            optimizer.step()

    def weights() -> Weights:
        with torch.no_grad():
            params = [p.detach().numpy().copy() for p in net.parameters()]
        return [p.T.copy() if p.ndim == 2 else p for p in params]  # torch stores W as (out, in)

    return epoch, weights


def _torch_net(problem: Problem):
    import torch

    if problem.name == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(HIDDEN, 1))
        layers = [net[0], net[2]]
    else:
        net = torch.nn.Linear(N_FEATURES, 1)
        layers = [net]
    with torch.no_grad():
        for layer, (w, b) in zip(layers, zip(problem.weights[::2], problem.weights[1::2])):
            layer.weight.copy_(torch.from_numpy(w.T.copy()))
            layer.bias.copy_(torch.from_numpy(b))
    return net


@contextlib.contextmanager
def _captured_stderr() -> Iterator[Callable[[], str]]:
    """Sends file descriptor 2 to a file: onnxruntime's C++ logging bypasses Python."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1]
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def ort_on_device_peer(problem: Problem, batch: int,
                       workdir: Path) -> tuple[Epoch, Callable[[], Weights | None]]:
    try:
        import torch
        from onnxruntime.training import artifacts
        from onnxruntime.training.api import CheckpointState, Module, Optimizer
    except ImportError as error:
        raise Unavailable(f"onnxruntime.training.api cannot be imported ({error})") from error
    folder = workdir / f"ort_{problem.name}_{batch}"
    folder.mkdir(parents=True, exist_ok=True)
    net = _torch_net(problem)
    exported = folder / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.from_numpy(problem.X[:batch]),), str(exported),
                          dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, export_params=True,
                          input_names=["X"], output_names=["variable"],
                          dynamic_axes={"X": {0: "N"}, "variable": {0: "N"}})
    model = onnx.load(str(exported))
    log = lambda: ""  # noqa: E731
    try:
        with _captured_stderr() as log:
            artifacts.generate_artifacts(
                model, requires_grad=[init.name for init in model.graph.initializer],
                loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                artifact_directory=str(folder))
    except Exception as error:
        tail = log().strip().splitlines()[-3:]
        raise Unavailable(f"generate_artifacts failed: {error!s:.200} {' | '.join(tail)}"
                          ) from error
    # onnx >= 1.21 stamps the optimizer graph generate_artifacts builds with an IR version
    # newer than this runtime reads (10 for 1.19): lower it, the graph uses nothing newer.
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        graph = onnx.load(str(folder / name))
        if graph.ir_version > 10:
            graph.ir_version = 10
            onnx.save(graph, str(folder / name))
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                    device="cpu")
    optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LEARNING_RATE)
    module.train()
    X, y = problem.X, problem.y
    starts = range(0, len(X), batch)

    def epoch() -> None:
        for start in starts:
            module(X[start:start + batch], y[start:start + batch])
            optimizer.step()
            module.lazy_reset_grad()

    return epoch, lambda: None  # plain SGD: not the same update as numpy's


def numpy_peer(problem: Problem, batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    weights = [w.copy() for w in problem.weights]
    velocities = [np.zeros_like(w) for w in weights]
    grads = [np.zeros_like(w) for w in weights]
    scratch = [np.zeros_like(w) for w in weights]
    m, lr = np.float32(MOMENTUM), np.float32(LEARNING_RATE)
    two_over_b = np.float32(2.0 / batch)  # d mean((p - y)^2) / dp
    X, y = problem.X, problem.y
    starts = range(0, len(X), batch)
    prediction = np.empty((batch, 1), np.float32)

    def update() -> None:  # v = m v + g;  w -= lr (g + m v)
        for w, v, g, s in zip(weights, velocities, grads, scratch):
            np.multiply(v, m, out=v)
            v += g
            np.multiply(v, m, out=s)
            s += g
            s *= lr
            w -= s

    if problem.name == "linear":
        coef, intercept = weights
        g_coef, g_intercept = grads

        def epoch() -> None:
            for start in starts:
                xb = X[start:start + batch]
                np.matmul(xb, coef, out=prediction)
                np.add(prediction, intercept, out=prediction)
                np.subtract(prediction, y[start:start + batch], out=prediction)
                np.multiply(prediction, two_over_b, out=prediction)  # dL/dp
                np.matmul(xb.T, prediction, out=g_coef)
                np.sum(prediction, axis=0, out=g_intercept)
                update()

        return epoch, lambda: [w.copy() for w in weights]

    W1, b1, W2, b2 = weights
    gW1, gb1, gW2, gb2 = grads
    hidden = np.empty((batch, HIDDEN), np.float32)
    d_hidden = np.empty((batch, HIDDEN), np.float32)
    mask = np.empty((batch, HIDDEN), np.bool_)

    def epoch() -> None:
        for start in starts:
            xb = X[start:start + batch]
            np.matmul(xb, W1, out=hidden)
            np.add(hidden, b1, out=hidden)
            np.maximum(hidden, 0, out=hidden)
            np.matmul(hidden, W2, out=prediction)
            np.add(prediction, b2, out=prediction)
            np.subtract(prediction, y[start:start + batch], out=prediction)
            np.multiply(prediction, two_over_b, out=prediction)  # dL/dp
            np.matmul(hidden.T, prediction, out=gW2)
            np.sum(prediction, axis=0, out=gb2)
            np.matmul(prediction, W2.T, out=d_hidden)
            np.greater(hidden, 0, out=mask)
            np.multiply(d_hidden, mask, out=d_hidden)
            np.matmul(xb.T, d_hidden, out=gW1)
            np.sum(d_hidden, axis=0, out=gb1)
            update()

    return epoch, lambda: [w.copy() for w in weights]


def hand_graph_bound(problem: Problem, batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    """The same epoch as one hand-minimized graph of standard ops, run by onnxruntime.

    Not a peer: the bound for any compiler of standard ONNX on this runtime. The weights
    and velocities travel as two flat vectors (one update for all weights), the learning
    rate and 2/batch are constants (2/batch shaped (1, 1): onnxruntime broadcasts a
    scalar against an (N, 1) tensor element by element), the loss is ReduceSumSquare:
    20-odd nodes per step.
    """
    session, feeds = _scan_session(_hand_graph(problem, batch), problem, batch)
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
    try:
        from lossgraph.runtime.specialize import row_product_parts
    except ImportError:  # an older lossgraph: one product
        parts = None
    else:
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


def products_floor(problem: Problem, batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    """Only the matrix products of each step, nothing else: a floor, not a training.

    Not a peer: every step of any implementation does these products (forward, the
    weight gradients and the backward pass between layers); onnxruntime's take this
    long on their own, so no graph run by onnxruntime can train faster than this row.
    The weights stay put (there is no update), so there are no weights to check.
    """
    session, feeds = _scan_session(_products_graph(problem, batch), problem, batch)
    for j, w in enumerate(problem.weights[::2]):
        feeds[f"W{j}"], feeds[f"dW{j}"] = w, np.zeros_like(w)
    return (lambda: session.run(None, feeds)), (lambda: None)


def _products_graph(problem: Problem, batch: int) -> onnx.ModelProto:
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


def _scan_session(model: onnx.ModelProto, problem: Problem,
                  batch: int) -> tuple[Any, dict[str, np.ndarray]]:
    """An onnxruntime session for a model from :func:`_epoch_scan`, and its data feeds."""
    try:
        import onnxruntime
    except ImportError as error:
        raise Unavailable("onnxruntime is not installed") from error
    session = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    n, features = problem.X.shape
    return session, {"X": problem.X.reshape(n // batch, batch, features),
                     "y": problem.y.reshape(n // batch, batch, 1)}


def _epoch_scan(body: list[onnx.NodeProto], problem: Problem, batch: int,
                carried: dict[str, list[int]], per_step: str | None = None,
                read: dict[str, list[int]] | None = None) -> onnx.ModelProto:
    """A model running ``body`` as a Scan over the epoch's batches of X (``x`` in the
    body) and y (``y_in``). ``carried`` values are given by shape, and ``body`` computes
    the next value of each, ``<name>_new``; ``per_step`` is stacked over the steps;
    ``read`` are more inputs, by shape, that the body reads as they are."""
    read = read or {}
    features = problem.X.shape[1]
    tensor = lambda name, *shape: helper.make_tensor_value_info(  # noqa: E731
        name, TensorProto.FLOAT, list(shape))
    stacked = [per_step] if per_step else []
    graph = helper.make_graph(
        body, "step", [*(tensor(name, *shape) for name, shape in carried.items()),
                       tensor("x", batch, features), tensor("y_in", batch, 1)],
        [*(tensor(f"{name}_new", *shape) for name, shape in carried.items()),
         *(tensor(name) for name in stacked)])
    scan = helper.make_node("Scan", [*carried, "X", "y"],
                            [*(f"{name}_out" for name in carried), *stacked],
                            num_scan_inputs=2, body=graph)
    outer = helper.make_graph(
        [scan], "epoch", [*(tensor(name, *shape) for name, shape in (carried | read).items()),
                          tensor("X", "batches", batch, features),
                          tensor("y", "batches", batch, 1)],
        [*(tensor(f"{name}_out", *shape) for name, shape in carried.items()),
         *(tensor(name, "batches") for name in stacked)])
    model = helper.make_model(outer, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


# -- lossgraph -----------------------------------------------------------------------------


@dataclass
class Compiled:
    """One lossgraph fuse mode of one model: its program and setup costs."""

    mode: str
    program: Any = None
    error: str | None = None
    compile_s: float = 0.0
    trainer_s: list[float] = field(default_factory=list)


def lossgraph_api() -> tuple[Any, Any, Any]:
    """(compile, Trainer, Momentum) or Unavailable."""
    try:
        import lossgraph
    except ImportError as error:
        raise Unavailable(f"lossgraph cannot be imported ({error})") from error
    missing = [n for n in ("compile", "Trainer") if not hasattr(lossgraph, n)]
    try:
        from lossgraph.optim import Momentum
    except ImportError:
        missing.append("optim.Momentum")
    if missing:
        raise Unavailable(f"lossgraph has no {', '.join(missing)} yet")
    return lossgraph.compile, lossgraph.Trainer, Momentum


def compile_modes(problem: Problem) -> list[Compiled]:
    try:
        compile_, _, Momentum = lossgraph_api()
    except Unavailable as error:
        return [Compiled(mode, error=str(error)) for mode in ("step", "epoch")]
    results = []
    for mode in FUSE_MODES:
        start = time.perf_counter()
        try:
            program = compile_(problem.onnx_model, loss="squared_error",
                               optimizer=Momentum(LEARNING_RATE, momentum=MOMENTUM,
                                                  nesterov=True),
                               fuse=mode)
        except Exception as error:  # noqa: BLE001 - reported, the run goes on
            if mode == "separate":
                print(f"  [{problem.name}] lossgraph fuse='separate' skipped: "
                      f"{type(error).__name__}: {error!s:.160}")
                continue
            results.append(Compiled(mode, error=f"{type(error).__name__}: {error!s:.200}"))
            continue
        results.append(Compiled(mode, program, compile_s=time.perf_counter() - start))
    return results


def lossgraph_impl(compiled: Compiled, problem: Problem,
                   batch: int) -> tuple[Epoch, Callable[[], Weights | None]]:
    if compiled.error:
        raise Unavailable(compiled.error)
    _, Trainer, _ = lossgraph_api()
    start = time.perf_counter()
    trainer = Trainer(compiled.program)
    compiled.trainer_s.append(time.perf_counter() - start)
    X, y = problem.X, problem.y

    def epoch() -> None:  # the first call (the warm-up) starts from the program's state
        trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=False, progress=False,
                    warm_start=trainer.steps_ > 0)

    def weights() -> Weights:
        state = trainer.state
        return [np.asarray(state[n], np.float32).reshape(w.shape)
                for n, w in zip(problem.weight_names, problem.weights)]

    return epoch, weights


# -- timing ----------------------------------------------------------------------------------


@dataclass
class Row:
    """One implementation's figures for one model."""

    name: str
    kind: str  # "peer", "lossgraph" or "bound" (compared, never the fastest peer)
    note: str = ""
    ms: dict[int, float | None] = field(default_factory=dict)  # batch -> median ms/epoch
    samples: dict[int, list[float]] = field(default_factory=dict)
    setup_ms: dict[int, float] = field(default_factory=dict)
    warm_up_ms: dict[int, float] = field(default_factory=dict)  # first epoch, lazy setup included
    errors: dict[int, str] = field(default_factory=dict)
    check: dict[int, float | None] = field(default_factory=dict)  # max |w - w_numpy|


def _failed(row: Row, batch: int, error: Exception) -> None:
    row.ms[batch] = None
    if isinstance(error, Unavailable):
        row.errors[batch] = str(error)
        return
    row.errors[batch] = f"{type(error).__name__}: {error!s:.200}"
    if os.environ.get("BENCH_DEBUG"):
        traceback.print_exc()


def warm_up(row: Row, factory: Callable[[], tuple[Epoch, Callable[[], Weights | None]]],
            batch: int, reference: Weights | None) -> tuple[Epoch | None, Weights | None]:
    """Sets one implementation up and trains its warm-up epoch (the one the check reads).

    Returns its epoch function (None if it cannot run) and its weights after that epoch.
    """
    try:
        start = time.perf_counter()
        epoch, weights = factory()
        row.setup_ms[batch] = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        epoch()
        row.warm_up_ms[batch] = (time.perf_counter() - start) * 1000
        after_warm_up = weights()
    except Exception as error:  # noqa: BLE001 - one implementation must not end the run
        _failed(row, batch, error)
        return None, None
    if after_warm_up is not None and reference is not None:
        row.check[batch] = max(float(np.abs(a - b).max()) for a, b in
                               zip(after_warm_up, reference))
    return epoch, after_warm_up


SETTLE_S = 0.15


def settle(epoch: Epoch) -> None:
    """Untimed epochs of one implementation for at least SETTLE_S seconds (one at least).

    Thread pools keep spinning after a call, and would take the cores of whichever
    implementation runs next: OpenBLAS's for up to 2**28 cycles (about 0.1 s), torch's
    OpenMP and onnxruntime's for less. One untimed epoch is not enough when epochs take
    a few milliseconds: such epochs then varied 5x within a run.
    """
    start = time.perf_counter()
    epoch()
    while time.perf_counter() - start < SETTLE_S:
        epoch()


def run_model(problem: Problem, batches: list[int], repeat: int, workdir: Path) -> dict:
    """Per batch size: set up and warm up every implementation, then time `repeat` rounds.

    Each round times one epoch of every implementation in turn, so that a burst of load
    from another process falls on all of them rather than on one. Each timed epoch
    follows untimed epochs of the same implementation (see :func:`settle`).
    """
    sk_note = ("SGDRegressor: per-sample updates, no minibatch, no momentum"
               if problem.name == "linear" else "MLPRegressor.partial_fit; loss is MSE/2")
    rows = [Row("numpy", "peer", "hand-written Nesterov SGD"),
            Row("scikit-learn", "peer", sk_note),
            Row("torch eager", "peer", f"{TORCH_THREADS} threads"),
            Row("ORT on-device", "peer", "plain SGD (no momentum): its API has SGD/AdamW only"),
            Row("hand-written graph", "bound", "not a peer: the same epoch as one hand-minimized "
                "graph of standard ops in onnxruntime, the bound for lossgraph's graphs"),
            *([Row("matrix products only", "bound", "not a peer, not a training: only the "
                   "step's matrix products, in onnxruntime: the floor for any onnxruntime "
                   "graph")] if problem.name == "mlp" else [])]
    factories: dict[str, Callable] = {
        "numpy": numpy_peer, "scikit-learn": sklearn_peer, "torch eager": torch_peer,
        "ORT on-device": lambda p, b: ort_on_device_peer(p, b, workdir),
        "hand-written graph": hand_graph_bound, "matrix products only": products_floor}
    compiled = compile_modes(problem)
    for c in compiled:
        rows.append(Row(f"lossgraph fuse={c.mode}", "lossgraph"))
        factories[rows[-1].name] = lambda p, b, c=c: lossgraph_impl(c, p, b)
    for batch in batches:
        epochs: dict[str, Epoch] = {}
        reference = None
        for row in rows:
            epoch, after = warm_up(row, lambda r=row, b=batch: factories[r.name](problem, b),
                                   batch, reference)
            if epoch is not None:
                epochs[row.name] = epoch
            if row.name == "numpy":
                reference = after
        samples: dict[str, list[float]] = {name: [] for name in epochs}
        for _ in range(repeat):
            for row in rows:
                if row.name not in epochs:
                    continue
                try:
                    settle(epochs[row.name])
                    start = time.perf_counter()
                    epochs[row.name]()
                    samples[row.name].append((time.perf_counter() - start) * 1000)
                except Exception as error:  # noqa: BLE001
                    _failed(row, batch, error)
                    del epochs[row.name]
        for row in rows:
            if row.name in epochs:
                row.samples[batch] = samples[row.name]
                row.ms[batch] = statistics.median(samples[row.name])
    return {"problem": problem, "rows": rows, "compiled": compiled}


# -- report ----------------------------------------------------------------------------------


def machine_facts() -> dict[str, str]:
    facts = {"cores": str(os.cpu_count()), "python": platform.python_version(),
             "platform": platform.platform(terse=True), "numpy": np.__version__,
             "onnx": onnx.__version__}
    with contextlib.suppress(OSError, AttributeError):
        facts["load average (1 min)"] = f"{os.getloadavg()[0]:.2f}"
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state

        training = hasattr(_pybind_state, "GradientGraphBuilder")
        distribution = "onnxruntime-training-cpu" if training else "onnxruntime"
        facts["onnxruntime"] = (f"{onnxruntime.__version__} ({distribution}, training build: "
                                f"{'yes' if training else 'no'})")
    except ImportError:
        facts["onnxruntime"] = "not installed"
    for package in ("torch", "scikit-learn", "skl2onnx", "lossgraph"):
        try:
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            facts[package] = "not installed"
    if facts["lossgraph"] == "not installed":
        with contextlib.suppress(ImportError):
            import lossgraph

            facts["lossgraph"] = f"{lossgraph.__version__} (from the checkout)"
    return facts


def fastest_peer(rows: list[Row], batch: int) -> Row | None:
    peers = [r for r in rows if r.kind == "peer" and r.ms.get(batch) is not None]
    return min(peers, key=lambda r: r.ms[batch]) if peers else None


def ratio_to(row: Row, other: Row | None, batch: int) -> float | None:
    if other is None or row.ms.get(batch) is None or not other.ms.get(batch):
        return None
    return row.ms[batch] / other.ms[batch]


def report_model(result: dict, batches: list[int], n_rows: int) -> dict:
    problem, rows = result["problem"], result["rows"]
    title = ("MLP 100-50-1 (relu)" if problem.name == "mlp" else "linear regression")
    print(f"\n== {title}: ms per epoch of {n_rows:,} rows (ratio to the fastest peer, "
          "* = fastest peer) ==")
    for note in problem.notes:
        print(f"   note: {note}")
    width = 24
    print(f"{'implementation':{width}s}" + "".join(f"{'batch ' + str(b):>20s}" for b in batches))
    fastest = {b: fastest_peer(rows, b) for b in batches}
    for row in rows:
        cells = []
        for b in batches:
            ms = row.ms.get(b)
            if ms is None:
                cells.append("n/a")
                continue
            ratio = ratio_to(row, fastest[b], b)
            mark = "*" if fastest[b] is row else " "
            cells.append(f"{ms:.1f} ms ({ratio:.2f}x){mark}" if ratio else f"{ms:.1f} ms")
        print(f"{row.name:{width}s}" + "".join(f"{c:>20s}" for c in cells))
    print("notes:")
    for row in rows:
        if row.note:
            print(f"  {row.name}: {row.note}")
        for message in sorted(set(row.errors.values())):
            print(f"  {row.name}: n/a -- {message}")
    checks = {row.name: max(row.check.values()) for row in rows if row.check}
    if checks:
        print("  check, max |w - w_numpy| after the warm-up epoch (same start, same batches): "
              + ", ".join(f"{name} {d:.1e}{' DIFFERS' if d > CHECK_TOLERANCE else ''}"
                          for name, d in checks.items()))
    setups = [f"{row.name} {statistics.median(row.setup_ms.values()):.0f} ms"
              for row in rows if row.setup_ms]
    print("  setup per batch size (excluded from the timings; median): " + ", ".join(setups))
    for row, c in zip((r for r in rows if r.kind == "lossgraph"), result["compiled"]):
        if c.program is not None:
            trainer = f"{statistics.median(c.trainer_s) * 1000:.1f} ms" if c.trainer_s else "-"
            first = ", ".join(f"b{b} {row.warm_up_ms[b]:.0f} ms" for b in batches
                              if b in row.warm_up_ms)
            print(f"  {row.name}: compile {c.compile_s * 1000:.0f} ms (once), Trainer() "
                  f"{trainer}, first fit (creates the sessions, + 1 epoch) {first}")
    return {"title": title, "rows": rows, "fastest": fastest,
            "targets": report_targets(problem.name, rows, batches)}


def report_targets(model: str, rows: list[Row], batches: list[int]) -> list[dict]:
    ours = [r for r in rows if r.kind == "lossgraph"]
    numpy_row = next(r for r in rows if r.name == "numpy")
    against = "the fastest peer" if model == "mlp" else "numpy by hand"
    print(f"  targets (lossgraph's best mode vs {against}):")
    verdicts = []
    for b in batches:
        limit = TARGETS[model].get(b)
        done = [r for r in ours if r.ms.get(b) is not None]
        reference = fastest_peer(rows, b) if model == "mlp" else numpy_row
        if not done or limit is None or ratio_to(done[0], reference, b) is None:
            why = "no target at this batch size" if limit is None else "untested (n/a)"
            print(f"    batch {b}: {why}")
            verdicts.append({"batch": b, "limit": limit, "ratio": None, "verdict": why})
            continue
        best = min(done, key=lambda r: r.ms[b])
        ratio = ratio_to(best, reference, b)
        verdict = "PASS" if ratio <= limit else "MISS"
        bounds = {r.name: ratio_to(r, reference, b) for r in rows if r.kind == "bound"}
        bound_text = "".join(f"; {name} {x:.2f}x" for name, x in bounds.items() if x is not None)
        print(f"    batch {b}: {best.name} {ratio:.2f}x {reference.name} "
              f"(target <= {limit}x): {verdict}{bound_text}")
        verdicts.append({"batch": b, "limit": limit, "ratio": ratio, "best": best.name,
                         "against": reference.name, "verdict": verdict, "bounds": bounds})
    if model == "linear":
        for r in ours:
            ratios = [ratio_to(r, numpy_row, b) for b in batches]
            print(f"    {r.name} / numpy: " + ", ".join(
                f"b{b} {x:.2f}x" if x is not None else f"b{b} n/a"
                for b, x in zip(batches, ratios)))
    return verdicts


def to_json(facts: dict, reports: dict[str, dict], args: argparse.Namespace, n: int) -> dict:
    def row_json(row: Row, report: dict) -> dict:
        return {"name": row.name, "kind": row.kind, "note": row.note,
                "ms_per_epoch": {str(b): v for b, v in row.ms.items()},
                "samples_ms": {str(b): v for b, v in row.samples.items()},
                "ratio_to_fastest_peer": {str(b): ratio_to(row, report["fastest"][b], b)
                                          for b in row.ms},
                "setup_ms": {str(b): v for b, v in row.setup_ms.items()},
                "warm_up_ms": {str(b): v for b, v in row.warm_up_ms.items()},
                "max_abs_diff_vs_numpy": {str(b): v for b, v in row.check.items()},
                "errors": {str(b): v for b, v in row.errors.items()}}

    return {"generator": BENCHMARK_MARK, "machine": facts, "rows_per_epoch": n,
            "features": N_FEATURES, "learning_rate": LEARNING_RATE, "momentum": MOMENTUM,
            "repeat": args.repeat,
            "models": {name: {"title": r["title"], "targets": r["targets"],
                              "fastest_peer": {str(b): (f.name if f else None)
                                               for b, f in r["fastest"].items()},
                              "rows": [row_json(row, r) for row in r["rows"]]}
                       for name, r in reports.items()}}


def _benchmark_output(path: Path) -> bool:
    """True for a file this benchmark wrote (its JSON or PNG carries BENCHMARK_MARK)."""
    return BENCHMARK_MARK.encode() in path.read_bytes()[:4096]


def plot(reports: dict[str, dict], batches: list[int], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n--plot {path}: matplotlib is not installed, no plot written")
        return
    figure, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for axis, (_, report) in zip(axes[0], reports.items()):
        for row in report["rows"]:
            points = [(b, row.ms[b]) for b in batches if row.ms.get(b) is not None]
            if points:
                axis.plot(*zip(*points), marker="o", label=row.name,
                          linestyle="-" if row.kind == "lossgraph" else "--")
        axis.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms per epoch",
                 title=report["title"])
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120, metadata={"Software": BENCHMARK_MARK})
    write_file(path, image.getvalue(), owned=_benchmark_output)
    print(f"\nplot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: N={N_ROWS_QUICK:,} rows, one repeat")
    parser.add_argument("--models", default="mlp,linear", help="comma-separated: mlp,linear")
    parser.add_argument("--batches", default="100,1000,10000", help="comma-separated sizes")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed epochs per cell, after one warm-up (default 3; 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (needs matplotlib)")
    args = parser.parse_args(argv)
    args.repeat = args.repeat or (1 if args.quick else 3)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"mlp", "linear"}
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}: pick from mlp, linear")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    n = N_ROWS_QUICK if args.quick else N_ROWS
    for path in filter(None, (args.json, args.plot)):  # before minutes of measuring
        try:
            check_file_target(path, owned=_benchmark_output)
        except UnsafeWriteError:
            parser.error(f"{path} is in the way: it is not a file this benchmark wrote. "
                         "Choose another path (nothing was measured).")
    if any(b <= 0 or n % b for b in batches):
        parser.error(f"every batch size must divide N={n}")

    with contextlib.suppress(ImportError):
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    facts = machine_facts()
    print("one epoch of minibatch SGD, Nesterov momentum (lr 0.01, momentum 0.9), "
          f"N={n:,} rows x {N_FEATURES} float32 features, no shuffling; "
          f"median of {args.repeat} epoch(s), each after {SETTLE_S:g} s of untimed ones")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    started, cpu_before = time.perf_counter(), _cpu_seconds()
    X, y = make_data(n)
    reports = {}
    with tempfile.TemporaryDirectory(prefix="lossgraph_bench_") as workdir:
        for name in models:
            problem = (mlp_problem if name == "mlp" else linear_problem)(X, y)
            result = run_model(problem, batches, args.repeat, Path(workdir))
            reports[name] = report_model(result, batches, n)
    wall = time.perf_counter() - started
    print(f"\ntotal wall time {wall:.0f} s")
    cpu_after = _cpu_seconds()
    if cpu_before and cpu_after:
        others = max(0.0, (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1]))
        facts["other processes' CPU load during the run (cores)"] = f"{others / wall:.2f}"
        warning = ("  WARNING: the machine was busy, figures are unreliable: rerun on a quiet "
                   "machine" if others / wall > 0.25 else "")
        print(f"other processes kept {others / wall:.2f} of {os.cpu_count()} cores busy "
              f"during the run{warning}")
    if args.json:
        write_file(args.json, json.dumps(to_json(facts, reports, args, n), indent=2).encode(),
                   owned=_benchmark_output)
        print(f"figures written to {args.json}")
    if args.plot:
        plot(reports, batches, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
