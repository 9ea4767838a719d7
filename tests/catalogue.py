"""The catalogue of bad inputs in docs/reference/errors.md, shared by the test files that
provoke them (test_bad_inputs, test_storage, test_cli).

Each file lists its cases with an id; its tests prove the error, and these helpers
write the page's tables from real runs and check that no case is missing from it.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

ERRORS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md"

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
