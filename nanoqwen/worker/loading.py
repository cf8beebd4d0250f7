"""A rank's model, ready to run: the kernels chosen for it first (kernel_selection.py), then this rank's shard of
the weights loaded into a model built with them (nanoqwen/model_loader/loader.py). Rank 0 (the engine), the
tensor-parallel workers (tp_worker.py) and a speculative draft model load theirs the same way."""

from __future__ import annotations

from pathlib import Path

import torch

from nanoqwen.config.model import Qwen3Config
from nanoqwen.model_loader.loader import load_model
from nanoqwen.models.qwen3 import Qwen3ForCausalLM
from nanoqwen.worker.kernel_selection import select_kernels


def load_model_with_kernels(model_dir: Path, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
                            max_model_len: int, enforce_eager: bool, quantization: str | None = None,
                            tp_rank: int = 0, tp_size: int = 1, task: str = "generate",
                            show_progress: bool | None = None) -> Qwen3ForCausalLM:
    """The model of model_dir (this rank's shard), built with the kernels select_kernels chooses for this
    device, dtype and enforce_eager (`model.kernels`)."""
    kernels = select_kernels(device, dtype, enforce_eager)
    return load_model(model_dir, config, dtype, device, max_model_len, tp_rank, tp_size,
                      show_progress=show_progress, quantization=quantization, task=task, kernels=kernels)
