"""Every Python example in README.md and docs/ runs; the generated ops table is current."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from lossgraph.autodiff.table import markdown

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCKS = [(page, index, code) for page in PAGES
          for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}[{i}]" for p, i, _ in BLOCKS])
def test_python_example_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": "__doc_example__"})


def test_demo_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "examples" / "demo.py"), run_name="__main__")
    assert "OK: lossgraph trains the ONNX model as well as" in capsys.readouterr().out


def test_supported_ops_page_is_generated_from_the_registry():
    page = ROOT / "docs" / "supported_ops.md"
    assert page.read_text() == markdown(), (
        "docs/supported_ops.md is stale: run python -m lossgraph.autodiff.table > "
        "docs/supported_ops.md")
