"""lossgraph's reverse-mode autodiff: rules per op (:mod:`.rules`) and what carries no
gradient, declared in one registry (:mod:`.registry`); one walker (:mod:`.walker`).

The package imports the rules and the registry; the walker (``differentiate``), which
the analyses it builds on need the registry for, is imported from
:mod:`lossgraph.autodiff.walker` where it is used.
"""

from . import rules  # noqa: F401  (registers the built-in rules)
from .context import GradContext, Node
from .registry import (
    RuleInfo,
    grad_rule,
    no_gradient,
    not_differentiable,
    scoped_rules,
    supported_ops,
    zero_gradient,
)

__all__ = ["GradContext", "Node", "RuleInfo", "grad_rule", "no_gradient", "not_differentiable",
           "scoped_rules", "supported_ops", "zero_gradient"]
