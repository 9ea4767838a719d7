"""The reference documents' exceptions, from lossgraph's hierarchy (:mod:`lossgraph.errors`)."""

from ..errors import ConvergenceError, ConvergenceWarning, EvaluationError, ProviderError

__all__ = ["ConvergenceError", "ConvergenceWarning", "EvaluationError", "ProviderError"]
