"""The benchmarks compute what they claim: every implementation the training-speed
benchmark times (the hand-written bound and lossgraph included) trains the same weights as
numpy, its floor rows compute a step's matrix products and its report judges each cell
against the floor; the reference tutorial's and the compile-cost benchmarks report every
row."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
from onnx import numpy_helper
from support.environment import HAS_SKL2ONNX

from benchmarks.bounds import hand_graph_bound, products_graph, products_loop, scan_session
from benchmarks.harness import ModelRun, Row, line_up
from benchmarks.lossgraph_modes import compile_modes, lossgraph_trainer
from benchmarks.peers import numpy_peer
from benchmarks.problems import PROBLEMS, Problem, Unavailable, make_data


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


def last_step_gradients(problem: Problem, batch: int, library: str) -> list[np.ndarray]:
    """The weight gradients of the last step of one epoch of the floor row of ``library``."""
    if library == "onnxruntime":
        session, feeds = scan_session(products_graph(problem, batch), problem, batch)
        for j, w in enumerate(problem.weights[::2]):
            feeds[f"W{j}"], feeds[f"dW{j}"] = w, np.zeros_like(w)
        return session.run(None, feeds)
    if library == "numpy":
        epoch, grads = products_loop(problem, batch, np.matmul, np.asarray)
    else:  # as benchmarks.bounds.torch_products
        import torch

        epoch, grads = products_loop(problem, batch, torch.mm, torch.from_numpy)
    epoch()
    return [np.asarray(g) for g in grads]


@pytest.mark.parametrize("library", ["onnxruntime", "numpy",
                                     pytest.param("torch", marks=pytest.mark.torch)])
@pytest.mark.parametrize("model", ["mlp", "linear"])
@pytest.mark.parametrize("batch", [500, 1000])  # 1000: onnxruntime splits a one-column gradient
def test_products_floor_computes_every_matrix_product_of_a_step(data, model, batch, library,
                                                                rng):
    X, y = data
    problem = PROBLEMS[model](X, y)  # random weights: the linear model starts from zeros
    problem.weights = [rng.standard_normal(w.shape).astype(np.float32) for w in problem.weights]
    layers = problem.weights[::2]
    activations = [X[-batch:].astype(np.float64)]
    for w in layers:  # no biases, no relu: the products alone
        activations.append(activations[-1] @ w)
    upstream, expected = activations.pop(), []
    for j in reversed(range(len(layers))):
        expected.insert(0, activations[j].T @ upstream)
        upstream = upstream @ layers[j].T
    ours = last_step_gradients(problem, batch, library)
    assert len(ours) == len(layers)
    for gradient, theirs in zip(ours, expected):  # float32 sums of up to 1000 products
        scale = np.abs(theirs).max()
        assert gradient.shape == theirs.shape and scale > 1
        np.testing.assert_allclose(gradient, theirs, rtol=1e-4, atol=1e-5 * scale)


def test_every_model_has_the_three_floor_rows(data, tmp_path, monkeypatch):
    """numpy, torch and onnxruntime each run a step's matrix products: the floor rows;
    without torch, its row is n/a (Unavailable), not an error."""
    for model in ("mlp", "linear"):
        floors = {row.name: factory for row, factory in line_up(PROBLEMS[model](*data), [],
                                                                 tmp_path)
                  if row.kind == "floor"}
        assert list(floors) == ["matrix products (numpy)", "matrix products (torch)",
                                "matrix products (onnxruntime)"]
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(Unavailable, match="torch is not installed"):
        floors["matrix products (torch)"](PROBLEMS["linear"](*data), 100)


def fabricated_run(model: str, ms: dict[str, dict[int, float | None]]) -> ModelRun:
    """A ModelRun whose rows (named as the harness names them) took ``ms`` per epoch."""
    kinds = {"numpy": "peer", "torch eager": "peer", "hand-written graph": "bound",
             "matrix products (numpy)": "floor", "matrix products (torch)": "floor",
             "matrix products (onnxruntime)": "floor", "lossgraph fuse=step": "lossgraph",
             "lossgraph fuse=epoch": "lossgraph"}
    rows = [Row(name, kinds[name], ms=times) for name, times in ms.items()]
    problem = Problem(model, np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), [],
                      None, [])
    return ModelRun(problem, rows, [])


def test_report_judges_each_cell_against_the_floor_and_the_fastest_peer(capsys):
    """The floor of a cell is its fastest matrix-products row (a row that could not run
    is left out); the MLP's targets: batch 100 against the fastest peer, 1000 and 10000
    against the floor; linear regression's against numpy, with the floor's ratio beside
    (made-up timings: the report's arithmetic, not a measurement)."""
    from benchmarks.report import FASTEST_PEER, FLOOR, TARGETS, report_model, to_json

    batches = [100, 1000, 10000]
    ms = {"numpy": {100: 200.0, 1000: 90.0, 10000: 80.0},
          "torch eager": {100: 1000.0, 1000: 160.0, 10000: 70.0},
          "hand-written graph": {100: 120.0, 1000: 70.0, 10000: 66.0},
          "matrix products (numpy)": {100: 80.0, 1000: 40.0, 10000: 50.0},
          "matrix products (torch)": {100: None, 1000: None, 10000: 30.0},
          "matrix products (onnxruntime)": {100: 60.0, 1000: 45.0, 10000: 35.0},
          "lossgraph fuse=step": {100: 150.0, 1000: 70.0, 10000: 44.0},
          "lossgraph fuse=epoch": {100: 100.0, 1000: 50.0, 10000: 48.0}}
    mlp = report_model(fabricated_run("mlp", ms), batches, 100_000)
    assert {b: f.name for b, f in mlp.floor.items()} == {
        100: "matrix products (onnxruntime)", 1000: "matrix products (numpy)",
        10000: "matrix products (torch)"}
    assert {b: f.name for b, f in mlp.fastest.items()} == {
        100: "numpy", 1000: "numpy", 10000: "torch eager"}
    verdicts = {v["batch"]: v for v in mlp.targets}
    assert [(verdicts[b]["against"], verdicts[b]["limit"]) for b in batches] == [
        (TARGETS["mlp"][b].against, TARGETS["mlp"][b].limit) for b in batches] == [
        (FASTEST_PEER, 0.55), (FLOOR, 1.5), (FLOOR, 1.5)]
    expected = {100: ("lossgraph fuse=epoch", 100 / 200, "PASS", 100 / 60),
                1000: ("lossgraph fuse=epoch", 50 / 40, "PASS", 50 / 40),
                10000: ("lossgraph fuse=step", 44 / 30, "PASS", 44 / 30)}
    for b, (best, ratio, verdict, to_floor) in expected.items():
        assert verdicts[b]["best"] == best and verdicts[b]["verdict"] == verdict
        assert verdicts[b]["ratio"] == pytest.approx(ratio)
        assert verdicts[b]["ratio_to_floor"] == pytest.approx(to_floor)
    assert verdicts[10000]["bounds"] == {"hand-written graph": pytest.approx(66 / 30)}
    assert verdicts[100]["bounds"] == {"hand-written graph": pytest.approx(120 / 200),
                                       "floor": pytest.approx(60 / 200)}
    printed = capsys.readouterr().out
    assert "44.0 ms (0.63x, 1.47x floor)" in printed  # lossgraph at batch 10000
    assert "30.0 ms (0.43x)^" in printed and "200.0 ms (1.00x)*" in printed
    assert "batch 1000: lossgraph fuse=epoch 1.25x the floor [matrix products (numpy)]" \
        in printed

    ms["lossgraph fuse=epoch"] = {100: 300.0, 1000: 62.0, 10000: None}  # slower, or n/a
    ms["lossgraph fuse=step"] = {100: 150.0, 1000: 70.0, 10000: None}
    missed = {v["batch"]: v["verdict"] for v in report_model(
        fabricated_run("mlp", ms), batches, 100_000).targets}
    assert missed == {100: "MISS", 1000: "MISS", 10000: "untested (n/a)"}
    capsys.readouterr()

    linear = report_model(fabricated_run("linear", ms), batches, 100_000)
    judged = [v for v in linear.targets if v["ratio"] is not None]
    assert [v["batch"] for v in judged] == [100, 1000]
    for v in judged:
        assert v["against"] == v["reference"] == "numpy"
        assert v["ratio_to_floor"] == pytest.approx(
            ms[v["best"]][v["batch"]] / ms[linear.floor[v["batch"]].name][v["batch"]])
    printed = capsys.readouterr().out  # batch 1000: 62 / 90 and 62 / 40
    assert "62.0 ms (0.69x, 1.55x floor)" in printed
    assert "batch 1000: lossgraph fuse=epoch 0.69x numpy (target <= 1.0x): PASS | 0.69x the " \
           "fastest peer | 1.55x the floor" in printed
    figures = to_json({}, {"mlp": mlp}, 1, 100_000)["models"]["mlp"]
    assert figures["floor"]["10000"] == {"row": "matrix products (torch)", "ms_per_epoch": 30.0}
    by_name = {row["name"]: row for row in figures["rows"]}
    assert by_name["lossgraph fuse=step"]["ratio_to_floor"]["10000"] == pytest.approx(44 / 30)
    assert by_name["matrix products (torch)"]["ms_per_epoch"]["100"] is None


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
    """The CNN, transformer, ResNet block, LSTM and MobileNetV3 benchmark on tiny networks:
    every lossgraph mode runs, trains the export to torch's weights after the same steps
    (every weight compared, and they moved), and the report has a ratio per mode (no timing
    is checked); the saved exports then run without torch (lossgraph only). ResNet-18 is
    left out: it has no tiny form, and its quick run alone takes 20 s here."""
    import torch

    from benchmarks import model_speed as bench

    out, models = tmp_path / "speed.json", tmp_path / "models"
    workloads = [name for name in bench.WORKLOADS if name != "resnet18"]
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--threads", "1", "--json", str(out), "--workloads",
                           ",".join(workloads), "--save-models", str(models)]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    assert [w["workload"] for w in figures["workloads"]] == workloads
    targets = {w["workload"]: w["bound"]["target"] for w in figures["workloads"]}
    assert targets == {"cnn": 0.8, "transformer": 0.8, "resnet": None, "lstm": None,
                       "mobilenet_v3": None}
    assert bench.WORKLOADS["resnet18"].target == 1.3
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
    plot = tmp_path / "speed.png"
    assert bench.main(["--quick", "--workloads", "cnn,lstm", "--models", str(models),
                       "--json", str(out), "--plot", str(plot)]) == 0  # replaces its own JSON
    printed = capsys.readouterr().out
    assert "(needs torch)" in printed and "lossgraph fuse=epoch" in printed
    if importlib.util.find_spec("matplotlib"):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and bench.is_benchmark_output(plot)


def test_model_speed_never_replaces_a_file_it_did_not_write(tmp_path):
    from benchmarks import model_speed as bench

    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--workloads", "cnn", "--plot", str(mine)])
    assert mine.read_text() == '{"mine": true}'


@pytest.mark.torch
def test_first_fit_quick_run_specializes_to_the_same_graph_before_and_after(tmp_path, capsys):
    """The first-fit benchmark in quick mode: each fuse mode's first fit runs with the
    shape inference of before and of now, both specialize to the same graph and train to
    the same loss (no timing is checked)."""
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    from benchmarks import first_fit as bench

    out = tmp_path / "first_fit.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    assert set(figures["cells"]) == {f"small_cnn/{fuse}" for fuse in bench.FUSES}
    for pair in figures["cells"].values():
        before, after = pair["before"], pair["after"]
        assert before["graph"] == after["graph"]
        assert before["loss"] == after["loss"]
        assert after["fit_s"] > 0 and after["specialize_s"] > 0
    assert "| small_cnn | epoch |" in capsys.readouterr().out


def test_cli_speed_times_the_commands_it_names_and_reports_each(tmp_path, capsys):
    """Each lossgraph row does what its name says (status and message checked by the run);
    the report prints every row with what it imported (no timing is judged here). The
    real training run is left to the benchmark (it loads onnxruntime: seconds here); a
    floor row shows that an import is seen."""
    import os
    from pathlib import Path

    from benchmarks import cli_speed as bench

    environment = {**os.environ, "PYTHONPATH": str(Path(bench.ROOT))}
    bench.prepare(tmp_path, environment)
    listed = [row for row in bench.rows(real_run=False) if row.lossgraph]
    measured = {}
    for row in listed:
        wall, cpu = bench.timed(row, tmp_path, environment)  # asserts status and message
        assert wall > 0 and cpu >= 0
        measured[row.name] = bench.Timing([wall], [cpu], bench.imported(row, tmp_path,
                                                                        environment))
    assert all(timing.imported == [] for timing in measured.values())
    floor = next(row for row in bench.rows(real_run=False) if row.name == "import onnx")
    assert "onnx" in bench.imported(floor, tmp_path, environment)
    verdicts = bench.report({"here": measured}, 1, listed)
    printed = capsys.readouterr().out
    assert all(row.name in printed for row in listed)
    assert len(verdicts) == sum(row.target for row in listed) == 4


@pytest.mark.torch
def test_memory_cells_train_what_they_say_and_the_report_shows_every_column(tmp_path, capsys):
    """The memory benchmark on its quick CNN: the export made in a fresh process (as every
    cell of a run is), then each cell run here: torch and every fuse mode train their steps
    (the epoch modes two epochs of 3), from the file too (``auto`` and ``file-auto``
    with a recomputation plan, the others without), each cell has a peak and the peak
    after each step, compile's told against the weights; the report shows them. A file the
    benchmark did not write is never replaced."""
    from benchmarks import memory as bench

    row = bench.run_worker({"task": "export", "subject": "cnn", "quick": True,
                            "folder": str(tmp_path), "checkout": None}, limit_gib=4)
    assert row["parameters"] > 0 and (tmp_path / "cnn.onnx").exists()
    subject = bench.SUBJECTS["cnn"]
    row["torch"] = bench.torch_cell(subject, True, threads=1)
    trained = ("step", "epoch", "separate", "auto", "file", "file-epoch", "file-separate",
               "file-auto")
    for column in (*trained, "compile"):
        row[column] = bench.lossgraph_cell(subject, True, column, tmp_path, threads=1)
    assert [row[c]["steps"] for c in trained] == [3, 6, 3, 3, 3, 6, 3, 3]
    assert all(len(row[c]["steps_mb"]) == bench.STEPS for c in ("torch", *trained)
               if c not in ("epoch", "file-epoch"))
    # a recomputation plan (the tiny CNN's: one boundary, after which its tail is kept)
    assert row["auto"]["boundaries"] > 0 and row["file-auto"]["boundaries"] > 0
    assert row["step"]["boundaries"] == row["file"]["boundaries"] == 0
    # the baseline (VmRSS) and the peak (VmHWM, which Linux updates lazily) are read at
    # different moments: a cell that adds nearly nothing may read a fraction of a MiB below
    assert all(row[c]["peak_mb"] > -1 for c in bench.COLUMNS)
    assert row["torch"]["model_mb"] >= 0
    bench.report({"cnn": row}, list(bench.COLUMNS))
    printed = capsys.readouterr().out
    assert all(bench.COLUMNS[c] in printed for c in bench.COLUMNS)
    assert "| cnn (" in printed and "x the weights, " in printed and "x stored)" in printed
    whole = {"torch": {"peak_mb": 10, "model_mb": 5}, "file": {"peak_mb": 12}}
    assert bench.cell_text(whole, "file", None) == "12 (0.80x torch's 15 with its network)"
    foreign = tmp_path / "notes.json"
    foreign.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--json", str(foreign)])
    assert foreign.read_text() == "{}"


@pytest.mark.torch
def test_training_options_quick_run_trains_every_variant_to_torchs_weights(tmp_path, capsys):
    """The cost of the fine-tuning options on a tiny MLP, one fuse mode: every variant
    (schedule, decay groups, label smoothing with class weights, accumulation, the larger
    batch) trains the export to torch's weights after the same epochs, and the report has
    a cell for each (no timing is checked)."""
    import torch

    from benchmarks import training_options as bench

    out = tmp_path / "options.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--workloads", "mlp", "--fuses", "epoch", "--steps", "4",
                           "--repeat", "1", "--threads", "1", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads(out.read_text())
    assert figures["generator"] == bench.BENCHMARK_MARK
    cells = figures["results"]["mlp"]
    assert set(cells) == {"torch", "lossgraph epoch"}
    for cell in cells.values():
        assert set(cell["ms_per_batch"]) == set(bench.VARIANTS)
    moved = cells["torch"]["moved"]
    for variant, difference in cells["lossgraph epoch"]["check"].items():
        assert difference < 1e-6 and moved[variant] > 100 * difference, (variant, difference)
    assert "| mlp | lossgraph epoch |" in capsys.readouterr().out


@pytest.mark.torch
def test_lora_cells_train_what_they_say_and_the_report_judges_both_goals(tmp_path, capsys):
    """The LoRA benchmark on its tiny BERT, each cell run here: lossgraph's LoRA trains the
    adapters alone, as many parameters as PEFT's (rank 8 on ``query`` and ``value``), both
    full fine-tunings every parameter torch has; lossgraph's
    optimizer state is AdamW's two moments of what it trains; the floor runs the LoRA
    step's products, and the phases take its peak apart. The report shows every run and a
    verdict on each goal. A file the benchmark did not write is never replaced."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from benchmarks import lora as bench
    from benchmarks import memory

    row = memory.export(memory.SUBJECTS["bert"], True, tmp_path)
    threads = torch.get_num_threads()
    try:
        for column in bench.COLUMNS:
            row[column] = bench.cell(column, "bert", True, tmp_path, threads=1)
    finally:
        torch.set_num_threads(threads)
    trainers = [column for column in bench.COLUMNS if column not in ("floor", "phases")]
    trained = {column: row[column]["trained_parameters"] for column in trainers}
    adapters = trained["peft"]
    assert 0 < adapters < row["parameters"] / 5
    assert trained == {"torch": row["parameters"], "peft": adapters, "full": row["parameters"],
                       "lora": adapters}
    for column in ("full", "lora"):
        assert row[column]["optimizer_state_mb"] * 2**20 == 2 * 4 * trained[column]
        assert row[column]["steps"] == memory.STEPS
    assert "MatMul" in row["floor"]["kernels"] and row["floor"]["step_ms"] > 0
    assert [p["phase"].split(":")[0] for p in row["phases"]["phases"]] == [
        "compiled", "train_step specialized to the batch, the program alive", "its session made",
        "the session, the graph dropped", "one step run"]
    verdicts = bench.report({"bert": row}, list(bench.COLUMNS))
    printed = capsys.readouterr().out
    assert all(f"| {bench.COLUMNS[c]} | {trained[c]:,} |" in printed for c in trainers)
    assert [v["goal"].split()[0] for v in verdicts] == ["peak", "step"]
    assert all(v["verdict"] in ("PASS", "MISS") for v in verdicts)
    foreign = tmp_path / "notes.json"
    foreign.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--json", str(foreign)])
    assert foreign.read_text() == "{}"
