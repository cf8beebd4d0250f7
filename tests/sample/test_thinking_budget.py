"""SamplingParams.thinking_token_budget on a random-weight checkpoint: its reasoning never writes </think> by
itself within these few tokens (checked), so a </think> at position B is the budget's doing."""

from __future__ import annotations

import pytest
import torch
from conftest import make_llm

from nanoqwen import SamplingParams
from nanoqwen.errors import InvalidRequestError
from nanoqwen.sample.structured_outputs import apply_bitmasks
from nanoqwen.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "Think about a number."}]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint("tiny", std=0.08), max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def prompts(llm):
    """(thinking on, thinking off): the chat template's prompt with its generation prompt."""
    tokenizer = llm.get_tokenizer()
    return tuple(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                               enable_thinking=on) for on in (True, False))


@pytest.fixture(scope="module")
def think_end(llm) -> int:
    return llm.get_tokenizer().token_to_id("</think>")


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_the_model_does_not_close_its_reasoning_by_itself(llm, prompts, think_end):
    """The premise of the tests below."""
    out = llm.generate([prompts[0]], greedy(24), use_tqdm=False)[0]
    assert think_end not in out.token_ids


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_think_end_is_forced_after_the_budget(llm, prompts, think_end, budget):
    free = llm.generate([prompts[0]], greedy(budget + 4), use_tqdm=False)[0].token_ids
    out = llm.generate([prompts[0]], greedy(budget + 4, thinking_token_budget=budget), use_tqdm=False)[0]
    assert out.token_ids[budget] == think_end
    assert out.token_ids[:budget] == free[:budget]  # the reasoning itself is untouched
    assert out.token_ids.count(think_end) == 1  # once closed, the answer is free again
    assert "</think>" in out.text


def test_other_sequences_in_the_batch_are_unaffected(llm, prompts, think_end):
    alone = llm.generate([prompts[0]], greedy(10), use_tqdm=False)[0].token_ids
    both = llm.generate([prompts[0], prompts[0]], [greedy(10, thinking_token_budget=3), greedy(10)],
                        use_tqdm=False)
    assert both[0].token_ids[3] == think_end
    assert both[1].token_ids == alone


def test_every_answer_of_n_gets_the_budget(llm, prompts, think_end):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True, thinking_token_budget=2)
    outs = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    assert len({tuple(o.token_ids[:2]) for o in outs}) > 1  # sampled: the answers differ
    assert all(o.token_ids[2] == think_end for o in outs)


def test_budget_with_thinking_off_does_nothing(llm, prompts, think_end):
    plain = llm.generate([prompts[1]], greedy(8), use_tqdm=False)[0]
    budgeted = llm.generate([prompts[1]], greedy(8, thinking_token_budget=2), use_tqdm=False)[0]
    assert budgeted.token_ids == plain.token_ids
    assert llm.llm_engine.grammar_compiler.new_state(None, prompts[1], 2) is None


def test_structured_outputs_apply_after_the_forced_think_end(llm, prompts, think_end):
    params = greedy(12, thinking_token_budget=3, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    params.ignore_eos = False
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.token_ids[3] == think_end
    assert out.text.split("</think>", 1)[1] in ("yes", "no")


def test_the_forced_bitmask_allows_think_end_alone(llm, prompts, think_end):
    engine = llm.llm_engine
    state = engine.grammar_compiler.new_state(None, prompts[0], 1)
    assert state.bitmask() is None
    state.accept(100)
    allowed = apply_bitmasks(torch.zeros(1, engine.config.vocab_size), [state.bitmask()])
    assert torch.isfinite(allowed[0]).nonzero().flatten().tolist() == [think_end]
    state.accept(think_end)
    assert not state.reasoning and state.bitmask() is None and not state.is_finished


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_bad_budget_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=value)
