"""The paged KV cache: one preallocated pool of blocks per layer for keys and for values.

Each pool is [num_blocks, block_size, kv_heads, head_dim]. A sequence's block table
(core/block_manager.py) says which blocks hold its tokens. A step writes its new keys/values at
their slots (block * block_size + offset) and attention reads a sequence's blocks back in order: as
a view when they are consecutive in the pool, otherwise gathered into one [B, kv_heads, S, head_dim]
tensor (the plain-PyTorch path; a GPU kernel can read the blocks in place instead).

A quantized cache (kv_cache_dtype, nanoqwen/config/cache.py) stores each token's vector of a kv head
as codes (int8 or float8, `KVQuantization`) and one float32 scale: `quantize_kv` and `dequantize_kv`
below are the definition, which nanoqwen's C++ kernels reproduce when they write and read the cache in
place (nanoqwen/ops/cpu/kernels.py). Read back through this class, the values come dequantized to the
model's dtype.

The pool starts as zeros, never as uninitialised memory: attention reads (and masks) the unused
positions of a sequence's last block and of shorter sequences' padding, and a masked NaN left in
memory would still poison the output (0 * NaN = NaN). On CPU the zeros come from an anonymous
memory map, so the pool takes RAM only as blocks are first written; it is advised for 2 MiB pages (a page
walk every 2 MiB, not every 4 KiB, as a long context's decode step streams the cache: ops/cpu/memory.py),
so RAM is then taken 2 MiB at a time.
"""

from __future__ import annotations

import logging
import math
import mmap
from typing import NamedTuple

import torch

from nanoqwen.attention.metadata import DecodeGroup, PrefillChunk, consecutive
from nanoqwen.ops.cpu.memory import huge_page_buffer, huge_pages_enabled

logger = logging.getLogger("nanoqwen")


class KVQuantization(NamedTuple):
    """How a quantized cache stores a vector x of head_dim values: scale = max|x| / qmax (float32) and codes =
    x / scale rounded to `dtype` (int8: to nearest, ties to even; float8: torch's conversion), all zeros for a
    zero vector. The value read back is codes * scale."""

    dtype: torch.dtype
    qmax: float  # the largest code magnitude: int8 127, float8 e4m3 448, e5m2 57344


KV_QUANTIZATIONS = {
    "int8": KVQuantization(torch.int8, 127.0),
    "fp8_e4m3": KVQuantization(torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVQuantization(torch.float8_e5m2, 57344.0),
}


def quantize_kv(x: torch.Tensor, quant: KVQuantization) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] of quant.dtype, scale [...] float32): the definition."""
    xf = x.float()
    scale = xf.abs().amax(-1) / quant.qmax  # [...]
    y = torch.where(scale[..., None] > 0, xf / scale[..., None], 0.0).clamp(-quant.qmax, quant.qmax)
    codes = y.round().to(quant.dtype) if quant.dtype == torch.int8 else y.to(quant.dtype)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D], scale [...] -> codes * scale [..., D] in float32, then rounded to dtype."""
    return (codes.float() * scale[..., None]).to(dtype)


class KVCache:
    """Preallocated keys and values: [layers, num_blocks, block_size, kv_heads, head_dim] each; for a quantized
    cache, codes, and their scales k_scale, v_scale [layers, num_blocks, block_size, kv_heads] (None otherwise).

    dtype: the model's (what attention computes in); cache_dtype: "auto" (dtype itself) or a name of
    KV_QUANTIZATIONS.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, cache_dtype: str = "auto") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.quantization = KV_QUANTIZATIONS.get(cache_dtype)
        codes = dtype if self.quantization is None else self.quantization.dtype
        self.k, self.v = _zeros(shape, codes, device), _zeros(shape, codes, device)
        self.k_scale = self.v_scale = None
        if self.quantization is not None:
            self.k_scale = _zeros(shape[:-1], torch.float32, device)
            self.v_scale = _zeros(shape[:-1], torch.float32, device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, cache_dtype: str = "auto") -> int:
        quant = KV_QUANTIZATIONS.get(cache_dtype)
        if quant is None:
            return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        return 2 * num_layers * num_kv_heads * (head_dim * quant.dtype.itemsize + 4)  # codes and a float32 scale

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One layer's pools as the paged kernels take them: k, v [num_blocks, block_size, Hkv, D] and their
        scales [num_blocks, block_size, Hkv] (None for an unquantized cache)."""
        if self.quantization is None:
            return self.k[layer], self.v[layer], None, None
        return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write a step's keys/values k, v [N, Hkv, D] at their slots [N] (quantized by quantize_kv for a
        quantized cache)."""
        if self.quantization is None:
            self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
            self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
            return
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            codes, scale = quantize_kv(x, self.quantization)
            # (as bytes: CPU torch copies float8 by index only that way)
            pool[layer].view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, codes.view(torch.uint8))
            scales[layer].view(-1, x.shape[1]).index_copy_(0, slot_mapping, scale)

    def decode_context(self, layer: int, group: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S, D] of a group of decoding sequences."""
        if group.first_block is not None:
            num_blocks = group.max_len // self.block_size
            return self._view(layer, group.first_block, num_blocks, group.max_len)
        return self._gather(layer, group.block_tables)

    def sequence_context(self, layer: int,
                         chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [1, Hkv, context_len, D] of one prompt chunk's sequence."""
        table = chunk.block_table
        if consecutive(table):
            return self._view(layer, table[0], len(table), chunk.context_len)
        k, v = self._gather(layer, torch.tensor([table], device=self.k.device))
        return k[:, :, : chunk.context_len], v[:, :, : chunk.context_len]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's keys and values in every layer (for a forked sequence's partly
        filled block)."""
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                _as_bytes(pool)[:, dst] = _as_bytes(pool)[:, src]

    def _view(self, layer: int, first: int, num_blocks: int,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive blocks: a view of the pool ([1, Hkv, length, D]), or their dequantized copy."""
        def view(pool: torch.Tensor | None) -> torch.Tensor | None:
            if pool is None:
                return None
            blocks = pool[layer, first: first + num_blocks]  # [nb, bs, Hkv, (D)]
            return blocks.reshape(1, -1, *blocks.shape[2:])[:, :length].transpose(1, 2)
        return self._values(view(self.k), view(self.k_scale)), self._values(view(self.v), view(self.v_scale))

    def _gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [B, nb] -> keys and values [B, Hkv, nb * bs, D] (a copy)."""
        def gather(pool: torch.Tensor | None) -> torch.Tensor | None:
            if pool is None:
                return None
            blocks = _as_stored(pool[layer], _as_bytes(pool[layer])[block_tables])  # [B, nb, bs, Hkv, (D)]
            b, nb, bs = blocks.shape[:3]
            return blocks.view(b, nb * bs, *blocks.shape[3:]).transpose(1, 2)
        return (self._values(gather(self.k), gather(self.k_scale)),
                self._values(gather(self.v), gather(self.v_scale)))

    def _values(self, codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return codes if scale is None else dequantize_kv(codes, scale, self.dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (CPU torch indexes and copies float8 only that way); others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _as_stored(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """_as_bytes undone: t read as like's dtype."""
    return t.view(like.dtype) if t.dtype != like.dtype else t


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU an anonymous memory map, so pages take RAM only once written: advised for 2 MiB
    pages where nanoqwen uses them (ops/cpu/memory.py), as a long context's decode step streams its cache."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = max(1, numel) * dtype.itemsize  # (an empty pool still maps one element)
    if huge_pages_enabled():
        try:
            return huge_page_buffer(nbytes).view(dtype)[:numel].view(shape)
        except OSError as e:  # (a kernel built without transparent huge pages refuses the advice)
            logger.debug("KV cache stays in 4 KiB pages: madvise(MADV_HUGEPAGE) failed: %s", e)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype)[:numel].view(shape)  # (the tensor keeps the map alive)
