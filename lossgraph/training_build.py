"""Is the onnxruntime training build installed? Its bindings, or a clear error; and
onnxruntime imported without the training build's Python package.

``onnxruntime-training-cpu`` and plain ``onnxruntime`` install the same module; only the
training build's ``onnxruntime.capi._pybind_state`` has ``GradientGraphBuilder`` (the
``"ort"`` gradient backend). ``import onnxruntime.training`` needs torch, and the training
build's own ``import onnxruntime`` imports it too (its build check imports
``onnxruntime.training.ortmodule``: 2-4 s, torch and sympy); lossgraph uses the native
bindings only, so :func:`import_onnxruntime` imports onnxruntime without that package.
"""

from __future__ import annotations

import sys
from types import ModuleType

from .errors import RuntimeUnavailableError

__all__ = ["available", "bindings", "import_onnxruntime"]


def import_onnxruntime() -> ModuleType:
    """The ``onnxruntime`` module, imported (when it is not yet) without the training
    build's ``onnxruntime.training`` package, which its build check would import with
    torch: the check then finds no ORTModule, as on a build without it, and nothing else
    changes. ``import onnxruntime.training`` afterwards works as usual (during the import
    itself, another thread importing it would be refused). ImportError where onnxruntime
    is not installed."""
    module = sys.modules.get("onnxruntime")
    if module is not None:
        return module
    blocked = "onnxruntime.training" not in sys.modules
    if blocked:
        sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]  # import fails
    try:
        import onnxruntime
    finally:
        if blocked and "onnxruntime.training" in sys.modules \
                and sys.modules["onnxruntime.training"] is None:
            del sys.modules["onnxruntime.training"]
    return onnxruntime


def _pybind() -> ModuleType | None:
    try:
        import_onnxruntime()
        from onnxruntime.capi import _pybind_state
    except ImportError:
        return None
    return _pybind_state


def available() -> bool:
    """True when the installed onnxruntime is the training build."""
    module = _pybind()
    return module is not None and hasattr(module, "GradientGraphBuilder")


def bindings(purpose: str = "backend='ort'") -> ModuleType:
    """The training build's native bindings; for anything else a RuntimeUnavailableError
    saying that ``purpose`` needs them and how to install them."""
    module = _pybind()
    if module is None:
        raise RuntimeUnavailableError(
            f"{purpose} needs onnxruntime-training-cpu 1.19.2 (pip install "
            "'lossgraph[training]'); onnxruntime is not installed.")
    if not hasattr(module, "GradientGraphBuilder"):
        raise RuntimeUnavailableError(
            f"{purpose} needs the onnxruntime training build (pip install "
            "'lossgraph[training]' in an environment without plain onnxruntime); the "
            "installed onnxruntime has no GradientGraphBuilder. Use backend='onnx' "
            "(lossgraph.compile_program(..., backend='onnx')).")
    return module
