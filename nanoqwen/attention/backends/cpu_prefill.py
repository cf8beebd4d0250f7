"""A prompt chunk's attention on CPU in bf16, where nanoqwen's kernels are on: backends/sdpa.py's
prefill_attention_blocked's function (scores and probabilities rounded to bf16 where it rounds them), faster at
long contexts.

The reference makes four passes over each block's scores (the masked_fill, and torch.softmax reading bf16,
writing float32 inside, rounding) and allocates each block's scores and probabilities afresh: at a 16k context a
block's scores are 64 MB, a fresh mapping of the process's memory each time. Here a block's scores (at a long
context one kv head's, a few MB, so that they stay in the caches between the passes) are written by torch's product
(oneDNN: AMX or AVX-512 bf16 where the CPU has them) into one buffer, masked, normalised and rounded there in place
by nanoqwen's causal_softmax_ (nanoqwen/ops/cpu/csrc/gemm.cpp), and multiplied by the values.
bench/bench_long_context.py measures prompts of 512 to 16k tokens.
"""

from __future__ import annotations

import torch

from nanoqwen.ops.cpu import kernels as cpu_kernels

# query rows a block takes (their keys: those up to its last query); bench/bench_long_context.py measured the sizes
BF16_PREFILL_BLOCK = 256
SCORES_BYTES = 4 << 20  # the kv heads of a block go in one call while their scores fit in this


def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                           block: int = BF16_PREFILL_BLOCK) -> torch.Tensor:
    """prefill_attention_blocked(q, k, v, num_cached)'s function for bf16 CPU tensors: q [Hq, T, D] at positions
    num_cached .. num_cached + T - 1; k, v [Hkv, S, D] with S = num_cached + T -> [Hq, T, D]."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    # k and v as they come, views of the paged pool's layout ([S, Hkv, D] in memory): each head's first `keys`
    # rows are a matrix with a row stride, which the products read in place
    qg = q.view(hkv, g, t, d)  # the G query heads of each key/value head
    out = torch.empty_like(qg)
    rows = g * min(block, t)
    # all kv heads in one call where their scores fit in SCORES_BYTES (short prompts: fewer calls), else one at a
    # time (a long context: each head's scores stay in the caches, and its keys and values are plain strided
    # matrices that the 2-D products read in place; the batched ones copy a slice of the cache's layout first)
    together = hkv * rows * (num_cached + t) * q.element_size() <= SCORES_BYTES
    heads = hkv if together else 1
    scores_buffer = q.new_empty(heads * rows * (num_cached + t))  # the largest block's scores, `heads` heads'
    out_buffer = q.new_empty(heads * rows * d)
    no_bias = q.new_empty(1, 1, 1)
    for start in range(0, t, block):
        end = min(start + block, t)
        b, keys = end - start, num_cached + end
        for h0 in range(0, hkv, heads):
            hs = slice(h0, h0 + heads)
            qb = qg[hs, :, start:end].reshape(heads, g * b, d)
            scores = scores_buffer[: heads * g * b * keys].view(heads, g * b, keys)
            block_out = out_buffer[: heads * g * b * d].view(heads, g * b, d)
            if together:
                torch.baddbmm(no_bias, qb, k[hs, :keys].transpose(1, 2), beta=0, alpha=d**-0.5, out=scores)
            else:
                torch.addmm(no_bias[0], qb[0], k[h0, :keys].T, beta=0, alpha=d**-0.5, out=scores[0])
            cpu_kernels.causal_softmax_(scores, b)  # [heads, G*b, keys] probabilities, bf16
            if together:
                torch.bmm(scores, v[hs, :keys], out=block_out)
            else:
                torch.mm(scores[0], v[h0, :keys], out=block_out[0])
            out[hs, :, start:end] = block_out.view(heads, g, b, d)
    return out.view(hq, t, d)
