"""Memory on the CPU: freed heap handed back to the system, and buffers the kernel backs with 2 MiB pages.

A decode step streams memory it does not reuse: every weight once, and at long contexts each sequence's cached
keys and values. In 4 KiB pages that is a TLB miss, a page walk, every 4 KiB; in 2 MiB pages (transparent huge
pages) one every 2 MiB. Linux gives a process huge pages where it asks for them with madvise(MADV_HUGEPAGE) when
/sys/kernel/mm/transparent_hugepage/enabled is "madvise" (the usual default) or "always"; torch's allocator never
asks. `huge_page_buffer` makes such memory: worker/huge_pages.py moves a model's weights into it, and the paged KV
cache (attention/kv_cache.py) is allocated in it. NANOQWEN_HUGE_PAGES=0 turns both off; where the kernel has no
transparent huge pages ("never", or not Linux) neither applies.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref

import torch

HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


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


def transparent_huge_pages() -> str | None:
    """The kernel's setting ("always", "madvise" or "never"), None where it cannot be read."""
    try:
        with open(THP_SETTING) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def kernel_gives_huge_pages() -> bool:
    """Whether the kernel backs advised memory with huge pages (its setting "always" or "madvise")."""
    return transparent_huge_pages() in ("always", "madvise")


def huge_pages_enabled() -> bool:
    """Whether nanoqwen asks for huge pages: not turned off (NANOQWEN_HUGE_PAGES=0) and the kernel gives them."""
    return os.environ.get("NANOQWEN_HUGE_PAGES", "1") != "0" and kernel_gives_huge_pages()


# each buffer made here: its mapping (weakly: it lives as long as some tensor views it), first address, end
_buffers: list[tuple[weakref.ref, int, int]] = []


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros in a fresh private anonymous mapping, 2 MiB-aligned and advised for huge pages
    (untouched pages cost no memory until written, then a 2 MiB page each). The tensor keeps the mapping alive.
    Raises OSError where the kernel refuses the advice (built without transparent huge pages)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    _buffers.append((weakref.ref(mapping), buffer.data_ptr(), buffer.data_ptr() + nbytes))
    return buffer


def in_huge_page_memory(storage: torch.UntypedStorage) -> bool:
    """Whether a storage is in a live buffer made by huge_page_buffer."""
    _buffers[:] = [b for b in _buffers if b[0]() is not None]  # (a freed one's addresses may be reused)
    return any(first <= storage.data_ptr() < end for _, first, end in _buffers)
