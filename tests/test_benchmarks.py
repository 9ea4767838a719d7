"""The training-speed benchmark computes what it claims: every implementation it times
(the hand-written bound and lossgraph included) trains the same weights as numpy."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bounds import hand_graph_bound, products_graph, scan_session
from benchmarks.lossgraph_modes import compile_modes, lossgraph_trainer
from benchmarks.peers import numpy_peer
from benchmarks.problems import PROBLEMS, make_data


@pytest.fixture(scope="module")
def data():
    return make_data(2000)


@pytest.mark.parametrize("model", ["mlp", "linear"])
@pytest.mark.parametrize("batch", [100, 1000])
def test_hand_graph_and_lossgraph_train_what_numpy_trains(data, model, batch):
    problem = PROBLEMS[model](*data)
    implementations = [hand_graph_bound(problem, batch)]
    implementations += [lossgraph_trainer(c, problem, batch) for c in compile_modes(problem)]
    reference_epoch, reference_weights = numpy_peer(problem, batch)
    for _ in range(2):
        reference_epoch()
    for epoch, weights in implementations:
        epoch()
        epoch()
        for ours, theirs in zip(weights(), reference_weights()):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["mlp", "linear"])
@pytest.mark.parametrize("batch", [500, 1000])  # 1000: a one-column gradient is split
def test_products_floor_computes_every_matrix_product_of_a_step(data, model, batch):
    X, y = data
    problem = PROBLEMS[model](X, y)
    session, feeds = scan_session(products_graph(problem, batch), problem, batch)
    layers = problem.weights[::2]
    for j, w in enumerate(layers):
        feeds[f"W{j}"], feeds[f"dW{j}"] = w, np.zeros_like(w)
    outputs = session.run(None, feeds)  # the weight gradients of the last step
    activations = [X[-batch:]]
    for w in layers:  # no biases, no relu: the products alone
        activations.append(activations[-1] @ w)
    upstream, expected = activations.pop(), []
    for j in reversed(range(len(layers))):
        expected.insert(0, activations[j].T @ upstream)
        upstream = upstream @ layers[j].T
    assert len(outputs) == len(layers)
    for ours, theirs in zip(outputs, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-3)
