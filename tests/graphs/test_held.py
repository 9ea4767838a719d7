"""Weights held apart (lossgraph/graphs/held.py): the light model carries no weight data,
reads its weights' values from the store without copying them, passes onnx's checker, and
gets its data back byte for byte; a light model that outlives its store is an error."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import large_weights_model

from lossgraph.errors import InternalError
from lossgraph.graphs import (
    HeldWeights,
    is_held,
    tensor_array,
    with_weight_data,
    without_weight_data,
)


def test_a_held_model_has_no_weight_data_and_gets_it_back_byte_for_byte():
    model = large_weights_model()
    before = model.SerializeToString()
    store = HeldWeights()
    light = store.hold(model)
    weight, small, shape = light.graph.initializer
    assert is_held(weight) and not weight.HasField("raw_data")
    assert not is_held(small) and not is_held(shape)  # small tensors keep their data
    assert model.SerializeToString() == before  # the given model untouched
    assert light.ByteSize() < len(model.graph.initializer[0].raw_data)
    values = tensor_array(weight)
    np.testing.assert_array_equal(values, numpy_helper.to_array(model.graph.initializer[0]))
    assert tensor_array(weight) is values  # one array per weight, never a copy
    onnx.checker.check_model(without_weight_data(light)[0], full_check=True)
    assert with_weight_data(light).SerializeToString() == before


def test_a_model_without_large_weights_is_held_as_it_is():
    model = large_weights_model()
    assert HeldWeights(min_bytes=1 << 20).hold(model) is model  # W: 128 KiB
    assert with_weight_data(model) is model


def test_a_light_model_that_outlives_its_store_is_an_internal_error():
    store = HeldWeights()
    light = store.hold(large_weights_model())
    del store
    gc.collect()
    with pytest.raises(InternalError, match="outlived its store"):
        with_weight_data(light)
