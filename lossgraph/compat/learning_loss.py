"""The losses of the reference documents' forward/backward optimizer, as ONNX graphs.

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

from ..builder import GraphBuilder
from ..errors import UnsupportedOptionError, suggest
from ..graphs import opset_version
from ..names import NameAuthority
from ..options import non_negative
from ..passes.contract import Pipeline
from ..passes.gradient import Gradient
from ..passes.loss import AddLossOutput
from ..roles import get_roles

__all__ = ["BaseLearningLoss", "SquareLearningLoss", "AbsoluteLearningLoss",
           "ElasticLearningLoss", "NegLogLearningLoss"]

PREDICTION = "prediction"


@dataclass(frozen=True)
class BaseLearningLoss:
    """A loss function and the ONNX graph computing it and its gradient."""

    #: lossgraph's loss function, its options and the factor applied to its value.
    loss: ClassVar[str]
    scale: ClassVar[float] = 1.0
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
        identity = helper.make_model(
            helper.make_graph([helper.make_node("Identity", [PREDICTION], ["score"])],
                              type(self).__name__, [value],
                              [helper.make_tensor_value_info("score", elem_type, ["N", 1])]),
            opset_imports=[helper.make_opsetid("", opset)])
        loss_model = AddLossOutput(self.loss, weight_name=weight_name, reduction=reduction,
                                   options=dict(self.loss_options()))(identity).model
        if self.scale != 1.0:
            _scale_loss(loss_model, self.scale)
        outputs = [o for o in loss_model.graph.output if o.name != "score"]
        del loss_model.graph.output[:]
        loss_model.graph.output.extend(outputs)
        return Pipeline((Gradient([PREDICTION]),))(loss_model).model

    @classmethod
    def select(cls, value: Any, **options: Any) -> BaseLearningLoss:
        """An instance for ``value``: an instance (returned as is), a class name or an alias
        (``"square_error"``, ``"square"``, ``"absolute"``, ``"elastic"``, ``"log"``,
        ``"neglog"``), built with ``options``."""
        if isinstance(value, BaseLearningLoss):
            return value
        kinds = (SquareLearningLoss, AbsoluteLearningLoss, ElasticLearningLoss,
                 NegLogLearningLoss)
        names = {name: kind for kind in kinds for name in (kind.__name__, *kind.aliases)}
        if isinstance(value, str) and value in names:
            return names[value](**options)
        raise UnsupportedOptionError(
            f"Unknown learning loss {value!r}." + suggest(str(value), names, "losses"))


def _scale_loss(model: onnx.ModelProto, factor: float) -> None:
    """Multiply the loss output by ``factor`` in place (the output keeps its name)."""
    loss = get_roles(model)["loss"]
    graph = model.graph
    b = GraphBuilder(NameAuthority.for_model(model), opset_version(model), prefix="loss/")
    unscaled = b.names.fresh(f"{loss}_unscaled")
    for node in graph.node:
        node.output[:] = [unscaled if o == loss else o for o in node.output]
    dtype = helper.tensor_dtype_to_np_dtype(graph.output[0].type.tensor_type.elem_type)
    b.rename(b.Mul(unscaled, b.const(factor, dtype, "loss_scale")), loss, uses=False)
    b.append_to(graph)


@dataclass(frozen=True)
class SquareLearningLoss(BaseLearningLoss):
    """``0.5 (p - y)^2`` per row, scikit-learn's MLP convention: lossgraph's
    ``squared_error`` scaled by 0.5, so the gradient is ``p - y``."""

    loss: ClassVar[str] = "squared_error"
    scale: ClassVar[float] = 0.5
    aliases: ClassVar[tuple[str, ...]] = ("square_error", "square")


@dataclass(frozen=True)
class AbsoluteLearningLoss(BaseLearningLoss):
    """``|p - y|`` per row: lossgraph's ``absolute_error``."""

    loss: ClassVar[str] = "absolute_error"
    aliases: ClassVar[tuple[str, ...]] = ("absolute",)


@dataclass(frozen=True)
class ElasticLearningLoss(BaseLearningLoss):
    """``l1_weight |p - y| + l2_weight (p - y)^2`` per row: lossgraph's ``elastic``."""

    l1_weight: float = 0.5
    l2_weight: float = 0.5

    loss: ClassVar[str] = "elastic"
    aliases: ClassVar[tuple[str, ...]] = ("elastic",)

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
    aliases: ClassVar[tuple[str, ...]] = ("log", "neglog")

    def __post_init__(self) -> None:
        if not 0 <= non_negative("NegLogLearningLoss: eps", self.eps) < 0.5:
            raise UnsupportedOptionError(f"NegLogLearningLoss: eps={self.eps!r} must be below 0.5.")
        if self.probability_function != "sigmoid":
            raise UnsupportedOptionError(
                f"NegLogLearningLoss: probability_function={self.probability_function!r} is not "
                "supported; 'sigmoid' is the only one.")
