"""The reference documents' (onnxcustom's) value objects on lossgraph: learning rates,
losses, penalties and exceptions (docs/reference/compat.md)."""

from .exceptions import ConvergenceError, ConvergenceWarning, EvaluationError, ProviderError
from .learning_loss import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    ElasticLearningLoss,
    NegLogLearningLoss,
    SquareLearningLoss,
)
from .learning_penalty import BaseLearningPenalty, ElasticLearningPenalty, NoLearningPenalty
from .learning_rate import BaseLearningRate, LearningRateSGD, LearningRateSGDNesterov

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
    "ProviderError",
    "SquareLearningLoss",
]
