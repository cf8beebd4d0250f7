"""The process's heap on the CPU: freed memory handed back to the system."""

from __future__ import annotations

import ctypes
import sys


def release_freed_memory() -> None:
    """Return the freed heap pages to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps freed memory for reuse: a weight's old pages (the model-dtype matrices a quantised layer
    replaced, the copies moved into huge pages) would stay in the process's RSS, and a matrix allocated above
    glibc's mmap threshold would take new pages on top of them.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
