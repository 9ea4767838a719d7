"""Safe writes: atomic, following the umask, and never over what lossgraph did not create.

Every file and folder lossgraph writes goes through this module:

- a file is written to a temporary sibling, flushed to disk, then renamed over the
  target (:func:`write_file`, :func:`save_model`): a reader sees the old file or the
  new one, never half of one;
- a folder is written into a staging sibling, which then takes the target's place
  (:func:`replace_directory`), by an atomic exchange of the two where the system has
  one (Linux ``renameat2(RENAME_EXCHANGE)``), else by two renames;
- what is already at the target is replaced only when it is recognisably lossgraph's
  own output: an ONNX file lossgraph wrote (it carries the :data:`WRITTEN_BY_KEY`
  metadata mark), or a folder of a :class:`FolderKind` (a program or checkpoint
  folder, recognised by its manifest) holding nothing but what lossgraph wrote there.
  Anything else is an :class:`~lossgraph.errors.UnsafeWriteError`, raised before any
  work. A missing parent folder is an error too: lossgraph creates only the file or
  folder it was asked for.

New files and folders get the usual permissions (``0o666``/``0o777`` less the umask),
like those of any ordinary program.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MissingFolderError, UnsafeWriteError
from .metadata import WRITTEN_BY_KEY

if TYPE_CHECKING:
    import onnx

__all__ = ["WRITTEN_BY_KEY", "FolderKind", "serialize", "written_by_lossgraph", "write_file",
           "save_model", "ensure_folder", "check_file_target", "check_folder_target",
           "replace_directory", "remove_directory"]

_SHOWN = 5  # foreign entries named in an error message


def serialize(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes, marked as lossgraph's output (the caller's model is not changed)."""
    if any(p.key == WRITTEN_BY_KEY for p in model.metadata_props):
        return model.SerializeToString()
    marked = type(model)()
    marked.CopyFrom(model)
    marked.metadata_props.add(key=WRITTEN_BY_KEY, value="lossgraph")
    return marked.SerializeToString()


def written_by_lossgraph(path: Path) -> bool:
    """True when ``path`` is a regular file holding an ONNX model lossgraph wrote."""
    if path.is_symlink() or not path.is_file():
        return False
    import onnx  # here: the command line checks its outputs before it imports onnx

    try:
        model = onnx.load_model_from_string(path.read_bytes())
    except Exception:  # not ONNX at all: certainly not ours
        return False
    return any(p.key == WRITTEN_BY_KEY for p in model.metadata_props)


# -- checks done before any work ----------------------------------------------------------


def _parent_folder(target: Path, what: str) -> Path:
    parent = target.parent
    if not parent.is_dir():
        error = UnsafeWriteError if os.path.lexists(parent) else MissingFolderError
        raise error(
            f"Cannot write {what} {str(target)!r}: the folder {str(parent)!r} does not exist. "
            "Create it first (lossgraph creates only the file or folder it is asked for).")
    return parent


def ensure_folder(path: str | os.PathLike) -> Path:
    """The folder ``path``, made (alone, not its parents) when it does not exist yet."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists() or folder.is_symlink():
        raise UnsafeWriteError(f"{str(folder)!r} is not a folder; lossgraph writes its files "
                               "into a folder there. Choose another path.")
    _parent_folder(folder.absolute(), "the folder")
    folder.mkdir(0o777)
    return folder


def check_file_target(path: str | os.PathLike, owned: Callable[[Path], bool] = written_by_lossgraph,
                      overwrite: bool = False) -> Path:
    """The absolute path, once it is clear a file may be written there; else UnsafeWriteError.

    An existing file is replaced only when ``owned(path)`` says lossgraph wrote it, or
    with ``overwrite=True``; a folder, a link or a special file never.
    """
    target = Path(path).absolute()
    _parent_folder(target, "the file")
    if target.is_symlink() or (target.exists() and not target.is_file()):
        kind = "a link" if target.is_symlink() else "a folder" if target.is_dir() else \
            "not a regular file"
        raise UnsafeWriteError(
            f"{str(target)!r} is {kind}; lossgraph writes a file only where there is none or "
            "one it wrote itself. Choose another output path.")
    if target.exists() and not overwrite and not owned(target):
        raise UnsafeWriteError(
            f"{str(target)!r} exists and was not written by lossgraph: it is left untouched. "
            "Choose another output path, or pass overwrite=True (--force on the command "
            "line) to replace it.")
    return target


@dataclass(frozen=True)
class FolderKind:
    """A kind of folder lossgraph writes, and how to recognise one.

    ``entries(folder)`` returns the names of the entries lossgraph wrote in ``folder``
    (read from its manifest), or ``None`` when ``folder`` is not of this kind.
    """

    description: str
    entries: Callable[[Path], set[str] | None]


def _foreign_entries(folder: Path, kind: FolderKind) -> list[str] | None:
    """Entries of ``folder`` lossgraph did not write there (None: not a folder of ``kind``)."""
    present = sorted(os.listdir(folder))
    if not present:
        return []
    owned = kind.entries(folder)
    if owned is None:
        return None
    return [name for name in present if name not in owned]


def check_folder_target(path: str | os.PathLike, kind: FolderKind) -> Path:
    """The absolute path, once it is clear a ``kind`` folder may be written there.

    Accepted: no such entry yet, an empty folder, or a ``kind`` folder holding only
    what lossgraph wrote. Anything else is an UnsafeWriteError naming what is in the way.
    """
    target = Path(path).absolute()
    _parent_folder(target, kind.description)
    advice = "Choose a new or empty folder, or move those files away yourself."
    if target.is_symlink():
        raise UnsafeWriteError(f"{str(target)!r} is a link; lossgraph does not replace links. "
                               + advice)
    if not target.exists():
        return target
    if not target.is_dir():
        raise UnsafeWriteError(
            f"{str(target)!r} is a file, not a folder: lossgraph writes {kind.description} "
            f"as a folder and does not replace files with one. {advice}")
    foreign = _foreign_entries(target, kind)
    if foreign is None:
        names = sorted(os.listdir(target))
        raise UnsafeWriteError(
            f"{str(target)!r} is not empty and is not {kind.description} (it holds "
            f"{_listing(names)}); lossgraph replaces only its own folders. {advice}")
    if foreign:
        raise UnsafeWriteError(
            f"{str(target)!r} is {kind.description} but also holds {_listing(foreign)}, which "
            f"lossgraph did not write; saving would delete it. {advice}")
    return target


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


# -- writing ---------------------------------------------------------------------------------


def _fsync_folder(folder: Path) -> None:
    """Make a folder's entries (a rename into it) durable; a no-op where unsupported."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _sibling(target: Path) -> Path:
    return target.with_name(f".{target.name}.lossgraph-{secrets.token_hex(4)}")


def write_file(path: str | os.PathLike, data: bytes, owned: Callable[[Path], bool] =
               written_by_lossgraph, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically, after :func:`check_file_target`."""
    target = check_file_target(path, owned, overwrite)
    temporary = _sibling(target)
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_folder(target.parent)
    return target


def save_model(model: onnx.ModelProto, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``model`` to ``path`` atomically, marked as lossgraph's (see :func:`serialize`).

    An existing file is replaced only when lossgraph wrote it, or with ``overwrite=True``.
    """
    return write_file(path, serialize(model), overwrite=overwrite)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the file system or kernel has no exchange
    raise OSError(code, os.strerror(code), str(a))


def _sync_tree(folder: Path) -> None:
    """Flush every file under ``folder``, then the folders themselves, to disk."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            handle = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)
        _fsync_folder(Path(root))


@contextlib.contextmanager
def replace_directory(path: str | os.PathLike, kind: FolderKind) -> Iterator[Path]:
    """Yield an empty staging folder that takes the place of ``path`` when the block succeeds.

    ``path`` is checked first (:func:`check_folder_target`). On failure the staging
    folder is removed and ``path`` is left as it was; a killed process leaves the old
    folder in place and at most a hidden ``.<name>.lossgraph-*`` sibling.
    """
    target = check_folder_target(path, kind)
    staging = _sibling(target)
    os.mkdir(staging, 0o777)
    try:
        yield staging
        _sync_tree(staging)
        if not target.exists():
            os.rename(staging, target)
            retired = None
        elif _exchange(staging, target):
            retired = staging  # the old folder is now at the staging path
        else:
            retired = _sibling(target)
            os.rename(target, retired)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(retired, target)
                raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # made and filled by lossgraph alone
        raise
    _fsync_folder(target.parent)
    if retired is not None:
        _discard_old(retired, kind)


def remove_directory(path: str | os.PathLike, kind: FolderKind) -> bool:
    """Delete the ``kind`` folder at ``path`` (a checkpoint that rotates out) when it is
    recognisably lossgraph's and holds nothing else; otherwise leave it and return False
    (a link, a file, an empty or foreign folder, one with a foreign entry)."""
    folder = Path(path)
    if folder.is_symlink() or not folder.is_dir() or kind.entries(folder) is None:
        return False
    if _foreign_entries(folder, kind):
        return False
    shutil.rmtree(folder)
    _fsync_folder(folder.parent)
    return True


def _discard_old(folder: Path, kind: FolderKind) -> None:
    """Delete a replaced ``kind`` folder, unless something foreign appeared in it meanwhile."""
    foreign = _foreign_entries(folder, kind)
    if foreign is None or foreign:
        warnings.warn(f"lossgraph kept the replaced folder at {str(folder)!r}: it holds "
                      f"{_listing(foreign or sorted(os.listdir(folder)))}, which lossgraph did "
                      "not write.", stacklevel=3)
        return
    shutil.rmtree(folder)
