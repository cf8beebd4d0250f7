"""Attention through torch's own kernels: prompt chunks (attention_sdpa, and prefill_attention_blocked for
16-bit CPU tensors) and decode rows gathered from the cache (decode_attention, the CPU path without the paged
kernels). Each computes what `attention_reference` (nanoqwen/models/qwen3.py) computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_BLOCK = 128  # query rows a block of CPU prompt attention takes (its keys: those up to its last query)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
    """The same function as attention_reference through torch's fused kernel (faster)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)


def prefill_attention_blocked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                              block: int = PREFILL_BLOCK, upcast: bool = False) -> torch.Tensor:
    """attention_reference for one prompt chunk, causal, in blocks of query rows (the CPU fast path
    in bf16/fp16).

    q [Hq, T, D] at positions num_cached .. num_cached + T - 1; k, v [Hkv, S, D] with S = num_cached
    + T. Query block [start, end) only needs keys 0 .. num_cached + end - 1, so the causal half is
    never computed, and only the block's last `end - start` keys need masking. The scores and the
    probabilities are rounded to the activation dtype, as transformers' eager attention rounds them
    (softmax accumulates in float32). With upcast (a CPU whose bf16 matmuls are slow: the float32
    path of nanoqwen/ops/cpu/matmul.py) the products run in float32 on the 16-bit values and are
    rounded at the same two places: the same function, faster there.
    """
    hq, t, d = q.shape
    hkv = k.shape[0]
    dtype = q.dtype
    compute = torch.float32 if upcast else dtype
    # one copy out of the paged pool's layout, the keys transposed: the first `keys` of each head are then a
    # matrix of the layout the product takes as it is (a slice of [S, D] rows is copied by the product first)
    k_t, v = k.to(compute).transpose(1, 2).contiguous(), v.to(compute).contiguous()  # [Hkv, D, S], [Hkv, S, D]
    # the G query heads of each key/value head, never repeating K/V
    qg = q.view(hkv, hq // hkv, t, d)
    out = torch.empty_like(qg)
    future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)  # key after query
    no_bias = v.new_empty(1, 1, 1)
    for start in range(0, t, block):
        end = min(start + block, t)
        b, keys = end - start, num_cached + end
        qb = qg[:, :, start:end].reshape(hkv, -1, d).to(compute)  # [Hkv, G*b, D]
        scores = torch.baddbmm(no_bias, qb, k_t[:, :, :keys], beta=0, alpha=d**-0.5)
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
