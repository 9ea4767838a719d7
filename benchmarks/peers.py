"""The peers: the usual ways of training the same model, each an implementation.

    scikit-learn   MLPRegressor(solver="sgd", nesterovs_momentum=True) .partial_fit;
                   linear: SGDRegressor.partial_fit (per-sample, no momentum)
    torch eager    nn.Sequential / nn.Linear, torch.optim.SGD(nesterov=True), MSELoss
    ORT on-device  onnxruntime.training artifacts + onnxruntime.training.api
                   (its optimizers are AdamW and SGD: plain SGD here, no momentum)
    numpy          the same Nesterov SGD written by hand (preallocated, in place)

Each takes (problem, batch) and returns an Implementation; one whose library is missing
raises Unavailable.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx

from benchmarks.problems import (
    HIDDEN,
    LEARNING_RATE,
    MOMENTUM,
    N_FEATURES,
    SEED,
    Implementation,
    Problem,
    Unavailable,
    Weights,
    not_compared,
    sklearn_mlp,
)

TORCH_THREADS = 2


def sklearn_peer(problem: Problem, batch: int) -> Implementation:
    try:
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import SGDRegressor
    except ImportError as error:
        raise Unavailable("scikit-learn is not installed") from error
    X, y = problem.X, problem.y.ravel()
    if problem.name == "mlp":
        estimator = sklearn_mlp(batch)
    else:
        estimator = SGDRegressor(loss="squared_error", penalty=None, alpha=0.0,
                                 learning_rate="constant", eta0=LEARNING_RATE, shuffle=False,
                                 random_state=SEED, average=False)

    def epoch() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            estimator.partial_fit(X, y)

    return epoch, not_compared  # its loss is half the squared error


def torch_peer(problem: Problem, batch: int) -> Implementation:
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
    """The problem's model as a torch module holding the problem's initial weights."""
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
    """Sends file descriptor 2 to a file: onnxruntime's C++ logging bypasses Python.

    Yields a function returning what was written so far.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:

        def written() -> str:
            sink.seek(0)
            return sink.read().decode(errors="replace")

        os.dup2(sink.fileno(), 2)
        try:
            yield written
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def ort_on_device_peer(problem: Problem, batch: int, workdir: Path) -> Implementation:
    """onnxruntime's on-device training API; its artifacts are written under ``workdir``."""
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
    with _captured_stderr() as log:
        try:
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

    return epoch, not_compared  # plain SGD: not the same update as numpy's


def numpy_peer(problem: Problem, batch: int) -> Implementation:
    """Nesterov SGD by hand: preallocated buffers, in-place ops, ``matmul(out=)``."""
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

    def current() -> Weights:
        return [w.copy() for w in weights]

    if problem.name == "linear":
        coef, intercept = weights
        g_coef, g_intercept = grads

        def linear_epoch() -> None:
            for start in starts:
                xb = X[start:start + batch]
                np.matmul(xb, coef, out=prediction)
                np.add(prediction, intercept, out=prediction)
                np.subtract(prediction, y[start:start + batch], out=prediction)
                np.multiply(prediction, two_over_b, out=prediction)  # dL/dp
                np.matmul(xb.T, prediction, out=g_coef)
                np.sum(prediction, axis=0, out=g_intercept)
                update()

        return linear_epoch, current

    W1, b1, W2, b2 = weights
    gW1, gb1, gW2, gb2 = grads
    hidden = np.empty((batch, HIDDEN), np.float32)
    d_hidden = np.empty((batch, HIDDEN), np.float32)
    mask = np.empty((batch, HIDDEN), np.bool_)

    def mlp_epoch() -> None:
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

    return mlp_epoch, current
