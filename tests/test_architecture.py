"""The structure the design keeps (docs/design.md), checked by reading the package's code:

- a module reads another module's underscore attributes never: code outside a module
  uses its public methods (the training engine, lossgraph.runtime.engine, exists so that
  nothing needs to);
- nothing outside lossgraph.modes compares a fusion mode's name: each mode is one object
  that owns its plan, its graphs and its runtime step.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

from support.environment import ROOT

PACKAGE = ROOT / "lossgraph"


def modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text())


def private_names(tree: ast.Module) -> set[str]:
    """The underscore names a module defines: functions, classes, attributes it assigns."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def foreign_private_reads() -> list[str]:
    """``module:line: expression`` for each read of an underscore attribute that another
    lossgraph module defines, on anything but ``self``, ``cls`` or ``super()``."""
    parsed = dict(modules())
    defined = {module: private_names(tree) for module, tree in parsed.items()}
    owners: dict[str, set[str]] = {}
    for module, names in defined.items():
        for name in names:
            owners.setdefault(name, set()).add(module)
    found = []
    for module, tree in parsed.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
                continue
            if node.attr in owners and module not in owners[node.attr]:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)} (defined in "
                             f"{', '.join(sorted(owners[node.attr]))})")
    return found


def test_no_module_reads_another_modules_underscore_attributes():
    assert foreign_private_reads() == []


def test_the_check_finds_a_read_of_another_modules_underscore_attribute(tmp_path, monkeypatch):
    """The scan itself: a module reading a trainer's private attribute is reported."""
    package = tmp_path / "lossgraph"
    package.mkdir()
    (package / "owner.py").write_text("class Owner:\n    def __init__(self):\n"
                                      "        self._secret = 1\n")
    (package / "reader.py").write_text("def peek(owner):\n    return owner._secret\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert foreign_private_reads() == [
        "lossgraph/reader.py:2: owner._secret (defined in lossgraph/owner.py)"]


def test_only_the_modes_compare_a_fusion_modes_name():
    from lossgraph.modes import MODES

    found = []
    for module, tree in modules():
        if module.startswith("lossgraph/modes/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                constants = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
                if any(value in MODES for value in constants):
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
