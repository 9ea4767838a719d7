"""NameAuthority's fresh names (lossgraph/names.py): the index that keeps compile time linear in
the model's size gives the names a plain scan gives."""

from __future__ import annotations

import numpy as np
import pytest

from lossgraph.errors import NameCollisionError
from lossgraph.names import NameAuthority


def first_free(taken: set[str], base: str) -> str:
    """The rule fresh keeps: ``base`` if free, else the first free ``base_1``, ``base_2``..."""
    name, index = base, 0
    while name in taken:
        index += 1
        name = f"{base}_{index}"
    return name


def test_fresh_names_are_the_first_free_suffix_whatever_was_claimed_between():
    rng = np.random.default_rng(0)
    hints = ["w", "w_1", "grad", "grad_2", "t"]
    authority, taken = NameAuthority(["w", "grad_1", "grad_3"]), {"w", "grad_1", "grad_3"}
    for _ in range(2000):
        hint = hints[rng.integers(len(hints))]
        if rng.random() < 0.2:  # a name claimed exactly, perhaps one fresh would give later
            name = f"{hint}_{rng.integers(1, 40)}"
            if name in taken:
                with pytest.raises(NameCollisionError):
                    authority.claim(name)
            else:
                assert authority.claim(name) == name
                taken.add(name)
        else:
            expected = first_free(taken, hint)
            assert authority.fresh(hint) == expected
            taken.add(expected)
    assert all(name in authority for name in taken)


def test_fresh_makes_an_unsafe_hint_safe_and_counts_it_with_its_safe_spelling():
    authority = NameAuthority()
    assert [authority.fresh(h) for h in ("a b", "a_b", "a?b", "")] == ["a_b", "a_b_1",
                                                                         "a_b_2", "t"]
