"""lossgraph's reverse-mode autodiff: rules per op (:mod:`.rules`), one walker (:mod:`.walker`)."""

from . import rules  # noqa: F401  (registers the built-in rules)
from .context import GradContext, Node
from .registry import RuleInfo, grad_rule, scoped_rules, supported_ops
from .walker import differentiate

__all__ = ["GradContext", "Node", "RuleInfo", "differentiate", "grad_rule", "scoped_rules",
           "supported_ops"]
