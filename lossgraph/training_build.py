"""Is the onnxruntime training build installed? Its bindings, or a clear error.

``onnxruntime-training-cpu`` and plain ``onnxruntime`` install the same module; only the
training build's ``onnxruntime.capi._pybind_state`` has ``GradientGraphBuilder`` (the
``"ort"`` gradient backend). ``import onnxruntime.training`` needs torch, so the
bindings are reached without it.
"""

from __future__ import annotations

from types import ModuleType

from .errors import RuntimeUnavailableError

__all__ = ["available", "bindings"]


def _pybind() -> ModuleType | None:
    try:
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
