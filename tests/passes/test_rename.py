"""alphabetize_initializers and rename_values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import UNSORTED

from lossgraph import add_loss_output, alphabetize_initializers, get_roles
from lossgraph.errors import UnknownNameError


def test_weights_are_renamed_so_alphabetical_order_is_graph_order():
    model = onnx.parser.parse_model(UNSORTED)
    renamed, mapping = alphabetize_initializers(model)
    assert mapping == {"z_weight": "I0_z_weight", "a_bias": "I1_a_bias"}
    names = [t.name for t in renamed.graph.initializer]
    assert names == ["I0_z_weight", "I1_a_bias"] and names == sorted(names)


def test_renaming_reaches_into_subgraphs_and_keeps_results(run_model, rng):
    model = onnx.parser.parse_model(UNSORTED)
    renamed, _ = alphabetize_initializers(model)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    for flag in (True, False):
        feeds = {"x": x, "flag": np.array(flag)}
        np.testing.assert_array_equal(run_model(renamed, feeds)["y"], run_model(model, feeds)["y"])
    branch_inputs = {i for n in renamed.graph.node if n.op_type == "If"
                     for a in n.attribute for sub in [a.g] for m in sub.node for i in m.input}
    assert "I1_a_bias" in branch_inputs and "a_bias" not in branch_inputs


def test_sorted_names_are_left_alone():
    model = onnx.parser.parse_model(UNSORTED.replace("z_weight", "b_weight"))
    model.graph.initializer.sort(key=lambda t: t.name)
    renamed, mapping = alphabetize_initializers(model)
    assert mapping == {"a_bias": "a_bias", "b_weight": "b_weight"}
    assert renamed.SerializeToString() == alphabetize_initializers(model)[0].SerializeToString()


def test_explicit_names_limit_what_is_renamed():
    model = onnx.parser.parse_model(UNSORTED)
    _, mapping = alphabetize_initializers(model, ["a_bias"])
    assert mapping == {"a_bias": "a_bias"}


def test_roles_follow_the_renaming():
    model = add_loss_output(onnx.parser.parse_model(UNSORTED), penalty={"a_bias": 0.1})
    renamed, mapping = alphabetize_initializers(model)
    assert get_roles(renamed) == get_roles(model)
    assert set(mapping.values()) <= {t.name for t in renamed.graph.initializer}


def test_unknown_name_is_an_error_with_a_suggestion():
    with pytest.raises(UnknownNameError, match="Did you mean 'a_bias'"):
        alphabetize_initializers(onnx.parser.parse_model(UNSORTED), ["a_bas"])


def test_generated_names_avoid_existing_ones():
    taken = UNSORTED.replace("h = MatMul", "I0_z_weight = Identity(x)\n h = MatMul")
    model = onnx.parser.parse_model(taken)
    _, mapping = alphabetize_initializers(model)
    assert mapping["z_weight"] == "I0_z_weight_1"
