"""The rule registry: scoped registrations leave nothing behind, and each rule's
``nondiff`` declaration is what the analyses read."""

from __future__ import annotations

import pytest

from lossgraph.autodiff import grad_rule, scoped_rules, supported_ops
from lossgraph.autodiff.registry import (
    differentiable_inputs,
    find_rule,
    no_gradient_ops,
    nondiff_inputs,
)


def _identity(g, node, dy):
    return dy


def test_a_rule_registered_in_a_scope_is_gone_after_it():
    before = [(r.domain, r.op_type, r.since, r.rule) for r in supported_ops(None)]
    with scoped_rules():
        grad_rule("Twice", domain="scope.test", nondiff=(1,))(_identity)
        assert find_rule("Twice", "scope.test", 1).rule is _identity
        assert nondiff_inputs("Twice", "scope.test") == {1}
    assert find_rule("Twice", "scope.test", 1) is None
    assert nondiff_inputs("Twice", "scope.test") is None
    assert [(r.domain, r.op_type, r.since, r.rule) for r in supported_ops(None)] == before


def test_an_override_of_a_built_in_rule_in_a_scope_is_undone_after_it():
    built_in = find_rule("Relu", "", 18)
    with scoped_rules():
        grad_rule("Relu")(_identity)
        assert find_rule("Relu", "", 18).rule is _identity
    assert find_rule("Relu", "", 18) is built_in


def test_a_scope_is_undone_when_its_body_raises():
    with pytest.raises(RuntimeError), scoped_rules():
        grad_rule("Broken", domain="scope.test")(_identity)
        raise RuntimeError("the test failed")
    assert find_rule("Broken", "scope.test", 1) is None


def test_rules_declare_the_inputs_without_gradient_and_no_gradient_only_ops_without_rules():
    assert differentiable_inputs("Gather", "", 2) == [0]
    assert differentiable_inputs("Where", "", 3) == [1, 2]
    assert differentiable_inputs("Resize", "", 4, opset=18) == [0]
    ruled = {(r.domain, r.op_type) for r in supported_ops(None)}
    assert not ruled & set(no_gradient_ops())
    assert differentiable_inputs("Shape", "", 1) == []  # no rule: its declaration answers
    assert differentiable_inputs("Upsample", "", 2) == [0]


def test_declarations_made_in_a_scope_are_undone_with_it():
    from lossgraph.autodiff.registry import no_gradient, not_differentiable_reason
    from lossgraph.autodiff.registry import not_differentiable as declare

    with scoped_rules():
        no_gradient("Scoped", domain="scope.test")
        declare("Opaque", "a test", domain="scope.test")
        assert differentiable_inputs("Scoped", "scope.test", 2) == []
        assert not_differentiable_reason("Opaque", "scope.test") == "a test"
    assert differentiable_inputs("Scoped", "scope.test", 2) == [0, 1]
    assert not_differentiable_reason("Opaque", "scope.test") is None


def test_ops_of_other_domains_without_a_rule_differentiate_every_input():
    assert differentiable_inputs("Gather", "my.ops", 2) == [0, 1]
