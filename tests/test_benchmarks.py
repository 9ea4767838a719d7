"""The training-speed benchmark computes what it claims: every implementation it times
(the hand-written bound and lossgraph included) trains the same weights as numpy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import HAS_SKL2ONNX

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


@pytest.mark.skipif(not HAS_SKL2ONNX, reason="needs scikit-learn and skl2onnx")
def test_reference_tutorial_quick_run_reports_every_candidate(tmp_path, capsys):
    """The reference tutorial's benchmark runs in quick mode and its report has every row,
    both APIs training the same weights (no timing is checked)."""
    from benchmarks import reference_tutorial as bench

    out = tmp_path / "reference.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert bench.WHOLE in printed and bench.FORWARD_BACKWARD in printed
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    assert figures["config"]["rows"] == bench.QUICK_ROWS
    assert figures["config"]["epochs"] == bench.QUICK_EPOCHS
    rows = figures["rows"]
    names = [bench.SKLEARN, bench.WHOLE, bench.FORWARD_BACKWARD,
             "floor: matrix products (onnxruntime)", "floor: matrix products (numpy)"]
    assert [(r["optimizer"], r["candidate"]) for r in rows] == [
        (optimizer, name) for optimizer in bench.OPTIMIZERS for name in names]
    for row in rows:
        assert row["error"] is None, row
        assert row["seconds_per_100_epochs"] > 0 and len(row["samples_s"]) == 1
        if row["kind"] == "lossgraph":
            assert row["verdict"] in ("PASS", "MISS") and row["ratio_to_sklearn"] > 0
            assert row["setup_s"] >= 0 and row["setup_fit_of_one_epoch_s"] > 0
            assert row["target"] == bench.TARGET
        if row["kind"] != "floor":  # same data, same optimizer: comparable losses
            assert np.isfinite(row["train_loss"]) and np.isfinite(row["full_data_loss"])
            assert not row["loss_differs"], row
        else:
            assert row["train_loss"] is None and row["verdict"] == "-"
    for optimizer in bench.OPTIMIZERS:  # same start, same shuffles: the same weights
        assert figures["checks"][optimizer] < 1e-4
    # a second run may replace its own file, never someone else's
    foreign = tmp_path / "notes.json"
    foreign.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--json", str(foreign)])
    assert foreign.read_text() == "{}"
