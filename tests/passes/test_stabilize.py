"""StabilizeNumerics: overflowing forms rewritten into stable ones, before differentiation.

Each form is a small model in ONNX text syntax. The rewritten model computes the same
values (against a float64 reference, and never further from it than the original form),
its gradient is finite at extreme inputs where the original one is not, and equals finite
differences elsewhere. Intermediates other nodes read are kept; constants are matched
exactly. The compiler runs the pass on every graph that computes the loss, never on the
inference model: a skl2onnx SGDClassifier, whose gradient was NaN, now trains.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import recipes
from support.environment import HAS_SKL2ONNX
from support.gradcheck import check_gradients, loss_model

import lossgraph
from lossgraph import add_loss_output, gradient, lower_ml_ops
from lossgraph.errors import UnsupportedOptionError
from lossgraph.optim import SGD
from lossgraph.passes import StabilizeNumerics
from lossgraph.passes.loss import SCORES
from lossgraph.passes.stabilize import StableRewrite, stabilize_numerics


# ------------------------------------------------------------------ references
def _sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0, x)


def _log_sum_exp(x: np.ndarray, keepdims: bool = False) -> np.ndarray:
    top = x.max(axis=1, keepdims=True)
    total = top + np.log(np.exp(x - top).sum(axis=1, keepdims=True))
    return total if keepdims else total[:, 0]


#: name -> (body of a graph from x[N, 3] to y, the value of y in float64, what the report
#: shows as the unstable form, the ops of the rewritten graph with the Softplus kernel)
FORMS: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], str, list[str]]] = {
    "torch 1 / (1 + exp(-x))": (
        "n = Neg(x) e = Exp(n) c = Constant<value = {t} {{1}}>() d = Add(e, c) y = Reciprocal(d)",
        _sigmoid, "Reciprocal(Add(Exp(n), 1))", ["Neg", "Softplus", "Neg", "Exp"]),
    "skl2onnx SGDClassifier": (
        "n = Mul(x, negate) e = Exp(n) d = Add(e, one) y = Reciprocal(d)",
        _sigmoid, "Reciprocal(Add(Exp(n), 1))", ["Mul", "Softplus", "Neg", "Exp"]),
    "skl2onnx sigmoid calibration": (
        "e = Exp(x) d = Add(one, e) y = Div(one, d)",
        lambda x: _sigmoid(-x), "Div(1, Add(1, Exp(x)))", ["Softplus", "Neg", "Exp"]),
    "1 / (1 + exp(0 - x))": (
        "n = Sub(zero, x) e = Exp(n) d = Add(one, e) y = Div(one, d)",
        _sigmoid, "Div(1, Add(1, Exp(n)))", ["Sub", "Softplus", "Neg", "Exp"]),
    "log softmax": (
        "p = Softmax<axis = 1>(x) y = Log(p)",
        lambda x: x - _log_sum_exp(x, keepdims=True), "Log(Softmax(x; axis=1))", ["LogSoftmax"]),
    "log(1 + exp(x))": (
        "e = Exp(x) d = Add(e, one) y = Log(d)",
        _softplus, "Log(Add(Exp(x), 1))", ["Softplus"]),
    "log sigmoid": (
        "s = Sigmoid(x) y = Log(s)",
        lambda x: -_softplus(-x), "Log(Sigmoid(x))", ["Neg", "Softplus", "Neg"]),
    "log(1 - sigmoid)": (
        "s = Sigmoid(x) d = Sub(one, s) y = Log(d)",
        lambda x: -_softplus(x), "Log(Sub(1, Sigmoid(x)))", ["Softplus", "Neg"]),
    "log(-sigmoid + 1), torch dynamo": (
        "s = Sigmoid(x) m = Neg(s) d = Add(m, one) y = Log(d)",
        lambda x: -_softplus(x), "Log(Add(Neg(Sigmoid(x)), 1))", ["Softplus", "Neg"]),
    "log sum exp": (
        "e = Exp(x) r = ReduceSum<keepdims = 1>(e, axes) y = Log(r)",
        lambda x: _log_sum_exp(x, keepdims=True), "Log(ReduceSum(Exp(x), 1; keepdims=1))",
        ["ReduceLogSumExp"]),
    "log(1 / (1 + exp(-x)))": (
        "n = Neg(x) e = Exp(n) d = Add(e, one) r = Reciprocal(d) y = Log(r)",
        lambda x: -_softplus(-x), "Log(Exp(negated_softplus))", ["Neg", "Softplus", "Neg",
                                                                  "Identity"]),
    "log(exp(x))": ("e = Exp(x) y = Log(e)", lambda x: x, "Log(Exp(x))", ["Identity"]),
}
TYPES = {"float": np.float32, "double": np.float64}


def form_model(name: str, t: str = "float", body: str | None = None,
               constants: str = "") -> onnx.ModelProto:
    """The model of form ``name`` in element type ``t`` (another ``body`` if given)."""
    body = (body or FORMS[name][0]).format(t=t)
    columns = 1 if "ReduceSum" in body else 3
    return onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 18]>
        g ({t}[N, 3] x) => ({t}[N, {columns}] y)
        <{t} one = {{1}}, {t} zero = {{0}}, {t} negate = {{-1}}, int64[1] axes = {{1}}{constants}>
        {{ {body} }}""")


def _parse(body: str, t: str = "float", outputs: str = "", inputs: str = "",
           constants: str = "") -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 18]>
        g ({t}[N, 3] x{inputs}) => ({t}[N, 3] y{outputs})
        <{t} one = {{1}}, {t} two = {{2}}{constants}>
        {{ {body} }}""")


def inputs(dtype: type, rng: np.random.Generator) -> np.ndarray:
    """Moderate values, large ones, and extremes past where Exp overflows."""
    extremes = [[-1000, -100, -89], [89, 100, 1000], [0, -20, 20], [-40, 40, 0.5],
                [-90, -95, -100], [700, -700, 1]]
    return np.concatenate([rng.normal(size=(8, 3)), rng.normal(size=(8, 3)) * 30,
                           extremes]).astype(dtype)


def _bound(x: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """How far from ``reference`` a value computed from ``x`` may be: relatively, the type's
    rounding; absolutely, a few units of the type's resolution at the row's largest input
    (its own rounding: log-softmax is x - lse(x), the explicit softplus's log(1 + e^-|x|)
    is exact to the resolution near 1, not relatively in its tail)."""
    eps = float(np.finfo(x.dtype).eps)
    rtol = 1e-5 if x.dtype == np.float32 else 1e-12
    scale = 1 + np.abs(x).max(axis=1, keepdims=True).astype(np.float64)
    return rtol * np.abs(reference) + 4 * eps * scale


FORM_IDS = list(FORMS)
CASES = [pytest.param(name, t, backend, id=f"{name}-{t}-{backend}")
         for name in FORM_IDS for t in TYPES for backend in ("onnx", "ort")]


# -------------------------------------------------------------------- rewrites
@pytest.mark.parametrize("name", FORM_IDS)
def test_each_form_is_rewritten_into_stable_ops_and_reported(name):
    body, _, unstable, ops = FORMS[name]
    model = form_model(name)
    result = StabilizeNumerics()(model)
    assert result.changed
    assert result.report[-1].value == "y"
    assert result.report[-1].unstable == unstable
    assert [n.op_type for n in result.model.graph.node] == ops
    onnx.checker.check_model(result.model, full_check=True)
    # the constants only the unstable form read are gone
    unread = {t.name for t in model.graph.initializer} - {i for n in model.graph.node
                                                          for i in n.input}
    read = {i for n in result.model.graph.node for i in n.input}
    assert {t.name for t in result.model.graph.initializer} - unread <= read
    assert model.SerializeToString() == form_model(name).SerializeToString()  # pure


def test_the_report_shows_both_forms():
    result = StabilizeNumerics()(form_model("skl2onnx SGDClassifier"))
    assert result.report == (StableRewrite("y", "Reciprocal(Add(Exp(n), 1))",
                                           "Exp(Neg(Softplus(n)))"),)
    double = StabilizeNumerics()(form_model("log sigmoid", "double"))
    assert double.report[0].stable == (
        "Neg(Add(Mul(Sub(Abs(x), x), 0.5), Log(Add(Exp(Neg(Abs(x))), 1))))")


@pytest.mark.parametrize(("name", "t", "backend"), CASES)
def test_forward_values_are_kept(name, t, backend, rng, run_model):
    """Against float64: the stable form within float tolerance everywhere, and never further
    from the truth than the original wherever the original is finite."""
    dtype = TYPES[t]
    model = form_model(name, t)
    result = StabilizeNumerics(backend)(model)
    if _left_to_ort(name, backend):
        assert result.report == ()
        return
    stable = result.model
    emitted = {n.op_type for n in stable.graph.node}
    assert "Softplus" not in emitted or (t, backend) == ("float", "onnx")
    assert "ReduceLogSumExp" not in emitted or backend == "onnx"
    x = inputs(dtype, rng)
    reference = FORMS[name][1](x.astype(np.float64))
    new = run_model(stable, {"x": x})["y"]
    with np.errstate(all="ignore"):
        old = run_model(model, {"x": x})["y"]
    bound = _bound(x, reference)
    assert np.all(np.isfinite(new))
    assert np.all(np.abs(new - reference) <= bound), np.max(np.abs(new - reference) / bound)
    finite = np.isfinite(old)
    assert np.all((np.abs(new - reference) <= np.abs(old - reference) + bound)[finite])
    moderate = np.abs(x).max(axis=1) < 5
    assert np.all(np.abs(new - old)[moderate] <= 2 * bound[moderate])


def _left_to_ort(name: str, backend: str) -> bool:
    """Log(ReduceSum(Exp)): onnxruntime-training fails on ReduceLogSumExp's gradient."""
    return name == "log sum exp" and backend == "ort"


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("backend", ["onnx", "ort"])
def test_the_sigmoid_is_exact_in_both_tails(t, backend, run_model):
    """onnxruntime's Sigmoid reads 0 past -18 (float32); the emitted form keeps the tail
    relatively exact, as 1 / (1 + exp(-x)) does where it is finite."""
    dtype = TYPES[t]
    model = StabilizeNumerics(backend)(form_model("skl2onnx SGDClassifier", t)).model
    x = np.array([[-80, -40, -17], [-5, 0, 5], [17, 40, 80]], dtype)
    np.testing.assert_allclose(run_model(model, {"x": x})["y"], _sigmoid(x.astype(np.float64)),
                               rtol=1e-5 if t == "float" else 1e-13, atol=np.finfo(dtype).tiny)


# ------------------------------------------------------------------- gradients
def _gradient_of(model: onnx.ModelProto, x: np.ndarray, run_model) -> np.ndarray:
    with_loss = loss_model(model, {"x": np.zeros((1, 3), x.dtype)})
    graph = gradient(with_loss, weights=["x"], loss_name="gradcheck_loss")
    with np.errstate(all="ignore"):
        return run_model(graph, {"x": x})["x_grad"]


def _reference_gradient(name: str, x: np.ndarray) -> np.ndarray:
    """d sum(y R) / dx in float64, by central differences of the float64 reference (the
    cotangent R is gradcheck's, one row broadcast over the rows)."""
    from support.gradcheck import cotangent

    f = FORMS[name][1]
    shape = f(x[:1]).shape
    r = cotangent(shape, np.float64)
    h = 1e-6 * np.maximum(1, np.abs(x))
    grad = np.zeros_like(x)
    for column in range(x.shape[1]):
        step = np.zeros_like(x)
        step[:, column] = h[:, column]
        grad[:, column] = (((f(x + step) - f(x - step)) * r).sum(axis=1)
                           / (2 * h[:, column]))
    return grad


@pytest.mark.parametrize(("name", "t", "backend"), CASES)
def test_the_gradient_is_finite_and_right_at_extreme_inputs(name, t, backend, run_model):
    if _left_to_ort(name, backend):
        return
    dtype = TYPES[t]
    x = np.array([[-1000, -100, -89], [89, 100, 1000], [-90, 95, 0], [-40, 40, 0.5]], dtype)
    model = form_model(name, t)
    stable = _gradient_of(StabilizeNumerics(backend)(model).model, x, run_model)
    assert np.all(np.isfinite(stable))
    # the reference's central differences are good to about 1e-10 at these magnitudes
    np.testing.assert_allclose(stable, _reference_gradient(name, x.astype(np.float64)),
                               rtol=1e-4 if t == "float" else 1e-7,
                               atol=1e-6 if t == "float" else 1e-9)
    if t == "float":  # the original form's gradient overflows there
        assert not np.all(np.isfinite(_gradient_of(model, x, run_model)))


@pytest.mark.parametrize("name", FORM_IDS)
@pytest.mark.parametrize("backend", ["onnx", "ort"])
def test_the_gradient_equals_finite_differences(name, backend, rng):
    x = (rng.normal(size=(4, 3)) * 3).astype(np.float64)
    check_gradients(StabilizeNumerics(backend)(form_model(name, "double")).model, {"x": x},
                    ort=backend == "ort")


@pytest.mark.training
@pytest.mark.parametrize("name", FORM_IDS)
def test_onnxruntime_training_differentiates_the_ort_forms(name):
    """backend="ort" emits only ops GradientGraphBuilder differentiates (it has no
    Softplus rule, and fails on ReduceLogSumExp)."""
    result = StabilizeNumerics("ort")(form_model(name))
    if _left_to_ort(name, "ort"):
        assert result.report == ()
        return
    model = result.model
    ours = {n.op_type for n in model.graph.node}
    assert not {"Softplus", "ReduceLogSumExp"} & ours
    x = np.array([[-1000, -100, -89], [89, 100, 1000], [0.3, -2, 1]], np.float32)
    with_loss = loss_model(model, {"x": x})
    from lossgraph.runtime.session import create_session, quiet_session_options

    graph = gradient(with_loss, weights=["x"], loss_name="gradcheck_loss", backend="ort")
    session = create_session(graph, session_options=quiet_session_options())
    assert np.all(np.isfinite(session.run(["x_grad"], {"x": x})[0]))


# -------------------------------------------------- what is kept, what is left alone
def test_an_intermediate_read_elsewhere_is_kept_and_the_stable_form_computed_beside_it(
        rng, run_model):
    model = _parse("""n = Neg(x)  e = Exp(n)  d = Add(e, one)  y = Reciprocal(d)
                      z = Mul(d, two)""", outputs=", float[N, 3] z")
    result = StabilizeNumerics()(model)
    assert result.report[0].kept == ("d", "e")  # e: read by the Add that stays
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Exp") == 2 and "Add" in ops and "Reciprocal" not in ops
    x = inputs(np.float32, rng)
    with np.errstate(all="ignore"):
        before = run_model(model, {"x": x})
    after = run_model(result.model, {"x": x})
    np.testing.assert_array_equal(after["z"], before["z"])
    np.testing.assert_allclose(after["y"], _sigmoid(x.astype(np.float64)), rtol=1e-5,
                               atol=np.finfo(np.float32).tiny)


def test_an_intermediate_that_is_a_graph_output_is_kept(rng, run_model):
    model = _parse("p = Softmax<axis = 1>(x)  y = Log(p)", outputs=", float[N, 3] p")
    result = StabilizeNumerics()(model)
    assert result.report == (
        StableRewrite("y", "Log(Softmax(x; axis=1))", "LogSoftmax(x; axis=1)", ("p",)),)
    assert [n.op_type for n in result.model.graph.node] == ["Softmax", "LogSoftmax"]
    x = inputs(np.float32, rng)
    np.testing.assert_array_equal(run_model(result.model, {"x": x})["p"],
                                  run_model(model, {"x": x})["p"])


def test_torchscripts_binary_cross_entropy_with_logits_becomes_stable(rng, run_model):
    """One Sigmoid read by Log(s) and Log(1 - s): both rewritten, then the Sigmoid goes."""
    model = _parse("""s = Sigmoid(x)  a = Log(s)  d = Sub(one, s)  b = Log(d)
                      t = Sub(one, label)  pa = Mul(label, a)  pb = Mul(t, b)
                      total = Add(pa, pb)  y = Neg(total)""", inputs=", float[N, 3] label")
    result = StabilizeNumerics()(model)
    assert [r.value for r in result.report] == ["a", "b"]
    assert result.report[0].kept == ("s",) and result.report[1].kept == ()
    assert "Sigmoid" not in {n.op_type for n in result.model.graph.node}
    x = inputs(np.float32, rng)
    label = (rng.random(x.shape) > 0.5).astype(np.float32)
    y = run_model(result.model, {"x": x, "label": label})["y"]
    x64 = x.astype(np.float64)
    expected = label * _softplus(-x64) + (1 - label) * _softplus(x64)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    with_loss = loss_model(result.model, {"x": x, "label": label})
    graph = gradient(with_loss, weights=["x"], loss_name="gradcheck_loss")
    assert np.all(np.isfinite(run_model(graph, {"x": x, "label": label})["x_grad"]))


@pytest.mark.parametrize(("why", "body", "constants"), [
    ("not exactly one", "e = Exp(x) d = Add(e, near) y = Log(d)", ", float near = {1.0000001}"),
    ("a constant that broadcasts to a larger shape", None, None),
    ("float16", None, None),
    ("already stable: Exp of minus an absolute value",
     "a = Abs(x) n = Neg(a) e = Exp(n) d = Add(one, e) y = Log(d)", ""),
    ("already stable: Exp of minus a Relu",
     "a = Relu(x) n = Mul(a, negate) e = Exp(n) d = Add(one, e) y = Reciprocal(d)", ""),
    ("a Log of something else", "s = Sigmoid(x) d = Add(s, one) y = Log(d)", ""),
    ("a Reciprocal of something else", "e = Exp(x) d = Mul(e, one) y = Reciprocal(d)", ""),
])
def test_forms_that_are_not_exactly_matched_are_left_alone(why, body, constants):
    if why == "float16":
        model = form_model("log(1 + exp(x))", "float16")
    elif body is None:
        model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
            g (float[3] x) => (float[2, 3] y) <float[2, 3] wide = {1, 1, 1, 1, 1, 1}>
            { e = Exp(x)  d = Add(e, wide)  y = Log(d) }""")
    else:
        model = form_model("", body=body, constants=constants)
    result = StabilizeNumerics()(model)
    assert result.report == () and not result.changed, why
    assert result.model.graph.SerializeToString() == model.graph.SerializeToString()


def test_a_constant_that_is_also_a_graph_input_is_not_taken_for_one():
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 3] x, float one) => (float[N, 3] y) <float one = {1}>
        { e = Exp(x)  d = Add(e, one)  y = Log(d) }""")
    assert StabilizeNumerics()(model).report == ()


def test_a_constant_one_of_a_broadcast_shape_that_keeps_the_shape_matches(run_model, rng):
    model = form_model("", body="e = Exp(x) d = Add(e, ones) y = Log(d)",
                       constants=", float[1, 3] ones = {1, 1, 1}")
    result = StabilizeNumerics()(model)
    assert [r.stable for r in result.report] == ["Softplus(x)"]
    x = inputs(np.float32, rng)
    np.testing.assert_allclose(run_model(result.model, {"x": x})["y"],
                               _softplus(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", sorted(SCORES))
def test_lossgraphs_own_losses_are_stable_already(loss):
    """The separate mode's loss graph and every loss add_loss_output writes: nothing to do."""
    shapes = {"binary_log_loss": "float[N, 2]", "multiclass_log_loss": "float[N, 3]"}
    shape = shapes.get(loss, "float[N, 1]")
    columns = int(shape[-2])
    ones = ", ".join(["1"] * 3 * columns)

    def scores(last: str = "y = Identity(z)") -> onnx.ModelProto:
        return onnx.parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 18]>
            g (float[N, 3] x) => ({shape} y) <float[3, {columns}] w = {{{ones}}}>
            {{ z = MatMul(x, w)  {last} }}""")

    # the log losses of probabilities read a softmax, the others scores or values
    probabilities = loss in ("binary_log_loss", "multiclass_log_loss")
    model = scores("y = Softmax <axis = 1> (z)" if probabilities else "y = Identity(z)")
    with_loss = add_loss_output(model, loss)
    assert StabilizeNumerics()(with_loss).report == ()
    if loss == "multiclass_log_loss":
        logits = add_loss_output(scores(), loss, from_logits=True)
        assert StabilizeNumerics()(logits).report == ()


def test_forms_in_subgraphs_are_rewritten(run_model, rng):
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 3] x, bool c) => (float[N, 3] y) {
            y = If(c) <then_branch = t () => (float[N, 3] a) { p = Softmax<axis = 1>(x)
                                                               a = Log(p) },
                       else_branch = f () => (float[N, 3] b) { b = Identity(x) }>
        }""")
    result = StabilizeNumerics()(model)
    assert [r.unstable for r in result.report] == ["Log(Softmax(x; axis=1))"]
    branch = result.model.graph.node[0].attribute[0].g
    assert [n.op_type for n in branch.node] == ["LogSoftmax"]
    x = inputs(np.float32, rng)
    out = run_model(result.model, {"x": x, "c": np.array(True)})["y"]
    np.testing.assert_allclose(out, FORMS["log softmax"][1](x.astype(np.float64)),
                               rtol=1e-5, atol=1e-6)


def test_the_pass_is_deterministic_and_its_names_fresh():
    model = form_model("", body="n = Neg(x) e = Exp(n) d = Add(e, one) r = Reciprocal(d) "
                                "y = Log(r) softplus = Identity(x)", constants="")
    first, second = StabilizeNumerics()(model), StabilizeNumerics()(model)
    assert first.model.SerializeToString() == second.model.SerializeToString()
    assert first.report == second.report
    outputs = [o for n in first.model.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs)) and "softplus_1" in outputs


def test_a_model_without_candidates_is_returned_unchanged():
    model = onnx.load(recipes.GOLDEN_DIR / "hand_linear.onnx")
    result = StabilizeNumerics()(model)
    assert not result.changed and result.report == ()
    assert result.model.graph.SerializeToString() == model.graph.SerializeToString()


def test_an_unknown_backend_is_refused():
    with pytest.raises(UnsupportedOptionError, match="backend"):
        StabilizeNumerics("torch")


# --------------------------------------------------------------- in the compiler
def _sgd() -> onnx.ModelProto:
    return onnx.load(recipes.GOLDEN_DIR / "skl_sgd_classifier.onnx")


def test_stabilize_numerics_function_is_the_pass():
    model = lower_ml_ops(_sgd())
    assert stabilize_numerics(model).SerializeToString() == \
        StabilizeNumerics()(model).model.SerializeToString()


def test_the_golden_sgd_classifier_differentiates_only_once_stabilized(run_model):
    model = add_loss_output(lower_ml_ops(_sgd()), "multiclass_log_loss")
    X, y, _, _ = recipes.dataset("skl_sgd_classifier")
    feeds = {"X": X, "label_1": y.astype(np.int64)}
    with np.errstate(all="ignore"):
        raw = run_model(gradient(model), feeds)
    assert not np.all(np.isfinite(raw["coef_grad"]))
    stable = run_model(gradient(stabilize_numerics(model)), feeds)
    assert np.all(np.isfinite(stable["coef_grad"]))
    np.testing.assert_allclose(stable["loss"], raw["loss"], rtol=1e-6)


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_describe_plan_runs_it_on_every_loss_graph_and_never_on_predict(fuse):
    text = lossgraph.describe_plan(_sgd(), loss="multiclass_log_loss", fuse=fuse)
    lines = {name.strip(): passes for name, passes in
             (line.split(" = ", 1) for line in text.splitlines())}
    for start in ("loss model", "inference model", "forward model"):  # the models planned from
        assert "StabilizeNumerics" not in lines.pop(start, "")
    assert "StabilizeNumerics" not in lines.pop("predict")
    # separate mode's loss, update and penalty graphs are built, not derived from the model:
    # lossgraph's own loss is written in stable forms
    built = {name: lines.pop(name) for name in ("loss", "update", "penalty") if name in lines}
    assert all("StabilizeNumerics" not in passes for passes in built.values())
    assert lines and all("StabilizeNumerics" in passes for passes in lines.values())
    for name, passes in lines.items():
        if "Gradient" in passes:
            assert passes.index("StabilizeNumerics") < passes.index("Gradient"), name
    if fuse == "separate":
        assert lines["gradient"].startswith("forward model -> WeightsToInputs(")


@pytest.mark.training
def test_with_the_ort_backend_it_emits_what_onnxruntime_training_differentiates():
    ort = lossgraph.describe_plan(_sgd(), loss="multiclass_log_loss", backend="ort")
    assert "StabilizeNumerics(backend='ort') -> Gradient(" in ort


def _sgd_reference(X, y, W, b, learning_rate, epochs):
    """``epochs`` steps of full-batch gradient descent, and the loss before each, on the mean
    log loss of skl2onnx's probabilities (one-vs-rest sigmoids normalized to sum 1, clipped
    to [eps, 1 - eps]), in float64."""
    eps = float(np.finfo(np.float32).eps)
    rows = np.arange(len(y))
    losses = []
    for _ in range(epochs):
        s = X @ W + b
        sig = _sigmoid(s)
        total = sig.sum(axis=1, keepdims=True)
        p = sig[rows, y] / total[:, 0]
        losses.append(float(-np.log(np.clip(p, eps, 1 - eps)).mean()))
        inside = ((p > eps) & (p < 1 - eps))[:, None]
        onehot = np.eye(W.shape[1])[y]
        # d(-log p_y)/ds_k = -(onehot / sig_y - 1 / total) sig_k (1 - sig_k)
        ds = -(onehot / sig[rows, y][:, None] - 1 / total) * sig * (1 - sig) * inside / len(y)
        W, b = W - learning_rate * X.T @ ds, b - learning_rate * ds.sum(axis=0)
    return W, b, losses


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_the_skl2onnx_sgd_classifier_trains_and_predicts_like_a_reference(fuse):
    X, y, X_test, y_test = recipes.dataset("skl_sgd_classifier")
    y = y.astype(np.int64)
    program = lossgraph.compile_program(_sgd(), loss="multiclass_log_loss", fuse=fuse,
                                        optimizer=SGD(0.5))
    predict_ops = {n.op_type for n in program.graphs["predict"].graph.node}
    assert {"Reciprocal", "Exp"} <= predict_ops and "Softplus" not in predict_ops
    inference_ops = [n.op_type for n in program.inference_model.graph.node]
    assert "Reciprocal" in inference_ops and "Softplus" not in inference_ops
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=20, batch_size=len(X), shuffle=False,
                                             progress=False)
    losses = np.array(trainer.train_losses_)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] and np.all(np.diff(losses) < 0)
    initial = _weights(_sgd())
    W, b, expected = _sgd_reference(X.astype(np.float64), y, initial["coef"].astype(np.float64),
                                    initial["intercept"].astype(np.float64), 0.5, 20)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    np.testing.assert_allclose(trainer.state["coef"], W, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(trainer.state["intercept"], b, rtol=1e-3, atol=1e-4)
    s = X_test.astype(np.float64) @ W + b
    expected_proba = _sigmoid(s) / _sigmoid(s).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(trainer.predict(X_test), expected_proba, rtol=1e-3, atol=1e-5)
    exported = trainer.to_inference_model()
    assert "Reciprocal" in [n.op_type for n in exported.graph.node]


@pytest.mark.skipif(not HAS_SKL2ONNX, reason="needs skl2onnx")
def test_an_sgd_classifier_converted_by_skl2onnx_now_trains_and_predicts_like_scikit_learn():
    """The recipe's SGDClassifier converted by this skl2onnx: its class scores reach -99,
    where the gradient of 1 / (1 + Exp(-s)) was NaN; it trains in minibatches."""
    from skl2onnx import to_onnx

    X, y, X_test, y_test = recipes.dataset("skl_sgd_classifier")
    est = recipes.fit_estimator("skl_sgd_classifier")
    model = to_onnx(est, X[:1], target_opset=18, options={"zipmap": False})
    assert (X @ est.coef_.T + est.intercept_).min() < -88
    program = lossgraph.compile_program(model, loss="multiclass_log_loss", optimizer=SGD(0.5))
    fresh = lossgraph.Trainer(program)  # before any step: scikit-learn's probabilities
    np.testing.assert_allclose(fresh.predict(X_test), est.predict_proba(X_test), rtol=1e-4,
                               atol=1e-6)
    trainer = lossgraph.Trainer(program).fit(X, y.astype(np.int64), epochs=10, batch_size=20,
                                             random_state=0, progress=False)
    losses = np.array(trainer.train_losses_)
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0)
    accuracy = (trainer.predict(X_test).argmax(axis=1) == y_test).mean()
    assert accuracy >= est.score(X_test, y_test) - 0.02


@pytest.mark.training
def test_the_sgd_classifier_trains_with_the_ort_backend():
    X, y, _, _ = recipes.dataset("skl_sgd_classifier")
    program = lossgraph.compile_program(_sgd(), loss="multiclass_log_loss", backend="ort",
                                        optimizer=SGD(0.5))
    trainer = lossgraph.Trainer(program).fit(X, y.astype(np.int64), epochs=3, batch_size=50,
                                             random_state=0, progress=False)
    assert np.all(np.isfinite(trainer.train_losses_))
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]
