"""lossgraph.compat.OrtGradientForwardBackward on both backends: predictions equal
onnxruntime's on the original model, gradients equal float64 finite differences, the
backends agree, training forwards are answered last in first out, bad calls raise
lossgraph's errors, and the object pickles.

``backend="ort"`` runs onnxruntime-training's OrtModuleGraphBuilder + TrainingAgent; its
tests carry the ``training`` marker (skipped on plain onnxruntime).
"""

from __future__ import annotations

import functools
import pickle

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from support.environment import GOLDEN_MODELS, HAS_TRAINING

from lossgraph.compat.forward_backward import OrtGradientForwardBackward
from lossgraph.errors import (
    DTypeMismatchError,
    InvalidDataError,
    RuntimeUnavailableError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
)
from lossgraph.passes.plan import PlanRunner
from lossgraph.passes.weights import WeightsToInputs
from lossgraph.runtime.session import create_session

BACKENDS = ["onnx", pytest.param("ort", marks=pytest.mark.training)]
#: golden model -> the outputs the function returns (None: all of them)
CASES = {
    "skl_mlp_regressor": None,
    "skl_linear_regression": None,  # LinearRegressor, lowered to Gemm with weights coef, intercept
    "skl_mlp_classifier": ["probabilities"],
    "hand_mlp_tanh_double": None,
}
ROWS = 4


@functools.cache
def golden(name: str) -> onnx.ModelProto:
    return onnx.load(str(GOLDEN_MODELS / f"{name}.onnx"))


@functools.cache
def built(name: str, backend: str) -> OrtGradientForwardBackward:
    """One object per model and backend (building takes a while); tests make their own
    function objects from it."""
    return OrtGradientForwardBackward(golden(name), output_names=CASES[name], backend=backend)


def features(model: onnx.ModelProto, seed: int, rows: int = ROWS) -> np.ndarray:
    tensor = model.graph.input[0].type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    columns = tensor.shape.dim[1].dim_value
    return np.random.default_rng(seed).normal(size=(rows, columns)).astype(dtype)


def inputs_of(fb: OrtGradientForwardBackward, seed: int = 0) -> list[np.ndarray]:
    """Features, then the model's weights slightly moved (so nothing sits at its initial
    value by accident)."""
    rng = np.random.default_rng(seed + 100)
    weights = [w + (0.01 * rng.normal(size=w.shape)).astype(w.dtype)
               for w in (fb.get_initializer(n) for n in fb.weights_to_train)]
    return [features(fb.onnx_model, seed), *weights]


def cotangents(outputs: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """A random linear functional of the outputs: L = sum_k sum(R_k * y_k)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=y.shape).astype(y.dtype) for y in outputs]


def float64_model(fb: OrtGradientForwardBackward) -> onnx.ModelProto:
    """The (lowered) model with its weights as inputs, the chosen outputs, all in float64."""
    model = WeightsToInputs(tuple(fb.weights_to_train))(fb.onnx_model).model
    kept = [o for o in model.graph.output if o.name in fb.output_names]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    float32 = onnx.TensorProto.FLOAT
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        if value.type.tensor_type.elem_type == float32:
            value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.data_type == float32:
            array = numpy_helper.to_array(tensor).astype(np.float64)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == float32:
                attribute.i = onnx.TensorProto.DOUBLE
            assert attribute.type != onnx.AttributeProto.TENSOR or \
                attribute.t.data_type != float32, "float32 constant left in the float64 model"
    return model


def finite_differences(fb: OrtGradientForwardBackward, inputs: list[np.ndarray],
                       weights: list[np.ndarray], eps: float = 1e-6) -> list[np.ndarray | None]:
    """Central differences in float64 of L = sum_k sum(weights_k * y_k), for each float
    input and weight (None for the others)."""
    session = create_session(float64_model(fb))
    differentiable = [fb.output_names.index(n) for n in fb.differentiable_outputs]

    def loss(feeds: dict[str, np.ndarray]) -> float:
        outputs = session.run(fb.output_names, feeds)
        return sum(float(np.sum(outputs[i] * r)) for i, r in zip(differentiable, weights))

    base = {n: (a.astype(np.float64) if a.dtype.kind == "f" else a)
            for n, a in zip(fb.grad_input_names, inputs)}
    result: list[np.ndarray | None] = []
    for name in fb.grad_input_names:
        x = base[name]
        if x.dtype != np.float64:
            result.append(None)
            continue
        grad = np.zeros(x.shape)
        for index in np.ndindex(x.shape):
            original = x[index]
            x[index] = original + eps
            plus = loss(base)
            x[index] = original - eps
            minus = loss(base)
            x[index] = original
            grad[index] = (plus - minus) / (2 * eps)
        result.append(grad)
    return result


# -- numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_onnxruntime_on_the_original_model(name: str, backend: str) -> None:
    fb = built(name, backend)
    model = golden(name)
    inputs = [features(model, 0), *(fb.get_initializer(w) for w in fb.weights_to_train)]
    session = create_session(model)
    expected = session.run(fb.output_names, {model.graph.input[0].name: inputs[0]})
    function = fb.new_instance()
    predicted = function.forward(inputs, training=False)
    trained = function.forward(inputs, training=True)
    assert len(predicted) == len(expected) == len(trained)
    for want, got, got_training in zip(expected, predicted, trained):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_training, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_finite_differences(name: str, backend: str) -> None:
    fb = built(name, backend)
    inputs = inputs_of(fb)
    function = fb.new_instance()
    outputs = function.forward(inputs, training=True)
    seeds = cotangents([outputs[fb.output_names.index(n)] for n in fb.differentiable_outputs], 7)
    grads = function.backward(seeds)
    numeric = finite_differences(fb, inputs, seeds)
    double = inputs[0].dtype == np.float64
    rtol, atol = (1e-6, 1e-7) if double else (2e-3, 2e-4)
    assert len(grads) == len(fb.grad_input_names)
    for name_, got, want, given in zip(fb.grad_input_names, grads, numeric, inputs):
        assert got is not None, name_
        assert got.shape == given.shape and got.dtype == given.dtype, name_
        assert np.abs(want).max() > 1e-3, f"{name_}: a gradient of zeros tests nothing"
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name_)


@pytest.mark.training
@pytest.mark.parametrize("name", list(CASES))
def test_backends_agree(name: str) -> None:
    results = {}
    for backend in ("onnx", "ort"):
        fb = built(name, backend)
        function = fb.new_instance()
        inputs = inputs_of(fb, seed=3)
        outputs = function.forward(inputs, training=True)
        chosen = [outputs[fb.output_names.index(n)] for n in fb.differentiable_outputs]
        results[backend] = (function.forward(inputs), outputs,
                            function.backward(cotangents(chosen, 11)))
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    onnx_, ort = results["onnx"], results["ort"]
    for group in range(2):
        for a, b in zip(onnx_[group], ort[group], strict=True):
            np.testing.assert_allclose(a, b, **tolerance)
    for a, b in zip(onnx_[2], ort[2], strict=True):
        np.testing.assert_allclose(a, b, **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_forwards_then_two_backwards_last_in_first_out(backend: str) -> None:
    fb = built("skl_mlp_regressor", backend)
    first, second = inputs_of(fb, seed=1), inputs_of(fb, seed=2)
    seed_first = cotangents([np.zeros((ROWS, 1), np.float32)], 21)
    seed_second = cotangents([np.zeros((ROWS, 1), np.float32)], 22)
    expected = []
    for inputs, seeds in ((first, seed_first), (second, seed_second)):
        alone = fb.new_instance()
        alone.forward(inputs, training=True)
        expected.append(alone.backward(seeds))
    assert not np.allclose(expected[0][1], expected[1][1]), "the two steps must differ"

    function = fb.new_instance()
    function.forward(first, training=True)
    function.forward(second, training=True)
    assert len(function.states_) == 2
    answers = [function.backward(seed_second), function.backward(seed_first)]
    assert function.states_ == []
    for got, want in zip(answers, expected[::-1]):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_put_back_answers_a_second_backward(backend: str) -> None:
    # lossgraph.torch keeps a call's state and puts it back for each backward
    # (retain_graph=True); onnxruntime's PartialGraphExecutionState answers one backward
    fb = built("skl_mlp_regressor", backend)
    function = fb.new_instance()
    function.forward(inputs_of(fb, seed=12), training=True)
    state = function.states_[-1]
    seeds = cotangents([np.zeros((ROWS, 1), np.float32)], 12)
    first = function.backward(seeds)
    function.states_.append(state)
    other = cotangents([np.zeros((ROWS, 1), np.float32)], 13)
    second = function.backward(other)
    function.states_.append(state)
    third = function.backward(seeds)
    assert not np.allclose(first[0], second[0])
    for a, b in zip(first, third, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_in_the_order_asked_and_integer_outputs_take_no_gradient(backend: str) -> None:
    model = golden("skl_mlp_classifier")
    fb = OrtGradientForwardBackward(model, output_names=["probabilities", "label"],
                                    backend=backend)
    assert fb.differentiable_outputs == ["probabilities"]
    inputs = inputs_of(fb, seed=4)
    expected = dict(zip(["label", "probabilities"], create_session(
        WeightsToInputs(tuple(fb.weights_to_train))(model).model).run(
            ["label", "probabilities"], dict(zip(fb.grad_input_names, inputs)))))
    assert len(set(expected["label"].tolist())) > 1, "labels all alike test nothing"
    function = fb.new_instance()
    for training in (False, True):
        probabilities, label = function.forward(inputs, training=training)
        assert label.dtype == np.int64
        np.testing.assert_array_equal(label, expected["label"])
        np.testing.assert_allclose(probabilities, expected["probabilities"], rtol=1e-5,
                                   atol=1e-6)
    reference = built("skl_mlp_classifier", "onnx").new_instance()  # probabilities only
    reference.forward(inputs, training=True)
    seeds = cotangents([probabilities], 8)
    for got, want in zip(function.backward(seeds), reference.backward(seeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_input_has_no_gradient(backend: str) -> None:
    # Y = Gather(W, idx) * X: idx is int64 and gets None, X and W get gradients
    graph = onnx.parser.parse_graph(
        "g (float[N, 3] X, int64[N] idx) => (float[N, 3] Y) <float[5, 3] W = "
        "{" + ", ".join(str(0.1 * i) for i in range(15)) + "}> "
        "{ rows = Gather <axis = 0> (W, idx)\n Y = Mul(rows, X) }")
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 18)])
    fb = OrtGradientForwardBackward(model, backend=backend)
    assert fb.grad_input_names == ["X", "idx", "W"]
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    idx = np.array([0, 2, 2, 4], dtype=np.int64)
    function = fb.new_instance()
    (y,) = function.forward([x, idx, fb.get_initializer("W")], training=True)
    seed = np.random.default_rng(1).normal(size=y.shape).astype(np.float32)
    x_grad, idx_grad, w_grad = function.backward([seed])
    w = fb.get_initializer("W")
    assert idx_grad is None
    np.testing.assert_allclose(x_grad, seed * w[idx], rtol=1e-6)
    expected = np.zeros_like(w)
    np.add.at(expected, idx, seed * x)
    np.testing.assert_allclose(w_grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_0_weight_and_output(backend: str) -> None:
    # y = x k, s = sum(y): a scalar weight and a scalar output keep their rank 0
    graph = onnx.parser.parse_graph(
        "g (float[N, 2] x) => (float[N, 2] y, float s) <float k = {2.5}> "
        "{ y = Mul(x, k)\n s = ReduceSum <keepdims = 0> (y) }")
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 18)])
    fb = OrtGradientForwardBackward(model, weights_to_train=["k"], backend=backend)
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    function = fb.new_instance()
    y, s = function.forward([x, np.array(2.5, np.float32)], training=True)
    assert y.shape == (3, 2) and s.shape == ()
    y_grad = np.full((3, 2), 0.5, np.float32)
    x_grad, k_grad = function.backward([y_grad, np.array(2.0, np.float32)])
    assert k_grad.shape == ()
    np.testing.assert_allclose(k_grad, np.sum(y_grad * x) + 2.0 * x.sum(), rtol=1e-6)
    np.testing.assert_allclose(x_grad, (y_grad + 2.0) * 2.5, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_tensors_are_the_inputs_of_the_last_training_forward(backend: str) -> None:
    fb = built("skl_mlp_regressor", backend)
    function = fb.new_instance()
    with pytest.raises(InvalidDataError, match="saved_tensors"):
        _ = function.saved_tensors
    inputs = inputs_of(fb)
    function.forward(inputs)  # prediction only: saves nothing
    with pytest.raises(InvalidDataError):
        _ = function.saved_tensors
    function.forward(inputs, training=True)
    saved = function.saved_tensors
    assert len(saved) == len(inputs) and all(a is b for a, b in zip(saved, inputs))


# -- errors ----------------------------------------------------------------------------


def with_value(array: np.ndarray, value: float) -> np.ndarray:
    """A float64 copy of ``array`` holding ``value`` at row 0, column 1."""
    copy = array.astype(np.float64)
    copy[0, 1] = value
    return copy


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_calls_raise_lossgraph_errors(backend: str) -> None:
    fb = built("skl_mlp_regressor", backend)
    function = fb.new_instance()
    inputs = inputs_of(fb)
    with pytest.raises(InvalidDataError, match="no forward pass"):
        function.backward([np.ones((ROWS, 1), np.float32)])
    with pytest.raises(InvalidDataError, match="takes 5 inputs"):
        function.forward(inputs[:-1], training=True)
    with pytest.raises(DTypeMismatchError, match="Input 'X' holds <U"):
        function.forward([inputs[0].astype(str), *inputs[1:]], training=True)
    with pytest.raises(InvalidDataError, match="Input 'X' holds 1e\\+39 at row 0, column 1"):
        function.forward([with_value(inputs[0], 1e39), *inputs[1:]], training=True)
    with pytest.raises(ShapeMismatchError, match="'X' has shape"):
        function.forward([inputs[0][:, :3], *inputs[1:]])
    with pytest.raises(ShapeMismatchError, match="'coefficient' has shape"):
        function.forward([inputs[0], inputs[1].T, *inputs[2:]], training=True)
    assert function.states_ == []  # failed forwards push nothing

    (y,) = function.forward(inputs, training=True)
    with pytest.raises(InvalidDataError, match="one gradient per float output"):
        function.backward([y, y])
    with pytest.raises(DTypeMismatchError, match="complex"):
        function.backward([y.astype(np.complex64)])
    with pytest.raises(ShapeMismatchError, match="shape"):
        function.backward([np.ones((ROWS + 1, 1), np.float32)])
    assert len(function.states_) == 1  # a rejected backward leaves its forward waiting
    grads = function.backward([np.ones_like(y)])
    assert all(g is not None and np.isfinite(g).all() for g in grads)
    with pytest.raises(InvalidDataError):
        function.backward([np.ones_like(y)])


def test_bad_options_raise_lossgraph_errors() -> None:
    model = golden("skl_mlp_regressor")
    with pytest.raises(UnsupportedOptionError, match="backend"):
        OrtGradientForwardBackward(model, backend="torch")
    with pytest.raises(UnsupportedOptionError, match="graph_builder_config"):
        OrtGradientForwardBackward(model, graph_builder_config=object())
    with pytest.raises(UnknownNameError, match="coefficients"):
        OrtGradientForwardBackward(model, weights_to_train=["coefficients"])
    with pytest.raises(UnknownNameError, match="Y"):
        OrtGradientForwardBackward(model, output_names=["Y"])


@pytest.mark.skipif(HAS_TRAINING, reason="the training build is installed: backend='ort' runs")
def test_ort_backend_on_plain_onnxruntime_raises_runtime_unavailable() -> None:
    with pytest.raises(RuntimeUnavailableError, match="training build"):
        OrtGradientForwardBackward(golden("skl_mlp_regressor"), backend="ort")


# -- onnxruntime-training's builder ----------------------------------------------------


def _builder_config(weights: list[str], require_grad: list[str]):
    from onnxruntime.capi import _pybind_state as C

    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = weights
    config.initializer_names_to_train = weights
    config.input_names_require_grad = require_grad
    config.build_gradient_graph = True
    return config


@pytest.mark.training
def test_ort_builder_order_is_mapped_to_the_functions_order() -> None:
    model = golden("skl_mlp_regressor")
    reference = built("skl_mlp_regressor", "onnx")
    user_order = reference.weights_to_train
    builder_order = [user_order[i] for i in (3, 0, 2, 1)]
    fb = OrtGradientForwardBackward(model, graph_builder_config=_builder_config(
        builder_order, ["X"]), backend="ort")
    assert fb.weights_to_train == builder_order  # weights_to_train=None: the config's
    fb = OrtGradientForwardBackward(model, weights_to_train=user_order, backend="ort",
                                    graph_builder_config=_builder_config(builder_order, ["X"]))
    assert fb.weights_to_train == user_order
    assert list(fb._engine.graph_info.initializer_names_to_train) == builder_order
    assert [i.name for i in fb.gradient_onnx.graph.input] == ["X", *builder_order]

    inputs = inputs_of(reference, seed=5)
    seeds = cotangents([np.zeros((ROWS, 1), np.float32)], 5)
    expected_fn, got_fn = reference.new_instance(), fb.new_instance()
    np.testing.assert_allclose(got_fn.forward(inputs, training=True)[0],
                               expected_fn.forward(inputs, training=True)[0], rtol=1e-6)
    for got, want in zip(got_fn.backward(seeds), expected_fn.backward(seeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.training
def test_ort_builder_config_without_input_gradients() -> None:
    reference = built("skl_mlp_regressor", "onnx")
    fb = OrtGradientForwardBackward(golden("skl_mlp_regressor"), backend="ort",
                                    graph_builder_config=_builder_config(
                                        reference.weights_to_train, []))
    inputs = inputs_of(reference, seed=6)
    seeds = cotangents([np.zeros((ROWS, 1), np.float32)], 6)
    expected_fn, got_fn = reference.new_instance(), fb.new_instance()
    expected_fn.forward(inputs, training=True)
    got_fn.forward(inputs, training=True)
    got, want = got_fn.backward(seeds), expected_fn.backward(seeds)
    assert got[0] is None and want[0] is not None
    for a, b in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.training
def test_ort_builder_config_errors() -> None:
    model = golden("skl_mlp_regressor")
    weights = built("skl_mlp_regressor", "onnx").weights_to_train
    with pytest.raises(UnsupportedOptionError, match="different weights"):
        OrtGradientForwardBackward(model, weights_to_train=weights[:2], backend="ort",
                                   graph_builder_config=_builder_config(weights, ["X"]))
    with pytest.raises(UnknownNameError, match="input_names_require_grad"):
        OrtGradientForwardBackward(model, backend="ort",
                                   graph_builder_config=_builder_config(weights, ["Z"]))
    no_gradient = _builder_config(weights, ["X"])
    no_gradient.build_gradient_graph = False
    with pytest.raises(UnsupportedOptionError, match="build_gradient_graph"):
        OrtGradientForwardBackward(model, backend="ort", graph_builder_config=no_gradient)
    with pytest.raises(UnsupportedOptionError, match="YieldOp"):
        _ = built("skl_mlp_regressor", "ort").forward_onnx


# -- pickling --------------------------------------------------------------------------


def _round_trip_works(fb: OrtGradientForwardBackward) -> OrtGradientForwardBackward:
    restored = pickle.loads(pickle.dumps(fb))
    assert restored.backend == fb.backend
    assert restored.weights_to_train == fb.weights_to_train
    inputs = inputs_of(fb, seed=9)
    seeds = cotangents([np.zeros((ROWS, 1), np.float32)], 9)
    results = []
    for obj in (fb, restored):
        function = obj.new_instance()
        outputs = function.forward(inputs, training=True)
        results.append((outputs, function.backward(seeds), function.forward(inputs)))
    for group in range(3):
        for a, b in zip(results[0][group], results[1][group], strict=True):
            np.testing.assert_array_equal(a, b)
    return restored


@pytest.mark.parametrize("backend", BACKENDS)
def test_pickle_round_trip(backend: str) -> None:
    _round_trip_works(built("skl_mlp_regressor", backend))


@pytest.mark.training
def test_pickle_round_trip_keeps_the_builder_configuration() -> None:
    weights = built("skl_mlp_regressor", "onnx").weights_to_train[::-1]
    fb = OrtGradientForwardBackward(golden("skl_mlp_regressor"), backend="ort",
                                    graph_builder_config=_builder_config(weights, []))
    restored = _round_trip_works(fb)
    config = restored.graph_builder_config
    assert list(config.initializer_names_to_train) == weights
    assert list(config.input_names_require_grad) == []
    assert list(restored._engine.graph_info.initializer_names_to_train) == weights


def test_the_plan_declares_the_graphs_backend_onnx_builds() -> None:
    fb = built("hand_mlp_tanh_double", "onnx")
    assert str(fb.plan).splitlines() == [
        "predict  = lifted model -> InferenceMode",
        "gradient = lifted model -> Gradient(weights=('X', 'W1', 'B1', 'W2', 'B2'), "
        "outputs=('Y',))"]
    built_graphs = PlanRunner({"lifted model": WeightsToInputs(fb.weights_to_train)(
        fb.onnx_model).model}).build_all(fb.plan)
    assert built_graphs["predict"].model.graph == fb.eval_onnx.graph
    assert built_graphs["gradient"].model.graph == fb.gradient_onnx.graph


@pytest.mark.training
def test_backend_ort_has_no_plan_of_lossgraphs() -> None:
    with pytest.raises(UnsupportedOptionError, match="OrtModuleGraphBuilder builds its graphs"):
        print(built("hand_mlp_tanh_double", "ort").plan)
