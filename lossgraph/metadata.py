"""The keys lossgraph writes into a model's ``metadata_props``, and JSON records under them.

    lossgraph.roles       {"loss": ..., "label": ..., "prediction": ...[, "sample_weight": ...]}
                          which tensor plays which role in a loss model (lossgraph.roles)
    lossgraph.loss        {"ignore_index": k, "class_weight": [...]}, each when set: the label
                          value the loss ignores (the Trainer accepts it) and the weight of
                          each class (batch means combine by them), written by add_loss_output
    lossgraph.gradients   {weight: gradient output}, written by the gradient pass
    lossgraph.signature   who is who among a training graph's inputs and outputs
                          (lossgraph.signature.Signature), written by the fusion passes
    lossgraph.buffers     {buffer: its next value's output}, written by RunningStatistics
                          (lossgraph.passes.running_stats)
    lossgraph.adapters    [{"weight": ..., "module": ..., "a": ..., "b": ..., ...}]: the LoRA
                          adapters AddLoRA wrote (lossgraph.adapters.Adapter), kept by every
                          later pass; merge_adapters removes it with the branches
    lossgraph.written_by  "lossgraph": marks a file lossgraph wrote (lossgraph.fileio)

A pass records what later passes need in the model itself, so the data flows forward
through the pipeline.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

__all__ = ["ROLES_KEY", "LOSS_KEY", "GRADIENTS_KEY", "SIGNATURE_KEY", "BUFFERS_KEY",
           "ADAPTERS_KEY", "WRITTEN_BY_KEY", "read_text", "read_json", "write_json",
           "remove_record"]

ROLES_KEY = "lossgraph.roles"
LOSS_KEY = "lossgraph.loss"
GRADIENTS_KEY = "lossgraph.gradients"
SIGNATURE_KEY = "lossgraph.signature"
BUFFERS_KEY = "lossgraph.buffers"
ADAPTERS_KEY = "lossgraph.adapters"
WRITTEN_BY_KEY = "lossgraph.written_by"


def read_text(model: onnx.ModelProto, key: str) -> str | None:
    """The value recorded under ``key``, or ``None``."""
    return next((p.value for p in model.metadata_props if p.key == key), None)


def read_json(model: onnx.ModelProto, key: str) -> Any:
    """The JSON value recorded under ``key`` (``None`` when there is none). Callers that
    read a record users may have edited check its structure themselves."""
    text = read_text(model, key)
    return None if text is None else json.loads(text)


def write_json(model: onnx.ModelProto, key: str, value: Any) -> None:
    """Record ``value`` as JSON under ``key``, in place, replacing any previous record."""
    props = {p.key: p.value for p in model.metadata_props}
    props[key] = json.dumps(value, sort_keys=key == ROLES_KEY)
    del model.metadata_props[:]
    for name, text in props.items():
        model.metadata_props.add(key=name, value=text)


def remove_record(model: onnx.ModelProto, key: str) -> None:
    """Drop the record under ``key``, in place (nothing when there is none)."""
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
