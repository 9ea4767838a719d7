"""The catalogue of bad inputs in docs/reference/errors.md, shared by the test files that
provoke them (test_bad_inputs, test_storage, cli/test_main).

Each file lists its cases with an id; its tests prove the error, and these helpers
write the page's tables from real runs and check that no case is missing from it.
``PYTHONPATH=. python tests/support/catalogue.py`` rewrites the page's three tables (and
their count) from fresh runs of the three files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ERRORS_PAGE = ROOT / "docs" / "reference" / "errors.md"

#: ``(id, input described, error class name or outcome, message)``
Row = tuple[str, str, str, str]


def slug(words: str) -> str:
    """A catalogue id from a description: ``"graph file missing"`` -> ``graph-file-missing``."""
    return re.sub(r"[^a-z0-9]+", "-", words.lower().replace("'", "")).strip("-")


def message_of(error: BaseException | str, folder: Path) -> str:
    """The message as the page shows it: one line, the test's folder as ``<tmp>``."""
    message = str(error).replace(str(folder), "<tmp>").replace(os.getcwd(), "<cwd>")
    return re.sub(r"\s+", " ", message).strip()


def table(rows: Iterable[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| id | input | error | message |", "|---|---|---|---|"]
    for case_id, described, error, message in rows:
        escaped = message.replace("|", "\\|")
        lines.append(f"| `{case_id}` | {described} | `{error}` | {escaped} |")
    return "\n".join(lines) + "\n"


def assert_listed(ids: Iterable[str], source: str) -> None:
    """Fail, naming the ids the errors page lacks and how to print their rows."""
    page = ERRORS_PAGE.read_text()
    missing = [case_id for case_id in ids if f"`{case_id}`" not in page]
    assert not missing, f"add to docs/reference/errors.md (python {source}): {missing}"


def print_table(rows: Callable[[Path], Iterable[Row]]) -> None:
    """Print the table of ``rows(folder)``, run in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        sys.stdout.write(table(rows(Path(tmp))))


#: The test files whose catalogues the page lists, in the page's order.
SOURCES = ("tests/test_bad_inputs.py", "tests/test_storage.py", "tests/cli/test_main.py")
_HEADER = re.compile(r"^\| id \| input \| error \| message \|$", re.M)
_COUNT = re.compile(r"\d+ bad inputs, each a test, in three tables: the Python API \(\d+\), "
                    r"saving and\nloading \(\d+\), and the command line \(\d+\)\.")


def write_page() -> list[int]:
    """Rewrite the page's tables from a run of each source file; the rows per table."""
    page = ERRORS_PAGE.read_text()
    starts = [match.start() for match in _HEADER.finditer(page)]
    assert len(starts) == len(SOURCES), f"{ERRORS_PAGE} should hold {len(SOURCES)} tables"
    paths = os.pathsep.join(str(ROOT / p) for p in (".", "tests", "golden_models"))
    environment = {**os.environ, "PYTHONPATH": paths}
    pieces, last, counts = [], 0, []
    for start, source in zip(starts, SOURCES):
        end = page.find("\n\n", start)
        end = len(page) if end == -1 else end + 1
        printed = subprocess.run([sys.executable, str(ROOT / source)], capture_output=True,
                                 text=True, check=True, env=environment).stdout
        # the table's lines alone: onnx's checker prints warnings to stdout from C++
        rows = "".join(line for line in printed.splitlines(keepends=True)
                       if line.startswith("|"))
        counts.append(rows.count("\n") - 2)
        pieces += [page[last:start], rows]
        last = end
    page = "".join([*pieces, page[last:]])
    page = _COUNT.sub(f"{sum(counts)} bad inputs, each a test, in three tables: the Python API "
                      f"({counts[0]}), saving and\nloading ({counts[1]}), and the command "
                      f"line ({counts[2]}).", page)
    ERRORS_PAGE.write_text(page)
    return counts


if __name__ == "__main__":
    print(write_page())
