"""Plans and their runner (lossgraph/passes/plan.py): pipelines built apart share the passes
they have in common, run once."""

from __future__ import annotations

import onnx
from support.environment import GOLDEN_MODELS

import lossgraph
from lossgraph.passes import WeightsToInputs


def test_compile_runs_a_prefix_shared_by_equal_passes_once(monkeypatch):
    """Pipelines built apart share the passes they have in common (equal options): the
    epoch program lifts the weights of the loss model once for its four training and
    evaluation graphs, and the inference model's once."""
    calls = []
    real = WeightsToInputs.call
    monkeypatch.setattr(WeightsToInputs, "call", lambda self, model: calls.append(1)
                        or real(self, model))
    lossgraph.compile_program(onnx.load(GOLDEN_MODELS / "hand_linear.onnx"), fuse="epoch")
    assert len(calls) == 2
