"""Attention for a step of the engine: `attend` stores the step's keys and values in the paged cache
and picks a kernel for each part of the batch. Each kernel computes what `attention_reference`
(nanoqwen/models/qwen3.py, the documented definition) computes; tests/test_model.py and
tests/test_gpu_paths.py hold them to it.

- attention_sdpa: prompt chunks through torch's fused scaled_dot_product_attention (GPU, and
  float32 on CPU);
- prefill_attention_blocked: prompt chunks on CPU in bf16/fp16, where it is faster than the fused
  kernel; on the float32 path where nanoqwen's GEMM was chosen (ops/cpu.py), its function in one
  C++ call (ops/cpu_gemv.py prefill_attention);
- decode_attention: one query per sequence, the query heads of a group folded into one SDPA call
  (CPU).
The paged decode kernels that read the KV cache in place (GPU) are in ops/paged_attention.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanoqwen.ops import cpu
from nanoqwen.ops.paged_attention import paged_decode_attention

if TYPE_CHECKING:
    from nanoqwen.engine.attention_metadata import AttentionMetadata, PrefillChunk
    from nanoqwen.engine.kv_cache import KVCache

PREFILL_BLOCK = 128  # query rows a block of CPU prompt attention takes (its keys: those up to its last query)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
           meta: AttentionMetadata) -> torch.Tensor:
    """Store k, v [N, Hkv, D] at their cache slots, then attention for every query
    q [N, Hq, D] -> [N, Hq, D].

    The N flat tokens are the decode tokens (one per sequence, first) and then the prompt chunks
    (meta: nanoqwen/engine/attention_metadata.py). Each attends to its sequence's cached keys and
    values.
    """
    kv_cache.store(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    # GPU: all decode rows in one call that reads the cache blocks in place
    if meta.paged_decode is not None:
        p, rows = meta.paged_decode, slice(0, meta.num_decode_tokens)
        paged_decode_attention(q[rows], kv_cache.k[layer], kv_cache.v[layer], p.block_tables,
                               p.context_lens, q.shape[-1] ** -0.5, p.backend, out=out[rows])
    # CPU: decode rows in groups of similar lengths, their blocks gathered
    for group in meta.decode_groups:
        rows = slice(group.start, group.end)
        out[rows] = decode_attention(q[rows], *kv_cache.decode_context(layer, group), group.mask)
    # prompt chunks: causal over their own tokens and what the cache held before
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = prefill_attention(q[rows], *kv_cache.sequence_context(layer, chunk), chunk)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      chunk: PrefillChunk) -> torch.Tensor:
    """One prompt chunk: q [T, Hq, D]; k, v [1, Hkv, S, D]
    (its whole context, S = chunk.context_len)."""
    num_cached = chunk.context_len - chunk.query_len
    if cpu.own_gemm(q):  # the same function in one C++ call (k, v: [S, Hkv, D], the cache's layout)
        return cpu.prefill_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1), num_cached, PREFILL_BLOCK)
    qh = q.transpose(0, 1)  # [Hq, T, D]
    if q.device.type == "cpu" and q.dtype != torch.float32:
        out = prefill_attention_blocked(qh, k[0], v[0], num_cached)
    else:
        # nothing cached before: the plain causal mask
        causal = chunk.context_len == chunk.query_len
        out = attention_sdpa(qh[None], k, v, None if causal else chunk.causal_mask,
                             causal=causal)[0]
    return out.transpose(0, 1)  # [T, Hq, D]


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
    """The same function as attention_reference through torch's fused kernel (faster)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)


def prefill_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                              block: int = PREFILL_BLOCK) -> torch.Tensor:
    """attention_reference for one prompt chunk, causal, in blocks of query rows (the CPU fast path
    in bf16/fp16).

    q [Hq, T, D] at positions num_cached .. num_cached + T - 1; k, v [Hkv, S, D] with S = num_cached
    + T. Query block [start, end) only needs keys 0 .. num_cached + end - 1, so the causal half is
    never computed, and only the block's last `end - start` keys need masking. The scores and the
    probabilities are rounded to the activation dtype, as transformers' eager attention rounds them
    (softmax accumulates in float32). On a CPU whose bf16 matmuls are slow (ops/cpu.py) the products
    run in float32 on the 16-bit values and are rounded at the same two places: the same function,
    faster there.
    """
    hq, t, d = q.shape
    hkv = k.shape[0]
    dtype = q.dtype
    compute = torch.float32 if cpu.upcast_16bit(q) else dtype
    # one copy out of the paged pool's layout
    k, v = k.to(compute).contiguous(), v.to(compute).contiguous()
    # the G query heads of each key/value head, never repeating K/V
    qg = q.view(hkv, hq // hkv, t, d)
    out = torch.empty_like(qg)
    future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)  # key after query
    no_bias = k.new_empty(1, 1, 1)
    for start in range(0, t, block):
        end = min(start + block, t)
        b, keys = end - start, num_cached + end
        qb = qg[:, :, start:end].reshape(hkv, -1, d).to(compute)  # [Hkv, G*b, D]
        scores = torch.baddbmm(no_bias, qb, k[:, :keys].transpose(1, 2), beta=0, alpha=d**-0.5)
        scores = scores.to(dtype)  # (a no-op unless computed in float32)
        scores.view(hkv, -1, b, keys)[..., keys - b:].masked_fill_(future[:b, :b], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, G*b, keys]
        out[:, :, start:end] = (probs.to(compute) @ v[:, :keys]).view(hkv, -1, b, d)
    return out.view(hq, t, d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """attention_reference for one query per sequence:
    q [B, Hq, D], k/v [B, Hkv, S, D] -> [B, Hq, D].

    The G query heads that share a key/value head are handed to the fused kernel as G rows of one
    [B, Hkv, G, D] query: they sit at the same position, so no causal mask is needed and nothing is
    repeated (several times faster on CPU than the kernel's own GQA handling for a single query).
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    # reshape, not view: CUDA's kernels may return [B, Hkv, G, D] laid out as [B, G, Hkv, D]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(b, hq, d)
