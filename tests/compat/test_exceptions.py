"""lossgraph.compat's exceptions (lossgraph/compat/exceptions.py) belong to lossgraph's
hierarchy and keep onnxcustom's bases, so that old except clauses still catch them."""

from __future__ import annotations

import lossgraph
from lossgraph.compat import ConvergenceError, ConvergenceWarning, EvaluationError, ProviderError
from lossgraph.errors import LossgraphError


def test_exceptions_belong_to_lossgraph_hierarchy():
    for error in (ConvergenceError, EvaluationError, ProviderError):
        assert issubclass(error, LossgraphError)
        assert issubclass(error, RuntimeError)  # onnxcustom's base: old except clauses hold
    assert issubclass(ConvergenceError, ArithmeticError) and issubclass(ProviderError, ValueError)
    assert issubclass(ConvergenceWarning, Warning)
    assert ConvergenceError is lossgraph.errors.ConvergenceError
