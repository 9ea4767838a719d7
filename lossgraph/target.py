"""Which runtimes an emitted model must load in: IR version and opset policy.

onnx 1.23 stamps models with IR version 14, which onnxruntime-training 1.19 rejects
(it reads at most IR 10, opset 21). Every pass therefore sets the IR version and
opset imports of its output deliberately, through :func:`finalize`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import onnx

from .errors import UnsupportedModelError, UnsupportedOptionError, suggest
from .graphs import all_graphs, opset_version

__all__ = ["Target", "DEFAULT_TARGET", "TARGETS", "active_target", "check_opset",
           "check_opset_option", "finalize", "resolve_target", "use_target"]


@dataclass(frozen=True)
class Target:
    """The runtimes a model is emitted for."""

    description: str
    ir_version: int
    max_opset: int
    min_opset: int = 13

    def supports(self, opset: int) -> bool:
        """True when the target's runtimes load ``ai.onnx`` opset ``opset``."""
        return self.min_opset <= opset <= self.max_opset


#: Loadable by onnxruntime-training 1.19.2 and by current plain onnxruntime.
DEFAULT_TARGET = Target(
    description="onnxruntime-training 1.19 and current onnxruntime", ir_version=10, max_opset=21
)

#: The runtimes a model can be emitted for, by name (``compile_program(..., target=name)``).
TARGETS = {
    "default": DEFAULT_TARGET,
    "onnxruntime-training-1.19": DEFAULT_TARGET,
    # Plain onnxruntime 1.20+ (checked with 1.31) loads opsets up to 25; lossgraph's
    # rules are proven up to 21, and opsets 22-25 changed types, not semantics, of the
    # ops lossgraph differentiates.
    "onnxruntime": Target(description="current onnxruntime (1.20 and later)", ir_version=10,
                          max_opset=25),
}

_ACTIVE: ContextVar[Target] = ContextVar("lossgraph_target", default=DEFAULT_TARGET)


def resolve_target(target: Target | str | None) -> Target:
    """A :class:`Target` from a Target, a name of :data:`TARGETS`, or ``None`` (the default)."""
    if target is None:
        return DEFAULT_TARGET
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise UnsupportedOptionError(
            f"target={target!r} must be a name of lossgraph.target.TARGETS "
            f"({', '.join(map(repr, TARGETS))}) or a lossgraph.target.Target.")
    if target not in TARGETS:
        raise UnsupportedOptionError(f"Unknown target {target!r}." + suggest(target, list(TARGETS),
                                                                             "targets"))
    return TARGETS[target]


def active_target() -> Target:
    """The target the passes emit for now (see :func:`use_target`)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use_target(target: Target | str | None) -> Iterator[Target]:
    """Run the passes inside the block for ``target``."""
    token = _ACTIVE.set(resolve_target(target))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


def check_opset(model: onnx.ModelProto, target: Target | None = None) -> int:
    """The model's ``ai.onnx`` opset, checked to lie in the range the target supports."""
    target = target or active_target()
    version = opset_version(model)
    if version is None:
        raise UnsupportedModelError(
            "The model imports no 'ai.onnx' opset. Add one, e.g. "
            "model.opset_import.append(onnx.helper.make_opsetid('', 17))."
        )
    if not target.supports(version):
        suggested = min(max(version, target.min_opset), target.max_opset)
        raise UnsupportedModelError(
            f"The model uses ai.onnx opset {version}; lossgraph emits models for "
            f"{target.description}, which needs opset {target.min_opset} to "
            f"{target.max_opset}. Convert it first, e.g. "
            f"onnx.version_converter.convert_version(model, {suggested})."
            + (" Or emit for current onnxruntime only: "
               "compile_program(..., target='onnxruntime') or "
               "with lossgraph.target.use_target('onnxruntime'): ..."
               if version > target.max_opset and version <= TARGETS["onnxruntime"].max_opset
               else "")
        )
    return version


def check_opset_option(opset: int, target: Target | None = None) -> int:
    """An ``opset=`` option of a graph lossgraph builds from scratch, checked like a model's."""
    target = target or active_target()
    if not target.supports(opset):
        raise UnsupportedOptionError(
            f"opset={opset} is outside {target.min_opset}..{target.max_opset}, "
            f"the range {target.description} load."
        )
    return opset


def finalize(model: onnx.ModelProto, target: Target | None = None) -> None:
    """Set the IR version and a clean opset list (one entry per domain) in place.

    Domains no node uses any more (e.g. ``ai.onnx.ml`` after :func:`lower_ml_ops`)
    are dropped, so the model loads where that domain is unknown.
    """
    target = target or active_target()
    bodies = [*all_graphs(model.graph), *model.functions]
    used = {node.domain or "" for body in bodies for node in body.node} | {""}
    versions: dict[str, int] = {}
    for opset in model.opset_import:
        domain = "" if opset.domain == "ai.onnx" else opset.domain
        if domain in used:
            versions[domain] = max(versions.get(domain, 0), opset.version)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(versions.items()))
    model.ir_version = target.ir_version

