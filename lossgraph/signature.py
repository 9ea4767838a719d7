"""Signature: who is who among a training graph's inputs and outputs.

The fusion passes record it in the graph's metadata (:data:`lossgraph.metadata.SIGNATURE_KEY`)
so that the next pass, and the manifest, read the names instead of guessing them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import onnx

from .errors import UnsupportedModelError
from .metadata import BUFFERS_KEY, GRADIENTS_KEY, SIGNATURE_KEY, read_json, write_json
from .roles import get_roles

__all__ = ["Signature"]


@dataclass
class Signature:
    """The names of a training graph's inputs and outputs, by what they are."""

    features: list[str]
    label: str
    sample_weight: str | None
    loss: str
    weights: list[str]
    states: dict[str, list[str]] = field(default_factory=dict)  # weight -> its state names
    gradients: dict[str, str] = field(default_factory=dict)  # weight -> gradient value
    learning_rate: str = "learning_rate"
    step: str = "step"
    new: dict[str, str] = field(default_factory=dict)  # weight, state or buffer -> its output
    permutation: str | None = None  # epoch graphs only
    learning_rates: str | None = None
    losses: str | None = None
    prediction: str | None = None  # separate graphs only
    prediction_grad: str | None = None
    unpacked: Signature | None = None  # packed graphs only: the per-weight signature
    shapes: dict[str, list[int]] = field(default_factory=dict)  # packed: weight -> shape
    # state the graph updates without gradients or optimizer: training-mode
    # BatchNormalization's running statistics (lossgraph.passes.running_stats), never packed
    buffers: list[str] = field(default_factory=list)
    # gradient accumulation (lossgraph.passes.accumulate): weight -> the running sum of its
    # gradient the graph reads, and the factor a micro-batch's gradient is added with
    # (a vector of one per micro-batch in a group's and an epoch's graph)
    gradient_sums: dict[str, str] = field(default_factory=dict)
    gradient_scale: str | None = None
    # the gradients' global norm where the update clips them (lossgraph.update_options):
    # a step's scalar output, and an epoch graph's one per update
    grad_norm: str | None = None
    grad_norms: str | None = None

    @classmethod
    def of_gradient_model(cls, model: onnx.ModelProto) -> Signature:
        """The signature of a loss model with gradients (weights as inputs): roles from
        ``add_loss_output``, weights and gradients from the gradient pass, buffers and their
        next values from :class:`~lossgraph.passes.running_stats.RunningStatistics`."""
        roles = get_roles(model)
        gradients = read_json(model, GRADIENTS_KEY)
        if not gradients or "loss" not in roles:
            raise UnsupportedModelError(
                "A training graph is built from a loss model with gradients: the model records "
                "no loss (lossgraph.add_loss_output) or no gradients (lossgraph.gradient with "
                "its weights as inputs).")
        buffers = read_json(model, BUFFERS_KEY) or {}
        signature = cls.of_loss_model(model, list(gradients), list(buffers))
        signature.gradients = dict(gradients)
        signature.new.update(buffers)
        return signature

    @classmethod
    def of_loss_model(cls, model: onnx.ModelProto, weights: list[str],
                      buffers: list[str] | None = None) -> Signature:
        """The signature of a loss model whose ``weights`` (and ``buffers``) are graph inputs."""
        roles = get_roles(model)
        buffers = list(buffers or [])
        data = {roles["label"], roles.get("sample_weight"), *weights, *buffers}
        features = [i.name for i in model.graph.input if i.name not in data]
        return cls(features=features, label=roles["label"],
                   sample_weight=roles.get("sample_weight"), loss=roles["loss"],
                   weights=list(weights), buffers=buffers)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> Signature:
        """The signature recorded in ``model`` by a fusion pass, else the gradient model's."""
        recorded = read_json(model, SIGNATURE_KEY)
        return cls.from_dict(recorded) if recorded else cls.of_gradient_model(model)

    def record(self, model: onnx.ModelProto) -> None:
        """Write this signature into ``model``'s metadata, in place."""
        write_json(model, SIGNATURE_KEY, self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The signature as JSON-ready data; without buffers, accumulation or norms where
        it has none, as recorded before them."""
        return _without_empty(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Signature:
        unpacked = record.get("unpacked")
        return cls(**{**record, "unpacked": cls.from_dict(unpacked) if unpacked else None})

    def roles(self) -> dict[str, str]:
        """The role of every input and output this signature names, by name (the
        manifest's)."""
        role_of = {name: "feature" for name in self.features}
        role_of.update({self.label: "label", self.loss: "loss",
                        self.learning_rate: "learning_rate", self.step: "step"})
        if self.sample_weight:
            role_of[self.sample_weight] = "sample_weight"
        role_of.update({w: "weight" for w in self.weights})
        role_of.update({s: "state" for s in self.state_names})
        role_of.update({self.new[w]: "new_weight" for w in self.weights if w in self.new})
        role_of.update({self.new[s]: "new_state" for s in self.state_names})
        role_of.update({b: "buffer" for b in self.buffers})
        role_of.update({self.new[b]: "new_buffer" for b in self.buffers})
        gradient = "new_gradient_sum" if self.gradient_sums else "gradient"
        role_of.update({g: gradient for g in self.gradients.values()})
        for key, role in (("permutation", "permutation"), ("learning_rates", "learning_rates"),
                          ("losses", "losses"), ("prediction", "prediction"),
                          ("prediction_grad", "prediction_grad"), ("grad_norm", "grad_norm"),
                          ("grad_norms", "grad_norms")):
            if getattr(self, key):
                role_of[getattr(self, key)] = role
        role_of.update({s: "gradient_sum" for s in self.gradient_sums.values()})
        if self.gradient_scale:
            role_of[self.gradient_scale] = ("gradient_scales" if self.learning_rates
                                            else "gradient_scale")
        return role_of

    @property
    def data(self) -> list[str]:
        """The per-row inputs: features, label, sample weight."""
        return [*self.features, self.label, *([self.sample_weight] if self.sample_weight else [])]

    @property
    def state_names(self) -> list[str]:
        """Every optimizer state, weight by weight."""
        return [s for w in self.weights for s in self.states.get(w, [])]

    def members(self, flat: str) -> list[str]:
        """Packed graphs: the per-weight values that the flat weight or state ``flat`` holds."""
        unpacked = self.unpacked
        assert unpacked is not None, "only packed signatures have members"
        if flat in self.weights:
            return list(unpacked.weights)
        index = self.state_names.index(flat)
        return [unpacked.states[w][index] for w in unpacked.weights]


def _without_empty(record: dict[str, Any]) -> dict[str, Any]:
    for key in ("buffers", "gradient_sums", "gradient_scale", "grad_norm", "grad_norms"):
        if not record.get(key):
            record.pop(key, None)
    if record.get("unpacked"):
        record["unpacked"] = _without_empty(record["unpacked"])
    return record
