"""Greedy multi-step decode (num_scheduler_steps, core/scheduler.py): several decode steps run in one go
give exactly the tokens, text and finish reasons of one step at a time; the C++ loop (worker/fused_decoder.py,
FusedDecoder.greedy_steps) and ModelRunner's step-by-step reference agree; stops, max_tokens and
max_model_len end an answer where they would; blocks are reserved ahead and given back."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from nanoqwen import LLM, SamplingParams
from nanoqwen.core.block_manager import BlockManager
from nanoqwen.core.scheduler import Scheduler
from nanoqwen.core.sequence import Sequence, SequenceStatus
from nanoqwen.errors import ConfigError
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.worker.model_runner import ModelRunner

K = 8  # steps in one go


def bf16_llm(path, steps: int, **kwargs) -> LLM:
    """A bf16 CPU engine with 4-token blocks, so that the steps ahead cross block boundaries."""
    return LLM(path, dtype="bfloat16", device="cpu", max_model_len=96, block_size=4, kv_cache_memory=8 << 20,
               num_scheduler_steps=steps, **kwargs)


def count_calls(monkeypatch, obj, name: str) -> list[tuple]:
    """Record each call of obj.name (its arguments), still calling it."""
    calls = []
    original = getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **kw: calls.append(a) or original(*a, **kw))
    return calls


@pytest.fixture
def model_dir(checkpoint):
    return checkpoint("gqa2-untied", dtype="bfloat16")


def answers(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_steps_in_one_go_give_the_tokens_of_one_step_at_a_time(fused, quantization, model_dir, monkeypatch):
    """Four sequences of different lengths, 21 tokens each (not a multiple of K): the same tokens and text,
    through the C++ loop (fused) or the step-by-step reference, and fewer trips through the scheduler."""
    if fused == "1" and not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    monkeypatch.setenv("NANOQWEN_FUSED_DECODE", fused)
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    one = bf16_llm(model_dir, 1, quantization=quantization)
    expected = answers(one, params)
    many = bf16_llm(model_dir, K, quantization=quantization)
    runner = many.llm_engine.runner
    assert (runner.fused_decoder is not None) == (fused == "1")
    loops = count_calls(monkeypatch, cpu_kernels, "decode_steps")
    reference = count_calls(monkeypatch, runner, "greedy_steps_reference")
    schedules = count_calls(monkeypatch, many.llm_engine.scheduler, "schedule")
    assert answers(many, params) == expected
    assert [len(o[0]) for o in expected] == [21] * 4
    assert bool(loops) == (fused == "1") and bool(reference) == (fused == "0")
    # a prefill step, then 20 tokens in windows of 8, 8 and 4 (the last cut to max_tokens)
    assert [c[-1] for c in loops] + [c[1] for c in reference] == [K, K, 4]
    assert len(schedules) == 4
    bm = many.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every reserved block came back


def test_the_cpp_loop_and_the_reference_agree_step_by_step(model_dir):
    """ModelRunner.greedy_steps through FusedDecoder.greedy_steps against greedy_steps_reference, on the same
    sequences, cache contents and blocks: the same tokens at every step, and the same keys and values written.
    (With the fused decoder loaded, the reference's forward() is one decode_model call a step: this checks the C++
    loop's positions, slots, argmax and feeding against calls made one at a time from Python.)"""
    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    llm = bf16_llm(model_dir, 1)
    engine = llm.llm_engine
    runner: ModelRunner = engine.runner
    assert runner.fused_decoder is not None
    seqs = []
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        seqs.append(engine.requests[str(i)].seqs[0])
    while any(seq.is_prefilling or not seq.output_token_ids for seq in seqs):  # prompts in, first tokens out
        engine.step()
    for seq in seqs:  # the blocks for K more tokens
        assert engine.block_manager.append_slots(seq, seq.num_computed_tokens + K)
    cache = runner.kv_cache
    before = cache.k.clone(), cache.v.clone()
    fused = runner.greedy_steps(seqs, K)  # (ignore_eos: no stop ids)
    fused_cache = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    reference = runner.greedy_steps_reference(seqs, K, [set()] * 3)
    assert [s.token_ids for s in fused] == [list(t) for t in zip(*reference, strict=True)]
    assert len(reference) == K and len({tuple(t) for t in reference}) > 1
    assert not torch.equal(fused_cache[0], before[0])  # K steps' keys were written...
    assert torch.equal(cache.k, fused_cache[0]) and torch.equal(cache.v, fused_cache[1])  # ...the same ones
    for i in range(3):
        engine.abort_request(str(i))


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_stop_token_ends_the_answer_where_one_step_at_a_time_ends_it(fused, model_dir, monkeypatch):
    """A stop token in the middle of a K-step window: the answer ends at it (the tokens after it dropped), and
    the window stops after the step where every sequence has stopped, in the C++ loop and in the reference."""
    if fused == "1" and not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    monkeypatch.setenv("NANOQWEN_FUSED_DECODE", fused)
    free_run = answers(bf16_llm(model_dir, 1), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       PROMPTS[:1])[0][0]
    # the prompt's step gives token 0, the first window tokens 1-8, the second 9-16: a stop in the second
    stop_at = next(i for i in range(9, 17) if free_run[i] not in free_run[:i])
    stop = free_run[stop_at]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    expected = answers(bf16_llm(model_dir, 1), params, PROMPTS[:1])
    assert expected[0][0] == free_run[:stop_at + 1] and expected[0][2] == "stop" and expected[0][3] == stop
    many = bf16_llm(model_dir, K)
    runner = many.llm_engine.runner
    windows = []  # the tokens of each window's steps run, [steps][rows]
    if fused == "1":
        original = cpu_kernels.decode_steps
        monkeypatch.setattr(cpu_kernels, "decode_steps", lambda *a, **kw: windows.append(original(*a, **kw).tolist()) or
                            torch.tensor(windows[-1]))
    else:
        original = runner.greedy_steps_reference
        monkeypatch.setattr(runner, "greedy_steps_reference", lambda *a: windows.append(original(*a)) or windows[-1])
    assert answers(many, params, PROMPTS[:1]) == expected
    assert [len(w) for w in windows] == [K, stop_at - 8]  # the second window stopped after the stop token
    bm = many.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_strings_and_max_model_len_end_answers_as_one_step_at_a_time(model_dir):
    """A stop string found in the middle of a window (its text cut as usual), and answers cut by max_model_len
    (prompts whose room left is not a multiple of K), alongside each other in one batch."""
    free_run = answers(bf16_llm(model_dir, 1), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       PROMPTS[:1])[0][1]
    stop_string = free_run[len(free_run) // 2: len(free_run) // 2 + 3]
    assert len(stop_string) == 3 and stop_string.strip()
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_string]),
              SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)]
    prompts = [PROMPTS[0], [5] * 70, [7] * 83]  # 26 and 13 tokens of room under max_model_len 96
    results = {}
    for steps in (1, K):
        llm = bf16_llm(model_dir, steps)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[steps] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                           o.outputs[0].stop_reason) for o in outs]
        bm = llm.llm_engine.block_manager  # every block keyed for the prefix cache holds a full block of tokens
        assert bm.cached_blocks and all(len(b.token_ids) == 4 for b in bm.blocks if b.hash is not None)
    assert results[K] == results[1]
    assert results[1][0][2:] == ("stop", stop_string)
    assert [len(r[0]) for r in results[1][1:]] == [26, 13] and results[1][1][2] == "length"


def test_filled_blocks_join_the_prefix_cache_with_their_tokens(model_dir):
    """The blocks filled by a K-step window's tokens are offered to the prefix cache once those tokens are
    appended, also in the window that finishes the answer: a prompt continuing the answer finds them all."""
    llm = bf16_llm(model_dir, K)
    prompt = PROMPTS[0]  # 5 tokens; 16 more: 20 in the cache at the end, 5 full blocks
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    follow = prompt + out.outputs[0].token_ids + [11, 12, 13]
    again = llm.generate([follow], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 20


def test_only_blocks_of_a_sequences_own_tokens_join_the_prefix_cache():
    """A sequence that stopped inside a window (at a stop string, or at a stop token while other rows ran on) has
    computed keys past its last token: register_full_blocks keys only the blocks its tokens fill."""
    bm = BlockManager(8, 4)
    seq = Sequence("r", 0, list(range(6)), SamplingParams(), output_token_ids=[100, 101, 102])  # 9 tokens
    seq.status = SequenceStatus.RUNNING
    assert bm.allocate(seq, [], 16)
    seq.num_computed_tokens = 15  # the window ran on 6 tokens past the stop
    bm.register_full_blocks(seq)
    keyed = [b for b in bm.blocks if b.hash is not None]
    assert [b.token_ids for b in keyed] == [(0, 1, 2, 3), (4, 5, 100, 101)]


def test_only_batches_that_all_take_the_argmax_run_steps_ahead():
    """Scheduler.steps_ahead: K while every decoding sequence is plain greedy; 1 as soon as one samples,
    asks for logprobs, has a penalty or has min_tokens to reach; fewer near max_tokens; and 1, with the
    reserved blocks given back, when the blocks for the steps ahead run short."""
    def decoding(params: SamplingParams, num_tokens: int = 6, outputs: int = 1) -> Sequence:
        seq = Sequence("r", 0, list(range(num_tokens)), params, output_token_ids=[1] * outputs)
        seq.status = SequenceStatus.RUNNING
        return seq

    greedy = SamplingParams(temperature=0, max_tokens=50)
    sched = Scheduler(BlockManager(64, 4), 8, 64, max_model_len=200, num_scheduler_steps=K)
    for other, steps in [(greedy, K), (SamplingParams(temperature=0.7), 1),
                         (SamplingParams(temperature=0, logprobs=1), 1),
                         (SamplingParams(temperature=0, repetition_penalty=1.1), 1),
                         (SamplingParams(temperature=0, min_tokens=3), 1),
                         (SamplingParams(temperature=0, max_tokens=4), 3)]:
        seqs = [decoding(greedy), decoding(other)]
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens - 1
            assert sched.block_manager.append_slots(seq, seq.num_tokens)
        assert sched.steps_ahead(seqs) == steps, other
        for seq in seqs:
            assert len(seq.block_table) == -(-(seq.num_computed_tokens + steps) // 4)
            sched.block_manager.free(seq)
    # blocks short: the first sequence gets its 2 blocks ahead, the second cannot; both go back to one step's
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, 8, 64, max_model_len=200, num_scheduler_steps=K)
    seqs = [decoding(greedy, num_tokens=3), decoding(greedy, num_tokens=3)]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
        assert bm.append_slots(seq, seq.num_tokens)
    assert bm.num_free_blocks == 3 and sched.steps_ahead(seqs) == 1
    assert [len(seq.block_table) for seq in seqs] == [1, 1] and bm.num_free_blocks == 3


def test_num_scheduler_steps_is_checked_and_on_the_command_line(tiny_dir):
    import argparse

    from nanoqwen.config.engine import EngineConfig
    from nanoqwen.entrypoints.engine_args import add_engine_args, engine_config_from_args

    with pytest.raises(ConfigError, match="num_scheduler_steps=0 must be an integer >= 1"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ConfigError, match="choose one"):
        EngineConfig(num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--num-scheduler-steps", "4"])).num_scheduler_steps == 4
    assert engine_config_from_args(p.parse_args([])).num_scheduler_steps == 1


@pytest.mark.timeout(180)  # (a sibling never started would keep generate waiting forever)
def test_a_prompt_finishing_in_a_decode_row_still_starts_its_siblings(model_dir):
    """n = 2 with a chunked prompt whose last token is left for the next step: that step is a decode row that also
    samples the waiting sibling's first token, so it runs one step (not K); both answers then finish as one step
    at a time gives them."""
    prompt = [(7 * i + 3) % 5000 + 100 for i in range(17)]  # 16 tokens in the first step, 1 left
    params = SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True)
    results = {}
    for steps in (1, K):
        llm = bf16_llm(model_dir, steps, max_num_batched_tokens=16)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        results[steps] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        assert not llm.llm_engine.has_unfinished_requests()
    assert results[K] == results[1] and [len(t) for t, _ in results[1]] == [5, 5]


def test_a_block_table_short_of_its_tokens_is_refused():
    """Padding a decode row's blocks with block 0 would write its keys into another sequence's block: a table too
    short for the row's tokens (the scheduler reserved too few) is an error, not a silent write."""
    from nanoqwen.attention.metadata import DecodeRow, padded_block_tables

    assert padded_block_tables([DecodeRow([3, 7], 5), DecodeRow([2], 4)], 4) == [[3, 7], [2, 0]]
    with pytest.raises(RuntimeError, match="fewer than the 2 its 5 tokens need"):
        padded_block_tables([DecodeRow([3], 5)], 4)
