"""add_loss_output (lossgraph/passes/loss.py): values against scikit-learn, structure, options
and errors; the token-level cross entropy (multiclass_log_loss over a sequence's positions,
with ignore_index) against torch's F.cross_entropy, in training, in the Trainer's label
check, on the command line and data-parallel; label smoothing, class weights and pos_weight
against torch's CrossEntropyLoss and BCEWithLogitsLoss.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, mean_absolute_error, mean_squared_error
from support.environment import GOLDEN_MODELS
from support.gradcheck import check_gradients, cotangent
from support.linear import LINEAR, linear_data

import lossgraph
from lossgraph import add_loss_output, get_roles
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidDataError,
    InvalidModelError,
    InvalidProgramError,
    LossgraphError,
    NameCollisionError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.metadata import LOSS_KEY, read_json
from lossgraph.optim import AdamW
from lossgraph.passes import RemoveLossOutput
from lossgraph.passes.loss import read_loss_record

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


# ==========================================================================================
# The token-level cross entropy: multiclass_log_loss of an (N, d1, ..., C) prediction (classes
# on the last axis) against int64 labels (N, d1, ...), with ignore_index. The reference is
# torch's F.cross_entropy(z.view(-1, C), y.view(-1), ignore_index=k): the mean over the
# positions whose label is not k; per-row sample weights weigh each row's positions
# (sum_i w_i sum_t l_it / sum_i w_i c_i, c_i the row's counted positions). sum and none keep
# lossgraph's per-row losses, the mean over each row's positions.
# ==========================================================================================

IGNORE = -100  # torch's and transformers' ignore_index


ROWS, LENGTH, FEATURES, CLASSES = 6, 5, 3, 4


def token_model(dtype: str = "float", weights_as_inputs: bool = False,
                classes: int = CLASSES) -> onnx.ModelProto:
    """``logits = x @ W + b``: a class score at each position of ``x`` ``(N, T, F)``."""
    rng = np.random.default_rng(3)
    W = rng.normal(size=(FEATURES, classes)).round(3)
    b = rng.normal(size=classes).round(3)
    values = lambda a: ", ".join(map(str, a.ravel()))  # noqa: E731
    params = (f", {dtype}[{FEATURES}, {classes}] W, {dtype}[{classes}] b" if weights_as_inputs
              else "")
    initializers = ("" if weights_as_inputs else
                    f"<{dtype}[{FEATURES}, {classes}] W = {{{values(W)}}}, "
                    f"{dtype}[{classes}] b = {{{values(b)}}}>")
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        tokens ({dtype}[N, T, {FEATURES}] x{params}) => ({dtype}[N, T, {classes}] logits)
        {initializers}
        {{
            scores = MatMul(x, W)
            logits = Add(scores, b)
        }}""")


def token_identity(shape: str, dtype: str = "double") -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        identity ({dtype}[{shape}] x) => ({dtype}[{shape}] y) {{ y = Identity(x) }}""")


def token_labels(rng: np.random.Generator, shape: tuple[int, ...], classes: int = CLASSES,
           ignored: float = 0.3) -> np.ndarray:
    """Class labels with about ``ignored`` of them ``IGNORE``; every row keeps one."""
    y = rng.integers(0, classes, size=shape)
    y[rng.uniform(size=shape) < ignored] = IGNORE
    y.reshape(len(y), -1)[:, 0] = rng.integers(0, classes, size=len(y))
    return y


def token_reference(z: np.ndarray, y: np.ndarray, w: np.ndarray | None, reduction: str,
              from_logits: bool = True, ignore_index: int | None = IGNORE) -> np.ndarray:
    """The documented formula in float64: per-position losses ``l`` (0 where ignored), the
    per-row loss the mean over positions, the mean over counted positions."""
    log_p = (z - z.max(-1, keepdims=True)) if from_logits else np.log(z)
    if from_logits:
        log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    counted = np.ones(y.shape) if ignore_index is None else (y != ignore_index).astype(float)
    safe = np.where(counted > 0, y, 0)
    l = -np.take_along_axis(log_p, safe[..., None], -1)[..., 0] * counted  # noqa: E741
    w = np.ones(len(y)) if w is None else w
    axes = tuple(range(1, y.ndim))
    rows = w * l.mean(axis=axes)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (w * counted.mean(axis=axes)).sum()


def token_loss(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    from lossgraph.runtime.session import create_session

    return create_session(model).run([get_roles(model)["loss"]], feeds)[0]


# -- token loss: values --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(ROWS, LENGTH), (ROWS, 3, 2)])
@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_equals_the_documented_formula(rng, shape, from_logits, weighted, reduction):
    dims = ", ".join(["N", *(f"d{i}" for i in range(1, len(shape))), str(CLASSES)])
    z = rng.normal(size=(*shape, CLASSES)) * 3
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    y = token_labels(rng, shape)
    w = rng.uniform(0.2, 2, size=ROWS)
    model = add_loss_output(token_identity(dims), "multiclass_log_loss", from_logits=from_logits,
                            ignore_index=IGNORE, reduction=reduction,
                            weight_name="w" if weighted else None)
    feeds = {"x": z if from_logits else p, "label": y, **({"w": w} if weighted else {})}
    expected = token_reference(z if from_logits else p, y, w if weighted else None, reduction,
                         from_logits)
    np.testing.assert_allclose(token_loss(model, **feeds), expected, rtol=1e-12)


@pytest.mark.torch
def test_mean_is_torchs_cross_entropy_over_the_flattened_positions(rng):
    import torch

    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), token_labels(rng, (ROWS, LENGTH))
    theirs = torch.nn.functional.cross_entropy(
        torch.from_numpy(z).reshape(-1, CLASSES), torch.from_numpy(y).reshape(-1),
        ignore_index=IGNORE)
    model = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, ignore_index=IGNORE)
    np.testing.assert_allclose(token_loss(model, x=z, label=y), float(theirs), rtol=1e-12)


def test_without_ignore_index_the_mean_is_over_every_position(rng):
    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), rng.integers(0, CLASSES, (ROWS, LENGTH))
    model = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True)
    np.testing.assert_allclose(token_loss(model, x=z, label=y),
                               token_reference(z, y, None, "mean", ignore_index=None), rtol=1e-12)
    assert not any(n.op_type == "Equal" for n in model.graph.node)
    assert read_json(model, LOSS_KEY) is None


def test_ignore_index_may_be_a_class_and_changes_nothing_when_no_label_is_it(rng):
    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), token_labels(rng, (ROWS, LENGTH), ignored=0)
    plain = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, reduction="sum")
    unused = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                             from_logits=True, reduction="sum", ignore_index=IGNORE)
    np.testing.assert_allclose(token_loss(unused, x=z, label=y), token_loss(plain, x=z, label=y),
                               rtol=1e-14)
    class_two = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                                from_logits=True, ignore_index=2)
    np.testing.assert_allclose(token_loss(class_two, x=z, label=y),
                               token_reference(z, y, None, "mean", ignore_index=2), rtol=1e-12)


def test_row_level_labels_take_ignore_index_too(rng):
    z, y = rng.normal(size=(9, CLASSES)), rng.integers(0, CLASSES, 9)
    y[[1, 4]] = IGNORE
    model = add_loss_output(token_identity(f"N, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, ignore_index=IGNORE)
    np.testing.assert_allclose(token_loss(model, x=z, label=y),
                               token_reference(z, y, None, "mean"),
                               rtol=1e-12)


# -- token loss: gradients -----------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_equal_finite_differences(rng, weighted, reduction):
    model = add_loss_output(token_model("double", weights_as_inputs=True),
                            "multiclass_log_loss", from_logits=True, ignore_index=IGNORE,
                            reduction=reduction, weight_name="w" if weighted else None)
    inputs = {"x": rng.normal(size=(ROWS, LENGTH, FEATURES)),
              "W": rng.normal(size=(FEATURES, CLASSES)), "b": rng.normal(size=CLASSES),
              "label": token_labels(rng, (ROWS, LENGTH)),
              **({"w": rng.uniform(0.2, 2, ROWS)} if weighted else {})}
    check_gradients(model, inputs, wrt=["x", "W", "b"], ort=False)


@pytest.mark.torch
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("from_logits", [True, False])
def test_gradients_equal_torch_autograd_with_ignore_index(rng, weighted, from_logits):
    import torch

    F = torch.nn.functional
    base = token_model("double", weights_as_inputs=True)
    if not from_logits:  # probabilities: a softmax in the model
        base.graph.node[-1].output[0] = "raw"
        base.graph.node.append(onnx.helper.make_node("Softmax", ["raw"], ["logits"], axis=-1))
    model = add_loss_output(base, "multiclass_log_loss", from_logits=from_logits,
                            ignore_index=IGNORE, weight_name="w" if weighted else None)
    x, y = rng.normal(size=(ROWS, LENGTH, FEATURES)), token_labels(rng, (ROWS, LENGTH))
    W, b = rng.normal(size=(FEATURES, CLASSES)), rng.normal(size=CLASSES)
    w = rng.uniform(0.2, 2, ROWS)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in {"W": W, "b": b}.items()}
    logits = torch.from_numpy(x) @ tensors["W"] + tensors["b"]
    per_token = F.cross_entropy(logits.reshape(-1, CLASSES), torch.from_numpy(y).reshape(-1),
                                ignore_index=IGNORE, reduction="none").reshape(y.shape)
    row_weight = torch.from_numpy(w if weighted else np.ones(ROWS))[:, None]
    theirs = (row_weight * per_token).sum() / (row_weight * torch.from_numpy(y != IGNORE)).sum()
    theirs.backward()
    R = float(cotangent((), np.float64))  # check_gradients differentiates R * loss
    reference_grads = {k: R * t.grad.numpy() for k, t in tensors.items()}
    inputs = {"x": x, "W": W, "b": b, "label": y, **({"w": w} if weighted else {})}
    check_gradients(model, inputs, wrt=["W", "b"], reference=reference_grads, ort=False)
    np.testing.assert_allclose(token_loss(model, **inputs), theirs.item(), rtol=1e-10)


# -- token loss, training: every fuse mode, sample weights, like torch's AdamW -------------


def torch_token_loss(logits, y, weights=None):
    """torch's cross entropy with ignore_index, each row's tokens weighted by its weight."""
    import torch

    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
        reduction="none").reshape(y.shape)
    row = torch.ones(len(y), dtype=logits.dtype) if weights is None else weights
    return (row[:, None] * per_token).sum() / (row[:, None] * (y != IGNORE)).sum()


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("weighted", [False, True])
def test_training_equals_torch_adamw_step_for_step(rng, fuse, weighted):
    """One epoch of three batches (one fit: the epoch graph runs them in one Scan) against
    three torch AdamW steps on the same loss; the epoch's loss is the rows-weighted mean of
    the batches' losses, as the Trainer records it."""
    import torch

    batch, steps = 4, 3
    rows = batch * steps
    X = rng.normal(size=(rows, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (rows, LENGTH), ignored=0.4)
    w = rng.uniform(0.2, 2, rows).astype(np.float32)
    program = lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, "ignore_index": IGNORE,
                      **({"weight_name": "sample_weight"} if weighted else {})},
        optimizer=AdamW(0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.05))
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, sample_weight=w if weighted else None, epochs=1, batch_size=batch,
                shuffle=False, progress=False)

    params = {k: torch.tensor(v, requires_grad=True) for k, v in program.state.items()
              if k in program.weights}
    theirs = torch.optim.AdamW(params.values(), lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                               weight_decay=0.05)
    losses = []
    for step in range(steps):
        part = slice(step * batch, (step + 1) * batch)
        theirs.zero_grad()
        logits = torch.from_numpy(X[part]) @ params["W"] + params["b"]
        loss = torch_token_loss(logits, torch.from_numpy(y[part]),
                                torch.from_numpy(w[part]) if weighted else None)
        loss.backward()
        theirs.step()
        losses.append(loss.item())
    for name, value in params.items():
        np.testing.assert_allclose(trainer.state[name], value.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert trainer.train_losses_ == [pytest.approx(np.mean(losses), rel=1e-5)]
    moved = max(np.abs(trainer.state[n] - program.state[n]).max() for n in params)
    assert moved > 0.05, "training hardly moved the weights"


# -- token loss: the Trainer's label check -------------------------------------------------


@pytest.fixture(scope="module")
def ignoring_trainer():
    return lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss",
        loss_options={"from_logits": True, "ignore_index": IGNORE}))


def test_the_ignored_label_is_recorded_and_accepted(ignoring_trainer, rng):
    assert read_json(ignoring_trainer.program.graphs["evaluate"], LOSS_KEY) == {
        "ignore_index": IGNORE}
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (ROWS, LENGTH))
    assert (y == IGNORE).any()
    ignoring_trainer.fit(X, y, epochs=1, batch_size=ROWS, progress=False)
    assert np.isfinite(ignoring_trainer.train_losses_[-1])


@pytest.mark.parametrize(("value", "pattern"), [
    (-1, r"class label -1 at row 2, position \(3,\), but the model's classes are 0\.\.3 "
         r"\(or -100, the loss's ignore_index\)"),
    (CLASSES, r"class label 4 at row 2, position \(3,\)"),
])
def test_other_labels_outside_the_classes_are_named_by_row_and_position(ignoring_trainer, rng,
                                                                       value, pattern):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (ROWS, LENGTH))
    y[2, 3] = value
    with pytest.raises(InvalidDataError, match=pattern):
        ignoring_trainer.fit(X, y, progress=False)


def test_labels_all_ignored_are_refused_before_training(ignoring_trainer, rng):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    with pytest.raises(InvalidDataError, match="-100 .the loss's ignore_index. everywhere"):
        ignoring_trainer.fit(X, np.full((ROWS, LENGTH), IGNORE), progress=False)


@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_a_batch_whose_labels_are_all_ignored_is_named(rng, fuse):
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, "ignore_index": IGNORE}))
    X = rng.normal(size=(8, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (8, LENGTH))
    y[4:] = IGNORE
    before = trainer.state
    with pytest.raises(InvalidDataError, match="No label of epoch 0, batch 1 counts"):
        trainer.fit(X, y, batch_size=4, shuffle=False, progress=False)
    if fuse == "epoch":  # the epoch's state is restored
        np.testing.assert_array_equal(trainer.state["W"], before["W"])


def test_without_ignore_index_the_label_minus_100_is_refused(rng):
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", loss_options={"from_logits": True}))
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (ROWS, LENGTH))
    with pytest.raises(InvalidDataError, match=r"class label -100 at row \d, position "
                                               r"\(\d,\), but the model's classes are 0\.\.3:"):
        trainer.fit(X, y, progress=False)


def test_labels_of_the_wrong_shape_are_refused(ignoring_trainer, rng):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    with pytest.raises(ShapeMismatchError, match=r"y has shape \(6,\)"):
        ignoring_trainer.fit(X, np.zeros(ROWS, np.int64), progress=False)


# -- token loss: structure and errors ------------------------------------------------------


def test_the_label_has_the_predictions_axes_but_the_classes():
    model = add_loss_output(token_model(), "multiclass_log_loss", from_logits=True,
                            ignore_index=IGNORE)
    label = model.graph.input[-1].type.tensor_type
    assert label.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in label.shape.dim] == ["N", "T"]
    assert read_json(model, LOSS_KEY) == {"ignore_index": IGNORE}
    back = RemoveLossOutput()(model).model
    assert read_json(back, LOSS_KEY) is None and get_roles(back) == {}


@pytest.mark.parametrize(("shape", "pattern"), [
    ("N, T, 1", r"\(N, d1, \.\.\., classes\).*has shape \(N, T, 1\)"),
    ("N", r"has shape \(N,\)"),
])
def test_predictions_without_a_class_axis_are_shape_errors(shape, pattern):
    with pytest.raises(ShapeMismatchError, match=pattern):
        add_loss_output(token_identity(shape), "multiclass_log_loss", from_logits=True)


@pytest.mark.parametrize("value", [True, 1.5, float("nan"), "-100", 2**63])
def test_ignore_index_must_be_an_int64(value):
    with pytest.raises(UnsupportedOptionError, match="ignore_index=.* must be an int64 label"):
        add_loss_output(token_model(), "multiclass_log_loss", ignore_index=value)


def test_the_command_line_gives_ignore_index_as_an_integral_number(tmp_path):
    """``--loss-option ignore_index=-100`` reads the value as the number -100.0."""
    from lossgraph.cli import main

    onnx.save(token_model(), tmp_path / "tokens.onnx")
    assert main(["compile", str(tmp_path / "tokens.onnx"), "--loss", "multiclass_log_loss",
                 "--loss-option", "from_logits=true", "--loss-option", "ignore_index=-100",
                 "-o", str(tmp_path / "program")]) == 0
    program = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert read_json(program.graphs["evaluate"], LOSS_KEY) == {"ignore_index": IGNORE}


def test_ignore_index_is_an_option_of_multiclass_log_loss_only():
    with pytest.raises(UnsupportedOptionError, match="takes no option 'ignore_index'"):
        add_loss_output(token_model(), "squared_error", ignore_index=IGNORE)
    with pytest.raises(UnsupportedOptionError, match="no key 'ignore_index'"):
        lossgraph.compile_program(token_model(), loss="squared_error",
                                  loss_options={"ignore_index": IGNORE})


# -- token loss: data-parallel -------------------------------------------------------------


def test_data_parallel_refuses_a_mean_over_counted_positions():
    from lossgraph.parallel import ParallelProgram

    with pytest.raises(UnsupportedOptionError, match="data-parallel step divides"):
        ParallelProgram.compile(token_model(), loss="multiclass_log_loss",
                                loss_options={"from_logits": True, "ignore_index": IGNORE})


@pytest.mark.parametrize("options", [
    {"from_logits": True},
    {"from_logits": True, "ignore_index": IGNORE, "reduction": "sum"},
])
def test_data_parallel_token_loss_equals_one_process(rng, options):
    """Without ignore_index the mean over positions is the mean of the rows' means, and with
    reduction='sum' nothing is divided: two replicas step like one Trainer."""
    from lossgraph.parallel import ParallelProgram, Replica, array_shards

    parallel = ParallelProgram.compile(token_model(), loss="multiclass_log_loss",
                                       loss_options=options, optimizer=AdamW(0.05))
    X = rng.normal(size=(10, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (10, LENGTH), ignored=0.4 if "ignore_index" in options else 0)
    trainer = lossgraph.Trainer(parallel.program)
    trainer.fit(X, y, batch_size=5, shuffle=False, progress=False)
    replicas = [Replica(parallel, None) for _ in range(2)]
    for shards in zip(*(array_shards((X, y), 5, rank, 2) for rank in range(2))):
        parts = [r.contribution(s) for r, s in zip(replicas, shards)]
        for replica in replicas:
            replica.apply(parts[0] + parts[1])
    for name in parallel.program.weights:
        np.testing.assert_allclose(replicas[0].trainer.state[name], trainer.state[name],
                                   rtol=1e-5, atol=1e-6, err_msg=name)


# ==========================================================================================
# Label smoothing and class weights (multiclass_log_loss), pos_weight (binary_log_loss,
# logistic): torch's CrossEntropyLoss(weight=, label_smoothing=, ignore_index=) and
# BCEWithLogitsLoss(pos_weight=), the mean divided by the weights of the labels counted.
# Sample weights multiply the class weights (scikit-learn's rule).
# ==========================================================================================

CLASS_WEIGHT = [0.5, 2.0, 1.0, 0.25]


def torch_cross_entropy(logits, y, reduction="mean", **options):
    """torch's cross entropy over the flattened positions, classes on the last axis."""
    import torch

    weight = options.pop("class_weight", None)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.as_tensor(y).reshape(-1),
        weight=None if weight is None else torch.tensor(weight, dtype=logits.dtype),
        ignore_index=options.pop("ignore_index", None) or IGNORE, reduction=reduction,
        **options)
    return loss if reduction == "mean" else loss.reshape(y.shape)


def label_shares(y: np.ndarray, ignore_index: int | None, class_weight: list | None):
    """The weight of each label position in the mean: 0 if ignored, else its class's."""
    counted = np.ones(y.shape) if ignore_index is None else (y != ignore_index)
    weights = np.ones(CLASSES) if class_weight is None else np.asarray(class_weight)
    return counted * weights[np.where(counted, y, 0)]


@pytest.mark.torch
@pytest.mark.parametrize(("shape", "ignore_index"), [((ROWS,), None), ((ROWS,), IGNORE),
                                                     ((ROWS, LENGTH), IGNORE)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("class_weight", [None, CLASS_WEIGHT])
@pytest.mark.parametrize("from_logits", [True, False])
def test_loss_and_gradient_equal_torchs_cross_entropy(rng, shape, ignore_index,
                                                      label_smoothing, class_weight,
                                                      from_logits):
    """On random logits, the loss and its gradient with respect to them, against torch's
    autograd of CrossEntropyLoss; with ``from_logits=False`` the model ends in a Softmax
    and the loss takes its probabilities."""
    import torch

    z = rng.normal(size=(*shape, CLASSES)) * 2
    y = token_labels(rng, shape) if ignore_index else rng.integers(0, CLASSES, shape)
    options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
               "class_weight": class_weight}
    dims = ", ".join(["N", *(f"d{i}" for i in range(1, len(shape))), str(CLASSES)])
    base = token_identity(dims)
    if not from_logits:
        base.graph.node[0].CopyFrom(onnx.helper.make_node("Softmax", ["x"], ["y"], axis=-1))
    model = add_loss_output(base, "multiclass_log_loss", from_logits=from_logits,
                            **{k: v for k, v in options.items() if v})
    logits = torch.tensor(z, requires_grad=True)
    theirs = torch_cross_entropy(logits, y, **options)
    theirs.backward()
    R = float(cotangent((), np.float64))
    np.testing.assert_allclose(token_loss(model, x=z, label=y), theirs.item(), rtol=1e-12)
    check_gradients(model, {"x": z, "label": y}, wrt=["x"],
                    reference={"x": R * logits.grad.numpy()}, ort=False)


@pytest.mark.torch
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sample_weights_multiply_the_class_weights(rng, label_smoothing, reduction):
    """Each position weighs its row's sample weight times its class's weight: the mean is
    sum_i w_i mean_t l_it / sum_i w_i mean_t c[y_it] (torch's reduction='none' per
    position), as one mean with scikit-learn's sample_weight * class_weight."""
    import torch

    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), token_labels(rng, (ROWS, LENGTH))
    w = rng.uniform(0.2, 2, ROWS)
    options = {"ignore_index": IGNORE, "label_smoothing": label_smoothing,
               "class_weight": CLASS_WEIGHT}
    model = add_loss_output(token_identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, weight_name="w", reduction=reduction, **options)
    per_position = torch_cross_entropy(torch.from_numpy(z), y, "none", **options).numpy()
    rows = w * per_position.mean(axis=1)
    expected = {"none": rows, "sum": rows.sum(),
                "mean": rows.sum() / (w * label_shares(y, IGNORE, CLASS_WEIGHT).mean(1)).sum()}
    np.testing.assert_allclose(token_loss(model, x=z, label=y, w=w), expected[reduction],
                               rtol=1e-12)
    if reduction == "mean" and not label_smoothing:  # one label a row: scikit-learn's log_loss
        p = np.exp(z[:, 0]) / np.exp(z[:, 0]).sum(-1, keepdims=True)
        rows_model = add_loss_output(token_identity(f"N, {CLASSES}"), "multiclass_log_loss",
                                     weight_name="w", class_weight=CLASS_WEIGHT)
        label = y[:, 0]
        theirs = log_loss(label, p, sample_weight=w * np.asarray(CLASS_WEIGHT)[label],
                          labels=range(CLASSES))
        np.testing.assert_allclose(token_loss(rows_model, x=p, label=label, w=w), theirs,
                                   rtol=1e-10)


@pytest.mark.torch
@pytest.mark.parametrize("loss", ["logistic", "binary_log_loss"])
@pytest.mark.parametrize("pos_weight", [None, 3.0, 0.5])
@pytest.mark.parametrize(("shape", "weighted"), [("N", False), ("N, 1", True)])
def test_pos_weight_equals_torchs_bce_with_logits(rng, loss, pos_weight, shape, weighted):
    """torch's BCEWithLogitsLoss(pos_weight=c): c y softplus(-s) + (1 - y) softplus(s), a
    plain mean (pos_weight is not normalised); of the sigmoid's probability for
    binary_log_loss. Sample weights weigh rows as everywhere."""
    import torch

    s = rng.normal(size=(9, 1) if shape == "N, 1" else 9) * 3
    y = rng.integers(0, 2, 9)
    w = rng.uniform(0.2, 2, 9)
    given = torch.tensor(s, requires_grad=True)
    per_row = torch.nn.functional.binary_cross_entropy_with_logits(
        given.reshape(-1), torch.from_numpy(y).double(), reduction="none",
        pos_weight=None if pos_weight is None else torch.tensor(pos_weight).double())
    row_weight = torch.from_numpy(w if weighted else np.ones(9))
    theirs = (row_weight * per_row).sum() / row_weight.sum()
    theirs.backward()
    probability = 1 / (1 + np.exp(-s))
    model = add_loss_output(token_identity(shape), loss, weight_name="w" if weighted else None,
                            **({} if pos_weight is None else {"pos_weight": pos_weight}))
    x = s if loss == "logistic" else probability
    inputs = {"x": x, "label": y, **({"w": w} if weighted else {})}
    np.testing.assert_allclose(token_loss(model, **inputs), theirs.item(), rtol=1e-10)
    grad = given.grad.numpy() if loss == "logistic" else (
        given.grad.numpy() / (probability * (1 - probability)))  # dL/dp = dL/ds / p (1 - p)
    check_gradients(model, inputs, wrt=["x"], reference={"x": float(cotangent(
        (), np.float64)) * grad}, ort=False)


# -- training: every fuse mode, a saved and loaded program, like torch -----------------------


def torch_steps(program, X, y, batch, loss_fn):
    """torch AdamW steps on ``loss_fn(logits, y)`` from the program's initial weights, each
    batch in order: the losses and the weights reached."""
    import torch

    params = {k: torch.tensor(v, requires_grad=True) for k, v in program.state.items()
              if k in program.weights}
    optimizer = torch.optim.AdamW(params.values(), lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                                  weight_decay=0.05)
    losses = []
    for lo in range(0, len(X), batch):
        optimizer.zero_grad()
        logits = torch.from_numpy(X[lo:lo + batch]) @ params["W"] + params["b"]
        loss = loss_fn(logits, y[lo:lo + batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in params.items()}


def trained_alike(program, X, y, batch, loss_fn, tmp_path):
    """The program, and the same saved and loaded, train as torch does step for step."""
    losses, theirs = torch_steps(program, X, y, batch, loss_fn)
    program.save(tmp_path / "program")
    for trained in (program, lossgraph.TrainingProgram.load(tmp_path / "program")):
        trainer = lossgraph.Trainer(trained).fit(X, y, epochs=1, batch_size=batch,
                                                 shuffle=False, progress=False)
        for name, value in theirs.items():
            np.testing.assert_allclose(trainer.state[name], value, rtol=1e-5, atol=1e-6,
                                       err_msg=name)
        assert trainer.train_losses_ == [pytest.approx(np.mean(losses), rel=1e-5)]
    assert max(np.abs(theirs[n] - program.state[n]).max() for n in theirs) > 0.05


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_training_with_smoothing_and_class_weights_equals_torch(rng, fuse, tmp_path):
    options = {"ignore_index": IGNORE, "label_smoothing": 0.1, "class_weight": CLASS_WEIGHT}
    program = lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, **options},
        optimizer=AdamW(0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.05))
    X = rng.normal(size=(12, LENGTH, FEATURES)).astype(np.float32)
    y = token_labels(rng, (12, LENGTH), ignored=0.4)
    trained_alike(program, X, y, 4, lambda z, y: torch_cross_entropy(z, y, **options), tmp_path)


def logit_model() -> onnx.ModelProto:
    """``s = x @ W + b``: one raw score per row."""
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        logit (float[N, {FEATURES}] x) => (float[N, 1] s)
        <float[{FEATURES}, 1] W = {{0.3, -0.2, 0.1}}, float[1] b = {{0.1}}> {{
            h = MatMul(x, W)
            s = Add(h, b)
        }}""")


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_training_with_pos_weight_equals_torch(rng, fuse, tmp_path):
    import torch

    program = lossgraph.compile_program(
        logit_model(), loss="logistic", loss_options={"pos_weight": 3.0}, fuse=fuse,
        optimizer=AdamW(0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.05))
    X = rng.normal(size=(12, FEATURES)).astype(np.float32)
    y = rng.integers(0, 2, 12)
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0]))
    trained_alike(program, X, y, 4,
                  lambda s, y: loss_fn(s, torch.from_numpy(y[:, None]).float()), tmp_path)


# -- what the program records, and the Trainer's checks ------------------------------------


@pytest.mark.torch
def test_a_kept_batch_evaluates_in_runs_as_one_mean_over_the_class_weights(rng):
    """A model exported with a batch of 2 evaluates 2 rows a run; the runs' means combine
    by the class weights of their labels into torch's mean over every row."""
    import torch

    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        clf (float[2, {FEATURES}] x) => (float[2, {CLASSES}] logits)
        <float[{FEATURES}, {CLASSES}] W = {{{", ".join(["0.3", "-0.2", "0.1"] * CLASSES)}}},
         float[{CLASSES}] b = {{0.1, 0.2, -0.1, 0}}> {{
            s = MatMul(x, W)
            logits = Add(s, b)
        }}""")
    options = {"ignore_index": IGNORE, "label_smoothing": 0.1, "class_weight": CLASS_WEIGHT}
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        model, loss="multiclass_log_loss", fixed_batch="keep",
        loss_options={"from_logits": True, **options}))
    X = rng.normal(size=(6, FEATURES)).astype(np.float32)
    y = np.array([1, 0, IGNORE, 3, 2, 1])
    logits = torch.from_numpy(X) @ torch.from_numpy(trainer.state["W"]) + torch.from_numpy(
        trainer.state["b"])
    assert trainer.evaluate(X, y) == pytest.approx(
        torch_cross_entropy(logits, y, **options).item(), rel=1e-6)



def test_the_class_weights_are_recorded_and_read_back():
    model = add_loss_output(token_model(), "multiclass_log_loss", from_logits=True,
                            class_weight=np.array(CLASS_WEIGHT), label_smoothing=0.1)
    assert read_json(model, LOSS_KEY) == {"class_weight": CLASS_WEIGHT}
    assert read_loss_record(model) == {"ignore_index": None, "class_weight": CLASS_WEIGHT}
    plain = add_loss_output(token_model(), "multiclass_log_loss", from_logits=True,
                            label_smoothing=0.1)
    assert read_json(plain, LOSS_KEY) is None


@pytest.mark.parametrize("record", ['{"class_weight": "balanced"}', '{"class_weight": [1, true]}',
                                    '[1, 2]', '{"ignore_index": 1.5}'])
def test_a_loss_record_edited_by_hand_is_an_invalid_program(record):
    model = add_loss_output(token_model(), "multiclass_log_loss", from_logits=True,
                            class_weight=CLASS_WEIGHT)
    onnx.helper.set_model_props(model, {LOSS_KEY: record})
    with pytest.raises(InvalidProgramError, match="must be a JSON object such as"):
        read_loss_record(model)


@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_a_batch_whose_labels_all_weigh_zero_is_named(rng, fuse):
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, "class_weight": [0.0, 1.0, 1.0, 1.0]}))
    X = rng.normal(size=(8, LENGTH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, (8, LENGTH))
    y[4:] = 0
    with pytest.raises(InvalidDataError, match="No label of epoch 0, batch 1 counts: each is of "
                                               "a class of weight zero"):
        trainer.fit(X, y, batch_size=4, shuffle=False, progress=False)


def test_without_a_static_class_count_labels_are_checked_against_the_class_weights(rng):
    """A model whose number of classes is not static: the class weights give it."""
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        open (float[N, C] x) => (float[N, C] y) <float[1] scale = {1.0}> {
            y = Mul(x, scale)
        }""")
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        model, loss="multiclass_log_loss", loss_options={"from_logits": True,
                                                         "class_weight": [1, 2]}))
    assert trainer.engine.classes == 2
    X = rng.normal(size=(4, 2)).astype(np.float32)
    with pytest.raises(InvalidDataError, match="class label 2 at row 3, but the model's "
                                               r"classes are 0\.\.1"):
        trainer.fit(X, np.array([0, 1, 1, 2]), progress=False)


@pytest.mark.parametrize(("options", "pattern"), [
    ({"label_smoothing": -0.1}, r"label_smoothing=-0\.1 .* must be a number in \[0, 1\)"),
    ({"label_smoothing": True}, r"label_smoothing=True"),
    ({"class_weight": [1, 2, float("nan"), 1]}, r"class_weight=\[1, 2, nan, 1\]"),
    ({"class_weight": [0, 0, 0, 0]}, r"not all zero"),
    ({"class_weight": {0: 2.0}}, r"must be a list of one weight per class"),
    ({"class_weight": [1.0]}, r"class_weight=\[1\.0\]"),
    ({"class_weight": [1, 2, 3]}, r"class_weight has 3 weights but output 'logits' has 4"),
])
def test_bad_smoothing_and_class_weights_are_option_errors(options, pattern):
    with pytest.raises(UnsupportedOptionError, match=pattern):
        add_loss_output(token_model(), "multiclass_log_loss", from_logits=True, **options)


def test_pos_weight_is_for_the_binary_losses_and_class_weight_for_the_multiclass_one():
    with pytest.raises(UnsupportedOptionError, match="takes no option 'pos_weight'"):
        add_loss_output(token_model(), "multiclass_log_loss", pos_weight=2.0)
    with pytest.raises(UnsupportedOptionError, match="takes no option 'class_weight'"):
        add_loss_output(logit_model(), "logistic", class_weight=[1, 2])
    with pytest.raises(UnsupportedOptionError, match=r"pos_weight=inf .* finite number >= 0"):
        add_loss_output(logit_model(), "logistic", pos_weight=float("inf"))


def test_balanced_class_weight_equals_scikit_learns(rng):
    from sklearn.utils.class_weight import compute_class_weight

    y = rng.integers(0, CLASSES, 50)
    np.testing.assert_allclose(lossgraph.balanced_class_weight(y), compute_class_weight(
        "balanced", classes=np.arange(CLASSES), y=y), rtol=1e-15)
    tokens = token_labels(rng, (20, LENGTH))
    counted = tokens[tokens != IGNORE]
    np.testing.assert_allclose(
        lossgraph.balanced_class_weight(tokens, classes=CLASSES, ignore_index=IGNORE),
        compute_class_weight("balanced", classes=np.arange(CLASSES), y=counted), rtol=1e-15)


@pytest.mark.parametrize(("y", "options", "pattern"), [
    ([0, 1, 3], {}, "no label of class 2"),
    ([0, 1, 3], {"classes": 3}, "the label 3, beyond the 3 classes"),
    ([0.0, 1.0], {}, "needs integer class labels"),
    ([-1, 0, 1], {}, "the label -1"),
    ([IGNORE, IGNORE], {"ignore_index": IGNORE}, "no label to count"),
])
def test_balanced_class_weight_refuses_labels_it_cannot_weigh(y, options, pattern):
    with pytest.raises(InvalidDataError, match=pattern):
        lossgraph.balanced_class_weight(np.array(y), **options)


def test_the_command_line_takes_class_weights_as_a_json_list(tmp_path):
    from lossgraph.cli import main

    onnx.save(token_model(), tmp_path / "tokens.onnx")
    assert main(["compile", str(tmp_path / "tokens.onnx"), "--loss", "multiclass_log_loss",
                 "--loss-option", "from_logits=true", "--loss-option", "label_smoothing=0.1",
                 "--loss-option", f"class_weight={CLASS_WEIGHT}",
                 "-o", str(tmp_path / "program")]) == 0
    program = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert read_json(program.graphs["evaluate"], LOSS_KEY) == {"class_weight": CLASS_WEIGHT}


@pytest.mark.parametrize("source", ["csv", "npz"])
def test_the_command_line_weighs_classes_by_the_labels_of_a_data_file(tmp_path, rng, source):
    """``class_weight=balanced`` with ``--class-weight-labels DATA [NAME]``: the weights of
    balanced_class_weight(labels) are computed at compile and kept in the program."""
    from lossgraph.cli import main

    onnx.save(token_model(), tmp_path / "tokens.onnx")
    labels = token_labels(rng, (20, LENGTH))
    if source == "csv":
        data = tmp_path / "labels.csv"
        data.write_text("tag\n" + "\n".join(map(str, labels.ravel())) + "\n")
        flag = [str(data), "tag"]
    else:
        data = tmp_path / "data.npz"
        np.savez(data, X=np.zeros(1), y=labels)
        flag = [str(data)]
    assert main(["compile", str(tmp_path / "tokens.onnx"), "--loss", "multiclass_log_loss",
                 "--loss-option", "from_logits=true", "--loss-option", "ignore_index=-100",
                 "--loss-option", "class_weight=balanced", "--class-weight-labels", *flag,
                 "-o", str(tmp_path / "program")]) == 0
    weights = lossgraph.balanced_class_weight(labels, ignore_index=IGNORE)
    lossgraph.compile_program(token_model(), loss="multiclass_log_loss", loss_options={
        "from_logits": True, "ignore_index": IGNORE, "class_weight": weights,
    }).save(tmp_path / "expected")
    for path in (tmp_path / "expected").iterdir():  # the same program, byte for byte
        assert (tmp_path / "program" / path.name).read_bytes() == path.read_bytes(), path.name
    program = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert read_json(program.graphs["evaluate"], LOSS_KEY) == {"ignore_index": IGNORE,
                                                               "class_weight": weights}


def test_data_parallel_refuses_a_mean_divided_by_class_weights():
    from lossgraph.parallel import ParallelProgram

    with pytest.raises(UnsupportedOptionError, match="class_weight=.* data-parallel step"):
        ParallelProgram.compile(token_model(), loss="multiclass_log_loss",
                                loss_options={"from_logits": True, "class_weight": CLASS_WEIGHT})


# -- the separate mode's loss graph (program_loss_graph) -----------------------------------
def test_the_separate_loss_graph_proves_prediction_and_label_alike():
    """The prediction's unnamed batch axis gets a name the label shares: the loss gradient
    needs no run-time broadcast reduction (Equal, Not, And, Compress on shapes)."""
    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    program = lossgraph.compile_program(model, fuse="separate")
    ops = {node.op_type for node in program.graphs["loss"].graph.node}
    assert not ops & {"Compress", "Equal", "And"}, ops


# -- found by the fuzzer (tests/test_fuzz.py) --------------------------------------------------

#: An output whose column dimension is named N while the batch has no name: fuse="separate"
#: named the batch of its loss graph N too, and chaining its graphs failed (an InternalError).
COLUMN_NAMED_N = LINEAR.replace("(float[N, 4] x) => (float[N, 1] y)",
                                "(float[?, 4] x) => (float[?, N] y)")


def test_an_output_dimension_named_n_trains_alike_in_every_fuse_mode():
    X, y = linear_data(40, seed=3)
    states = {}
    for fuse in ("separate", "step", "epoch"):
        program = lossgraph.compile_program(onnx.parser.parse_model(COLUMN_NAMED_N), fuse=fuse)
        trainer = lossgraph.Trainer(program).fit(X, y[:, None], epochs=2, batch_size=10,
                                                 shuffle=False, progress=False)
        states[fuse] = trainer.state
    for fuse in ("separate", "epoch"):
        for name in ("coef", "intercept"):
            np.testing.assert_allclose(states[fuse][name], states["step"][name], rtol=1e-5,
                                       atol=1e-6, err_msg=f"{fuse} {name}")
