"""Every Python example in README.md and docs/ runs (the numbered scripts of docs/examples/
too); the generated ops table is current."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import subprocess
import sys

import pytest
from support.environment import ROOT

from lossgraph.autodiff import scoped_rules
from lossgraph.autodiff.table import markdown

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("[0-9][0-9]_*.py"))


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where one of ``modules`` (optional packages) is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


#: Examples that need more than the core dependencies, by the marker that says so; the
#: fine-tuning ones import torchvision or transformers and train a real architecture beside
#: torch (10 s each on two cores, half of it imports).
EXAMPLE_MARKS = {"02_finetune_torch_export.py": pytest.mark.torch,
                 "06_torch_layer.py": pytest.mark.torch,
                 "07_out_of_core.py": needs("pyarrow"),
                 "08_finetune_torchvision.py": [pytest.mark.torch, pytest.mark.slow,
                                                needs("torchvision")],
                 "09_finetune_transformers.py": [pytest.mark.torch, pytest.mark.slow,
                                                 needs("transformers")],
                 "10_finetune_like_hugging_face.py": [pytest.mark.torch, pytest.mark.slow,
                                                      needs("transformers")],
                 "11_finetune_with_lora.py": [pytest.mark.torch, pytest.mark.slow,
                                              needs("transformers", "peft")]}
BLOCKS = [(page, index, code) for page in PAGES
          for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]
#: A block whose first line is "# needs torch" (or another package) runs where it is installed.
BLOCK_MARKS = {"# needs torch": pytest.mark.torch, "# needs pyarrow": needs("pyarrow"),
               "# needs dask-ml": needs("dask_ml", "distributed"), "# needs ray": needs("ray")}


@pytest.mark.parametrize(("page", "index", "code"), [
    pytest.param(page, index, code, marks=BLOCK_MARKS.get(code.split("\n", 1)[0], ()),
                 id=f"{page.relative_to(ROOT)}[{index}]") for page, index, code in BLOCKS])
def test_python_example_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files
    with scoped_rules():  # a rule an example registers stays in the example
        exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": "__doc_example__"})


def test_demo_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "examples" / "demo.py"), run_name="__main__")
    assert "OK: lossgraph trains the ONNX model as well as" in capsys.readouterr().out


@pytest.mark.parametrize("script", [
    pytest.param(path, marks=EXAMPLE_MARKS.get(path.name, ()), id=path.name) for path in EXAMPLES])
def test_numbered_example_runs_and_writes_nothing_where_it_is_run(script, tmp_path):
    """Run as a user would (a fresh process, another working folder): it asserts what it
    shows and says OK; its files go to a temporary folder of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\nOK: " in "\n" + result.stdout, result.stdout
    assert not list(tmp_path.iterdir())


def test_examples_readme_lists_every_numbered_example():
    index = (ROOT / "docs" / "examples" / "README.md").read_text()
    assert EXAMPLES
    for path in EXAMPLES:
        assert f"({path.name})" in index, path.name


def test_supported_ops_page_is_generated_from_the_registry():
    page = ROOT / "docs" / "supported_ops.md"
    assert page.read_text() == markdown(), (
        "docs/supported_ops.md is stale: run python -m lossgraph.autodiff.table > "
        "docs/supported_ops.md")
