"""TrainingProgram (lossgraph/program.py): saved and loaded, it trains the same; saving over a
program replaces it whole; every graph is exported valid and described by the manifest."""

from __future__ import annotations

import json
import pickle

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.linear import linear_data, linear_program

import lossgraph
from lossgraph.errors import InvalidModelError


@pytest.fixture(scope="module")
def data():
    return linear_data(205, seed=11)


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_program_save_load_round_trip_trains_the_same(data, tmp_path, mode):
    X, y = data
    original = linear_program(mode, penalty={"coef": 0.01})
    original.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    assert loaded.manifest == original.manifest
    a = lossgraph.Trainer(original).fit(X, y, epochs=2, random_state=0, progress=False)
    b = lossgraph.Trainer(loaded).fit(X, y, epochs=2, random_state=0, progress=False)
    np.testing.assert_array_equal(a.state["coef"], b.state["coef"])


def test_a_program_holds_each_weight_once_and_gives_its_inference_model_back_whole(data):
    """The inference model is kept without the data of the weights the state holds (a
    second copy of every weight, issue 27) and put back, to the byte, when asked for; a
    state that is not the model's (a checkpoint's trained weights) leaves the model whole."""
    program = linear_program("step")
    model = program.inference_model
    for tensor in model.graph.initializer:  # as exporters store weights: raw data
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
    held = lossgraph.TrainingProgram(program.graphs, program.manifest, program.state, model)
    kept, apart = held._inference
    assert apart == {"coef", "intercept"}
    assert all(not t.raw_data for t in kept.graph.initializer if t.name in apart)
    assert held.inference_model.SerializeToString() == model.SerializeToString()
    for graph in program.graphs.values():  # nor does a session of a training graph
        assert not apart & {t.name for t in graph.graph.initializer}
    trainer = lossgraph.Trainer(held).fit(*data, epochs=1, progress=False)
    trained = lossgraph.TrainingProgram(program.graphs, program.manifest, trainer.state, model)
    assert trained._inference[1] == frozenset()
    assert trained.inference_model.SerializeToString() == model.SerializeToString()


def test_saving_over_a_program_replaces_it_whole(tmp_path):
    linear_program("epoch").save(tmp_path / "prog")
    linear_program("step").save(tmp_path / "prog")
    manifest = json.loads((tmp_path / "prog" / "manifest.json").read_text())
    assert manifest["fuse"] == "step"
    assert not (tmp_path / "prog" / "train_epoch.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog"]


def test_loading_a_folder_without_a_program_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidModelError, match="manifest.json"):
        lossgraph.TrainingProgram.load(tmp_path)


@pytest.mark.parametrize("mode", ["separate", "step", "epoch"])
def test_every_graph_is_exported_valid_and_described_by_the_manifest(tmp_path, mode, ort_session):
    prog = linear_program(mode, penalty={"coef": 0.1})
    as_bytes = prog.save_onnx_graph()
    paths = prog.save_onnx_graph(tmp_path)
    assert sorted(as_bytes) == sorted(paths) == sorted(prog.manifest["graphs"])
    for name, serialized in as_bytes.items():
        model = onnx.load_model_from_string(serialized)
        onnx.checker.check_model(model, full_check=True)
        assert {d.domain for d in model.graph.node} <= {""}
        session = ort_session(model)
        described = prog.manifest["graphs"][name]
        assert [i.name for i in session.get_inputs()] == [i["name"] for i in described["inputs"]]
        assert [o.name for o in session.get_outputs()] == [o["name"]
                                                           for o in described["outputs"]]
        assert paths[name].read_bytes() == serialized


# -- frozen weights held once -----------------------------------------------------------------


def _held_arrays(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from lossgraph.graphs import stored_tensors
    from lossgraph.graphs.held import held_tensors

    found = {}
    for tensor, store, key in held_tensors(stored_tensors(model)):
        assert not tensor.raw_data  # light: no data of its own
        found[tensor.name] = store.array(key)
    return found


def _assert_held_once(program: lossgraph.TrainingProgram) -> None:
    frozen = program.frozen
    assert frozen["fc1.weight"].nbytes == 128 * 128 * 4 and not frozen["fc1.weight"].flags.writeable
    readers = [*program.light_graphs.values(), program._inference[0]]
    held = [array for model in readers for array in _held_arrays(model).values()]
    assert {id(array) for array in held} == {id(frozen["fc1.weight"])}  # the one large one
    assert sum("fc1.weight" in _held_arrays(m) for m in readers) >= 3  # graphs, inference
    whole = program.graphs["evaluate"]  # a whole model when read
    tensor = next(t for t in whole.graph.initializer if t.name == "fc1.weight")
    assert tensor.raw_data == frozen["fc1.weight"].tobytes()


@pytest.mark.parametrize(("kind", "fuse"), [("lora", "step"), ("weights", "step"),
                                           ("lora", "epoch")])
def test_frozen_weights_are_held_once_and_saved_whole(kind, fuse, tmp_path):
    """Compiled, loaded or unpickled, a program holds its large frozen weight once (an
    epoch graph's Scan body reads a copy of it under another name) and writes it whole."""
    from support.frozen import frozen_program

    program = frozen_program(kind, fuse)
    _assert_held_once(program)
    program.save(tmp_path / "a")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "a")  # held once again, from files
    _assert_held_once(loaded)
    loaded.save(tmp_path / "b")
    assert {f.name: f.read_bytes() for f in (tmp_path / "a").iterdir()} == \
        {f.name: f.read_bytes() for f in (tmp_path / "b").iterdir()}
    assert program.save_onnx_graph() == loaded.save_onnx_graph()
    copied = pickle.loads(pickle.dumps(program))  # a store lives in one process: whole models
    _assert_held_once(copied)
    assert copied.save_onnx_graph() == program.save_onnx_graph()
