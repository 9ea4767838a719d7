"""The training engine (lossgraph/runtime/engine.py), held to its documented contract through
its public methods only: a step writes the next state beside the live one, ``apply`` makes
it live, ``step_back`` returns once; every fusion mode's step is plain SGD's update."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from support.linear import COEF, INTERCEPT, linear_data, linear_program

from lossgraph.errors import UnsupportedOptionError
from lossgraph.optim import SGD
from lossgraph.runtime import Engine, Trainer

RATE = 0.05


def sgd_step(coef: np.ndarray, intercept: np.ndarray, X: np.ndarray, y: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, float]:
    """One step of SGD on the mean squared error of ``X @ coef + intercept``, in numpy: the
    next weights and the loss at the given ones."""
    residual = X @ coef.ravel() + intercept.ravel() - y
    loss = float(np.mean(residual ** 2))
    grad_coef = 2 * X.T @ residual / len(y)
    grad_intercept = 2 * residual.mean()
    return (coef - RATE * grad_coef.reshape(coef.shape),
            intercept - RATE * grad_intercept, loss)


@pytest.mark.parametrize("fuse", ["separate", "step", "epoch"])
def test_a_step_is_pending_until_applied_and_is_sgds_update(fuse):
    engine = Engine(linear_program(fuse, SGD(RATE)))
    X, y = linear_data(8, seed=0)
    data = engine.prepare(X, y)
    before = engine.state
    loss = engine.step(data, step=1, rate=RATE)
    pending = engine.state
    assert all(np.array_equal(pending[n], before[n]) for n in before), \
        "a step must leave the live state as it was until apply"
    engine.apply(1, "batch 0")
    after = engine.state
    coef, intercept, expected_loss = sgd_step(before["coef"], before["intercept"], X, y)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    np.testing.assert_allclose(after["coef"], coef, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["intercept"], intercept, rtol=1e-5, atol=1e-6)
    assert engine.evaluate(data) == pytest.approx(
        float(np.mean((X @ coef.ravel() + intercept.ravel() - y) ** 2)), rel=1e-5)


def test_step_back_returns_to_the_state_before_the_last_applied_run_once():
    engine = Engine(linear_program("step", SGD(RATE)))
    data = engine.prepare(*linear_data(8, seed=1))
    assert engine.step_back() is None  # nothing applied yet
    start = engine.state
    engine.step(data, step=1, rate=RATE)
    engine.apply(1, "epoch 0, batch 0")
    first = engine.state
    engine.step(data, step=2, rate=RATE)
    engine.apply(1, "epoch 0, batch 1")
    assert engine.step_back() == (1, "epoch 0, batch 1")
    assert all(np.array_equal(engine.state[n], first[n]) for n in first)
    assert engine.step_back() is None, "the state before is kept for one step back only"
    engine.reset()
    assert all(np.array_equal(engine.state[n], start[n]) for n in start)


@pytest.mark.parametrize("fuse", ["separate", "step", "epoch"])
def test_two_buffer_sets_or_one_train_as_three_and_keep_no_state_to_step_back_to(fuse):
    X, y = linear_data(12, seed=3)
    runs = {}
    for sets, options in ((3, {"keep_previous_state": True}),
                          (2, {"keep_previous_state": False, "in_place": False}),
                          (1, {"keep_previous_state": False})):
        trainer = Trainer(linear_program(fuse, SGD(RATE)), **options)
        if fuse == "epoch" and sets == 1:  # its Scan writes the state apart
            assert trainer.engine.ring.sets == 2
            continue
        assert trainer.engine.ring.sets == sets
        assert trainer.engine.keeps_previous_state is (sets == 3)
        trainer.fit(X, y, epochs=2, batch_size=4, shuffle=False, progress=False)
        runs[sets] = trainer.state
        assert (trainer.engine.step_back() is not None) is (sets == 3)
    assert all(np.array_equal(runs[3][n], run[n]) for run in runs.values() for n in runs[3])


def test_the_state_before_the_last_step_is_kept_by_default_for_small_states_only():
    from lossgraph.runtime.engine import KEEP_PREVIOUS_MAX_BYTES

    program = linear_program("step", SGD(RATE))
    assert sum(a.nbytes for a in program.state.values()) <= KEEP_PREVIOUS_MAX_BYTES
    assert Engine(program).keeps_previous_state
    with pytest.raises(UnsupportedOptionError, match="keep_previous_state"):
        Engine(program, keep_previous_state="no")


def test_an_epoch_run_is_its_steps_one_after_the_other():
    X, y = linear_data(12, seed=2)
    stepped = Engine(linear_program("epoch", SGD(RATE)))
    for t, rows in enumerate((slice(0, 4), slice(4, 8), slice(8, 12)), start=1):
        stepped.step(stepped.prepare(X[rows], y[rows]), step=t, rate=RATE, full=4)
        stepped.apply(1, f"batch {t}")
    fused = Engine(linear_program("epoch", SGD(RATE)))
    assert fused.runs_epochs
    losses = fused.epoch(fused.prepare(X, y), None, 3, 4, first_step=1,
                         rates=np.full(3, RATE, np.float32))
    fused.apply(3, "epoch 0")
    assert len(losses) == 3
    for name, value in stepped.state.items():
        np.testing.assert_allclose(fused.state[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fuse, in_place, match", [("step", None, "fuse='epoch'"),
                                                    ("epoch", True, "in_place=False")])
def test_an_engine_without_an_epoch_graph_to_run_refuses_an_epoch_run_saying_why(
        fuse, in_place, match):
    engine = Engine(linear_program(fuse, SGD(RATE)), in_place=in_place)
    assert not engine.runs_epochs
    with pytest.raises(UnsupportedOptionError, match=match):
        engine.epoch(engine.prepare(*linear_data(4, seed=3)), None, 1, 4, first_step=1,
                     rates=np.full(1, RATE, np.float32))


def test_the_trainer_trains_what_the_engine_steps():
    """The Trainer is a loop over the engine: one epoch of full-batch SGD is one engine
    step, to the bit."""
    X, y = linear_data(8, seed=4)
    program = linear_program("step", SGD(RATE))
    trainer = Trainer(program).fit(X, y, epochs=1, batch_size=8, shuffle=False,
                                   progress=False)
    engine = Engine(program)
    engine.step(engine.prepare(X, y), step=1, rate=RATE, full=8)
    engine.apply(1, "epoch 0")
    for name, value in engine.state.items():
        assert np.array_equal(trainer.state[name], value), name


def test_predict_reads_the_live_weights():
    engine = Engine(linear_program("step", SGD(RATE)))
    X, _ = linear_data(5, seed=5)
    prediction = engine.predict(engine.prepare(X, graph="predict", with_label=False))
    np.testing.assert_allclose(np.ravel(prediction), X @ np.array(COEF) + INTERCEPT,
                               rtol=1e-5, atol=1e-6)


def test_sessions_run_without_the_memory_pattern_or_planned_reuse_unless_told_so():
    """onnxruntime's memory pattern allocates a run's values again from the second run on,
    beside the arena holding the first's: a step's memory grew after the first step; its
    planned buffer reuse holds a buffer from its first value to its last (issue 27). The
    engine's sessions leave both off by default, a dict of settings may turn one back on,
    and onnxruntime's SessionOptions given are used as given."""
    from lossgraph.runtime.session import quiet_session_options

    program = linear_program("step")

    def options(session_options=None):
        made = Engine(program, session_options=session_options).session("train_step")
        given = made.get_session_options()
        return given.enable_mem_pattern, given.enable_mem_reuse

    assert options() == (False, False)
    assert options({"enable_mem_reuse": True}) == (False, True)
    assert options(quiet_session_options()) == (True, True)


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_planned_buffer_reuse_changes_where_values_live_not_the_weights(fuse):
    """Without onnxruntime's planned reuse (lossgraph's default) a network trains to the
    same weights bit for bit as with it: recomputed activations, the in-place update and
    an epoch's Scan included."""
    from support.models import gelu_mlp

    import lossgraph

    program = lossgraph.compile_program(gelu_mlp(16), loss="squared_error", optimizer=SGD(0.1),
                                        fuse=fuse, recompute="activations")
    rng = np.random.default_rng(3)
    X = rng.normal(size=(24, 3)).astype(np.float32)
    y = rng.normal(size=(24, 1)).astype(np.float32)
    states = []
    for reuse in (False, True):
        trainer = Trainer(program, session_options={"intra_op_num_threads": 1,
                                                    "enable_mem_reuse": reuse})
        trainer.fit(X, y, epochs=3, batch_size=8, shuffle=False, progress=False)
        states.append(trainer.state)
    assert states[0].keys() == states[1].keys()
    for name, value in states[0].items():
        np.testing.assert_array_equal(value, states[1][name], err_msg=name)


# -- frozen weights held once -----------------------------------------------------------------


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_sessions_feed_the_programs_frozen_weights_without_a_copy(fuse):
    """A LoRA program's sessions take its frozen base weight as an input fed from its store
    (the OrtValue aliases the store's array; onnxruntime copies initializers, external ones
    included), hidden from the inputs a caller feeds, and train as sessions of the whole
    graphs do (onnxruntime's SessionOptions given: the weights copied into the model)."""
    from support.frozen import frozen_data, frozen_program

    from lossgraph.runtime.session import default_session_options, onnxruntime_module

    program, (X, y) = frozen_program("lora", fuse), frozen_data()
    light = Trainer(program, session_options={"intra_op_num_threads": 1})
    whole = Trainer(program, session_options=default_session_options(intra_op_num_threads=1))
    for trainer in (light, whole):
        trainer.fit(X, y, epochs=2, batch_size=4, shuffle=False, progress=False)
    np.testing.assert_allclose(light.train_losses_, whole.train_losses_, rtol=1e-6)
    np.testing.assert_allclose(light.predict(X), whole.predict(X), rtol=1e-5, atol=1e-6)
    assert light.evaluate(X, y) == pytest.approx(whole.evaluate(X, y), rel=1e-6)
    for name, value in light.state.items():
        np.testing.assert_allclose(value, whole.state[name], rtol=1e-5, atol=1e-7)
    frozen = program.frozen
    fed = 0
    for graph, batch in light.engine.open_sessions:
        if graph == "packed update":
            continue
        session = light.engine.session(graph, batch)
        graph_inputs = onnxruntime_module().InferenceSession.get_inputs(session)
        inputs = {value.name for value in graph_inputs}
        assert not inputs & {value.name for value in session.get_inputs()} & set(frozen)
        for name, array in session.frozen.items():
            value = session.frozen_values[name]
            assert name in inputs and np.shares_memory(array, frozen[name])
            assert value.data_ptr() == array.__array_interface__["data"][0]
            fed += 1
    assert fed >= 1
    assert all(not whole.engine.session(*key).frozen
               for key in whole.engine.open_sessions if key[0] != "packed update")
    copied = pickle.loads(pickle.dumps(light))  # its settings kept, its weights held again
    assert copied.session_options == {"intra_op_num_threads": 1}
    np.testing.assert_array_equal(copied.predict(X), light.predict(X))

