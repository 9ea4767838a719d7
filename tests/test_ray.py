"""lossgraph.ray on a local Ray cluster (one per test session, 2 CPUs): two workers equal
the single-process Trainer and each other, through either all-reduce; a Ray Data run whose
worker is killed mid-run resumes from its last checkpoint. Skipped without Ray."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.environment import local_ray_cluster
from support.linear import LINEAR, linear_data

ray = pytest.importorskip("ray", reason="needs Ray (pip install 'lossgraph[ray]')")
pytest.importorskip("ray.train", reason="needs Ray Train (pip install 'lossgraph[ray]')")

import lossgraph  # noqa: E402
from lossgraph.errors import UnknownNameError, UnsupportedOptionError  # noqa: E402
from lossgraph.optim import Adam, Momentum  # noqa: E402
from lossgraph.parallel import state_digest  # noqa: E402
from lossgraph.ray import RayTrainer  # noqa: E402

#: Ray Data's own deprecated settings, read when a Dataset's context is copied
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")

WORKER = {"CPU": 0.5}  # whole CPUs for the workers would starve Ray Data's read tasks
ALL_REDUCES = ["actor"] + (["gloo"] if importlib.util.find_spec("torch") else [])


@pytest.fixture(scope="module")
def cluster():
    """One local cluster (about 1 GB) for every test here, stopped after the last: the only
    module that uses it, so its memory is free again for the rest of the session."""
    with local_ray_cluster():
        yield


@pytest.fixture(scope="module")
def data():
    X, y = linear_data(202, seed=8)  # batch 40: five global batches, the last of 2 rows
    weights = np.random.default_rng(9).uniform(0.5, 2.0, 202).astype(np.float32)
    return X, y, weights


def assert_states_close(actual, expected):
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=2e-5, atol=2e-6,
                                   err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("all_reduce", ALL_REDUCES)
def test_two_workers_equal_the_single_process_trainer(cluster, data, tmp_path, all_reduce):
    trainer = RayTrainer(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                         loss_options={"weight_name": "sample_weight"},
                         penalty={"coef": {"l1": 0.01, "l2": 0.05}}, num_workers=2,
                         resources_per_worker=WORKER, all_reduce=all_reduce,
                         storage_path=str(tmp_path), name="arrays")
    result = trainer.fit(data, epochs=2, batch_size=40, shuffle=True, random_state=4)
    single = lossgraph.Trainer(trainer.program.program).fit(
        *data, epochs=2, batch_size=40, shuffle=True, random_state=4, progress=False)
    assert_states_close(result.state, single.state)
    np.testing.assert_allclose(result.train_losses, single.train_losses_, rtol=1e-5)
    assert result.trainer.steps_ == single.steps_ == 12
    # every epoch both replicas' states had the same CRC-32 (else the run fails)
    assert [record["epoch"] for record in result.history] == [0, 1]
    assert result.history[-1]["state_crc32"] == state_digest(result.state)
    assert all(record["rows"] == 202 for record in result.history)
    coef = next(t for t in result.inference_model.graph.initializer if t.name == "coef")
    np.testing.assert_array_equal(numpy_helper.to_array(coef), result.state["coef"])


def write_parquet_shards(folder, X, y, files=4):
    """``X`` and ``y`` as ``files`` Parquet files of scalar columns f0.., y."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    for index, rows in enumerate(np.array_split(np.arange(len(y)), files)):
        columns = {f"f{j}": X[rows, j] for j in range(X.shape[1])}
        pq.write_table(pa.table({**columns, "y": y[rows]}), folder / f"part-{index}.parquet")
    return folder


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_checkpoint(cluster, data, tmp_path):
    """Parquet shards through Ray Data; rank 1 kills its own process once a checkpoint
    exists; Ray Train restarts the workers from it. Each epoch is one global batch of
    every row, whatever rows each worker got, so the run equals the Trainer's."""
    X, y = data[0][:200], data[1][:200]
    folder = write_parquet_shards(tmp_path / "parquet", X, y)
    run, died = tmp_path / "runs" / "resume", tmp_path / "died"

    def read_or_die(batch):  # runs in the workers
        rank = ray.train.get_context().get_world_rank()
        if rank == 1 and not died.exists() and any(run.glob("checkpoint_*")):
            died.touch()
            os._exit(1)
        return np.column_stack([batch[f"f{j}"] for j in range(4)]), batch["y"]

    trainer = RayTrainer(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.1),
                         batch_function=read_or_die, num_workers=2,
                         resources_per_worker=WORKER, storage_path=str(run.parent),
                         name=run.name, max_failures=1)
    result = trainer.fit(ray.data.read_parquet(str(folder)), epochs=3, batch_size=200)
    assert died.exists()  # at the latest in epoch 2: checkpoints are uploaded synchronously
    assert [record["epoch"] for record in result.history] == [0, 1, 2]
    attempts = [record["first_epoch_of_attempt"] for record in result.history]
    assert attempts[0] == 0 and attempts[-1] > 0  # the second attempt began from a checkpoint
    assert all(record["rows"] == 200 and record["steps"] == 1 for record in result.history)
    single = lossgraph.Trainer(trainer.program.program).fit(
        X, y, epochs=3, batch_size=200, shuffle=False, progress=False)
    assert_states_close(result.state, single.state)
    np.testing.assert_allclose(result.train_losses, single.train_losses_, rtol=1e-5)
    # a new driver with the same storage_path and name continues the run (here: one epoch)
    again = RayTrainer(trainer.program, batch_function=read_or_die, num_workers=2,
                       resources_per_worker=WORKER, storage_path=str(run.parent),
                       name=run.name).fit(ray.data.read_parquet(str(folder)), epochs=4,
                                          batch_size=200)
    assert [record["first_epoch_of_attempt"] for record in again.history][3] == 3
    single.fit(X, y, epochs=1, batch_size=200, shuffle=False, warm_start=True, progress=False)
    assert_states_close(again.state, single.state)


def test_options_are_checked_before_the_run(cluster, data):
    model = onnx.parser.parse_model(LINEAR)
    with pytest.raises(UnsupportedOptionError, match="all_reduce"):
        RayTrainer(model, all_reduce="mpi")
    dataset = ray.data.from_items([{"x": row, "y": label} for row, label in zip(*data[:2])])
    with pytest.raises(UnsupportedOptionError, match="features=..., label="):
        RayTrainer(model).fit(dataset)
    with pytest.raises(UnknownNameError, match="no column 'label'.*'y'"):
        RayTrainer(model, features="x", label="label").fit(dataset)
    with pytest.raises(UnsupportedOptionError, match="random_shuffle"):
        RayTrainer(model, features="x", label="y").fit(dataset, shuffle=True)
    with pytest.raises(UnsupportedOptionError, match="batch_size"):
        RayTrainer(model, num_workers=4).fit(data[:2], batch_size=3)
    with pytest.raises(UnsupportedOptionError, match="num_workers"):
        RayTrainer(model, num_workers=0)
    with pytest.raises(UnsupportedOptionError, match="does not give the program's loss graph"):
        RayTrainer(lossgraph.compile_program(model, fuse="separate"), loss="huber")
