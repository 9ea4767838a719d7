"""Old spellings of the public API, kept working for one release with a warning.

The vocabulary (docs/concepts.md) gives one word per idea; a name a previous release
documented still works, with a :class:`~lossgraph.errors.LossgraphDeprecationWarning`
naming its replacement::

    @renamed_keywords(trainable="weights", gradient="backend")
    def compile_program(model, weights=None, ..., backend="onnx"): ...
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import LossgraphDeprecationWarning, UnsupportedOptionError

__all__ = ["renamed_keywords", "warn_renamed", "moved_names"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is spelled ``new`` now."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new}.",
                  LossgraphDeprecationWarning, stacklevel=stacklevel)


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Accept each old keyword (``old="new"``) for its new name, with a warning; giving both
    is an :class:`~lossgraph.errors.UnsupportedOptionError`."""

    def decorate(fn: F) -> F:
        shown = fn.__qualname__.removesuffix(".__init__")  # a class by its name
        shown = shown if fn.__name__ == "__init__" else fn.__name__

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise UnsupportedOptionError(
                            f"{shown} got both {old}= and {new}=; {old}= is the old "
                            f"spelling of {new}=: pass only {new}=.")
                    warn_renamed(f"{shown}({old}=...)", f"{new}=...")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return decorate


def moved_names(module: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names a previous release's module ``module``
    defined and ``homes`` gives a new home to: a module (``{"update_graph":
    "lossgraph.optim"}``), or a module and a new name (``"lossgraph.surgery:GradientHalves"``).
    Each still works, with a warning naming its new home."""

    def getattr_(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new_name = homes[name].partition(":")
        new_name = new_name or name
        warn_renamed(f"{module}.{name}", f"{home}.{new_name}")
        return getattr(importlib.import_module(home), new_name)

    return getattr_
