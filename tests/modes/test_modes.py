"""The fusion modes' registry (lossgraph/modes): one object per mode, owning its plan, the
graphs it emits and its runtime step; everything that names a mode reads the registry."""

from __future__ import annotations

import pytest
from support.linear import linear_program

import lossgraph
from lossgraph.cli.parser import build_parser
from lossgraph.errors import UnsupportedOptionError
from lossgraph.manifest import FUSE_MODES, REQUIRED_GRAPHS
from lossgraph.modes import MODES, FuseMode, fuse_mode


def test_the_registry_holds_the_three_modes_and_everything_reads_it():
    assert sorted(MODES) == ["epoch", "separate", "step"]
    assert all(isinstance(mode, FuseMode) and mode.name == name for name, mode in MODES.items())
    assert tuple(MODES) == FUSE_MODES
    compile_parser = build_parser()._subparsers._group_actions[0].choices["compile"]
    fuse = next(a for a in compile_parser._actions if "--fuse" in a.option_strings)
    assert list(fuse.choices) == list(MODES)


def test_an_unknown_mode_is_named_with_the_one_meant():
    with pytest.raises(UnsupportedOptionError, match="'epoch'"):
        fuse_mode("epochs")
    assert fuse_mode("step") is MODES["step"]


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_mode_emits_the_graphs_the_manifest_requires_of_it(name):
    program = linear_program(name)
    assert set(REQUIRED_GRAPHS[name]) <= set(program.graphs)
    assert program.fuse == name


@pytest.mark.parametrize("name", sorted(MODES))
def test_describe_plan_prints_every_graph_the_mode_emits(name):
    from support.linear import linear_model

    program = linear_program(name)
    text = lossgraph.describe_plan(linear_model(), fuse=name)
    for graph in program.graphs:
        assert graph in text, f"{graph!r} missing from describe_plan(fuse={name!r})"
