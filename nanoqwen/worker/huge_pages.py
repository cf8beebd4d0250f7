"""A CPU model's weights moved into memory the kernel backs with 2 MiB pages (ops/cpu/memory.py says why).

A CPU decode step streams every weight from memory once (hundreds of MB a token), and an int4 decode step runs
faster from 2 MiB pages (bench/bench_model.py measures it, with and without NANOQWEN_HUGE_PAGES=0). So, once the
model is loaded (and quantised), its tensors from MIN_BYTES to MAX_BYTES are copied into one huge_page_buffer, and
each parameter and buffer is pointed at its copy (the values, shapes, strides and tied weights stay as they were).
One storage at a time: the old one is freed as its copy is made (and malloc's heap trimmed every TRIM_BYTES), so
memory peaks at the model plus one tensor and TRIM_BYTES. A tensor over MAX_BYTES (an embedding table; a tied LM
head, which is that table) stays where it is, so the peak is at most the model plus MAX_BYTES and TRIM_BYTES.

NANOQWEN_HUGE_PAGES=0 turns this off; where the kernel has no transparent huge pages ("never", or not Linux) it is
skipped.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoqwen.ops.cpu.memory import huge_page_buffer, huge_pages_enabled, in_huge_page_memory, release_freed_memory

logger = logging.getLogger("nanoqwen")
MIN_BYTES = 64 << 10  # smaller storages (norms) stay where they are
MAX_BYTES = 256 << 20  # and bigger ones, whose copy would raise the peak of memory by as much
ALIGN = 64  # each copy starts on a cache line
TRIM_BYTES = 64 << 20  # the heap is trimmed each time this much has been freed (release_freed_memory)


def move_to_huge_pages(model: nn.Module) -> int:
    """Point the model's parameters and buffers of MIN_BYTES to MAX_BYTES at copies in huge-page memory;
    returns the bytes moved (0 when off or not supported)."""
    if not huge_pages_enabled():
        return 0
    # the storages to move (tied weights share one; none already moved, as a draft's embedding shared with its
    # target), each with the slots viewing it: (module, name, is_parameter, the view's offset in the storage; read
    # here, before a tied Parameter's first slot repoints it)
    moves: dict[int, tuple[torch.UntypedStorage, list[tuple[nn.Module, str, bool, int]]]] = {}
    for module in model.modules():
        for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "cpu":
                    continue
                storage = tensor.untyped_storage()
                if MIN_BYTES <= storage.nbytes() <= MAX_BYTES and not in_huge_page_memory(storage):
                    slot = (module, name, is_parameter, tensor.storage_offset())
                    moves.setdefault(storage.data_ptr(), (storage, []))[1].append(slot)
    if not moves:
        return 0
    total = sum(_aligned(storage.nbytes()) for storage, _ in moves.values())
    try:
        arena = huge_page_buffer(total)
    except OSError as e:  # (a kernel built without transparent huge pages refuses the advice)
        logger.debug("weights stay in 4 KiB pages: madvise(MADV_HUGEPAGE) failed: %s", e)
        return 0
    start = unreturned = 0  # where the next copy goes; bytes freed since the heap was last trimmed
    while moves:
        _, (storage, slots) = moves.popitem()
        arena[start:start + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        for module, name, is_parameter, storage_offset in slots:
            old = (module._parameters if is_parameter else module._buffers)[name]
            offset = start // old.element_size() + storage_offset
            new = torch.empty(0, dtype=old.dtype).set_(arena.untyped_storage(), offset, old.size(), old.stride())
            if is_parameter:
                old.data = new  # (the same Parameter object: ties and references to it hold)
            else:
                module._buffers[name] = new
        start += _aligned(storage.nbytes())
        unreturned += storage.nbytes()
        del storage, slots, old  # (the last references to the old storage: its memory goes back now)
        if unreturned >= TRIM_BYTES:
            release_freed_memory()
            unreturned = 0
    release_freed_memory()
    logger.debug("weights moved into huge-page memory: %.0f MiB", total / 2**20)
    return total


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
