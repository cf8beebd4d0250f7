"""Attention over the paged KV cache: the cache itself (kv_cache.py), where each step's tokens sit in it
(metadata.py), `attend` (attend.py), which picks a backend for each part of a batch, and every backend in
one place (backends/)."""
