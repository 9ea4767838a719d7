"""The data-parallel step (lossgraph.parallel): k replicas in one process, their gradient
sums all-reduced in memory, equal the single-process Trainer on the same global batches,
step for step; without the all-reduce they do not."""

from __future__ import annotations

import importlib
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.linear import LINEAR, linear_data

import lossgraph
from lossgraph.errors import (
    ConvergenceError,
    EvaluationError,
    InvalidDataError,
    RuntimeUnavailableError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.optim import SGD, Adam, AdamW, Momentum
from lossgraph.parallel import (
    InMemoryGroup,
    ParallelProgram,
    Replica,
    array_shards,
    shard_bounds,
    state_digest,
)

ROWS, BATCH = 202, 40  # four full global batches and a last one of 2 rows
OPTIMIZERS = {"sgd": SGD(0.05), "momentum": Momentum(0.05),
              "nesterov": Momentum(0.05, nesterov=True), "adam": Adam(0.05),
              "adamw": AdamW(0.05, weight_decay=0.1)}
PENALTIES = {"none": None, "l1_l2": {"coef": {"l1": 0.05, "l2": 0.1}, "intercept": 0.2}}


@pytest.fixture(scope="module")
def data():
    X, y = linear_data(ROWS, seed=5)
    weights = np.random.default_rng(6).uniform(0.2, 2.0, ROWS).astype(np.float32)
    weights[::7] = 0  # rows that do not count
    return X, y, weights


def mlp() -> onnx.ModelProto:
    """A 4-6-1 ReLU network with non-zero weights."""
    rng = np.random.default_rng(7)
    weights = {"W1": rng.normal(size=(4, 6)), "b1": rng.normal(size=6) / 10,
               "W2": rng.normal(size=(6, 1)), "b2": np.zeros(1) + 0.3}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "W2"], ["p"]),
             helper.make_node("Add", ["p", "b2"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 18)])


def linear() -> onnx.ModelProto:
    return onnx.parser.parse_model(LINEAR)


def global_batches(arrays, batch_size=BATCH):
    """The Trainer's batches of ``arrays`` (no shuffling)."""
    rows = len(arrays[1])
    return [tuple(a[start:start + batch_size] for a in arrays)
            for start in range(0, rows, batch_size)]


def lockstep(replicas, shards):
    """One step of in-process replicas: each one's contribution, their sum in rank order
    (the in-memory all-reduce), each one's update."""
    parts = [replica.contribution(shard) for replica, shard in zip(replicas, shards)]
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return [replica.apply(total.copy()) for replica in replicas]


def assert_states_close(actual, expected, what):
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=2e-5, atol=2e-6,
                                   err_msg=f"{name} {what}")


def assert_identical(replicas):
    first = replicas[0].trainer.state
    for replica in replicas[1:]:
        for name, value in replica.trainer.state.items():
            np.testing.assert_array_equal(value, first[name])


def train_step_for_step(program, arrays, parts, compare=True):
    """Train ``parts`` replicas and a Trainer on the same global batches, one step at a time;
    the replicas' states are compared with the Trainer's after every step."""
    trainer = lossgraph.Trainer(program.program)
    replicas = [Replica(program, None) for _ in range(parts)]
    for step, batch in enumerate(global_batches(arrays)):
        trainer.fit(*batch, epochs=1, batch_size=BATCH, shuffle=False, warm_start=True,
                    progress=False)
        shards = [next(array_shards(batch, BATCH, rank, parts)) for rank in range(parts)]
        results = lockstep(replicas, shards)
        assert {r.rows for r in results} == {len(batch[1])}
        if compare:
            assert_states_close(replicas[0].trainer.state, trainer.state, f"after step {step}")
    assert_identical(replicas)
    return replicas, trainer


@pytest.mark.parametrize("penalty", list(PENALTIES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_three_replicas_equal_the_trainer_step_for_step(data, optimizer, penalty):
    program = ParallelProgram.compile(linear(), optimizer=OPTIMIZERS[optimizer],
                                      penalty=PENALTIES[penalty])
    # shards of 14, 13 and 13 rows; the last global batch of 2 rows leaves rank 2 empty
    assert [shard_bounds(BATCH, 3, r) for r in range(3)] == [(0, 14), (14, 27), (27, 40)]
    assert [shard_bounds(ROWS % BATCH, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    replicas, trainer = train_step_for_step(program, data[:2], 3)
    assert replicas[0].trainer.steps_ == trainer.steps_ == 6


@pytest.mark.parametrize("optimizer", ["nesterov", "adam"])
def test_sample_weights_are_summed_not_averaged_per_shard(data, optimizer):
    program = ParallelProgram.compile(linear(), optimizer=OPTIMIZERS[optimizer],
                                      loss_options={"weight_name": "sample_weight"},
                                      penalty=PENALTIES["l1_l2"])
    train_step_for_step(program, data, 3)


def test_a_shard_whose_rows_all_weigh_zero_adds_only_its_rows(data):
    X, y, weights = data
    weights = weights.copy()
    weights[14:27] = 0  # rank 1's shard of the first global batch
    program = ParallelProgram.compile(linear(), optimizer=Adam(0.05),
                                      loss_options={"weight_name": "sample_weight"})
    part = Replica(program, None).contribution((X[14:27], y[14:27], weights[14:27]))
    assert not part[:-1].any() and part[-1] == 13
    train_step_for_step(program, (X, y, weights), 3)


def test_a_summed_loss_is_not_divided(data):
    program = ParallelProgram.compile(linear(), optimizer=SGD(0.001),
                                      loss_options={"reduction": "sum"})
    assert not program.mean
    train_step_for_step(program, data[:2], 2)


def test_an_mlp_trains_alike_on_five_replicas(data):
    program = ParallelProgram.compile(mlp(), optimizer=Adam(0.01), loss="huber")
    train_step_for_step(program, data[:2], 5)


def test_without_the_all_reduce_the_replicas_drift_apart(data):
    """The negative control: each replica steps on its own shard (an all-reduce that returns
    its input), and the result is not the single-process step."""
    program = ParallelProgram.compile(linear(), optimizer=Momentum(0.05))
    trainer = lossgraph.Trainer(program.program).fit(
        *data[:2], epochs=1, batch_size=BATCH, shuffle=False, progress=False)
    replicas = [Replica(program, lambda values: values) for _ in range(2)]
    for rank, replica in enumerate(replicas):
        replica.run_epoch(array_shards(data[:2], BATCH, rank, 2))
    for replica in replicas:
        gap = max(np.abs(replica.trainer.state[n] - trainer.state[n]).max() for n in trainer.state)
        assert gap > 1e-3
    assert state_digest(replicas[0].trainer.state) != state_digest(replicas[1].trainer.state)


def run_threads(program, shards_of, parts, epochs=1):
    """``parts`` replicas as threads joined by an InMemoryGroup, each running ``epochs``
    epochs over ``shards_of(rank, epoch)``; the replicas and their common digests."""
    group = InMemoryGroup(parts)
    replicas = [Replica(program, group.member(rank)) for rank in range(parts)]

    def run(rank):
        try:
            for epoch in range(epochs):
                replicas[rank].run_epoch(shards_of(rank, epoch))
            return replicas[rank].check_identical(rank, parts)
        except BaseException:
            group.abort()  # or the other replicas wait for this one forever
            raise

    with ThreadPoolExecutor(parts) as pool:
        digests = list(pool.map(run, range(parts)))
    return replicas, digests


def test_replicas_in_threads_equal_a_shuffled_fit_bit_identical(data):
    program = ParallelProgram.compile(linear(), optimizer=Adam(0.05),
                                      loss_options={"weight_name": "sample_weight"})
    trainer = lossgraph.Trainer(program.program).fit(
        *data, epochs=2, batch_size=BATCH, shuffle=True, random_state=3, progress=False)
    rng = np.random.default_rng(3)
    orders = [rng.permutation(ROWS) for _ in range(2)]  # as Trainer.fit draws them
    checked = Replica(program, None).prepare(*data)  # the data checked once, shards not again
    assert sorted(checked) == ["label", "sample_weight", "x"]
    replicas, digests = run_threads(
        program, lambda rank, epoch: array_shards(checked, BATCH, rank, 4, orders[epoch]), 4, 2)
    assert_states_close(replicas[0].trainer.state, trainer.state, "after two epochs")
    assert len(set(digests)) == 1 and digests[0] == state_digest(replicas[3].trainer.state)
    assert_identical(replicas)
    np.testing.assert_allclose(replicas[2].trainer.train_losses_, trainer.train_losses_,
                               rtol=1e-5)
    assert replicas[1].trainer.epochs_ == 2 and replicas[1].trainer.steps_ == trainer.steps_


def test_an_aborted_group_releases_the_waiting_replicas_with_an_error():
    group = InMemoryGroup(2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(group.member(1), np.ones(3, np.float32))
        group.abort()  # what a failing replica does instead of calling
        with pytest.raises(EvaluationError, match="Replica 1's all-reduce was aborted"):
            waiting.result(timeout=10)


def test_a_replica_whose_data_end_early_contributes_empty_shards(data):
    """Rank 1 gets a single shard, rank 0 four: the epoch goes on until no rank has rows,
    and each global batch is the union of what the ranks gave."""
    program = ParallelProgram.compile(linear(), optimizer=Momentum(0.05, nesterov=True))
    X, y = data[:2]
    own = {0: [(X[i:i + 10], y[i:i + 10]) for i in range(0, 40, 10)], 1: [(X[40:65], y[40:65])]}
    replicas, _ = run_threads(program, lambda rank, epoch: own[rank], 2)
    trainer = lossgraph.Trainer(program.program)
    for batch in [(np.concatenate([X[0:10], X[40:65]]), np.concatenate([y[0:10], y[40:65]])),
                  *own[0][1:]]:
        trainer.fit(*batch, batch_size=len(batch[1]), shuffle=False, warm_start=True,
                    progress=False)
    assert_states_close(replicas[1].trainer.state, trainer.state, "after the epoch")
    assert replicas[0].trainer.steps_ == 4


def test_a_program_is_checked_against_the_loss_options_given(data):
    program = lossgraph.compile_program(linear(), fuse="separate",
                                        loss_options={"weight_name": "w"})
    assert ParallelProgram.of(program, loss_options={"weight_name": "w"}).mean
    with pytest.raises(UnsupportedOptionError, match="does not give the program's loss graph"):
        ParallelProgram.of(program)
    with pytest.raises(UnsupportedOptionError, match="does not give the program's loss graph"):
        ParallelProgram.of(program, loss="absolute_error", loss_options={"weight_name": "w"})
    with pytest.raises(UnsupportedOptionError, match="fuse='separate'"):
        ParallelProgram.of(lossgraph.compile_program(linear()))


def test_running_statistics_are_refused():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        net (float[N, 3] x) => (float[N, 3] y)
        <float[3] scale = {1, 1, 1}, float[3] shift = {0, 0, 0}, float[3] mean = {0, 0, 0},
         float[3] var = {1, 1, 1}>
        { y, m, v = BatchNormalization <training_mode: int = 1> (x, scale, shift, mean, var) }""")
    with pytest.raises(UnsupportedModelError, match="synchronized batch statistics"):
        ParallelProgram.compile(model)


def test_a_global_batch_of_zero_weight_and_divergence_are_named_errors(data):
    X, y, weights = data
    program = ParallelProgram.compile(linear(), loss_options={"weight_name": "sample_weight"})
    replica = Replica(program, lambda values: values)
    with pytest.raises(InvalidDataError, match="sum to 0"):
        replica.step((X[:5], y[:5], np.zeros(5, np.float32)))
    exploding = Replica(ParallelProgram.compile(linear(), optimizer=SGD(1e4)), lambda v: v)
    before = exploding.trainer.state
    with pytest.raises(ConvergenceError, match=r"global step 3.*before step 2 \(epoch 0, "
                                                r"batch 1\), the last whose loss was finite"):
        exploding.run_epoch(array_shards((X * 1e3, y), 20, 0, 1))
    assert exploding.trainer.steps_ == 1
    assert not np.array_equal(exploding.trainer.state["coef"], before["coef"])
    assert np.isfinite(exploding.trainer.state["coef"]).all()


def test_a_replica_resumes_from_a_trainer_checkpoint(data, tmp_path):
    program = ParallelProgram.compile(linear(), optimizer=Adam(0.05))
    group_of_one = Replica(program, lambda values: values)
    group_of_one.run_epoch(array_shards(data[:2], BATCH, 0, 1))
    group_of_one.trainer.save_checkpoint(tmp_path / "checkpoint")
    resumed = Replica(program, lambda values: values)
    resumed.resume(tmp_path / "checkpoint")
    assert resumed.trainer.epochs_ == 1 and resumed.trainer.steps_ == 6
    for replica in (group_of_one, resumed):
        replica.run_epoch(array_shards(data[:2], BATCH, 0, 1))
    assert_identical([group_of_one, resumed])
    single = lossgraph.Trainer(program.program).fit(*data[:2], epochs=2, batch_size=BATCH,
                                                    shuffle=False, progress=False)
    assert_states_close(resumed.trainer.state, single.state, "after the resumed epoch")


def test_the_ray_adapter_without_ray_says_what_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "lossgraph.ray", raising=False)  # restored afterwards
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(RuntimeUnavailableError, match=r"pip install 'lossgraph\[ray\]'"):
        importlib.import_module("lossgraph.ray")
