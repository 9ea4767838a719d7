"""onnxcustom's exceptions, from lossgraph's hierarchy (:mod:`lossgraph.errors`)."""

from ..errors import (
    ConvergenceError,
    ConvergenceWarning,
    EvaluationError,
    NotFittedError,
    ProviderError,
)

__all__ = ["ConvergenceError", "ConvergenceWarning", "EvaluationError", "NotFittedError",
           "ProviderError"]
