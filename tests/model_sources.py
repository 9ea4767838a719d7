"""The model libraries the supported-models suite builds from: torchvision, timm and
transformers, each imported on first use, or ``None`` where it (or torch) is not installed,
so that its cases skip.

They import as they are: a torchvision wheel matched to its torch imports fine, and CI's
PyPI torchvision beside the CPU torch imports through .ci/torchvision_cpu.py's start-up
hook (installed by ``.ci/setup-env --torch``). lossgraph itself imports none of them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

#: The libraries by the name the catalogue gives their source.
LIBRARIES = ("torchvision", "timm", "transformers")


@functools.cache
def library(name: str) -> ModuleType | None:
    """The library ``name`` (one of :data:`LIBRARIES`), or None when it or torch is not
    installed."""
    if name not in LIBRARIES:
        raise KeyError(f"no model source {name!r}: one of {LIBRARIES}")
    if any(importlib.util.find_spec(m) is None for m in ("torch", name)):
        return None
    return importlib.import_module(name)
