"""The separate mode's step (lossgraph/runtime/separate_step.py): a full batch runs the graphs
specialized to it with every exchanged value in a preallocated buffer, a last, smaller batch
the general graphs one by one; all give the same numbers, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph


@pytest.mark.parametrize("optimizer", [lossgraph.optim.Momentum(0.01, nesterov=True),
                                       lossgraph.optim.Adam(0.01)], ids=["nesterov", "adam"])
@pytest.mark.parametrize("penalty", [None, {"coefficient": {"l1": 0.01, "l2": 0.02}}])
@pytest.mark.parametrize(("name", "runs"), [("skl_mlp_regressor", 1),
                                            ("hand_mlp_tanh_double", 3)])
def test_separate_step_with_bound_buffers_equals_the_step_binding_as_it_goes(name, runs,
                                                                             penalty, optimizer):
    """A full batch runs the graphs specialized to it with every exchanged value in a
    preallocated buffer, the forward half, the loss and the backward half in one run (in
    three where the model's opset is not the loss graph's), and (where the Trainer packs
    the state) the update of every weight at once; a last, smaller batch the general
    graphs one by one. All give the same numbers, bit for bit."""
    from lossgraph.runtime.separate_step import SeparateStep

    model = onnx.load(GOLDEN_MODELS / f"{name}.onnx")
    weight = next(i.name for i in model.graph.initializer if i.dims)
    program = lossgraph.compile_program(model, fuse="separate", optimizer=optimizer,
                                        penalty=penalty and {weight: penalty["coefficient"]})
    dtype = program.state[weight].dtype
    rng = np.random.default_rng(0)
    feature = program.io("gradient", "feature")[0]
    X = rng.normal(size=(8, 5)).astype(dtype)
    y = rng.normal(size=(8, 1)).astype(dtype)
    states, kinds = [], []
    for batch, packs in ((8, True), (8, False), (None, True)):
        engine = lossgraph.runtime.Engine(program)
        assert engine.packed is not None
        step = SeparateStep(program, engine.ring, engine.new_session, engine.runner,
                            batch, engine.packed if packs else None)
        kinds.append((step.static, step.static and step.runs,
                      ("packed update", None) in engine.open_sessions))
        losses = []
        for number in range(1, 4):
            engine.set_scalars(number, 0.01)
            losses.append(step.run({feature: X, program.io("loss", "label")[0]: y}))
            engine.apply(1, f"step {number}")
        states.append((losses, engine.state))
    # (bound buffers, runs for forward, loss and backward, packed update)
    assert kinds == [(True, runs, True), (True, runs, False), (False, False, False)]
    for losses, state in states[1:]:
        assert losses == states[0][0]
        for name_, value in state.items():
            np.testing.assert_array_equal(value, states[0][1][name_], err_msg=name_)
    assert not np.array_equal(states[0][1][weight], program.state[weight])
