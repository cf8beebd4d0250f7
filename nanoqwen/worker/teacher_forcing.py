"""Next-token log-probabilities along a fixed token sequence, each token after the prompt fed as a decode step that
reads every earlier position from a paged KV cache of the given type (kv_cache_dtype): what a cache type costs a
model's distributions, measured against another type on the same tokens. tests/attention/test_kv_cache_dtype.py
bounds each type's cost with it; bench/bench_kv_quality.py sets it beside llama.cpp's cache types."""

from __future__ import annotations

import torch

from nanoqwen.attention.backends.paged import attention_backend
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.attention.metadata import AttentionMetadata, DecodeRow, PrefillRow
from nanoqwen.models.qwen3 import Qwen3ForCausalLM

BLOCK_SIZE = 16


def continuation_logprobs(model: Qwen3ForCausalLM, tokens: list[int], prompt_len: int,
                          cache_dtype: str) -> torch.Tensor:
    """The model's next-token log-probabilities [len(tokens) - prompt_len, V] (float32) along `tokens`: the first
    prompt_len as one prompt, then each further token as a decode step that reads every earlier one from a cache
    of cache_dtype (a cache of its own, on the model's device), through the decode path the engine picks for it."""
    c, device = model.config, next(model.parameters()).device
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    cache = KVCache(c.num_hidden_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads, c.head_dim, model.dtype, device,
                    cache_dtype)
    table = list(range(num_blocks))
    backend = attention_backend(device, BLOCK_SIZE, model.dtype, cpu_kernels_on=model.kernels.matmul.gemv,
                                kv_cache_dtype=cache_dtype)
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata.build([], [PrefillRow(table, 0, prompt_len)], BLOCK_SIZE, device)
        hidden = model(torch.tensor(tokens[:prompt_len], device=device), meta.positions, cache, meta)
        rows.append(model.compute_logits(hidden[-1:]))
        for n in range(prompt_len + 1, len(tokens)):
            meta = AttentionMetadata.build([DecodeRow(table, n)], [], BLOCK_SIZE, device, paged_backend=backend)
            hidden = model(torch.tensor(tokens[n - 1: n], device=device), meta.positions, cache, meta)
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows).float().log_softmax(-1)
