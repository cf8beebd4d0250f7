"""SamplingParams.prompt_logprobs: every prompt token's log-probability (its rank, the top k) from the prompt's own
prefill, equal to transformers' log_softmax of the same weights, however the prompt is chunked, cached, batched,
preempted or forked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import hf_model, make_llm

from nanoqwen import SamplingParams
from nanoqwen.errors import InvalidRequestError
from nanoqwen.outputs import Logprob
from nanoqwen.sampling_params import MAX_LOGPROBS

# 23 tokens: with 7-token chunks, 4 chunks (the last holds the prompt's last position, which samples)
PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(23)]
OTHERS = [[(11 * i + 5) % 5000 + 100 for i in range(n)] for n in (9, 17)]
K = 3
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
TOL = 1e-4  # float32: nanoqwen's and transformers' sums add in other orders


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("gqa2-untied", dtype="float32")


@pytest.fixture(scope="module")
def alone(path) -> list[dict[int, Logprob] | None]:
    """PROMPT's prompt logprobs in one prefill, no prefix cache."""
    llm = make_llm(path, enable_prefix_caching=False)
    return llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].prompt_logprobs


@pytest.fixture(scope="module")
def reference(path) -> torch.Tensor:
    """transformers' log_softmax over PROMPT's logits in float32, [len(PROMPT), vocab]: row p - 1 is position p's."""
    with torch.inference_mode():
        return hf_model(path, torch.float32)(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def ranks_within(row: torch.Tensor, token: int, tol: float = TOL) -> range:
    """The ranks token may take in row: a token whose logprob lies within tol of its own may count either way."""
    return range((row > row[token] + tol).sum().item() + 1, (row > row[token] - tol).sum().item() + 2)


def assert_same(got: list, expected: list, reference: torch.Tensor, tol: float = TOL) -> None:
    """The same entries (token ids, ranks) with logprobs within tol. A rank may differ only where the reference row
    has a tie within tol around the token (float32 sums added in another order, as another chunking adds them, may
    order near-equal tokens either way: the tail of 151,936 random logits holds many)."""
    assert len(got) == len(expected) == len(PROMPT) and got[0] is None and expected[0] is None
    for position, (mine, theirs) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
        assert mine.keys() == theirs.keys(), position
        for token, lp in mine.items():
            assert lp.decoded_token == theirs[token].decoded_token, (position, token)
            if lp.rank != theirs[token].rank:
                allowed = ranks_within(reference[position - 1], token, tol)
                assert lp.rank in allowed and theirs[token].rank in allowed, (position, token, allowed)
            assert lp.logprob == pytest.approx(theirs[token].logprob, abs=tol), (position, token)


def test_prompt_logprobs_equal_transformers_log_softmax(path, alone, reference):
    assert len(alone) == len(PROMPT) and alone[0] is None
    for position in range(1, len(PROMPT)):
        entry, row, token = alone[position], reference[position - 1], PROMPT[position]
        # the prompt token's own logprob, and its rank among all tokens (a tie within TOL may count either way)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL)
        assert entry[token].rank in ranks_within(row, token)
        # the top K, best first, with ranks 1..K
        top = sorted((lp for t, lp in entry.items() if lp.rank <= K), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, K + 1))
        assert [lp.logprob for lp in top] == pytest.approx(row.topk(K).values.tolist(), abs=TOL)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=TOL)
        # the prompt token and the top K, nothing else
        assert len(entry) == K + (entry[token].rank > K)


def test_zero_gives_only_the_prompt_token(path, alone):
    out = make_llm(path).generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                                  use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        token = PROMPT[position]
        assert list(out.prompt_logprobs[position]) == [token]
        assert out.prompt_logprobs[position][token].rank == alone[position][token].rank


def test_off_by_default_and_a_one_token_prompt_gets_one_none(path):
    llm = make_llm(path)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None
    assert llm.generate([[40]], PARAMS, use_tqdm=False)[0].prompt_logprobs == [None]


def test_chunked_prefill_gives_the_same_entries(path, alone, reference):
    """7-token chunks: each chunk's positions give their entries, a chunk's last position the next chunk's
    first token's."""
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=7)
    assert_same(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].prompt_logprobs, alone, reference)


def test_a_prefix_cache_hit_still_gives_every_entry(path, alone, reference):
    """A request with prompt_logprobs skips the prefix-cache lookup (as vLLM): the same prompt a second time, or
    after a request that cached it, still gets every entry; a request without them does hit the cache."""
    llm = make_llm(path, max_num_batched_tokens=7)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([PROMPT], plain, use_tqdm=False)[0].num_cached_tokens == 0
    for _ in range(2):
        out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert_same(out.prompt_logprobs, alone, reference)
    assert llm.generate([PROMPT], plain, use_tqdm=False)[0].num_cached_tokens == 20  # its blocks were cached


def test_other_requests_of_the_batch_are_unchanged(path, alone, reference):
    """The same batch with and without PROMPT's prompt_logprobs: the others' answers and logprobs bit for bit."""
    llm = make_llm(path, enable_prefix_caching=False)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    asking = dataclasses.replace(plain, prompt_logprobs=K)
    prompts = [OTHERS[0], PROMPT, OTHERS[1]]
    without = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts, [plain, asking, plain], use_tqdm=False)
    assert_same(mixed[1].prompt_logprobs, alone, reference)
    for before, after in zip(without, mixed, strict=True):
        assert after.token_ids == before.token_ids
        assert after.logprobs == before.logprobs
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None


def test_n_answers_share_one_list(path, alone, reference):
    llm = make_llm(path, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, prompt_logprobs=K)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_same(out.prompt_logprobs, alone, reference)


def test_preemption_neither_duplicates_nor_loses_entries(path, alone, reference):
    """Preempted after its first chunk (then recomputed from the start), and again after its prompt (while
    decoding): every entry once, the same values."""
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=7)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    engine.add_request("r", PROMPT, params)
    seq = engine.requests["r"].seqs[0]
    engine.step()
    assert len(seq.prompt_logprobs) == 8  # None, then the first chunk's 7 positions
    engine.scheduler.preempt(seq)
    outputs = []
    while not outputs:
        outputs = engine.step()
    assert seq.num_preemptions == 1 and len(seq.output_token_ids) == 1
    engine.scheduler.preempt(seq)
    while engine.has_unfinished_requests():
        outputs = engine.step() or outputs
    assert seq.num_preemptions == 2 and outputs[0].finished
    assert_same(outputs[0].prompt_logprobs, alone, reference)


def test_a_step_run_again_request_by_request_adds_each_entry_once(path, alone, reference):
    """A step that raises runs again one request at a time (LLMEngine._execute_each): its chunks' prompt
    logprobs, computed by the failed run too, are added once."""
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=64)
    runner = llm.llm_engine.runner
    execute, failed = runner.execute, []

    def fail_once_after_running(batch):
        out = execute(batch)
        if not failed:
            failed.append(len(batch.prefill))
            raise RuntimeError("a step that fails after its forward")
        return out

    runner.execute = fail_once_after_running
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([PROMPT, OTHERS[0]], [PARAMS, plain], use_tqdm=False)
    assert failed == [2] and all(o.error is None for o in out)
    assert_same(out[0].prompt_logprobs, alone, reference)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "2"])
def test_a_bad_value_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"


def test_llm_generate_with_text_prompt(path):
    out = make_llm(path).generate("Hello world, how are you", PARAMS, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) > 1
    assert all(out.prompt_token_ids[i] in out.prompt_logprobs[i] for i in range(1, len(out.prompt_token_ids)))
