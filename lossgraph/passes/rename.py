"""alphabetize_initializers: make the alphabetical order of the weights their graph order.

onnxruntime's forward/backward API (``TrainingAgent``) passes weights positionally,
in alphabetical order of their names. This pass renames the trainable initializers
``W_0, W_1, ...`` (graph order) to ``I0_W_0, I1_W_1, ...`` when their names do not
already sort in graph order:

    name_k -> I{k}_{name_k}     (k zero-padded, every reference renamed, subgraphs included)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from ..analysis import trainable_initializers
from ..deprecation import renamed_keywords
from ..errors import UnknownNameError, suggest
from ..graphs import rename_values
from ..models import ModelLike
from ..names import NameAuthority
from ..options import names as names_option
from ..roles import get_roles, set_roles
from .contract import Pass, PassResult, name_fields

__all__ = ["AlphabetizeInitializers", "alphabetize_initializers"]


@dataclass(frozen=True)
class AlphabetizeInitializers(Pass[dict[str, str]]):
    """Rename ``weights`` (default: the trainable initializers) so they sort in graph order.

    The report is the mapping ``old name -> new name``: the identity when the names
    already sort in graph order, in which case nothing is renamed.
    """

    weights: Sequence[str] | None = None

    def __post_init__(self) -> None:
        name_fields(self, "weights")

    def call(self, model: onnx.ModelProto) -> PassResult:
        mapping = _alphabetize(model, self.weights)
        return PassResult(model, mapping, changed=any(k != v for k, v in mapping.items()))


@renamed_keywords(names="weights")
def alphabetize_initializers(
    model: ModelLike, weights: Sequence[str] | None = None
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The renamed model and the mapping ``old name -> new name``
    (:class:`AlphabetizeInitializers`)."""
    result = AlphabetizeInitializers(weights)(model)
    return result.model, result.report


def _alphabetize(model: onnx.ModelProto, names: Sequence[str] | None) -> dict[str, str]:
    initializers = [t.name for t in model.graph.initializer]
    if names is None:
        names = trainable_initializers(model)
    elif not names:
        names_option("weights", [], candidates=trainable_initializers(model))
    for name in names:
        if name not in initializers:
            raise UnknownNameError(
                f"{name!r} is not an initializer of the model."
                + suggest(name, initializers, "initializers")
            )
    chosen = set(names)
    ordered = [n for n in initializers if n in chosen]
    if ordered == sorted(ordered):
        return {n: n for n in ordered}
    authority = NameAuthority.for_model(model)
    width = len(str(len(ordered) - 1))
    mapping = {old: authority.fresh(f"I{k:0{width}d}_{old}") for k, old in enumerate(ordered)}
    rename_values(model.graph, mapping)
    roles = get_roles(model)
    if roles:
        set_roles(model, {role: mapping.get(value, value) for role, value in roles.items()})
    return mapping
