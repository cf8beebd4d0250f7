"""The KV cache's storage type: `kv_cache_dtype` (vLLM's name; llama.cpp's --cache-type-k/-v).

- "auto": the model's dtype (bf16 for Qwen3 checkpoints);
- "int8": int8 codes, one float32 scale per token and kv head (llama.cpp's q8_0 cache is the same idea
  per block of 32 values);
- "fp8_e4m3" ("fp8" is the same, as in vLLM) and "fp8_e5m2": float8 codes, one float32 scale per token and kv
  head.

A quantized cache takes a little over half the bytes a token of a bf16 one does, so the same kv_cache_memory holds
about twice the tokens. nanoqwen/attention/kv_cache.py defines the quantization.
"""

from __future__ import annotations

from nanoqwen.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name of a kv_cache_dtype ("fp8" is "fp8_e4m3"); an unknown one is a ConfigError naming the
    choices."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r} is not a KV cache type; choose one of "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if name == "fp8" else name
