"""Helpers for the LoRA tests: random PEFT adapters written by PEFT itself over a random-weight checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(base: Path, out: Path, seed: int, **lora_config) -> Path:
    """A random LoRA adapter of transformers' model of `base`, saved by PEFT's save_pretrained into `out`
    (init_lora_weights=False: A and B both random, so the adapter changes the logits)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = hf_model(base, torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, **lora_config)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    """PEFT's own PeftModel of `adapter` over transformers' float32 model of `base`."""
    peft = pytest.importorskip("peft")
    return peft.PeftModel.from_pretrained(hf_model(base, torch.float32), adapter).eval()
