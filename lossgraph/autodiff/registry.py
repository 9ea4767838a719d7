"""The gradient rule registry: one rule per op type (and opset range).

A rule maps the gradients of a node's outputs to the gradients of its inputs:

    @grad_rule("Mul", broadcast=True)
    def mul(g, node, dy):
        a, b = node.inputs
        return g.Mul(dy, b), g.Mul(dy, a)

    @grad_rule("Gather", nondiff=(1,))
    def gather(g, node, dy):
        ...
        return node.grads(dx)        # (dx, None): the indices carry no gradient

``g`` is a :class:`~lossgraph.autodiff.context.GradContext` (a graph builder that
also knows forward shapes, types and constant values), ``node`` a
:class:`~lossgraph.autodiff.context.Node`, and ``dy`` the gradient of each output
(``None`` for an output no gradient flows into; single-output ops always get one).

``nondiff`` declares the input positions that never carry a gradient (shapes, axes,
indices, conditions, counts, and float inputs such as Resize's scales); a mapping
``{position: reason}`` also says why, for the error that names such an input (a float
input the op treats as a constant: ``RoiAlign``'s regions). The declaration is the one
source of that fact: the walker and the analyses (:mod:`lossgraph.differentiability`,
``trainable_initializers``) read it from here, so a rule that overrides a built-in one
states it again.

**The rule contract**, checked by the walker for every call:

- A rule returns exactly **one entry per input of the node** (``len(node.inputs)``,
  absent optional inputs in the middle included): the name of the input's gradient,
  or ``None`` for an input without one: a ``nondiff`` input, an absent input, or one
  whose gradient is not wanted. :meth:`Node.grads` pads the trailing ``None`` entries.
- A bare name (or ``None``) instead of a sequence is accepted for a **single-input
  node** only.
- A gradient for a ``nondiff`` input is an error: the declaration and the rule disagree.
- ``None`` for an input whose gradient the walker wants (``node.wanted``: a
  differentiable input on the path to the loss) is an error, unless the same value
  gets its gradient through another position of the node (``Mul(a, a)`` may return
  ``(2 dy a, None)``). A gradient that is mathematically zero is returned as zeros.
- Ops with subgraphs (``If``) return a dict ``{value name: gradient}`` that answers
  every wanted name (inputs and captured outer values).

A rule that breaks the contract raises :class:`~lossgraph.errors.InvalidRuleError`
naming the op, the node, the rule and the counts: never a silent zero gradient.
``broadcast=True`` asks the walker to sum each input gradient back to the input's
shape, so elementwise rules never deal with broadcasting.

:func:`zero_gradient` declares ops whose derivative is zero wherever it exists (``Sign``,
``Round``, ``Hardmax``: piecewise constant, JAX's ``defjvp_zero``): their rule returns
zeros, so a path through them stays differentiable, and the analyses know that nothing
trains through them (a weight whose every path to the loss passes one never changes).

Users register rules for their own ops the same way, with ``domain=``; rules
registered inside ``with scoped_rules():`` are dropped when it ends (tests, trials).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GradRule", "grad_rule", "find_rule", "nondiff_inputs", "scoped_rules",
           "supported_ops", "RuleInfo", "zero_gradient"]

GradRule = Callable[..., Any]


@dataclass(frozen=True)
class RuleInfo:
    """A registered rule and what it covers."""

    op_type: str
    domain: str
    since: int
    until: int | None
    broadcast: bool
    notes: str
    rule: GradRule
    #: input positions that never carry a gradient
    nondiff: frozenset[int] = frozenset()
    #: (position, why) for the ``nondiff`` inputs whose declaration says why
    nondiff_reasons: tuple[tuple[int, str], ...] = ()
    #: the derivative is zero wherever it exists (:func:`zero_gradient`)
    zero: bool = False

    def nondiff_reason(self, position: int) -> str | None:
        """Why input ``position`` carries no gradient, where the rule says."""
        return dict(self.nondiff_reasons).get(position)

    def covers(self, version: int) -> bool:
        return self.since <= version and (self.until is None or version <= self.until)

    @property
    def opsets(self) -> str:
        return f"{self.since}+" if self.until is None else f"{self.since}-{self.until}"


_RULES: dict[tuple[str, str], list[RuleInfo]] = {}


def grad_rule(
    op_type: str,
    *,
    domain: str = "",
    since: int = 1,
    until: int | None = None,
    broadcast: bool = False,
    notes: str = "",
    nondiff: Iterable[int] | Mapping[int, str] = (),
    zero: bool = False,
) -> Callable[[GradRule], GradRule]:
    """Register the decorated function as the gradient rule of ``domain::op_type``.

    ``since``/``until`` bound the opset versions of ``domain`` the rule handles (for
    ops whose signature changed); ``notes`` appear in the docs table (for example
    "straight-through: zero gradient"); ``nondiff`` lists the input positions that
    never carry a gradient (the rule returns ``None`` there). Registering a rule for
    an op and opset range that already has one replaces it, so users can override
    built-in rules. ``nondiff`` as a mapping ``{position: reason}`` also says why;
    ``zero``: the rule's gradients are zero wherever the derivative exists.
    """
    reasons = tuple(sorted(nondiff.items())) if isinstance(nondiff, Mapping) else ()

    def register(rule: GradRule) -> GradRule:
        key = ("" if domain == "ai.onnx" else domain, op_type)
        info = RuleInfo(op_type, key[0], since, until, broadcast, notes, rule,
                        frozenset(nondiff), reasons, zero)
        kept = [r for r in _RULES.get(key, []) if (r.since, r.until) != (since, until)]
        _RULES[key] = sorted([*kept, info], key=lambda r: r.since)
        return rule

    return register


def find_rule(op_type: str, domain: str, version: int) -> RuleInfo | None:
    """The rule for ``domain::op_type`` at opset ``version``, or ``None``."""
    key = ("" if domain == "ai.onnx" else domain, op_type)
    for info in reversed(_RULES.get(key, [])):
        if info.covers(version):
            return info
    return None


def nondiff_inputs(op_type: str, domain: str, version: int | None = None
                   ) -> frozenset[int] | None:
    """The input positions that the rule for ``domain::op_type`` declares
    non-differentiable (at opset ``version``; where no rule covers it, the newest rule's,
    since an op's shape and index inputs keep their positions), or ``None`` when the
    op has no rule."""
    key = ("" if domain == "ai.onnx" else domain, op_type)
    infos = _RULES.get(key)
    if not infos:
        return None
    covering = find_rule(op_type, domain, version) if version is not None else None
    return (covering or infos[-1]).nondiff


def _zeros(g, node, dy):
    return g.zeros_like(node.inputs[0])


def zero_gradient(*op_types: str, domain: str = "", notes: str = "zero gradient almost "
                  "everywhere") -> None:
    """Register ``op_types`` (single-input ops of ``domain``, piecewise constant) as ops
    whose derivative is zero wherever it exists: the rule returns zeros, and the rule
    says ``zero`` for the analyses (a weight trained only through such ops never moves)."""
    for op_type in op_types:
        grad_rule(op_type, domain=domain, notes=notes, zero=True)(_zeros)


@contextlib.contextmanager
def scoped_rules() -> Iterator[None]:
    """Rules registered inside ``with scoped_rules():`` (new ones, and overrides of
    existing ones) are undone when it ends, so a test or a trial leaves the registry
    as it found it."""
    saved = {key: list(infos) for key, infos in _RULES.items()}
    try:
        yield
    finally:
        _RULES.clear()
        _RULES.update(saved)


def supported_ops(domain: str | None = "") -> list[RuleInfo]:
    """Every registered rule (of ``domain``; all domains with ``None``), sorted by op."""
    return sorted(
        (r for (d, _), infos in _RULES.items() for r in infos if domain is None or d == domain),
        key=lambda r: (r.domain, r.op_type, r.since),
    )
