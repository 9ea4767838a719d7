"""Learning-rate schedules: the rate of every update, as data.

A schedule is a frozen dataclass that any optimizer takes as its ``learning_rate``
(``AdamW(learning_rate=Linear(1e-3, total_steps=1000, warmup_steps=100))``). It is data,
not a callback: it serialises in the optimizer's ``to_dict`` (the program's manifest) and
comes back from :func:`schedule_from_dict`, so a saved and loaded program trains the same.
The runtime feeds each update's rate (``schedule(t)``) to the graphs (one rate per step;
the epoch graph takes a vector of them).

lossgraph counts updates from 1; torch's schedulers count the steps already taken from 0
(the first ``optimizer.step()`` uses the scheduler's value at 0, then ``scheduler.step()``).
So update ``t`` runs at the reference's value at ``s = t - 1``. With ``W`` warmup steps
(``w = s / W`` while ``s < W``, which makes the first update's rate 0, as in transformers)
and ``T`` total steps, ``p = (s - W) / max(1, T - W)``:

    Constant     rate * w, then rate                  get_constant_schedule_with_warmup
    Linear       peak * w, then end + (peak - end) max(0, 1 - p)
                                                      get_linear_schedule_with_warmup (end=0),
                                                      get_polynomial_decay_... (power=1)
    Cosine       peak * w, then end + (peak - end) (1 + cos(2 pi cycles p)) / 2
                                                      get_cosine_schedule_with_warmup (end=0),
                                                      get_cosine_with_min_lr_... (min_lr=end)
    Polynomial   peak * w, then end + (peak - end) (1 - p)^power, end after T
                                                      get_polynomial_decay_schedule_with_warmup
    InverseSqrt  peak * w, then peak / sqrt((s + c - W) / c), c = W or 10000
                                                      get_inverse_sqrt_schedule
    StepDecay    rate * gamma^floor(s / step_size)    torch.optim.lr_scheduler.StepLR
    OneCycle     max_rate / div_factor up to max_rate over pct_start T steps, then down to
                 max_rate / (div_factor final_div_factor) at s = T - 1, both halves of a cosine
                                                      OneCycleLR(anneal_strategy="cos")

Past ``total_steps`` Linear and Polynomial hold ``end``; Cosine goes on along its cosine
(transformers' formula); OneCycle, like torch's, has no rate past ``s = T``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import UnsupportedOptionError, suggest
from .options import count, finite, non_negative

__all__ = ["Schedule", "Constant", "Linear", "Cosine", "Polynomial", "InverseSqrt", "StepDecay",
           "OneCycle", "SCHEDULES", "SCHEDULE_NAMES", "schedule_from_dict", "schedule_named"]


def check_step(step: Any) -> int:
    """``step``, an update number: an integer >= 1 (updates count from 1)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise UnsupportedOptionError(
            f"step={step!r} must be an integer >= 1 (updates count from 1).")
    return int(step)


@dataclass(frozen=True)
class Schedule(abc.ABC):
    """The learning rate of every update (module docstring)."""

    #: the argument holding the rate the schedule scales (peak, rate, max_rate)
    peak_argument: ClassVar[str] = "peak"

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int":
                value = count(f"{name}: {field.name}", value, 0)
            else:
                value = finite(f"{name}: {field.name}", value)
            object.__setattr__(self, field.name, value)  # plain numbers: JSON-ready
        self._check()

    def _check(self) -> None:
        """The checks of this schedule's arguments beyond their types (a subclass adds its
        own)."""
        name = self.peak_argument
        non_negative(f"{type(self).__name__}: {name}", getattr(self, name))

    @abc.abstractmethod
    def _value(self, s: int) -> float:
        """The rate after ``s`` updates (the reference's step count, from 0)."""

    def __call__(self, step: int) -> float:
        """The learning rate of update ``step`` (1-based)."""
        return float(self._value(check_step(step) - 1))

    def to_dict(self) -> dict[str, Any]:
        """``{"type": <class name>, <argument>: value, ...}``, for the manifest."""
        return {"type": type(self).__name__, **dataclasses.asdict(self)}

    def _warmup(self, s: int, warmup_steps: int) -> float | None:
        """The linear warmup's factor while ``s < warmup_steps``; None after it."""
        return s / max(1, warmup_steps) if s < warmup_steps else None

    def _positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise UnsupportedOptionError(
                    f"{type(self).__name__}: {name}={getattr(self, name)!r} must be > 0.")

    def _within(self, name: str, value: float, low: float, high: float,
                closed: bool = True) -> None:
        if not (low <= value <= high if closed else low < value < high):
            interval = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g})"
            raise UnsupportedOptionError(
                f"{type(self).__name__}: {name}={value!r} must lie in {interval}.")


class _Decay(Schedule):
    """What Linear, Cosine and Polynomial share: a warmup, then a decay from ``peak`` to
    ``end`` over ``total_steps``."""

    def _check(self) -> None:
        super()._check()
        self._positive("total_steps")
        name = type(self).__name__
        if self.warmup_steps > self.total_steps:
            raise UnsupportedOptionError(
                f"{name}: warmup_steps={self.warmup_steps} exceeds total_steps="
                f"{self.total_steps}: the warmup is part of the total steps.")
        self._within("end", self.end, 0.0, self.peak)

    def _progress(self, s: int) -> float:
        return (s - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)

    def _value(self, s: int) -> float:
        warm = self._warmup(s, self.warmup_steps)
        if warm is not None:
            return self.peak * warm
        return self.end + (self.peak - self.end) * self._decay(s)

    @abc.abstractmethod
    def _decay(self, s: int) -> float:
        """The factor from 1 (end of warmup) to 0 (``total_steps``)."""


@dataclass(frozen=True)
class Constant(Schedule):
    """``rate``, after a linear warmup from 0 over ``warmup_steps`` updates."""

    peak_argument: ClassVar[str] = "rate"
    rate: float
    warmup_steps: int = 0

    def _value(self, s: int) -> float:
        warm = self._warmup(s, self.warmup_steps)
        return self.rate * (1.0 if warm is None else warm)


@dataclass(frozen=True)
class Linear(_Decay):
    """A linear warmup to ``peak``, then a linear decay to ``end`` at ``total_steps``."""

    peak: float
    total_steps: int
    warmup_steps: int = 0
    end: float = 0.0

    def _decay(self, s: int) -> float:
        return max(0.0, 1.0 - self._progress(s))


@dataclass(frozen=True)
class Cosine(_Decay):
    """A linear warmup to ``peak``, then ``cycles`` waves of a cosine between ``peak`` and
    ``end`` (0.5: one half-wave down to ``end`` at ``total_steps``)."""

    peak: float
    total_steps: int
    warmup_steps: int = 0
    end: float = 0.0
    cycles: float = 0.5

    def _check(self) -> None:
        super()._check()
        self._positive("cycles")

    def _decay(self, s: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * self._progress(s)))


@dataclass(frozen=True)
class Polynomial(_Decay):
    """A linear warmup to ``peak``, then ``end + (peak - end) (1 - p)^power``, ``end`` after
    ``total_steps``."""

    peak: float
    total_steps: int
    warmup_steps: int = 0
    end: float = 1e-7
    power: float = 1.0

    def _check(self) -> None:
        super()._check()
        self._positive("power")

    def _decay(self, s: int) -> float:
        return 0.0 if s > self.total_steps else (1.0 - self._progress(s)) ** self.power


@dataclass(frozen=True)
class InverseSqrt(Schedule):
    """A linear warmup to ``peak``, then ``peak / sqrt(s / warmup_steps)`` (with no warmup,
    ``peak / sqrt(1 + s / 10000)``, as transformers' timescale)."""

    peak: float
    warmup_steps: int

    def _value(self, s: int) -> float:
        warm = self._warmup(s, self.warmup_steps)
        if warm is not None:
            return self.peak * warm
        timescale = self.warmup_steps or 10_000
        return self.peak / math.sqrt((s + timescale - self.warmup_steps) / timescale)


@dataclass(frozen=True)
class StepDecay(Schedule):
    """``rate``, multiplied by ``gamma`` every ``step_size`` updates (torch's StepLR)."""

    peak_argument: ClassVar[str] = "rate"
    rate: float
    step_size: int
    gamma: float

    def _check(self) -> None:
        super()._check()
        self._positive("step_size")
        non_negative("StepDecay: gamma", self.gamma)

    def _value(self, s: int) -> float:
        return self.rate * self.gamma ** (s // self.step_size)


@dataclass(frozen=True)
class OneCycle(Schedule):
    """The one-cycle policy (torch's ``OneCycleLR``, cosine annealing, two phases): from
    ``max_rate / div_factor`` up to ``max_rate`` over ``pct_start`` of ``total_steps``, then
    down to ``max_rate / (div_factor final_div_factor)``."""

    peak_argument: ClassVar[str] = "max_rate"
    max_rate: float
    total_steps: int
    pct_start: float = 0.3
    div_factor: float = 25.0
    final_div_factor: float = 1e4

    def _check(self) -> None:
        super()._check()
        self._positive("total_steps", "div_factor", "final_div_factor")
        self._within("pct_start", self.pct_start, 0.0, 1.0, closed=False)

    def _value(self, s: int) -> float:
        if s > self.total_steps:
            raise UnsupportedOptionError(
                f"OneCycle(total_steps={self.total_steps}) has no rate for update {s + 1}: its "
                f"cycle ends after {self.total_steps} updates (torch's OneCycleLR refuses to "
                "step past it too). Give total_steps the number of updates training runs "
                "(epochs x batches per epoch).")
        start = self.max_rate / self.div_factor
        low = start / self.final_div_factor
        rise = self.pct_start * self.total_steps - 1.0
        if s <= rise:
            return _cosine_anneal(start, self.max_rate, s / rise)
        return _cosine_anneal(self.max_rate, low, (s - rise) / (self.total_steps - 1.0 - rise))


def _cosine_anneal(start: float, end: float, fraction: float) -> float:
    """From ``start`` (fraction 0) to ``end`` (1) along half a cosine, as torch's
    OneCycleLR computes it."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * fraction) + 1)


#: Every schedule, by class name (the manifest's ``"type"``).
SCHEDULES: dict[str, type[Schedule]] = {
    cls.__name__: cls for cls in (Constant, Linear, Cosine, Polynomial, InverseSqrt, StepDecay,
                                  OneCycle)}

#: The command line's names: each class name in snake case.
SCHEDULE_NAMES: dict[str, type[Schedule]] = {
    "constant": Constant, "linear": Linear, "cosine": Cosine, "polynomial": Polynomial,
    "inverse_sqrt": InverseSqrt, "step_decay": StepDecay, "one_cycle": OneCycle}


def schedule_from_dict(d: Mapping[str, Any]) -> Schedule:
    """The schedule :meth:`Schedule.to_dict` described; a missing or unknown argument is an
    :class:`~lossgraph.errors.UnsupportedOptionError` naming the arguments."""
    if not isinstance(d, Mapping) or "type" not in d:
        raise UnsupportedOptionError(
            "A schedule description is a dict with a 'type' key, e.g. {'type': 'Linear', "
            f"'peak': 0.001, 'total_steps': 1000}}; got {reprlib.repr(d)}.")
    kind = d["type"]
    if not isinstance(kind, str) or kind not in SCHEDULES:
        raise UnsupportedOptionError(
            f"Unknown schedule type {kind!r}." + suggest(str(kind), SCHEDULES, "schedules"))
    return _build(SCHEDULES[kind], {k: v for k, v in d.items() if k != "type"})


def schedule_named(name: str, **arguments: Any) -> Schedule:
    """The schedule of a command-line name (:data:`SCHEDULE_NAMES`) with ``arguments``."""
    if name not in SCHEDULE_NAMES:
        raise UnsupportedOptionError(
            f"Unknown schedule {name!r}." + suggest(name, SCHEDULE_NAMES, "schedules"))
    return _build(SCHEDULE_NAMES[name], arguments)


def _build(cls: type[Schedule], arguments: Mapping[str, Any]) -> Schedule:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    listed = ", ".join(fields)
    unknown = sorted(set(arguments) - set(fields))
    if unknown:
        raise UnsupportedOptionError(
            f"{cls.__name__} has no argument {unknown[0]!r} (its arguments: {listed})."
            + suggest(unknown[0], list(fields), "arguments"))
    missing = [name for name, f in fields.items() if name not in arguments
               and f.default is dataclasses.MISSING]
    if missing:
        raise UnsupportedOptionError(
            f"{cls.__name__} needs {', '.join(missing)} (its arguments: {listed}).")
    return cls(**arguments)
