"""The losses of onnxcustom's forward/backward optimizer, as ONNX graphs.

Each loss builds one graph ``(prediction, label[, weight]) -> (loss, prediction_grad)``
with lossgraph's passes (an Identity model, :class:`~lossgraph.passes.loss.AddLossOutput`,
then :class:`~lossgraph.passes.gradient.Gradient` with respect to the prediction). With
``d = p - y``, row weights ``w`` (1 without a weight input) and the default
``reduction="sum"``::

    SquareLearningLoss       loss = sum w 0.5 d^2                     grad = w d
    AbsoluteLearningLoss     loss = sum w |d|                         grad = w sign(d)
    ElasticLearningLoss      loss = sum w (l1 |d| + l2 d^2)           grad = w (l1 sign(d) + 2 l2 d)
    NegLogLearningLoss       loss = sum w (log(1 + e^s) - y s)        grad = w (sigmoid(s) - y)

(``s`` the raw score, ``y`` in {0, 1}; the last is lossgraph's ``logistic`` loss, the
log loss of ``sigmoid(s)`` written without clipping). ``reduction="mean"`` divides by
``sum w`` (the row count without weights), as scikit-learn's mean losses do.
The prediction is ``(N, 1)`` of ``dtype``; labels are ``(N, 1)`` of ``dtype``, int64 ``(N,)``
class indices for :class:`NegLogLearningLoss`; the weight is ``(N,)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
from onnx import helper

from ..errors import UnsupportedOptionError, suggest
from ..options import non_negative
from ..passes.loss import loss_graph

__all__ = ["BaseLearningLoss", "SquareLearningLoss", "AbsoluteLearningLoss",
           "ElasticLearningLoss", "NegLogLearningLoss"]

PREDICTION = "prediction"


@dataclass(frozen=True)
class BaseLearningLoss:
    """A loss function and the ONNX graph computing it and its gradient."""

    #: lossgraph's loss function (:data:`lossgraph.passes.loss.SCORES`).
    loss: ClassVar[str]
    #: The names :meth:`select` accepts for this class, besides the class name.
    aliases: ClassVar[tuple[str, ...]] = ()

    def loss_options(self) -> Mapping[str, Any]:
        """The options of lossgraph's loss function (:attr:`loss`)."""
        return {}

    def build_onnx_function(self, opset: int = 18, device: str = "cpu",
                            weight_name: str | None = None, dtype: Any = np.float32,
                            reduction: str = "sum") -> onnx.ModelProto:
        """The graph ``(prediction, label[, weight_name]) -> (loss, prediction_grad)``.

        The graph does not depend on ``device`` (``"cpu"``, ``"cuda"``, ...); the session
        running it picks the device.
        """
        if not isinstance(device, str):
            raise UnsupportedOptionError(f"device={device!r} must be a string such as 'cpu'.")
        elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        value = helper.make_tensor_value_info(PREDICTION, elem_type, ["N", 1])
        return loss_graph(value, self.loss, self.loss_options(), weight_name=weight_name,
                          reduction=reduction, opset=opset).model

    @classmethod
    def select(cls, value: Any, **options: Any) -> BaseLearningLoss:
        """An instance for ``value``: an instance (returned as is), a class name or an alias
        (``"square_error"``, ``"square"``, ``"absolute_error"``, ``"absolute"``,
        ``"elastic_error"``, ``"elastic"``, ``"log"``, ``"neglog"``, ``"logloss"``: onnxcustom's),
        built with ``options``."""
        if isinstance(value, BaseLearningLoss):
            return value
        kinds = (SquareLearningLoss, AbsoluteLearningLoss, ElasticLearningLoss,
                 NegLogLearningLoss)
        names = {name: kind for kind in kinds for name in (kind.__name__, *kind.aliases)}
        if isinstance(value, str) and value in names:
            return names[value](**options)
        raise UnsupportedOptionError(
            f"Unknown learning loss {value!r}." + suggest(str(value), names, "losses"))


@dataclass(frozen=True)
class SquareLearningLoss(BaseLearningLoss):
    """``0.5 (p - y)^2`` per row, scikit-learn's MLP convention: lossgraph's
    ``half_squared_error``, whose gradient is ``p - y``."""

    loss: ClassVar[str] = "half_squared_error"
    aliases: ClassVar[tuple[str, ...]] = ("square_error", "square")


@dataclass(frozen=True)
class AbsoluteLearningLoss(BaseLearningLoss):
    """``|p - y|`` per row: lossgraph's ``absolute_error``."""

    loss: ClassVar[str] = "absolute_error"
    aliases: ClassVar[tuple[str, ...]] = ("absolute_error", "absolute")


@dataclass(frozen=True)
class ElasticLearningLoss(BaseLearningLoss):
    """``l1_weight |p - y| + l2_weight (p - y)^2`` per row: lossgraph's ``elastic``."""

    l1_weight: float = 0.5
    l2_weight: float = 0.5

    loss: ClassVar[str] = "elastic"
    aliases: ClassVar[tuple[str, ...]] = ("elastic_error", "elastic")

    def __post_init__(self) -> None:
        non_negative("ElasticLearningLoss: l1_weight", self.l1_weight)
        non_negative("ElasticLearningLoss: l2_weight", self.l2_weight)

    def loss_options(self) -> Mapping[str, Any]:
        return {"l1_weight": self.l1_weight, "l2_weight": self.l2_weight}


@dataclass(frozen=True)
class NegLogLearningLoss(BaseLearningLoss):
    """The log loss of ``sigmoid(s)`` on a raw score ``s``: lossgraph's ``logistic``.

    ``eps`` is checked and kept for the reference's signature; the loss is computed in
    the unclipped form, so its gradient is ``sigmoid(s) - y`` everywhere.
    """

    eps: float = 1e-5
    probability_function: str = "sigmoid"

    loss: ClassVar[str] = "logistic"
    aliases: ClassVar[tuple[str, ...]] = ("log", "neglog", "logloss")

    def __post_init__(self) -> None:
        if not 0 <= non_negative("NegLogLearningLoss: eps", self.eps) < 0.5:
            raise UnsupportedOptionError(f"NegLogLearningLoss: eps={self.eps!r} must be below 0.5.")
        if self.probability_function != "sigmoid":
            raise UnsupportedOptionError(
                f"NegLogLearningLoss: probability_function={self.probability_function!r} is not "
                "supported; 'sigmoid' is the only one.")
