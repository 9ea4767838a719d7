"""lossgraph: compile ONNX inference models into ONNX training graphs.

The public surface (docs/concepts.md gives its vocabulary):

- passes, each a model in and a model out: :func:`add_loss_output`, :func:`gradient`,
  :func:`lower_ml_ops`, :func:`alphabetize_initializers`, :func:`stabilize_numerics`,
  :func:`strip_training`, :func:`straight_through_quantization` (their pass classes, and
  the pipeline machinery, in :mod:`lossgraph.passes`)
- gradients: :func:`grad_rule` (register a rule), :func:`supported_ops`
- training: :func:`compile_program` -> :class:`TrainingProgram`, :class:`Trainer` (on the
  engine :class:`Engine`), optimizers in :mod:`lossgraph.optim`, fusion modes in
  :mod:`lossgraph.modes`; :func:`describe_plan` shows what compiling runs
- analyses: :func:`trainable_initializers`, :func:`get_roles`
- errors: :class:`LossgraphError` and its subclasses in :mod:`lossgraph.errors`
- onnxcustom's classes (:mod:`lossgraph.compat`): :class:`OrtGradientOptimizer`,
  :class:`OrtGradientForwardBackwardOptimizer`, :class:`OrtGradientForwardBackward`, the
  learning rates, losses and penalties
- deployment: :mod:`lossgraph.export`; data-parallel training: :mod:`lossgraph.parallel`
  (and :mod:`lossgraph.ray`); a graph as a torch layer: :mod:`lossgraph.torch`
"""

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
from .deprecation import moved_names as _moved_names
from .errors import LossgraphError
from .passes import (
    add_loss_output,
    alphabetize_initializers,
    gradient,
    lower_ml_ops,
    stabilize_numerics,
    straight_through_quantization,
    strip_training,
)
from .program import TrainingProgram
from .roles import get_roles
from .runtime.engine import Engine
from .runtime.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "Engine",
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
    "lower_ml_ops",
    "optim",
    "stabilize_numerics",
    "straight_through_quantization",
    "strip_training",
    "supported_ops",
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

#: ``lossgraph.compile``, the previous release's name of :func:`compile_program`.
__getattr__ = _moved_names("lossgraph", {"compile": "lossgraph:compile_program"})
