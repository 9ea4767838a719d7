"""The rule registry: scoped registrations leave nothing behind, and each rule's
``nondiff`` declaration is what the analyses read."""

from __future__ import annotations

import onnx
import pytest
from support.models import model

import lossgraph
from lossgraph.autodiff import grad_rule, scoped_rules, supported_ops
from lossgraph.autodiff.registry import (
    differentiable_inputs,
    find_rule,
    no_gradient_ops,
    nondiff_inputs,
    not_differentiable_ops,
    not_differentiable_reason,
)
from lossgraph.errors import NoGradientError


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


# ------------------------------------------------------------- not differentiable
NOT_DIFFERENTIABLE_MODELS = [
    ("Unique", "(double[6] x) => (double[N] y)", "y = Unique(x)", 18, {}),
    ("Bernoulli", "(double[6] x) => (double[6] y)", "y = Bernoulli(x)", 18, {}),
    ("MelWeightMatrix", "(float lo) => (float[5, 4] y) <int64 m = {4}, int64 n = {8}, "
     "int64 r = {8000}, float hi = {3000}>", "y = MelWeightMatrix(m, n, r, lo, hi)", 18, {}),
    ("TreeEnsemble", "(double[2, 3] x) => (double[2, 1] y)",
     "y = ai.onnx.ml.TreeEnsemble <aggregate_function = 1, leaf_targetids = [0, 0], "
     "leaf_weights = double[2] {1.0, 2.0}, nodes_falseleafs = [1], nodes_falsenodeids = [1], "
     "nodes_featureids = [0], nodes_modes = uint8[1] {0}, nodes_splits = double[1] {0.5}, "
     "nodes_trueleafs = [1], nodes_truenodeids = [0], n_targets = 1, "
     "post_transform = 0, tree_roots = [0]> (x)", 18, {"ai.onnx.ml": 5}),
    ("Momentum", "(float r, int64 t, double[3] w, double[3] g, double[3] v) => "
     "(double[3] w2, double[3] v2)",
     'w2, v2 = ai.onnx.preview.training.Momentum <alpha = 0.9, beta = 1.0, mode = "standard",'
     " norm_coefficient = 0.0> (r, t, w, g, v)", 18, {"ai.onnx.preview.training": 1}),
]


@pytest.mark.parametrize("op, sig, body, opset, domains", NOT_DIFFERENTIABLE_MODELS)
def test_ops_without_a_derivative_worth_having_are_named_not_differentiable(op, sig, body,
                                                                            opset, domains):
    net = model(sig, body, opset=opset, domains=domains)
    x = net.graph.input[0].name if op != "Momentum" else "w"
    with pytest.raises(NoGradientError, match=op):
        lossgraph.gradient(net, weights=[x], outputs=[net.graph.output[0].name])
    domain = next(iter(domains), "")
    assert not_differentiable_reason(op, domain)


def test_every_op_declared_not_differentiable_exists_and_has_no_rule():
    for (domain, op), reason in not_differentiable_ops().items():
        assert onnx.defs.has(op, domain), (domain, op)
        assert lossgraph.autodiff.registry.find_rule(op, domain, 100) is None, (domain, op)
        assert reason and len(reason) < 200
