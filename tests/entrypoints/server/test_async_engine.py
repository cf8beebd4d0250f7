"""The serving engine: paged KV cache, prefix caching, preemption, chunked prefill, n > 1, stops,
logprobs.

Outputs must not depend on how requests were scheduled, and every block must come back.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import SYSTEM, make_llm, prompt_logits

from nanoqwen import LLM, ConfigError, InvalidRequestError, SamplingParams

PROMPTS = [
    SYSTEM + [9707, 11, 847, 829, 374],
    SYSTEM + [785, 6722, 315, 9625, 374, 264, 1293, 11652, 9934],
    [40, 1079],
    SYSTEM + [3838, 374, 279, 7290, 315, 2272, 30, 358, 1744, 432, 374, 220, 19, 17, 13],
    [3838, 374, 279, 7290, 315, 2272, 30],
    SYSTEM + [9707, 11, 847, 829, 374, 1207],
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("gqa2-untied", dtype="float32")


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert all(bm.blocks[i].hash == h for h, i in bm.cached_blocks.items())
    assert not llm.llm_engine.requests and not llm.llm_engine.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """Greedy answers, one request at a time, prefix caching off: the reference schedule."""
    llm = make_llm(model_dir, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


def test_all_at_once_equals_one_at_a_time(model_dir, expected):
    llm = make_llm(model_dir)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert len({tuple(t) for t in expected}) == len(PROMPTS)
    assert_all_blocks_free(llm)


def test_preemption_under_a_tiny_kv_budget_gives_the_same_tokens(model_dir, expected):
    # 4-token blocks of 256 bytes a token for this shape: room for 52 tokens, far less than the
    # batch needs
    per_token = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, float32
    llm = make_llm(model_dir, kv_cache_memory=52 * per_token, max_model_len=52)
    assert llm.llm_engine.block_manager.num_blocks == 13
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_tiny_prefill_chunks_give_the_same_tokens(model_dir, expected):
    llm = make_llm(model_dir, max_num_batched_tokens=3, max_num_seqs=3)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert_all_blocks_free(llm)


def test_prefix_caching_reuses_blocks_and_gives_the_same_tokens(model_dir, expected):
    llm = make_llm(model_dir)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens == 0
    # the shared 14-token system prefix is 3 full 4-token blocks
    assert outs[1].num_cached_tokens == 12 and outs[3].num_cached_tokens == 12
    # PROMPTS[5] extends PROMPTS[0]: its prompt and its first answer tokens were cached
    assert outs[5].num_cached_tokens == 16
    assert llm.llm_engine.kv_cache_stats["prefix_cache_hit_rate"] > 0
    off = make_llm(model_dir, enable_prefix_caching=False)
    assert all(off.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0 for p in PROMPTS)


def test_n_samples_share_the_prompt_blocks(model_dir):
    llm = make_llm(model_dir, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = PROMPTS[1]  # 23 tokens: 5 full blocks and a partial one
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()  # prefill the prompt once and fork
    seqs = engine.requests["r"].seqs
    tables = [s.block_table for s in seqs]
    assert tables[0][:5] == tables[1][:5] == tables[2][:5]  # full prompt blocks shared...
    assert len({t[5] for t in tables}) == 3  # ...the partly filled one copied
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in tables[0][:5])
    while engine.has_unfinished_requests():
        outs = engine.step()
    out = outs[-1]
    assert ([c.index for c in out.outputs] == [0, 1, 2]
            and all(len(c.token_ids) == 6 for c in out.outputs))
    # sample i is what a lone request seeded seed + i produces
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(temperature=1.0, max_tokens=6, seed=7 + i, ignore_eos=True)
        assert llm.generate([prompt], alone, use_tqdm=False)[0].token_ids == c.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_all_blocks_free(llm)


def test_no_block_leaks_over_hundreds_of_random_requests(model_dir):
    per_token = 2 * 2 * 2 * 16 * 4
    llm = make_llm(model_dir, kv_cache_memory=96 * per_token, max_model_len=64, max_num_seqs=6,
                   max_num_batched_tokens=24)
    engine = llm.llm_engine
    rng = random.Random(0)
    finished, aborted, next_id = 0, 0, 0
    live: list[str] = []
    for _ in range(800):
        if rng.random() < 0.6 and len(live) < 12:
            prefix = SYSTEM[: rng.randrange(0, 15)]
            prompt = prefix + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 20))]
            params = SamplingParams(temperature=rng.choice([0, 0.8]),
                                    max_tokens=rng.randrange(1, 24),
                                    n=rng.choice([1, 1, 2, 3]), stop=rng.choice([None, ["e"]]),
                                    seed=rng.randrange(99))
            engine.add_request(f"q{next_id}", prompt, params)
            live.append(f"q{next_id}")
            next_id += 1
        if live and rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
            aborted += 1
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
                finished += 1
    for _ in range(5000):  # bounded: a request stuck forever must fail the test, not hang it
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished += 1
    assert finished + aborted == next_id and next_id > 250
    assert engine.scheduler.num_preemptions > 0  # the budget really was tight
    assert_all_blocks_free(llm)


def test_budget_too_small_for_one_sequence_is_a_clear_error(model_dir):
    with pytest.raises(ConfigError, match=r"holds 16 tokens, fewer than max_model_len=128"):
        make_llm(model_dir, kv_cache_memory=16 * 2 * 2 * 2 * 16 * 4)
    # without an explicit max_model_len, it shrinks to what the cache holds
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=64 * 2 * 2 * 2 * 16 * 4, block_size=4)
    assert llm.llm_engine.max_model_len == 64


def greedy_text(llm, prompt, n=20) -> tuple[str, list[int]]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                skip_special_tokens=False), use_tqdm=False)[0]
    return out.text, out.token_ids


def test_stop_string_split_across_tokens_is_caught_and_never_streamed(model_dir):
    llm = make_llm(model_dir)
    tok = llm.get_tokenizer()
    text, ids = greedy_text(llm, PROMPTS[0])
    # a stop string made of the end of token 4's text and the start of token 5's
    before, piece4, piece5 = tok.decode(ids[:4]), tok.decode(ids[4:5]), tok.decode(ids[5:6])
    assert piece4 and piece5
    stop = piece4[-2:] + piece5[:2]
    cut = text.find(stop)
    assert 0 <= cut <= len(before) + len(piece4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                            skip_special_tokens=False)
    engine.add_request("s", PROMPTS[0], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.text for o in engine.step()]
    assert seen[-1] == text[:cut]
    assert all(stop not in t and seen[-1].startswith(t) for t in seen)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert (out.finish_reason, out.outputs[0].stop_reason, out.text) == ("stop", stop, text[:cut])
    assert len(out.token_ids) == 6  # generation stopped at the token that completed the stop string
    with_stop = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=True, skip_special_tokens=False)
    assert llm.generate([PROMPTS[0]], with_stop, use_tqdm=False)[0].text == text[: cut + len(stop)]


def test_logprobs_match_a_float64_recomputation(model_dir):
    llm = make_llm(model_dir)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    logits = prompt_logits(llm.llm_engine.model, prompt + out.token_ids).double()
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)
        assert [lp.rank for _, lp in top] == [1, 2, 3]
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert torch.tensor([lp.logprob for _, lp in top]).exp().sum() <= 1.0


def test_min_tokens_holds_off_eos(model_dir):
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    _, ids = greedy_text(llm, PROMPTS[0])
    engine.eos_token_ids = frozenset({ids[2]})  # pretend the greedy path's 3rd token is EOS
    try:
        early = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20),
                             use_tqdm=False)[0]
        late = llm.generate([PROMPTS[0]],
                            SamplingParams(temperature=0, max_tokens=20, min_tokens=8),
                            use_tqdm=False)[0]
    finally:
        engine.eos_token_ids = frozenset({151645, 151643})
    assert early.finish_reason == "stop" and len(early.token_ids) == 3
    assert len(late.token_ids) >= 8 and ids[2] not in late.token_ids[:8]


def test_repetition_penalty_reaches_the_sampler(model_dir):
    llm = make_llm(model_dir)
    plain = llm.generate([PROMPTS[2]],
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert len(set(plain)) < len(plain)  # a random model repeats itself
    penalty = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             repetition_penalty=100.0)
    penalised = llm.generate([PROMPTS[2]], penalty, use_tqdm=False)[0].token_ids
    assert len(set(penalised)) > len(set(plain))


def test_request_metrics(model_dir):
    llm = make_llm(model_dir)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    assert m.time_to_first_token > 0 and m.time_per_output_token > 0 and m.num_output_tokens == 6
    assert m.finished_time >= m.last_token_time >= m.first_token_time >= m.arrival_time


def test_bad_requests_leave_the_engine_serving(model_dir):
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_model_len is 128"):
        engine.add_request("long", [5] * 200, GREEDY)
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request("good", PROMPTS[1], GREEDY)
    for field, value in (("n", 0), ("max_tokens", 0), ("temperature", -1.0), ("top_p", 2.0)):
        with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
            SamplingParams(**{field: value})
    done = None
    while engine.has_unfinished_requests():
        done = engine.step() or done
    assert done[-1].request_id == "good" and len(done[-1].token_ids) == 20
    assert_all_blocks_free(llm)
