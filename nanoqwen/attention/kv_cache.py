"""The paged KV cache: one preallocated pool of blocks per layer for keys and for values.

Each pool is [num_blocks, block_size, kv_heads, head_dim]. A sequence's block table
(core/block_manager.py) says which blocks hold its tokens. A step writes its new keys/values at
their slots (block * block_size + offset) and attention reads a sequence's blocks back in order: as
a view when they are consecutive in the pool, otherwise gathered into one [B, kv_heads, S, head_dim]
tensor (the plain-PyTorch path; a GPU kernel can read the blocks in place instead).

The pool starts as zeros, never as uninitialised memory: attention reads (and masks) the unused
positions of a sequence's last block and of shorter sequences' padding, and a masked NaN left in
memory would still poison the output (0 * NaN = NaN). On CPU the zeros come from an anonymous
memory map, so the pool takes RAM only as blocks are first written.
"""

from __future__ import annotations

import math
import mmap

import torch

from nanoqwen.attention.metadata import DecodeGroup, PrefillChunk, consecutive


class KVCache:
    """Preallocated keys and values: [layers, num_blocks, block_size, kv_heads, head_dim] each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k, self.v = _zeros(shape, dtype, device), _zeros(shape, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write a step's keys/values k, v [N, Hkv, D] at their slots [N]."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    def decode_context(self, layer: int, group: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] of a group of decoding sequences."""
        if group.first_block is not None:
            num_blocks = group.max_len // self.block_size
            return self._view(layer, group.first_block, num_blocks, group.max_len)
        return (self._gather(self.k[layer], group.block_tables),
                self._gather(self.v[layer], group.block_tables))

    def sequence_context(self, layer: int,
                         chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, context_len, D] of one prompt chunk's sequence."""
        table = chunk.block_table
        if consecutive(table):
            return self._view(layer, table[0], len(table), chunk.context_len)
        index = torch.tensor([table], device=self.k.device)
        return (self._gather(self.k[layer], index)[:, :, : chunk.context_len],
                self._gather(self.v[layer], index)[:, :, : chunk.context_len])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's keys and values in every layer (for a forked sequence's partly
        filled block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def _view(self, layer: int, first: int, num_blocks: int,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        def view(pool: torch.Tensor) -> torch.Tensor:
            blocks = pool[layer, first: first + num_blocks]  # [nb, bs, Hkv, D]
            return blocks.reshape(1, -1, *blocks.shape[2:])[:, :length].transpose(1, 2)
        return view(self.k), view(self.v)

    @staticmethod
    def _gather(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """pool [num_blocks, bs, Hkv, D], block_tables [B, nb] -> [B, Hkv, nb * bs, D] (a copy)."""
        blocks = pool[block_tables]  # [B, nb, bs, Hkv, D]
        b, nb, bs = blocks.shape[:3]
        return blocks.view(b, nb * bs, *blocks.shape[3:]).transpose(1, 2)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by an anonymous mmap, so pages take RAM only once written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    # the tensor keeps the map alive
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
