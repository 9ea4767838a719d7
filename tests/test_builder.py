"""GraphBuilder's renaming (lossgraph/builder.py): the indexes that keep compile time linear in
the model's size give the graphs a plain scan gives."""

from __future__ import annotations

import pytest

from lossgraph.builder import GraphBuilder
from lossgraph.names import NameAuthority


def test_rename_updates_every_use_also_after_the_node_list_was_replaced():
    b = GraphBuilder(NameAuthority(["x"]), 18)
    h = b.Relu("x")
    square = b.Mul(h, h)
    b.nodes = list(b.nodes)  # replaced whole, as the walker does after dropping dead code
    total = b.Add(square, h)
    assert b.rename(h, "hidden") == "hidden"
    assert [list(n.input) for n in b.nodes] == [["x"], ["hidden", "hidden"],
                                                 [square, "hidden"]]
    b.rename("hidden", "hidden_again")  # the renamed value's uses are known too
    assert [list(n.input) for n in b.nodes][1:] == [["hidden_again", "hidden_again"],
                                                    [square, "hidden_again"]]
    assert list(b.nodes[0].output) == ["hidden_again"] and list(b.nodes[2].output) == [total]


def test_rename_leaves_nodes_that_left_the_builder_alone():
    b = GraphBuilder(NameAuthority(["x"]), 18)
    h = b.Relu("x")
    moved = b.Neg(h)
    gone, b.nodes = b.nodes, [b.nodes[0]]  # the Neg node now belongs to someone else
    b.rename(h, "kept")
    assert list(gone[1].input) == [h] and moved == gone[1].output[0]
    with pytest.raises(KeyError):
        b.rename("x", "y")  # not produced here
