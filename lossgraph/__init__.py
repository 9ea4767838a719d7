"""lossgraph: compile ONNX inference models into ONNX training graphs.

The public surface (docs/concepts.md gives its vocabulary):

- passes: :func:`add_loss_output`, :func:`alphabetize_initializers`, :func:`lower_ml_ops`
  (their pass classes, and the pipeline machinery, in :mod:`lossgraph.passes`)
- gradients: :func:`gradient`, :func:`grad_rule` (register a rule), :func:`supported_ops`
- training: :func:`compile_program` -> :class:`TrainingProgram`, :class:`Trainer`,
  optimizers in :mod:`lossgraph.optim`; :func:`describe_plan` shows what compiling runs
- analyses: :func:`trainable_initializers`
- errors: :class:`LossgraphError` and its subclasses in :mod:`lossgraph.errors`
- the reference documents' classes (:mod:`lossgraph.compat`): :class:`OrtGradientOptimizer`,
  :class:`OrtGradientForwardBackwardOptimizer`, :class:`OrtGradientForwardBackward`, the
  learning rates, losses and penalties
"""

from typing import Any

from . import optim
from .analysis import trainable_initializers
from .autodiff import grad_rule, supported_ops
from .compat import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    BaseLearningPenalty,
    BaseLearningRate,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    NoLearningPenalty,
    OrtGradientForwardBackward,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    SquareLearningLoss,
)
from .compiler import compile_program, describe_plan
from .deprecation import warn_renamed
from .errors import LossgraphError
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.rename import alphabetize_initializers
from .program import TrainingProgram
from .roles import get_roles
from .runtime.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "LossgraphError",
    "Trainer",
    "TrainingProgram",
    "add_loss_output",
    "alphabetize_initializers",
    "compile_program",
    "describe_plan",
    "get_roles",
    "grad_rule",
    "gradient",
    "supported_ops",
    "lower_ml_ops",
    "optim",
    "trainable_initializers",
    "__version__",
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "BaseLearningPenalty",
    "BaseLearningRate",
    "ElasticLearningLoss",
    "ElasticLearningPenalty",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "NegLogLearningLoss",
    "NoLearningPenalty",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardOptimizer",
    "OrtGradientOptimizer",
    "SquareLearningLoss",
]


def __getattr__(name: str) -> Any:
    """``lossgraph.compile``, the previous release's name of :func:`compile_program`."""
    if name == "compile":
        warn_renamed("lossgraph.compile", "lossgraph.compile_program")
        return compile_program
    raise AttributeError(f"module 'lossgraph' has no attribute {name!r}")
