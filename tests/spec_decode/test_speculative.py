"""Speculative decoding: n-gram lookup, a draft model and the model's own quantised copy propose,
the target verifies (nanoqwen/sample/rejection_sampler.py). Greedy output must be token for token what it
is without speculation, and sampled output must follow the same distribution."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import PROMPTS, make_llm
from scipy.stats import chi2_contingency, chisquare

from nanoqwen import LLM, SamplingParams
from nanoqwen.config.engine import EngineConfig
from nanoqwen.config.speculative import SpeculativeConfig
from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.scheduler import ScheduledBatch, ScheduledPrefill, ScheduledSpecDecode, Scheduler
from nanoqwen.core.sequence import Sequence
from nanoqwen.errors import ConfigError
from nanoqwen.model_loader.init_random import write_random_model
from nanoqwen.sample.rejection_sampler import rejection_sample
from nanoqwen.spec_decode.proposer import NgramProposer
from nanoqwen.spec_decode.spec_switch import SpecDecodeSwitch

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# disable_by_batch_size 8: batches of the 4 PROMPTS (and the 6 of the prefix test) are speculated;
# disable_by_acceptance off: every step speculates, whatever its drafts' cost (on a tiny model a
# draft costs as much as the target: the switch would pause them; it is tested on its own below)
ALWAYS = {"disable_by_batch_size": 8, "disable_by_acceptance": False}
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1, **ALWAYS},
    "self-int8": {"method": "self_quantized", "quantization": "int8",
                  "num_speculative_tokens": 4, **ALWAYS},
    "self-int4": {"method": "self_quantized", "quantization": "int4",
                  "num_speculative_tokens": 3, **ALWAYS},
    # model: below
    "draft-other-size": {"method": "draft_model", "num_speculative_tokens": 2, **ALWAYS},
}


@pytest.fixture(scope="module")
def draft_dir(checkpoint):
    """A draft model of another size (2 layers, narrower), with the same tokenizer."""
    return checkpoint("gqa2-untied", num_hidden_layers=2)


def spec_config(name: str, draft_dir) -> dict:
    config = dict(METHODS[name])
    if config["method"] == "draft_model":
        config["model"] = str(draft_dir)
    return config


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Greedy answers without speculation, batched."""
    return token_ids(make_llm(tiny_dir).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_output_unchanged(tiny_dir, draft_dir, reference, name):
    llm = make_llm(tiny_dir, speculative_config=spec_config(name, draft_dir))
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference  # batched
    assert llm.llm_engine.spec_stats["num_drafts"] > 0  # (speculated in the batch too)
    for prompt, expected in zip(PROMPTS, reference, strict=True):  # alone
        assert token_ids(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expected]
    stats = llm.llm_engine.spec_stats
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    if name == "self-int8":  # the int8 copy of a float32 model agrees nearly always
        assert stats["num_accepted_tokens"] >= 0.8 * stats["num_draft_tokens"]


@pytest.mark.parametrize("name", ["self-int4", "draft-other-size", "ngram"])
def test_greedy_unchanged_under_preemption_and_prefix_hits(tiny_dir, draft_dir, reference, name):
    """A KV budget of 12 blocks of 4 tokens for 4 answers of up to 44 tokens: sequences are
    preempted (their draft cache with them) and recomputed; the same prompts twice hit the prefix
    cache, whose blocks the draft model recomputes; 6-token steps chunk the prompts (and the
    draft's catching up on them)."""
    # K and V bytes per token: the target's 2 layers x 2 heads x 32 floats, plus the draft's
    per_token = 2 * 2 * 2 * 32 * 4 + {"self-int4": 2 * 2 * 2 * 32 * 4,
                                      "draft-other-size": 2 * 2 * 2 * 16 * 4, "ngram": 0}[name]
    llm = make_llm(tiny_dir, speculative_config=spec_config(name, draft_dir),
                   kv_cache_memory=12 * 4 * per_token, max_model_len=48,
                   max_num_batched_tokens=6)  # prompts in chunks beside verification rows
    assert llm.llm_engine.block_manager.num_blocks == 12  # the draft's cache counted
    outputs = llm.generate(PROMPTS + PROMPTS[:2], GREEDY, use_tqdm=False)
    assert token_ids(outputs) == reference + reference[:2]
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.block_manager.prefix_hits > 0


def test_greedy_unchanged_in_bfloat16(checkpoint):
    """bf16 weights and activations. Weights of std 0.5: at this tiny width smaller ones give
    nearly flat logits over 151936 tokens, with exact bf16 ties whose argmax any change in the
    order of float32 additions may flip (a verification step attends in other groups than a plain
    decode step)."""
    path = checkpoint("tiny", dtype="bfloat16", std=0.5)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kwargs = dict(max_model_len=128, kv_cache_memory=8 << 20, block_size=4, device="cpu")
    plain = LLM(path, dtype="bfloat16", **kwargs).generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(path, dtype="bfloat16", speculative_config=METHODS["self-int4"], **kwargs)
    assert token_ids(spec.generate(PROMPTS, params, use_tqdm=False)) == token_ids(plain)
    assert spec.llm_engine.spec_stats["num_accepted_tokens"] > 0


def test_stops_logprobs_and_n_match_plain_decoding(tiny_dir, draft_dir):
    """Stop strings, stop tokens, min_tokens, max_tokens, penalties, logprobs and n > 1 act on the
    accepted tokens as they would one at a time."""
    plain = make_llm(tiny_dir)
    spec = make_llm(tiny_dir, speculative_config=METHODS["self-int8"])
    ref = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    stop_text = ref[0].outputs[0].text[10:14]
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=30,
                       stop_token_ids=[ref[1].outputs[0].token_ids[7]]),
        SamplingParams(temperature=0, max_tokens=13, logprobs=3, repetition_penalty=1.3,
                       frequency_penalty=0.5, n=2),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=15,
                       stop_token_ids=[ref[3].outputs[0].token_ids[2]]),
    ]
    a = plain.generate(PROMPTS, params, use_tqdm=False)
    b = spec.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert (cy.token_ids, cy.text, cy.finish_reason, cy.stop_reason) == \
                (cx.token_ids, cx.text, cx.finish_reason, cx.stop_reason)
            for lx, ly in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
                assert lx.keys() == ly.keys()
                for t in lx:
                    assert ly[t].rank == lx[t].rank
                    assert ly[t].logprob == pytest.approx(lx[t].logprob, abs=1e-4)
    assert a[0].outputs[0].finish_reason == "stop" and a[2].outputs[0].logprobs
    assert spec.llm_engine.spec_stats["num_accepted_tokens"] > 0


def test_metrics_and_blocks_given_back(tiny_dir):
    llm = make_llm(tiny_dir, speculative_config=METHODS["self-int4"])
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[1], GREEDY)
    bs = engine.block_manager.block_size
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for seq in engine.scheduler.running:  # no block past the answer's tokens stays held
            assert len(seq.block_table) == -(-seq.num_tokens // bs)
    m = outputs[0].metrics
    assert m.spec_num_drafts > 0 and m.spec_num_draft_tokens <= 3 * m.spec_num_drafts
    assert m.spec_mean_acceptance_length == 1 + m.spec_num_accepted_tokens / m.spec_num_drafts
    # fewer verification steps than tokens: several tokens per step
    assert m.spec_num_drafts + 1 < len(outputs[0].outputs[0].token_ids)
    stats = engine.kv_cache_stats
    assert stats["spec_decode_num_drafts"] == m.spec_num_drafts
    assert stats["used_blocks"] == 0


def test_abort_leaves_the_others_alone(tiny_dir, reference):
    """Aborting a speculating request between steps frees its blocks; the other answers are
    unchanged."""
    llm = make_llm(tiny_dir, speculative_config=METHODS["self-int4"])
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    finished = {}
    for step in range(100):
        if step == 3:
            engine.abort_request("1")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert finished == {str(i): reference[i] for i in (0, 2, 3)}
    assert engine.kv_cache_stats["used_blocks"] == 0
    assert engine.spec_stats["num_accepted_tokens"] > 0


def test_off_in_large_batches(tiny_dir):
    """disable_by_batch_size=2: four running answers are never speculated; one alone is."""
    config = {**METHODS["self-int8"], "disable_by_batch_size": 2}
    llm = make_llm(tiny_dir, speculative_config=config)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # same length: all four run to the end
    assert llm.llm_engine.spec_stats["num_drafts"] == 0
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert llm.llm_engine.spec_stats["num_drafts"] > 0


# ---- the switch that pauses drafts that do not pay (spec_decode/spec_switch.py)


def test_switch_weighs_tokens_per_step_against_a_steps_cost():
    """Synthetic step times: a speculative step costs 3 plain steps (the fastest of each; a
    compiling step and a step with a prompt chunk do not count); a sequence giving 3 tokens per
    verification keeps its drafts, one falling below is paused for 32 tokens, then 64 after a failed
    retry (128 after 3 verifications without one accepted draft), and a retry that pays makes the
    next pause short again."""
    switch = SpecDecodeSwitch()
    seq = Sequence("a", 0, [1, 2, 3], SamplingParams(max_tokens=100))
    seq.spec_token_ids = [5, 6]
    other = Sequence("b", 0, [1], SamplingParams())
    spec_step = ScheduledBatch(spec_decode=[ScheduledSpecDecode(seq, 2)])
    plain_step = ScheduledBatch(decode=[other])
    assert switch.step_cost(1) is None
    # no plain step measured yet: the next step is plain, to measure one
    assert not switch.judge(seq, 3, batch_size=1) and seq.spec_resume_at == 4
    for _ in range(3):
        switch.record_step(spec_step, 0.020, 0.010)
        switch.record_step(plain_step, 0.0, 0.010)
    switch.record_step(spec_step, 4.0, 1.0)  # compiled a new shape
    switch.record_step(plain_step, 0.0, 0.002)  # counts: plain steps are this fast
    switch.record_step(ScheduledBatch(decode=[other], prefill=[ScheduledPrefill(seq, 2)]), 0, 1e-4)
    assert switch.step_cost(1) == pytest.approx(15.0)
    switch.record_step(plain_step, 0.0, 0.010)
    switch.plain_seconds[1].remove(0.002)
    assert switch.step_cost(1) == pytest.approx(3.0)
    assert switch.step_cost(2) is None
    seq.spec_recent_lengths.clear()
    seq.output_token_ids = [7] * 10
    for _ in range(6):
        assert not switch.judge(seq, 3, batch_size=1)  # exactly pays
    assert seq.spec_resume_at == 4
    assert switch.judge(seq, 1, batch_size=1)  # the mean of [3]*6 + [1] falls below 3
    assert seq.spec_resume_at == 10 + 1 + 32 and not seq.spec_recent_lengths
    assert [switch.judge(seq, 2, 1) for _ in range(4)] == [False] * 3 + [True]  # a failed retry
    assert seq.spec_resume_at == 10 + 2 + 64 and seq.spec_pause == 128
    assert [switch.judge(seq, 1, 1) for _ in range(3)] == [False] * 2 + [True]  # none accepted
    assert seq.spec_resume_at == 10 + 1 + 128 and seq.spec_pause == 256
    assert not any(switch.judge(seq, 3, 1) for _ in range(4)) and seq.spec_pause == 0
    assert switch.num_pauses == 3
    # a measured plain step is due again after 64 speculative steps
    for _ in range(64):
        switch.record_step(spec_step, 0.020, 0.010)
    assert not switch.judge(seq, 3, 1) and seq.spec_resume_at == 10 + 3 + 1
    scheduler = Scheduler(BlockManager(8, 4, False), 4, 64, num_speculative_tokens=2)
    assert scheduler.spec_tokens_allowed(seq, 2) == 0  # paused until 14 tokens
    seq.output_token_ids.extend([7] * 4)
    assert scheduler.spec_tokens_allowed(seq, 2) == 2


def test_drafts_that_do_not_pay_are_paused(tiny_dir, monkeypatch):
    """The model's int8 copy made to propose a token after the one it chose: every draft is
    rejected, so with the switch on the answer (unchanged) is mostly decoded without drafts."""
    from nanoqwen.spec_decode.proposer import DraftModelProposer

    monkeypatch.setattr(DraftModelProposer, "_draw",
                        staticmethod(lambda seq, logits: (int(logits.argmax()) + 1, None)))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = make_llm(tiny_dir).generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    config = {"method": "self_quantized", "quantization": "int8", "num_speculative_tokens": 3}
    for switch in (False, True):
        llm = make_llm(tiny_dir, speculative_config={**config, "disable_by_acceptance": switch})
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == plain.token_ids
        m = out.metrics
        assert m.spec_num_accepted_tokens <= 2  # (the copy's choice + 1 may be the model's)
        if not switch:
            # every step but the first (the prompt's) and the last (no room for drafts)
            assert m.spec_num_drafts == 62 - m.spec_num_accepted_tokens and not m.spec_num_pauses
    # 1 verification, a plain step measured, 2 more (none accepted): 32 tokens paused, 3, 64 ...
    assert 2 <= m.spec_num_pauses <= 3 and m.spec_num_drafts <= 10
    assert llm.llm_engine.kv_cache_stats["spec_decode_num_pauses"] == m.spec_num_pauses


def test_drafts_that_pay_keep_speculating(tiny_dir, monkeypatch):
    """A proposer that knows the answer (the n-gram method's lookup replaced by the plain answer):
    7 tokens per step for a step that costs fewer plain ones; the switch leaves it on."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = PROMPTS[0]
    answer = make_llm(tiny_dir).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(NgramProposer, "lookup", lambda self, token_ids, k: list(
        answer[len(token_ids) - len(prompt): len(token_ids) - len(prompt) + k]))
    config = {**METHODS["ngram"], "num_speculative_tokens": 6, "disable_by_acceptance": True}
    llm = make_llm(tiny_dir, speculative_config=config)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == answer
    m = out.metrics
    assert m.spec_num_pauses == 0 and m.spec_mean_acceptance_length > 6
    switch = llm.llm_engine.spec_switch
    assert switch.plain_seconds[1] and switch.spec_seconds[1]  # both kinds of step were timed
    # no bound below: on the tiny model a 7-row step can time as fast as a 1-row one
    assert 0 < switch.step_cost(1) < 7


def test_structured_outputs_are_not_speculated(tiny_dir):
    from nanoqwen.sampling_params import StructuredOutputsParams

    llm = make_llm(tiny_dir, speculative_config=METHODS["ngram"])
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    assert llm.llm_engine.spec_stats["num_drafts"] == 0


def test_seeded_sampling_reproducible(tiny_dir):
    llm = make_llm(tiny_dir, speculative_config=METHODS["self-int4"])
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7, ignore_eos=True)
    first = token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == first


# ---- the rejection sampler's distribution


def test_rejection_sampler_emits_the_target_distribution():
    """p and a q that disagrees with it, over 6 tokens: the first emitted token must follow p
    (chi-square goodness of fit, p-value > 1e-3 over 4000 draws), whatever the draft proposed;
    accepting every draft would give q instead, which the same test rejects."""
    vocab = 6
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 2)  # [rows, V]: 1 draft + bonus
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    params = SamplingParams(temperature=1.0)
    p = p_logits[0].softmax(-1)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab)
    drafts_seen = torch.zeros(vocab)
    n = 4000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        out = rejection_sample(p_logits, [[d]], [q[None]], [params], [g], [[0]], [[]], [set()])
        counts[out[0].token_ids[0]] += 1
        drafts_seen[d] += 1
    assert chisquare(counts, p * n).pvalue > 1e-3
    assert chisquare(drafts_seen, p * n).pvalue < 1e-6  # the test tells q from p


def test_rejection_sampler_deterministic_draft():
    """A certain draft (n-gram: q one-hot) is accepted with probability p(draft)."""
    p_logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]] * 2)
    p = p_logits[0].softmax(-1)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    n = 3000
    counts = torch.zeros(4)
    for _ in range(n):
        out = rejection_sample(p_logits, [[2]], [None], [params], [g], [[0]], [[]], [set()])
        counts[out[0].token_ids[0]] += 1
    assert chisquare(counts, p * n).pvalue > 1e-3


def test_rejection_sampler_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    params = SamplingParams(temperature=0)
    out = rejection_sample(logits, [[1, 0]], [None], [params], [None], [[0]], [[]], [set()])
    assert out[0].token_ids == [1, 0, 2]  # both accepted, then the last row's argmax
    out = rejection_sample(logits, [[1, 2]], [None], [params], [None], [[0]], [[]], [set()])
    assert out[0].token_ids == [1, 0]  # the second rejected: the target's token instead


def test_sampled_distribution_matches_plain_decoding(checkpoint, monkeypatch):
    """The answers' first three tokens over 1500 seeded samples (temperature 1, top_k 3: at most 27
    answers), with speculation and without: a chi-square test of homogeneity must not reject at
    1e-3. The draft is the model itself sampling at temperature 0.3, so its q overlaps p but often
    disagrees with it (about a third of the drafts are rejected): a verifier that drew rejected
    positions from p instead of max(0, p - q) fails this test."""
    from nanoqwen.sample.sampler import dense_probs
    from nanoqwen.spec_decode.proposer import DraftModelProposer

    def sharper_draw(seq, logits):
        q = dense_probs(logits[None], [replace(seq.sampling_params, temperature=0.3)])[0]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q

    monkeypatch.setattr(DraftModelProposer, "_draw", staticmethod(sharper_draw))
    path = checkpoint("tiny", dtype="float32", std=0.5)  # peaked: top-3 candidates that matter
    n = 1500
    kwargs = dict(max_num_seqs=256, max_model_len=32, kv_cache_memory=32 << 20)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(n)]
    config = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2,
              "disable_by_batch_size": 1024, "disable_by_acceptance": False}
    counts = []
    for options in ({}, {"speculative_config": config}):
        llm = make_llm(path, **kwargs, **options)
        outputs = llm.generate([PROMPTS[0]] * n, params, use_tqdm=False)
        counts.append(Counter(tuple(o.outputs[0].token_ids) for o in outputs))
    stats = llm.llm_engine.spec_stats
    assert stats["num_drafts"] >= n  # every answer was speculated
    rejected = stats["num_draft_tokens"] - stats["num_accepted_tokens"]
    assert 0.2 * stats["num_draft_tokens"] < rejected < 0.8 * stats["num_draft_tokens"]
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(k, 0) for k in keys] for c in counts]
    assert chi2_contingency(table).pvalue > 1e-3


# ---- configuration and proposers


def test_ngram_lookup():
    proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # "5 6 7" occurred before, followed by 8 9 1: the longest match wins
    assert proposer.lookup([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 2) == [8, 9]
    # only the last token matches, latest occurrence first
    assert proposer.lookup([4, 1, 4, 2, 3, 4], 3) == [2, 3, 4]
    # in a loop the latest occurrence has 1 token after it: an earlier one gives all k
    assert proposer.lookup([7] * 6, 3) == [7, 7, 7]
    assert proposer.lookup([1, 2] * 4, 4) == [1, 2, 1, 2]
    assert proposer.lookup([1, 2, 3], 4) == []
    assert NgramProposer(2, 3).lookup([4, 1, 4, 2, 3, 4], 3) == []  # needs 2 matching tokens


def test_config_parsing_and_errors(tiny_dir):
    c = EngineConfig(tiny_dir, speculative_config='{"method": "ngram", '
                                                  '"num_speculative_tokens": 4}')
    assert (c.speculative_config.prompt_lookup_min, c.speculative_config.prompt_lookup_max) == (5, 5)
    legacy = SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2})
    assert legacy.method == "ngram"
    draft = SpeculativeConfig.from_value({"model": "Qwen/Qwen3-0.6B",
                                          "num_speculative_tokens": 2})
    assert draft.method == "draft_model"
    assert SpeculativeConfig.from_value({"method": "self_quantized",
                                         "num_speculative_tokens": 2}).quantization == "int4"
    bad = [({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa'"),
           ({"method": "ngram"}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
           ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field 'k'"),
           ({"method": "self_quantized", "quantization": "fp8", "num_speculative_tokens": 2},
            "quantization='fp8'"),
           ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_acceptance": "no"},
            "disable_by_acceptance='no' must be true or false"),
           ("{method: ngram}", "not valid JSON")]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            SpeculativeConfig.from_value(value)


def test_draft_with_another_tokenizer_is_refused(tiny_dir, tmp_path):
    other = write_random_model(tmp_path / "other", {**json.loads(
        (tiny_dir / "config.json").read_text()), "vocab_size": 1000}, dtype="float32")
    with pytest.raises(ConfigError, match="vocab_size 1000"):
        make_llm(tiny_dir, speculative_config={"model": str(other), "num_speculative_tokens": 2})
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_dir, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        make_llm(tiny_dir, speculative_config={"model": str(swapped),
                                               "num_speculative_tokens": 2})


def test_refused_where_it_cannot_help(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        make_llm(tiny_dir, tensor_parallel_size=2, speculative_config=METHODS["self-int8"])
    with pytest.raises(ConfigError, match="generates nothing"):
        make_llm(tiny_dir, task="embed", speculative_config=METHODS["ngram"])



def test_server_streams_accepted_tokens_and_reports_metrics(tiny_dir):
    """A streamed completion with speculation: its chunks add up to the plain engine's greedy text
    (several tokens may arrive in one chunk), and /metrics counts the drafts."""
    import re

    from fastapi.testclient import TestClient

    from nanoqwen.entrypoints.server import build_app

    plain = make_llm(tiny_dir).generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    llm = make_llm(tiny_dir, speculative_config=METHODS["self-int8"], enforce_eager=True)
    body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with TestClient(build_app(llm.llm_engine, "m")) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == plain.text
        metrics = http.get("/metrics").text
    drafts = float(re.search(r"^nanoqwen_spec_decode_num_drafts (\S+)$", metrics, re.M)[1])
    accepted = float(re.search(r"^nanoqwen_spec_decode_num_accepted_tokens (\S+)$", metrics,
                               re.M)[1])
    assert drafts > 0 and accepted > 0
    assert drafts == llm.llm_engine.spec_stats["num_drafts"]
