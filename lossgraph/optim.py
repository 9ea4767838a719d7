"""Optimizers: the weight update as ONNX nodes, one small subgraph per weight.

Each optimizer emits, for a weight ``w`` with gradient ``g``, its per-weight state
and the scalar inputs ``lr`` (the learning rate, a scalar of the weight's dtype,
fed each step) and ``t`` (int64, the 1-based update number), the nodes computing
the new weight and the new state. The formulas (``m``, ``b1``, ``b2``, ``eps``,
``wd`` are the optimizer's constants, folded into the graph):

    SGD        w' = w - lr g
    Momentum   v' = m v + g                                    (torch.optim.SGD)
               w' = w - lr v'                 nesterov=False
               w' = w - lr (g + m v')         nesterov=True
    Adam       m' = b1 m + (1 - b1) g                          (torch.optim.Adam)
               v' = b2 v + (1 - b2) g^2
               w' = w - (lr / (1 - b1^t)) m' / (sqrt(v') / sqrt(1 - b2^t) + eps)
    AdamW      w~ = w (1 - lr wd), then Adam's step on w~      (torch.optim.AdamW)

The learning rate is a graph input so that a schedule can change it between
steps: :meth:`Optimizer.schedule` gives its value for update ``t``. Every optimizer's
``learning_rate`` is a number or a :mod:`lossgraph.schedules` schedule (``Linear``,
``Cosine``, ... with warmup: data, saved in :meth:`Optimizer.to_dict`). :class:`SGD` also
has the schedules of scikit-learn's ``SGDRegressor`` (``_sgd_fast.pyx``):

    constant    lr_t = learning_rate
    invscaling  lr_t = eta0 / t^power_t                  (eta0 defaults to learning_rate)
    optimal     lr_t = 1 / (alpha (t0 + t - 1)),  t0 = 1 / (alpha typw),  typw = alpha^(-1/4)

(scikit-learn's heuristic is ``initial_eta0 = typw / max(1, dloss(1, -typw))``; the
derivative is negative for every loss it offers, so ``initial_eta0 = typw`` and the
first rate is ``typw``.)

Scalar work shared by all weights (Adam's bias corrections, AdamW's decay factor)
is emitted once per builder; per-tensor work broadcasts a scalar against the
weight at most once per term, and no ``Where`` is used.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper

from .builder import GraphBuilder, standalone_model
from .errors import UnsupportedOptionError, suggest
from .graphs import weights_dtype
from .names import NameAuthority
from .options import finite, matching_weights, non_negative, weight_patterns
from .schedules import Schedule, check_step, schedule_from_dict
from .target import check_opset_option
from .update_options import UpdateOptions

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "AdamW", "optimizer_from_dict", "as_optimizer",
           "OPTIMIZERS", "update_graph", "build_update", "BuiltUpdate"]

SCHEDULES = ("constant", "invscaling", "optimal")


# -- validation helpers ----------------------------------------------------------------


def _non_negative(owner: str, name: str, value: Any) -> None:
    non_negative(f"{owner}: {name}", value)


def _unit_interval(owner: str, name: str, value: Any) -> None:
    if not 0 <= finite(f"{owner}: {name}", value) < 1:
        raise UnsupportedOptionError(f"{owner}: {name}={value!r} must lie in [0, 1).")


def _elem_type(dtype: Any) -> int:
    return dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# -- the optimizers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer(abc.ABC):
    """A weight-update rule with constant hyper-parameters and per-weight state."""

    learning_rate: float | Schedule = 0.01
    _state_suffixes: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.learning_rate, (Schedule, numbers.Real)):
            raise UnsupportedOptionError(
                f"{type(self).__name__}: learning_rate={reprlib.repr(self.learning_rate)} must "
                "be a finite number >= 0 or a lossgraph.schedules schedule, e.g. Linear(1e-3, "
                "total_steps=1000, warmup_steps=100).")
        if not isinstance(self.learning_rate, Schedule):
            _non_negative(type(self).__name__, "learning_rate", self.learning_rate)
        # Plain Python numbers (not numpy scalars), so that to_dict() is JSON-ready.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, field.name, bool(value))
            elif isinstance(value, numbers.Real):
                object.__setattr__(self, field.name, float(value))

    def schedule(self, step: int) -> float:
        """The learning rate for update number ``step`` (1-based): ``learning_rate``, or its
        schedule's value at ``step``."""
        if isinstance(self.learning_rate, Schedule):
            return self.learning_rate(step)
        check_step(step)
        return float(self.learning_rate)

    def schedules(self, first: int, count: int) -> np.ndarray:
        """The learning rates of updates ``first`` to ``first + count - 1`` (float64), as
        :meth:`schedule` gives them; an epoch graph takes them all at once."""
        if self._constant_schedule:
            return np.full(count, self.schedule(first))
        return np.array([self.schedule(t) for t in range(first, first + count)], np.float64)

    @property
    def _constant_schedule(self) -> bool:
        return not isinstance(self.learning_rate, Schedule)

    @property
    def same_for_every_weight(self) -> bool:
        """Whether every weight takes the same elementwise update, so that weights laid end
        to end in one vector update as one (:class:`~lossgraph.passes.PackWeights`)."""
        return True

    def state_names(self, weight: str) -> list[str]:
        """Names of the per-weight state tensors, named after the weight."""
        return [f"{weight}_{suffix}" for suffix in self._state_suffixes]

    def initial_state(self, weight: np.ndarray) -> list[np.ndarray]:
        """The state before the first update: zeros like ``weight``, one per state name
        (``np.zeros``: memory the system zeroes and maps when it is first written, so a
        program holds none of it while it is only read; ``zeros_like`` writes every
        byte, 836 MiB resident for BERT-base's AdamW moments)."""
        return [np.zeros(weight.shape, weight.dtype) for _ in self._state_suffixes]

    @abc.abstractmethod
    def emit_update(self, b: GraphBuilder, weight: str, grad: str, states: Sequence[str],
                    learning_rate: str, step: str, dtype: Any) -> tuple[str, list[str]]:
        """Emit nodes computing ``(new weight, [new states])`` into ``b``.

        ``learning_rate`` is a scalar of ``dtype`` (the weight's), ``step`` an int64
        scalar holding the 1-based update number, ``states`` the current state values in
        :meth:`state_names` order.
        """

    def to_dict(self) -> dict[str, Any]:
        """``{"type": <class name>, <hyper-parameter>: value, ...}``, for the manifest (a
        schedule as its own dict, :meth:`~lossgraph.schedules.Schedule.to_dict`)."""
        described = {f.name: list(value) if isinstance(value, tuple) else value
                     for f in dataclasses.fields(self) for value in [getattr(self, f.name)]}
        if isinstance(self.learning_rate, Schedule):
            described["learning_rate"] = self.learning_rate.to_dict()
        return {"type": type(self).__name__, **described}

    def _check_states(self, states: Sequence[str]) -> None:
        if len(states) != len(self._state_suffixes):
            raise UnsupportedOptionError(
                f"{type(self).__name__} keeps {len(self._state_suffixes)} state tensor(s) per "
                f"weight ({', '.join(self._state_suffixes) or 'none'}); got {len(states)}."
            )


@dataclass(frozen=True)
class SGD(Optimizer):
    """Plain stochastic gradient descent, ``w' = w - lr g``, with scikit-learn's schedules.

    ``learning_rate_schedule`` is ``"constant"`` (``learning_rate``), ``"invscaling"``
    (``eta0 / t**power_t``, ``eta0`` defaulting to ``learning_rate``) or ``"optimal"``
    (``1 / (alpha (t0 + t - 1))``, see the module docstring).
    """

    learning_rate: float | Schedule = 0.01
    learning_rate_schedule: str = "constant"
    eta0: float | None = None
    power_t: float = 0.25
    alpha: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learning_rate_schedule not in SCHEDULES:
            raise UnsupportedOptionError(
                f"SGD: unknown learning_rate_schedule {self.learning_rate_schedule!r}."
                + suggest(str(self.learning_rate_schedule), SCHEDULES, "schedules")
            )
        if self.learning_rate_schedule != "constant" and isinstance(self.learning_rate,
                                                                    Schedule):
            raise UnsupportedOptionError(
                f"SGD: learning_rate is a schedule ({type(self.learning_rate).__name__}) and "
                f"learning_rate_schedule={self.learning_rate_schedule!r} is another: give one "
                "(learning_rate_schedule='constant' follows the learning_rate schedule).")
        if self.eta0 is not None:
            _non_negative("SGD", "eta0", self.eta0)
        finite("SGD: power_t", self.power_t)
        _non_negative("SGD", "alpha", self.alpha)
        if self.learning_rate_schedule == "optimal" and self.alpha == 0:
            raise UnsupportedOptionError(
                "SGD: learning_rate_schedule='optimal' needs alpha > 0 (its rate is "
                "1 / (alpha (t0 + t - 1)))."
            )

    @property
    def initial_eta0(self) -> float:
        """``eta0`` as the invscaling schedule uses it (``learning_rate`` when unset)."""
        return float(self.learning_rate if self.eta0 is None else self.eta0)

    @property
    def optimal_init(self) -> float:
        """scikit-learn's ``t0`` for the optimal schedule: ``1 / (alpha typw)``."""
        typw = math.sqrt(1.0 / math.sqrt(self.alpha))
        return 1.0 / (typw * self.alpha)

    @property
    def _constant_schedule(self) -> bool:
        return self.learning_rate_schedule == "constant" and super()._constant_schedule

    def schedule(self, step: int) -> float:
        if self.learning_rate_schedule == "invscaling":
            return self.initial_eta0 / float(check_step(step)) ** self.power_t
        if self.learning_rate_schedule == "optimal":
            return 1.0 / (self.alpha * (self.optimal_init + check_step(step) - 1))
        return super().schedule(step)

    def emit_update(self, b: GraphBuilder, weight: str, grad: str, states: Sequence[str],
                    learning_rate: str, step: str, dtype: Any) -> tuple[str, list[str]]:
        self._check_states(states)
        return b.Sub(weight, b.Mul(grad, learning_rate), hint=f"{weight}_new"), []


@dataclass(frozen=True)
class Momentum(Optimizer):
    """SGD with (Nesterov) momentum, as ``torch.optim.SGD(momentum=m, nesterov=...)``.

    ``v' = m v + g``; ``w' = w - lr v'``, or ``w' = w - lr (g + m v')`` with Nesterov.
    State: ``<weight>_velocity``.
    """

    learning_rate: float | Schedule = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    _state_suffixes: ClassVar[tuple[str, ...]] = ("velocity",)

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit_interval("Momentum", "momentum", self.momentum)
        if not isinstance(self.nesterov, (bool, np.bool_)):
            raise UnsupportedOptionError(f"Momentum: nesterov={self.nesterov!r} must be a bool.")
        if self.nesterov and self.momentum == 0:
            raise UnsupportedOptionError(
                "Momentum: nesterov=True needs momentum > 0 (torch.optim.SGD rejects it too); "
                "use SGD for plain gradient descent."
            )

    def emit_update(self, b: GraphBuilder, weight: str, grad: str, states: Sequence[str],
                    learning_rate: str, step: str, dtype: Any) -> tuple[str, list[str]]:
        self._check_states(states)
        if self.momentum == 0:
            velocity = b.Identity(grad, hint=f"{weight}_velocity_new")
        else:
            m = b.const(self.momentum, dtype, "momentum")
            velocity = b.Add(b.Mul(states[0], m), grad, hint=f"{weight}_velocity_new")
        direction = b.Add(grad, b.Mul(velocity, m)) if self.nesterov else velocity
        new_weight = b.Sub(weight, b.Mul(direction, learning_rate), hint=f"{weight}_new")
        return new_weight, [velocity]


#: Why Adam needs an epsilon the weights' type does not round to 0.
_ZERO_EPSILON = (
    "{name}: epsilon={value}{type}: the update divides 0 by 0 for every weight entry "
    "whose gradient is 0 (a dead unit's, an unused class's), and the weight becomes NaN. "
    "Use a positive epsilon the weights' type can hold, e.g. 1e-8 (the default).")


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam, as ``torch.optim.Adam`` (bias-corrected, ``eps`` added after the square root).

    States: ``<weight>_m`` (first moment) and ``<weight>_v`` (second moment).
    """

    learning_rate: float | Schedule = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    _state_suffixes: ClassVar[tuple[str, ...]] = ("m", "v")

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        _unit_interval(name, "beta1", self.beta1)
        _unit_interval(name, "beta2", self.beta2)
        _non_negative(name, "epsilon", self.epsilon)
        if self.epsilon == 0:
            raise UnsupportedOptionError(_ZERO_EPSILON.format(name=name, value=0, type=""))

    def _decayed(self, b: GraphBuilder, weight: str, learning_rate: str, dtype: Any) -> str:
        return weight

    def emit_update(self, b: GraphBuilder, weight: str, grad: str, states: Sequence[str],
                    learning_rate: str, step: str, dtype: Any) -> tuple[str, list[str]]:
        self._check_states(states)
        m, v = states
        const = b.const

        def scalars() -> tuple[str, ...]:
            elem_type = _elem_type(dtype)
            (t,) = b.memo(("t", step, elem_type), lambda: (b.Cast(step, to=elem_type,
                                                                     hint="t"),))
            one = const(1.0, dtype, "one")
            bc1 = b.Sub(one, b.Pow(const(self.beta1, dtype, "beta1"), t), hint="bias_correction1")
            bc2 = b.Sub(one, b.Pow(const(self.beta2, dtype, "beta2"), t), hint="bias_correction2")
            step_size = b.Div(learning_rate, bc1, hint="step_size")
            return step_size, b.Sqrt(bc2, hint="bias_correction2_sqrt")

        key = ("adam", self.beta1, self.beta2, learning_rate, step, _elem_type(dtype))
        step_size, sqrt_bc2 = b.memo(key, scalars)

        w = self._decayed(b, weight, learning_rate, dtype)
        m_new = b.Add(b.Mul(m, const(self.beta1, dtype, "beta1")),
                      b.Mul(grad, const(1.0 - self.beta1, dtype, "one_minus_beta1")),
                      hint=f"{weight}_m_new")
        v_new = b.Add(b.Mul(v, const(self.beta2, dtype, "beta2")),
                      b.Mul(b.Mul(grad, grad), const(1.0 - self.beta2, dtype, "one_minus_beta2")),
                      hint=f"{weight}_v_new")
        np_type = np.dtype(helper.tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int)
                           else dtype)
        if np_type.type(self.epsilon) == 0:
            raise UnsupportedOptionError(_ZERO_EPSILON.format(
                name=type(self).__name__, value=self.epsilon,
                type=f" is 0 in {np_type}, the weights' type"))
        denominator = b.Add(b.Div(b.Sqrt(v_new), sqrt_bc2), const(self.epsilon, dtype, "epsilon"))
        new_weight = b.Sub(w, b.Div(b.Mul(m_new, step_size), denominator), hint=f"{weight}_new")
        return new_weight, [m_new, v_new]


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: ``w <- w (1 - lr wd)`` first, then Adam's step.

    ``exclude_from_weight_decay``: the weights that take Adam's step without the decay (torch's
    second parameter group, ``weight_decay=0``): names or regular expressions
    (:func:`lossgraph.options.matching_weights`), or ``"auto"``, every bias and normalization
    scale and shift (:func:`lossgraph.analysis.no_decay_weights`), which
    :func:`~lossgraph.compile_program` resolves from the graph into the names it records.
    """

    weight_decay: float = 0.01
    exclude_from_weight_decay: str | tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_from_weight_decay", weight_patterns(
            "AdamW: exclude_from_weight_decay", self.exclude_from_weight_decay))
        super().__post_init__()
        _non_negative("AdamW", "weight_decay", self.weight_decay)

    @property
    def same_for_every_weight(self) -> bool:
        return self.weight_decay == 0 or not self.exclude_from_weight_decay

    def to_dict(self) -> dict[str, Any]:
        described = super().to_dict()
        if not self.exclude_from_weight_decay:  # as the previous release wrote AdamW
            del described["exclude_from_weight_decay"]
        return described

    def decays(self, weight: str) -> bool:
        """Whether ``weight`` takes the decay: ``exclude_from_weight_decay`` selects it not."""
        excluded = self.exclude_from_weight_decay
        if excluded == "auto":
            raise UnsupportedOptionError(
                "AdamW(exclude_from_weight_decay='auto') finds the biases and normalization "
                "weights from the model's graph: compile_program resolves it. Without a graph "
                "(update_graph), list the names or regular expressions to exclude.")
        return not any(matching_weights(pattern, [weight]) for pattern in excluded)

    def _decayed(self, b: GraphBuilder, weight: str, learning_rate: str, dtype: Any) -> str:
        if self.weight_decay == 0 or not self.decays(weight):
            return weight

        def decay() -> str:
            shrink = b.Mul(learning_rate, b.const(self.weight_decay, dtype, "weight_decay"))
            return (b.Sub(b.const(1.0, dtype, "one"), shrink, hint="decay"),)

        key = ("decay", self.weight_decay, learning_rate, _elem_type(dtype))
        (factor,) = b.memo(key, decay)
        return b.Mul(weight, factor, hint=f"{weight}_decayed")


OPTIMIZERS: dict[str, type[Optimizer]] = {
    cls.__name__: cls for cls in (SGD, Momentum, Adam, AdamW)
}


def optimizer_from_dict(d: Mapping[str, Any]) -> Optimizer:
    """The optimizer :meth:`Optimizer.to_dict` described."""
    if not isinstance(d, Mapping) or "type" not in d:
        raise UnsupportedOptionError(
            f"An optimizer description is a dict with a 'type' key, e.g. "
            f"{{'type': 'SGD', 'learning_rate': 0.01}}; got {d!r}."
        )
    kind = d["type"]
    if not isinstance(kind, str) or kind not in OPTIMIZERS:
        raise UnsupportedOptionError(
            f"Unknown optimizer type {kind!r}." + suggest(str(kind), OPTIMIZERS, "types")
        )
    cls = OPTIMIZERS[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    options = {k: v for k, v in d.items() if k != "type"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise UnsupportedOptionError(
            f"{kind} has no option {unknown[0]!r} (its options: {', '.join(sorted(fields))})."
        )
    if isinstance(options.get("learning_rate"), Mapping):  # a schedule's dict form
        options["learning_rate"] = schedule_from_dict(options["learning_rate"])
    return cls(**options)


def as_optimizer(value: Optimizer | str | Mapping[str, Any] | None) -> Optimizer:
    """The optimizer ``value`` describes, for ``compile_program(optimizer=...)``.

    Accepted on purpose: an :class:`Optimizer`; ``None`` (``SGD()``); a type name in any
    case (``"adam"``: default hyper-parameters); the dict form of :meth:`Optimizer.to_dict`
    (what the manifest and the CLI hold). A class (``Adam`` for ``Adam()``) or anything
    else is an :class:`UnsupportedOptionError`, so that no hyper-parameter is guessed.
    """
    if value is None:
        return SGD()
    if isinstance(value, Optimizer):
        return value
    if isinstance(value, str):
        by_name = {name.lower(): cls for name, cls in OPTIMIZERS.items()}
        if value.lower() not in by_name:
            raise UnsupportedOptionError(
                f"Unknown optimizer {value!r}." + suggest(value, OPTIMIZERS, "optimizers"))
        return by_name[value.lower()]()
    if isinstance(value, Mapping):
        return optimizer_from_dict(value)
    if isinstance(value, type) and issubclass(value, Optimizer):
        raise UnsupportedOptionError(
            f"optimizer={value.__name__} is a class, not an optimizer: pass an instance, e.g. "
            f"optimizer={value.__name__}() or {value.__name__}(learning_rate=0.01).")
    raise UnsupportedOptionError(
        f"optimizer={reprlib.repr(value)} is not an optimizer: pass a lossgraph.optim "
        "optimizer (SGD(0.01), Momentum(0.01, nesterov=True), Adam(), AdamW()), its name "
        "('adam') or its dict form ({'type': 'Adam', 'learning_rate': 0.001}). torch.optim "
        "optimizers are not accepted.")


# -- the standalone update graph ------------------------------------------------------


@dataclass(frozen=True)
class BuiltUpdate:
    """An update graph (:func:`update_graph`) and the names of its inputs and outputs."""

    model: onnx.ModelProto
    learning_rate: str
    step: str
    gradients: dict[str, str]  # weight -> its gradient input
    states: dict[str, list[str]]  # weight -> its state inputs
    new: dict[str, str]  # weight or state -> the output with its next value
    grad_norm: str | None = None  # the gradients' norm output, where the update clips

    @property
    def roles(self) -> dict[str, str]:
        """The role of each input and output, as the manifest names them."""
        roles = {self.learning_rate: "learning_rate", self.step: "step"}
        if self.grad_norm:
            roles[self.grad_norm] = "grad_norm"
        for weight, states in self.states.items():
            roles.update({weight: "weight", self.gradients[weight]: "gradient",
                          self.new[weight]: "new_weight"})
            roles.update((s, "state") for s in states)
            roles.update((self.new[s], "new_state") for s in states)
        return roles


def update_graph(
    optimizer: Optimizer, weights: Mapping[str, np.ndarray], opset: int = 18,
    options: UpdateOptions | None = None,
) -> onnx.ModelProto:
    """The standalone update graph of ``optimizer`` for ``weights`` (name -> initial value).

    Inputs: ``learning_rate`` (a scalar of the weights' float type: the schedule's value
    for this update), ``step`` (int64 scalar, the 1-based update number; Adam and AdamW
    read it), then per weight ``w``, ``w_grad``, its states
    (:meth:`Optimizer.state_names`); outputs per weight ``w_new`` then ``<state>_new``.
    A name a weight has already gets a suffix (``w_grad_1``). A runner feeds the
    outputs back as the next step's inputs. ``options``
    (:class:`~lossgraph.update_options.UpdateOptions`) clips the gradients first (the
    norm is the last output, ``grad_norm``) and keeps an EMA of each weight (its last
    state, ``<w>_ema``).
    """
    return build_update(optimizer, weights, opset, options=options).model


def build_update(optimizer: Optimizer, weights: Mapping[str, np.ndarray], opset: int = 18,
                 taken: Iterable[str] = (), options: UpdateOptions | None = None
                 ) -> BuiltUpdate:
    """:func:`update_graph` with the names it chose, none of them a weight's or in
    ``taken``."""
    options = options or UpdateOptions()
    if not isinstance(optimizer, Optimizer):
        raise UnsupportedOptionError(
            f"optimizer must be a lossgraph.optim optimizer (SGD, Momentum, Adam, AdamW), "
            f"not {optimizer!r}."
        )
    check_opset_option(opset)
    dtype = weights_dtype(weights, "update_graph")
    elem_type = helper.np_dtype_to_tensor_dtype(dtype)
    names = NameAuthority([*weights, *taken])
    learning_rate, step = names.fresh("learning_rate"), names.fresh("step")
    inputs = [helper.make_tensor_value_info(learning_rate, elem_type, []),
              helper.make_tensor_value_info(step, TensorProto.INT64, [])]
    gradients = {w: names.fresh(f"{w}_grad") for w in weights}
    states = {w: [names.fresh(s) for s in options.state_names(optimizer, w)] for w in weights}
    for weight, value in weights.items():
        for name in (weight, gradients[weight], *states[weight]):
            inputs.append(helper.make_tensor_value_info(name, elem_type, np.shape(value)))
    new = {name: names.fresh(f"{name}_new") for w in weights for name in (w, *states[w])}
    grad_norm = names.fresh("grad_norm") if options.clips else None

    b = GraphBuilder(names, opset)
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    computed, norm = options.emit_update(b, optimizer, gradients, states, learning_rate, step,
                                         dtype)
    for weight, value in weights.items():
        for result, old in zip(computed[weight], [weight, *states[weight]]):
            info = helper.make_tensor_value_info(new[old], elem_type, np.shape(value))
            outputs.append((result, new[old], info))
    if norm is not None:
        outputs.append((norm, grad_norm, helper.make_tensor_value_info(grad_norm, elem_type, [])))
    model = standalone_model(b, f"{type(optimizer).__name__}_update", inputs, outputs, opset)
    return BuiltUpdate(model, learning_rate, step, gradients, states, new, grad_norm)
