"""Prompt logprobs under tensor parallelism (CPU, gloo, a real worker process): every rank runs the prompt positions
through its slice of the LM head and rank 0 gathers them, so TP=2 gives TP=1's entries, chunked or not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm

from nanoqwen import SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(23)]
OTHER = [9707, 11, 847, 829, 374]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
PLAIN = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def entries(llm) -> list:
    """PROMPT's prompt logprobs beside a request without them, and that request's tokens."""
    out = llm.generate([PROMPT, OTHER], [PARAMS, PLAIN], use_tqdm=False)
    assert out[1].prompt_logprobs is None
    return [None] + [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out[0].prompt_logprobs[1:]], \
        out[1].token_ids


def test_tp2_gives_the_prompt_logprobs_of_tp1(checkpoint):
    path = checkpoint("gqa2-untied", dtype="float32")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        expected, tokens = entries(make_llm(path, enforce_eager=True))
        llm = make_llm(path, tensor_parallel_size=2, enforce_eager=True, max_num_batched_tokens=7)
        try:
            got, got_tokens = entries(llm)
        finally:
            llm.llm_engine.shutdown()
    finally:
        torch.set_num_threads(before)
    assert got_tokens == tokens and len(got) == len(expected) == len(PROMPT) and got[0] is None
    for mine, theirs in zip(got[1:], expected[1:], strict=True):
        assert mine.keys() == theirs.keys()
        for token, (logprob, rank) in mine.items():
            assert rank == theirs[token][1] and logprob == pytest.approx(theirs[token][0], abs=1e-4)
