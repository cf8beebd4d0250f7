"""How much memory the KV cache gets, and so how many blocks: the policy, apart from the pool itself
(nanoqwen/attention/kv_cache.py)."""

from __future__ import annotations

import torch
from torch import nn

from nanoqwen.attention.kv_cache import KVCache


def kv_cache_budget(kv_cache_memory: int | float | None, device: torch.device) -> int:
    """Bytes for the KV cache: a byte count, a fraction of the memory still free (a float in (0, 1];
    checked by EngineConfig), or the default.

    Default: on GPU 90% of the free memory left after the weights, minus 1 GiB for activations; on
    CPU 4 GiB, or half the available memory if that is less (vLLM's CPU default is 4 GiB too).
    """
    if device.type == "cuda":
        # what loading freed (bf16 matrices quantised, a tied head's discarded allocation) is
        # still reserved by torch's allocator, which mem_get_info counts as used
        torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_cpu_memory()
    if kv_cache_memory is None:
        if device.type == "cuda":
            return int(0.9 * free) - (1 << 30)
        return min(4 << 30, free // 2)
    if isinstance(kv_cache_memory, float):
        return int(kv_cache_memory * free)
    return kv_cache_memory


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # unknown: assume a modest machine


def kv_cache_blocks(models: list[nn.Module], dtype: torch.dtype, block_size: int, budget: int,
                    kv_cache_dtype: str = "auto") -> int:
    """How many KV blocks of block_size tokens `budget` bytes hold for every model in `models` (a target and
    its draft each keep a cache of the same blocks; a tensor-parallel rank's holds only its heads), each cache
    stored as kv_cache_dtype."""
    per_token = sum(KVCache.bytes_per_token(m.config.num_hidden_layers, m.num_kv_heads, m.config.head_dim, dtype,
                                            kv_cache_dtype)
                    for m in models)
    return max(0, budget) // (per_token * block_size)
