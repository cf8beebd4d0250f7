"""Decode attention over the paged KV cache: one query per sequence, its keys and values found
through its block table (the GPU fast path, and CPUs where nanoqwen's own kernels are on; otherwise the CPU path gathers
groups of sequences instead, see nanoqwen/attention/attend.py).

    paged_decode_attention(q [B, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
                           block_tables [B, max_blocks] int32, context_lens [B] int32, scale,
                           backend) -> [B, Hq, D]

A quantized cache (nanoqwen/attention/kv_cache.py) passes its codes as k_cache, v_cache and their scales
k_scale, v_scale [num_blocks, block_size, Hkv]; every backend but flash reads it (each value codes * scale).

Row i attends to the first context_lens[i] positions of its sequence: position p lives at slot
p % block_size of block block_tables[i, p // block_size]. Entries of block_tables past a row's
context are never read. A row with context_len 0 (padding added to reach a captured CUDA-graph batch
size) attends to nothing and gets zeros. The shapes never depend on the data, so all three backends
can be captured in a graph:

- "torch": the documented reference in plain PyTorch (gathers all max_blocks blocks, masks, softmax
  in fp32);
- "triton": triton_paged.py beside this file, reading the blocks in place;
- "flash": flash-attn's flash_attn_with_kvcache (needs block_size a multiple of 256, flash-attn 2's
  limit);
- "cpu": nanoqwen's C++ kernel (nanoqwen/ops/cpu/kernels.py), reading the blocks in place, bf16 on CPU.

`attention_backend(device, block_size, dtype, cpu_kernels_on, kv_cache_dtype)` picks one: flash when flash_attn
is importable and the block size and cache allow, else triton, on CUDA; on CPU "cpu" where the engine's matmul
path has nanoqwen's own decode kernels on (nanoqwen/ops/cpu/matmul.py) and the model is bf16, else None: the
grouped gather path. The
environment variable NANOQWEN_PAGED_ATTENTION=auto|flash|triton|torch|off overrides the choice (off:
the CPU path).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from nanoqwen.attention.kv_cache import dequantize_kv
from nanoqwen.ops.cpu import kernels as cpu_kernels

logger = logging.getLogger("nanoqwen")
BACKENDS = ("flash", "triton", "torch", "cpu")


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: float, out: torch.Tensor | None = None,
                                     k_scale: torch.Tensor | None = None,
                                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: gather each row's blocks into [B, Hkv, S, D] (S = max_blocks * block_size;
    a quantized cache's values dequantized to float32), mask the positions at or past its context_len,
    softmax in float32; the G = Hq / Hkv query heads of a kv head share it."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    tables = block_tables.long()
    k, v = k_cache[tables].float(), v_cache[tables].float()  # [B, W, bs, Hkv, D]
    if k_scale is not None:
        k, v = dequantize_kv(k, k_scale[tables]), dequantize_kv(v, v_scale[tables])
    k = k.flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.flatten(1, 2).transpose(1, 2)
    keep = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]  # [B, S]
    keep = keep[:, None, None, :]  # [B, 1, 1, S]
    qg = q.float().view(b, hkv, hq // hkv, 1, d)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, 1, S]
    probs = scores.masked_fill(~keep.unsqueeze(1), float("-inf")).softmax(-1)
    probs = probs.masked_fill(~keep.unsqueeze(1), 0.0)  # a row with nothing to attend to: NaN -> 0
    result = (probs @ v.unsqueeze(2)).view(b, hq, d).to(q.dtype)
    if out is None:
        return result
    return out.copy_(result)


def paged_decode_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn's paged KV-cache kernel (one query token per sequence, so no causal mask is
    needed)."""
    from flash_attn import flash_attn_with_kvcache

    o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                block_table=block_tables,
                                softmax_scale=scale).squeeze(1)  # [B, Hq, D]
    # padding rows: zeros, whatever the kernel wrote
    o = torch.where((context_lens > 0)[:, None, None], o, 0.0)
    if out is None:
        return o
    return out.copy_(o)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           backend: str, out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to a backend (see the module docstring); the result is written into out when
    given."""
    if backend == "triton":
        from nanoqwen.attention.backends.triton_paged import paged_decode_attention_triton
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens,
                                             scale, out, k_scale, v_scale)
    if backend == "flash":
        if k_scale is not None:
            raise ValueError("flash-attn reads 16-bit caches only, not a quantized one: use triton or torch")
        return paged_decode_attention_flash(q, k_cache, v_cache, block_tables, context_lens,
                                            scale, out)
    if backend == "cpu":
        return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                  scale, out, k_scale=k_scale, v_scale=v_scale)
    if backend == "torch":
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                                scale, out, k_scale, v_scale)
    raise ValueError(f"unknown paged attention backend {backend!r}; "
                     f"use one of {', '.join(BACKENDS)}")


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def flash_fits(block_size: int, dtype: torch.dtype) -> bool:
    """Whether flash-attn 2 can read this cache: 16-bit values, blocks of a multiple of 256 tokens."""
    return dtype in (torch.float16, torch.bfloat16) and block_size % 256 == 0


def _check_choice(choice: str, device: torch.device, block_size: int, dtype: torch.dtype,
                  quantized: bool) -> None:
    """A backend named in NANOQWEN_PAGED_ATTENTION that cannot run this engine's cache: one clear error at start,
    not one from inside its kernel at the first decode step. (triton stays allowed on CPU: the tests run it
    there under TRITON_INTERPRET=1.)"""
    problem = None
    if choice == "cpu" and (device.type != "cpu" or dtype != torch.bfloat16):
        problem = f"the cpu backend is nanoqwen's kernel for a bfloat16 cache on CPU, not {dtype} on {device.type}"
    elif choice == "flash" and (device.type != "cuda" or not flash_fits(block_size, dtype) or quantized):
        problem = (f"flash-attn 2 runs float16 or bfloat16 caches of blocks of a multiple of 256 tokens on CUDA, "
                   f"not {dtype}{' quantized' if quantized else ''}, block_size {block_size} on {device.type}")
    if problem:
        raise ValueError(f"NANOQWEN_PAGED_ATTENTION={choice}: {problem}; "
                         "unset it (auto) or use torch, the reference that runs everywhere")


def attention_backend(device: torch.device, block_size: int, dtype: torch.dtype = torch.bfloat16,
                      cpu_kernels_on: bool = False, kv_cache_dtype: str = "auto") -> str | None:
    """The paged decode backend for this device, or None for the grouped gather path of
    nanoqwen/attention/attend.py. cpu_kernels_on: whether the engine's CPU matmul path has nanoqwen's own
    decode kernels on (MatmulPath.gemv); kv_cache_dtype: the cache's (nanoqwen/config/cache.py)."""
    quantized = kv_cache_dtype != "auto"
    choice = os.environ.get("NANOQWEN_PAGED_ATTENTION", "auto")
    if choice == "off":
        return None
    if choice in BACKENDS:
        _check_choice(choice, device, block_size, dtype, quantized)
        return choice
    if choice != "auto":
        raise ValueError(f"NANOQWEN_PAGED_ATTENTION={choice!r}: "
                         f"use auto, off or one of {', '.join(BACKENDS)}")
    if device.type == "cpu":
        return "cpu" if cpu_kernels_on and dtype == torch.bfloat16 else None
    if device.type != "cuda":
        return None
    if has_module("flash_attn") and flash_fits(block_size, dtype) and not quantized:
        return "flash"
    if has_module("triton"):
        return "triton"
    logger.warning("neither triton nor flash_attn is installed: "
                   "decode attention gathers the KV cache (slower), and CUDA graphs are off")
    return None
