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
source of that fact: the walker and the analyses (:func:`differentiable_inputs`,
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

**What carries no gradient** is declared here too, next to the rules, once for the
walker and the analyses (``trainable_initializers``, blocked and stuck weights,
``lossgraph inspect``), in the style of JAX's ``defjvp_zero``:

- ``grad_rule(..., nondiff=...)``: a rule's inputs that never carry a gradient;
- ``grad_rule(..., constant=...)``: a rule's inputs that carry a gradient but are
  constants of the op, never weights to train (BatchNormalization's running statistics,
  class weights, one-hot values, fake quantization scales);
- :func:`zero_gradient`: ops whose derivative is zero wherever it exists (``Sign``,
  ``Round``, ``Hardmax``: piecewise constant): their rule returns zeros, so a path
  through them stays differentiable, and nothing trains through them;
- :func:`no_gradient`: ops without a rule whose outputs carry no gradient to (some of)
  their inputs (``Shape``, ``ArgMax``, ``Range``'s inputs);
- :func:`not_differentiable`: ops without a rule whose outputs have no derivative worth
  having, with the reason an error gives (``Unique``, ``QuantizeLinear``).

:func:`differentiable_inputs`, :func:`not_differentiable_reason` and
:func:`zero_gradient_op` answer from these declarations.

Users register rules for their own ops the same way, with ``domain=``; rules
registered inside ``with scoped_rules():`` are dropped when it ends (tests, trials).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..graphs import canonical_domain

__all__ = ["GradRule", "grad_rule", "find_rule", "nondiff_inputs", "scoped_rules",
           "supported_ops", "RuleInfo", "zero_gradient", "no_gradient", "not_differentiable",
           "differentiable_inputs", "not_differentiable_reason", "zero_gradient_op",
           "not_differentiable_ops", "no_gradient_ops"]

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
    #: input positions that carry a gradient but are constants of the op, never trained
    constant: frozenset[int] = frozenset()

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
    constant: Iterable[int] = (),
) -> Callable[[GradRule], GradRule]:
    """Register the decorated function as the gradient rule of ``domain::op_type``.

    ``since``/``until`` bound the opset versions of ``domain`` the rule handles (for
    ops whose signature changed); ``notes`` appear in the docs table (for example
    "straight-through: zero gradient"); ``nondiff`` lists the input positions that
    never carry a gradient (the rule returns ``None`` there). Registering a rule for
    an op and opset range that already has one replaces it, so users can override
    built-in rules. ``nondiff`` as a mapping ``{position: reason}`` also says why;
    ``zero``: the rule's gradients are zero wherever the derivative exists;
    ``constant``: inputs that get gradients but are never weights to train.
    """
    reasons = tuple(sorted(nondiff.items())) if isinstance(nondiff, Mapping) else ()

    def register(rule: GradRule) -> GradRule:
        key = (canonical_domain(domain), op_type)
        info = RuleInfo(op_type, key[0], since, until, broadcast, notes, rule,
                        frozenset(nondiff), reasons, zero, frozenset(constant))
        kept = [r for r in _RULES.get(key, []) if (r.since, r.until) != (since, until)]
        _RULES[key] = sorted([*kept, info], key=lambda r: r.since)
        return rule

    return register


def find_rule(op_type: str, domain: str, version: int) -> RuleInfo | None:
    """The rule for ``domain::op_type`` at opset ``version``, or ``None``."""
    key = (canonical_domain(domain), op_type)
    for info in reversed(_RULES.get(key, [])):
        if info.covers(version):
            return info
    return None


def _declared(op_type: str, domain: str, version: int | None) -> RuleInfo | None:
    """The rule whose declarations hold for ``domain::op_type`` at opset ``version``: the
    one covering it, else the newest (an op's shape and index inputs keep their
    positions); None when the op has no rule."""
    infos = _RULES.get((canonical_domain(domain), op_type))
    if not infos:
        return None
    covering = find_rule(op_type, domain, version) if version is not None else None
    return covering or infos[-1]


def nondiff_inputs(op_type: str, domain: str, version: int | None = None
                   ) -> frozenset[int] | None:
    """The input positions that the rule for ``domain::op_type`` declares
    non-differentiable (at opset ``version``, see :func:`_declared`), or ``None`` when the
    op has no rule."""
    info = _declared(op_type, domain, version)
    return None if info is None else info.nondiff


# -- what carries no gradient, for ops without a rule ----------------------------------

#: Every input position (an op's outputs carry no gradient to any of its inputs).
ALL_INPUTS = frozenset(range(64))
#: (domain, op type) -> input positions that carry no gradient, for ops without a rule.
_NO_GRADIENT: dict[tuple[str, str], frozenset[int]] = {}
#: (domain, op type) -> why none of the op's inputs carries a gradient.
_NOT_DIFFERENTIABLE: dict[tuple[str, str], str] = {}


def no_gradient(*op_types: str, inputs: Iterable[int] = ALL_INPUTS, domain: str = "") -> None:
    """Declare that ``op_types`` (of ``domain``, without a gradient rule) pass no gradient
    to their ``inputs`` (default: any): shapes, counts, indices, random draws."""
    for op_type in op_types:
        _NO_GRADIENT[(canonical_domain(domain), op_type)] = frozenset(inputs)


def not_differentiable(op_type: str, why: str, domain: str = "") -> None:
    """Declare ``domain::op_type`` (without a gradient rule) not differentiable: its outputs
    have no derivative worth having, for the reason ``why`` (an error quotes it)."""
    _NOT_DIFFERENTIABLE[(canonical_domain(domain), op_type)] = why


def not_differentiable_ops() -> dict[tuple[str, str], str]:
    """Every op declared :func:`not_differentiable`, ``(domain, op type) -> why``."""
    return dict(_NOT_DIFFERENTIABLE)


def no_gradient_ops() -> dict[tuple[str, str], frozenset[int]]:
    """Every op declared with :func:`no_gradient`, ``(domain, op type) -> input positions``."""
    return dict(_NO_GRADIENT)


def differentiable_inputs(op_type: str, domain: str, arity: int, trainable: bool = False,
                          opset: int | None = None) -> list[int]:
    """Positions of the inputs of an ``op_type`` node (of ``domain``, at ``opset``) that
    may carry a gradient (``trainable``: and may be trained, which excludes the rule's
    ``constant`` inputs). Ops of other domains without any declaration: every input."""
    info = _declared(op_type, domain, opset)
    key = (canonical_domain(domain), op_type)
    if info is not None:
        skipped = info.nondiff | (info.constant if trainable else frozenset())
    elif key in _NOT_DIFFERENTIABLE:
        skipped = ALL_INPUTS
    else:
        skipped = _NO_GRADIENT.get(key, frozenset())
    return [i for i in range(arity) if i not in skipped]


def not_differentiable_reason(op_type: str, domain: str = "", position: int | None = None,
                              opset: int | None = None) -> str | None:
    """Why input ``position`` of ``domain::op_type`` (at ``opset``) carries no gradient,
    where its rule's ``nondiff`` declaration says; else why no input of the op does
    (:func:`not_differentiable`); else ``None``."""
    if position is not None and opset is not None:
        info = find_rule(op_type, domain, opset)
        reason = info.nondiff_reason(position) if info is not None else None
        if reason is not None:
            return reason
    return _NOT_DIFFERENTIABLE.get((canonical_domain(domain), op_type))


def zero_gradient_op(op_type: str, domain: str = "", opset: int | None = None) -> bool:
    """True when ``domain::op_type`` (at ``opset``) has a derivative that is zero wherever
    it exists (:func:`zero_gradient`)."""
    info = find_rule(op_type, domain, opset) if opset is not None else None
    return info is not None and info.zero


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
    """Rules and declarations made inside ``with scoped_rules():`` (new ones, and overrides
    of existing ones) are undone when it ends, so a test or a trial leaves the registry
    as it found it."""
    saved = {key: list(infos) for key, infos in _RULES.items()}
    declared = dict(_NO_GRADIENT), dict(_NOT_DIFFERENTIABLE)
    try:
        yield
    finally:
        _RULES.clear()
        _RULES.update(saved)
        for table, kept in zip((_NO_GRADIENT, _NOT_DIFFERENTIABLE), declared):
            table.clear()
            table.update(kept)


def supported_ops(domain: str | None = "") -> list[RuleInfo]:
    """Every registered rule (of ``domain``; all domains with ``None``), sorted by op."""
    return sorted(
        (r for (d, _), infos in _RULES.items() for r in infos if domain is None or d == domain),
        key=lambda r: (r.domain, r.op_type, r.since),
    )
