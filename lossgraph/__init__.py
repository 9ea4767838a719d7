"""lossgraph: compile ONNX inference models into ONNX training graphs.

The public surface:

- passes: :func:`add_loss_output`, :func:`alphabetize_initializers`, :func:`lower_ml_ops`
- gradients: :func:`gradient`, :func:`grad_rule` (register a rule), :func:`supported_ops`
- training: :func:`compile` -> :class:`TrainingProgram`, :class:`Trainer`,
  optimizers in :mod:`lossgraph.optim`
- analyses: :func:`trainable_initializers`
- errors: :class:`LossgraphError` and its subclasses in :mod:`lossgraph.errors`
"""

from . import optim
from .analysis import trainable_initializers
from .autodiff import grad_rule, supported_ops
from .errors import LossgraphError
from .passes.gradient import gradient
from .passes.loss import add_loss_output
from .passes.lower_ml import lower_ml_ops
from .passes.rename import alphabetize_initializers
from .program import TrainingProgram, compile
from .roles import get_roles
from .runtime import Trainer

__version__ = "0.1.0"

__all__ = [
    "LossgraphError",
    "Trainer",
    "TrainingProgram",
    "add_loss_output",
    "alphabetize_initializers",
    "compile",
    "get_roles",
    "grad_rule",
    "gradient",
    "supported_ops",
    "lower_ml_ops",
    "optim",
    "trainable_initializers",
    "__version__",
]
