"""Synchronous data-parallel training, whatever the engine: the step every adapter uses.

Each replica holds the whole program and the same state. A global batch of ``B`` rows is
cut into shards, one per replica (of any sizes, empty ones included); a step is::

    replica r:  sum_r = sum over its rows of grad(w_i l_i)      (the loss graph's "sum")
                count_r = sum of its rows' weights (its row count without sample weights)
    all-reduce: sum = sum_r sum_r,  count = sum_r count_r       (every replica gets the same)
    replica r:  grad = sum / count  (reduction "mean"; "sum" keeps the sum)
                grad += penalty_grad(W);  W, states = update(W, grad, states)

so every replica runs the same update graph on the same numbers and the replicas stay
identical without broadcasting weights; the optimizer state is replicated. Sums and
counts, never means: a mean per shard weighs a short shard like a full one. The penalty
is added once, after the all-reduce, as the single-process step adds it once. The result
equals :class:`~lossgraph.runtime.Trainer` on the same global batches to float rounding.

The gradient of the summed loss comes from the program's own loss graph built with
``reduction="sum"`` (:func:`lossgraph.passes.loss.program_loss_graph`): the gradient graph is
linear in its seed, so it then returns the sum of the rows' gradients.

- :class:`ParallelProgram`: a ``fuse="separate"`` program and its summed loss graph.
- :class:`AllReduce`: the engine's part, one call per step; :class:`InMemoryGroup` runs
  replicas as threads of one process (tests, and a reference for adapters).
- :class:`Replica`: one replica (:meth:`Replica.step`, :meth:`Replica.run_epoch`).
- :func:`array_shards`: a replica's shards of the global batches of in-memory arrays.
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx

from .compiler import compile_program
from .errors import (
    ConvergenceError,
    EvaluationError,
    InternalError,
    InvalidDataError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from .graphs import opset_version
from .models import ModelLike
from .modes import fuse_mode
from .modes.separate import SeparateSteps
from .passes.loss import program_loss_graph
from .program import TrainingProgram
from .runtime.trainer import Trainer
from .speed import WidenScalarConstants
from .validation import compile_options

__all__ = ["AllReduce", "EpochResult", "InMemoryGroup", "ParallelProgram", "Replica", "StepResult",
           "array_shards", "shard_bounds", "state_digest"]

#: A replica's shard of a global batch: ``(X, y)`` or ``(X, y, sample_weight)`` as
#: :meth:`Trainer.fit` takes them (checked); or the program's input arrays by name, checked
#: already (:meth:`Replica.prepare` of the whole data); ``None`` (or no rows) when it has
#: no rows this step.
Shard = tuple[Any, ...] | Mapping[str, np.ndarray] | None


class AllReduce(Protocol):
    """The engine's collective: the element-wise sum of ``values`` over all replicas.

    Every replica calls it once per step with a 1-D array of the same size and dtype;
    every replica must receive the same bytes (sum in a fixed order). It may write into
    ``values`` and return it.
    """

    def __call__(self, values: np.ndarray) -> np.ndarray: ...


class InMemoryGroup:
    """An all-reduce for ``size`` replicas that are threads of one process.

    ``group.member(rank)`` is rank ``rank``'s :class:`AllReduce`; a call blocks until every
    member has called, and all receive the sum in rank order. A replica that fails must
    :meth:`abort` the group (an engine stops its other workers), or the others wait forever:
    their calls then raise :class:`~lossgraph.errors.EvaluationError`.
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise UnsupportedOptionError(f"InMemoryGroup(size={size!r}) needs size >= 1.")
        self.size = size
        self._parts: list[np.ndarray | None] = [None] * size
        self._total: np.ndarray | None = None
        self._barrier = threading.Barrier(size, action=self._reduce)

    def abort(self) -> None:
        """Release every member waiting now or later with an error."""
        self._barrier.abort()

    def _reduce(self) -> None:
        total = np.array(self._parts[0], copy=True)
        for part in self._parts[1:]:
            total += part
        self._total = total

    def member(self, rank: int) -> AllReduce:
        """The all-reduce of replica ``rank`` (0 <= rank < size)."""
        if not 0 <= rank < self.size:
            raise UnsupportedOptionError(f"rank={rank} is not in 0..{self.size - 1}.")

        def all_reduce(values: np.ndarray) -> np.ndarray:
            self._parts[rank] = values
            try:
                self._barrier.wait()  # the last to arrive sums; each copies before it calls again
            except threading.BrokenBarrierError:
                raise EvaluationError(
                    f"Replica {rank}'s all-reduce was aborted: another replica of the group "
                    "failed (its error says why).") from None
            assert self._total is not None
            return self._total.copy()

        return all_reduce


@dataclass(frozen=True)
class ParallelProgram:
    """A ``fuse="separate"`` program with the gradient of its loss summed over the rows.

    ``sum_loss`` is the program's ``loss`` graph with ``reduction="sum"`` (same inputs and
    outputs); ``mean`` says whether the program's loss is the mean over rows (divide the
    all-reduced sums by the total weight) or their sum.
    """

    program: TrainingProgram
    sum_loss: onnx.ModelProto
    mean: bool

    @classmethod
    def compile(cls, model: ModelLike, *, loss: str = "squared_error",
                loss_options: Mapping[str, Any] | None = None, backend: str = "onnx",
                **options: Any) -> ParallelProgram:
        """:func:`~lossgraph.compile_program` with ``fuse="separate"`` (``options``: its other
        keyword arguments: weights, penalty, optimizer, target), made data-parallel."""
        mode = fuse_mode(options.pop("fuse", "separate"))
        if not mode.exposes_gradients:
            raise UnsupportedOptionError(
                f"fuse={mode.name!r}: data-parallel training runs the separate graphs "
                "(gradients as outputs); leave fuse out.")
        program = compile_program(model, loss=loss, loss_options=loss_options, backend=backend,
                                  fuse=mode.name, **options)
        return cls.of(program, loss=loss, loss_options=loss_options, backend=backend)

    @classmethod
    def of(cls, program: TrainingProgram, *, loss: str = "squared_error",
           loss_options: Mapping[str, Any] | None = None,
           backend: str = "onnx") -> ParallelProgram:
        """``program`` (compiled with ``fuse="separate"``) made data-parallel; ``loss``,
        ``loss_options`` and ``backend`` are those it was compiled with (a program does not
        record them), and are checked: the loss graph they give must be the program's."""
        if not isinstance(program, TrainingProgram):
            raise UnsupportedOptionError(
                f"ParallelProgram.of takes a TrainingProgram, not a {type(program).__name__}; "
                "for a model use ParallelProgram.compile(model, ...).")
        if not fuse_mode(program.fuse).exposes_gradients:
            raise UnsupportedOptionError(
                f"The program was compiled with fuse={program.fuse!r}; data-parallel training "
                "needs the gradients as outputs: compile with fuse='separate'.")
        if program.buffers:
            raise UnsupportedModelError(
                f"The model updates running statistics ({', '.join(program.buffers)}): a "
                "training-mode BatchNormalization normalizes each shard by its own statistics, "
                "so replicas would not compute the single-process step (that needs synchronized "
                "batch statistics, which lossgraph does not do). Put BatchNormalization in "
                "inference mode, or train in one process.")
        checked = compile_options(None, loss, loss_options, None, None, backend, "separate")
        roles = program.manifest["roles"]
        prediction = next((o for o in program.light_graphs["gradient"].graph.output
                           if o.name == roles["prediction"]), None)
        if prediction is None:
            raise InternalError(f"The gradient graph has no output {roles['prediction']!r}.")
        reduction = checked.loss_options.get("reduction", "mean")
        given = program.graphs["loss"]

        def build(reduction: str) -> onnx.ModelProto:
            graph = program_loss_graph(prediction, roles["label"], loss, checked.loss_options,
                                       checked.backend, reduction,
                                       opset_version(given) or 18).model
            graph = WidenScalarConstants()(graph).model  # as compile_program finishes it
            graph.ir_version = given.ir_version  # the program's target
            return graph

        if build(reduction).SerializeToString() != given.SerializeToString():
            raise UnsupportedOptionError(
                f"loss={loss!r} with loss_options={dict(loss_options or {})!r} and "
                f"backend={backend!r} does not give the program's loss graph: pass the loss "
                "options the program was compiled with.")
        return cls(program, build("sum"), reduction == "mean")


def shard_bounds(rows: int, parts: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of part ``rank`` when ``rows`` rows are cut into ``parts``
    contiguous parts whose sizes differ by at most one (the first ``rows % parts`` larger)."""
    size, extra = divmod(rows, parts)
    lo = rank * size + min(rank, extra)
    return lo, lo + size + (rank < extra)


def array_shards(data: Sequence[Any] | Mapping[str, np.ndarray], batch_size: int, rank: int,
                 parts: int, order: np.ndarray | None = None) -> Iterator[Shard]:
    """Replica ``rank``'s shard (:func:`shard_bounds`) of each global batch of ``data``,
    taken in ``order`` (a permutation of the rows; default: as stored), as ``Trainer.fit``
    cuts its batches. ``data``: ``(X, y[, sample_weight])`` arrays (``X`` a dict of arrays
    for several feature inputs), or input arrays by name (:meth:`Replica.prepare`), whose
    shards are then not checked again."""
    rows = len(next(iter(data.values())) if isinstance(data, Mapping) else data[1])
    for start in range(0, rows, batch_size):
        stop = min(rows, start + batch_size)
        lo, hi = shard_bounds(stop - start, parts, rank)
        index = slice(start + lo, start + hi) if order is None else order[start + lo:start + hi]
        if isinstance(data, Mapping):
            yield {name: array[index] for name, array in data.items()}
        else:
            yield tuple(_rows(part, index) for part in data)


def _rows(part: Any, index: slice | np.ndarray) -> Any:
    if part is None:
        return None
    if isinstance(part, Mapping):
        return {name: np.asarray(array)[index] for name, array in part.items()}
    return np.asarray(part)[index]


@dataclass(frozen=True)
class StepResult:
    """A global step: its loss (the single-process step's: mean loss plus penalty), and
    the rows of the global batch."""

    loss: float
    rows: int


@dataclass(frozen=True)
class EpochResult:
    """An epoch: its loss (as ``Trainer.fit`` records it), its rows and its global steps."""

    loss: float
    rows: int
    steps: int


class Replica:
    """One replica of synchronous data-parallel training (see the module docstring).

    It holds a :class:`~lossgraph.runtime.Trainer` of the program (``trainer``), whose state,
    counters (``steps_``, ``epochs_``, ``train_losses_``), checkpoints, ``predict`` and
    inference export are those of the data-parallel run. ``all_reduce`` is the engine's
    collective; ``all_reduce_seconds`` the time spent in it.
    """

    def __init__(self, program: ParallelProgram, all_reduce: AllReduce,
                 providers: Sequence[str] | None = None, session_options: Any = None) -> None:
        if not isinstance(program, ParallelProgram):
            raise UnsupportedOptionError(
                f"Replica takes a ParallelProgram, not a {type(program).__name__}: "
                "ParallelProgram.compile(model, ...) or ParallelProgram.of(program, ...).")
        self.program = program
        self.all_reduce = all_reduce
        self.all_reduce_seconds = 0.0
        self.trainer = Trainer(program.program, providers, session_options)
        base = program.program
        self._summed = TrainingProgram({**base.light_graphs, "loss": program.sum_loss},
                                       base.manifest, base.state, base.inference_model)
        self._weights = base.weights
        self._shapes = {w: base.state.like(w).shape for w in self._weights}
        ends = np.cumsum([base.state.like(w).size for w in self._weights])
        self._slices = {w: slice(int(end) - base.state.like(w).size, int(end))
                        for w, end in zip(self._weights, ends)}
        self._size = int(ends[-1])
        self._dtype = base.state.like(self._weights[0]).dtype
        self._label = base.manifest["roles"]["label"]
        self._sample_weight = base.manifest["roles"].get("sample_weight")
        #: the separate steps over the summed loss graph, on the trainer's state
        self._steps = SeparateSteps(self.trainer.engine, self._summed)
        self._full: int | None = None
        self._batches = 0  # global steps of the current epoch

    # -- one step ----------------------------------------------------------------------
    def prepare(self, X: Any, y: Any, sample_weight: Any = None) -> dict[str, np.ndarray]:
        """``(X, y[, sample_weight])`` as checked input arrays by name (``Trainer.fit``'s
        checks): check the whole data once, then step on shards of these
        (:func:`array_shards`) without checking each again."""
        return self.trainer.engine.prepare(X, y, sample_weight)

    def contribution(self, shard: Shard) -> np.ndarray:
        """This replica's part of a step: its gradients summed over ``shard``'s rows, then
        the summed loss, the total weight and the row count (one 1-D array to all-reduce);
        zeros for a shard without rows."""
        payload = np.zeros(self._size + 3, self._dtype)
        data = self._checked(shard)
        rows = 0 if data is None else len(data[self._label])
        if not rows:
            return payload
        weights = data[self._sample_weight] if self._sample_weight else None
        if weights is not None and not weights.any():
            # rows that all weigh zero add exactly nothing but their count (the Trainer
            # refuses such a batch; a shard of a global batch may well be one)
            payload[-1] = rows
            return payload
        if self._full is None:
            self._full = rows  # graphs specialized to the first shard size seen
        loss, gradients = self._steps.gradients(data, self._full)
        for weight, where in self._slices.items():
            value = gradients[weight]
            payload[where] = (value if isinstance(value, np.ndarray) else value.numpy()).ravel()
        payload[-3:] = loss, rows if weights is None else weights.sum(dtype=self._dtype), rows
        return payload

    def _checked(self, shard: Shard) -> Mapping[str, np.ndarray] | None:
        """The shard's input arrays by name (checked unless they are already)."""
        if shard is None or isinstance(shard, Mapping):
            return shard
        if not len(shard[1]):
            return None
        if len(shard) == 3 and shard[2] is not None and not np.any(shard[2]):
            weights = np.asarray(shard[2])  # all zero: the other data's checks, then these
            return {**self.prepare(*shard[:2], np.ones_like(weights)),
                    self._sample_weight: weights.astype(self._dtype)}
        return self.prepare(*shard)

    def apply(self, total: np.ndarray) -> StepResult | None:
        """The update from the all-reduced ``total`` of every replica's :meth:`contribution`
        (the same on every replica); ``None`` when the global batch had no rows (the data
        are exhausted everywhere), and nothing changes."""
        if total.shape != (self._size + 3,):
            raise InternalError(f"The all-reduce returned shape {total.shape}, not "
                                f"({self._size + 3},).")
        loss_sum, weight, rows = (float(v) for v in total[-3:])
        if rows == 0:
            return None
        step_number = self.trainer.steps_ + 1
        divisor = weight if self.program.mean else 1.0
        if not divisor > 0:
            raise InvalidDataError(
                f"The sample weights of global step {step_number} sum to {weight:g}, so its "
                "mean loss is undefined. Shuffle the rows, use larger batches, or drop rows of "
                "weight zero.")
        gradients = {w: (total[where] / self._dtype.type(divisor)).reshape(self._shapes[w])
                     for w, where in self._slices.items()}
        engine = self.trainer.engine
        engine.set_scalars(step_number, self.trainer.learning_rate(step_number))
        loss = loss_sum / divisor
        loss += self._steps.update(gradients, loss)
        if not math.isfinite(loss):
            raise ConvergenceError(
                f"The loss became {loss} at global step {step_number}: training diverged. Try "
                "a smaller learning rate, scale the features, or a smaller penalty. "
                + self.trainer.step_back(loss))
        engine.apply(1, f"epoch {self.trainer.epochs_}, batch {self._batches}")
        self.trainer.steps_ = step_number
        self._batches += 1
        return StepResult(loss, int(rows))

    def step(self, shard: Shard) -> StepResult | None:
        """One global step: :meth:`contribution`, the all-reduce, :meth:`apply`."""
        payload = self.contribution(shard)
        start = time.perf_counter()
        total = self.all_reduce(payload)
        self.all_reduce_seconds += time.perf_counter() - start
        return self.apply(total)

    def run_epoch(self, shards: Iterable[Shard]) -> EpochResult:
        """Steps over this replica's ``shards`` until a global batch has no rows (every
        replica's shards are exhausted; one that ends early contributes empty shards, so
        no replica waits forever). The epoch's loss is recorded as ``Trainer.fit`` does."""
        source = iter(shards)
        losses, rows = [], []
        while (result := self.step(next(source, None))) is not None:
            losses.append(result.loss)
            rows.append(result.rows)
        if not rows:
            raise InvalidDataError("The epoch had no rows on any replica.")
        loss = float(np.dot(losses, rows) / np.sum(rows))
        self.trainer.epochs_ += 1
        self._batches = 0
        self.trainer.train_losses_.append(loss)
        return EpochResult(loss, int(np.sum(rows)), len(rows))

    def check_identical(self, rank: int, size: int) -> int:
        """The replicas' common :func:`state_digest`, compared through the all-reduce (every
        replica calls it together, as a step); an InternalError when they differ."""
        digests = np.zeros(size, np.float64)  # CRC-32s are exact in float64
        digests[rank] = state_digest(self.trainer.state)
        digests = self.all_reduce(digests)
        if len(set(digests.tolist())) > 1:
            raise InternalError(
                f"The replicas' states differ after {self.trainer.steps_} steps (CRC-32 by "
                f"rank: {[int(d) for d in digests]}): the all-reduce did not give every "
                "replica the same sum, or a replica ran another program.")
        return int(digests[0])

    # -- checkpoints -------------------------------------------------------------------
    def resume(self, path: str | Path) -> None:
        """Continue from a checkpoint written by ``replica.trainer.save_checkpoint`` (or a
        single-process Trainer's): its state and counters."""
        saved = Trainer.load_checkpoint(path)
        self.trainer.set_state(saved.state)
        self.trainer.steps_, self.trainer.epochs_ = saved.steps_, saved.epochs_
        self.trainer.train_losses_ = list(saved.train_losses_)


def state_digest(state: Mapping[str, np.ndarray]) -> int:
    """The CRC-32 of a state's bytes (weights, optimizer states, buffers), by name: equal
    digests mean replicas identical bit for bit."""
    digest = 0
    for name in sorted(state):
        digest = zlib.crc32(np.ascontiguousarray(state[name]).tobytes(), digest)
    return digest
