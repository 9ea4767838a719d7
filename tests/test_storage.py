"""Program and checkpoint folders: safe to save (never over foreign files, atomic, umask),
careful to load (every damage a named error before any training)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.catalogue import Row, assert_listed, message_of, print_table, slug
from support.linear import linear_model

import lossgraph
from lossgraph import fileio, storage
from lossgraph.cli import main as cli
from lossgraph.errors import InvalidDataError, InvalidProgramError, UnsafeWriteError

MODEL = linear_model((0.5, -0.25, 1), 0.1)


def compiled(fuse: str = "step") -> lossgraph.TrainingProgram:
    return lossgraph.compile_program(MODEL, optimizer=lossgraph.optim.Momentum(0.01), fuse=fuse)


def data(rows: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, 3)).astype(np.float32)
    return X, (X @ np.array([[1.0], [2.0], [-1.0]], np.float32)).astype(np.float32)


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: proof that nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.fixture
def saved(tmp_path) -> Path:
    folder = tmp_path / "prog"
    compiled().save(folder)
    return folder


# -- saving never destroys what lossgraph did not write -------------------------------------

SAVES: dict[str, Callable[[Path], object]] = {
    "program.save": lambda path: compiled().save(path),
    "save_checkpoint": lambda path: lossgraph.Trainer(compiled()).save_checkpoint(path),
    "cli compile -o": lambda path: _cli_compile(path),
}


def _cli_compile(path: Path) -> None:
    """``lossgraph compile MODEL -o path``; its message raised as an UnsafeWriteError."""
    message = io.StringIO()
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stderr(message):
        onnx.save(MODEL, Path(folder) / "model.onnx")
        status = cli(["compile", str(Path(folder) / "model.onnx"), "-o", str(path)])
    if status != 0:
        raise UnsafeWriteError(message.getvalue())


def _users_folder(tmp: Path, save: Callable[[Path], object]) -> Path:
    (tmp / "myproject").mkdir()
    (tmp / "myproject" / "thesis.txt").write_text("three years of work")
    return tmp / "myproject"


def _regular_file(tmp: Path, save: Callable[[Path], object]) -> Path:
    (tmp / "notes").write_text("keep me")
    return tmp / "notes"


def _own_folder_with_a_foreign_file(tmp: Path, save: Callable[[Path], object]) -> Path:
    save(tmp / "out")
    (tmp / "out" / "results.csv").write_text("mine")
    return tmp / "out"


def _link(tmp: Path, save: Callable[[Path], object]) -> Path:
    (tmp / "real").mkdir()
    (tmp / "link").symlink_to(tmp / "real")
    return tmp / "link"


#: Where a save must refuse to write, and a fragment of the UnsafeWriteError it raises.
REFUSED: dict[str, tuple[Callable[[Path, Callable[[Path], object]], Path], str]] = {
    "a folder of the user's files": (_users_folder, "is not empty and is not a lossgraph"),
    "a regular file": (_regular_file, "is a file, not a folder"),
    "lossgraph's folder holding a file of the user's": (_own_folder_with_a_foreign_file,
                                                         "'results.csv', which lossgraph did"),
    "a link": (_link, "is a link"),
    "a folder whose parent is missing": (lambda tmp, save: tmp / "no" / "such" / "out",
                                         "does not exist"),
}


@pytest.mark.parametrize("make, message", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("save", SAVES.values(), ids=SAVES.keys())
def test_saving_refuses_what_lossgraph_did_not_write_and_changes_nothing(tmp_path, save, make,
                                                                         message):
    target = make(tmp_path, save)
    before = listing(tmp_path)
    with pytest.raises(UnsafeWriteError, match=re.escape(message)):
        save(target)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("save", SAVES.values(), ids=SAVES.keys())
def test_saving_twice_replaces_lossgraphs_own_folder(tmp_path, save):
    save(tmp_path / "out")
    save(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_program_does_not_replace_a_checkpoint_nor_the_reverse(tmp_path):
    lossgraph.Trainer(compiled()).save_checkpoint(tmp_path / "ckpt")
    compiled().save(tmp_path / "prog")
    with pytest.raises(UnsafeWriteError, match="not a lossgraph program folder"):
        compiled().save(tmp_path / "ckpt")
    with pytest.raises(UnsafeWriteError, match="not a lossgraph checkpoint folder"):
        lossgraph.Trainer(compiled()).save_checkpoint(tmp_path / "prog")


def test_an_empty_folder_is_used(tmp_path):
    (tmp_path / "empty").mkdir()
    compiled().save(tmp_path / "empty")
    assert lossgraph.TrainingProgram.load(tmp_path / "empty").fuse == "step"


def test_saving_leaves_the_current_directorys_other_files_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.csv").write_text("1,2,3")
    (tmp_path / ".hidden").write_text("x")
    compiled().save("prog")
    compiled("epoch").save("prog")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "data.csv", "prog"]
    assert (tmp_path / "data.csv").read_text() == "1,2,3"


def test_save_onnx_graph_replaces_its_own_files_but_not_the_users(tmp_path):
    program = compiled()
    program.save_onnx_graph(tmp_path / "graphs")
    program.save_onnx_graph(tmp_path / "graphs")  # its own files: replaced
    (tmp_path / "graphs" / "evaluate.onnx").write_bytes(MODEL.SerializeToString())
    before = listing(tmp_path / "graphs")
    with pytest.raises(UnsafeWriteError, match="evaluate.onnx"):
        program.save_onnx_graph(tmp_path / "graphs")
    assert listing(tmp_path / "graphs") == before  # checked before anything was written


def test_save_model_replaces_a_file_only_when_lossgraph_wrote_it_or_when_forced(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(MODEL, path)
    with pytest.raises(UnsafeWriteError, match="overwrite=True"):
        fileio.save_model(MODEL, path)
    fileio.save_model(MODEL, path, overwrite=True)
    assert fileio.written_by_lossgraph(path)
    fileio.save_model(MODEL, path)  # now it is lossgraph's: replaced without force
    assert not MODEL.metadata_props  # the caller's model is not marked


# -- atomic: a failed or killed save leaves the previous program loadable -----------------------


def test_a_save_failing_midway_leaves_the_previous_program_and_no_debris(saved, monkeypatch):
    before = listing(saved)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.np, "savez", disk_full)
    with pytest.raises(OSError, match="No space left"):
        compiled("epoch").save(saved)
    assert listing(saved) == before
    assert sorted(p.name for p in saved.parent.iterdir()) == ["prog"]
    assert lossgraph.TrainingProgram.load(saved).fuse == "step"


def test_replacing_without_an_atomic_exchange_still_replaces(saved, monkeypatch):
    monkeypatch.setattr(fileio, "_exchange", lambda a, b: False)
    compiled("epoch").save(saved)
    assert lossgraph.TrainingProgram.load(saved).fuse == "epoch"
    assert sorted(p.name for p in saved.parent.iterdir()) == ["prog"]


@pytest.mark.parametrize("moment", ["while writing", "after writing, before the swap"])
def test_a_save_killed_midway_leaves_the_previous_program_loadable(saved, moment):
    """A child process saves over the program and is killed with SIGKILL part-way."""
    hook = ("storage.np.savez" if moment == "while writing" else "fileio._sync_tree")
    script = textwrap.dedent(f"""
        import os, signal, onnx, lossgraph
        from lossgraph import fileio, storage
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        {hook} = die
        model = onnx.load({str(saved.parent / "model.onnx")!r})
        lossgraph.compile_program(model, fuse="epoch").save({str(saved)!r})
    """)
    onnx.save(MODEL, saved.parent / "model.onnx")
    before = listing(saved)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == -9, result.stderr.decode()
    assert listing(saved) == before
    assert lossgraph.TrainingProgram.load(saved).fuse == "step"
    compiled("epoch").save(saved)  # and the next save works despite the debris
    assert lossgraph.TrainingProgram.load(saved).fuse == "epoch"


# -- permissions follow the umask ----------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_and_folders_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        compiled().save(tmp_path / "prog")
        lossgraph.Trainer(compiled()).save_checkpoint(tmp_path / "ckpt")
        fileio.save_model(MODEL, tmp_path / "model.onnx")
    finally:
        os.umask(previous)
    for path in [tmp_path / "prog", tmp_path / "ckpt", *(tmp_path / "prog").iterdir(),
                 *(tmp_path / "ckpt").rglob("*"), tmp_path / "model.onnx"]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


# -- loading: every damage is a named error, before any training --------------------------


def _rewrite_manifest(folder: Path, change: Callable[[dict], object]) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _drop_checksums(folder: Path) -> None:
    _rewrite_manifest(folder, lambda m: m.pop("files"))


def _truncate(folder: Path, name: str, keep: float = 0.5) -> None:
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[:int(len(data) * keep)])


def _state(folder: Path, change: Callable[[dict], object]) -> None:
    with np.load(folder / "state.npz") as stored:
        arrays = {name: stored[name] for name in stored.files}
    change(arrays)
    np.savez(folder / "state.npz", **arrays)
    _drop_checksums(folder)


def _external_data(folder: Path) -> None:
    model = onnx.load(folder / "evaluate.onnx")
    tensor = onnx.numpy_helper.from_array(np.zeros(4, np.float32), "stolen")
    onnx.external_data_helper.set_external_data(tensor, location="../../etc/passwd")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    model.graph.initializer.append(tensor)
    (folder / "evaluate.onnx").write_bytes(model.SerializeToString())
    _drop_checksums(folder)


def _pickled_state(folder: Path) -> None:
    marker = folder.parent / "pwned"
    payload = np.array([_Exploit(str(marker))], dtype=object)
    np.savez(folder / "state.npz", coef=payload)
    _drop_checksums(folder)


class _Exploit:
    """Unpickling this runs code: it creates a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _foreign_inference(folder: Path) -> None:
    other = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 18]> '
                                    "g (float[N] x) => (float[N] y) { y = Identity(x) }")
    (folder / "inference.onnx").write_bytes(other.SerializeToString())
    _drop_checksums(folder)


def _swap_graphs(folder: Path) -> None:
    evaluate, step = (folder / "evaluate.onnx").read_bytes(), (folder / "train_step.onnx")
    (folder / "evaluate.onnx").write_bytes(step.read_bytes())
    step.write_bytes(evaluate)
    _drop_checksums(folder)


def _outside_link(folder: Path) -> None:
    outside = folder.parent / "elsewhere.onnx"
    outside.write_bytes((folder / "predict.onnx").read_bytes())
    (folder / "predict.onnx").unlink()
    (folder / "predict.onnx").symlink_to(outside)


def _not_utf8(folder: Path, file: str, field: Callable[[onnx.ModelProto], object]) -> None:
    """``file`` with the string ``field`` sets made of a byte that is not UTF-8, as a bit
    flipped in a copy makes it (found by the fuzzer: onnx's checker raised a raw
    UnicodeDecodeError for a graph's output name, and passed an inference model's
    producer name, whose export then raised one)."""
    model = onnx.load(folder / file)
    field(model)
    data = model.SerializeToString().replace(b"PLACEHOLDER", b"\xa7LACEHOLDER")
    (folder / file).write_bytes(data)
    _drop_checksums(folder)


def _untyped_input(folder: Path) -> None:
    """evaluate.onnx's first input of element type 0 (found by the fuzzer: a raw KeyError)."""
    model = onnx.load(folder / "evaluate.onnx")
    model.graph.input[0].type.tensor_type.elem_type = 0
    (folder / "evaluate.onnx").write_bytes(model.SerializeToString())
    _drop_checksums(folder)


def _linear_classifier(folder: Path) -> None:
    """predict.onnx replaced by an ai.onnx.ml LinearClassifier without intercepts, inputs and
    outputs as the manifest says: onnxruntime 1.19 dies of a segmentation fault on it."""
    model = onnx.load(folder / "predict.onnx")
    del model.graph.node[:]
    model.graph.node.append(onnx.helper.make_node(
        "LinearClassifier", ["x"], ["label", "y"], domain="ai.onnx.ml",
        coefficients=[1.0, 2.0, 3.0], classlabels_ints=[0, 1]))
    model.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", 1))
    (folder / "predict.onnx").write_bytes(model.SerializeToString())
    _drop_checksums(folder)


def _swap_entries(manifest: dict) -> None:
    """train_step's and predict's manifest entries swapped, each with its file: each graph
    agrees with its entry, but the Trainer ran predict as the step (a raw KeyError)."""
    graphs = manifest["graphs"]
    graphs["train_step"], graphs["predict"] = graphs["predict"], graphs["train_step"]


def _swap_roles(manifest: dict) -> None:
    roles = manifest["roles"]
    roles["loss"], roles["prediction"] = roles["prediction"], roles["loss"]


def _prediction_shape(manifest: dict, shape: list) -> None:
    for entry in manifest["graphs"]["evaluate"]["outputs"]:
        if entry["name"] == manifest["roles"]["prediction"]:
            entry["shape"] = shape


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "no manifest": (lambda f: (f / "manifest.json").unlink(), "holds no manifest.json"),
    "manifest not JSON": (lambda f: (f / "manifest.json").write_text("{oops"), "not valid JSON"),
    "manifest binary": (lambda f: (f / "manifest.json").write_bytes(b"\xff\xfe\x00"),
                        "not text"),
    "manifest a list": (lambda f: (f / "manifest.json").write_text("[1, 2]"),
                        "expected a JSON object, found list"),
    "another format": (
        lambda f: _rewrite_manifest(f, lambda m: m.update(format="lossgraph-program/9")),
        "this lossgraph reads 'lossgraph-program/1'"),
    "missing key": (lambda f: _rewrite_manifest(f, lambda m: m.pop("weights")),
                    "the key 'weights' is missing"),
    "wrong type": (lambda f: _rewrite_manifest(f, lambda m: m.update(graphs=[])),
                   "'graphs' must be dict"),
    "unknown fuse": (lambda f: _rewrite_manifest(f, lambda m: m.update(fuse="turbo")),
                     "fuse is 'turbo'"),
    "accumulation steps zero": (lambda f: _rewrite_manifest(f, lambda m: m.update(
        accumulation={"steps": 0, "loss_reduction": "mean"})), "accumulation steps must be >= 1"),
    "accumulating graph missing": (lambda f: _rewrite_manifest(f, lambda m: m.update(
        accumulation={"steps": 2, "loss_reduction": "mean"})),
        "needs the graphs train_accumulate, train_step_accumulated"),
    "graph missing from manifest": (
        lambda f: _rewrite_manifest(f, lambda m: m["graphs"].pop("train_step")),
        "needs the graphs train_step"),
    "bad dtype": (lambda f: _rewrite_manifest(
        f, lambda m: m["graphs"]["evaluate"]["inputs"][0].update(dtype="floaty")),
        "'floaty' is not a numpy dtype"),
    "update option unknown": (lambda f: _rewrite_manifest(
        f, lambda m: m.update(update={"clip": 1.0})), "Unknown update option 'clip'"),
    "update option out of range": (lambda f: _rewrite_manifest(
        f, lambda m: m.update(update={"max_grad_norm": -1.0})), "max_grad_norm=-1.0 must be"),
    "averages not listed": (lambda f: _rewrite_manifest(
        f, lambda m: m.update(update={"ema_decay": 0.9})),
        "'ema' lists each weight's average exactly when 'update' holds ema_decay"),
    "average not a state": (lambda f: _rewrite_manifest(f, lambda m: m.update(
        update={"ema_decay": 0.9}, ema={"coef": "coef"})), "each weight maps to its last"),
    "graph file missing": (lambda f: (f / "train_step.onnx").unlink(),
                           "has no file 'train_step.onnx'"),
    "graph truncated": (lambda f: _truncate(f, "train_step.onnx"), "checksum"),
    "graph truncated, no checksums": (lambda f: (_truncate(f, "train_step.onnx"),
                                                 _drop_checksums(f)), "train_step.onnx"),
    "graph empty": (lambda f: ((f / "evaluate.onnx").write_bytes(b""), _drop_checksums(f)),
                    "is empty"),
    "graph corrupt": (lambda f: ((f / "evaluate.onnx").write_bytes(b"\x08\x96\x01garbage" * 9),
                                 _drop_checksums(f)), "not a valid ONNX model"),
    "graphs swapped": (_swap_graphs, "do not belong together"),
    # found by the fuzzer (tests/test_fuzz.py): raw KeyError, IndexError in the Trainer
    "graph input of no element type": (_untyped_input, "('x', 'element type 0')"),
    "graphs' entries swapped": (lambda f: _rewrite_manifest(f, _swap_entries),
                                "the graph 'train_step' ('predict.onnx') has no input or "
                                "output of the role 'label'"),
    "roles swapped": (lambda f: _rewrite_manifest(f, _swap_roles),
                      "the roles name 'y' as the loss, but in the evaluate graph 'y' is its"),
    "prediction shape edited": (lambda f: _rewrite_manifest(f, lambda m: _prediction_shape(
        m, [])), "declares its output 'y' of shape ['N', 1], but the manifest describes []"),
    "graph holding a linear classifier": (_linear_classifier,
                                          "holds an ai.onnx.ml LinearClassifier node"),
    "graph name not utf-8": (lambda f: _not_utf8(
        f, "evaluate.onnx", lambda m: setattr(m.graph.output[0], "name", "PLACEHOLDER")),
        "model.graph.output[0].name; damaged bytes"),
    "inference producer not utf-8": (lambda f: _not_utf8(
        f, "inference.onnx", lambda m: setattr(m, "producer_name", "PLACEHOLDER")),
        "model.producer_name; damaged bytes"),
    "path with ..": (lambda f: _rewrite_manifest(
        f, lambda m: m["graphs"]["evaluate"].update(file="../evaluate.onnx")),
        "not a plain file name"),
    "absolute path": (lambda f: _rewrite_manifest(
        f, lambda m: m["graphs"]["evaluate"].update(file="/etc/passwd")),
        "not a plain file name"),
    "link out of the folder": (_outside_link, "link"),
    "external data": (_external_data, "external data"),
    "state missing weight": (lambda f: _state(f, lambda a: a.pop("coef")), "missing ['coef']"),
    "state extra array": (lambda f: _state(f, lambda a: a.update(bias=np.zeros(1))),
                          "unexpected ['bias']"),
    "state wrong shape": (
        lambda f: _state(f, lambda a: a.update(coef=np.zeros((4, 1), np.float32))),
        "'coef' as float32[4, 1]"),
    "state wrong dtype": (lambda f: _state(f, lambda a: a.update(coef=np.zeros((3, 1)))),
                          "'coef' as float64[3, 1]"),
    "state with pickled objects": (_pickled_state, "object arrays"),
    "state not an archive": (lambda f: ((f / "state.npz").write_text("coef,1,2"),
                                        _drop_checksums(f)), "state.npz"),
    "inference model of another program": (_foreign_inference, "no initializer 'coef'"),
}


@pytest.mark.parametrize("damage, message", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_program_folder_is_a_named_error(saved, damage, message):
    damage(saved)
    with pytest.raises(InvalidProgramError, match=re.escape(message)):
        lossgraph.TrainingProgram.load(saved)
    assert not (saved.parent / "pwned").exists()


def test_a_file_or_nothing_where_a_program_folder_is_expected(tmp_path):
    onnx.save(MODEL, tmp_path / "model.onnx")
    with pytest.raises(InvalidProgramError, match="compile it first"):
        lossgraph.TrainingProgram.load(tmp_path / "model.onnx")
    with pytest.raises(InvalidProgramError, match="There is no lossgraph program folder"):
        lossgraph.TrainingProgram.load(tmp_path / "missing")


def test_a_program_saved_and_loaded_trains_exactly_as_the_original(tmp_path):
    X, y = data()
    original = compiled("epoch")
    original.save(tmp_path / "prog")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "prog")
    assert loaded.manifest == original.manifest
    a = lossgraph.Trainer(original).fit(X, y, epochs=2, batch_size=8, random_state=0,
                                        progress=False)
    b = lossgraph.Trainer(loaded).fit(X, y, epochs=2, batch_size=8, random_state=0,
                                      progress=False)
    for name, value in a.state.items():
        np.testing.assert_array_equal(b.state[name], value)


CHECKPOINT_DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "no record": (lambda f: (f / "trainer.json").unlink(), "holds no trainer.json"),
    "record not JSON": (lambda f: (f / "trainer.json").write_text("nope"), "not valid JSON"),
    "not a record": (lambda f: (f / "trainer.json").write_text('{"steps": 1}'),
                     "not a lossgraph checkpoint record"),
    "another format": (lambda f: _rewrite_record(f, format="lossgraph-checkpoint/7"),
                       "this lossgraph reads"),
    "negative steps": (lambda f: _rewrite_record(f, steps=-3), "'steps' must be a count"),
    "losses not numbers": (lambda f: _rewrite_record(f, train_losses=["low"]),
                           "'train_losses' must be a list of numbers"),
    "bad generator": (lambda f: _rewrite_record(f, rng={"bit_generator": "Nope"}),
                      "'rng' is not the state"),
    "metrics not numbers": (lambda f: _rewrite_record(f, metrics={"accuracy": ["high"]}),
                            "'accuracy' must be a list of numbers"),
    "not an early-stopping record": (lambda f: _rewrite_record(f, early_stopping=[3]),
                                     "'early_stopping' is not an early-stopping record"),
    "best state missing": (lambda f: _rewrite_record(f, best_state="0" * 64),
                           "has no file 'best_state.npz'"),
    "best state damaged": (lambda f: (_rewrite_record(f, best_state="0" * 64),
                                      (f / "best_state.npz").write_bytes(b"PK")),
                           "does not match the checksum"),
    "program missing": (lambda f: _remove_tree(f / "program"),
                        "There is no lossgraph program folder"),
    "program damaged": (lambda f: (f / "program" / "manifest.json").write_text("["),
                        "not valid JSON"),
}


def _rewrite_record(folder: Path, **changes) -> None:
    record = json.loads((folder / "trainer.json").read_text())
    record.update(changes)
    (folder / "trainer.json").write_text(json.dumps(record))


def _remove_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        path.unlink()
    folder.rmdir()


@pytest.mark.parametrize("damage, message", CHECKPOINT_DAMAGE.values(),
                         ids=CHECKPOINT_DAMAGE.keys())
def test_a_damaged_checkpoint_is_a_named_error(tmp_path, damage, message):
    X, y = data()
    trainer = lossgraph.Trainer(compiled()).fit(X, y, epochs=1, random_state=0, progress=False)
    trainer.save_checkpoint(tmp_path / "ckpt")
    damage(tmp_path / "ckpt")
    with pytest.raises(InvalidProgramError, match=message):
        lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt")


def test_a_checkpoint_written_before_checkpoints_had_a_format_still_loads(tmp_path):
    X, y = data()
    trainer = lossgraph.Trainer(compiled()).fit(X, y, epochs=1, random_state=0, progress=False)
    trainer.save_checkpoint(tmp_path / "ckpt")
    record = json.loads((tmp_path / "ckpt" / "trainer.json").read_text())
    del record["format"]
    (tmp_path / "ckpt" / "trainer.json").write_text(json.dumps(record))
    assert lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt").steps_ == trainer.steps_


# -- data files ----------------------------------------------------------------------------------


def test_arrays_are_read_from_an_npz_or_a_folder_of_npy_files(tmp_path):
    X, y = data()
    np.savez(tmp_path / "train.npz", X=X, y=y)
    (tmp_path / "folder").mkdir()
    np.save(tmp_path / "folder" / "X.npy", X)
    np.save(tmp_path / "folder" / "y.npy", y)
    for source in (tmp_path / "train.npz", tmp_path / "folder"):
        arrays = storage.read_arrays(source)
        np.testing.assert_array_equal(arrays["X"], X)
        np.testing.assert_array_equal(arrays["y"], y)


BAD_DATA: dict[str, tuple[Callable[[Path], Path], str]] = {
    "missing": (lambda t: t / "none.npz", "There is no data file"),
    "text file": (lambda t: _write(t / "data.npz", b"X,y\n1,2\n"), "does not start like one"),
    "corrupt archive": (lambda t: _write(t / "data.npz", b"PK\x03\x04" + b"\x00" * 40),
                        "cannot be read"),
    "pickled objects": (lambda t: _pickled_npz(t), "object arrays (pickled Python objects)"),
    "single array as npz": (lambda t: _npy(t), "is not an .npz archive: it is a .npy array"),
    "empty folder": (lambda t: _mkdir(t / "empty"), "holds no .npy files"),
    "link out of the folder": (lambda t: _linked_folder(t), "leads out of"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _npy(tmp_path: Path) -> Path:
    np.save(tmp_path / "X.npy", np.ones(3))
    return tmp_path / "X.npy"


def _pickled_npz(tmp_path: Path) -> Path:
    np.savez(tmp_path / "data.npz", X=np.array([_Exploit(str(tmp_path / "pwned"))], dtype=object))
    return tmp_path / "data.npz"


def _linked_folder(tmp_path: Path) -> Path:
    (tmp_path / "secret.npy").write_bytes(b"")
    np.save(tmp_path / "secret.npy", np.ones(2))
    folder = _mkdir(tmp_path / "data")
    (folder / "X.npy").symlink_to(tmp_path / "secret.npy")
    return folder


@pytest.mark.parametrize("make, message", BAD_DATA.values(), ids=BAD_DATA.keys())
def test_a_bad_data_file_is_a_named_error_and_never_runs_code(tmp_path, make, message):
    with pytest.raises(InvalidDataError, match=re.escape(message)):
        storage.read_arrays(make(tmp_path))
    assert not (tmp_path / "pwned").exists()


# -- the catalogue in docs/reference/errors.md ---------------------------------------------------


def _raised(action: Callable[[], object]) -> BaseException:
    try:
        action()
    except (UnsafeWriteError, InvalidProgramError, InvalidDataError) as error:
        return error
    raise AssertionError("the catalogue case raised nothing")


def _damaged_checkpoint(folder: Path, damage: Callable[[Path], object]) -> Path:
    X, y = data()
    trainer = lossgraph.Trainer(compiled()).fit(X, y, epochs=1, random_state=0, progress=False)
    trainer.save_checkpoint(folder / "ckpt")
    damage(folder / "ckpt")
    return folder / "ckpt"


def catalogue_rows(tmp: Path) -> Iterator[Row]:
    """This file's catalogue (refused saves, damaged folders, bad data files), as run now."""
    save = SAVES["program.save"]
    groups = [
        ("save", REFUSED, lambda folder, make: lambda: save(make(folder, save))),
        ("load", DAMAGE, lambda folder, damage: lambda: (
            compiled().save(folder / "prog"), damage(folder / "prog"),
            lossgraph.TrainingProgram.load(folder / "prog"))),
        ("checkpoint", CHECKPOINT_DAMAGE, lambda folder, damage: lambda: (
            lossgraph.Trainer.load_checkpoint(_damaged_checkpoint(folder, damage)))),
        ("data-file", BAD_DATA, lambda folder, make: lambda: storage.read_arrays(make(folder))),
    ]
    for prefix, cases, provoke in groups:
        for described, (setup, _) in cases.items():
            folder = tmp / f"{prefix}-{slug(described)}"
            folder.mkdir()
            error = _raised(provoke(folder, setup))
            yield (f"{prefix}-{slug(described)}", f"{prefix.replace('-', ' ')}: {described}",
                   type(error).__name__, message_of(error, folder))


def test_every_case_of_this_file_is_listed_in_the_errors_page(tmp_path):
    assert_listed((row[0] for row in catalogue_rows(tmp_path)), __file__)


if __name__ == "__main__":
    print_table(catalogue_rows)
