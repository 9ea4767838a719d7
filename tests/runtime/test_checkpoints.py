"""Checkpoints that rotate (lossgraph/runtime/checkpoints.py): the last k and the best kept,
nothing foreign touched, and resuming the latest equal to an uninterrupted fit, bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.linear import linear_data, linear_program

import lossgraph
from lossgraph.errors import UnsafeWriteError
from lossgraph.fileio import remove_directory
from lossgraph.optim import Adam
from lossgraph.paths import CHECKPOINT_FOLDER, latest_checkpoint, saved_checkpoints


@pytest.fixture(scope="module")
def data():
    X, y = linear_data(120, seed=5)  # 100 rows to train, 5 batches of 20 an epoch
    return X[:100], y[:100], (X[100:], y[100:])


def trainer(mode: str = "step") -> lossgraph.Trainer:
    return lossgraph.Trainer(linear_program(mode, Adam(0.05)))


def names(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_rotation_keeps_the_last_k_and_the_best_and_nothing_foreign(data, tmp_path):
    """Validation labels equal to the starting model's predictions: the validation loss
    grows as training moves the weights, so the best checkpoint is the first one."""
    X, y, (Xv, _) = data
    start = trainer()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "checkpoint-4").mkdir()  # a folder of the user's, named like one
    (folder / "checkpoint-4" / "data.bin").write_bytes(b"1")
    start.save_checkpoint(folder / "checkpoint-3")  # lossgraph's, with a file of the user's
    (folder / "checkpoint-3" / "mine.txt").write_text("keep")
    trained = trainer().fit(X, y, epochs=6, batch_size=20, random_state=0, progress=False,
                            validation_data=(Xv, start.predict(Xv)), checkpoint_dir=folder,
                            keep_last=2)
    assert int(np.argmin(trained.validation_losses_)) == 0
    assert set(names(folder)) == {"checkpoint-5", "checkpoint-25", "checkpoint-30",
                                  "checkpoint-3", "checkpoint-4", "notes.txt"}
    assert (folder / "checkpoint-3" / "mine.txt").read_text() == "keep"
    assert (folder / "checkpoint-4" / "data.bin").read_bytes() == b"1"
    assert [s for s, _ in saved_checkpoints(folder)] == [5, 25, 30]  # checkpoint-3 is not
    best = lossgraph.Trainer.load_checkpoint(folder / "checkpoint-5")  # only lossgraph's
    assert best.epochs_ == 1 and best.validation_losses_ == trained.validation_losses_[:1]
    assert not remove_directory(folder / "checkpoint-3", CHECKPOINT_FOLDER)
    assert not remove_directory(folder / "checkpoint-4", CHECKPOINT_FOLDER)


@pytest.mark.parametrize("mode", ["step", "epoch", "separate"])
def test_resuming_the_latest_checkpoint_equals_an_uninterrupted_fit_bit_for_bit(data, tmp_path,
                                                                                mode):
    X, y, validation = data
    options = {"batch_size": 20, "validation_data": validation, "progress": False}
    straight = trainer(mode).fit(X, y, epochs=4, random_state=2, checkpoint_dir=tmp_path / "a",
                                 **options)
    first = trainer(mode).fit(X, y, epochs=2, random_state=2, checkpoint_dir=tmp_path / "b",
                              **options)
    resumed = lossgraph.Trainer.load_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert resumed.steps_ == first.steps_ == 10
    resumed.fit(X, y, epochs=2, warm_start=True, checkpoint_dir=tmp_path / "b", **options)
    assert resumed.train_losses_ == straight.train_losses_
    assert resumed.validation_losses_ == straight.validation_losses_
    for name, value in straight.state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)
    assert names(tmp_path / "a") == names(tmp_path / "b") == [
        "checkpoint-10", "checkpoint-15", "checkpoint-20"]


def test_checkpoint_every_n_epochs_and_at_the_end(data, tmp_path):
    X, y, _ = data
    trainer().fit(X, y, epochs=3, batch_size=20, progress=False, checkpoint_dir=tmp_path,
                  checkpoint_every=2, keep_last=None, keep_best=False)
    assert names(tmp_path) == ["checkpoint-10", "checkpoint-15"]
    trainer().fit(X, y, max_steps=3, batch_size=20, progress=False, warm_start=False,
                  checkpoint_dir=tmp_path / "short", keep_best=False)
    assert names(tmp_path / "short") == ["checkpoint-3"]  # max_steps ended the epoch there


def test_a_folder_of_another_runs_checkpoints_is_refused_before_any_work(data, tmp_path):
    X, y, _ = data
    trainer().fit(X, y, epochs=1, batch_size=20, progress=False, checkpoint_dir=tmp_path,
                  keep_best=False)
    fresh = trainer()
    with pytest.raises(UnsafeWriteError, match="holds checkpoint-5, past step 0"):
        fresh.fit(X, y, epochs=1, batch_size=20, progress=False, checkpoint_dir=tmp_path,
                  keep_best=False)
    assert fresh.steps_ == 0 and names(tmp_path) == ["checkpoint-5"]
