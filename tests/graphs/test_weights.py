"""Large weights: onnx's checker and shape inference see a copy without their data (so that
a 440 MB model is not serialized dozens of times per compile), and nothing is lost by it:
the same types, the same verdicts, the same constants, the caller's model untouched."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.models import BIG, large_weights_model

import lossgraph
from lossgraph.errors import InvalidModelError
from lossgraph.graphs import ForwardFacts, without_weight_data
from lossgraph.passes import WeightsToInputs


def test_large_weights_become_inputs_of_their_type_and_small_constants_stay():
    model = large_weights_model()
    before = model.SerializeToString()
    light, aside = without_weight_data(model)
    assert [t.name for t in aside] == ["W"] and aside[0] is model.graph.initializer[0]
    assert [t.name for t in light.graph.initializer] == ["S", "shape"]
    (weight,) = [v for v in light.graph.input if v.name == "W"]
    assert weight.type == helper.make_tensor_type_proto(TensorProto.FLOAT, BIG)
    assert model.SerializeToString() == before
    inferred = [onnx.shape_inference.infer_shapes(m, strict_mode=True) for m in (model, light)]
    assert inferred[0].graph.value_info == inferred[1].graph.value_info
    assert inferred[0].graph.output == inferred[1].graph.output
    assert without_weight_data(light)[0] is light  # nothing left to set aside


def test_forward_facts_of_a_model_with_large_weights_know_their_values_and_types():
    model = large_weights_model()
    facts = ForwardFacts.of(model)
    np.testing.assert_array_equal(facts.constants["W"],
                                  numpy_helper.to_array(model.graph.initializer[0]))
    assert set(facts.constants) == {"W", "S", "shape"}
    assert facts.shapes["W"] == BIG and len(facts.shapes["r"]) == 2 and facts.shapes["y"][1] == 4


@pytest.mark.parametrize(("damage", "message"), [
    ("short", "raw_data size"), ("two value fields", "one and only one value field"),
    ("external", "external file")])
def test_a_large_weight_the_checker_would_refuse_is_still_refused(damage, message):
    big = numpy_helper.from_array(np.ones(BIG, np.float32), "W")
    if damage == "short":
        big.raw_data = big.raw_data[:-4]
    elif damage == "two value fields":
        big.float_data.append(1.0)
    else:
        big.data_location = TensorProto.EXTERNAL
    model = large_weights_model(big)
    assert without_weight_data(model)[1] == []  # left for the checker to see
    with pytest.raises(InvalidModelError, match=message):
        WeightsToInputs(["W"])(model)


def test_a_weight_that_is_also_a_graph_input_keeps_its_data():
    model = large_weights_model()
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, BIG))
    assert without_weight_data(model) == (model, [])


def test_an_ir3_model_whose_weight_is_no_input_is_still_refused():
    """IR version 3 wants every initializer listed as an input: setting the weight aside
    as an input would hide the error."""
    model = large_weights_model()
    model.ir_version = 3
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 8))
    assert without_weight_data(model) == (model, [])
    with pytest.raises(InvalidModelError, match="W in initializer but not in graph input"):
        WeightsToInputs(["W"])(model)


def test_a_model_with_large_weights_compiles_to_the_weights_it_was_given():
    model = large_weights_model()
    program = lossgraph.compile_program(model, fuse="step")
    for tensor in model.graph.initializer[:2]:
        np.testing.assert_array_equal(program.state[tensor.name],
                                      numpy_helper.to_array(tensor))


def test_held_apart_sets_aside_exactly_the_data_the_values_hold_and_put_back_restores_it():
    """A program keeps its inference model without the weights its state holds (issue 27):
    only raw data equal to the value byte for byte is set aside (a value of another dtype,
    shape or bits, -0.0 for 0.0 included, and data stored as float_data stay), and the
    model comes back byte-identical."""
    model = large_weights_model()
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    model.graph.initializer.append(helper.make_tensor("F", TensorProto.FLOAT, [2], [1.0, 2.0]))
    values = {**weights, "S": -weights["S"], "shape": weights["shape"].astype(np.int32),
              "F": np.array([1.0, 2.0], np.float32), "absent": np.zeros(3)}
    signed = np.zeros(2, np.float32)
    model.graph.initializer.append(numpy_helper.from_array(signed, "Z"))
    values["Z"] = -signed
    light, apart = lossgraph.graphs.held_apart(model, values)
    assert apart == {"W"}
    assert not next(t for t in light.graph.initializer if t.name == "W").raw_data
    assert light.ByteSize() < model.ByteSize() - weights["W"].nbytes
    restored = lossgraph.graphs.put_back(light, values, apart)
    assert restored.SerializeToString() == model.SerializeToString()
