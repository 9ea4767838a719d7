"""The passes of the lossgraph compiler, one module each.

Every pass keeps the contract of :mod:`lossgraph.passes.contract`: pure, valid,
deterministic, honest errors.
"""

from .contract import model_pass
from .gradient import gradient
from .loss import add_loss_output
from .lower_ml import lower_ml_ops
from .rename import alphabetize_initializers

__all__ = ["model_pass", "add_loss_output", "alphabetize_initializers", "gradient",
           "lower_ml_ops"]
