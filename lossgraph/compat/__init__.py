"""onnxcustom's classes on lossgraph: the two optimizers, the
forward/backward object, learning rates, losses, penalties and exceptions
(docs/reference/compat.md)."""

from .exceptions import (
    ConvergenceError,
    ConvergenceWarning,
    EvaluationError,
    NotFittedError,
    ProviderError,
)
from .forward_backward import OrtGradientForwardBackward, OrtGradientForwardBackwardFunction
from .learning_loss import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    ElasticLearningLoss,
    NegLogLearningLoss,
    SquareLearningLoss,
)
from .learning_penalty import BaseLearningPenalty, ElasticLearningPenalty, NoLearningPenalty
from .learning_rate import BaseLearningRate, LearningRateSGD, LearningRateSGDNesterov
from .optimizers import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "BaseLearningPenalty",
    "BaseLearningRate",
    "ConvergenceError",
    "ConvergenceWarning",
    "ElasticLearningLoss",
    "ElasticLearningPenalty",
    "EvaluationError",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "NegLogLearningLoss",
    "NoLearningPenalty",
    "NotFittedError",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardFunction",
    "OrtGradientForwardBackwardOptimizer",
    "OrtGradientOptimizer",
    "ProviderError",
    "SquareLearningLoss",
]
