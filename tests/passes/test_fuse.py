"""Fusion (lossgraph/passes/fuse.py): the epoch graph's Scan carries the weights and each
optimizer state as one flat vector, and the step counter only when the update reads it."""

from __future__ import annotations

import onnx
import pytest
from support.linear import LINEAR, linear_data

import lossgraph
from lossgraph.optim import Adam, Momentum


def test_epoch_scan_carries_weights_and_each_state_as_one_flat_vector():
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                fuse="epoch")
    for name in ("train_epoch", "train_epoch_ordered"):
        graph = program.graphs[name].graph
        (scan,) = [n for n in graph.node if n.op_type == "Scan"]
        body = scan.attribute[0].g
        carried = len(body.input) - scan.attribute[1].i  # weights, Adam's m and v, step
        assert carried == 4
        assert [i.type.tensor_type.shape.dim[0].dim_value for i in body.input[:3]] == [5] * 3
        # outside, the graph still reads and writes every weight and state by name
        step_inputs = {i.name for i in program.graphs["train_step"].graph.input}
        assert {i.name for i in program.graphs[name].graph.input} >= (
            step_inputs - {"x", "y", "learning_rate"})


@pytest.mark.parametrize("optimizer, reads_step", [(Adam(0.05), True),
                                                  (Momentum(0.05, nesterov=True), False)])
def test_epoch_scan_carries_the_step_counter_only_when_the_update_reads_it(optimizer,
                                                                           reads_step):
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=optimizer,
                                fuse="epoch")
    (scan,) = [n for n in program.graphs["train_epoch"].graph.node if n.op_type == "Scan"]
    body = scan.attribute[0].g
    assert any(i.type.tensor_type.elem_type == onnx.TensorProto.INT64
               for i in body.input) is reads_step
    assert any(n.op_type == "Add" and "next_step" in n.name for n in body.node) is reads_step
    X, y = linear_data(12, seed=3)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=4, progress=False)
    assert trainer.steps_ == 6  # the trainer counts the steps either way
