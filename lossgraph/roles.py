"""Roles of a loss model's tensors, recorded in the model's metadata.

``add_loss_output`` may have to pick free names (a skl2onnx classifier already has
an output called ``label``), so it records which tensor plays which role under the
metadata key ``lossgraph.roles`` as JSON, e.g.
``{"loss": "loss", "label": "label_1", "prediction": "probabilities"}``.
Runners read it with :func:`get_roles` instead of guessing names.
"""

from __future__ import annotations

import json

import onnx

__all__ = ["ROLES_KEY", "get_roles", "set_roles"]

ROLES_KEY = "lossgraph.roles"


def get_roles(model: onnx.ModelProto) -> dict[str, str]:
    """The recorded roles (empty when the model has none)."""
    for prop in model.metadata_props:
        if prop.key == ROLES_KEY:
            return json.loads(prop.value)
    return {}


def set_roles(model: onnx.ModelProto, roles: dict[str, str]) -> None:
    """Record ``roles`` in place, replacing any previous record."""
    props = {p.key: p.value for p in model.metadata_props}
    props[ROLES_KEY] = json.dumps(roles, sort_keys=True)
    onnx.helper.set_model_props(model, props)
