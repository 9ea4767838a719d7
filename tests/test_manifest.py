"""The manifest: who is who among each graph's inputs and outputs, whatever the names."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.linear import linear_data, linear_model, linear_program

import lossgraph
from lossgraph.optim import Adam, Momentum

MODES = ["separate", "step", "epoch"]


def linear(coef: str, intercept: str) -> onnx.ModelProto:
    """``y = x @ <coef> + <intercept>`` with weights of the given names."""
    return linear_model(coef_name=coef, intercept_name=intercept)


#: weight names lossgraph would otherwise invent for itself: a state, a gradient, the
#: learning rate and step, the penalty and its gradient, a next value
CLASHING = [("w", "w_velocity"), ("learning_rate", "step"), ("w", "w_grad"),
            ("w", "penalty"), ("w", "w_penalty_grad"), ("w", "w_new"), ("w", "w_m")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("coef", "intercept"), CLASHING)
def test_a_weight_named_like_what_lossgraph_invents_trains_as_any_other(mode, coef, intercept):
    """The names lossgraph invents are free ones in every mode: the program trains as
    the same model with plain names does, to the last bit, and every weight keeps its
    role in every graph."""
    X, y = linear_data(50, seed=3)
    optimizer = Adam(0.05) if intercept == "w_m" else Momentum(0.05)
    runs = []
    for names in ((coef, intercept), ("coef", "intercept")):
        program = lossgraph.compile_program(linear(*names), fuse=mode, optimizer=optimizer,
                                            penalty={names[0]: 0.01, names[1]: 0.02})
        for graph in program.manifest["graphs"].values():
            roles = {v["name"]: v["role"] for v in graph["inputs"]}
            assert all(roles.get(w, "weight") == "weight" for w in names)
        trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=16,
                                                 random_state=0, progress=False)
        runs.append((trainer.train_losses_, [trainer.state[n] for n in names]))
    assert runs[0][0] == runs[1][0]
    for got, expected in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(got, expected)


def test_manifest_gives_every_training_input_a_role():
    manifest = linear_program("epoch").manifest
    roles = {i["name"]: i["role"] for i in manifest["graphs"]["train_epoch"]["inputs"]}
    assert roles == {"x": "feature", "label": "label", "permutation": "permutation",
                     "learning_rates": "learning_rates", "step": "step", "coef": "weight",
                     "intercept": "weight", "coef_velocity": "state",
                     "intercept_velocity": "state"}
    assert manifest["optimizer"] == {"type": "Momentum", "learning_rate": 0.01, "momentum": 0.9,
                                     "nesterov": True}
