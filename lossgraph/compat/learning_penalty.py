"""The penalties of onnxcustom's forward/backward optimizer.

For every weight ``W`` given::

    NoLearningPenalty           penalty = 0
    ElasticLearningPenalty      penalty = l1 sum|W| + l2 sum W^2     grad = l1 sign(W) + 2 l2 W

as lossgraph's penalty dict (:meth:`BaseLearningPenalty.penalty`, what ``compile_program``
and ``add_loss_output`` take) and as the standalone graph of
:func:`lossgraph.penalties.penalty_graph`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx

from ..errors import UnsupportedOptionError, suggest
from ..options import non_negative
from ..penalties import penalty_graph

__all__ = ["BaseLearningPenalty", "NoLearningPenalty", "ElasticLearningPenalty"]


@dataclass(frozen=True)
class BaseLearningPenalty:
    """A penalty on the weights, as a penalty dict and as a graph."""

    #: The names :meth:`select` accepts for this class, besides the class name.
    aliases: ClassVar[tuple[str, ...]] = ()

    def penalty(self, weights: Iterable[str]) -> dict[str, dict[str, float]]:
        """lossgraph's ``penalty=`` dict for the weights named ``weights``."""
        raise NotImplementedError

    def build_onnx_function(self, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto | None:
        """The graph ``(W...) -> (penalty, <W>_penalty_grad...)`` for ``weights`` (name ->
        value), or ``None`` when nothing is penalized."""
        penalty = self.penalty(weights)
        return penalty_graph(weights, penalty) if penalty else None

    @classmethod
    def select(cls, value: Any, **options: Any) -> BaseLearningPenalty:
        """An instance for ``value``: an instance (returned as is), ``None`` or ``""`` (no
        penalty, as onnxcustom took them), a class name or an alias (``"elastic"``,
        ``"l1l2"``), built with ``options``."""
        if isinstance(value, BaseLearningPenalty):
            return value
        if value is None or (isinstance(value, str) and value == ""):
            return NoLearningPenalty()
        kinds = (NoLearningPenalty, ElasticLearningPenalty)
        names = {name: kind for kind in kinds for name in (kind.__name__, *kind.aliases)}
        if isinstance(value, str) and value in names:
            return names[value](**options)
        raise UnsupportedOptionError(
            f"Unknown learning penalty {value!r}: give None, an instance or a name."
            + suggest(str(value), names, "penalties"))


@dataclass(frozen=True)
class NoLearningPenalty(BaseLearningPenalty):
    """No penalty: an empty penalty dict and no graph."""

    def penalty(self, weights: Iterable[str]) -> dict[str, dict[str, float]]:
        return {}


@dataclass(frozen=True)
class ElasticLearningPenalty(BaseLearningPenalty):
    """``l1 sum|W| + l2 sum W^2`` on every weight given."""

    l1: float = 0.5
    l2: float = 0.5

    aliases: ClassVar[tuple[str, ...]] = ("elastic", "l1l2")

    def __post_init__(self) -> None:
        non_negative("ElasticLearningPenalty: l1", self.l1)
        non_negative("ElasticLearningPenalty: l2", self.l2)

    def penalty(self, weights: Iterable[str]) -> dict[str, dict[str, float]]:
        return {name: {"l1": float(self.l1), "l2": float(self.l2)} for name in weights}
