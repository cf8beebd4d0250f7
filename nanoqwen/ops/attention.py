"""Fast attention kernels for the model's non-paged paths, each computing what `attention_reference`
(nanoqwen/models/qwen3.py, the documented definition) computes; tests/test_model.py holds them to it.

- attention_sdpa: prompt chunks through torch's fused scaled_dot_product_attention (GPU, and float32 on CPU);
- prefill_attention_blocked: prompt chunks on CPU in bf16/fp16, where it is 3-4x faster than the fused kernel;
- decode_attention: one query per sequence, the query heads of a group folded into one SDPA call (CPU).
The paged decode kernels that read the KV cache in place (GPU) are in ops/paged_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
    """The same function as attention_reference through torch's fused kernel (faster)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def prefill_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                              block: int = 128) -> torch.Tensor:
    """attention_reference for one prompt chunk, causal, in blocks of query rows (the CPU fast path in bf16/fp16).

    q [Hq, T, D] at positions num_cached .. num_cached + T - 1; k, v [Hkv, S, D] with S = num_cached + T.
    Query block [start, end) only needs keys 0 .. num_cached + end - 1, so the causal half is never
    computed, and only the block's last `end - start` keys need masking. The scores are rounded to the
    activation dtype, as transformers' eager attention does (softmax still accumulates in float32
    inside torch); on CPU this is 3-4x faster than torch's fused kernel for bf16.
    """
    hq, t, d = q.shape
    hkv = k.shape[0]
    k, v = k.contiguous(), v.contiguous()  # one copy out of the paged pool's layout, not one per block
    qg = q.view(hkv, hq // hkv, t, d)  # the G query heads of each key/value head, never repeating K/V
    out = torch.empty_like(qg)
    future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)  # key after query
    no_bias = q.new_empty(1, 1, 1)
    for start in range(0, t, block):
        end = min(start + block, t)
        b, keys = end - start, num_cached + end
        qb = qg[:, :, start:end].reshape(hkv, -1, d)  # [Hkv, G*b, D]
        scores = torch.baddbmm(no_bias, qb, k[:, :keys].transpose(1, 2), beta=0, alpha=d**-0.5)
        scores.view(hkv, -1, b, keys)[..., keys - b:].masked_fill_(future[:b, :b], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, G*b, keys]
        out[:, :, start:end] = (probs @ v[:, :keys]).view(hkv, -1, b, d)
    return out.view(hq, t, d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """attention_reference for one query per sequence: q [B, Hq, D], k/v [B, Hkv, S, D] -> [B, Hq, D].

    The G query heads that share a key/value head are handed to the fused kernel as G rows of one
    [B, Hkv, G, D] query: they sit at the same position, so no causal mask is needed and nothing is
    repeated (several times faster on CPU than the kernel's own GQA handling for a single query).
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v, attn_mask=mask).view(b, hq, d)
