"""The training engine: a program's graphs run in onnxruntime over one live state.

    engine = Engine(program)                      # sessions made on first use
    data = engine.prepare(X, y)                   # checked input arrays by name
    loss = engine.step(batch, step=t, rate=lr)    # one update; its result pending
    losses = engine.accumulate([b1, b2], step=t, rate=lr)   # one update of micro-batches
    engine.apply(1, "epoch 0, batch 3")           # the pending state becomes the live one
    engine.evaluate(data), engine.predict(data)

The engine owns the onnxruntime sessions (one per graph, specialized to a batch size where
a fit asks), the state (weights, optimizer states, buffers) in a ring of two or three sets of
arrays bound to the sessions (:mod:`lossgraph.runtime.ring`), the learning-rate and step
scalars the graphs read, and the data checks (:mod:`lossgraph.data`). What a step runs is
its fusion mode's (:mod:`lossgraph.modes`). The training loop, schedules, counters,
callbacks and checkpoints are its callers': :class:`~lossgraph.runtime.trainer.Trainer`,
the data-parallel :class:`~lossgraph.parallel.Replica`.

Contract: :meth:`step` (and :meth:`accumulate`, :meth:`epoch`) read the live state and write
the next one into the following buffer set, never the live one; :meth:`apply` makes it
live and keeps the state it replaced, which :meth:`step_back` returns to once (a loss is
that of the state a step reads, so after a non-finite loss the state before the last
applied run is the last whose loss was finite), where a third set keeps it
(``keep_previous_state``: by default for states up to :data:`KEEP_PREVIOUS_MAX_BYTES`).
A larger model's state is held once where its steps can write the next state over the one
they read (``in_place``: :mod:`lossgraph.passes.in_place`; a step whose loss is not finite
then writes back the state it read), else twice. An epoch program run in place runs its
batches as steps (:class:`~lossgraph.modes.fused.EpochMode`: a Scan cannot write in place);
it runs in place by default only where its state is over :data:`KEEP_PREVIOUS_MAX_BYTES`,
since below that the epoch graph's speed is worth the second set. A failed run changes
nothing the caller sees, but for an onnxruntime error in the middle of a run that writes
in place, which may leave part of the next state written. Arrays handed to a run are
aliased, never copied: keep them unchanged until the next run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..data import CheckedArrays, as_array, check_values
from ..errors import (
    InvalidDataError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
    suggest,
)
from ..modes import fuse_mode
from ..options import count, flag
from ..passes.fixed_batch import rows
from ..passes.in_place import WriteInPlace
from ..passes.loss import position_weights, read_loss_record
from ..program import TrainingProgram
from ..speed import SpecializeBatch
from .packed import PackedUpdate
from .ring import Block, GraphRunner, StateRing
from .session import (
    check_loadable,
    check_session_options,
    checked_providers,
    create_session,
    evaluation_error,
)

__all__ = ["Engine", "KEEP_PREVIOUS_MAX_BYTES"]

#: The largest state (weights, optimizer states, buffers) whose copy before the last step
#: the engine keeps by default, for a step back after a non-finite loss: 64 MiB, so that a
#: model the size of BERT's (418 MiB of weights) holds its state twice, not thrice.
KEEP_PREVIOUS_MAX_BYTES = 64 * 2**20


class Engine:
    """Runs a :class:`~lossgraph.program.TrainingProgram`'s graphs over one live state
    (module docstring: the contract)."""

    def __init__(self, program: TrainingProgram, providers: Sequence[str] | None = None,
                 session_options: Any = None, keep_previous_state: bool | None = None,
                 in_place: bool | None = None) -> None:
        if not isinstance(program, TrainingProgram):
            hint = ""
            if isinstance(program, (onnx.ModelProto, bytes, str, os.PathLike)):
                hint = " Compile a model first: Trainer(lossgraph.compile_program(model))."
            raise UnsupportedOptionError(
                f"Trainer takes a TrainingProgram (from lossgraph.compile_program or "
                f"TrainingProgram.load), not a {type(program).__name__}.{hint}")
        for name, value in (("keep_previous_state", keep_previous_state),
                            ("in_place", in_place)):
            if value is not None:
                flag(name, value)
        for name, graph in program.light_graphs.items():  # before any work, not at a fit
            check_loadable(graph, f"The program's {name!r} graph")
        self.program = program
        self.providers = checked_providers(providers)
        check_session_options(session_options)
        #: None, a dict of settings (each session's options made from them: the frozen
        #: weights handed to onnxruntime without a copy) or onnxruntime's SessionOptions
        self.session_options = session_options
        self.mode = fuse_mode(program.fuse)
        manifest = program.manifest
        roles = manifest["roles"]
        #: the label and sample-weight inputs' names (None: no sample weights)
        self.label: str = roles["label"]
        self.sample_weight: str | None = roles.get("sample_weight")
        record = read_loss_record(program.light_graphs["evaluate"])
        #: the label value the loss ignores (its ignore_index), or None
        self.ignored_label: int | None = record["ignore_index"]
        #: the loss's weight of each class (its class_weight), or None
        self.class_weight: list[float] | None = record["class_weight"]
        #: how many classes integer labels index (None: not static, or no class labels)
        self.classes = _class_count(manifest) or (
            len(self.class_weight) if self.class_weight else None)
        batch = manifest.get("batch")
        #: the rows every run takes, for a model exported with a fixed batch that compile
        #: kept (None: any number of rows)
        self.fixed_batch: int | None = batch["size"] if batch and batch["fixed"] else None
        self._loss_reduction = batch["loss_reduction"] if batch else "mean"
        # Models that impute missing values take NaN features on purpose.
        self.allows_missing = any(node.op_type in ("Imputer", "IsNaN")
                                  for node in program.light_graphs["predict"].graph.node)
        self._checked = CheckedArrays()
        #: the update of every weight at once, where the mode runs one (the state lies packed)
        self.packed: PackedUpdate | None = self.mode.packed_update(program)
        names = program.weights + program.optimizer_states + program.buffers
        sets = self._buffer_sets(sum(program.state.like(n).nbytes for n in names),
                                 keep_previous_state, in_place)
        #: whether each step writes the next state over the one it reads, holding the
        #: state in one buffer set (by default where it is not kept and the mode can)
        self.in_place: bool = sets == 1
        self.ring = StateRing(names, program.state, self.packed.blocks if self.packed else (),
                              sets)
        self._sessions: dict[tuple[str, int | None], Any] = {}
        self._runners: dict[tuple[Any, ...], GraphRunner] = {}
        self.dtype = program.state.like(program.weights[0]).dtype
        self._rate = np.zeros((), self.dtype)
        self._step = np.zeros((), np.int64)
        self._loss = np.zeros((), self.dtype)
        self._grad_norm = np.full((), np.nan, self.dtype)
        #: whether the update clips the gradients (``compile_program(max_grad_norm=...)``),
        #: so that each run outputs their norm
        self.clips: bool = program.update_options.clips
        #: the gradients' norms of the last epoch run's updates, where the program clips
        #: them (its mode's epoch stepper writes them)
        self.grad_norms: np.ndarray = np.empty(0, self.dtype)
        self._stepper = self.mode.stepper(self)
        #: the last applied run's steps and where it was (what step_back undoes)
        self._applied: tuple[int, str] | None = None

    def _buffer_sets(self, size: int, keep_previous_state: bool | None,
                     in_place: bool | None) -> int:
        """The state ring's sets for a state of ``size`` bytes: 3 to keep the state before
        the last step (by default up to :data:`KEEP_PREVIOUS_MAX_BYTES`), 1 where the
        steps write in place (by default where the mode can, and for an epoch program
        where the state is over that size: module doc), else 2; contradictory options are
        an UnsupportedOptionError."""
        if keep_previous_state is None:
            keep_previous_state = size <= KEEP_PREVIOUS_MAX_BYTES and not in_place
        if in_place and keep_previous_state:
            raise UnsupportedOptionError(
                "in_place=True writes each step over the state it reads, so no state before "
                "the last step can be kept: pass keep_previous_state=False (or leave it out).")
        if keep_previous_state:
            return 3
        if in_place is False or (in_place is None and self.mode.runs_epochs
                                 and size <= KEEP_PREVIOUS_MAX_BYTES):
            return 2
        problem = self.mode.in_place_problem(self.program, self.packed)
        if in_place and problem:
            raise UnsupportedOptionError(
                f"in_place=True, but this program's steps cannot write the next state over "
                f"the one they read: {problem}. Leave in_place out (two buffer sets).")
        return 2 if problem else 1

    # -- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """The program's initial state, live again."""
        self.ring.load(self.program.state)
        self._applied = None

    @property
    def state(self) -> dict[str, np.ndarray]:
        """A copy of the live weights, optimizer states and buffers."""
        return {name: array.copy() for name, array in self.ring.live().items()}

    def live(self) -> dict[str, np.ndarray]:
        """The live state's arrays themselves (views: copy what must outlive a step)."""
        return self.ring.live()

    def set_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace weights (and optimizer states or buffers, when given); names, shapes,
        dtypes and finiteness are checked before anything changes."""
        live = self.ring.live()
        if not isinstance(state, Mapping):
            raise UnsupportedOptionError(
                f"set_state takes a dict of arrays by name (as Trainer.state gives), not a "
                f"{type(state).__name__}.")
        for name, value in state.items():
            if name not in live:
                raise UnknownNameError(f"{name!r} is not a weight, state or buffer of this program."
                                       + suggest(str(name), list(live), "names"))
            value = np.asarray(value)
            if value.shape != live[name].shape or value.dtype != live[name].dtype:
                raise ShapeMismatchError(
                    f"State {name!r} must be {live[name].dtype}{list(live[name].shape)}, got "
                    f"{value.dtype}{list(value.shape)}.")
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                raise InvalidDataError(f"State {name!r} holds NaN or infinite values.")
        for name, value in state.items():
            live[name][...] = value
        self._applied = None

    # -- sessions ----------------------------------------------------------------------
    def session(self, graph: str, batch: int | None = None) -> Any:
        """The session of ``graph``, specialized to ``batch`` rows a step when given (one
        batch size at a time per graph: another batch size replaces it)."""
        key = (graph, batch)
        if key not in self._sessions:
            model = self.program.light_graphs[graph]  # sessions read the frozen weights
            if batch is not None:
                for stale in [k for k in self._sessions if k[0] == graph and k[1] is not None]:
                    del self._sessions[stale]
                for stale in [k for k in self._runners if k[0] == graph and k[1] is not None]:
                    del self._runners[stale]
                model = SpecializeBatch(batch)(model).model
            if self.in_place and graph in self.mode.guarded:
                model = WriteInPlace(self.program.state_updates(graph),
                                     self.program.io(graph, "loss")[0])(model).model
            self._sessions[key] = self.new_session(model, graph)
        return self._sessions[key]

    @property
    def open_sessions(self) -> list[tuple[str, int | None]]:
        """The sessions made so far, as (graph, the batch size it is specialized to or
        None); the packed update's is ``("packed update", None)``."""
        return list(self._sessions)

    def new_session(self, model: onnx.ModelProto, graph: str = "model") -> Any:
        """A session of ``model`` with the engine's providers and options."""
        return create_session(model, self.providers, self.session_options, graph)

    def runner(self, graph: str | PackedUpdate, batch: int | None = None,
               bound: Mapping[str, np.ndarray] | None = None,
               bound_outputs: Mapping[str, np.ndarray] | None = None) -> GraphRunner:
        """The runner of ``graph`` (or of the packed update) over the state ring
        (specialized to ``batch``), with the learning rate, the step and the arrays
        ``bound`` (by input name) bound once, and its outputs ``bound_outputs`` written
        into the arrays given (one runner per set of arrays)."""
        if isinstance(graph, PackedUpdate):
            return self._packed_runner(graph, bound or {})
        arrays = {**(bound or {}), **(bound_outputs or {})}
        key = (graph, batch, tuple((name, id(array)) for name, array in arrays.items()))
        if key not in self._runners:
            entry = self.program.manifest["graphs"][graph]
            inputs: dict[str, str | Block] = {v["name"]: v["name"] for v in entry["inputs"]
                                              if v["role"] in ("weight", "state", "buffer")}
            outputs: dict[str, str | Block] = {
                new: name for name, new in self.program.state_updates(graph).items()}
            roles = {v["role"]: v["name"] for v in (*entry["inputs"], *entry["outputs"])}
            scalars = {"step": self._step, "learning_rate": self._rate}  # where it reads them
            fixed_in = {roles[role]: value for role, value in scalars.items() if role in roles}
            fixed_in.update(bound or {})
            fixed_out = dict(bound_outputs or {})
            if "loss" in roles:
                fixed_out[roles["loss"]] = self._loss
            if "grad_norm" in roles:
                fixed_out[roles["grad_norm"]] = self._grad_norm
            self._runners[key] = GraphRunner(self.session(graph, batch), self.ring, inputs,
                                             outputs, fixed_in, fixed_out, graph)
        return self._runners[key]

    def _packed_runner(self, packed: PackedUpdate, bound: Mapping[str, np.ndarray]
                       ) -> GraphRunner:
        """A runner of the packed update graph over the packed weights and states, reading
        the arrays ``bound`` (a new runner each time: each step binds its own gradient).
        Where the update reads the gradient once, elementwise, that node writes over the
        gradient bound (:attr:`PackedUpdate.over_gradient`): nothing reads it after."""
        key = ("packed update", None)
        if key not in self._sessions:
            self._sessions[key] = self.new_session(packed.model, "update")
        outputs = {packed.grad_norm: self._grad_norm} if packed.grad_norm else {}
        if packed.over_gradient and packed.gradient in bound:
            outputs[packed.over_gradient] = bound[packed.gradient]
        return GraphRunner(self._sessions[key], self.ring, packed.inputs, packed.outputs,
                           {packed.learning_rate: self._rate, packed.step: self._step, **bound},
                           outputs, "update")

    # -- data --------------------------------------------------------------------------
    def inputs(self, graph: str, role: str) -> list[dict]:
        """The manifest entries of ``graph``'s inputs that play ``role``."""
        entry = self.program.manifest["graphs"][graph]
        return [v for v in entry["inputs"] if v["role"] == role]

    def prepare(self, X: Any, y: Any = None, sample_weight: Any = None, *,
                graph: str = "evaluate", with_label: bool = True,
                what: str = "") -> dict[str, np.ndarray]:
        """Checked, C-contiguous data arrays by ``graph``'s input names; errors before any
        work. ``what`` prefixes the data's names in messages (``"validation_data "``)."""
        features = self.inputs(graph, "feature")
        if isinstance(X, Mapping):
            unknown = sorted(set(X) - {f["name"] for f in features})
            if unknown:
                raise UnknownNameError(f"{what}X names {unknown[0]!r}, not a feature input."
                                       + suggest(str(unknown[0]), [f["name"] for f in features],
                                                 "feature inputs"))
            given = {name: (value, f"{what}X[{name!r}]") for name, value in X.items()}
        elif len(features) == 1:
            given = {features[0]["name"]: (X, f"{what}X")}
        else:
            raise InvalidDataError(
                f"The model has {len(features)} feature inputs "
                f"({', '.join(f['name'] for f in features)}): pass {what}X as a dict by name.")
        data = {f["name"]: self._array(*given.get(f["name"], (None, f"{what}X")), f, "feature")
                for f in features}
        if with_label:
            label = self.inputs(graph, "label")[0]
            if y is None:
                raise InvalidDataError(
                    f"{what}y is missing: training and evaluation need labels.")
            data[label["name"]] = self._array(y, f"{what}y", label, "label")
            weight = self.inputs(graph, "sample_weight")
            if sample_weight is not None and not weight:
                raise UnsupportedOptionError(
                    "sample_weight was given but the program has no sample-weight input: "
                    "compile with loss_options={'weight_name': 'sample_weight'}.")
            if weight:
                rows = len(next(iter(data.values())))
                data[weight[0]["name"]] = (
                    np.ones(rows, self.dtype) if sample_weight is None else
                    self._array(sample_weight, f"{what}sample_weight", weight[0],
                                "sample_weight"))
        rows = {name: len(array) for name, array in data.items()}
        if len(set(rows.values())) > 1:
            raise ShapeMismatchError(f"The {what}data have different numbers of rows: {rows}.")
        return data

    def _array(self, value: Any, what: str, spec: dict, role: str) -> np.ndarray:
        """One input's data, converted and checked (values once per array, see
        :class:`~lossgraph.data.CheckedArrays`)."""
        array = as_array(value, spec, what)
        context = (role, spec["name"])
        if (array, context) not in self._checked:
            check_values(array, role, what, self.classes,
                         finite=not (role == "feature" and self.allows_missing),
                         ignored=self.ignored_label)
            self._checked.add(array, context)
        return array

    def data_problem(self, data: Mapping[str, np.ndarray], rows: np.ndarray, where: str,
                     restored: str) -> InvalidDataError | None:
        """The error that blames a batch (``data``, rows ``rows`` of the data given) for a
        non-finite loss at ``where``, or None when the data are not at fault (divergence).
        ``restored`` says which state the caller keeps."""
        for name, array in data.items():
            if array.dtype.kind != "f" or (self.allows_missing and name not in (
                    self.label, self.sample_weight)):
                continue
            finite = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            if not finite.all():  # the data changed in place since they were checked
                bad_row = int(rows[np.flatnonzero(~finite)[0]])
                return InvalidDataError(
                    f"Input {name!r} holds NaN or infinite values (row {bad_row}, {where}): "
                    "clean or impute the data before training.")
        if self.sample_weight in data and not data[self.sample_weight].any():
            return InvalidDataError(
                f"The sample weights of {where} are all zero, so its mean loss is 0/0. Shuffle "
                "the rows (shuffle=True), use larger batches, or drop rows of weight zero. The "
                f"weights are those before {restored}.")
        labels = data.get(self.label)
        shares = None if labels is None else position_weights(labels, self.ignored_label,
                                                              self.class_weight)
        if shares is not None:
            counted = shares.reshape(len(labels), -1).sum(axis=1)
            if not np.any(counted * data.get(self.sample_weight, 1)):
                why = " or ".join(
                    [*([f"{self.ignored_label} (the loss's ignore_index)"]
                       if self.ignored_label is not None else []),
                     *(["of a class of weight zero"] if self.class_weight else [])])
                return InvalidDataError(
                    f"No label of {where} counts: each is {why} or in a row of weight zero, so "
                    "its mean loss is 0/0. Shuffle the rows (shuffle=True), use larger "
                    f"batches, or drop such rows. The weights are those before {restored}.")
        return None

    # -- training ----------------------------------------------------------------------
    @property
    def runs_epochs(self) -> bool:
        """Whether :meth:`epoch` runs the full batches of an epoch as one graph: an epoch
        program's engine that does not run in place (module doc)."""
        return self.mode.runs_epochs and not self.in_place

    @property
    def loss(self) -> float:
        """The loss of the last fused run (the scalar its graph writes)."""
        return float(self._loss)

    @property
    def grad_norm(self) -> float:
        """The gradients' global norm (before clipping) of the last step, where the
        program clips them; NaN otherwise."""
        return float(self._grad_norm)

    def set_scalars(self, step: int, rate: float) -> None:
        """The update number (from 1) and learning rate the next run reads."""
        self._step[()] = step
        self._rate[()] = rate

    def step(self, batch: Mapping[str, np.ndarray], *, step: int, rate: float,
             full: int | None = None) -> float:
        """One update on ``batch`` (checked arrays by input name) as update number ``step``
        with learning rate ``rate``: the loss at the live state; the next state is pending
        (:meth:`apply`). A batch of ``full`` rows (the fit's batch size) runs graphs
        specialized to that size."""
        self.check_batch(batch, "The batch")
        self.set_scalars(step, rate)
        return self._stepper.step(batch, full)

    def epoch(self, data: Mapping[str, np.ndarray], order: np.ndarray | None, batches: int,
              batch_size: int, *, first_step: int, rates: np.ndarray,
              accumulation_steps: int = 1) -> np.ndarray:
        """``batches`` updates on the full batches of ``data`` in one run (where
        :attr:`runs_epochs`), the first of update number ``first_step``, one learning rate
        each: their losses; the next state is pending. With ``accumulation_steps=k``, the
        ``batches`` full batches are micro-batches, every ``k`` one update (as
        :meth:`accumulate`), and ``rates`` has one rate per update."""
        if not self.runs_epochs:
            raise UnsupportedOptionError(
                "This engine runs its epochs as steps, in place: pass in_place=False to run "
                "the epoch graph." if self.mode.runs_epochs else
                f"A fuse={self.program.fuse!r} program runs no epoch graph: compile with "
                "fuse='epoch'.")
        if self.fixed_batch is not None and batch_size != self.fixed_batch:
            self.check_batch({"": np.empty(batch_size)}, "Each batch of the epoch")
        self._step[()] = first_step
        if self.accumulation_steps(accumulation_steps) == 1:
            return self._stepper.epoch(data, order, batches, batch_size, rates)
        used = slice(0, batches * batch_size)
        shares = self._row_shares(data)[used if order is None else order[used]]
        scales = self.gradient_scales(
            shares.reshape(-1, accumulation_steps, batch_size).sum(axis=-1))
        return self._stepper.epoch(data, order, batches, batch_size, rates, scales)

    def apply(self, steps: int, where: str) -> None:
        """Make the pending state live: a run of ``steps`` updates, ``where`` (for
        :meth:`step_back`'s account of it)."""
        self.ring.advance()
        self._applied = (steps, where)

    @property
    def keeps_previous_state(self) -> bool:
        """Whether the state before the last applied run is kept (:meth:`step_back`)."""
        return self.ring.keeps_previous

    def step_back(self) -> tuple[int, str] | None:
        """Make the state before the last applied run live again: that run's steps and
        where it was; None when it is not kept (nothing applied since the start, a load,
        or a step back, or a ring without a third set: :attr:`keeps_previous_state`)."""
        applied, self._applied = self._applied, None
        if applied is None or not self.ring.step_back():
            return None
        return applied

    # -- a fixed batch -----------------------------------------------------------------
    def check_batch(self, data: Mapping[str, np.ndarray], what: str) -> None:
        """``data`` (``what``, in messages) is one batch this program's graphs take: any
        number of rows, or for a model whose batch is fixed (:attr:`fixed_batch`)
        exactly that many."""
        if self.fixed_batch is not None and _rows(data) != self.fixed_batch:
            raise InvalidDataError(
                f"{what} has {rows(_rows(data))}, but the model's batch is fixed at "
                f"{rows(self.fixed_batch)}: its graphs take batches of exactly that many "
                f"({self.program.manifest['batch']['detail']}). Export the model with a free "
                "batch axis to train any batch size (lossgraph inspect shows how).")

    def check_rows(self, data: Mapping[str, np.ndarray], what: str) -> None:
        """``data`` can be evaluated or predicted: any number of rows, or for a fixed batch
        a multiple of it (run in batches of that size)."""
        if self.fixed_batch is not None and _rows(data) % self.fixed_batch:
            raise InvalidDataError(
                f"{what} has {rows(_rows(data))}, not a multiple of {self.fixed_batch}: the "
                f"model's batch is fixed at {rows(self.fixed_batch)}, so it evaluates and "
                "predicts that many rows a run (and lossgraph never pads rows, which would "
                "change a batch the model computes as one). Pass a multiple of "
                f"{rows(self.fixed_batch)}, or export the model with a free batch axis "
                "(lossgraph inspect shows how).")

    def _batches(self, data: Mapping[str, np.ndarray], what: str
                 ) -> list[Mapping[str, np.ndarray]]:
        """``data`` as the batches one run takes: itself, or for a fixed batch views of
        that many rows."""
        self.check_rows(data, what)
        size = self.fixed_batch or _rows(data)
        if size == _rows(data):
            return [data]
        return [{name: array[lo:lo + size] for name, array in data.items()}
                for lo in range(0, _rows(data), size)]

    def _share(self, batch: Mapping[str, np.ndarray]) -> float:
        """The denominator of a batch's mean loss, by which batch losses average into the
        loss of all their rows: the sample weights (or rows), times each row's mean share
        of its labels (0 for an ignore_index, the class's weight for a class_weight)."""
        return float(np.sum(self._row_shares(batch)))

    def _row_shares(self, data: Mapping[str, np.ndarray]) -> np.ndarray:
        """Each row's part of :meth:`_share`: its sample weight (or 1), times its labels'
        mean share; without sample weights, the sum of its labels' shares."""
        rows = _rows(data)
        weights = data[self.sample_weight] if self.sample_weight else np.ones(rows)
        shares = position_weights(data[self.label], self.ignored_label, self.class_weight)
        if shares is None:
            return weights
        shares = shares.reshape(rows, -1)
        if self.sample_weight is None:
            return shares.sum(axis=1)
        return weights * shares.mean(axis=1)

    # -- accumulation ------------------------------------------------------------------
    def accumulation_steps(self, steps: int | None) -> int:
        """The micro-batches of one update a fit with ``accumulation_steps=steps`` takes:
        ``steps``, by default the program's (1 where it was compiled without); more than
        1 needs a program compiled to accumulate (an error saying how, otherwise)."""
        record = self.program.manifest.get("accumulation")
        if steps is None:
            return record["steps"] if record else 1
        steps = count("accumulation_steps", steps, 1)
        if steps > 1 and record is None:
            raise UnsupportedOptionError(
                f"accumulation_steps={steps}, but the program was compiled without gradient "
                "accumulation: compile it with accumulation_steps (any value above 1: "
                f"compile_program(..., accumulation_steps={steps}), or lossgraph compile "
                f"--accumulation-steps {steps}); it then builds the graphs that accumulate and "
                "records how the loss reduces rows.")
        return steps

    def gradient_scales(self, shares: np.ndarray) -> np.ndarray:
        """The factor of each micro-batch's gradient in its update's (the last axis of
        ``shares``, the micro-batches' :meth:`_share`): its share of the update's rows for
        a mean loss, so that the sum is the gradient of the mean over all of them; 1 for a
        summed loss. An update whose rows all weigh nothing gets zeros (its losses are
        0/0 already)."""
        if self.program.manifest["accumulation"]["loss_reduction"] == "sum":
            return np.ones_like(shares, dtype=self.dtype)
        total = shares.sum(axis=-1, keepdims=True)
        scales = np.divide(shares, total, out=np.zeros(shares.shape), where=total > 0)
        return scales.astype(self.dtype)

    def accumulate(self, batches: Sequence[Mapping[str, np.ndarray]], *, step: int,
                   rate: float, full: int | None = None) -> np.ndarray:
        """One update from the micro-batches ``batches`` (checked arrays by input name) as
        update number ``step`` with learning rate ``rate``: the gradient of the loss over
        all their rows, as one batch of them gives (:meth:`gradient_scales`); buffers
        updated by each micro-batch in turn. The loss of each at the live state; the next
        state is pending (:meth:`apply`). One micro-batch is a :meth:`step`."""
        if len(batches) == 1:  # the fit's every step where it does not accumulate
            return np.array([self.step(batches[0], step=step, rate=rate, full=full)])
        self.accumulation_steps(len(batches))  # a program compiled to accumulate, or an error
        for index, batch in enumerate(batches):
            self.check_batch(batch, f"Micro-batch {index}")
        scales = self.gradient_scales(np.array([self._share(batch) for batch in batches]))
        self.set_scalars(step, rate)
        return self._stepper.accumulate(batches, scales, full)

    # -- evaluation --------------------------------------------------------------------
    def evaluate(self, data: Mapping[str, np.ndarray], ema: bool = False) -> float:
        """The loss on ``data`` (prepared) at the live state, layers in inference mode
        (for a fixed batch, the runs' losses of that many rows each, averaged as one mean
        over all rows); with ``ema=True``, at the weights' averages."""
        loss = self.program.manifest["roles"]["loss"]
        batches = self._batches(data, "The data to evaluate")
        if len(batches) > 1 and self._loss_reduction != "mean":
            kind = (f"reduction {self._loss_reduction!r}" if self._loss_reduction else
                    "the model's own")
            raise UnsupportedOptionError(
                f"The model's batch is fixed at {rows(self.fixed_batch)}, so its loss is "
                f"evaluated {rows(self.fixed_batch)} a run, and only a mean loss (reduction "
                "'mean', lossgraph's loss) combines exactly across runs; this one is "
                f"{kind}. Evaluate {rows(self.fixed_batch)} "
                "at a time, or export the model with a free batch axis.")
        losses = [float(self._run("evaluate", [loss], batch, ema)[0]) for batch in batches]
        if len(batches) == 1:
            return losses[0]
        shares = np.array([self._share(batch) for batch in batches])
        counted = shares > 0  # a run whose rows all weigh nothing adds nothing
        if not counted.any():
            return float("nan")  # 0/0, as one run over all rows gives
        return float(np.dot(np.array(losses)[counted], shares[counted]) / shares.sum())

    def predict(self, data: Mapping[str, np.ndarray], ema: bool = False) -> np.ndarray:
        """The model's prediction (the output the loss is computed on) for ``data``
        (prepared with ``graph="predict", with_label=False``) at the live state; with
        ``ema=True``, at the weights' averages."""
        prediction = self.program.manifest["roles"]["prediction"]
        batches = self._batches(data, "X")
        results = [self._run("predict", [prediction], batch, ema)[0] for batch in batches]
        return results[0] if len(results) == 1 else np.concatenate(results)

    def _run(self, graph: str, outputs: list[str], data: Mapping[str, np.ndarray],
             ema: bool = False) -> list:
        live = self.program.model_state(self.ring.live(), ema=ema)
        inputs = self.program.manifest["graphs"][graph]["inputs"]
        state = {v["name"]: live[v["name"]] for v in inputs if v["role"] in ("weight", "buffer")}
        try:
            return self.session(graph).run(outputs, {**data, **state})
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise evaluation_error(graph, exc) from None


def _rows(data: Mapping[str, np.ndarray]) -> int:
    """The number of rows of a batch's arrays."""
    return len(next(iter(data.values())))


def _class_count(manifest: Mapping[str, Any]) -> int | None:
    """How many classes integer labels index: C for an (N, C) prediction, 2 for (N,) or
    (N, 1) (a binary loss), C for an (N, d1, ..., C) prediction with labels of shape
    (N, d1, ...) (a class at each position); None when the count is not static."""
    roles, graph = manifest["roles"], manifest["graphs"]["evaluate"]
    shape = next((o["shape"] for o in graph["outputs"] if o["name"] == roles["prediction"]),
                 None)
    if shape is None:
        return None
    if len(shape) > 2:
        label = next((i["shape"] for i in graph["inputs"] if i["name"] == roles["label"]), None)
        if label != shape[:-1]:
            return None
    elif len(shape) == 1 or shape[1] == 1:
        return 2
    return shape[-1] if isinstance(shape[-1], int) else None
