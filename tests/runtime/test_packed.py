"""The packed update (lossgraph/runtime/packed.py): the update of every weight at once, on flat
vectors, gives the per-weight update bit for bit, and is made only from the update graph the
optimizer would build."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import lossgraph
from lossgraph.optim import update_graph
from lossgraph.runtime.packed import packed_update
from lossgraph.speed import WidenScalarConstants

WEIGHTS_OF_ANY_RANK = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
                       "s": np.array(0.5, np.float32), "b": np.array([[-1.0, 2.0]], np.float32),
                       "c": np.ones((2, 1, 3), np.float32)}


@pytest.mark.parametrize("optimizer", [
    lossgraph.optim.SGD(0.1), lossgraph.optim.Momentum(0.1, momentum=0.8),
    lossgraph.optim.Momentum(0.1, nesterov=True), lossgraph.optim.Adam(0.1),
    lossgraph.optim.AdamW(0.1, weight_decay=0.3)], ids=lambda o: repr(o).split("(")[0])
def test_the_packed_update_gives_the_per_weight_update_bit_for_bit(optimizer, run_model):
    weights = WEIGHTS_OF_ANY_RANK
    states = {w: optimizer.state_names(w) for w in weights}
    update = WidenScalarConstants()(update_graph(optimizer, weights)).model
    packed = packed_update(update, optimizer, weights)
    assert packed is not None
    assert len(packed.model.graph.node) < len(update.graph.node) / 2
    rng = np.random.default_rng(1)
    feeds = {"learning_rate": np.array(0.1, np.float32), "step": np.array(3, np.int64)}
    for weight, value in weights.items():
        feeds[weight] = np.asarray(value + rng.normal(size=value.shape), np.float32)
        feeds[f"{weight}_grad"] = np.asarray(rng.normal(size=value.shape), np.float32)
        feeds.update({s: np.asarray(np.abs(rng.normal(size=value.shape)), np.float32)
                      for s in states[weight]})
    expected = run_model(update, feeds)
    flat = {name: np.concatenate([feeds[n].ravel() for n in block])
            for name, block in packed.inputs.items()}
    flat[packed.gradient] = np.concatenate([feeds[f"{w}_grad"].ravel() for w in weights])
    got = run_model(packed.model, {**flat, "learning_rate": feeds["learning_rate"],
                                   "step": feeds["step"]})
    for output, block in packed.outputs.items():
        parts = np.split(got[output], np.cumsum([feeds[n].size for n in block])[:-1])
        for name, part in zip(block, parts):
            np.testing.assert_array_equal(part.reshape(feeds[name].shape),
                                          expected[f"{name}_new"], err_msg=name)


def test_the_packed_update_is_made_only_from_the_update_graph_it_would_build():
    """A program's update graph changed by hand runs as it is (no packed form), as do
    weights of several float types."""
    optimizer = lossgraph.optim.Momentum(0.1)
    weights = WEIGHTS_OF_ANY_RANK
    update = WidenScalarConstants()(update_graph(optimizer, weights)).model
    edited = onnx.ModelProto()
    edited.CopyFrom(update)
    edited.graph.node[0].op_type = "Add" if edited.graph.node[0].op_type != "Add" else "Mul"
    assert packed_update(edited, optimizer, weights) is None
    assert packed_update(update, lossgraph.optim.Momentum(0.1, momentum=0.5), weights) is None
    mixed = {**weights, "s": np.array(0.5, np.float64)}
    assert packed_update(update, optimizer, mixed) is None


def test_sgds_product_with_the_rate_is_written_over_the_gradient_it_reads():
    """SGD's packed update reads the flat gradient once, in ``gradient * learning_rate``:
    bound over the gradient's own array, that product needs no temporary of the size of the
    weights, and the weights come out as computed apart. Updates reading the gradient more
    than once (Adam's moments, clipping's norm) or into a state (a velocity) have none."""
    import onnxruntime

    weights = WEIGHTS_OF_ANY_RANK
    sgd = lossgraph.optim.SGD(0.1)
    packed = packed_update(WidenScalarConstants()(update_graph(sgd, weights)).model, sgd,
                           weights)
    assert packed.over_gradient in {o.name for o in packed.model.graph.output}
    clipping = lossgraph.update_options.UpdateOptions(max_grad_norm=1.0)
    for optimizer, options in [(lossgraph.optim.Momentum(0.1), None),
                               (lossgraph.optim.Adam(0.1), None), (sgd, clipping)]:
        update = WidenScalarConstants()(update_graph(optimizer, weights,
                                                     options=options)).model
        assert packed_update(update, optimizer, weights, options).over_gradient is None
    rng = np.random.default_rng(4)
    size = sum(np.asarray(w).size for w in weights.values())
    flat = rng.normal(size=size).astype(np.float32)
    gradient = rng.normal(size=size).astype(np.float32)
    rate = np.array(0.1, np.float32)
    expected = flat - gradient * rate
    session = onnxruntime.InferenceSession(packed.model.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    binding, bound = session.io_binding(), onnxruntime.OrtValue.ortvalue_from_numpy(gradient)
    written = np.empty_like(flat)
    binding.bind_ortvalue_input(packed.gradient, bound)
    binding.bind_ortvalue_output(packed.over_gradient, bound)
    binding.bind_cpu_input("weights", flat)
    binding.bind_cpu_input("learning_rate", rate)
    binding.bind_output("weights_new", "cpu", 0, np.float32, written.shape,
                        written.ctypes.data)
    before = gradient.copy()
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(written, expected)
    np.testing.assert_array_equal(bound.numpy(), before * rate)
