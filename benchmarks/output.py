"""The files a benchmark writes: each carries its benchmark's mark, so that a run replaces
only what that benchmark wrote before (never a file of the user's), atomically."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lossgraph.errors import UnsafeWriteError
from lossgraph.fileio import check_file_target, write_file


def written_by(mark: str) -> Callable[[Path], bool]:
    """Whether a file was written by the benchmark of ``mark`` (its JSON's ``generator``
    or its PNG's ``Software`` field carries the mark, near the start)."""

    def owned(path: Path) -> bool:
        return mark.encode() in path.read_bytes()[:4096]

    return owned


def save_figure(figure: Any, path: str, mark: str, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG carrying ``mark``, written atomically to ``path``
    unless another program's file is there."""
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=dpi, metadata={"Software": mark})
    write_file(path, image.getvalue(), owned=written_by(mark))


def save_figures(figures: Any, path: str, owned: Callable[[Path], bool]) -> None:
    """A benchmark's figures as JSON, written atomically to ``path`` unless a file that
    ``owned`` does not recognise is there, and where they went said."""
    write_file(path, json.dumps(figures, indent=2).encode(), owned=owned)
    print(f"figures written to {path}")


def check_targets(parser: argparse.ArgumentParser, paths: Iterable[str | Path | None],
                  owned: Callable[[Path], bool]) -> None:
    """Before any measuring: each path asked for (None: not asked for) is free or holds a
    file ``owned`` recognises, else the command line's error naming it."""
    for path in filter(None, paths):
        try:
            check_file_target(path, owned=owned)
        except UnsafeWriteError:
            parser.error(f"{path} is in the way: it is not a file this benchmark wrote. "
                         "Choose another path (nothing was measured).")
