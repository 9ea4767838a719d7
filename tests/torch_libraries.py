"""torchvision, timm and transformers for the tests, imported beside the CPU torch build.

PyPI's torchvision wheel is built against CUDA torch: beside the CPU torch 2.13.0 its
compiled operators do not load, and ``import torchvision`` fails registering their fake
kernels ("operator torchvision::nms does not exist"). The classification models never
call those operators, so :func:`import_torchvision` imports it with that registration
made lenient. transformers and timm import torchvision when it is installed: import them
through :func:`import_transformers` and :func:`import_timm`. A torchvision wheel matched
to the installed torch imports as it is: a user never needs this.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def import_torchvision() -> ModuleType | None:
    """``torchvision``, imported (and ``timm`` made importable, which imports it), or None
    when torch or torchvision is not installed (the tests then skip)."""
    try:
        import torch
        import torch.library
    except ImportError:
        return None
    real = torch.library.register_fake

    def lenient(op, *args, **kwargs):
        inner = real(op, *args, **kwargs)
        if not callable(inner):
            return inner

        def register(function):
            try:
                return inner(function)
            except RuntimeError:  # torchvision's C++ op is absent beside the CPU torch build
                return function
        return register

    torch.library.register_fake = lenient
    try:
        return importlib.import_module("torchvision")
    except ImportError:
        return None
    finally:
        torch.library.register_fake = real


def import_timm() -> ModuleType | None:
    """``timm`` (after :func:`import_torchvision`), or None when it is not installed."""
    if import_torchvision() is None:
        return None
    try:
        return importlib.import_module("timm")
    except ImportError:
        return None


def import_transformers() -> ModuleType | None:
    """``transformers`` (torchvision first, when installed: transformers imports it), or
    None when torch or transformers is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    import_torchvision()
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None
