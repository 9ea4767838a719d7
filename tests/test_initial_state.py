"""InitialState (lossgraph/initial_state.py): a program compiled from a large ModelProto
or model file reads its initial weights from it when asked for instead of keeping a copy
of them (issue 27: the weights held once), trains and saves exactly as a program holding
them, and names a model changed after compile instead of starting from other weights."""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import BIG, large_weights_model, read_state_model, saved, tower

import lossgraph
from lossgraph import initial_state
from lossgraph.errors import ModelChangedError
from lossgraph.graphs.spans import initializer_spans
from lossgraph.optim import SGD, AdamW

RNG = np.random.default_rng(5)
X = RNG.standard_normal((24, BIG[0])).astype(np.float32) / 32
Y = RNG.standard_normal((24, 4)).astype(np.float32)


@pytest.fixture
def read_small(monkeypatch):
    """Programs read their state from the model however small it is (the test models'
    ``W``, 128 KiB, is large enough for a weight to be read)."""
    monkeypatch.setattr(initial_state, "READ_MIN_BYTES", 0)


def _compile(model, fuse="step", optimizer=None):
    return lossgraph.compile_program(model, loss="squared_error", fuse=fuse,
                                     optimizer=optimizer or SGD(0.001))


def _fit(program, **options):
    return lossgraph.Trainer(program, **options).fit(X, Y, epochs=2, batch_size=8,
                                                     random_state=0, progress=False)


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("optimizer", [SGD(0.001), AdamW(0.001)], ids=["sgd", "adamw"])
def test_a_state_read_from_the_model_trains_bit_for_bit_as_one_held(read_small, fuse,
                                                                     optimizer):
    model = large_weights_model()
    given = model.SerializeToString()
    reading = _compile(model, fuse, optimizer)
    holding = _compile(given, fuse, optimizer)  # bytes: the program keeps its own copy
    assert reading.state.read == {"W"} and holding.state.read == frozenset()
    a, b = _fit(reading), _fit(holding)
    for name in holding.state:
        np.testing.assert_array_equal(a.state[name], b.state[name])
        np.testing.assert_array_equal(reading.state[name], holding.state[name])
    assert model.SerializeToString() == given  # the model is read, never written


def test_reset_save_pickle_and_export_read_the_state_from_the_model(read_small, tmp_path):
    model = large_weights_model()
    program = _compile(model)
    W = numpy_helper.to_array(model.graph.initializer[0])
    trainer = _fit(program)
    assert not np.array_equal(trainer.state["W"], W)
    trainer.reset()
    np.testing.assert_array_equal(trainer.state["W"], W)
    program.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    copied = pickle.loads(pickle.dumps(program))
    # nothing refers to the model: the copy holds its values, the folder's read from it
    assert (loaded.state.read, copied.state.read) == ({"W"}, frozenset())
    for other in (loaded, copied):
        np.testing.assert_array_equal(other.state["W"], W)
    exported = {t.name: t for t in program.inference_model.graph.initializer}
    assert exported["W"].SerializeToString() == model.graph.initializer[0].SerializeToString()


def test_a_model_changed_after_compile_is_named_not_trained_from(read_small, tmp_path):
    model = large_weights_model()
    program = _compile(model)
    weight = model.graph.initializer[0]
    weight.raw_data = weight.raw_data[:-4] + b"\0\0\0\0"  # the last element: zero
    assert "W" in program.state and program.state.like("W").shape == BIG  # without reading
    for read in (lambda: lossgraph.Trainer(program), lambda: program.inference_model,
                 lambda: program.save(tmp_path / "prog"), lambda: program.state["W"]):
        with pytest.raises(ModelChangedError, match="initializer 'W' is not the value "
                                                    "compiled.*compile a copy of it"):
            read()
    assert not (tmp_path / "prog").exists()
    weight.raw_data = weight.raw_data[:-4]  # of another size than its dims
    with pytest.raises(ModelChangedError, match="initializer 'W' is not the value compiled"):
        program.state["W"]
    del model.graph.initializer[0]
    with pytest.raises(ModelChangedError, match="initializer 'W' is gone"):
        program.state["W"]


def test_a_trainer_made_before_the_change_trains_on_until_it_resets(read_small):
    model = large_weights_model()
    trainer = lossgraph.Trainer(_compile(model))
    weight = model.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 2, "W"))
    trainer.fit(X, Y, epochs=1, batch_size=8, progress=False, warm_start=True)
    assert np.isfinite(trainer.state["W"]).all()
    with pytest.raises(ModelChangedError):
        trainer.reset()


def test_a_value_set_is_held_and_no_longer_read(read_small):
    model = large_weights_model()
    program = _compile(model)
    program.state["W"] = np.ones(BIG, np.float32)
    assert program.state.read == frozenset()
    del model.graph.initializer[:]  # nothing is read from the model any more
    trainer = lossgraph.Trainer(program)
    np.testing.assert_array_equal(trainer.state["W"], np.ones(BIG, np.float32))


def test_only_large_weights_the_model_object_holds_under_their_names_are_read(
        monkeypatch, tmp_path):
    """Below READ_MIN_BYTES of them nothing is read; a model given as bytes has nothing to
    read from; a small weight (``S``, 2 KiB) and optimizer states are held."""
    model = large_weights_model()
    assert _compile(model).state.read == frozenset()  # 128 KiB of weights
    onnx.save(model, tmp_path / "m.onnx")
    assert _compile(tmp_path / "m.onnx").state.read == frozenset()
    monkeypatch.setattr(initial_state, "READ_MIN_BYTES", 0)
    assert _compile(model.SerializeToString()).state.read == frozenset()
    assert _compile(model, optimizer=AdamW(0.001)).state.read == {"W"}
    assert _compile(tower()).state.read == frozenset()  # every weight under 64 KiB


def test_a_real_size_model_is_read_by_default():
    """64 MiB of weights: the default threshold, no patching."""
    model = read_state_model()
    program = _compile(model)
    assert program.state.read == {"W"}
    trainer = lossgraph.Trainer(program)
    np.testing.assert_array_equal(trainer.state["W"],
                                  numpy_helper.to_array(model.graph.initializer[0]))


def test_a_model_saved_with_external_data_since_is_named(read_small, tmp_path):
    """onnx.save(..., save_as_external_data=True) moves the data out of the model object
    it is given: the program says so rather than read an empty tensor."""
    model = large_weights_model()
    program = _compile(model)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, size_threshold=1024)
    with pytest.raises(ModelChangedError, match="'W' has its data in an external file now"):
        lossgraph.Trainer(program)


def test_initializers_reordered_since_compile_are_found_by_name(read_small):
    """The values are read by name: a model whose initializers moved (same bytes) is the
    model compiled."""
    model = large_weights_model()
    program = _compile(model)
    W = numpy_helper.to_array(model.graph.initializer[0])
    tensors = [onnx.TensorProto() for _ in model.graph.initializer]
    for copy, tensor in zip(tensors, model.graph.initializer):
        copy.CopyFrom(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(reversed(tensors))
    np.testing.assert_array_equal(lossgraph.Trainer(program).state["W"], W)


# -- a model given as a file -------------------------------------------------------------
def _saved(tmp_path, external: bool = False):
    model = large_weights_model()
    return model, saved(model, tmp_path / "m.onnx", external)


@pytest.mark.parametrize("external", [False, True], ids=["in-the-file", "external-data"])
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_a_state_read_from_the_model_file_trains_bit_for_bit_as_one_held(
        read_small, tmp_path, fuse, external):
    model, path = _saved(tmp_path, external)
    given = path.read_bytes()
    reading = _compile(path, fuse)
    holding = _compile(model.SerializeToString(), fuse)
    assert reading.state.read == {"W"}
    a, b = _fit(reading), _fit(holding)
    for name in holding.state:
        np.testing.assert_array_equal(a.state[name], b.state[name])
        np.testing.assert_array_equal(reading.state[name], holding.state[name])
    assert not reading.state["W"].flags.writeable
    assert path.read_bytes() == given  # read, never written


def test_a_file_program_resets_saves_and_pickles_from_the_file(read_small, tmp_path,
                                                               monkeypatch):
    """Compiled from a relative path, it reads the same file from another folder."""
    model, path = _saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    program = _compile("m.onnx")
    monkeypatch.chdir(tmp_path.parent)
    W = numpy_helper.to_array(model.graph.initializer[0])
    trainer = _fit(program)
    trainer.reset()
    np.testing.assert_array_equal(trainer.state["W"], W)
    program.save(tmp_path / "prog")
    copied = pickle.loads(pickle.dumps(program))  # its own copy: another process has no file
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")  # read from its own folder
    assert (loaded.state.read, copied.state.read) == ({"W"}, frozenset())
    for other in (loaded, copied):
        np.testing.assert_array_equal(other.state["W"], W)


@pytest.mark.parametrize("external", [False, True], ids=["in-the-file", "external-data"])
def test_a_model_file_changed_after_compile_is_named_not_trained_from(read_small, tmp_path,
                                                                       external):
    model, path = _saved(tmp_path, external)
    program = _compile(path)
    data = path.with_name("m.data") if external else path
    span = initializer_spans(path)["W"]
    raw = bytearray(data.read_bytes())
    raw[span.offset + span.length - 4:span.offset + span.length] = bytes(4)  # the last: zero
    data.write_bytes(bytes(raw))
    with pytest.raises(ModelChangedError, match=f"model file '{path}'.*initializer 'W' is not "
                                                "the value compiled.*compile it again"):
        lossgraph.Trainer(program)
    data.write_bytes(bytes(raw[:span.offset + 8]))  # cut short
    with pytest.raises(ModelChangedError, match="'W' cannot be read from .*cut short"):
        program.state["W"]


@pytest.mark.parametrize("external", [False, True], ids=["in-the-file", "external-data"])
def test_a_model_file_replaced_or_removed_after_compile_still_reads_as_compiled(
        read_small, tmp_path, external):
    """The program keeps the file open: another file saved in its place (a new file
    renamed over it, as onnx.save and lossgraph's writes do) or the file removed, it
    reads the bytes it compiled."""
    model, path = _saved(tmp_path, external)
    program = _compile(path)
    W = numpy_helper.to_array(model.graph.initializer[0])
    other = large_weights_model(numpy_helper.from_array(np.zeros_like(W), "W"))
    saved(other, tmp_path / "other.onnx", external)
    (tmp_path / "other.onnx").replace(path)
    if external:
        (tmp_path / "m.data").unlink()
    np.testing.assert_array_equal(lossgraph.Trainer(program).state["W"], W)
    path.unlink()
    np.testing.assert_array_equal(program.state["W"], W)


def test_a_file_the_walk_cannot_read_gives_no_spans_and_the_state_is_held(read_small,
                                                                          tmp_path):
    """A model whose bytes are not where the walk says (two ``graph`` fields, which
    protobuf merges) holds its state; so does a file that is not one."""
    model, path = _saved(tmp_path)
    graph = model.graph.SerializeToString()
    key = bytes([7 << 3 | 2])  # ModelProto.graph, length-delimited
    empty = onnx.GraphProto(name="empty").SerializeToString()
    path.write_bytes(path.read_bytes() + key + bytes([len(empty)]) + empty)
    assert initializer_spans(path) == {}
    assert len(graph) > 0 and _compile(path).state.read == frozenset()
    (tmp_path / "empty").write_bytes(b"")
    assert initializer_spans(tmp_path / "empty") == {}


# -- a program folder ----------------------------------------------------------------------
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_a_loaded_program_reads_its_state_from_its_folder_and_trains_as_the_saved_one(
        read_small, tmp_path, fuse):
    """A program folder's large arrays are read from its state archive, kept open: the
    loaded program trains bit for bit as the one saved, the folder saved again over (the
    archive replaced) or removed since."""
    program = _compile(large_weights_model(), fuse, AdamW(0.001))
    program.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    assert loaded.state.read == {"W", "W_m", "W_v"}  # AdamW's moments, as large, too
    lossgraph.TrainingProgram.load(tmp_path / "prog").save(tmp_path / "prog")
    a, b = _fit(loaded), _fit(program)
    for name in program.state:
        np.testing.assert_array_equal(a.state[name], b.state[name])
    assert not loaded.state["W"].flags.writeable
    assert pickle.loads(pickle.dumps(loaded)).state.read == frozenset()


def test_a_state_archive_written_into_after_load_is_named(read_small, tmp_path):
    program = _compile(large_weights_model())
    program.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    archive = tmp_path / "prog" / "state.npz"
    raw = bytearray(archive.read_bytes())
    where = raw.find(np.asarray(program.state["W"]).tobytes()[:64])
    raw[where:where + 4] = bytes(4)
    with open(archive, "r+b") as file:  # in place: the file the program keeps open
        file.write(raw)
    with pytest.raises(ModelChangedError, match="state file .*state.npz' this program was "
                                                "loaded from changed after it was loaded: "
                                                "its array 'W' is not the value loaded"):
        lossgraph.Trainer(loaded)


def test_a_small_archive_is_held_as_loaded(tmp_path):
    """Below READ_MIN_BYTES, the arrays are read at load and held, writable, as np.load
    gives them."""
    program = _compile(large_weights_model())
    program.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    assert loaded.state.read == frozenset() and loaded.state["W"].flags.writeable
    np.testing.assert_array_equal(loaded.state["W"], program.state["W"])
