"""The paged KV cache and the per-step metadata that tells attention where each sequence lives.

For every layer, keys and values live in one preallocated pool of blocks:
[num_blocks, block_size, kv_heads, head_dim]. A sequence's block table (engine/block_manager.py)
says which blocks hold its tokens. A step writes its new keys/values at their slots
(block * block_size + offset) and attention reads a sequence's blocks back in order: as a view
when they are consecutive in the pool, otherwise gathered into one [B, kv_heads, S, head_dim]
tensor (the plain-PyTorch path; a GPU kernel can read the blocks in place instead).

The pool starts as zeros, never as uninitialised memory: attention reads (and masks) the unused
positions of a sequence's last block and of shorter sequences' padding, and a masked NaN left in
memory would still poison the output (0 * NaN = NaN). On CPU the zeros come from an anonymous
memory map, so the pool takes RAM only as blocks are first written.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from functools import cached_property

import torch

from nanoqwen.engine.paged_decode import PagedDecode, padded_block_tables
from nanoqwen.errors import ConfigError


@dataclass
class PrefillChunk:
    """One sequence's prompt tokens in this step (positions context_len - query_len .. context_len - 1)."""

    block_table: list[int]
    query_start: int  # offset of its first token in the flat batch
    query_len: int
    context_len: int  # tokens in the cache after this step, including the query
    device: torch.device | None = None

    @cached_property
    def causal_mask(self) -> torch.Tensor:
        """[1, 1, T, S] bool: query i (position context_len - T + i) sees keys 0 .. that position. Built on first
        use, once per step, only by the attention paths that take a mask (SDPA over a partly cached context):
        T x S can be large, and the CPU bf16 path never needs it."""
        q_pos = torch.arange(self.context_len - self.query_len, self.context_len)[:, None]
        return (torch.arange(self.context_len)[None, :] <= q_pos)[None, None].to(self.device)


@dataclass
class DecodeGroup:
    """Decoding sequences (rows start..end) of similar length, attended in one call, padded to the longest."""

    start: int
    end: int
    max_len: int  # S: keys read per sequence (its widest block table * block_size)
    mask: torch.Tensor  # [B, 1, 1, S] bool: position < that sequence's length
    block_tables: torch.Tensor | None = None  # [B, S / block_size], padded with block 0
    first_block: int | None = None  # set instead when B == 1 and its blocks are consecutive: read a view


@dataclass
class AttentionMetadata:
    """Where the N flat tokens of a step go: decode tokens first (one per sequence), then prompt chunks."""

    slot_mapping: torch.Tensor  # [N] cache slot (block * block_size + offset) of each token
    positions: torch.Tensor  # [N] position of each token in its sequence
    block_size: int
    num_decode_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    paged_decode: PagedDecode | None = None  # set instead of decode_groups on the GPU path (engine/paged_decode.py)
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(cls, decode: list[tuple[list[int], int]], prefill: list[tuple[list[int], int, int]],
              block_size: int, device: torch.device, paged_backend: str | None = None) -> AttentionMetadata:
        """decode: (block_table, context_len) per decoding sequence, shortest first (so groups pad little);
        prefill: (block_table, num_cached, query_len) per prompt chunk. paged_backend: attend to all decode rows
        in one call of that paged-attention backend instead of in groups."""
        slots: list[int] = []
        positions: list[int] = []

        def place(table: list[int], start: int, end: int) -> None:
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))

        for table, ctx in decode:
            place(table, ctx - 1, ctx)
        meta = cls(slot_mapping=torch.empty(0), positions=torch.empty(0), block_size=block_size,
                   num_decode_tokens=len(decode))
        if paged_backend is not None and decode:
            meta.paged_decode = PagedDecode.build(decode, block_size, device, paged_backend)
        start = 0
        while start < len(decode) and meta.paged_decode is None:  # CPU: groups of similar lengths
            end = _group_end(decode, start, block_size)
            meta.decode_groups.append(_decode_group(decode, start, end, block_size, device))
            start = end
        start = len(decode)
        for table, num_cached, query_len in prefill:
            context_len = num_cached + query_len
            meta.prefills.append(PrefillChunk(table[: -(-context_len // block_size)], start, query_len, context_len,
                                              device))
            place(table, num_cached, context_len)
            start += query_len
        meta.slot_mapping = torch.tensor(slots, device=device)
        meta.positions = torch.tensor(positions, device=device)
        return meta


def _group_end(decode: list[tuple[list[int], int]], start: int, block_size: int) -> int:
    """Extend a group while its sequences stay within 1.5x (+2 blocks) of its first one's length."""
    first = -(-decode[start][1] // block_size)
    end = start + 1
    while end < len(decode) and -(-decode[end][1] // block_size) <= first * 1.5 + 2:
        end += 1
    return end


def _decode_group(decode: list[tuple[list[int], int]], start: int, end: int, block_size: int,
                  device: torch.device) -> DecodeGroup:
    rows = decode[start:end]
    tables = padded_block_tables(rows, block_size)
    width = len(tables[0])
    lens = torch.tensor([ctx for _, ctx in rows])
    keep = torch.arange(width * block_size)[None, :] < lens[:, None]  # [B, S]
    group = DecodeGroup(start, end, width * block_size, keep[:, None, None, :].to(device))
    if len(rows) == 1 and _consecutive(tables[0]):
        group.first_block = tables[0][0]
    else:
        group.block_tables = torch.tensor(tables, device=device)
    return group


def _consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


class KVCache:
    """Preallocated keys and values: [layers, num_blocks, block_size, kv_heads, head_dim] each."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k, self.v = _zeros(shape, dtype, device), _zeros(shape, dtype, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write this step's keys/values k, v [N, Hkv, D] at their slots."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)

    def decode_context(self, layer: int, group: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] of a group of decoding sequences."""
        if group.first_block is not None:
            return self._view(layer, group.first_block, group.max_len // self.block_size, group.max_len)
        return self._gather(self.k[layer], group.block_tables), self._gather(self.v[layer], group.block_tables)

    def sequence_context(self, layer: int, chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, context_len, D] of one prompt chunk's sequence."""
        table = chunk.block_table
        if _consecutive(table):
            return self._view(layer, table[0], len(table), chunk.context_len)
        index = torch.tensor([table], device=self.k.device)
        return (self._gather(self.k[layer], index)[:, :, : chunk.context_len],
                self._gather(self.v[layer], index)[:, :, : chunk.context_len])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's keys and values in every layer (for a forked sequence's partly filled block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def _view(self, layer: int, first: int, num_blocks: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def kv_cache_budget(kv_cache_memory: int | float | None, device: torch.device) -> int:
    """Bytes for the KV cache: a byte count, a fraction of the memory still free, or the default.

    Default: on GPU 90% of the free memory left after the weights, minus 1 GiB for activations; on CPU
    4 GiB, or half the available memory if that is less (vLLM's CPU default is 4 GiB too).
    """
    if device.type == "cuda":  # what loading freed (bf16 matrices quantised, a tied head's discarded allocation)
        torch.cuda.empty_cache()  # is still reserved by torch's allocator, which mem_get_info counts as used
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_cpu_memory()
    if kv_cache_memory is None:
        if device.type == "cuda":
            return int(0.9 * free) - (1 << 30)
        return min(4 << 30, free // 2)
    if isinstance(kv_cache_memory, float) and 0 < kv_cache_memory <= 1:
        return int(kv_cache_memory * free)
    if isinstance(kv_cache_memory, int) and kv_cache_memory > 0:
        return kv_cache_memory
    raise ConfigError(f"kv_cache_memory={kv_cache_memory!r} must be a byte count (int > 0) or a fraction of free "
                      "memory (float in (0, 1])")


def _available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # unknown: assume a modest machine


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by an anonymous mmap, so pages take RAM only once written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the map alive
