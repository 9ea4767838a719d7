"""The name authority: the one place new tensor and node names are minted.

Every pass asks a :class:`NameAuthority` seeded with all names already in the model
(subgraphs included) for new names, so emitted names are readable
(``loss``, ``label``, ``coef_grad``), never collide, and are the same from one run
to the next.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import onnx

from .errors import NameCollisionError
from .graphs import names_in_graph

__all__ = ["NameAuthority"]

_UNSAFE = re.compile(r"[^0-9A-Za-z_./:-]+")


class NameAuthority:
    """Mints fresh, deterministic names that avoid every name already taken."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self._taken: set[str] = set(taken)
        # per hint, the first suffix not known to be taken: names are only ever added, so
        # the search resumes there instead of trying hint_1, hint_2, ... again each time
        self._next_suffix: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: onnx.ModelProto) -> NameAuthority:
        """An authority that knows every name used anywhere in ``model``."""
        return cls(names_in_graph(model.graph))

    def __contains__(self, name: str) -> bool:
        return name in self._taken

    def fresh(self, hint: str) -> str:
        """``hint`` itself if it is free, else the first free ``hint_1``, ``hint_2``, ..."""
        base = _UNSAFE.sub("_", hint) or "t"
        index = self._next_suffix.get(base, 0)
        name = f"{base}_{index}" if index else base
        while name in self._taken:
            index += 1
            name = f"{base}_{index}"
        self._taken.add(name)
        self._next_suffix[base] = index + 1
        return name

    def claim(self, name: str, what: str = "name") -> str:
        """Take ``name`` exactly, as the user asked for it; fail if it is already used."""
        if name in self._taken:
            raise NameCollisionError(
                f"The {what} {name!r} is already used in the model. "
                f"Pass another {what}, or leave it out to let lossgraph pick a free one."
            )
        self._taken.add(name)
        return name
