"""Roles of a loss model's tensors, recorded in the model's metadata.

``add_loss_output`` may have to pick free names (a skl2onnx classifier already has
an output called ``label``), so it records which tensor plays which role under the
metadata key ``lossgraph.roles`` as JSON, e.g.
``{"loss": "loss", "label": "label_1", "prediction": "probabilities"}``.
Runners read it with :func:`get_roles` instead of guessing names; a record that is
not such a JSON object, or names tensors the model lacks, is an
:class:`~lossgraph.errors.InvalidModelError`, never a wrong guess.
"""

from __future__ import annotations

import json

import onnx

from .errors import InvalidModelError
from .metadata import ROLES_KEY, read_text, write_json

__all__ = ["ROLES_KEY", "get_roles", "set_roles", "check_loss_roles", "renamed_roles"]

#: Where each role's tensor must be: an output or an input of the loss model.
_PLACES = {"loss": "output", "prediction": "output", "label": "input",
           "sample_weight": "input"}
#: Role names of the previous release: the sample weight was "weight".
_RENAMED = {"weight": "sample_weight"}
_FIX = ("lossgraph.add_loss_output writes this record: remove the entry from "
        "model.metadata_props, or build the loss again from the inference model.")


def get_roles(model: onnx.ModelProto) -> dict[str, str]:
    """The recorded roles (empty when the model has none)."""
    text = read_text(model, ROLES_KEY)
    return {} if text is None else renamed_roles(_parse(text))


def renamed_roles(roles: dict[str, str]) -> dict[str, str]:
    """``roles`` with the previous release's role names (``"weight"``) in today's."""
    return {_RENAMED.get(role, role): value for role, value in roles.items()}


def _parse(text: str) -> dict[str, str]:
    try:
        roles = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidModelError(
            f"The model's metadata {ROLES_KEY!r} is not JSON ({exc.msg} at character "
            f"{exc.pos} of {text[:60]!r}). {_FIX}") from None
    if not isinstance(roles, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in roles.items()):
        raise InvalidModelError(
            f"The model's metadata {ROLES_KEY!r} must be a JSON object of role names to tensor "
            f"names, e.g. {{\"loss\": \"loss\", \"label\": \"label\", \"prediction\": \"y\"}}; "
            f"it is {text[:60]!r}. {_FIX}")
    return roles


def set_roles(model: onnx.ModelProto, roles: dict[str, str]) -> None:
    """Record ``roles`` in place, replacing any previous record."""
    write_json(model, ROLES_KEY, roles)


def check_loss_roles(model: onnx.ModelProto) -> dict[str, str]:
    """The roles of a model that carries its loss: loss, label and prediction recorded, each
    (and the sample weight, when recorded) a tensor where the role needs it."""
    roles = get_roles(model)
    names = {"output": {o.name for o in model.graph.output},
             "input": {i.name for i in model.graph.input}}
    for role, place in _PLACES.items():
        if role not in roles:
            if role == "sample_weight":
                continue
            raise InvalidModelError(
                f"The model's metadata {ROLES_KEY!r} records no {role!r} tensor (it records "
                f"{sorted(roles)}). {_FIX}")
        if roles[role] not in names[place]:
            raise InvalidModelError(
                f"The model's metadata {ROLES_KEY!r} names {roles[role]!r} as the {role}, but "
                f"the model has no {place} of that name. {_FIX}")
    return roles
