"""Memory handed back to the system.

glibc's allocator keeps the pages it freed for reuse: after a compile that built and
dropped large protobuf messages, a process holds hundreds of megabytes it no longer uses
(BERT-base: 1.4 GiB, issue 27). ``malloc_trim(0)`` returns them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable

__all__ = ["release_free_memory"]


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system (glibc's ``malloc_trim(0)``);
    whether it could (False elsewhere: another C library, another system)."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
