"""lower_ml_ops: ai.onnx.ml linear models and Normalizer against onnxruntime's kernels."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from support import models

from lossgraph.analysis import trainable_initializers
from lossgraph.errors import InvalidModelError, UnsupportedModelError
from lossgraph.passes.lower_ml import lower_ml_ops

ort = pytest.importorskip("onnxruntime")

TRANSFORMS = ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"]
ELEM = {"float": TensorProto.FLOAT, "double": TensorProto.DOUBLE,
        "int64": TensorProto.INT64, "int32": TensorProto.INT32}
NP = {"float": np.float32, "double": np.float64, "int64": np.int64, "int32": np.int32}
ML = {"ai.onnx.ml": 3}
LOWERED = {"LinearRegressor", "LinearClassifier", "Normalizer"}
#: Ops a loss's gradient may meet on the score path of a lowered model.
DIFFERENTIABLE = {"Gemm", "Cast", "Reshape", "Unsqueeze", "Sigmoid", "Softmax", "Sub", "Concat",
                  "Add", "Mul", "Div", "Abs", "Sqrt", "ReduceSum", "ReduceMax", "Exp", "Log",
                  "Neg", "Max", "Clip"}


# -- model makers -----------------------------------------------------------------------


def _input(dtype: str, shape: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("X", ELEM[dtype], shape)


def classifier(coefficients, intercepts=None, *, post="NONE", ints=None, strings=None,
               dtype="float", shape=(None, "F"), multi_class=None,
               name="linear_classifier") -> onnx.ModelProto:
    """A model made of one LinearClassifier node, X -> (label, scores)."""
    attrs = {"coefficients": [float(c) for c in np.ravel(coefficients)], "post_transform": post}
    if intercepts is not None:
        attrs["intercepts"] = [float(i) for i in intercepts]
    if ints is not None:
        attrs["classlabels_ints"] = list(ints)
    if strings is not None:
        attrs["classlabels_strings"] = list(strings)
    if multi_class is not None:
        attrs["multi_class"] = multi_class
    if shape is not None and len(shape) and shape[-1] == "F":
        shape = [*shape[:-1], np.shape(coefficients)[-1]]
    node = helper.make_node("LinearClassifier", ["X"], ["label", "scores"], name=name,
                            domain="ai.onnx.ml", **attrs)
    label_type = TensorProto.STRING if strings is not None else TensorProto.INT64
    features = _input(dtype, None if shape is None else list(shape))
    graph = helper.make_graph([node], "ml", [features], [
        helper.make_tensor_value_info("label", label_type, [None]),
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, None])])
    return models.model_of_graph(graph, opset=17, domains=ML)


def regressor(coefficients, intercepts=None, *, post="NONE", targets=None, dtype="float",
              shape=(None, "F"), name="linear_regressor") -> onnx.ModelProto:
    """A model made of one LinearRegressor node, X -> Y."""
    attrs = {"coefficients": [float(c) for c in np.ravel(coefficients)], "post_transform": post}
    if intercepts is not None:
        attrs["intercepts"] = [float(i) for i in intercepts]
    if targets is not None:
        attrs["targets"] = targets
    if shape is not None and len(shape) and shape[-1] == "F":
        shape = [*shape[:-1], np.shape(coefficients)[-1]]
    node = helper.make_node("LinearRegressor", ["X"], ["Y"], name=name, domain="ai.onnx.ml",
                            **attrs)
    rows = [None] if shape is not None and len(shape) == 2 else [1]
    graph = helper.make_graph([node], "ml", [_input(dtype, None if shape is None else list(shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT,
                                                             [*rows, targets or 1])])
    return models.model_of_graph(graph, opset=17, domains=ML)


def normalizer(norm: str, dtype="float", shape=(None, 4)) -> onnx.ModelProto:
    node = helper.make_node("Normalizer", ["X"], ["Y"], name="normalizer", domain="ai.onnx.ml",
                            norm=norm)
    graph = helper.make_graph([node], "ml", [_input(dtype, list(shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(shape))])
    return models.model_of_graph(graph, opset=17, domains=ML)


# -- checks -----------------------------------------------------------------------------


def assert_same_outputs(actual: dict, expected: dict, atol: float = 1e-30) -> None:
    """Equal labels, float outputs equal to rtol 1e-6 (NaN where onnxruntime has NaN)."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype, name
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def assert_lowered(model: onnx.ModelProto) -> None:
    """No lowered ml op left, valid, and only standard domains when nothing else is ml."""
    onnx.checker.check_model(model, full_check=True)
    assert not [n for n in model.graph.node if n.domain == "ai.onnx.ml" and n.op_type in LOWERED]
    assert not any(n.op_type == "Where" for n in model.graph.node)
    if not any(n.domain == "ai.onnx.ml" for n in model.graph.node):
        assert [o.domain for o in model.opset_import] == [""]


def run(model: onnx.ModelProto, feeds: dict, prepacking: bool = False) -> dict:
    """All outputs of ``model`` on ``feeds`` in onnxruntime (CPU, warnings silenced).

    Prepacking is off by default: with it, onnxruntime packs a constant Gemm weight and
    runs single-row batches through another MLAS kernel than the one LinearClassifier
    uses (one ulp apart, see test_prepacked_weights_change_single_rows_by_rounding_only).
    Training graphs feed their weights as inputs, which are never prepacked.
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def check_against_onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> dict:
    """Lower ``model``, check the result, and compare both models' outputs on ``x``.

    PROBIT scores get an absolute tolerance of 5e-6: onnxruntime's ErfInv cancels
    near 0.5, so the 1-ulp errors of the C library's logf (about 1 input in 4000)
    reach a few 1e-6 there; everywhere else the results are equal to the bit.
    """
    lowered = lower_ml_ops(model)
    assert_lowered(lowered)
    expected = run(model, {"X": x})
    actual = run(lowered, {"X": x})
    probit = any(a.s == b"PROBIT" for n in model.graph.node for a in n.attribute)
    assert_same_outputs(actual, expected, atol=5e-6 if probit else 1e-30)
    return actual


@functools.cache
def _ort_applies_logistic_to_one_row_binary() -> bool:
    """Whether onnxruntime applies LOGISTIC to a one-row classifier with two labels (1.19 not)."""
    model = classifier([[1.0]], [0.0], post="LOGISTIC", ints=[0, 1])
    scores = run(model, {"X": np.array([[2.0]], np.float32)})["scores"]
    return bool(scores[0, 1] < 1.0)


def _attribute(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-z.astype(np.float64)))).astype(np.float32)


def _features(rng, n: int, f: int, dtype: str) -> np.ndarray:
    if dtype.startswith("int"):
        return rng.integers(-3, 4, size=(n, f)).astype(NP[dtype])
    return rng.normal(size=(n, f)).astype(NP[dtype])


def _weights(rng, rows: int, f: int, post: str) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients and intercepts; for PROBIT, scores mostly inside (0, 1)."""
    scale = 0.05 if post == "PROBIT" else 1.0
    coef = (rng.normal(size=(rows, f)) * scale).astype(np.float32)
    intercepts = rng.uniform(0.3, 0.7, size=rows) if post == "PROBIT" else rng.normal(size=rows)
    return coef, intercepts.astype(np.float32)


# -- scikit-learn models ------------------------------------------------------------------


def _sklearn_model(kind: str):
    """(fitted estimator, ONNX model from skl2onnx, float32 features)."""
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.datasets import make_classification, make_regression
    from sklearn.linear_model import (
        LinearRegression,
        LogisticRegression,
        RidgeClassifier,
        SGDRegressor,
    )
    from sklearn.svm import LinearSVC

    X1, y1 = make_regression(80, 5, n_targets=1, noise=0.1, random_state=0)
    X2, y2 = make_regression(80, 5, n_targets=2, noise=0.1, random_state=0)
    Xb, yb = make_classification(80, 5, n_classes=2, random_state=0)
    X3, y3 = make_classification(120, 5, n_informative=3, n_redundant=0, n_classes=3,
                                 random_state=0)
    cases = {
        "LinearRegression": (LinearRegression(), X1, y1),
        "LinearRegression_2_targets": (LinearRegression(), X2, y2),
        "SGDRegressor": (SGDRegressor(random_state=0), X1, y1),
        "LogisticRegression_binary": (LogisticRegression(), Xb, yb),
        "LogisticRegression_binary_strings": (LogisticRegression(), Xb,
                                              np.array(["no", "yes"])[yb]),
        "LogisticRegression_3_classes": (LogisticRegression(), X3, y3),
        "LogisticRegression_labels_7_3_5": (LogisticRegression(), X3, np.array([7, 3, 5])[y3]),
        "LinearSVC_binary": (LinearSVC(random_state=0), Xb, yb),
        "LinearSVC_3_classes": (LinearSVC(random_state=0), X3, y3),
        "RidgeClassifier_binary": (RidgeClassifier(), Xb, yb),
        "RidgeClassifier_3_classes": (RidgeClassifier(), X3, y3),
    }
    estimator, X, y = cases[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator.fit(X, y)
    options = {id(estimator): {"zipmap": False}} if kind.startswith("Logistic") else None
    model = to_onnx(estimator, X[:1].astype(np.float32), options=options,
                    target_opset={"": 18, "ai.onnx.ml": 3})
    return estimator, model, X.astype(np.float32)


SKLEARN_KINDS = ["LinearRegression", "LinearRegression_2_targets", "SGDRegressor",
                 "LogisticRegression_binary", "LogisticRegression_binary_strings",
                 "LogisticRegression_3_classes", "LogisticRegression_labels_7_3_5",
                 "LinearSVC_binary", "LinearSVC_3_classes", "RidgeClassifier_binary",
                 "RidgeClassifier_3_classes"]


@pytest.mark.parametrize("kind", SKLEARN_KINDS)
def test_lowered_skl2onnx_linear_model_matches_onnxruntime(kind):
    estimator, model, X = _sklearn_model(kind)
    outputs = check_against_onnxruntime(model, X)
    if hasattr(estimator, "classes_"):
        np.testing.assert_array_equal(outputs["label"], estimator.predict(X))
    if hasattr(estimator, "predict_proba") and "probabilities" in outputs:
        np.testing.assert_allclose(outputs["probabilities"], estimator.predict_proba(X),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["LinearRegression", "LogisticRegression_3_classes"])
def test_lowered_skl2onnx_model_runs_without_the_ml_domain(kind):
    _, model, X = _sklearn_model(kind)
    lowered = lower_ml_ops(model)
    assert {n.domain for n in lowered.graph.node} == {""}
    assert [(o.domain, o.version) for o in lowered.opset_import] == [("", 18)]
    assert lowered.ir_version == 10
    run(lowered, {"X": X})


@pytest.mark.parametrize(("kind", "weights"), [
    ("LinearRegression", ["coef", "intercept"]),
    ("LogisticRegression_3_classes", ["coef", "intercept"]),
])
def test_lowered_weights_are_trainable_float_initializers(kind, weights):
    estimator, model, _ = _sklearn_model(kind)
    lowered = lower_ml_ops(model)
    assert trainable_initializers(lowered) == weights
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}
    coef = np.atleast_2d(estimator.coef_)
    np.testing.assert_allclose(arrays["coef"], coef.astype(np.float32))
    assert arrays["coef"].dtype == np.float32 and arrays["intercept"].dtype == np.float32
    assert arrays["intercept"].shape == (coef.shape[0],)


def test_lowered_binary_logistic_regression_keeps_its_two_rows_tied():
    estimator, model, X = _sklearn_model("LogisticRegression_binary")
    node = model.graph.node[0]
    assert node.op_type == "LinearClassifier"
    assert _attribute(node, "post_transform") == b"LOGISTIC"
    lowered = lower_ml_ops(model)
    assert [n.op_type for n in lowered.graph.node] == [
        "Gemm", "Neg", "Concat", "ArgMax", "Gather", "Sigmoid"]
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}
    np.testing.assert_allclose(arrays["coef"], estimator.coef_.astype(np.float32))
    assert arrays["intercept"].shape == (1,)
    check_against_onnxruntime(model, X)


def test_other_ml_operators_are_kept():
    _, model, X = _sklearn_model("LinearSVC_binary")
    lowered = lower_ml_ops(model)
    kept = [n.op_type for n in lowered.graph.node if n.domain == "ai.onnx.ml"]
    assert kept == ["ArrayFeatureExtractor"]
    assert ("ai.onnx.ml", 1) in [(o.domain, o.version) for o in lowered.opset_import]
    check_against_onnxruntime(model, X)


def test_zipmap_is_kept_and_still_gets_the_probabilities():
    pytest.importorskip("skl2onnx")
    from skl2onnx import to_onnx
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(3)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    estimator = LogisticRegression().fit(X, (X[:, 0] + X[:, 1] > 0).astype(int))
    model = to_onnx(estimator, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
    lowered = lower_ml_ops(model)
    assert [n.op_type for n in lowered.graph.node if n.domain == "ai.onnx.ml"] == ["ZipMap"]
    expected, actual = run(model, {"X": X}), run(lowered, {"X": X})
    np.testing.assert_array_equal(actual["output_label"], expected["output_label"])
    for got, want in zip(actual["output_probability"], expected["output_probability"]):
        assert got.keys() == want.keys()
        np.testing.assert_allclose(list(got.values()), list(want.values()), rtol=1e-6)


def test_tree_ensemble_is_left_alone():
    tree = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["Y"], domain="ai.onnx.ml", n_targets=1,
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"], nodes_values=[0.0, 0.0, 0.0],
        nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
        target_treeids=[0, 0], target_nodeids=[1, 2], target_ids=[0, 0],
        target_weights=[-1.0, 1.0])
    graph = helper.make_graph([tree], "ml", [_input("float", [None, 2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])])
    model = models.model_of_graph(graph, opset=17, domains=ML)
    lowered = lower_ml_ops(model)
    assert lowered.graph.SerializeToString() == model.graph.SerializeToString()
    x = np.array([[-1.0, 0.0], [1.0, 0.0]], np.float32)
    np.testing.assert_array_equal(run(lowered, {"X": x})["Y"], [[-1.0], [1.0]])


# -- LinearClassifier ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float", "double", "int64", "int32"])
@pytest.mark.parametrize("post", TRANSFORMS)
@pytest.mark.parametrize("labels", ["ints", "strings"])
@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("multi_class", [None, 0, 1])
def test_lowered_multiclass_classifier_matches_onnxruntime(rng, dtype, post, labels,
                                                           rows, multi_class):
    coef, intercepts = _weights(rng, rows, 4, post)
    if dtype.startswith("int"):
        coef = coef / 4
    names = {"ints": {"ints": [9, -2, 4][:rows]},
             "strings": {"strings": ["cat", "dog", "eel"][:rows]}}[labels]
    model = classifier(coef, intercepts, post=post, dtype=dtype, multi_class=multi_class,
                       **names)
    check_against_onnxruntime(model, _features(rng, 50, 4, dtype))


@pytest.mark.parametrize("dtype", ["float", "double", "int64"])
@pytest.mark.parametrize("post", ["NONE", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("labels", [{"ints": [3, 7]}, {"strings": ["neg", "pos"]}])
def test_one_row_binary_classifier_scores_are_one_minus_score_and_score(rng, dtype,
                                                                        post, labels):
    coef, intercepts = _weights(rng, 1, 3, post)
    x = _features(rng, 40, 3, dtype)
    outputs = check_against_onnxruntime(
        classifier(coef, intercepts, post=post, dtype=dtype, **labels), x)
    z = (x.astype(np.float32) @ coef.T + intercepts).astype(np.float32)
    np.testing.assert_allclose(outputs["scores"], np.hstack([1 - z, z]), rtol=1e-5, atol=1e-6)
    names = np.array(labels.get("ints") or labels["strings"])
    np.testing.assert_array_equal(outputs["label"], names[(z[:, 0] > 0).astype(int)])


@pytest.mark.parametrize("labels", [{"ints": [0, 1]}, {"strings": ["no", "yes"]}])
def test_one_row_binary_logistic_classifier_applies_the_sigmoid(rng, labels):
    coef, intercepts = _weights(rng, 1, 3, "LOGISTIC")
    model = classifier(coef, intercepts, post="LOGISTIC", **labels)
    x = _features(rng, 40, 3, "float")
    if _ort_applies_logistic_to_one_row_binary():
        outputs = check_against_onnxruntime(model, x)
    else:  # onnxruntime 1.19 returns [1 - z, z]; newer versions and the ONNX spec do not
        outputs = run(lower_ml_ops(model), {"X": x})
        np.testing.assert_array_equal(outputs["label"], run(model, {"X": x})["label"])
    p = _sigmoid(x @ coef.T + intercepts)
    np.testing.assert_allclose(outputs["scores"], np.hstack([1 - p, p]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float", "double", "int32"])
@pytest.mark.parametrize("post", TRANSFORMS)
def test_one_row_classifier_without_labels_matches_onnxruntime(rng, dtype, post):
    coef, intercepts = _weights(rng, 1, 3, post)
    outputs = check_against_onnxruntime(classifier(coef, intercepts, post=post,
                                                               dtype=dtype),
                                        _features(rng, 40, 3, dtype))
    assert outputs["scores"].shape == (40, 1)
    assert set(np.unique(outputs["label"])) <= {0, 1}


def test_one_row_label_is_negative_at_a_score_of_exactly_zero():
    model = classifier([[1.0, -1.0]], [0.0], ints=[4, 8])
    x = np.array([[2.0, 2.0], [2.0, 1.0], [1.0, 2.0]], np.float32)
    outputs = check_against_onnxruntime(model, x)
    np.testing.assert_array_equal(outputs["label"], [4, 8, 4])


def test_unused_label_output_is_not_computed():
    model = classifier([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0], post="SOFTMAX", ints=[0, 1])
    del model.graph.output[0]  # only the scores are an output; the label is unused
    lowered = lower_ml_ops(model)
    assert [n.op_type for n in lowered.graph.node] == ["Gemm", "Softmax"]
    assert [t.name for t in lowered.graph.initializer] == ["coef", "intercept"]
    x = np.array([[1.0, -1.0], [0.5, 2.0]], np.float32)
    assert_same_outputs(run(lowered, {"X": x}), run(model, {"X": x}))


def test_tied_scores_give_the_first_class_like_onnxruntime():
    model = classifier([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [0.0, 0.0, 0.0], ints=[5, 6, 7])
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 2.0], [0.0, 0.0]], np.float32)
    outputs = check_against_onnxruntime(model, x)
    np.testing.assert_array_equal(outputs["label"], [5, 7, 5, 5, 5])


def test_label_comes_from_the_raw_scores_not_the_saturated_probabilities():
    # Sigmoid(40) and Sigmoid(50) are both 1.0 in float32: the label must still be class 1.
    model = classifier([[40.0], [50.0]], [0.0, 0.0], post="LOGISTIC", ints=[0, 1])
    outputs = check_against_onnxruntime(model, np.array([[1.0]], np.float32))
    np.testing.assert_array_equal(outputs["label"], [1])


def test_softmax_zero_leaves_zero_scores_out_like_onnxruntime():
    # Rows of zero coefficients give scores of exactly 0 or a tiny intercept.
    coef = [[0.0, 0.0], [1.0, 0.5], [0.0, 0.0], [-1.0, 2.0]]
    model = classifier(coef, [0.0, 0.1, 5e-8, -0.2], post="SOFTMAX_ZERO", ints=[0, 1, 2, 3])
    x = np.array([[0.0, 0.0], [1.0, 2.0], [-3.0, 1.0], [-100.0, -90.0], [0.5, -0.25]],
                 np.float32)
    check_against_onnxruntime(model, x)


def test_probit_reproduces_onnxruntimes_erfinv_approximation():
    model = classifier([[1.0], [-1.0]], [0.0, 1.0], post="PROBIT", ints=[0, 1])
    x = np.linspace(-0.2, 1.2, 14001, dtype=np.float32)[:, None]
    outputs = check_against_onnxruntime(model, x)
    expected = run(model, {"X": x})["scores"]
    inside = (x[:, 0] > 0) & (x[:, 0] < 1)
    assert np.isfinite(outputs["scores"][inside]).all()
    assert np.mean(outputs["scores"][inside] == expected[inside]) > 0.999  # bit-equal mostly


@pytest.mark.parametrize("rows", [1, 3])
def test_one_dimensional_input_is_a_single_row(rng, rows):
    coef, intercepts = _weights(rng, rows, 4, "NONE")
    model = classifier(coef, intercepts, ints=list(range(rows)) if rows > 1 else None,
                       shape=["F"])
    outputs = check_against_onnxruntime(model, rng.normal(size=4).astype(np.float32))
    assert outputs["label"].shape == (1,)


def test_input_of_unknown_rank_is_read_as_rows(rng):
    coef, intercepts = _weights(rng, 3, 4, "NONE")
    model = classifier(coef, intercepts, post="SOFTMAX", ints=[1, 2, 3])
    # X reaches the classifier through a Reshape to a runtime shape: its rank is unknown.
    model.graph.node[0].input[0] = "X_any"
    model.graph.node.insert(0, helper.make_node("Reshape", ["X", "shape"], ["X_any"]))
    model.graph.input.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [None]))
    lowered = lower_ml_ops(model)
    assert_lowered(lowered)
    assert "Reshape" in [n.op_type for n in lowered.graph.node[1:]]
    x = _features(rng, 7, 4, "float")
    for rows, shape in ((7, [7, 4]), (1, [4])):  # N rows, or one row given as a vector
        feeds = {"X": x[:rows], "shape": np.array(shape, np.int64)}
        assert_same_outputs(run(lowered, feeds), run(model, feeds))


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), features=st.integers(1, 6),
       post=st.sampled_from(["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"]),
       n=st.integers(1, 20))
def test_random_classifiers_match_onnxruntime(seed, rows, features, post, n):
    rng = np.random.default_rng(seed)
    coef, intercepts = _weights(rng, rows, features, post)
    labels = list(range(10, 10 + rows)) if rows > 1 else None
    model = classifier(coef * 3, intercepts, post=post, ints=labels)
    check_against_onnxruntime(model, _features(rng, n, features, "float"))


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
def test_prepacked_weights_change_single_rows_by_rounding_only(rng, post):
    # With default session options the lowered Gemm's constant weight is prepacked and a
    # one-row batch takes another MLAS kernel: raw scores may move by an ulp, and MLAS's
    # logistic (accurate to about 1e-7 absolute) turns that into up to 1e-5 relative.
    coef, intercepts = _weights(rng, 3, 8, post)
    model = classifier(coef * 3, intercepts, post=post, ints=[0, 1, 2])
    lowered = lower_ml_ops(model)
    for x in _features(rng, 50, 8, "float"):
        feeds = {"X": x[None, :]}
        expected = run(model, feeds, prepacking=True)
        actual = run(lowered, feeds, prepacking=True)
        np.testing.assert_allclose(actual["scores"], expected["scores"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(actual["label"], expected["label"])


# -- LinearRegressor --------------------------------------------------------------------------


@pytest.mark.parametrize("post", TRANSFORMS)
@pytest.mark.parametrize("targets", [1, 3])
@pytest.mark.parametrize("with_intercepts", [True, False])
def test_lowered_regressor_matches_onnxruntime(rng, post, targets, with_intercepts):
    coef, intercepts = _weights(rng, targets, 5, post)
    model = regressor(coef, intercepts if with_intercepts else None, post=post,
                      targets=None if targets == 1 else targets)
    outputs = check_against_onnxruntime(model, _features(rng, 30, 5, "float"))
    assert outputs["Y"].shape == (30, targets)


@pytest.mark.parametrize("post", ["LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_single_target_regressor_ignores_all_transforms_but_probit(rng, post):
    coef, intercepts = _weights(rng, 1, 3, post)
    x = _features(rng, 20, 3, "float")
    outputs = check_against_onnxruntime(regressor(coef, intercepts, post=post), x)
    np.testing.assert_allclose(outputs["Y"], x @ coef.T + intercepts, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["double", "int64", "int32"])
@pytest.mark.parametrize("post", ["NONE", "SOFTMAX"])
def test_regressor_casts_other_inputs_to_float_first(rng, dtype, post):
    # onnxruntime has no LinearRegressor kernel but for float: the reference is the float
    # model run on the input cast to float, which is what the ONNX specification says.
    coef, intercepts = _weights(rng, 2, 3, post)
    x = _features(rng, 25, 3, dtype)
    lowered = lower_ml_ops(regressor(coef, intercepts, post=post, targets=2, dtype=dtype))
    assert_lowered(lowered)
    assert lowered.graph.node[0].op_type == "Cast"
    expected = run(regressor(coef, intercepts, post=post, targets=2),
                         {"X": x.astype(np.float32)})
    assert_same_outputs(run(lowered, {"X": x}), expected)


def test_regressor_on_a_one_dimensional_input_gives_one_row(rng):
    coef, intercepts = _weights(rng, 2, 3, "NONE")
    model = regressor(coef, intercepts, targets=2, shape=[3])
    outputs = check_against_onnxruntime(model, rng.normal(size=3).astype(np.float32))
    assert outputs["Y"].shape == (1, 2)


def test_single_regressor_is_one_gemm_on_float_input():
    lowered = lower_ml_ops(regressor([[1.0, 2.0]], [0.5]))
    assert [(n.op_type, list(n.input), list(n.output)) for n in lowered.graph.node] == [
        ("Gemm", ["X", "coef", "intercept"], ["Y"])]
    assert _attribute(lowered.graph.node[0], "transB") == 1


# -- Normalizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
@pytest.mark.parametrize("dtype", ["float", "double", "int64", "int32"])
@pytest.mark.parametrize("shape", [(None, 4), (4,)])
def test_lowered_normalizer_matches_onnxruntime(rng, norm, dtype, shape):
    if len(shape) == 1:
        x = _features(rng, 1, 4, dtype)[0]
    else:
        x = _features(rng, 12, 4, dtype)
        x[0] = 0  # a zero row passes through unchanged
        x[1] = -np.abs(x[1]) - 1  # a negative maximum
    check_against_onnxruntime(normalizer(norm, dtype, shape), x)


# -- pass contract ------------------------------------------------------------------------------


def _two_regressors() -> onnx.ModelProto:
    first = helper.make_node("LinearRegressor", ["X"], ["Y1"], domain="ai.onnx.ml",
                             coefficients=[1.0, 2.0], intercepts=[0.5])
    second = helper.make_node("LinearRegressor", ["X"], ["Y2"], domain="ai.onnx.ml",
                              coefficients=[1.0, 2.0, 3.0, 4.0], intercepts=[1.0, 2.0], targets=2)
    taken = helper.make_node("Identity", ["X"], ["coef"])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, k])
               for n, k in (("Y1", 1), ("Y2", 2), ("coef", 2))]
    graph = helper.make_graph([first, taken, second], "ml", [_input("float", [None, 2])], outputs)
    return models.model_of_graph(graph, opset=17, domains=ML)


def test_several_linear_nodes_get_deterministic_suffixed_weight_names(rng):
    model = _two_regressors()
    lowered = lower_ml_ops(model)
    assert [t.name for t in lowered.graph.initializer] == [
        "coef_1", "intercept", "coef_2", "intercept_1"]
    assert [n.op_type for n in lowered.graph.node] == ["Gemm", "Identity", "Gemm"]
    check_against_onnxruntime(model, _features(rng, 6, 2, "float"))


def test_serialized_model_lowers_like_the_model():
    model = _two_regressors()
    assert (lower_ml_ops(model.SerializeToString()).SerializeToString()
            == lower_ml_ops(model).SerializeToString())


def test_model_without_ml_ops_is_returned_unchanged_as_a_copy():
    model = models.model("(float[N, 2] x) => (float[N, 2] y)", "y = Relu(x)", opset=17)
    lowered = lower_ml_ops(model)
    assert lowered is not model
    assert lowered.graph.SerializeToString() == model.graph.SerializeToString()


def test_score_path_uses_only_differentiable_standard_ops():
    for post in TRANSFORMS:
        lowered = lower_ml_ops(classifier([[1.0, 2.0], [3.0, 4.0]], [0.1, 0.2], post=post,
                                          ints=[0, 1]))
        producers = {o: n for n in lowered.graph.node for o in n.output}
        stack, seen = ["scores"], set()
        while stack:
            node = producers.get(stack.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            assert node.op_type in DIFFERENTIABLE, (post, node.op_type)
            if node.op_type in {"Cast"}:
                continue  # a mask (Cast of a comparison): not on the gradient path
            stack.extend(node.input)


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_lowered_scores_are_differentiated_by_lossgraphs_gradient_pass(rng, post):
    from lossgraph.passes.gradient import gradient

    coef, intercepts = _weights(rng, 3, 4, post)
    lowered = lower_ml_ops(classifier(coef, intercepts, post=post, ints=[0, 1, 2]))
    grads = gradient(lowered, weights=["coef"], outputs=["scores"])
    assert {n.domain for n in grads.graph.node} == {""}
    x = _features(rng, 5, 4, "float")
    seed = rng.normal(size=(5, 3)).astype(np.float32)
    seed_name = next(i.name for i in grads.graph.input if i.name.startswith("scores_grad"))
    got = run(grads, {"X": x, seed_name: seed})["coef_grad"]

    def weighted_scores(c: np.ndarray) -> float:
        model = onnx.ModelProto()
        model.CopyFrom(lowered)
        weight = next(t for t in model.graph.initializer if t.name == "coef")
        weight.CopyFrom(onnx.numpy_helper.from_array(c.astype(np.float32), "coef"))
        return float((run(model, {"X": x})["scores"].astype(np.float64) * seed).sum())

    eps, expected = 1e-2, np.zeros(coef.shape)
    for index in np.ndindex(*coef.shape):
        step = np.zeros(coef.shape)
        step[index] = eps
        expected[index] = (weighted_scores(coef + step) - weighted_scores(coef - step)) / (2 * eps)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


def test_probit_with_an_added_second_class_is_rejected_clearly():
    with pytest.raises(UnsupportedModelError, match="linear_classifier.*PROBIT.*uninitialized"):
        lower_ml_ops(classifier([[1.0]], [0.0], post="PROBIT", ints=[0, 1]))


@pytest.mark.parametrize(("model", "error", "message"), [
    (classifier([[1.0, 2.0]], None, ints=[0, 1]), UnsupportedModelError,
     "linear_classifier.*no 'intercepts'.*intercepts="),
    (classifier([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0], ints=[1]), InvalidModelError,
     "2 classes.*only 1 class labels"),
    (classifier([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0]), InvalidModelError,
     "neither 'classlabels_ints' nor 'classlabels_strings'"),
    (classifier([[1.0, 2.0]], [0.0], ints=[1, 2, 3]), InvalidModelError,
     "one row.*3 class labels.*exactly 2"),
    (classifier([[1.0, 2.0]], [0.0], post="SIGMOID"), InvalidModelError,
     "post_transform='SIGMOID'.*'LOGISTIC'"),
    (classifier([1.0, 2.0, 3.0], [0.0, 0.0], ints=[0, 1], shape=[None, 2]), InvalidModelError,
     "3 coefficients.*2 classes"),
    (classifier([[1.0, 2.0]], [0.0], shape=[None, 3]), InvalidModelError,
     "2 features.*'X' has 3 features"),
    (classifier([[1.0, 2.0]], [0.0], shape=[None, 5, 2]), InvalidModelError,
     "1D or 2D"),
    (regressor([[1.0, 2.0]], [0.0], shape=[None, 5, 2]), UnsupportedModelError,
     "linear_regressor.*'X' of rank 3.*rank 1 or 2"),
    (regressor([[1.0, 2.0]], [0.0, 1.0]), InvalidModelError,
     "linear_regressor.*2 intercepts for targets=1"),
    (regressor([1.0, 2.0, 3.0], targets=2, shape=[None, 2]), InvalidModelError,
     "3 coefficients.*2 targets"),
    (normalizer("L3"), InvalidModelError, "norm='L3'"),
    (normalizer("L2", shape=(2, 3, 4)), UnsupportedModelError, "Normalizer.*rank 3"),
])
def test_bad_ml_nodes_raise_errors_naming_node_and_fix(model, error, message):
    with pytest.raises(error, match=message):
        lower_ml_ops(model)


def test_both_kinds_of_class_labels_are_rejected():
    model = classifier([[1.0], [2.0]], [0.0, 0.0], ints=[0, 1], strings=["a", "b"])
    with pytest.raises(InvalidModelError, match="classlabels"):
        lower_ml_ops(model)


def test_linear_node_inside_a_subgraph_is_rejected():
    inner = classifier([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0], ints=[0, 1]).graph
    inner.ClearField("input")
    cond = helper.make_node("If", ["c"], ["label", "scores"], then_branch=inner,
                            else_branch=inner, name="choose")
    graph = helper.make_graph(
        [cond], "ml",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []), _input("float", [None, 2])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, None])])
    model = models.model_of_graph(graph, opset=17, domains=ML)
    with pytest.raises(UnsupportedModelError, match="subgraph.*main graph only"):
        lower_ml_ops(model)
