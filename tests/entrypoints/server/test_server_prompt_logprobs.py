"""Completions' echo (the prompt before each choice's text, its tokens' logprobs first) and vLLM's prompt_logprobs
field on completions and chat completions, through an in-process server on a random tiny checkpoint, with the
openai client and httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_testing import serve_app

from nanoqwen import LLM, SamplingParams
from nanoqwen.config.engine import EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.server import build_app

pytestmark = pytest.mark.timeout(180)
PROMPT = "Hello world, how are you today"
OPTIONS = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory": 16 << 20}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def base(model_dir):
    engine = LLMEngine(EngineConfig(str(model_dir), **OPTIONS))
    with serve_app(build_app(engine, "tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """PROMPT's tokens, greedy answer (4 tokens) and prompt logprobs (top 2) from LLM.generate."""
    llm = LLM(model_dir, **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    return llm.generate([PROMPT], params, use_tqdm=False)[0]


def test_echo_with_logprobs_puts_the_prompt_first(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=2, echo=True,
                                  temperature=0, extra_body={"ignore_eos": True})
    choice, n = r.choices[0], len(reference.prompt_token_ids)
    assert choice.text == PROMPT + reference.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert "".join(lp.tokens) == choice.text
    # the first prompt token has nothing to predict it: null, as OpenAI and vLLM
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    expected = [entry[token].logprob
                for token, entry in zip(reference.prompt_token_ids[1:], reference.prompt_logprobs[1:], strict=True)]
    expected += [entry[token].logprob for token, entry in zip(reference.token_ids, reference.logprobs, strict=True)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    # echo with logprobs computes the prompt's: they come back as vLLM's prompt_logprobs too
    assert len(choice.prompt_logprobs) == n and choice.prompt_logprobs[0] is None


def test_echo_without_logprobs_and_with_token_ids(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPT + reference.text and r.choices[0].logprobs is None
    assert getattr(r.choices[0], "prompt_logprobs", None) is None
    ids = client.completions.create(model="tiny", prompt=reference.prompt_token_ids, max_tokens=4, echo=True,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.choices[0].text == PROMPT + reference.text  # the token ids decoded


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, reference, base):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice, n = r.choices[0], len(reference.prompt_token_ids)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == n and choice.logprobs.token_logprobs[0] is None
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == r.usage.prompt_tokens == n
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_streamed_echo_equals_the_whole_answer(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, echo=True, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in chunks for v in getattr(c.logprobs, key)] == getattr(whole.logprobs, key), key
    alone = list(client.completions.create(stream=True, **{**kwargs, "max_tokens": 0}))
    assert "".join(c.choices[0].text for c in alone if c.choices) == PROMPT


def test_prompt_logprobs_on_completions_as_vllm_returns_them(base, reference):
    body = {"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1, "prompt_logprobs": 2}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert len(r["choices"]) == 2
    for choice in r["choices"]:
        assert choice["logprobs"] is None
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(reference.prompt_token_ids) and entries[0] is None
        for token, got, expected in zip(reference.prompt_token_ids[1:], entries[1:], reference.prompt_logprobs[1:],
                                        strict=True):
            assert got.keys() == {str(t) for t in expected}
            mine = got[str(token)]
            assert mine["rank"] == expected[token].rank and mine["decoded_token"] == expected[token].decoded_token
            assert mine["logprob"] == pytest.approx(expected[token].logprob, abs=1e-4)


def test_prompt_logprobs_on_chat_completions(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    entries = r["prompt_logprobs"]
    assert len(entries) == r["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    plain = httpx.post(f"{base}/v1/chat/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert "prompt_logprobs" not in plain


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
def test_prompt_logprobs_are_refused_with_stream(base, path, body):
    r = httpx.post(f"{base}{path}", json={**body, "max_tokens": 2, "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", json.dumps(r.json())
    too_many = httpx.post(f"{base}{path}", json={**body, "stream": False, "max_tokens": 2, "prompt_logprobs": 21},
                          timeout=30)
    assert too_many.status_code == 400
