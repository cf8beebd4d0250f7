"""Attention for a step of the engine: `attend` stores the step's keys and values in the paged cache
and picks a backend for each part of the batch (nanoqwen/attention/backends/). Each backend computes
what `attention_reference` (nanoqwen/models/qwen3.py, the documented definition) computes; the tests
hold them to it.

- prompt chunks: backends/sdpa.py's attention_sdpa (torch's fused scaled_dot_product_attention: GPU,
  and float32 on CPU) or prefill_attention_blocked (CPU in bf16/fp16, where it is faster than the
  fused kernel); its function faster where nanoqwen's kernels are on: on the bf16 matmul path
  backends/cpu_prefill.py (torch's products around nanoqwen's softmax), on the float32 path where
  nanoqwen's GEMM was chosen (nanoqwen/ops/cpu/matmul.py) one C++ call (nanoqwen/ops/cpu/kernels.py);
- decode rows: the paged kernels that read the KV cache in place (backends/paged.py: Triton,
  flash-attn, nanoqwen's C++ on CPU, a PyTorch reference), or on CPU without them backends/sdpa.py's
  decode_attention over each group's gathered blocks.
"""

from __future__ import annotations

import torch

from nanoqwen.attention.backends.cpu_prefill import prefill_attention_bf16
from nanoqwen.attention.backends.paged import paged_decode_attention
from nanoqwen.attention.backends.sdpa import (
    PREFILL_BLOCK,
    attention_sdpa,
    decode_attention,
    prefill_attention_blocked,
)
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata, PrefillChunk
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
           meta: AttentionMetadata, matmul: MatmulPath) -> torch.Tensor:
    """Store k, v [N, Hkv, D] at their cache slots, then attention for every query
    q [N, Hq, D] -> [N, Hq, D].

    The N flat tokens are the decode tokens (one per sequence, first) and then the prompt chunks
    (meta: nanoqwen/attention/metadata.py). Each attends to its sequence's cached keys and
    values. matmul: the engine's CPU matmul path (prompt chunks compute as its products do).
    """
    kv_cache.store(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    # GPU: all decode rows in one call that reads the cache blocks in place
    if meta.paged_decode is not None:
        p, rows = meta.paged_decode, slice(0, meta.num_decode_tokens)
        k_pool, v_pool, k_scale, v_scale = kv_cache.layer(layer)
        paged_decode_attention(q[rows], k_pool, v_pool, p.block_tables, p.context_lens, q.shape[-1] ** -0.5,
                               p.backend, out=out[rows], k_scale=k_scale, v_scale=v_scale)
    # CPU: decode rows in groups of similar lengths, their blocks gathered
    for group in meta.decode_groups:
        rows = slice(group.start, group.end)
        out[rows] = decode_attention(q[rows], *kv_cache.decode_context(layer, group), group.mask)
    # prompt chunks: causal over their own tokens and what the cache held before
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = prefill_attention(q[rows], *kv_cache.sequence_context(layer, chunk), chunk, matmul)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk,
                      matmul: MatmulPath) -> torch.Tensor:
    """One prompt chunk: q [T, Hq, D]; k, v [1, Hkv, S, D]
    (its whole context, S = chunk.context_len)."""
    num_cached = chunk.context_len - chunk.query_len
    if matmul.own_gemm(q):  # the same function in one C++ call (k, v: [S, Hkv, D], the cache's layout)
        return cpu_kernels.prefill_attention(q, k[0].transpose(0, 1), v[0].transpose(0, 1), num_cached,
                                             q.shape[-1] ** -0.5, PREFILL_BLOCK)
    qh = q.transpose(0, 1)  # [Hq, T, D]
    if matmul.own_prompt_softmax(q):
        out = prefill_attention_bf16(qh, k[0], v[0], num_cached)
    elif q.device.type == "cpu" and q.dtype != torch.float32:
        out = prefill_attention_blocked(qh, k[0], v[0], num_cached, upcast=matmul.upcast_16bit(q))
    else:
        # nothing cached before: the plain causal mask
        causal = chunk.context_len == chunk.query_len
        out = attention_sdpa(qh[None], k, v, None if causal else chunk.causal_mask,
                             causal=causal)[0]
    return out.transpose(0, 1)  # [T, Hq, D]
