"""Fusion modes: how a program trains, each mode one object in one registry.

    MODES["step"]      train_step: one minibatch step, update included, one run per batch
    MODES["epoch"]     train_epoch (and train_epoch_ordered): every full batch of an epoch in
                       one Scan, one run per epoch; train_step for a last, smaller batch
    MODES["separate"]  gradient, loss, penalty, update: onnxcustom's forward/backward design,
                       chained by the runner; the gradients are outputs (data-parallel
                       training needs them)

A :class:`FuseMode` owns everything that differs between modes:

- ``graphs``: the training graphs its programs hold, beside ``evaluate`` and ``predict``;
- :meth:`FuseMode.plan`: how each of them is built, a
  :class:`~lossgraph.passes.plan.Planned` start and pipeline (``describe_plan`` prints
  them; a graph built from nothing starts at a
  :class:`~lossgraph.passes.plan.GraphSource`, which prints its options);
- :meth:`FuseMode.assemble`: the program's signature and each graph's roles, from the
  graphs built, for the manifest;
- :meth:`FuseMode.stepper`: its runtime step, on an :class:`~lossgraph.runtime.engine.Engine`.

The compiler, the manifest, the engine and the command line take the modes from
:data:`MODES`; nothing else branches on a mode's name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from ..optim import Optimizer
from ..options import choice
from ..passes.contract import Pass, PassResult, Reports
from ..passes.plan import Planned
from ..passes.recompute import Recompute
from ..passes.running_stats import RunningStatistics
from ..passes.sequences import SequencesToTensors
from ..passes.stabilize import StabilizeNumerics
from ..passes.weights import WeightsToInputs
from ..passes.zipmap import ZipMapToTensor
from ..signature import Signature
from ..speed import (
    ConcatScatteredSlabs,
    FoldBatchIntoProducts,
    SumRowsByProduct,
    UnfoldConvWeightGradients,
    WidenScalarConstants,
)
from ..update_options import UpdateOptions

__all__ = ["FuseMode", "PlanContext", "Compiling", "Assembled", "Stepper", "MODES",
           "fuse_mode", "accumulation_problem"]


@dataclass(frozen=True)
class PlanContext:
    """What a mode plans its graphs from: the compile's checked options and what the loss
    model tells (the weights and buffers, whether it holds a split written as a sequence,
    its roles)."""

    weights: tuple[str, ...]
    optimizer: Optimizer
    backend: str
    buffers: tuple[str, ...] = ()
    splits: bool = False
    roles: Mapping[str, str] = field(default_factory=dict)
    loss: str | None = None
    loss_options: Mapping[str, Any] = field(default_factory=dict)
    penalty: Any = None
    #: the inference model has ZipMap outputs, which predict gives as the tensors they zip
    zipmaps: bool = False
    #: the micro-batches of one update a fit takes by default (compile's
    #: ``accumulation_steps``); above 1 the fused modes build the graphs that accumulate
    accumulation_steps: int = 1
    #: gradient clipping and an EMA of the weights, around the optimizer's update
    update_options: UpdateOptions = field(default_factory=UpdateOptions)
    #: compile's ``recompute`` as it applies to this model: ``"none"``, ``"activations"``,
    #: ``"elementwise"``, ``"auto"``, a budget (``"auto"`` within a fraction of the
    #: activations) or the boundaries (:mod:`lossgraph.passes.recompute`), run on the
    #: gradients
    recompute: str | tuple[str, ...] | float = "none"

    @property
    def lift(self) -> WeightsToInputs:
        """The weights and buffers as graph inputs (every graph's first pass)."""
        return WeightsToInputs((*self.weights, *self.buffers))

    @property
    def tensor_outputs(self) -> tuple[Pass, ...]:
        """The inference model's ZipMaps replaced by the tensors they zip, where it has some
        (``predict`` returns what the loss was computed on)."""
        return (ZipMapToTensor(),) if self.zipmaps else ()

    @property
    def widen(self) -> WidenScalarConstants:
        """Every graph's last pass."""
        return WidenScalarConstants()

    @property
    def update_buffers(self) -> tuple[Pass, ...]:
        """The running statistics' update, where there are buffers (then the loss model's
        layers are in training mode)."""
        return (RunningStatistics(),) if self.buffers else ()

    @property
    def stabilize(self) -> tuple[Pass, ...]:
        """Stable forms of what the loss computes, before it is differentiated (and before
        that, the splits written as sequences as tensors: gradients pass tensors only)."""
        return (*((SequencesToTensors(),) if self.splits else ()),
                StabilizeNumerics(self.backend))

    @property
    def speed(self) -> tuple[Pass, ...]:
        """The speed rewrites of a training graph's gradient (:mod:`lossgraph.speed`)."""
        return (FoldBatchIntoProducts(), SumRowsByProduct(), ConcatScatteredSlabs(),
                UnfoldConvWeightGradients())

    @property
    def recomputing(self) -> tuple[Pass, ...]:
        """Activations recomputed in the backward where compile asks
        (:class:`~lossgraph.passes.Recompute`)."""
        if isinstance(self.recompute, float):
            return (Recompute("auto", budget=self.recompute),)
        return () if self.recompute == "none" else (Recompute(self.recompute),)


@dataclass
class Compiling:
    """What compile knows while it builds a program's graphs in plan order: the loss
    model's roles, and the graphs built so far (their models and reports)."""

    roles: Mapping[str, str]
    weights: Sequence[str]
    buffers: Sequence[str]
    built: dict[str, PassResult[Reports]] = field(default_factory=dict)

    @property
    def initial(self) -> dict[str, np.ndarray]:
        """The weights' initial values (the evaluate graph lifted them)."""
        lifted = self.built["evaluate"].report.of(WeightsToInputs)
        return {w: lifted[w] for w in self.weights}

    @property
    def lifted(self) -> dict[str, np.ndarray]:
        """The weights' and buffers' initial values."""
        return dict(self.built["evaluate"].report.of(WeightsToInputs))


@dataclass
class Assembled:
    """What a mode makes of its built graphs: the program's signature (weights, states
    and their next values), and each graph's roles by name where the signature does not
    tell them (the manifest's)."""

    signature: Signature
    graph_roles: dict[str, dict[str, str]] = field(default_factory=dict)


class Stepper(Protocol):
    """A mode's runtime step on an engine: one update on a batch (or on several
    micro-batches), its loss returned and the next state left in the engine's following
    buffer set."""

    def step(self, batch: Mapping[str, np.ndarray], full: int | None) -> float: ...

    def accumulate(self, batches: Sequence[Mapping[str, np.ndarray]], scales: np.ndarray,
                   full: int | None) -> np.ndarray:
        """One update from micro-batches whose gradients add up with the factors
        ``scales``, buffers updated by each in turn: their losses."""


class FuseMode(abc.ABC):
    """A fusion mode: its graphs, their plan, the program it assembles, its runtime step."""

    #: the mode's name (``compile_program(fuse=name)``)
    name: ClassVar[str]
    #: the training graphs its programs hold, beside ``evaluate`` and ``predict``
    graphs: ClassVar[tuple[str, ...]]
    #: the graphs a program may lack (``penalty`` without a penalty)
    optional: ClassVar[tuple[str, ...]] = ()
    #: the graphs a program compiled to accumulate gradients holds besides
    #: (:mod:`lossgraph.passes.accumulate`; none where the stepper sums gradients itself)
    accumulating: ClassVar[tuple[str, ...]] = ()
    #: whether it runs the full batches of an epoch as one graph
    runs_epochs: ClassVar[bool] = False
    #: whether its graphs output the weights' gradients (data-parallel training)
    exposes_gradients: ClassVar[bool] = False
    #: one line for the command line's help
    summary: ClassVar[str]

    @abc.abstractmethod
    def plan(self, context: PlanContext) -> dict[str, Planned]:
        """Each training graph's start and pipeline, in build order."""

    @abc.abstractmethod
    def assemble(self, compiling: Compiling) -> Assembled:
        """The program's signature (and graph roles) from the graphs built."""

    def check(self, context: PlanContext) -> None:
        """Refuse options this mode cannot honour, before any graph is built (every option
        suits the fused modes)."""
        return None

    @abc.abstractmethod
    def stepper(self, engine: Any) -> Stepper:
        """The runtime step over ``engine``'s sessions and state buffers."""

    #: the training graphs the engine rewrites to write the state over the state they
    #: read (:class:`~lossgraph.passes.in_place.WriteInPlace`) when it runs in place
    guarded: ClassVar[tuple[str, ...]] = ()

    def in_place_problem(self, program: Any, packed: Any) -> str | None:
        """Why this mode's steps of ``program`` (with its ``packed`` update) cannot write
        the next state over the one they read, holding it in one buffer set
        (:mod:`lossgraph.passes.in_place`); None when they can."""
        return f"a fuse={self.name!r} program's steps are not built to write in place"

    def packed_update(self, program: Any) -> Any:
        """The update of every weight at once its stepper runs, whose layout the engine's
        state buffers take (:mod:`lossgraph.runtime.packed`); None: each weight apart."""
        return None

    def __repr__(self) -> str:
        return f"FuseMode({self.name!r})"


def accumulation_problem(program: Any) -> str | None:
    """Why ``program``'s steps cannot write in place for its gradient accumulation (the
    micro-batches of an update read one state while its buffers move on), or None."""
    if program.manifest.get("accumulation"):
        return "it was compiled to accumulate gradients (accumulation_steps)"
    return None


from .fused import EpochMode, StepMode  # noqa: E402  (the modes build on the classes above)
from .separate import SeparateMode  # noqa: E402

#: Every fusion mode, by name, in the order the documentation lists them.
MODES: dict[str, FuseMode] = {mode.name: mode for mode in (SeparateMode(), StepMode(),
                                                           EpochMode())}


def fuse_mode(name: Any) -> FuseMode:
    """The mode named ``name``, or an UnsupportedOptionError listing the modes."""
    return MODES[choice("fuse", name, list(MODES))]
