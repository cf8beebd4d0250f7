"""The KV cache and the per-step metadata that tells attention where each sequence lives.

The cache is allocated once: for every layer, `max_num_seqs` slots of `max_model_len`
positions, laid out [slot, kv_head, position, head_dim] so that the keys of one sequence and
head are contiguous and attention can read a slot as a view, without copying. Each running
sequence owns one slot; a step writes its new keys/values at their positions (no torch.cat
growth).

The cache starts as zeros, never as uninitialised memory: batched decode reads (and masks) the
positions between a short sequence's end and the longest one's, and a masked NaN left in
memory would still poison the output (0 * NaN = NaN).

On CPU the cache is an anonymous memory map reserved without backing: the OS gives a page of
RAM only when a token's keys are written there, and `release` hands a finished sequence's
pages back. The page table does the paging, so memory follows the tokens actually cached while
attention still reads each slot as one contiguous view. On GPU the cache is real memory and
must fit.
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass, field

import torch

from nanoqwen.errors import ConfigError


@dataclass
class PrefillChunk:
    """One sequence's prompt tokens in this step (positions context_len - query_len .. context_len - 1)."""

    slot: int
    query_start: int  # offset of its first token in the flat batch
    query_len: int
    context_len: int  # tokens in the cache after this step, including the query
    mask: torch.Tensor | None = None  # [1, 1, T, S] bool, only when part of the context was cached before


@dataclass
class AttentionMetadata:
    """Where the N flat tokens of a step go: decode tokens first (one per sequence), then prompt chunks."""

    slots: torch.Tensor  # [N] cache slot of each token
    positions: torch.Tensor  # [N] position of each token in its sequence
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None  # [B] slot of each decoding sequence
    decode_slot_range: tuple[int, int] | None = None  # (first, last + 1) when those slots are consecutive
    decode_max_len: int = 0  # longest context among decoding sequences
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, S] bool, None when all contexts are equally long
    prefills: list[PrefillChunk] = field(default_factory=list)

    @classmethod
    def build(cls, decode: list[tuple[int, int]], prefill: list[tuple[int, int, int]],
              device: torch.device) -> AttentionMetadata:
        """decode: (slot, context_len) per decoding sequence; prefill: (slot, num_cached, query_len)."""
        slots: list[int] = [s for s, _ in decode]
        positions: list[int] = [ctx - 1 for _, ctx in decode]
        meta = cls(slots=torch.empty(0), positions=torch.empty(0), num_decode_tokens=len(decode))
        if decode:
            decode_slots = [s for s, _ in decode]
            lens = torch.tensor([ctx for _, ctx in decode])
            meta.decode_max_len = int(lens.max())
            meta.decode_slots = torch.tensor(decode_slots, device=device)
            if decode_slots == list(range(decode_slots[0], decode_slots[0] + len(decode_slots))):
                meta.decode_slot_range = (decode_slots[0], decode_slots[0] + len(decode_slots))
            if int(lens.min()) != meta.decode_max_len:
                keep = torch.arange(meta.decode_max_len)[None, :] < lens[:, None]  # [B, S]
                meta.decode_mask = keep[:, None, None, :].to(device)
        start = len(decode)
        for slot, num_cached, query_len in prefill:
            context_len = num_cached + query_len
            chunk = PrefillChunk(slot, start, query_len, context_len)
            if num_cached:
                # query i (position num_cached + i) sees keys 0 .. num_cached + i
                q_pos = torch.arange(num_cached, context_len)[:, None]
                chunk.mask = (torch.arange(context_len)[None, :] <= q_pos)[None, None].to(device)
            meta.prefills.append(chunk)
            slots += [slot] * query_len
            positions += range(num_cached, context_len)
            start += query_len
        meta.slots = torch.tensor(slots, device=device)
        meta.positions = torch.tensor(positions, device=device)
        return meta


class KVCache:
    """Preallocated keys and values: [layers, slots, kv_heads, max_model_len, head_dim] each."""

    def __init__(self, num_layers: int, num_slots: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_model_len, head_dim)
        self.num_slots, self.max_model_len = num_slots, max_model_len
        nbytes = 2 * math.prod(shape) * dtype.itemsize
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            if nbytes > 0.9 * free:
                raise ConfigError(
                    f"the KV cache for max_num_seqs={num_slots} x max_model_len={max_model_len} needs "
                    f"{nbytes / 2**30:.1f} GiB but {free / 2**30:.1f} GiB of GPU memory is free; "
                    "lower --max-model-len or max_num_seqs")
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
            self._maps: list[mmap.mmap] = []
        else:
            self._maps = [_reserve(nbytes // 2) for _ in range(2)]
            self.k, self.v = (torch.frombuffer(m, dtype=dtype).view(shape) for m in self._maps)
        self._slot_bytes = num_kv_heads * max_model_len * head_dim * dtype.itemsize

    def release(self, slot: int) -> None:
        """Give a finished sequence's cache pages back to the OS (CPU); they read as zeros again."""
        page = mmap.PAGESIZE
        for m in self._maps:
            for layer in range(self.k.shape[0]):
                start = (layer * self.num_slots + slot) * self._slot_bytes
                first, end = -(-start // page) * page, (start + self._slot_bytes) // page * page
                if end > first:
                    m.madvise(mmap.MADV_DONTNEED, first, end - first)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write this step's keys/values k, v [N, Hkv, D] at (slot, position) of each token."""
        self.k[layer][meta.slots, :, meta.positions] = k
        self.v[layer][meta.slots, :, meta.positions] = v

    def decode_context(self, layer: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] of the decoding sequences: a view when their slots are consecutive."""
        s = meta.decode_max_len
        if meta.decode_slot_range is not None:
            first, end = meta.decode_slot_range
            return self.k[layer, first:end, :, :s], self.v[layer, first:end, :, :s]
        return self.k[layer, meta.decode_slots, :, :s], self.v[layer, meta.decode_slots, :, :s]

    def sequence_context(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, length, D] of one sequence, as a view."""
        return self.k[layer, slot: slot + 1, :, :length], self.v[layer, slot: slot + 1, :, :length]


# Linux's MAP_NORESERVE (not exported by Python's mmap module): reserve address space without
# committing memory, so a cache larger than RAM + swap can be mapped and is backed only where used.
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


def _reserve(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    return mmap.mmap(-1, max(1, nbytes), flags=flags)
