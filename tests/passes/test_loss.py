"""add_loss_output: values against scikit-learn, structure, options and errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, mean_absolute_error, mean_squared_error

from lossgraph import add_loss_output, get_roles
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidModelError,
    LossgraphError,
    NameCollisionError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
)

DTYPES = {"float": np.float32, "double": np.float64}


def identity_model(shape: str = "N, 2", dtype: str = "float", opset: int = 18,
                   extra: str = "") -> onnx.ModelProto:
    """A model whose output ``y`` is its input ``x`` (plus a trainable ``coef`` if asked)."""
    text = f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        identity ({dtype}[{shape}] x) => ({dtype}[{shape}] y)
        <{dtype}[2] coef = {{1.0, -2.0}}, int64[1] shape_like = {{2}}>
        {{
            y = Identity(x)
            {extra}
        }}
    """
    return onnx.parser.parse_model(text)


def loss_of(run_model, model: onnx.ModelProto, **feeds: np.ndarray) -> float:
    outputs = run_model(model, feeds)
    return float(outputs[get_roles(model)["loss"]])


@pytest.fixture
def regression_data(rng):
    def make(n: int, k: int, dtype=np.float32):
        shape = (n,) if k == 0 else (n, k)
        return (rng.normal(size=shape).astype(dtype), rng.normal(size=shape).astype(dtype),
                rng.uniform(0.1, 2.0, size=n).astype(dtype))
    return make


# -- values -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float", "double"])
@pytest.mark.parametrize("columns", [0, 1, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("score", "metric"), [
    ("squared_error", mean_squared_error), ("l2", mean_squared_error),
    ("absolute_error", mean_absolute_error), ("l1", mean_absolute_error),
])
def test_regression_loss_equals_scikit_learn(run_model, regression_data, dtype, columns,
                                             weighted, score, metric):
    shape = "N" if columns == 0 else f"N, {columns}"
    p, y, w = regression_data(40, columns, DTYPES[dtype])
    model = add_loss_output(identity_model(shape, dtype), score,
                            weight_name="w" if weighted else None)
    feeds = {"x": p, "label": y, **({"w": w} if weighted else {})}
    expected = metric(y, p, sample_weight=w if weighted else None)
    rtol = 1e-5 if dtype == "float" else 1e-12
    np.testing.assert_allclose(loss_of(run_model, model, **feeds), expected, rtol=rtol)


@pytest.mark.parametrize("weighted", [False, True])
def test_sum_reduction_is_the_weighted_sum_of_row_losses(run_model, regression_data, weighted):
    p, y, w = regression_data(30, 2)
    model = add_loss_output(identity_model(), "squared_error", reduction="sum",
                            weight_name="w" if weighted else None)
    row = ((p - y) ** 2).mean(axis=1)
    expected = (row * w).sum() if weighted else row.sum()
    feeds = {"x": p, "label": y, **({"w": w} if weighted else {})}
    np.testing.assert_allclose(loss_of(run_model, model, **feeds), expected, rtol=1e-5)


def test_elastic_loss_mixes_l1_and_l2(run_model, regression_data):
    p, y, _ = regression_data(25, 1)
    model = add_loss_output(identity_model("N, 1"), "elastic", l1_weight=0.1, l2_weight=0.9)
    expected = 0.1 * mean_absolute_error(y, p) + 0.9 * mean_squared_error(y, p)
    np.testing.assert_allclose(loss_of(run_model, model, x=p, label=y), expected, rtol=1e-5)


@pytest.mark.parametrize("delta", [0.3, 1.0, 5.0])
def test_huber_loss_equals_its_definition(run_model, regression_data, delta):
    p, y, _ = regression_data(50, 2, np.float64)
    model = add_loss_output(identity_model("N, 2", "double"), "huber", delta=delta)
    d = np.abs(p - y)
    expected = np.where(d <= delta, 0.5 * d**2, delta * (d - 0.5 * delta)).mean()
    np.testing.assert_allclose(loss_of(run_model, model, x=p, label=y), expected, rtol=1e-12)


@pytest.mark.torch
def test_huber_loss_equals_torch(run_model, regression_data):
    import torch

    p, y, _ = regression_data(50, 2, np.float64)
    model = add_loss_output(identity_model("N, 2", "double"), "huber", delta=0.7)
    expected = torch.nn.functional.huber_loss(torch.tensor(p), torch.tensor(y), delta=0.7)
    np.testing.assert_allclose(loss_of(run_model, model, x=p, label=y), expected.item(),
                               rtol=1e-12)


def _probabilities(rng, n: int, classes: int, dtype) -> np.ndarray:
    logits = rng.normal(size=(n, classes)) * 2
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return p.astype(dtype)


@pytest.mark.parametrize("dtype", ["float", "double"])
@pytest.mark.parametrize("layout", ["N", "N, 1", "N, 2"])
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_log_loss_equals_scikit_learn(run_model, rng, dtype, layout, weighted):
    np_dtype = DTYPES[dtype]
    p2 = _probabilities(rng, 60, 2, np_dtype)
    p = {"N": p2[:, 1], "N, 1": p2[:, 1:], "N, 2": p2}[layout]
    y = rng.integers(0, 2, size=60)
    w = rng.uniform(0.5, 2, size=60).astype(np_dtype)
    model = add_loss_output(identity_model(layout, dtype), "binary_log_loss",
                            weight_name="w" if weighted else None)
    feeds = {"x": p, "label": y, **({"w": w} if weighted else {})}
    expected = log_loss(y, p2[:, 1], sample_weight=w if weighted else None)
    rtol = 1e-5 if dtype == "float" else 1e-10
    np.testing.assert_allclose(loss_of(run_model, model, **feeds), expected, rtol=rtol)


def test_log_loss_clips_probabilities_with_eps(run_model):
    p = np.array([0.0, 1.0, 0.5], dtype=np.float64)
    y = np.array([1, 0, 1])
    model = add_loss_output(identity_model("N", "double"), "binary_log_loss", eps=1e-6)
    expected = -(np.log(1e-6) + np.log(1e-6) + np.log(0.5)) / 3
    np.testing.assert_allclose(loss_of(run_model, model, x=p, label=y), expected, rtol=1e-9)


@pytest.mark.parametrize("weighted", [False, True])
def test_logistic_loss_on_raw_scores_equals_log_loss_of_the_sigmoid(run_model, rng, weighted):
    s = rng.normal(size=(80, 1)) * 3
    y = rng.integers(0, 2, size=80)
    w = rng.uniform(0.5, 2, size=80)
    model = add_loss_output(identity_model("N, 1", "double"), "logistic",
                            weight_name="w" if weighted else None)
    feeds = {"x": s, "label": y, **({"w": w} if weighted else {})}
    expected = log_loss(y, 1 / (1 + np.exp(-s[:, 0])), sample_weight=w if weighted else None)
    np.testing.assert_allclose(loss_of(run_model, model, **feeds), expected, rtol=1e-10)


def test_logistic_loss_is_stable_for_huge_scores(run_model):
    s = np.array([1e4, -1e4, 1e4], dtype=np.float32)
    y = np.array([1, 0, 0])
    model = add_loss_output(identity_model("N"), "logistic")
    np.testing.assert_allclose(loss_of(run_model, model, x=s, label=y), 1e4 / 3, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float", "double"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_equals_scikit_learn(run_model, rng, dtype, weighted):
    np_dtype = DTYPES[dtype]
    p = _probabilities(rng, 70, 4, np_dtype)
    y = rng.integers(0, 4, size=70)
    w = rng.uniform(0.5, 2, size=70).astype(np_dtype)
    model = add_loss_output(identity_model("N, 4", dtype), "multiclass_log_loss",
                            weight_name="w" if weighted else None)
    feeds = {"x": p, "label": y, **({"w": w} if weighted else {})}
    expected = log_loss(y, p, sample_weight=w if weighted else None, labels=range(4))
    rtol = 1e-5 if dtype == "float" else 1e-10
    np.testing.assert_allclose(loss_of(run_model, model, **feeds), expected, rtol=rtol)


def test_cross_entropy_from_logits_uses_a_stable_log_softmax(run_model, rng):
    z = rng.normal(size=(30, 3)) * 50
    y = rng.integers(0, 3, size=30)
    model = add_loss_output(identity_model("N, 3", "double"), "multiclass_log_loss",
                            from_logits=True)
    shifted = z - z.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected = -log_softmax[np.arange(30), y].mean()
    np.testing.assert_allclose(loss_of(run_model, model, x=z, label=y), expected, rtol=1e-10)


def test_penalty_adds_l1_and_l2_of_the_named_initializers(run_model, regression_data):
    p, y, _ = regression_data(20, 2)
    base = identity_model()
    plain = loss_of(run_model, add_loss_output(base), x=p, label=y)
    l2_only = loss_of(run_model, add_loss_output(base, penalty={"coef": 0.5}), x=p, label=y)
    both = loss_of(run_model, add_loss_output(base, penalty={"coef": {"l1": 0.1, "l2": 0.2}}),
                   x=p, label=y)
    coef = np.array([1.0, -2.0])
    np.testing.assert_allclose(l2_only - plain, 0.5 * (coef**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(both - plain, 0.1 * np.abs(coef).sum() + 0.2 * (coef**2).sum(),
                               rtol=1e-5)


# -- structure ------------------------------------------------------------------------


def test_loss_is_the_first_output_and_label_then_weight_the_last_inputs():
    model = add_loss_output(identity_model(), weight_name="w")
    assert [i.name for i in model.graph.input] == ["x", "label", "w"]
    assert [o.name for o in model.graph.output] == ["loss", "y"]
    loss = model.graph.output[0].type.tensor_type
    assert loss.elem_type == onnx.TensorProto.FLOAT and len(loss.shape.dim) == 0
    assert get_roles(model) == {"loss": "loss", "label": "label", "sample_weight": "w",
                               "prediction": "y"}


def test_regression_label_has_the_prediction_type_and_class_label_is_int64_rows():
    regression = add_loss_output(identity_model("N, 3", "double"))
    label = regression.graph.input[1].type.tensor_type
    assert label.elem_type == onnx.TensorProto.DOUBLE
    assert [d.dim_param or d.dim_value for d in label.shape.dim] == ["N", 3]
    classifier = add_loss_output(identity_model("N, 3"), "multiclass_log_loss")
    label = classifier.graph.input[1].type.tensor_type
    assert label.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in label.shape.dim] == ["N"]


def test_sample_weights_are_applied_per_row_never_broadcast_to_n_by_n():
    model = add_loss_output(identity_model("N, 1"), weight_name="w")
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for value in inferred.graph.value_info:
        dims = value.type.tensor_type.shape.dim
        assert len(dims) <= 2
        assert not (len(dims) == 2 and dims[1].dim_param == "N")


def test_taken_label_name_is_replaced_by_a_free_one_and_recorded_in_roles():
    model = identity_model(extra="label = Identity(x)")
    model.graph.output.append(onnx.helper.make_tensor_value_info("label", 1, ["N", 2]))
    result = add_loss_output(model, output_index="y")
    assert get_roles(result)["label"] == "label_1"
    assert "label_1" in [i.name for i in result.graph.input]


def test_explicit_label_name_that_collides_is_an_error():
    with pytest.raises(NameCollisionError, match="'x'"):
        add_loss_output(identity_model(), label_name="x")


def test_output_index_by_position_and_name_pick_the_same_output(run_model, regression_data):
    model = identity_model(extra="z = Neg(x)")
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", 1, ["N", 2]))
    by_name = add_loss_output(model, output_index="z")
    by_position = add_loss_output(model, output_index=1)
    assert by_name.SerializeToString() == by_position.SerializeToString()
    p, y, _ = regression_data(10, 2)
    np.testing.assert_allclose(loss_of(run_model, by_name, x=p, label=y),
                               mean_squared_error(y, -p), rtol=1e-5)


def test_opset_13_models_get_attribute_style_reductions(run_model, regression_data):
    model = add_loss_output(identity_model(opset=13), weight_name="w")
    assert any(a.name == "axes" for n in model.graph.node if n.op_type == "ReduceMean"
               for a in n.attribute)
    p, y, w = regression_data(10, 2)
    np.testing.assert_allclose(loss_of(run_model, model, x=p, label=y, w=w),
                               mean_squared_error(y, p, sample_weight=w), rtol=1e-5)


def test_emitted_model_has_ir_10_and_one_opset_per_domain():
    model = identity_model()
    model.opset_import.append(onnx.helper.make_opsetid("", 18))
    result = add_loss_output(model)
    assert result.ir_version == 10
    assert [(o.domain, o.version) for o in result.opset_import] == [("", 18)]


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"score_name": "squared"}, UnsupportedOptionError, "squared_error"),
    ({"score_name": "squared_error", "delta": 1.0}, UnsupportedOptionError, "delta"),
    ({"score_name": "huber", "delta": -1.0}, UnsupportedOptionError, "delta"),
    ({"score_name": "huber", "delta": 0.0}, UnsupportedOptionError, "delta"),
    ({"score_name": "elastic", "l1_weight": float("nan")}, UnsupportedOptionError, "l1_weight"),
    ({"reduction": "median"}, UnsupportedOptionError, "median"),
    ({"output_index": "yy"}, UnknownNameError, "Did you mean 'y'"),
    ({"output_index": 3}, UnknownNameError, "out of range"),
    ({"penalty": {"coeff": 0.1}}, UnknownNameError, "Did you mean 'coef'"),
    ({"penalty": {"coef": -0.1}}, UnsupportedOptionError, "l2=-0.1"),
    ({"penalty": {"coef": {"l1": -1}}}, UnsupportedOptionError, "l1=-1"),
    ({"penalty": {"coef": {"l3": 1}}}, UnsupportedOptionError, "'l3'"),
    ({"penalty": {"shape_like": 0.1}}, DTypeMismatchError, "int64"),
    ({"loss": "binary_log_loss"}, ShapeMismatchError, "multiclass_log_loss"),
    ({"score_name": "logistic"}, ShapeMismatchError, "from_logits"),
])
def test_bad_options_raise_clear_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        add_loss_output(identity_model("N, 3"), **kwargs)


def test_non_float_output_is_a_dtype_error():
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (int64[N] y) { y = ArgMax <axis = 1, keepdims = 0> (x) }
    """)
    with pytest.raises(DTypeMismatchError, match="'y' is int64"):
        add_loss_output(model)


def test_several_float_outputs_need_an_output_index():
    model = identity_model(extra="z = Neg(x)")
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", 1, ["N", 2]))
    with pytest.raises(UnsupportedOptionError, match="output_index"):
        add_loss_output(model)


def test_model_that_fails_the_checker_is_rejected():
    model = identity_model()
    model.graph.node[0].input[0] = "missing"
    with pytest.raises(InvalidModelError, match="not a valid ONNX model"):
        add_loss_output(model)


def test_garbage_bytes_are_rejected():
    with pytest.raises(InvalidModelError):
        add_loss_output(b"not a model")


def test_model_with_a_loss_already_is_rejected():
    with pytest.raises(UnsupportedModelError, match="already has a loss"):
        add_loss_output(add_loss_output(identity_model()))


def test_every_error_is_a_lossgraph_error():
    with pytest.raises(LossgraphError):
        add_loss_output(identity_model(), loss="nope")


# -- properties -------------------------------------------------------------------------


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # run_model is stateless
@given(
    score=st.sampled_from(["squared_error", "absolute_error", "elastic", "huber"]),
    dtype=st.sampled_from(["float", "double"]),
    columns=st.integers(0, 4),
    weighted=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    penalty=st.one_of(st.none(), st.floats(0, 10)),
)
def test_loss_equals_the_numpy_formula(run_model, score, dtype, columns, weighted, reduction,
                                       penalty):
    shape = "N" if columns == 0 else f"N, {columns}"
    with_loss = add_loss_output(identity_model(shape, dtype), score,
                                weight_name="w" if weighted else None, reduction=reduction,
                                penalty=None if penalty is None else {"coef": penalty})

    rng = np.random.default_rng(columns)
    np_dtype = DTYPES[dtype]
    size = (7,) if columns == 0 else (7, columns)
    p, y = rng.normal(size=size).astype(np_dtype), rng.normal(size=size).astype(np_dtype)
    w = rng.uniform(0.1, 2, size=7).astype(np_dtype) if weighted else np.ones(7, np_dtype)
    d = (p - y).astype(np.float64)
    element = {"squared_error": d**2, "absolute_error": np.abs(d),
               "elastic": 0.5 * np.abs(d) + 0.5 * d**2,
               "huber": np.where(np.abs(d) <= 1, 0.5 * d**2, np.abs(d) - 0.5)}[score]
    row = element if columns == 0 else element.mean(axis=1)
    total = (row * w).sum() / (w.sum() if reduction == "mean" else 1)
    total += 0 if penalty is None else penalty * 5.0
    feeds = {"x": p, "label": y, **({"w": w} if weighted else {})}
    np.testing.assert_allclose(loss_of(run_model, with_loss, **feeds), total,
                               rtol=1e-4 if dtype == "float" else 1e-10, atol=1e-6)


# -- half_squared_error, reduction="none", RemoveLossOutput ------------------------------------


def test_half_squared_error_is_half_the_squared_error(run_model):
    p = np.array([[1.0, 3.0], [0.0, -2.0]], np.float32)
    y = np.array([[0.0, 1.0], [1.0, 1.0]], np.float32)
    full = run_model(add_loss_output(identity_model(), "squared_error"),
                     {"x": p, "label": y})["loss"]
    half = run_model(add_loss_output(identity_model(), "half_squared_error"), {"x": p, "label": y})
    assert half["loss"] == pytest.approx(0.5 * full) == pytest.approx(0.5 * np.mean((p - y) ** 2))


def test_reduction_none_gives_the_weighted_loss_of_each_row(run_model):
    p = np.array([[1.0, 3.0], [0.0, -2.0], [2.0, 2.0]], np.float32)
    y = np.zeros((3, 2), np.float32)
    w = np.array([1.0, 0.5, 2.0], np.float32)
    model = add_loss_output(identity_model(), "absolute_error", weight_name="w", reduction="none")
    assert [d.dim_param for d in model.graph.output[0].type.tensor_type.shape.dim] == ["N"]
    rows = run_model(model, {"x": p, "label": y, "w": w})["loss"]
    np.testing.assert_allclose(rows, w * np.abs(p - y).mean(axis=1))
    with pytest.raises(UnsupportedOptionError, match="penalty"):
        add_loss_output(identity_model(), reduction="none", penalty={"coef": 0.1})


def test_remove_loss_output_gives_back_the_inference_model(run_model):
    from lossgraph.passes import RemoveLossOutput

    original = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        m (float[N, 2] x) => (float[N, 2] y)
        <float[2] coef = {1.0, -2.0}>
        { y = Mul(x, coef) }""")
    loss_model = add_loss_output(original, "elastic", weight_name="w", penalty={"coef": 0.5})
    back = RemoveLossOutput()(loss_model).model
    assert [i.name for i in back.graph.input] == ["x"]
    assert [o.name for o in back.graph.output] == ["y"]
    assert get_roles(back) == {}
    assert [n.op_type for n in back.graph.node] == ["Mul"]
    x = np.array([[1.0, 2.0]], np.float32)
    expected = run_model(original, {"x": x})["y"]
    np.testing.assert_array_equal(run_model(back, {"x": x})["y"], expected)
    assert RemoveLossOutput()(original).changed is False


def test_logistic_loss_gradient_at_a_zero_score_is_sigmoid_of_zero_minus_y(run_model):
    """A zero-initialized model starts with every raw score at 0: the derivative there is
    0.5 - y (Relu's and Abs's derivatives at 0 are 0, which gave -y)."""
    from lossgraph import gradient

    model = gradient(add_loss_output(identity_model("N"), "logistic", reduction="sum"),
                     weights=["x"])
    outputs = run_model(model, {"x": np.zeros(4, np.float32),
                                "label": np.array([0, 1, 1, 0], np.int64)})
    np.testing.assert_allclose(outputs["x_grad"], [0.5, -0.5, -0.5, 0.5])
