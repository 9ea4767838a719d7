"""Data-parallel training on a Ray cluster (``pip install 'lossgraph[ray]'``).

:class:`RayTrainer` follows Ray Train's own pattern: its torch, XGBoost and LightGBM
trainers are each a ``DataParallelTrainer`` with a small backend that sets up the
framework's communication. Here the backend (:class:`LossgraphConfig`) sets up the
all-reduce, and every worker runs a :class:`~lossgraph.parallel.Replica` of
:mod:`lossgraph.parallel`'s synchronous step::

    trainer = RayTrainer(model, optimizer=Adam(1e-3), features="x", label="y",
                         num_workers=4, resources_per_worker={"CPU": 1}, storage_path="/runs")
    result = trainer.fit(ray.data.read_parquet("s3://bucket/train/"), epochs=10,
                         batch_size=10_000)
    result.trainer.predict(X), result.inference_model, result.train_losses

The all-reduce, chosen once per run by ``all_reduce=`` (``"auto"``: ``"gloo"`` when torch
imports on the driver, else ``"actor"``):

- ``"gloo"``: a ``ray.util.collective`` group with the gloo backend (torch.distributed's
  CPU collectives): the workers exchange the gradients among themselves, a ring whose
  bytes per worker stay about twice the gradient's, whatever the number of workers.
- ``"actor"``: a reducer actor that every worker sends its gradient to and gets the sum
  from: no extra dependency, but one process receives and sends ``workers x gradient``
  bytes each step, so it becomes the bottleneck with many workers or large gradients.

Data: a ``ray.data.Dataset`` (Parquet, NumPy, CSV...; each worker streams its split, so
the data may exceed the cluster's memory) read by column names (``features``, ``label``,
``sample_weight``) or a ``batch_function``; or in-memory arrays ``(X, y[, sample_weight])``,
put in the object store once and cut into the same global batches as ``Trainer.fit``
(``shuffle`` and ``random_state`` included), so the run equals a single-process one. The
batch size is global: each worker takes its share of every global batch. Ray Data's split
of blocks among workers is not deterministic and need not be even: each step's all-reduce
carries the row count, a worker whose data have ended contributes an empty shard, and the
epoch ends at the first global batch without rows, so no worker waits forever.

Rank 0 reports every epoch's metrics through ``ray.train.report``, with a checkpoint every
``checkpoint_every`` epochs and after the last: a folder holding a lossgraph checkpoint
(``Trainer.load_checkpoint`` reads it) and the metrics' history. When a worker fails,
``max_failures`` lets Ray Train restart the workers, which continue from the last
checkpoint; after a driver failure, ``fit`` again with the same ``name`` and
``storage_path`` continues the run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .errors import RuntimeUnavailableError, UnknownNameError, UnsupportedOptionError, suggest

# ray first: without it, the error says what to install before anything else can fail.
try:
    import ray
    import ray.train
    from ray.train.backend import Backend, BackendConfig
except ImportError as _exc:
    raise RuntimeUnavailableError(
        f"lossgraph.ray needs Ray Train, which does not import here ({_exc}): "
        "pip install 'lossgraph[ray]'") from _exc

from .data import random_state as checked_random_state
from .models import ModelLike
from .options import choice, count, flag
from .parallel import AllReduce, ParallelProgram, Replica, Shard, array_shards, shard_bounds
from .program import TrainingProgram
from .runtime.trainer import Trainer

__all__ = ["RayTrainer", "RayResult", "LossgraphConfig", "worker_all_reduce", "gloo_all_reduce",
           "reducer", "actor_all_reduce", "ALL_REDUCES"]

#: The all-reduce implementations (see the module docstring).
ALL_REDUCES = ("auto", "gloo", "actor")
#: In a checkpoint folder: the lossgraph checkpoint, and the metrics of every epoch.
_TRAINER_FOLDER = "lossgraph"
_HISTORY_FILE = "history.json"


# ----------------------------------------------------------------- the all-reduce
# What the backend sets up on each worker (a worker process runs one training at a time).
_worker_all_reduce: AllReduce | None = None


def _set_worker_all_reduce(all_reduce: AllReduce | None) -> None:
    global _worker_all_reduce
    _worker_all_reduce = all_reduce


class _GlooAllReduce:
    """A ``ray.util.collective`` gloo group's in-place sum."""

    def __init__(self, group: str) -> None:
        self.group = group

    def __call__(self, values: np.ndarray) -> np.ndarray:
        from ray.util import collective

        collective.allreduce(values, group_name=self.group)
        return values


def gloo_all_reduce(group: str, size: int, rank: int) -> AllReduce:
    """Join the ``ray.util.collective`` gloo group ``group`` of ``size`` Ray actors as
    ``rank`` (all of them call this together; needs torch) and return its all-reduce."""
    from ray.util import collective

    collective.init_collective_group(size, rank, backend="gloo", group_name=group)
    return _GlooAllReduce(group)


def _join_gloo_group(group: str, size: int, rank: int) -> None:
    _set_worker_all_reduce(gloo_all_reduce(group, size, rank))


def _leave_gloo_group(group: str) -> None:
    from ray.util import collective

    if collective.is_group_initialized(group):
        collective.destroy_collective_group(group)
    _set_worker_all_reduce(None)


@ray.remote(num_cpus=0)
class _Reducer:
    """Sums one array from each of ``size`` workers per round, in rank order, and returns
    the sum to all of them (an async actor: the calls of a round wait together)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._parts: dict[int, np.ndarray] = {}
        self._done: Any = None

    async def all_reduce(self, rank: int, values: np.ndarray) -> np.ndarray:
        import asyncio

        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        self._parts[rank] = values
        if len(self._parts) == self.size:
            total = np.array(self._parts[0], copy=True)
            for part in range(1, self.size):
                total += self._parts[part]
            self._parts, self._done = {}, None
            done.set_result(total)
        return await done


def reducer(size: int) -> Any:
    """A reducer actor for ``size`` workers (it takes no CPU); each gets its all-reduce
    with :func:`actor_all_reduce`."""
    return _Reducer.remote(size)


def actor_all_reduce(reducer: Any, rank: int) -> AllReduce:
    """Worker ``rank``'s all-reduce through the actor ``reducer`` (:func:`reducer`)."""
    return _ActorAllReduce(reducer, rank)


class _ActorAllReduce:
    """A worker's side of :class:`_Reducer`."""

    def __init__(self, reducer: Any, rank: int) -> None:
        self.reducer, self.rank = reducer, rank

    def __call__(self, values: np.ndarray) -> np.ndarray:
        return ray.get(self.reducer.all_reduce.remote(self.rank, values))


def worker_all_reduce() -> AllReduce:
    """This Ray Train worker's all-reduce, as :class:`LossgraphConfig`'s backend set it up
    (the identity for a run of one worker): for a training loop of one's own, run by a
    ``DataParallelTrainer(..., backend_config=LossgraphConfig(...))``, build
    ``Replica(program, worker_all_reduce())``."""
    if ray.train.get_context().get_world_size() == 1:
        return _alone
    if _worker_all_reduce is None:
        raise RuntimeUnavailableError(
            "This worker has no all-reduce: run the training loop with "
            "backend_config=LossgraphConfig(...) (RayTrainer does).")
    return _worker_all_reduce


def _alone(values: np.ndarray) -> np.ndarray:
    """The all-reduce of a single worker."""
    return values


def _use_reducer(actor: Any) -> None:
    _set_worker_all_reduce(actor_all_reduce(actor, ray.train.get_context().get_world_rank()))


class _GlooBackend(Backend):
    """Every worker joins a fresh gloo group (a new name per worker group: a restarted
    group never meets the rendezvous of a dead one)."""

    def on_start(self, worker_group: Any, backend_config: LossgraphConfig) -> None:
        self._group = f"lossgraph-{uuid.uuid4().hex}"
        size = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _join_gloo_group, self._group, size,
                                                   rank) for rank in range(size)])

    def on_shutdown(self, worker_group: Any, backend_config: LossgraphConfig) -> None:
        worker_group.execute(_leave_gloo_group, self._group)


class _ActorBackend(Backend):
    """One reducer actor per worker group."""

    def on_start(self, worker_group: Any, backend_config: LossgraphConfig) -> None:
        self._reducer = reducer(len(worker_group))
        worker_group.execute(_use_reducer, self._reducer)

    def on_shutdown(self, worker_group: Any, backend_config: LossgraphConfig) -> None:
        ray.kill(self._reducer)
        worker_group.execute(_set_worker_all_reduce, None)


@dataclass
class LossgraphConfig(BackendConfig):
    """Ray Train's backend configuration for lossgraph: which all-reduce the workers use
    (``"gloo"`` or ``"actor"``; :class:`RayTrainer` resolves ``"auto"``)."""

    all_reduce: str = "actor"

    @property
    def backend_cls(self) -> type[Backend]:
        return _GlooBackend if self.all_reduce == "gloo" else _ActorBackend

    def to_dict(self) -> dict[str, Any]:
        return {"all_reduce": self.all_reduce}


def _resolve_all_reduce(all_reduce: str) -> str:
    choice("all_reduce", all_reduce, ALL_REDUCES)
    if all_reduce == "auto":
        return "gloo" if importlib.util.find_spec("torch") is not None else "actor"
    if all_reduce == "gloo" and importlib.util.find_spec("torch") is None:
        raise RuntimeUnavailableError(
            "all_reduce='gloo' runs Ray's collective group on torch.distributed's gloo, and "
            "torch is not installed: pip install torch, or use all_reduce='actor'.")
    return all_reduce


# ----------------------------------------------------------------------- the data
@dataclass(frozen=True)
class _Arrays:
    """In-memory arrays, checked and in the object store (the input arrays by name), cut
    as ``Trainer.fit`` cuts them."""

    ref: Any
    rows: int
    shuffle: bool
    seed: int | None

    def open(self, rank: int, size: int, batch_size: int) -> Callable[[int], Iterable[Shard]]:
        data = ray.get(self.ref)
        orders = _EpochOrders(self.seed, self.rows) if self.shuffle else None
        return lambda epoch: array_shards(data, batch_size, rank, size,
                                          None if orders is None else orders.of(epoch))


class _EpochOrders:
    """Epoch ``e``'s shuffling order: the ``e+1``-th permutation of ``default_rng(seed)``,
    as ``Trainer.fit(shuffle=True, random_state=seed)`` draws them."""

    def __init__(self, seed: int | None, rows: int) -> None:
        self.seed, self.rows = seed, rows
        self._rng, self._next = np.random.default_rng(seed), 0

    def of(self, epoch: int) -> np.ndarray:
        if epoch < self._next:
            self._rng, self._next = np.random.default_rng(self.seed), 0
        while True:
            order = self._rng.permutation(self.rows)
            self._next += 1
            if self._next > epoch:
                return order


@dataclass(frozen=True)
class _Columns:
    """A Ray Dataset's batches (dicts of columns) as ``(X, y[, sample_weight])`` shards."""

    features: str | tuple[str, ...] | None
    label: str | None
    sample_weight: str | None
    batch_function: Callable[[dict[str, np.ndarray]], tuple] | None

    def check(self, columns: Sequence[str]) -> None:
        """Every column named is among the Dataset's ``columns`` (before the run starts)."""
        if self.features is None or self.label is None:
            raise UnsupportedOptionError(
                "A Dataset is read by column: pass RayTrainer(features=..., label=...) "
                "(and sample_weight=...), or batch_function=.")
        named = [self.features] if isinstance(self.features, str) else list(self.features)
        for name in (*named, self.label, *([self.sample_weight] if self.sample_weight else [])):
            if name not in columns:
                raise UnknownNameError(f"The Dataset has no column {name!r}."
                                       + suggest(name, list(columns), "columns"))

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple:
        if self.batch_function is not None:
            return self.batch_function(batch)
        X = (batch[self.features] if isinstance(self.features, str) else
             np.column_stack([batch[c] for c in self.features]))
        y = batch[self.label]
        return (X, y) if self.sample_weight is None else (X, y, batch[self.sample_weight])

    def open(self, rank: int, size: int, batch_size: int) -> Callable[[int], Iterable[Shard]]:
        shard = ray.train.get_dataset_shard("train")
        lo, hi = shard_bounds(batch_size, size, rank)
        return lambda epoch: map(self, shard.iter_batches(batch_size=hi - lo,
                                                           batch_format="numpy"))


# -------------------------------------------------------------------- the workers
@dataclass(frozen=True)
class _Job:
    """What every worker needs: the program, the data, and the run's settings."""

    program: ParallelProgram
    data: _Arrays | _Columns
    epochs: int
    batch_size: int
    checkpoint_every: int
    threads: int


def _train_worker(config: dict[str, Any]) -> None:
    """Ray Train's loop on each worker: resume, then epochs of replica steps; rank 0
    reports metrics and checkpoints."""
    job: _Job = config["job"]
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    replica = Replica(job.program, worker_all_reduce(),
                      session_options={"intra_op_num_threads": job.threads})
    history: list[dict[str, Any]] = []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            replica.resume(Path(folder) / _TRAINER_FOLDER)
            history = json.loads((Path(folder) / _HISTORY_FILE).read_text())
    first = replica.trainer.epochs_
    batches = job.data.open(rank, size, job.batch_size)
    for epoch in range(first, job.epochs):
        start, reduced = time.perf_counter(), replica.all_reduce_seconds
        result = replica.run_epoch(batches(epoch))
        seconds = time.perf_counter() - start
        history.append({
            "epoch": epoch, "loss": result.loss, "rows": result.rows, "steps": result.steps,
            "seconds": seconds, "rows_per_second": result.rows / seconds,
            # the steps' all-reduces and the one that finds the data exhausted
            "all_reduce_ms": 1e3 * (replica.all_reduce_seconds - reduced) / (result.steps + 1),
            "state_crc32": replica.check_identical(rank, size),  # raises if replicas differ
            "first_epoch_of_attempt": first})
        if rank == 0 and (epoch + 1 == job.epochs or (epoch + 1) % job.checkpoint_every == 0):
            with tempfile.TemporaryDirectory() as folder:
                replica.trainer.save_checkpoint(Path(folder) / _TRAINER_FOLDER)
                (Path(folder) / _HISTORY_FILE).write_text(json.dumps(history))
                ray.train.report(history[-1],
                                 checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(history[-1])


# --------------------------------------------------------------------- the driver
@dataclass
class RayResult:
    """A finished run: ``trainer`` is a single-process :class:`~lossgraph.runtime.Trainer`
    with the trained state and counters (``predict``, ``evaluate``, ``save_checkpoint``, or
    ``fit(..., warm_start=True)`` to go on in one process); ``history`` the metrics of every
    epoch; ``ray_result`` Ray Train's result (its checkpoint, storage path)."""

    trainer: Trainer
    history: list[dict[str, Any]]
    ray_result: Any = field(repr=False)

    @property
    def state(self) -> dict[str, np.ndarray]:
        return self.trainer.state

    @property
    def train_losses(self) -> list[float]:
        return list(self.trainer.train_losses_)

    @property
    def inference_model(self) -> onnx.ModelProto:
        """The original inference model with the trained weights written back."""
        return self.trainer.to_inference_model()


class RayTrainer:
    """Trains a model with synchronous data parallelism on a Ray cluster (module docstring).

    Args:
        model: an inference model (compiled here with the options below and
            ``fuse="separate"``), a ``fuse="separate"`` :class:`TrainingProgram` (compiled
            with ``loss``, ``loss_options`` and ``backend``: they are checked), or a
            :class:`~lossgraph.parallel.ParallelProgram`.
        loss, loss_options, penalty, optimizer, weights, backend, target: as
            :func:`~lossgraph.compile_program` takes them.
        features, label, sample_weight: the columns of a ``ray.data.Dataset`` holding the
            features (one tensor column, or a list of scalar columns stacked in order), the
            label and the sample weights; or ``batch_function``, mapping a batch (a dict of
            column arrays) to ``(X, y[, sample_weight])``. Arrays given to ``fit`` need none.
        num_workers: training workers (Ray Train's ``ScalingConfig``), at least 1 (for one
            process, use :class:`~lossgraph.runtime.Trainer`). ``resources_per_worker``: e.g.
            ``{"CPU": 0.5}``: on a small machine leave CPUs to Ray Data's read tasks, or the
            run waits for them forever.
        threads_per_worker: onnxruntime's intra-op threads (default: the worker's CPUs).
        all_reduce: ``"auto"``, ``"gloo"`` or ``"actor"`` (module docstring).
        storage_path, name: where Ray Train keeps checkpoints (a folder every node reaches,
            or cloud storage), and the run's name; the same pair continues a run.
        max_failures: worker failures Ray Train recovers from (``-1``: no limit).
        checkpoint_every: epochs between checkpoints (the last epoch always has one).
    """

    def __init__(self, model: ModelLike | TrainingProgram | ParallelProgram, *,
                 loss: str = "squared_error", loss_options: Mapping[str, Any] | None = None,
                 penalty: Mapping[str, Any] | None = None, optimizer: Any = None,
                 weights: Sequence[str] | str | None = None, backend: str = "onnx",
                 target: Any = None, features: str | Sequence[str] | None = None,
                 label: str | None = None, sample_weight: str | None = None,
                 batch_function: Callable[[dict[str, np.ndarray]], tuple] | None = None,
                 num_workers: int = 2, resources_per_worker: Mapping[str, float] | None = None,
                 threads_per_worker: int | None = None, all_reduce: str = "auto",
                 storage_path: str | None = None, name: str | None = None,
                 max_failures: int = 0, checkpoint_every: int = 1) -> None:
        if isinstance(model, ParallelProgram):
            self.program = model
        elif isinstance(model, TrainingProgram):
            self.program = ParallelProgram.of(model, loss=loss, loss_options=loss_options,
                                              backend=backend)
        else:
            self.program = ParallelProgram.compile(
                model, loss=loss, loss_options=loss_options, penalty=penalty,
                optimizer=optimizer, weights=weights, backend=backend, target=target)
        if batch_function is not None and not callable(batch_function):
            raise UnsupportedOptionError(
                f"batch_function={batch_function!r} must be a function of a batch (a dict of "
                "column arrays) returning (X, y) or (X, y, sample_weight).")
        if isinstance(features, (list, tuple)):
            features = tuple(features)
        self.columns = _Columns(features, label, sample_weight, batch_function)
        self.num_workers = count("num_workers", num_workers, 1)  # 0: one process,
        # which is lossgraph.Trainer's job (Ray's local mode would not keep the checkpoints)
        self.resources_per_worker = dict(resources_per_worker or {"CPU": 1})
        cpus = self.resources_per_worker.get("CPU", 1)
        self.threads_per_worker = count(
            "threads_per_worker", threads_per_worker if threads_per_worker is not None
            else max(1, math.floor(cpus)), 1)
        self.all_reduce = _resolve_all_reduce(all_reduce)
        self.storage_path, self.name = storage_path, name
        self.max_failures = int(max_failures)
        self.checkpoint_every = count("checkpoint_every", checkpoint_every, 1)

    def fit(self, data: Any, epochs: int = 1, batch_size: int = 32, shuffle: bool = False,
            random_state: int | None = None) -> RayResult:
        """Train for ``epochs`` epochs of global batches of ``batch_size`` rows.

        ``data`` is a ``ray.data.Dataset`` (shuffle it with Ray Data:
        ``random_shuffle()`` or ``randomize_block_order()``), or ``(X, y[, sample_weight])``
        arrays, cut as ``Trainer.fit(shuffle=..., random_state=...)`` cuts them.
        """
        epochs = count("epochs", epochs, 1)
        batch_size = count("batch_size", batch_size, 1)
        if batch_size < self.num_workers:
            raise UnsupportedOptionError(
                f"batch_size={batch_size} is smaller than num_workers={self.num_workers}: the "
                "batch size is global, each worker takes a share of every batch.")
        if np.dtype(self.program.program.state.like(self.program.program.weights[0]).dtype) \
                == np.float32 and batch_size > 2 ** 24:
            raise UnsupportedOptionError(
                f"batch_size={batch_size}: the all-reduce counts rows in float32, exact up to "
                f"2**24 = {2 ** 24}; use smaller global batches.")
        shuffle = flag("shuffle", shuffle)
        seed = checked_random_state(random_state)
        datasets: dict[str, Any] = {}
        if isinstance(data, ray.data.Dataset):
            if shuffle:
                raise UnsupportedOptionError(
                    "shuffle=True applies to arrays; shuffle a Dataset with Ray Data: "
                    "dataset.random_shuffle() (each epoch re-runs it) or "
                    "dataset.randomize_block_order().")
            if self.columns.batch_function is None:
                self.columns.check(data.schema().names)
            source: _Arrays | _Columns = self.columns
            datasets["train"] = data
        elif isinstance(data, (tuple, list)) and len(data) in (2, 3):
            arrays = Replica(self.program, _alone).prepare(*data)  # checked once, here
            if isinstance(seed, np.random.Generator):
                seed = int(seed.integers(2 ** 63))
            if shuffle and seed is None:  # one order for every worker
                seed = int(np.random.SeedSequence().generate_state(1)[0])
            source = _Arrays(ray.put(arrays), len(next(iter(arrays.values()))), shuffle, seed)
        else:
            raise UnsupportedOptionError(
                f"fit takes a ray.data.Dataset or a tuple (X, y[, sample_weight]) of arrays, "
                f"not a {type(data).__name__}.")
        job = _Job(self.program, source, epochs, batch_size, self.checkpoint_every,
                   self.threads_per_worker)
        result = self._ray_trainer(job, datasets).fit()
        if result.checkpoint is None:
            raise RuntimeUnavailableError(
                "Ray Train finished without a checkpoint: no epoch ran (the run at this "
                "storage_path and name had finished already?).")
        with result.checkpoint.as_directory() as folder:
            trainer = Trainer.load_checkpoint(Path(folder) / _TRAINER_FOLDER)
            history = json.loads((Path(folder) / _HISTORY_FILE).read_text())
        return RayResult(trainer, history, result)

    def _ray_trainer(self, job: _Job, datasets: dict[str, Any]) -> Any:
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        return DataParallelTrainer(
            _train_worker, train_loop_config={"job": job},
            backend_config=LossgraphConfig(self.all_reduce),
            scaling_config=ScalingConfig(num_workers=self.num_workers,
                                         resources_per_worker=self.resources_per_worker),
            run_config=RunConfig(name=self.name, storage_path=self.storage_path,
                                 failure_config=FailureConfig(max_failures=self.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
            datasets=datasets)
