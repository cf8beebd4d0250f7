"""Attention metadata for the GPU decode path: every decode row of a step in one paged-attention call.

Where the CPU path batches decoding sequences in groups of similar lengths and gathers their blocks
(kv_cache.DecodeGroup), a GPU kernel reads the blocks in place (nanoqwen/ops/paged_attention.py), so one call
covers all rows whatever their lengths. The tensors have shapes that depend only on the number of rows and the
table width, which is what lets engine/cuda_graph.py replay a captured graph on new contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedDecode:
    block_tables: torch.Tensor  # [B, W] int32: row i's cache blocks, in order, padded with block 0 (never read)
    context_lens: torch.Tensor  # [B] int32: keys row i attends to, its new token included (0: a padding row)
    backend: str  # "triton", "flash" or "torch" (nanoqwen/ops/paged_attention.py)

    @classmethod
    def build(cls, decode: list[tuple[list[int], int]], block_size: int, device: torch.device,
              backend: str) -> PagedDecode:
        """decode: (block_table, context_len) per decoding sequence."""
        return cls(torch.tensor(padded_block_tables(decode, block_size), dtype=torch.int32, device=device),
                   torch.tensor([ctx for _, ctx in decode], dtype=torch.int32, device=device), backend)


def padded_block_tables(decode: list[tuple[list[int], int]], block_size: int) -> list[list[int]]:
    """Each row's blocks up to its context_len, padded with block 0 to the widest row's count."""
    num_blocks = [-(-ctx // block_size) for _, ctx in decode]
    width = max(num_blocks)
    return [table[:nb] + [0] * (width - nb) for (table, _), nb in zip(decode, num_blocks, strict=True)]
