"""Package names loaded on first use: a package's ``__init__`` lists where each public name
lives, and importing the package imports none of those modules. Two reasons: the modules
build on modules that build on the package (``lossgraph.runtime``, ``lossgraph.export``),
and ``import lossgraph`` stays cheap, so the command line answers ``--help`` and argument
errors before numpy, onnx and onnxruntime load (``lossgraph``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str],
               fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``homes`` read from its module
    (``{"Engine": ".engine"}``, relative to the package; ``{"optim": ".optim"}``, the
    module itself) when first asked for, then kept in the package. Any other submodule
    is imported when asked for, as an eager ``__init__`` would have left it an attribute;
    other names go to ``fallback`` (e.g. :func:`lossgraph.deprecation.moved_names`) or
    raise AttributeError."""

    def getattr_(name: str) -> Any:
        if name in homes:
            module = importlib.import_module(homes[name], package)
            value = module if homes[name] == f".{name}" else getattr(module, name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f".{name}", package)
        elif fallback is not None:
            return fallback(name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    return getattr_
