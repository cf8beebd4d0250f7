"""The engine with a quantized KV cache (kv_cache_dtype): the same memory holds about twice the tokens, and
prefix caching, chunked prefill, preemption, n > 1, speculative decoding and the fused CPU decode step give a
request the answer it gets alone through the same cache type. (What the cache type costs the model's
distributions: tests/attention/test_kv_cache_dtype.py.)"""

from __future__ import annotations

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.attention.kv_cache import KVCache

PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(60)]
NEIGHBOURS = [[(11 * i + 5) % 5000 + 100 for i in range(n)] for n in (30, 7, 45)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
LOGPROB_BOUND = 0.1  # a few rounding steps of a bf16 logit, as tests/engine/test_consistency.py


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny", dtype="bfloat16", std=0.1, head_dim=128)


def make(path, kv_cache_dtype: str = "int8", **kwargs) -> LLM:
    kwargs = {"max_model_len": 256, "kv_cache_memory": 8 << 20, "block_size": 16, **kwargs}
    return LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype=kv_cache_dtype, **kwargs)


def answer(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> tuple[list, list]:
    out = llm.generate(prompts, params, use_tqdm=False)[0]
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def assert_within_bound(alone: tuple, other: tuple, how: str) -> None:
    """Step by step up to the first token that differs: the shared logprobs within the bound, and a different
    token only where alone's own logprobs had it within the bound of its choice."""
    for step, (mine, theirs, lps, other_lps) in enumerate(zip(alone[0], other[0], alone[1], other[1],
                                                              strict=True)):
        worst = max(abs(lps[t] - other_lps[t]) for t in lps.keys() & other_lps.keys())
        assert worst <= LOGPROB_BOUND, (how, step, worst)
        if mine != theirs:
            assert theirs in lps and lps[mine] - lps[theirs] <= LOGPROB_BOUND, (how, step, lps, other_lps)
            return


def test_the_same_memory_holds_about_twice_the_tokens(path):
    blocks = {name: make(path, name).llm_engine.block_manager.num_blocks for name in ("auto", "int8", "fp8_e5m2")}
    per_token = {name: KVCache.bytes_per_token(2, 2, 128, torch.bfloat16, name) for name in blocks}
    assert per_token["int8"] == per_token["fp8_e5m2"] == 2 * 2 * 2 * (128 + 4)  # codes and a scale a head
    assert blocks["int8"] == blocks["fp8_e5m2"] == (8 << 20) // (per_token["int8"] * 16)
    assert blocks["int8"] >= 1.9 * blocks["auto"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_a_request_gets_its_answer_however_it_runs(path, kv_cache_dtype):
    """Alone; again from the prefix cache; beside other requests; in 16-token prompt chunks; preempted and
    recomputed (a pool of 12 blocks for four sequences of up to 76 tokens). ("auto": the same bound holds for
    the model's own cache type.)"""
    llm = make(path, kv_cache_dtype)
    alone = answer(llm, [PROMPT])
    assert (llm.llm_engine.runner.kv_cache.quantization is None) == (kv_cache_dtype == "auto")
    per_token = KVCache.bytes_per_token(2, 2, 128, torch.bfloat16, kv_cache_dtype)
    tight = make(path, kv_cache_dtype, enable_prefix_caching=False, kv_cache_memory=12 * 16 * per_token,
                 max_model_len=160)
    runs = {"prefix cached": answer(llm, [PROMPT]),
            "beside others": answer(make(path, kv_cache_dtype, enable_prefix_caching=False), [PROMPT, *NEIGHBOURS]),
            "chunked": answer(make(path, kv_cache_dtype, enable_prefix_caching=False, max_num_batched_tokens=16),
                              [PROMPT]),
            "preempted": answer(tight, [PROMPT, *NEIGHBOURS])}
    assert llm.llm_engine.kv_cache_stats["prefix_cache_hit_rate"] > 0
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for how, other in runs.items():
        assert_within_bound(alone, other, how)


def test_n_answers_fork_from_one_quantized_prompt(path):
    """n=3 greedy answers share the prompt's blocks (its partly filled last block is copied, with its scales, for
    each answer): each is the n=1 answer."""
    llm = make(path)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    answers = [c.token_ids for c in llm.generate([PROMPT[:37]], params, use_tqdm=False)[0].outputs]
    one = make(path).generate([PROMPT[:37]], GREEDY, use_tqdm=False)[0].token_ids
    assert answers == [one[:12]] * 3


def test_speculative_decoding_over_a_quantized_cache(path):
    """ngram speculation verifies drafts in multi-token steps that read the same quantized cache: the greedy
    answer stays the plain one (within the rounding bound: a verification step attends in other groups)."""
    prompt = PROMPT[:20] * 3  # repeats: the ngram proposer finds drafts
    plain = answer(make(path), [prompt])
    spec = make(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert_within_bound(plain, answer(spec, [prompt]), "speculative")
    assert spec.llm_engine.spec_stats["num_drafts"] > 0
