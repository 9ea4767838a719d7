"""The gradient pass (lossgraph/passes/gradient.py): modes, backends, contract, errors, golden
models against references, and a training-mode Dropout written without its mask output."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import recipes
from onnx import helper

import lossgraph
from lossgraph import (
    add_loss_output,
    grad_rule,
    gradient,
    lower_ml_ops,
    supported_ops,
    trainable_initializers,
)
from lossgraph.autodiff import scoped_rules
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidRuleError,
    MissingGradientError,
    NoGradientError,
    RuntimeUnavailableError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
)
from lossgraph.passes.gradient import GRADIENTS_KEY
from lossgraph.passes.stabilize import stabilize_numerics
from lossgraph.runtime.session import create_session
from lossgraph.speed import SumRowsByProduct

LINEAR = """
    <ir_version: 8, opset_import: ["" : 18]>
    linear (float[N, 3] x, float[N, 2] label) => (float loss, float[N, 2] y)
    <float[3, 2] w = {1, 2, 3, 4, 5, 6}, float[2] b = {0.5, -0.5}, int64[1] axes = {1}>
    {
        h = MatMul(x, w)
        y = Add(h, b)
        d = Sub(y, label)
        s = Mul(d, d)
        loss = ReduceSum <keepdims = 0> (s)
    }
"""


@pytest.fixture
def linear():
    return onnx.parser.parse_model(LINEAR)


@pytest.fixture
def linear_feeds(rng):
    return {"x": rng.normal(size=(6, 3)).astype(np.float32),
            "label": rng.normal(size=(6, 2)).astype(np.float32)}


def _numpy_linear_grads(feeds):
    w = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    b = np.array([0.5, -0.5], np.float32)
    d = feeds["x"] @ w + b - feeds["label"]
    return {"w": 2 * feeds["x"].T @ d, "b": 2 * d.sum(axis=0)}


def test_scalar_loss_mode_adds_one_grad_output_per_weight_in_wrt_order(linear, run_model,
                                                                      linear_feeds):
    result = gradient(linear, weights=["b", "w"])
    assert [o.name for o in result.graph.output] == ["loss", "y", "b_grad", "w_grad"]
    assert [i.name for i in result.graph.input] == ["x", "label"]
    outputs = run_model(result, linear_feeds)
    expected = _numpy_linear_grads(linear_feeds)
    np.testing.assert_allclose(outputs["w_grad"], expected["w"], rtol=1e-5)
    np.testing.assert_allclose(outputs["b_grad"], expected["b"], rtol=1e-5)


def test_default_wrt_is_the_trainable_initializers(linear):
    result = gradient(linear)
    assert [o.name for o in result.graph.output][2:] == ["w_grad", "b_grad"]
    assert json.loads(dict((p.key, p.value) for p in result.metadata_props)[GRADIENTS_KEY]) == {
        "w": "w_grad", "b": "b_grad"}


def test_vector_jacobian_mode_takes_the_output_gradient_as_an_input(linear, run_model,
                                                                    linear_feeds, rng):
    result = gradient(linear, weights=["w", "b"], outputs=["y"])
    assert [i.name for i in result.graph.input] == ["x", "label", "y_grad"]
    y_grad = rng.normal(size=(6, 2)).astype(np.float32)
    outputs = run_model(result, {**linear_feeds, "y_grad": y_grad})
    np.testing.assert_allclose(outputs["w_grad"], linear_feeds["x"].T @ y_grad, rtol=1e-5)
    np.testing.assert_allclose(outputs["b_grad"], y_grad.sum(axis=0), rtol=1e-5)


def test_gradient_with_respect_to_a_graph_input(linear, run_model, linear_feeds):
    result = gradient(linear, weights=["x"])
    w = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    d = linear_feeds["x"] @ w + [0.5, -0.5] - linear_feeds["label"]
    np.testing.assert_allclose(run_model(result, linear_feeds)["x_grad"], 2 * d @ w.T, rtol=1e-5)


TWO_OUTPUTS = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 2] x) => (float loss, float[N, 2] z)
    <float[2] a = {1, 2}, float[2] c = {3, 4}>
    { y = Mul(x, a)
      z = Mul(x, c)
      loss = ReduceSum <keepdims = 0> (y) }
"""


def test_a_weight_that_does_not_influence_the_loss_is_an_error_not_zeros(run_model, rng):
    model = onnx.parser.parse_model(TWO_OUTPUTS)
    with pytest.raises(NoGradientError, match="No gradient reaches 'c': it does not influence "
                                              "'loss' at all"):
        gradient(model, weights=["a", "c"])
    x = rng.normal(size=(3, 2)).astype(np.float32)
    outputs = run_model(gradient(model, weights=["a"]), {"x": x})
    np.testing.assert_allclose(outputs["a_grad"], x.sum(axis=0), rtol=1e-6)


def test_training_a_weight_no_gradient_reaches_is_refused_when_compiling():
    import lossgraph

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 2] y)
        <float[2] a = {1, 2}, float[2] c = {3, 4}>
        { s = Shape(c)
          f = Cast <to = 1> (s)
          b = Mul(x, f)
          y = Mul(b, a) }
    """)
    with pytest.raises(NoGradientError, match="No gradient reaches 'c'.*\\[Shape\\] blocks"):
        lossgraph.compile_program(model, weights=["a", "c"])


def test_the_default_weights_are_those_that_reach_the_differentiated_output():
    model = onnx.parser.parse_model(TWO_OUTPUTS)
    assert gradient(model).graph.output[-1].name == "a_grad"
    vjp = gradient(model, outputs=["z"])
    assert [o.name for o in vjp.graph.output][2:] == ["c_grad"]


# case -> (forward lines from w to y, the op of the node that blocks w, what the error says)
BLOCKED = {
    "an integer Cast": ("s = ReduceSum <keepdims = 0> (w)\n i = Cast <to = 7> (s)\n"
                        " f = Cast <to = 1> (i)\n y = Mul(x, f)",
                        "Cast", "[Cast 'block'] blocks it: its output 'i' is int64"),
    "a comparison": ("s = ReduceSum <keepdims = 0> (w)\n b = Greater(s, x)\n y = Where(b, x, x)",
                     "Greater", "[Greater 'block'] blocks it: its output 'b' is bool"),
    "a shape": ("s = Shape(w)\n f = Cast <to = 1> (s)\n y = Mul(x, f)",
                "Shape", "[Shape 'block'] blocks it: its output 's' is int64"),
    "an index input": ('r = Resize <mode = "nearest"> (x, "", w)\n y = Identity(r)', "Resize",
                       "[Resize 'block'] blocks it: 'w' enters it as input 2, which carries no "
                       "gradient"),
}


@pytest.mark.parametrize("case", sorted(BLOCKED))
def test_a_weight_reaching_the_loss_only_through_non_differentiable_values_is_named(case):
    body, blocking, expected = BLOCKED[case]
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[1, 1, 2, 2] x) => (float loss)
        <float[4] w = {{1, 1, 1, 1}}>
        {{ {body}
           loss = ReduceSum <keepdims = 0> (y) }}
    """)
    next(n for n in model.graph.node if n.op_type == blocking).name = "block"
    with pytest.raises(NoGradientError) as info:
        gradient(model, weights=["w"])
    message = str(info.value)
    assert "No gradient reaches 'w': it influences 'loss' only through values that carry no " \
           "gradient" in message
    assert expected in message
    assert "w -> [" in message and "-> loss" in message


def test_a_value_used_twice_gets_one_sum_of_its_contributions(run_model, rng):
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float loss)
        <float[2] a = {1, 2}>
        { y = Mul(x, a)
          z = Mul(y, y)
          u = Add(z, y)
          loss = ReduceSum <keepdims = 0> (u) }
    """)
    result = gradient(model, weights=["a"])
    added = [n for n in result.graph.node if n.name.startswith("grad/")]
    assert sum(n.op_type == "Sum" for n in added) == 1
    x = rng.normal(size=(4, 2)).astype(np.float32)
    a = np.array([1, 2], np.float32)
    expected = ((2 * x * a + 1) * x).sum(axis=0)
    np.testing.assert_allclose(run_model(result, {"x": x})["a_grad"], expected, rtol=1e-5)


@pytest.mark.parametrize("outputs", [1, 2])
def test_a_bias_gradient_sums_its_batch_in_the_fastest_form(run_model, rng, outputs):
    """After SumRowsByProduct (which compile runs after every gradient), several columns:
    a row of ones times the rows; one column: one whole ReduceSum (each many times faster
    in onnxruntime than ReduceSum over the batch axis)."""
    w = rng.normal(size=(3, outputs)).astype(np.float32)
    b = rng.normal(size=outputs).astype(np.float32)
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        affine (float[N, 3] x, float[N, {outputs}] label) => (float loss)
        <float[3, {outputs}] w = {{{", ".join(map(str, w.ravel()))}}},
         float[{outputs}] b = {{{", ".join(map(str, b))}}}>
        {{
            h = MatMul(x, w)
            y = Add(h, b)
            d = Sub(y, label)
            s = Mul(d, d)
            loss = ReduceSum <keepdims = 0> (s)
        }}
    """)
    result = SumRowsByProduct()(gradient(model, weights=["b"])).model
    producers = {o: n for n in result.graph.node for o in n.output}
    summing = producers["b_grad"]
    while summing.op_type in ("Reshape", "Identity"):
        summing = producers[summing.input[0]]
    assert summing.op_type == ("ReduceSum" if outputs == 1 else "MatMul")
    feeds = {"x": rng.normal(size=(6, 3)).astype(np.float32),
             "label": rng.normal(size=(6, outputs)).astype(np.float32)}
    w, b = (onnx.numpy_helper.to_array(i) for i in model.graph.initializer)
    expected = 2 * (feeds["x"] @ w + b - feeds["label"]).sum(axis=0)
    np.testing.assert_allclose(run_model(result, feeds)["b_grad"], expected, rtol=1e-5)


def test_no_gradient_work_for_values_off_the_path(rng):
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float loss)
        <float[2] a = {1, 2}, float[2] c = {3, 4}>
        { p = Mul(x, c)
          q = Exp(p)
          y = Mul(q, a)
          loss = ReduceSum <keepdims = 0> (y) }
    """)
    added = [n for n in gradient(model, weights=["a"]).graph.node if n.name.startswith("grad/")]
    assert not any({"x", "p", "c"} & set(n.input) for n in added)  # nothing flows towards c
    assert "Exp" not in {n.op_type for n in added}


def test_gradient_graph_uses_standard_onnx_ops_only(linear):
    domains = {n.domain for n in gradient(linear).graph.node}
    assert domains <= {""}


def test_taken_grad_name_gets_a_fresh_one_recorded_in_metadata():
    model = onnx.parser.parse_model(LINEAR.replace("d = Sub", "w_grad = Identity(y)\n d = Sub"))
    result = gradient(model, weights=["w"])
    mapping = json.loads(dict((p.key, p.value) for p in result.metadata_props)[GRADIENTS_KEY])
    assert mapping == {"w": "w_grad_1"}
    assert result.graph.output[-1].name == "w_grad_1"


# -- errors ---------------------------------------------------------------------------


def test_missing_rule_names_the_op_node_and_path():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18, "custom.ops" : 1]>
        g (float[N, 2] x) => (float loss)
        <float[2] a = {1, 2}>
        { y = Mul(x, a)
          z = custom.ops.Frobnicate(y)
          loss = ReduceSum <keepdims = 0> (z) }
    """)
    model.graph.node[1].name = "frob"
    with pytest.raises(MissingGradientError) as info:
        gradient(model, weights=["a"], loss_name="loss")
    message = str(info.value)
    assert "'Frobnicate'" in message and "'frob'" in message
    assert "a -> [Mul] -> y -> [Frobnicate 'frob'] -> z -> [ReduceSum] -> loss" in message
    assert "grad_rule('Frobnicate', domain='custom.ops')" in message


@pytest.fixture(autouse=True)
def _rules_stay_in_the_test():
    """Every rule a test here registers is dropped when the test ends."""
    with scoped_rules():
        yield


def test_users_can_register_a_rule_for_their_own_op(run_model, rng):
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18, "my.domain" : 1]>
        g (float[N, 2] x) => (float loss)
        <float[2] a = {1, 2}>
        { y = Mul(x, a)
          z = my.domain.Cube(y)
          loss = ReduceSum <keepdims = 0> (z) }
    """)

    @grad_rule("Cube", domain="my.domain", notes="x^3")
    def cube(g, node, dy):
        (x,) = node.inputs
        return g.Mul(dy, g.Mul(g.const_like(3.0, x), g.Mul(x, x)))

    result = gradient(model, weights=["a"])
    cube_node = [n for n in result.graph.node if n.op_type == "Cube"]
    assert len(cube_node) == 1  # the forward op, not differentiated into more custom ops
    assert any(r.op_type == "Cube" and r.domain == "my.domain" for r in supported_ops(None))


# -- the rule contract ---------------------------------------------------------------

CONTRACT_MODEL = """
    <ir_version: 8, opset_import: ["" : 18, "contract.test" : 1]>
    g (float[N, 2] x) => (float loss)
    <float[2] w = {1, 2}>
    { y = contract.test.Scale(x, w)
      loss = ReduceSum <keepdims = 0> (y) }
"""

# what a broken rule returns -> what the error says
BROKEN_RULES = {
    "too few": (lambda g, node, dy: (dy,), "returned 1 entries for a node with 2 inputs"),
    "too many": (lambda g, node, dy: (dy, dy, dy), "returned 3 entries for a node with 2 inputs"),
    "a bare name for two inputs": (lambda g, node, dy: dy,
                                   "returned a single name for a node with 2 inputs"),
    "None for a wanted input": (lambda g, node, dy: (dy, None),
                                "returned None for input 1 ('w'), whose gradient is wanted"),
    "not a name": (lambda g, node, dy: (dy, 3), "returned a int for input 1"),
    "a dict without a wanted name": (lambda g, node, dy: {"x": dy},
                                     "returned no gradient for ['w']"),
    "a dict with a name not read": (lambda g, node, dy: {"w": dy, "q": dy},
                                    "returned gradients for ['q'], which the node does not read"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RULES))
def test_a_rule_breaking_the_contract_is_an_error_naming_op_node_rule_and_counts(case):
    rule, expected = BROKEN_RULES[case]
    grad_rule("Scale", domain="contract.test")(rule)
    model = onnx.parser.parse_model(CONTRACT_MODEL)
    model.graph.node[0].name = "scaler"
    with pytest.raises(InvalidRuleError) as info:
        gradient(model, weights=["w"])
    message = str(info.value)
    assert "for op 'Scale' (node 'scaler')" in message
    assert f"{rule.__module__}.{rule.__qualname__}" in message
    assert expected in message


def test_a_rule_may_answer_a_value_read_twice_at_one_position():
    """Scale(w, w) = w * w: (2 dy w, None) is one gradient for w, as Mul(a, a) returns."""
    def square(g, node, dy):
        w = node.inputs[0]
        return g.Mul(g.Mul(dy, w), g.const_like(2.0, w)), None

    grad_rule("Scale", domain="contract.test")(square)
    model = onnx.parser.parse_model(CONTRACT_MODEL.replace("Scale(x, w)", "Scale(w, w)")
                                    .replace("(float[N, 2] x)", "(float[2] x)"))
    result = gradient(model, weights=["w"])
    producer = next(n for n in result.graph.node if "w_grad" in n.output)
    assert producer.op_type == "Mul"  # the rule's 2 dy w, the only contribution


def test_a_rule_giving_a_gradient_for_an_input_it_declares_nondiff_is_an_error():
    grad_rule("Scale", domain="contract.test", nondiff=(0,))(lambda g, node, dy: (dy, dy))
    model = onnx.parser.parse_model(CONTRACT_MODEL)
    with pytest.raises(InvalidRuleError, match="returned a gradient for input 0 \\('x'\\), which "
                                               "its registration declares non-differentiable "
                                               "\\(nondiff=\\(0,\\)\\)"):
        gradient(model, weights=["w"])


def test_an_input_declared_nondiff_carries_no_gradient_for_the_walker_and_the_analyses():
    """The declaration is the one source: w enters Scale only as a nondiff input, so no
    gradient reaches it and it is not trainable; without it, it is both."""
    model = onnx.parser.parse_model(CONTRACT_MODEL)
    grad_rule("Scale", domain="contract.test")(lambda g, node, dy: (dy, dy))
    assert trainable_initializers(model) == ["w"]
    grad_rule("Scale", domain="contract.test", nondiff=(1,))(lambda g, node, dy: (dy, None))
    assert trainable_initializers(model) == []
    with pytest.raises(NoGradientError, match="'w' enters it as input 1, which carries no "
                                              "gradient"):
        gradient(model, weights=["w"])


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"weights": ["ww"]}, UnknownNameError, "Did you mean 'w'"),
    ({"weights": ["axes"]}, DTypeMismatchError, "int64"),
    ({"weights": ["w", "w"]}, UnsupportedOptionError, "names .w. more than once"),
    ({"loss_name": "los"}, UnknownNameError, "Did you mean 'loss'"),
    ({"loss_name": "y"}, ShapeMismatchError, "scalar"),
    ({"outputs": ["z"]}, UnknownNameError, "not an output"),
    ({"outputs": ["y"], "loss_name": "loss"}, UnsupportedOptionError, "not both"),
    ({"backend": "torch"}, UnsupportedOptionError, "'onnx' or 'ort'"),
])
def test_bad_arguments_raise_clear_errors(linear, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        gradient(linear, **kwargs)


def test_ort_backend_without_the_training_build_is_a_clear_error(linear):
    from support.environment import HAS_TRAINING

    if HAS_TRAINING:
        pytest.skip("the training build is installed here")
    with pytest.raises(RuntimeUnavailableError, match="lossgraph\\[training\\]"):
        gradient(linear, backend="ort")


# -- the ort backend ---------------------------------------------------------------------


@pytest.mark.training
@pytest.mark.parametrize("outputs", [None, ["y"]])
def test_ort_backend_has_the_same_inputs_outputs_and_values(linear, run_model, linear_feeds,
                                                           rng, outputs):
    ours = gradient(linear, outputs=outputs)
    theirs = gradient(linear, outputs=outputs, backend="ort")
    assert [i.name for i in ours.graph.input] == [i.name for i in theirs.graph.input]
    assert [o.name for o in ours.graph.output] == [o.name for o in theirs.graph.output]
    feeds = dict(linear_feeds)
    if outputs:
        feeds["y_grad"] = rng.normal(size=(6, 2)).astype(np.float32)
    expected = run_model(theirs, feeds)
    for name, value in run_model(ours, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.training
def test_ort_backend_rejects_double_losses_clearly():
    model = onnx.parser.parse_model(LINEAR.replace("float", "double"))
    with pytest.raises(DTypeMismatchError, match="float32"):
        gradient(model, backend="ort")


# -- golden models -----------------------------------------------------------------------


def _sklearn_backprop(est, X, Y):
    """scikit-learn's own loss gradients for a fitted MLP (its private _backprop)."""
    units = [X.shape[1], *est.hidden_layer_sizes, est.n_outputs_]
    activations = [X] + [None] * (len(units) - 1)
    deltas = [None] * (len(activations) - 1)
    coef_grads = [np.empty((a, b)) for a, b in zip(units[:-1], units[1:])]
    intercept_grads = [np.empty(b) for b in units[1:]]
    _, coef_grads, intercept_grads = est._backprop(
        X, Y, None, activations, deltas, coef_grads, intercept_grads)
    return coef_grads, intercept_grads


@pytest.mark.parametrize("name", ["skl_mlp_regressor", "skl_mlp_regressor_double"])
def test_golden_mlp_regressor_gradients_equal_scikit_learns_backprop(run_model, name):
    est = recipes.fit_estimator(name)
    X, y, _, _ = recipes.dataset(name)
    n = X.shape[0]
    # scikit-learn minimizes MSE/2 + alpha/(2n) sum W^2: twice that is our loss below.
    penalty = {"coefficient": est.alpha / n, "coefficient1": est.alpha / n}
    model = add_loss_output(recipes.GOLDEN_DIR / f"{name}.onnx", penalty=penalty)
    result = gradient(model, weights=["coefficient", "intercepts", "coefficient1", "intercepts1"])
    outputs = run_model(result, {"X": X, "label": y.reshape(-1, 1).astype(X.dtype)})
    coef_grads, intercept_grads = _sklearn_backprop(est, X.astype(np.float64),
                                                    y.reshape(-1, 1).astype(np.float64))
    rtol = 1e-4 if X.dtype == np.float32 else 1e-9
    for ours, theirs in [("coefficient", coef_grads[0]), ("intercepts", intercept_grads[0]),
                         ("coefficient1", coef_grads[1]), ("intercepts1", intercept_grads[1])]:
        np.testing.assert_allclose(outputs[f"{ours}_grad"] / 2, theirs.reshape(
            outputs[f"{ours}_grad"].shape), rtol=rtol, atol=rtol * 1e-2, err_msg=ours)


def test_golden_mlp_classifier_gradients_equal_scikit_learns_backprop(run_model):
    name = "skl_mlp_classifier"
    est = recipes.fit_estimator(name)
    X, y, _, _ = recipes.dataset(name)
    n = X.shape[0]
    penalty = {"coefficient": est.alpha / (2 * n), "coefficient1": est.alpha / (2 * n)}
    model = add_loss_output(recipes.GOLDEN_DIR / f"{name}.onnx", "multiclass_log_loss",
                            penalty=penalty)
    result = gradient(model, weights=["coefficient", "intercepts", "coefficient1", "intercepts1"])
    label = np.searchsorted(est.classes_, y).astype(np.int64)
    outputs = run_model(result, {"X": X, "label_1": label})
    Y = est._label_binarizer.transform(y).astype(np.float64)
    coef_grads, intercept_grads = _sklearn_backprop(est, X.astype(np.float64), Y)
    for ours, theirs in [("coefficient", coef_grads[0]), ("intercepts", intercept_grads[0]),
                         ("coefficient1", coef_grads[1]), ("intercepts1", intercept_grads[1])]:
        np.testing.assert_allclose(outputs[f"{ours}_grad"], theirs.reshape(
            outputs[f"{ours}_grad"].shape), rtol=2e-4, atol=1e-6, err_msg=ours)


SCORE_FOR = {"skl_logistic_binary": "binary_log_loss",
             "skl_logistic_multiclass": "multiclass_log_loss",
             "skl_sgd_classifier": "multiclass_log_loss",
             "skl_mlp_classifier": "multiclass_log_loss"}


GOLDEN = sorted(n for n, r in recipes.RECIPES.items() if r.kind != "torch")


@pytest.mark.parametrize("name", GOLDEN)
def test_every_golden_model_differentiates_and_runs(run_model, name):
    """Lowered, given a loss, stabilized and differentiated as compile_program does, every
    golden model yields finite gradients. skl2onnx writes SGDClassifier's one-vs-rest
    probabilities as 1 / (1 + Exp(-s)); skl_sgd_classifier's class-1 scores reach -99,
    where Exp overflows float32 and the chain rule meets 0 * inf: StabilizeNumerics
    rewrites the form (tests/passes/test_stabilize.py)."""
    model = add_loss_output(lower_ml_ops(recipes.GOLDEN_DIR / f"{name}.onnx"),
                            SCORE_FOR.get(name, "squared_error"))
    result = gradient(stabilize_numerics(model))
    grads = [o.name for o in result.graph.output][len(model.graph.output):]
    assert grads, "every golden model has trainable weights once lowered"
    X, y, _, _ = recipes.dataset(name)
    label = result.graph.input[1]
    if label.type.tensor_type.elem_type == onnx.TensorProto.INT64:
        label_value = y.astype(np.int64)
    else:
        label_value = y.reshape(-1, *[1] * (len(label.type.tensor_type.shape.dim) - 1))
        label_value = label_value.astype(X.dtype)
    outputs = run_model(result, {result.graph.input[0].name: X, label.name: label_value})
    for name_ in grads:
        assert np.all(np.isfinite(outputs[name_])), name_


@pytest.mark.parametrize("rows", [4, 8])
def test_a_gather_on_axis_1_before_a_gemm_differentiates_right(rows, run_model):
    """torch's ``out[:, -1]`` into a linear head: the rule's transpose of dy is the identity
    there, and onnxruntime's Gemm-Transpose fusion took an identity Transpose after a Gemm
    for a real one (a crash at 4 rows, a silently wrong gradient at 8). The builder emits
    no identity Transpose."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 5, 8] x) => (float[N, 1] y) <float[1, 8] w = {1,2,3,4,5,6,7,8}, int64 i = {-1}>
        { t = Gather<axis=1>(x, i)  y = Gemm<transB=1>(t, w) }""")
    vjp = gradient(model, weights=["x", "w"], outputs=["y"])
    perms = [list(n.attribute[0].ints) for n in vjp.graph.node if n.op_type == "Transpose"]
    assert all(p != sorted(p) for p in perms), perms
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5, 8)).astype(np.float32)
    dy = rng.normal(size=(rows, 1)).astype(np.float32)
    out = run_model(vjp, {"x": x, "y_grad": dy})
    expected = np.zeros_like(x)
    expected[:, -1, :] = dy * np.arange(1, 9, dtype=np.float32)
    np.testing.assert_allclose(out["x_grad"], expected, rtol=1e-6)
    np.testing.assert_allclose(out["w_grad"], dy.T @ x[:, -1, :], rtol=1e-5)


def test_a_weight_behind_an_op_declared_not_differentiable_is_told_why():
    """The NoGradientError names the declared reason (autodiff.registry.not_differentiable), not the
    generic one for shape, index or condition inputs."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N] x) => (float[N] y) <float[1] w = {0.5}>
        { p = Mul(x, w)  y = Bernoulli(p) }""")
    with pytest.raises(NoGradientError, match="a random draw of 0 or 1"):
        gradient(model, weights=["w"], outputs=["y"])


#: ``d_mask`` is taken already: the mask output gets another name
# -- a training-mode Dropout without its mask output --------------------------------------
# torch's dynamo exporter writes it so: the gradient pass gives the node its mask output,
# under a fresh name, and the gradient is dy * mask / (1 - ratio) with the mask that same
# forward pass drew.
DROPOUT = """<ir_version: 10, opset_import: ["" : 17]>
net (double[N, 4] x) => (double[N, 2] y)
<double[4, 3] W1 = {0.3, -0.2, 0.5, 0.1, 0.4, -0.6, -0.3, 0.2, 0.7, 0.5, -0.1, 0.2},
 double[3, 2] W2 = {0.2, -0.4, 0.6, 0.1, -0.5, 0.3}, float ratio = {0.4}, bool on = {1},
 double d_mask = {1.5}>
{
  h = MatMul(x, W1)
  a = Tanh(h)
  d = Dropout(a, ratio, on)
  z = MatMul(d, W2)
  y = Mul(z, d_mask)
}"""


def _numeric(loss, weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Central differences of ``loss(weights)`` with respect to ``weights[name]``."""
    grad = np.zeros_like(weights[name])
    for index in np.ndindex(*grad.shape):
        shifted = {k: v.copy() for k, v in weights.items()}
        shifted[name][index] += 1e-6
        up = loss(shifted)
        shifted[name][index] -= 2e-6
        grad[index] = (up - loss(shifted)) / 2e-6
    return grad


def test_the_gradient_uses_the_mask_its_forward_drew_and_equals_finite_differences():
    model = lossgraph.add_loss_output(onnx.parser.parse_model(DROPOUT))
    graph = lossgraph.gradient(model, ["W1", "W2"])
    (dropout,) = [n for n in graph.graph.node if n.op_type == "Dropout"]
    assert list(dropout.output) == ["d", "d_mask_1"]
    graph.graph.output.append(helper.make_tensor_value_info("d_mask_1", onnx.TensorProto.BOOL,
                                                            None))
    session = create_session(graph)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
               if t.name in ("W1", "W2")}
    masks = set()
    for _ in range(3):  # a new mask every run; each run's gradient is the one of its mask
        mask, grad1, grad2 = session.run(["d_mask_1", "W1_grad", "W2_grad"],
                                         {"x": X, "label": y})
        masks.add(mask.tobytes())
        assert 0 < mask.mean() < 1

        def loss(w, mask=mask):
            d = np.tanh(X @ w["W1"]) * mask / (1 - np.float32(0.4))
            return np.mean((d @ w["W2"] * 1.5 - y) ** 2)

        for name, grad in (("W1", grad1), ("W2", grad2)):
            np.testing.assert_allclose(grad, _numeric(loss, weights, name), rtol=1e-6,
                                       atol=1e-9, err_msg=name)
    assert len(masks) > 1


def test_the_training_graphs_dropout_gets_the_mask_output_the_model_given_keeps_none():
    given = onnx.parser.parse_model(DROPOUT)
    program = lossgraph.compile_program(given)
    (dropout,) = [n for n in given.graph.node if n.op_type == "Dropout"]
    assert list(dropout.output) == ["d"]
    (trained,) = [n for n in program.graphs["train_step"].graph.node if n.op_type == "Dropout"]
    assert len(trained.output) == 2


@pytest.mark.torch
def test_torchs_dynamo_export_of_a_training_dropout_gets_torchs_gradient_with_its_mask():
    torch = pytest.importorskip("torch")
    from support.torch_steps import assert_gradients_close, lossgraph_gradients, torch_gradients

    nn = torch.nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 1)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings
        exported = torch.onnx.export(
            net, (torch.randn(3, 4),), dynamo=True, optimize=False, verbose=False,
            dynamic_shapes=({0: torch.export.Dim("N", min=2)},)).model_proto
    (dropout,) = [n for n in exported.graph.node if n.op_type == "Dropout"]
    assert len(dropout.output) == 1
    exported.graph.output.append(helper.make_tensor_value_info(
        dropout.output[0], onnx.TensorProto.FLOAT, ("N", 4)))  # the dropped values
    rng = np.random.default_rng(1)
    X = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    names = [name for name, _ in net.named_parameters()]
    ours = lossgraph_gradients(exported, names, X, y, output_index=0,
                               fetch=(dropout.output[0],))
    kept = ours.pop(dropout.output[0]) != 0  # a Linear's output is never exactly 0
    assert 0.2 < kept.mean() < 0.8

    class FixedMask(nn.Module):
        def forward(self, x):
            return x * torch.from_numpy(kept.astype(np.float64) / 0.5)

    net[1] = FixedMask()
    assert_gradients_close(ours, torch_gradients(net, X, y))
    program = lossgraph.compile_program(exported, loss_options={"output_index": 0})
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=4, progress=False)
    assert np.isfinite(trainer.train_losses_).all()
