"""TrainingProgram (lossgraph/program.py): saved and loaded, it trains the same; saving over a
program replaces it whole; every graph is exported valid and described by the manifest."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
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
