"""nanoqwen computes what transformers' Qwen3ForCausalLM computes: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import SHAPES, hf_greedy, hf_model, our_greedy, prompt_logits

from nanoqwen import LLM

transformers = pytest.importorskip("transformers")

PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13, 358, 1075, 311, 3270, 2038, 304, 13027, 323,
          8257, 13]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_float32_logits_and_greedy_match_transformers(checkpoint, shape):
    shard = 2 << 20 if "sharded" in shape else 2 << 30
    path = checkpoint(shape, dtype="float32", max_shard_bytes=shard)
    if "sharded" in shape:
        assert (path / "model.safetensors.index.json").is_file()
    ref = hf_model(path, torch.float32)
    llm = LLM(path, dtype="float32", device="cpu")
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(llm.llm_engine.model, PROMPT)
    assert expected.abs().max() > 1.0  # logits far from flat, so argmax is not a coin toss
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert our_greedy(llm, PROMPT, 40) == hf_greedy(ref, PROMPT, 40)


def test_yarn_rope_and_attention_bias_match_transformers(checkpoint):
    path = checkpoint("yarn-bias", dtype="float32", attention_bias=True,
                      max_position_embeddings=4096,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 1024})
    ref = hf_model(path, torch.float32)
    llm = LLM(path, dtype="float32", device="cpu")
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(llm.llm_engine.model, PROMPT), expected, atol=1e-4,
                               rtol=0)


def test_bfloat16_greedy_and_logits_close(checkpoint):
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    ref = hf_model(path, torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cpu")
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(llm.llm_engine.model, PROMPT)
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.02)
    assert our_greedy(llm, PROMPT, 8) == hf_greedy(ref, PROMPT, 8)


def test_qwen3_0_6b_shape_matches_transformers(tmp_path):
    """The exact Qwen3-0.6B shape (28 layers, 16/8 heads, head_dim 128, tied 151936 vocab),
    short prompt."""
    from nanoqwen.model_loader.init_random import write_random_model

    path = write_random_model(tmp_path / "qwen3-0.6b", "qwen3-0.6b", dtype="float32", std=0.05)
    prompt = PROMPT[:8]
    ref = hf_model(path, torch.float32)
    with torch.inference_mode():
        expected = ref(torch.tensor([prompt])).logits[0].float()
    expected_tokens = hf_greedy(ref, prompt, 4)
    del ref
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64)
    got = prompt_logits(llm.llm_engine.model, prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert our_greedy(llm, prompt, 4) == expected_tokens
