"""The learning rates of onnxcustom's forward/backward optimizer.

A learning rate is stepped once per epoch; ``t`` counts the epochs already finished
(``t = 0`` for the first epoch), and every update of epoch ``t`` uses::

    constant    eta_t = eta0
    invscaling  eta_t = eta0 / (t + 1)^power_t     (SGDOptimizer.iteration_ends's formula, with
                                                   t the epoch: scikit-learn's MLP passes the
                                                   number of samples seen instead)
    optimal     eta_t = eta0 / (1 + alpha e t),  e = typw / (2 (1 + typw)),  typw = alpha^(-1/4)

``optimal`` is onnxcustom's: scikit-learn's ``SGDRegressor`` schedule
``1 / (alpha (t0 + t))`` with ``t0 = 1 / (alpha e)``, multiplied by the constant that makes
its first rate ``eta0`` (scikit-learn's own starts at ``alpha^(-1/4)``, 10 for the default
alpha, and diverges on onnxcustom's examples; :class:`lossgraph.optim.SGD`
keeps scikit-learn's). :meth:`BaseLearningRate.loop` yields ``eta_0, eta_1, ...`` as
onnxcustom's ``loop`` did. The update of :class:`LearningRateSGDNesterov` is
scikit-learn's ``SGDOptimizer``::

    u' = m u - eta_t g;   w' = w + u'                 nesterov=False
                          w' = w + m u' - eta_t g     nesterov=True

:class:`lossgraph.optim.Momentum` keeps ``v = -u / eta_t`` instead (``v' = m v + g``,
``w' = w - eta_t v'`` or ``w - eta_t (g + m v')``): the same numbers while ``eta_t`` holds,
and exactly the same across epochs when the runner multiplies every velocity by
:meth:`LearningRateSGDNesterov.velocity_scale` before the first update of epoch ``t``
(``eta_{t-1} / eta_t``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx

from ..errors import UnsupportedOptionError, suggest
from ..optim import SGD, Momentum, Optimizer, update_graph
from ..options import count, finite, non_negative

__all__ = ["BaseLearningRate", "LearningRateSGD", "LearningRateSGDNesterov"]

SCHEDULES = ("constant", "invscaling", "optimal")


@dataclass(frozen=True)
class BaseLearningRate:
    """A per-epoch learning-rate schedule and the lossgraph optimizer doing its update."""

    eta0: float = 0.01
    alpha: float = 0.0001
    power_t: float = 0.25
    learning_rate: str = "invscaling"

    #: The names :meth:`select` accepts for this class, besides the class name.
    aliases: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        non_negative(f"{owner}: eta0", self.eta0)
        non_negative(f"{owner}: alpha", self.alpha)
        finite(f"{owner}: power_t", self.power_t)
        if self.learning_rate not in SCHEDULES:
            raise UnsupportedOptionError(
                f"{owner}: unknown learning_rate {self.learning_rate!r}."
                + suggest(str(self.learning_rate), SCHEDULES, "schedules"))
        if self.learning_rate == "optimal" and self.alpha == 0:
            raise UnsupportedOptionError(
                f"{owner}: learning_rate='optimal' needs alpha > 0 (its rate is "
                "1 / (alpha (t0 + t))).")

    @property
    def optimal_init(self) -> float:
        """onnxcustom's ``t0`` of the optimal schedule: ``1 / (alpha e)``, with
        ``e = typw / max(1, 2 (1 + typw))`` and ``typw = alpha^(-1/4)``."""
        typw = math.sqrt(1.0 / math.sqrt(self.alpha))
        return 1.0 / (typw / max(1.0, (1 + typw) * 2) * self.alpha)

    def value(self, epoch: int) -> float:
        """The learning rate of every update in epoch ``epoch`` (0 for the first)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise UnsupportedOptionError(f"epoch={epoch!r} must be an integer >= 0.")
        if self.learning_rate == "invscaling":
            return float(self.eta0) / float(epoch + 1) ** self.power_t
        if self.learning_rate == "optimal":  # eta0 t0 / (t0 + t), exactly eta0 at t = 0
            return float(self.eta0) / (1.0 + epoch / self.optimal_init)
        return float(self.eta0)

    def loop(self, n: int = 1000) -> Iterator[float]:
        """The rates of the first ``n`` epochs, ``value(0)`` to ``value(n - 1)``, as
        onnxcustom's ``loop`` yielded them."""
        n = count("n", n, 0)
        return (self.value(t) for t in range(n))

    def to_optimizer(self) -> Optimizer:
        """The lossgraph optimizer whose update graph does this rate's per-step update;
        feed it :meth:`value` as its ``learning_rate`` input."""
        raise NotImplementedError

    def build_onnx_function(self, weights: Mapping[str, np.ndarray], opset: int = 18,
                            device: str = "cpu") -> onnx.ModelProto:
        """The update graph for ``weights`` (name -> value, giving shapes and dtype):
        ``(learning_rate, step, W, W_grad, states...) -> (W_new, states_new...)``, as
        :func:`lossgraph.optim.update_graph` builds it for :meth:`to_optimizer`. The
        graph does not depend on ``device``; the session running it picks the device."""
        if not isinstance(device, str):
            raise UnsupportedOptionError(f"device={device!r} must be a string such as 'cpu'.")
        return update_graph(self.to_optimizer(), weights, opset)

    @classmethod
    def select(cls, value: Any) -> BaseLearningRate:
        """An instance for ``value``: an instance (returned as is), a number ``eta0``
        (``LearningRateSGD(eta0=eta0)``, whose default schedule is invscaling, as
        onnxcustom's ``select`` gave), a class name or an alias (``"SGD"``,
        ``"SGDNesterov"``, ``"Nesterov"``). A constant rate is
        ``LearningRateSGD(eta0, learning_rate="constant")``."""
        if isinstance(value, BaseLearningRate):
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return LearningRateSGD(eta0=float(value))
        names = {name: kind for kind in (LearningRateSGD, LearningRateSGDNesterov)
                 for name in (kind.__name__, *kind.aliases)}
        if isinstance(value, str) and value in names:
            return names[value]()
        raise UnsupportedOptionError(
            f"Unknown learning rate {value!r}: give a float, an instance or a name."
            + suggest(str(value), names, "learning rates"))


@dataclass(frozen=True)
class LearningRateSGD(BaseLearningRate):
    """Plain SGD, ``w' = w - eta_t g``: :class:`lossgraph.optim.SGD`."""

    aliases: ClassVar[tuple[str, ...]] = ("SGD",)

    def to_optimizer(self) -> SGD:
        return SGD(learning_rate=self.eta0)


@dataclass(frozen=True)
class LearningRateSGDNesterov(BaseLearningRate):
    """SGD with momentum, Nesterov's by default, as scikit-learn's ``SGDOptimizer``:
    :class:`lossgraph.optim.Momentum` with :meth:`velocity_scale` (module docstring)."""

    momentum: float = 0.9
    nesterov: bool = True

    aliases: ClassVar[tuple[str, ...]] = ("SGDNesterov", "Nesterov")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.to_optimizer()  # Momentum checks momentum and nesterov

    def to_optimizer(self) -> Momentum:
        return Momentum(learning_rate=self.eta0, momentum=self.momentum, nesterov=self.nesterov)

    def velocity_scale(self, epoch: int) -> float:
        """The factor ``eta_{t-1} / eta_t`` the velocities take before epoch ``t``'s first
        update, so that Momentum's ``-eta_t v`` stays scikit-learn's ``u`` (1 for ``t = 0``)."""
        if epoch == 0:
            return 1.0
        current = self.value(epoch)
        if current == 0:
            raise UnsupportedOptionError(
                f"{type(self).__name__}: the rate of epoch {epoch} is 0, so Momentum's velocity "
                "cannot carry scikit-learn's; use eta0 > 0.")
        return self.value(epoch - 1) / current
