"""The commands' options and help (lossgraph/cli/parser.py): every command has help with an
example."""

from __future__ import annotations

import pytest

from lossgraph.cli import main


@pytest.mark.parametrize("command", ["inspect", "compile", "train", "export", "add-loss",
                                     "gradient", "lower-ml", "alphabetize", "trainable", "ops"])
def test_every_command_has_help_with_an_example(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "example" in out and f"\n  lossgraph {command} " in out
