"""The benchmarks compute what they claim: every implementation the training-speed
benchmark times (the hand-written bound and lossgraph included) trains the same weights as
numpy; the reference tutorial's and the compile-cost benchmarks report every row."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from conftest import HAS_SKL2ONNX
from onnx import numpy_helper

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


def test_compile_cost_mlp_is_the_relu_network_it_describes(rng):
    """The compile-cost benchmark's MLP computes relu(x W + b) layer after layer, then one
    output column: what its rows say they measure."""
    from benchmarks.compile_cost import mlp_model
    from lossgraph.runtime.session import create_session

    model = mlp_model(3, width=8)
    assert [n.op_type for n in model.graph.node] == ["Gemm", "Relu"] * 3 + ["MatMul"]
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x = rng.standard_normal((5, 8)).astype(np.float32)
    expected = x
    for i in range(3):
        expected = np.maximum(expected @ weights[f"W{i}"] + weights[f"b{i}"], 0)
    expected = expected @ weights["W_out"]
    (ours,) = create_session(model).run(None, {"X": x})
    assert ours.shape == (5, 1)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_cost_quick_run_reports_every_cell(tmp_path, capsys):
    """The compile-cost benchmark in quick mode: every model and mode has a time, a memory
    figure and the graph it built, the growth of each mode is reported against its target,
    and BERT is measured or said to be skipped (no timing is checked)."""
    from benchmarks import compile_cost as bench

    out = tmp_path / "compile_cost.json"
    assert bench.main(["--quick", "--json", str(out), "--cache", str(tmp_path)]) == 0
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    assert "cores" in figures["machine"]
    cells = figures["cells"]
    small, large = (f"MLP {n} layers" for n in bench.LAYERS_QUICK)
    for name in (small, large):
        assert set(cells[name]) == set(bench.MODES)
        for record in cells[name].values():
            assert "error" not in record, record
            assert record["median_ms"] > 0 and len(record["samples_ms"]) == 1
            assert np.isfinite(record["peak_added_mb"])
            assert record["built_nodes"] > record["nodes"]
    assert cells[small]["step"]["nodes"] == 2 * bench.LAYERS_QUICK[0] + 1
    assert cells[large]["step"]["nodes"] == 2 * bench.LAYERS_QUICK[1] + 1
    growth = [v for v in figures["verdicts"] if "layers_ratio" in v]
    assert [v["mode"] for v in growth] == list(bench.MODES)
    assert all(v["layers_ratio"] == 4 and v["verdict"] in ("PASS", "MISS") for v in growth)
    if "BERT-tiny" in cells:  # torch and transformers installed
        assert all("error" not in r and r["built_nodes"] > r["nodes"]
                   for r in cells["BERT-tiny"].values()), cells["BERT-tiny"]
    else:
        assert figures["skipped"] and "BERT-tiny" in figures["skipped"][0]
    printed = capsys.readouterr().out
    assert all(f"{mode}: 4x the layers" in printed for mode in bench.MODES)
    foreign = tmp_path / "notes.json"  # a second run replaces its own file, never another's
    foreign.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--json", str(foreign)])
    assert foreign.read_text() == "{}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="needs Ray (pip install 'lossgraph[ray]')")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")  # Ray's own
def test_cluster_quick_run_trains_what_one_process_trains(tmp_path, monkeypatch):
    """The cluster benchmark's quick run (its own local cluster, two workers): the Ray run
    ends with the single process's weights, and every all-reduce is timed (no timing is
    checked)."""
    from benchmarks import cluster as bench

    for name, value in bench.RAY_ENVIRONMENT.items():  # restored after the test
        monkeypatch.setenv(name, value)
    out = tmp_path / "cluster.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    single, one_thread, *on_ray = figures["trainings"]
    assert single["workers"] == one_thread["workers"] == 0
    assert [t["workers"] for t in on_ray] == [2] and on_ray[0]["error"] is None
    assert on_ray[0]["max_weight_gap"] < 1e-4
    assert [r["rows"] for r in on_ray[0]["epochs"]] == [bench.QUICK_ROWS] * bench.QUICK_EPOCHS
    kinds = {row["all_reduce"] for row in figures["all_reduce"]}
    assert kinds == {"actor", *(["gloo"] if importlib.util.find_spec("torch") else [])}
    assert all(row["median_ms"] > 0 for row in figures["all_reduce"])


@pytest.mark.torch
def test_model_speed_quick_run_trains_every_network_to_torchs_weights(tmp_path, capsys):
    """The CNN, transformer, ResNet block and LSTM benchmark on tiny networks: every
    lossgraph mode runs, trains the export to torch's weights after the same steps (every
    weight compared, and they moved), and the report has a ratio per mode (no timing is
    checked); the saved exports then run without torch (lossgraph only)."""
    import torch

    from benchmarks import model_speed as bench

    out, models = tmp_path / "speed.json", tmp_path / "models"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--threads", "1", "--json", str(out),
                           "--save-models", str(models)]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    assert [w["workload"] for w in figures["workloads"]] == list(bench.WORKLOADS)
    for workload in figures["workloads"]:
        assert not workload["errors"], workload["errors"]
        for mode in bench.MODES:
            name = f"lossgraph fuse={mode}"
            check = workload["checks"][name]
            assert check["weights_compared"] == check["weights"] > 0, (workload["workload"], check)
            assert check["max_abs_difference"] < 1e-5, (workload["workload"], name, check)
            assert check["torch_moved"] > 100 * check["max_abs_difference"]
            assert workload["ratio_to_torch"][name] > 0
    assert "DIFFERS" not in capsys.readouterr().out
    assert bench.main(["--quick", "--workloads", "cnn,lstm", "--models", str(models)]) == 0
    printed = capsys.readouterr().out
    assert "(needs torch)" in printed and "lossgraph fuse=epoch" in printed
