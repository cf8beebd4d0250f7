"""The same request, the same tokens: a request's greedy answer does not depend on what else shares its steps,
how its prompt was chunked or whether its prefix came from the cache.

int4 with enforce_eager promises it bit for bit: every row goes through nanoqwen's integer kernel, whose sums
do not depend on how many rows a call has, and the elementwise math runs the same ops for any row count.
Otherwise it cannot: a product over a few rows and one over many add in other orders, as do the compiled
elementwise kernels that take calls of many rows (and int8 prompts on CPUs with fast bf16 matmuls multiply by
the weights rounded to bf16), so a logit may move by a rounding step or two. Logits are bf16 values, a few
hundredths apart, so two tokens often tie exactly: there a rounding step picks the other one. The bound: every
logprob within LOGPROB_BOUND of the request's own when alone, and a token different only where the two were
within LOGPROB_BOUND of each other."""

from __future__ import annotations

import pytest

from nanoqwen import LLM, SamplingParams

# 100 tokens: a prompt chunk of many rows (the many-row kernels), whose prefix-cache hit leaves 4
PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(100)]
NEIGHBOURS = [[(11 * i + 5) % 5000 + 100 for i in range(n)] for n in (30, 7, 60)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
LOGPROB_BOUND = 0.1  # a few rounding steps of a bf16 logit (one is 2**-6 near 4, 2**-5 near 8)


def answer(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], list[dict[int, float]]]:
    """The first prompt's greedy tokens and, at each step, its top logprobs (and the chosen token's)."""
    out = llm.generate(prompts, PARAMS, use_tqdm=False)[0]
    return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def assert_within_bound(alone: tuple, other: tuple, how: str) -> None:
    """Step by step up to the first token that differs: the shared logprobs within the bound, and a different
    token only where alone's own logprobs had it within the bound of its choice."""
    for step, (mine, theirs, lps, other_lps) in enumerate(zip(alone[0], other[0], alone[1], other[1], strict=True)):
        worst = max(abs(lps[t] - other_lps[t]) for t in lps.keys() & other_lps.keys())
        assert worst <= LOGPROB_BOUND, (how, step, worst)
        if mine != theirs:
            assert theirs in lps and lps[mine] - lps[theirs] <= LOGPROB_BOUND, (how, step, lps, other_lps)
            return


@pytest.mark.parametrize("quantization, enforce_eager", [(None, False), ("int8", False), ("int4", False),
                                                        ("int4", True)])
def test_a_request_gets_the_same_tokens_however_it_runs(checkpoint, quantization, enforce_eager):
    path = checkpoint("tiny", dtype="bfloat16")
    options = dict(dtype="bfloat16", device="cpu", max_model_len=512, quantization=quantization,
                   enforce_eager=enforce_eager)
    llm = LLM(path, **options)
    alone = answer(llm, [PROMPT])
    runs = {"prefix cached": answer(llm, [PROMPT]),
            "beside others": answer(LLM(path, enable_prefix_caching=False, **options), [PROMPT, *NEIGHBOURS]),
            "chunked": answer(LLM(path, enable_prefix_caching=False, max_num_batched_tokens=32, **options),
                              [PROMPT])}
    assert llm.llm_engine.kv_cache_stats["prefix_cache_hit_rate"] > 0  # (the second run did hit the cache)
    for how, other in runs.items():
        if quantization == "int4" and enforce_eager:
            assert other == alone, how  # bit for bit
        else:
            assert_within_bound(alone, other, how)
