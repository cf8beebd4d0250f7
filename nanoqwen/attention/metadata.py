"""Per-step attention metadata: where each of a step's flat tokens sits in the paged KV cache, and
which sequence's keys each attends to. ModelRunner builds it once per step; every layer's `attend`
(nanoqwen/attention/attend.py) reads it.

A step's tokens are flat (`[N, hidden]`): first one token per decoding sequence (a `DecodeRow`),
then the prompt chunks (a `PrefillRow` each). Decode rows are attended in one of two ways:
- CPU: in groups of similar lengths (`DecodeGroup`), each group's blocks
  gathered into one padded tensor;
- GPU: all rows in one paged-attention call that reads the blocks in place (`PagedDecode`). Its
  tensors have shapes that depend only on the number of rows and the table width, which is what lets
  worker/cuda_graph.py replay a captured graph on new contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch


class DecodeRow(NamedTuple):
    """A decoding sequence in a step: its newest token is the query."""

    block_table: list[int]
    context_len: int  # tokens in the cache after this step, the new one included


class PrefillRow(NamedTuple):
    """A prompt chunk in a step: tokens num_cached .. num_cached + query_len - 1 of its sequence."""

    block_table: list[int]
    num_cached: int  # tokens of the sequence already in the cache
    query_len: int


@dataclass
class PrefillChunk:
    """One sequence's prompt tokens in this step (positions context_len - query_len ..
    context_len - 1)."""

    block_table: list[int]
    query_start: int  # offset of its first token in the flat batch
    query_len: int
    context_len: int  # tokens in the cache after this step, including the query
    device: torch.device | None = None

    @cached_property
    def causal_mask(self) -> torch.Tensor:
        """[1, 1, T, S] bool: query i (position context_len - T + i) sees keys 0 .. that position.
        Built on first use, once per step, only by the attention paths that take a mask (SDPA over a
        partly cached context): T x S can be large, and the CPU bf16 path never needs it."""
        q_pos = torch.arange(self.context_len - self.query_len, self.context_len)[:, None]
        return (torch.arange(self.context_len)[None, :] <= q_pos)[None, None].to(self.device)


@dataclass
class DecodeGroup:
    """Decoding sequences (rows start..end) of similar length, attended in one call,
    padded to the longest."""

    start: int
    end: int
    max_len: int  # S: keys read per sequence (its widest block table * block_size)
    mask: torch.Tensor  # [B, 1, 1, S] bool: position < that sequence's length
    block_tables: torch.Tensor | None = None  # [B, S / block_size], padded with block 0
    # set instead when B == 1 and its blocks are consecutive: read a view
    first_block: int | None = None


@dataclass
class PagedDecode:
    """Every decode row of a step for one paged-attention call (nanoqwen/attention/backends/paged.py)."""

    # [B, W] int32: row i's cache blocks, in order, padded with block 0 (never read)
    block_tables: torch.Tensor
    # [B] int32: keys row i attends to, its new token included (0: a padding row)
    context_lens: torch.Tensor
    backend: str  # "triton", "flash" or "torch"

    @classmethod
    def build(cls, decode: list[DecodeRow], block_size: int, device: torch.device,
              backend: str) -> PagedDecode:
        tables = padded_block_tables(decode, block_size)
        context_lens = [row.context_len for row in decode]
        return cls(torch.tensor(tables, dtype=torch.int32, device=device),
                   torch.tensor(context_lens, dtype=torch.int32, device=device), backend)


@dataclass
class AttentionMetadata:
    """Where the N flat tokens of a step go: decode tokens first (one per sequence), then
    prompt chunks."""

    slot_mapping: torch.Tensor  # [N] cache slot (block * block_size + offset) of each token
    positions: torch.Tensor  # [N] position of each token in its sequence
    block_size: int
    num_decode_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    paged_decode: PagedDecode | None = None  # set instead of decode_groups on the GPU path
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(cls, decode: list[DecodeRow], prefill: list[PrefillRow], block_size: int,
              device: torch.device, paged_backend: str | None = None) -> AttentionMetadata:
        """decode: shortest first (so groups pad little). paged_backend: attend to all decode rows
        in one call of that paged-attention backend instead of in groups."""
        slots: list[int] = []
        positions: list[int] = []

        def place(table: list[int], start: int, end: int) -> None:
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, end))

        for row in decode:
            place(row.block_table, row.context_len - 1, row.context_len)
        meta = cls(slot_mapping=torch.empty(0), positions=torch.empty(0), block_size=block_size,
                   num_decode_tokens=len(decode))
        if paged_backend is not None and decode:
            meta.paged_decode = PagedDecode.build(decode, block_size, device, paged_backend)
        start = 0
        while start < len(decode) and meta.paged_decode is None:  # CPU: groups of similar lengths
            end = _group_end(decode, start, block_size)
            meta.decode_groups.append(_decode_group(decode[start:end], start, block_size, device))
            start = end
        query_start = len(decode)
        for row in prefill:
            context_len = row.num_cached + row.query_len
            table = row.block_table[: -(-context_len // block_size)]
            chunk = PrefillChunk(table, query_start, row.query_len, context_len, device)
            meta.prefills.append(chunk)
            place(row.block_table, row.num_cached, context_len)
            query_start += row.query_len
        meta.slot_mapping = torch.tensor(slots, device=device)
        meta.positions = torch.tensor(positions, device=device)
        return meta


def padded_block_tables(decode: list[DecodeRow], block_size: int) -> list[list[int]]:
    """Each row's blocks up to its context_len, padded with block 0 to the widest row's count."""
    num_blocks = [-(-row.context_len // block_size) for row in decode]
    for row, nb in zip(decode, num_blocks, strict=True):
        if len(row.block_table) < nb:  # (padding would send its keys to block 0, another sequence's)
            raise RuntimeError(f"a decode row's block table has {len(row.block_table)} blocks, fewer than the "
                               f"{nb} its {row.context_len} tokens need: the scheduler reserved too few")
    width = max(num_blocks)
    return [row.block_table[:nb] + [0] * (width - nb)
            for row, nb in zip(decode, num_blocks, strict=True)]


def consecutive(blocks: list[int]) -> bool:
    """Whether the blocks follow each other in the pool (then a sequence's keys are one view,
    no copy)."""
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def _group_end(decode: list[DecodeRow], start: int, block_size: int) -> int:
    """Extend a group while its sequences stay within 1.5x (+2 blocks) of its first one's length."""
    first = -(-decode[start].context_len // block_size)
    end = start + 1
    while end < len(decode) and -(-decode[end].context_len // block_size) <= first * 1.5 + 2:
        end += 1
    return end


def _decode_group(rows: list[DecodeRow], start: int, block_size: int,
                  device: torch.device) -> DecodeGroup:
    tables = padded_block_tables(rows, block_size)
    width = len(tables[0])
    lens = torch.tensor([row.context_len for row in rows])
    keep = torch.arange(width * block_size)[None, :] < lens[:, None]  # [B, S]
    mask = keep[:, None, None, :].to(device)
    group = DecodeGroup(start, start + len(rows), width * block_size, mask)
    if len(rows) == 1 and consecutive(tables[0]):
        group.first_block = tables[0][0]
    else:
        group.block_tables = torch.tensor(tables, device=device)
    return group
