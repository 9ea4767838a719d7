"""Atomic writes: a reader sees the old file (or folder) or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx

__all__ = ["save_model", "replace_directory"]


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` atomically: a reader sees the old file or the new one,
    never half of one, and a failure leaves the old file in place."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".lossgraph-", suffix=".onnx", dir=folder)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(model.SerializeToString())
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


@contextlib.contextmanager
def replace_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder that replaces ``target`` when the block succeeds.

    On failure the staging folder is removed and ``target`` is left as it was.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
