"""Package names loaded on first use: a package's ``__init__`` lists where each public name
lives, and importing the package imports none of those modules (they build on modules
that build on the package)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``homes`` read from its module
    (``{"Engine": ".engine"}``, relative to the package) when first asked for."""

    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name], package), name)

    return getattr_
