"""Attention backends, each computing what `attention_reference` (nanoqwen/models/qwen3.py) defines: torch's
SDPA and a blocked CPU version for prompt chunks (sdpa.py), the paged decode kernels that read the cache in
place with their PyTorch reference (paged.py; the Triton kernel: triton_paged.py)."""
