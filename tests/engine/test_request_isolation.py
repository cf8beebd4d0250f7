"""No request can hurt another: every number is checked at the edge by one rule set, a step that one request
breaks is run again without it, NaN logits end their request with an error instead of a token, and one LLM
serves calls from several threads."""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading

import pytest
import torch
from conftest import PROMPTS, make_llm
from safetensors.torch import load_file, save_file

from nanoqwen import LLM, InvalidRequestError, SamplingParams
from nanoqwen.sample.sampler import BROKEN_ROW
from nanoqwen.worker import model_runner

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir)


def assert_idle(llm) -> None:
    engine = llm.llm_engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("field, value, words", [
    ("temperature", math.inf, "finite number >= 0"),
    ("temperature", math.nan, "finite number >= 0"),
    ("temperature", True, "finite number >= 0"),
    ("top_p", math.nan, "in (0, 1]"),
    ("min_p", math.inf, "in [0, 1]"),
    ("repetition_penalty", math.inf, "in [0.01, 100]"),
    ("repetition_penalty", 5e-324, "in [0.01, 100]"),  # (its reciprocal overflows: inf logits)
    ("presence_penalty", math.nan, "in [-2, 2]"),
    ("n", 10**7, "in [1, 128]"),
    ("n", 0, "in [1, 128]"),
    ("stop_token_ids", [-1], "integers >= 0"),
    ("stop", ["x" * 1025], "at most 1024 characters"),
    ("ignore_eos", "yes", "True or False"),
])
def test_sampling_params_refuse_what_means_nothing(field, value, words):
    pattern = rf"SamplingParams\.{field}=.* is invalid: .*{re.escape(words)}"
    with pytest.raises(InvalidRequestError, match=pattern) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@pytest.mark.parametrize("params, param, words", [
    (SamplingParams(stop_token_ids=[9223372036854775808]), "stop_token_ids",
     r"9223372036854775808 is not a token id of this model: ids are in \[0, 151936\)"),
    (SamplingParams(stop_token_ids=[151936]), "stop_token_ids", "151936 is not a token id"),
    (SamplingParams(stop_token_ids=list(range(2000))), "stop_token_ids",
     r"has 2000 ids, more than this engine's limit of 1024 \(--max-stop-token-ids\)"),
    (SamplingParams(stop=[str(i) for i in range(65)]), "stop",
     r"has 65 stop strings, more than this engine's limit of 64 \(--max-stop-sequences\)"),
])
def test_the_engine_refuses_ids_outside_the_vocabulary_and_lists_past_its_limits(llm, params, param, words):
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError, match=words) as e:
        engine.add_request("bad", PROMPTS[0], params)
    assert e.value.param == param
    with pytest.raises(InvalidRequestError, match=words):  # the same through LLM.generate, nothing queued
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, params], use_tqdm=False)
    assert_idle(llm)


def test_prompt_token_ids_given_to_add_request_are_checked(llm):
    with pytest.raises(InvalidRequestError, match=r"prompt token id 9223372036854775808 is not in the vocabulary"):
        llm.llm_engine.add_request("bad", "", GREEDY, prompt_token_ids=[1, 2**63])
    assert_idle(llm)


def test_limits_are_engine_options(tiny_dir):
    llm = make_llm(tiny_dir, max_stop_sequences=2, max_stop_token_ids=3)
    with pytest.raises(InvalidRequestError, match="limit of 2"):
        llm.generate([PROMPTS[0]], SamplingParams(stop=["a", "b", "c"]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="limit of 3"):
        llm.generate([PROMPTS[0]], SamplingParams(stop_token_ids=[1, 2, 3, 4]), use_tqdm=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2, 3], max_tokens=2),
                       use_tqdm=False)[0]
    assert out.finished


def fail_for_seed(monkeypatch, seed: int) -> list[int]:
    """Make the sampler raise whenever a row of the request with this seed is in the batch (a bug no check
    caught); returns the sizes of the batches it saw."""
    sample, batches = model_runner.sample, []

    def sample_or_fail(logits, params, *args, **kwargs):
        batches.append(len(params))
        if any(p.seed == seed for p in params):
            raise RuntimeError("Overflow when unpacking long long")
        return sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample_or_fail)
    return batches


def test_a_step_one_request_breaks_fails_that_request_alone(llm, monkeypatch):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True) for i in range(4)]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].token_ids for p, q in zip(PROMPTS, params, strict=True)]
    batches = fail_for_seed(monkeypatch, seed=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert max(batches) > 1  # (the bad request did share a step with the others)
    bad = outs[2]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error == "the engine failed on this request: RuntimeError: Overflow when unpacking long long"
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [t for i, t in enumerate(alone) if i != 2]
    assert all(o.outputs[0].finish_reason == "length" for i, o in enumerate(outs) if i != 2)
    assert_idle(llm)


def test_a_failure_of_every_request_is_the_engines(llm, monkeypatch):
    """Where every request of a step fails on its own too, no one request is at fault: the call raises (the
    server fails what is in flight), and the engine is left empty and serving."""
    def broken(*args, **kwargs):
        raise RuntimeError("a broken kernel")

    monkeypatch.setattr(model_runner, "sample", broken)
    monkeypatch.setattr(model_runner, "greedy_tokens", broken)  # (greedy rows skip the sampler)
    with pytest.raises(RuntimeError, match="a broken kernel"):
        llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids) == 8


@pytest.fixture(scope="module")
def nan_dir(checkpoint):
    """A checkpoint whose final norm is NaN: every logit is NaN."""
    path = checkpoint("tiny", dtype="bfloat16")
    broken = path.parent / "nan"
    if not broken.exists():
        shutil.copytree(path, broken)
        weights = load_file(broken / "model.safetensors")
        weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], math.nan)
        save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


@pytest.mark.parametrize("how", ["greedy", "sampled", "logprobs", "multi-step", "multi-step-reference"])
def test_nan_logits_never_become_a_token(nan_dir, monkeypatch, caplog, how):
    """The answer ends at once with finish_reason "error" and says why; the checkpoint is named once in the
    log. Greedy and sampled rows, and several greedy steps in one C++ call or the reference loop."""
    options = {"num_scheduler_steps": 4} if how.startswith("multi-step") else {}
    if how == "multi-step":
        monkeypatch.setenv("NANOQWEN_CPU_GEMV", "1")  # (the fused decoder takes the steps)
    llm = LLM(nan_dir, dtype="bfloat16", device="cpu", max_model_len=128, kv_cache_memory=8 << 20, **options)
    runner = llm.llm_engine.runner
    if how == "multi-step":
        assert runner.fused_decoder is not None
    if how == "multi-step-reference":
        runner.fused_decoder = None
    params = {"greedy": GREEDY, "sampled": SamplingParams(temperature=1.0, seed=0, max_tokens=8),
              "logprobs": SamplingParams(temperature=0, logprobs=2, max_tokens=8)}.get(how, GREEDY)
    with caplog.at_level(logging.WARNING, logger="nanoqwen"):
        outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert out.token_ids == [] and "NaN or all -inf" in out.error
    assert caplog.text.count("gave logits that are NaN or all -inf") == 1
    assert str(nan_dir) in caplog.text
    assert_idle(llm)


def test_the_sampler_marks_rows_with_nothing_to_pick():
    from nanoqwen.sample.sampler import sample

    logits = torch.randn(4, 16)
    logits[1] = math.nan
    logits[2] = -math.inf
    logits[3, 5] = math.nan  # one NaN: no distribution either
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1)] * 4
        out = sample(logits, params, [None] * 4, [[1]] * 4, [[]] * 4, [frozenset()] * 4)
        tokens = out.token_ids.tolist()
        assert tokens[0] != BROKEN_ROW and tokens[1:] == [BROKEN_ROW] * 3, temperature


def test_one_llm_serves_calls_from_several_threads(llm):
    """Calls from two threads at once, one of them a stream, each get what they get alone."""
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    alone = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    streamed_alone = list(llm.stream(PROMPTS[1], params[1]))[-1][1].token_ids
    results: dict[str, list] = {}
    errors = []

    def generate(name: str) -> None:
        try:
            for _ in range(3):
                results.setdefault(name, []).append(
                    [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        except Exception as e:  # pragma: no cover - the assertion below shows it
            errors.append(e)

    def stream() -> None:
        try:
            for _ in range(3):
                results.setdefault("stream", []).append(list(llm.stream(PROMPTS[1], params[1]))[-1][1].token_ids)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=generate, args=("a",)), threading.Thread(target=generate, args=("b",)),
               threading.Thread(target=stream)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert results["a"] == results["b"] == [alone] * 3
    assert results["stream"] == [streamed_alone] * 3
    assert_idle(llm)


def test_answers_of_a_large_n_take_turns_and_get_their_tokens(tiny_dir):
    """n answers past max_seqs_per_request_step decode in turns: every answer gets the tokens it gets when all
    run in every step (seeded: each answer's draws are its own), and a step never holds more of them."""
    params = SamplingParams(n=11, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True, logprobs=2,
                            presence_penalty=0.5)
    together = make_llm(tiny_dir, max_seqs_per_request_step=16).generate(PROMPTS[0], params, use_tqdm=False)[0]
    llm = make_llm(tiny_dir, max_seqs_per_request_step=3)
    steps = []
    execute = llm.llm_engine.runner.execute
    llm.llm_engine.runner.execute = lambda batch: steps.append(len(batch.decode)) or execute(batch)
    turns = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [c.token_ids for c in turns.outputs] == [c.token_ids for c in together.outputs]
    assert len({tuple(c.token_ids) for c in turns.outputs}) > 5  # real draws
    assert max(steps) == 3 and sum(steps) == 11 * 6  # (the prompt's step samples each answer's first token)
    assert_idle(llm)
