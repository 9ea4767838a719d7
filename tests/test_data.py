"""lossgraph/data.py's conversion: data of another dtype than the model's, converted as
scikit-learn's check_array converts.

float64 data (every scikit-learn dataset), integers and bools for a float32 model are cast
to float32, float32 data for a float64 model to float64; a value the cast would make
infinite is refused by row and column (tests/test_bad_inputs.py's ``*-beyond-float32``
cases), text, complex and object values are refused, and class labels stay whole numbers.
Everywhere data come in: the Trainer (fit, evaluate, predict, validation data, streamed
batches), the onnxcustom estimators, GraphFunction and the data-parallel Replica (``lossgraph
train --data``: tests/cli/test_data.py). The caller's arrays are never written.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.linear import LINEAR, linear_data

import lossgraph
from lossgraph.errors import DTypeMismatchError, InvalidDataError
from lossgraph.optim import SGD, Momentum

X, Y = linear_data(120, seed=5)
FIT = {"epochs": 2, "batch_size": 16, "random_state": 0, "progress": False}


def linear(dtype: str = "float") -> onnx.ModelProto:
    return onnx.parser.parse_model(LINEAR.replace("float", dtype))


def trained(X_data, y_data, model: onnx.ModelProto | None = None, fuse: str = "step",
            **fit_options) -> lossgraph.Trainer:
    program = lossgraph.compile_program(linear() if model is None else model,
                                        optimizer=Momentum(0.01), fuse=fuse)
    return lossgraph.Trainer(program).fit(X_data, y_data, **{**FIT, **fit_options})


def assert_same_state(a: lossgraph.Trainer, b: lossgraph.Trainer) -> None:
    for name, value in a.state.items():
        np.testing.assert_array_equal(b.state[name], value, err_msg=name)
        assert b.state[name].dtype == value.dtype


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_float64_data_train_as_their_float32_values(fuse):
    # float32 -> float64 -> float32 is exact: the same state, step for step
    reference = trained(X, Y, fuse=fuse)
    converted = trained(X.astype(np.float64), Y.astype(np.float64), fuse=fuse,
                        validation_data=(X.astype(np.float64), Y.astype(np.float64)))
    assert_same_state(reference, converted)
    assert converted.train_losses_ == reference.train_losses_


def test_float64_data_round_to_the_nearest_float32_as_scikit_learn_does():
    sklearn_validation = pytest.importorskip("sklearn.utils.validation")
    rng = np.random.default_rng(1)
    X64 = rng.normal(size=(120, 4)) * 3.0  # not float32 values: each is rounded
    y64 = X64 @ [1.0, -2.0, 0.5, 3.0]
    as_sklearn = sklearn_validation.check_array(X64, dtype=np.float32)
    assert_same_state(trained(as_sklearn, y64.astype(np.float32)), trained(X64, y64))


def test_evaluate_and_predict_take_float64():
    trainer = trained(X, Y)
    assert trainer.evaluate(X.astype(np.float64), Y.astype(np.float64)) == trainer.evaluate(X, Y)
    np.testing.assert_array_equal(trainer.predict(X.astype(np.float64)), trainer.predict(X))
    assert trainer.predict(X.astype(np.float64)).dtype == np.float32


def test_integers_and_bools_are_cast_to_the_float_input():
    counts = np.random.default_rng(2).integers(0, 9, size=(120, 4))
    reference = trained(counts.astype(np.float32), Y)
    assert_same_state(reference, trained(counts, Y))  # int64
    assert_same_state(reference, trained(counts.astype(np.uint8), Y))
    flags = counts > 4
    assert_same_state(trained(flags.astype(np.float32), Y), trained(flags, Y))


def test_float32_data_for_a_float64_model_are_cast_exactly():
    model = linear("double")
    reference = trained(X.astype(np.float64), Y.astype(np.float64), model)
    converted = trained(X, Y, model)
    assert_same_state(reference, converted)
    assert converted.state["coef"].dtype == np.float64


def test_streamed_batches_are_converted_too():
    batches = [(X[i:i + 16].astype(np.float64), Y[i:i + 16].astype(np.float64))
               for i in range(0, len(X), 16)]
    reference = [(X[i:i + 16], Y[i:i + 16]) for i in range(0, len(X), 16)]
    options = {"epochs": 1, "progress": False}
    program = lossgraph.compile_program(linear(), optimizer=SGD(0.01))
    a = lossgraph.Trainer(program).fit(reference, **options)
    b = lossgraph.Trainer(program).fit(batches, **options)
    assert_same_state(a, b)


def test_sample_weights_are_converted():
    program = lossgraph.compile_program(linear(), optimizer=SGD(0.01),
                                        loss_options={"weight_name": "sample_weight"})
    weights = np.linspace(0.5, 2.0, len(X))
    a = lossgraph.Trainer(program).fit(X, Y, sample_weight=weights.astype(np.float32), **FIT)
    b = lossgraph.Trainer(program).fit(X, Y, sample_weight=weights, **FIT)
    assert_same_state(a, b)


@pytest.mark.parametrize("layout", ["c", "fortran", "strided", "read-only"])
def test_the_callers_float64_arrays_are_never_written(layout):
    X64, y64 = X.astype(np.float64), Y.astype(np.float64)
    if layout == "fortran":
        X64 = np.asfortranarray(X64)
    elif layout == "strided":
        X64 = np.repeat(X64, 2, axis=1)[:, ::2]
    elif layout == "read-only":
        X64.setflags(write=False)
        y64.setflags(write=False)
    before = X64.copy(), y64.copy()
    trainer = trained(X64, y64, validation_data=(X64, y64))
    trainer.evaluate(X64, y64)
    trainer.predict(X64)
    trainer.fit(X64, y64, warm_start=True, **FIT)
    np.testing.assert_array_equal(X64, before[0])
    np.testing.assert_array_equal(y64, before[1])
    assert X64.dtype == np.float64 and y64.dtype == np.float64
    assert X64.flags.writeable == (layout != "read-only")


def test_a_refused_overflow_leaves_the_trainer_and_the_data_untouched():
    program = lossgraph.compile_program(linear(), optimizer=SGD(0.01))
    trainer = lossgraph.Trainer(program)
    X64 = X.astype(np.float64)
    X64[9, 3] = -1e39
    before = X64.copy()
    with pytest.raises(InvalidDataError, match="row 9, column 3, beyond the range of float32"):
        trainer.fit(X64, Y, **FIT)
    assert trainer.steps_ == 0
    np.testing.assert_array_equal(X64, before)
    with pytest.raises(InvalidDataError, match="row 9, column 3"):
        trainer.predict(X64)
    X64[9, 3] = np.finfo(np.float32).max  # the largest float32 itself is no overflow
    trainer.predict(X64)


def test_nan_and_infinity_in_float64_data_are_named_as_such_not_as_overflow():
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear(), optimizer=SGD(0.01)))
    X64 = X.astype(np.float64)
    X64[4, 1] = np.inf
    with pytest.raises(InvalidDataError, match="holds inf at row 4, column 1: clean or impute"):
        trainer.fit(X64, Y, **FIT)


@pytest.mark.parametrize(("values", "error", "fragment"), [
    (np.full((len(X), 4), "1.5"), DTypeMismatchError, "holds <U3 values, not numbers"),
    (X.astype(np.complex64), DTypeMismatchError, "holds complex64 values"),
    (X.astype(object), DTypeMismatchError, "holds object values, not numbers"),
])
def test_text_complex_and_object_arrays_are_still_refused(values, error, fragment):
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear(), optimizer=SGD(0.01)))
    with pytest.raises(error, match=fragment):
        trainer.fit(values, Y, **FIT)


#: Class scores (logits), trained with multiclass_log_loss from_logits.
CLASSIFIER = """
    <ir_version: 8, opset_import: ["" : 18]>
    clf (float[N, 4] x) => (float[N, 3] y)
    <float[4, 3] W = {0.1, 0.2, 0.3, -0.1, 0.0, 0.2, 0.1, -0.3, 0.2, 0.05, 0.1, -0.2},
     float[3] b = {0.0, 0.1, -0.1}>
    { h = MatMul(x, W)
      y = Add(h, b) }
"""


def test_class_labels_stay_whole_numbers():
    program = lossgraph.compile_program(onnx.parser.parse_model(CLASSIFIER), optimizer=SGD(0.1),
                                        loss="multiclass_log_loss",
                                        loss_options={"from_logits": True})
    labels = np.arange(len(X)) % 3
    reference = lossgraph.Trainer(program).fit(X.astype(np.float64), labels, **FIT)
    for given in (labels.astype(np.int32), labels.astype(np.uint8), labels.tolist(),
                  labels.astype(np.float64).tolist()):  # a list of whole floats: no dtype
        assert_same_state(reference, lossgraph.Trainer(program).fit(X, given, **FIT))
    with pytest.raises(DTypeMismatchError, match="class labels are whole numbers"):
        lossgraph.Trainer(program).fit(X, labels.astype(np.float64), **FIT)
    with pytest.raises(DTypeMismatchError, match="holds 0.5 at row 1, not a whole number"):
        lossgraph.Trainer(program).fit(X, [0, 0.5, *labels[2:].tolist()], **FIT)


# -- the onnxcustom estimators ----------------------------------------------------------------


def test_the_estimators_fit_scikit_learns_float64_datasets():
    datasets = pytest.importorskip("sklearn.datasets")
    linear_model = pytest.importorskip("sklearn.linear_model")
    skl2onnx = pytest.importorskip("skl2onnx")
    from lossgraph.compat import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

    X64, y64 = datasets.make_regression(200, 5, noise=1.0, random_state=0)
    before = X64.copy(), y64.copy()
    X32 = X64.astype(np.float32)
    model = skl2onnx.to_onnx(linear_model.LinearRegression().fit(X32[:20], y64[:20]), X32[:1],
                             target_opset=18)
    options = {"max_iter": 3, "learning_rate": 1e-3, "random_state": 0}
    for make in (lambda: OrtGradientForwardBackwardOptimizer(model, **options),
                 lambda: OrtGradientOptimizer(lossgraph.add_loss_output(model), None, **options)):
        reference = make().fit(X32, y64.astype(np.float32))
        estimator = make().fit(X64, y64)  # as the docs' examples give them
        for name, value in reference.get_state().items():
            np.testing.assert_array_equal(estimator.get_state()[name], value, err_msg=name)
        np.testing.assert_array_equal(estimator.predict(X64), reference.predict(X32))
        assert estimator.score(X64, y64) == reference.score(X32, y64.astype(np.float32))
    np.testing.assert_array_equal(X64, before[0])
    np.testing.assert_array_equal(y64, before[1])


# -- GraphFunction (onnxcustom's OrtGradientForwardBackward), the Replica ------------------------


def test_graph_function_converts_numpy_inputs_and_gradients():
    from lossgraph.runtime.graph_function import GraphFunction

    function = GraphFunction(linear())
    weights = [function.get_initializer(name) for name in function.weights_to_train]
    a, b = function.new_instance(), function.new_instance()
    X64 = X.astype(np.float64)
    (out_a,) = a.forward([X, *weights], training=True)
    (out_b,) = b.forward([X64, *(w.astype(np.float64) for w in weights)], training=True)
    np.testing.assert_array_equal(out_a, out_b)
    seed = np.ones_like(out_a)
    for grad_a, grad_b in zip(a.backward([seed]), b.backward([seed.astype(np.float64)])):
        np.testing.assert_array_equal(grad_a, grad_b)
        assert grad_b.dtype == np.float32
    np.testing.assert_array_equal(X64, X)


def test_the_replica_prepares_float64_data():
    from lossgraph.parallel import ParallelProgram, Replica

    replica = Replica(ParallelProgram.compile(linear(), optimizer=SGD(0.01)), None)
    data = replica.prepare(X.astype(np.float64), Y.astype(np.float64))
    expected = replica.prepare(X, Y)
    for name, array in expected.items():
        np.testing.assert_array_equal(data[name], array)
        assert data[name].dtype == array.dtype

