"""The OpenAI-compatible server: a real `nanoqwen serve` process on a random tiny checkpoint,
driven with the `openai` client, plus in-process apps over scripted engines for what a random model
cannot show (reasoning / tool-call parsing, a full queue, an engine that fails). The parsers on
their own: test_parsers.py."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest
from conftest import CALLS, THOUGHT
from fastapi.testclient import TestClient
from server_testing import ScriptedEngine, metrics, nanoqwen_serve, wait_idle

import nanoqwen
from nanoqwen import LLM, SamplingParams
from nanoqwen.entrypoints.server import build_app
from nanoqwen.tokenizer import Tokenizer

# a hang (e.g. a dead engine loop) fails instead of blocking the run
pytestmark = pytest.mark.timeout(120)
MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0}
QUESTIONS = ["Why is the sky blue?", "Write a haiku about tea.", "hi"]


# ---------------------------------------------------------------- a real server process




@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`nanoqwen serve` on a free port; the last test stops it with SIGTERM (teardown kills it
    otherwise)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with nanoqwen_serve(model_dir, log, "--dtype", "float32", "--device", "cpu",
                        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "32MiB",
                        "--served-model-name", "tiny", "--max-body-bytes", "1MiB", "--seed", "0",
                        "--shutdown-timeout", "1") as served:
        yield {"base": served.base, "proc": served.proc, "log": served.log}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=32 << 20)


def test_health_and_models(server, client):
    assert httpx.get(f"{server['base']}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_greedy_equals_llm_chat_whole_and_streamed(client, llm):
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids),
                                                                      len(ref.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_completion_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert (len({(c.id, c.created, c.model) for c in chunks}) == 1
            and chunks[0].object == "chat.completion.chunk")
    assert (chunks[0].choices[0].delta.role == "assistant"
            and chunks[0].choices[0].delta.content == "")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_timings_in_llama_cpp_names_beside_usage(client):
    messages = [{"role": "user", "content": "Count to ten. " * 12}]
    for _ in range(2):  # the second time, the prompt's full blocks come from the prefix cache
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
        usage, timings = chunks[-1].usage, chunks[-1].model_extra["timings"]
        assert all(c.model_extra.get("timings") is None for c in chunks[:-1])
        assert timings["predicted_n"] == usage.completion_tokens == 9
        assert timings["cache_n"] == usage.prompt_tokens_details.cached_tokens
        assert timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens
        assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
        assert timings["predicted_per_second"] == pytest.approx(8 * 1000 / timings["predicted_ms"])
        assert timings["prompt_per_second"] == pytest.approx(timings["prompt_n"] * 1000 / timings["prompt_ms"])
    assert timings["cache_n"] > 0
    whole = client.completions.create(model="tiny", prompt="One, two,", max_tokens=5, **GREEDY)
    assert whole.model_extra["timings"]["predicted_n"] == 5


def test_completions_greedy_equals_llm_generate(client, llm):
    prompts = ["The capital of France is", [785, 6722, 315]]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    for prompt, ref in zip(prompts, refs, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY)
        assert r.object == "text_completion" and r.choices[0].text == ref.text
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 10)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, stream=True,
                                           **GREEDY)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_unset_runs_to_the_context(client):
    prompt = [785 + i % 50 for i in range(MAX_MODEL_LEN - 7)]
    r = client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_seeded_n_gt_1_is_reproducible_and_uses_the_model_defaults(client, llm):
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "n": 3, "seed": 7}
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert (texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
            and len(set(texts)) == 3)
    assert a.usage.completion_tokens == 24
    # Unset fields take generation_config.json's sampling (temperature 0.6, top-k 20, top-p 0.95).
    params = replace(llm.get_default_sampling_params(), max_tokens=8, n=3, seed=7)
    ref = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert texts == [o.text for o in ref.outputs]
    other = client.completions.create(**{**kwargs, "seed": 8})
    assert [c.text for c in sorted(other.choices, key=lambda c: c.index)] != texts
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=3)
    params = replace(llm.get_default_sampling_params(), max_tokens=8, seed=3)
    assert chat.choices[0].message.content == llm.chat(messages, params, use_tqdm=False)[0].text


def test_stop_string(client, llm):
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    full = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stop=[stop],
                                       **GREEDY)
    assert r.choices[0].message.content == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop


def test_logprobs_chat_and_completions(client, llm):
    messages = [{"role": "user", "content": "hi"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                   use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, logprobs=True,
                                       top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == r.usage.completion_tokens
    for item, token_id, entry in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert (len(item.top_logprobs) == 3
                and item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob)
        # greedy picks the top one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    assert "".join(bytes(i.bytes).decode("utf-8", "replace") for i in content) == ref.text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                            logprobs=True, stream=True, **GREEDY)
    streamed = [i for c in stream if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2,
                                  **GREEDY).choices[0]
    assert len(c.logprobs.tokens) == 4 and "".join(c.logprobs.tokens) == c.text
    assert c.logprobs.text_offset[0] == 0 and all(2 <= len(t) <= 3 for t in c.logprobs.top_logprobs)


def test_64_concurrent_streams_complete_and_leave_nothing_behind(server, llm):
    prompts = [[100 + 37 * i + j for j in range(5 + i % 7)] for i in range(64)]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)

    async def one(aclient: openai.AsyncOpenAI, prompt: list[int]) -> tuple[str, int, str | None]:
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                                  stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True}, **GREEDY)
        text, tokens, finish = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, tokens, finish

    async def run() -> list[tuple[str, int, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="none",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert [r[1:] for r in results] == [(16, "length")] * 64
    same = sum(r[0] == ref.text for r, ref in zip(results, refs, strict=True))
    # batching may flip a near-tie
    assert same >= 60, f"only {same}/64 greedy answers equal LLM.generate's"
    m = wait_idle(server["base"])
    assert m["nanoqwen_num_requests_running"] == 0 and m["nanoqwen_kv_cache_used_blocks"] == 0
    assert m["nanoqwen_kv_cache_usage_ratio"] == 0 and m["nanoqwen_engine_sequences_running"] == 0


def test_client_disconnect_aborts_the_request(server):
    base = server["base"]
    before = metrics(base).get('nanoqwen_requests_finished_total{finish_reason="abort"}', 0)
    body = {"prompt": "Tell me a long story", "max_tokens": 480, "n": 4, "logprobs": 5,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few events, then hang up mid-stream
    # 4 x 480 tokens take seconds on this model; aborted, the blocks are free at once.
    m = wait_idle(base, timeout=1.5)
    assert m["nanoqwen_kv_cache_used_blocks"] == 0 and m["nanoqwen_num_requests_running"] == 0
    assert m['nanoqwen_requests_finished_total{finish_reason="abort"}'] == before + 1
    # Non-streaming too: a client that times out and closes the connection.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    m = wait_idle(base, timeout=1.5)
    assert m["nanoqwen_kv_cache_used_blocks"] == 0 and m["nanoqwen_num_requests_running"] == 0
    assert m['nanoqwen_requests_finished_total{finish_reason="abort"}'] == before + 2


BAD = [  # (path, body, status, words in the message)
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
     400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     400, f"maximum context length is {MAX_MODEL_LEN}"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400,
     "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}, 400,
     f"max_model_len is {MAX_MODEL_LEN}"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
     404, "gpt-4"),
    ("/v1/completions", {"prompt": list(range(600))}, 400,
     "the prompt has 600 tokens but max_model_len is 512"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, "larger than"),
    ("/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,words", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, path, body, status,
                                                                      words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server['base']}{path}", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    ok = httpx.post(f"{server['base']}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_metrics_count_requests_tokens_and_latency(server, client):
    before = metrics(server["base"])
    r = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Hello there", max_tokens=0)
    after = metrics(server["base"])

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("nanoqwen_prompt_tokens_total") == r.usage.prompt_tokens == 2
    assert grew("nanoqwen_generation_tokens_total") == 5
    assert grew("nanoqwen_time_to_first_token_seconds_count") == 1
    assert grew("nanoqwen_time_per_output_token_seconds_count") == 1
    assert grew('nanoqwen_http_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert grew('nanoqwen_http_requests_total{endpoint="/v1/completions",status="400"}') == 1
    assert grew('nanoqwen_requests_finished_total{finish_reason="length"}') == 1
    # 32 MiB of 16-token blocks
    assert after["nanoqwen_kv_cache_blocks"] == 32 * 2**20 // (16 * 2 * 2 * 2 * 32 * 4)
    assert "nanoqwen_prefix_cache_hit_rate" in after and "nanoqwen_num_preemptions" in after


def test_thinking_token_budget_closes_the_reasoning(client):
    """vLLM's request field: after that many reasoning tokens the answer gets </think>; without it a random model
    reasons on."""
    messages = [{"role": "user", "content": "Why is the sky blue?"}]

    def tokens(**extra) -> list[str]:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True,
                                           extra_body=extra, **GREEDY)
        return [t.token for t in r.choices[0].logprobs.content]

    assert "</think>" not in tokens()
    assert tokens(thinking_token_budget=3)[3] == "</think>"
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"thinking_token_budget": -1})


def test_tokenize_detokenize_and_version(server, client, llm):
    """vLLM's shapes: a prompt, or messages rendered exactly as a chat completion's prompt; and back."""
    base, tokenizer = server["base"], llm.get_tokenizer()
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "Hello there, world",
                                             "return_token_strs": True}).json()
    ids = tokenizer.encode("Hello there, world")
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                 "token_strs": [tokenizer.id_to_token(t) for t in ids]}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    tools = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}]
    for kwargs, body in (({}, {}), ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}),
                         ({"tools": tools}, {"tools": tools})):
        chat = httpx.post(f"{base}/tokenize", json={"messages": messages, **body}).json()
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        assert chat["tokens"] == expected and chat["token_strs"] is None
    completion = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **GREEDY)
    assert completion.usage.prompt_tokens == httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["count"]
    no_prompt = httpx.post(f"{base}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    back = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": expected}).json()
    assert back == {"prompt": tokenizer.decode(expected)}
    assert httpx.get(f"{base}/version").json()["version"] == nanoqwen.__version__
    # bad input: one clear 400 (or 404 for another model) in OpenAI's shape
    for path, body, status, words in (
            ("/detokenize", {"tokens": [10**9]}, 400, "not in the vocabulary"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"messages": []}, 400, "messages"),
            ("/tokenize", {"messages": messages, "prompt": "hi"}, 400, "not both"),
            ("/tokenize", {"messages": messages, "continue_final_message": True}, 400, "continue_final_message"),
            ("/tokenize", {"model": "other", "prompt": "x"}, 404, "other")):
        r = httpx.post(f"{base}{path}", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, body, r.text)


VLLM_TYPES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
              "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
              "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
              "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
              "vllm:num_preemptions": "counter", "vllm:request_prompt_tokens": "histogram",
              "vllm:request_generation_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
              "vllm:inter_token_latency_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
              "vllm:request_time_per_output_token_seconds": "histogram",
              "vllm:e2e_request_latency_seconds": "histogram"}


def test_metrics_also_carry_vllms_names(server, client):
    """What routers and dashboards made for vLLM read: vLLM's names, types and labels, counting the same requests."""
    base = server["base"]
    text = httpx.get(f"{base}/metrics").text
    for name, kind in VLLM_TYPES.items():  # (the text format names a counter by its sample, NAME_total)
        assert f"# TYPE {name}{'_total' if kind == 'counter' else ''} {kind}" in text, name
    label = '{engine="0",model_name="tiny"}'
    before = metrics(base)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # more than one 16-token block
    for _ in range(2):  # the second is a prefix-cache hit
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, **GREEDY)
    after = wait_idle(base)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew(f"vllm:prompt_tokens_total{label}") == 2 * r.usage.prompt_tokens
    assert grew(f"vllm:generation_tokens_total{label}") == 10
    assert grew('vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}') == 2
    assert grew(f"vllm:request_prompt_tokens_sum{label}") == 2 * r.usage.prompt_tokens
    assert grew(f"vllm:request_generation_tokens_count{label}") == 2
    assert grew(f"vllm:time_to_first_token_seconds_count{label}") == 2
    assert grew(f"vllm:e2e_request_latency_seconds_count{label}") == 2
    assert grew(f"vllm:inter_token_latency_seconds_count{label}") == 2 * 4  # each token after the first
    assert grew(f"vllm:inter_token_latency_seconds_sum{label}") > 0
    assert grew(f"vllm:request_time_per_output_token_seconds_count{label}") == 2
    assert grew(f"vllm:prefix_cache_hits_total{label}") >= 16
    assert grew(f"vllm:prefix_cache_queries_total{label}") >= grew(f"vllm:prefix_cache_hits_total{label}")
    assert after[f"vllm:num_requests_running{label}"] == after[f"vllm:num_requests_waiting{label}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{label}"] == after["nanoqwen_kv_cache_usage_ratio"]


def test_sigterm_finishes_short_requests_cancels_long_ones_and_exits_cleanly(server):
    """--shutdown-timeout 1: a 20-token stream finishes; a long one (500 tokens x 4 answers,
    seconds) ends with a 'shutting down' event."""
    base, proc = server["base"], server["proc"]
    started = [threading.Event(), threading.Event()]

    def stream(i: int, max_tokens: int, n: int) -> list[str]:
        body = {"prompt": "Count to a hundred", "max_tokens": max_tokens, "n": n, "logprobs": 5,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started[i].set()
            return [line for line in lines if line.startswith("data: ")]

    with ThreadPoolExecutor(2) as pool:
        short, long = pool.submit(stream, 0, 20, 1), pool.submit(stream, 1, 500, 4)
        assert all(e.wait(timeout=10) for e in started)
        proc.send_signal(signal.SIGTERM)
        short, long = short.result(timeout=20), long.result(timeout=20)
    assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
    assert long[-1] == "data: [DONE]" and json.loads(long[-2][6:])["error"]["code"] == "shutdown"
    assert proc.wait(timeout=15) == 0
    log = server["log"].read_text()
    assert "server stopped" in log and "Traceback" not in log
    assert re.search(r'"POST /v1/completions" 200 \d+ms cmpl-\w+ prompt=\d+ '
                     r'generated=20 finish=length', log)


# ------------------------------------------------------------ in-process apps over scripted engines




def script(prompt: str) -> str:
    prompt = prompt.rsplit("<|im_start|>user", 1)[-1]  # the last user turn (or tool results)
    if "FAIL" in prompt:
        return "FAIL"
    if "broken" in prompt:
        return "<tool_call>\n{not json}\n</tool_call>"
    if "weather" in prompt:
        return THOUGHT + CALLS
    return "<think>\nHmm.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture
def scripted(tokenizer):
    """(engine, TestClient, openai client) over an in-process app; the engine loop runs for the
    test."""
    engine = ScriptedEngine(tokenizer, script)
    with TestClient(build_app(engine, "scripted", api_key="sesame", max_waiting=1)) as http:
        http.headers["authorization"] = "Bearer sesame"
        yield engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="sesame",
                                          http_client=http, max_retries=0)
    engine.gate.set()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city",
                       "parameters": CITY}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_reasoning_and_tool_calls_end_to_end(scripted):
    engine, _, client = scripted
    r = client.chat.completions.create(model="scripted", messages=WEATHER, tools=TOOLS)
    msg = r.choices[0].message
    assert ('"name": "get_weather"' in engine.prompts[-1]
            and engine.prompts[-1].endswith("<|im_start|>assistant\n"))
    assert msg.reasoning_content == "\nThe user wants the weather.\n" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].id.startswith("call_")

    engine.step_seconds = 0.05  # the server sends a stream's latest output: steps far apart stay apart
    chunks = list(client.chat.completions.create(model="scripted", messages=WEATHER, tools=TOOLS,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.model_extra.get("reasoning_content") or ""
                   for d in deltas) == msg.reasoning_content
    assert sum(bool(d.model_extra.get("reasoning_content")) for d in deltas) > 1  # really streamed
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices[0].finish_reason] == ["tool_calls"]

    # tool_choice "none": the template gets no tools and the output is not parsed for calls.
    r = client.chat.completions.create(model="scripted", messages=WEATHER, tools=TOOLS,
                                       tool_choice="none")
    assert "# Tools" not in engine.prompts[-1] and r.choices[0].message.content == "\n\n" + CALLS
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls

    # Malformed call JSON stays text.
    r = client.chat.completions.create(model="scripted",
                                       messages=[{"role": "user", "content": "broken"}],
                                       tools=TOOLS)
    assert r.choices[0].message.content == "<tool_call>\n{not json}\n</tool_call>"
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_thinking_off_and_tool_results_render_through_the_template(scripted):
    engine, _, client = scripted
    r = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "<think>\nHmm.\n</think>\n\nHello there!"
    assert r.choices[0].message.model_extra["reasoning_content"] is None
    history = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in engine.prompts[-1])
    assert "<tool_response>\n18C and sunny\n</tool_response>" in engine.prompts[-1]
    assert r.choices[0].message.content == "\n\nHello there!"


def test_api_key_is_required_on_v1_only(scripted):
    _, http, _ = scripted
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"authorization": ""}, {"authorization": "Bearer wrong"},
                    {"authorization": "sesame"}):
        r = http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
    assert http.get("/health", headers={"authorization": ""}).status_code == 200
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(scripted):
    engine, http, _ = scripted
    engine.gate.clear()  # the engine stalls, so the first request waits for its first token
    body = {"prompt": "hi"}
    with ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(http.post, "/v1/completions", json=body)
            deadline = time.monotonic() + 5
            while "nanoqwen_num_requests_waiting 1.0" not in http.get("/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # admitted, it would hang
            r = pool.submit(http.post, "/v1/completions", json=body).result(timeout=5)
        finally:
            engine.gate.set()
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert first.result(timeout=10).status_code == 200
    assert http.post("/v1/completions", json=body).status_code == 200


def test_an_engine_failure_fails_its_requests_with_500_and_the_loop_keeps_serving(scripted):
    _, http, client = scripted
    r = http.post("/v1/completions", json={"prompt": "FAIL"})
    assert r.status_code == 500 and "scripted failure" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="scripted failure"):
        list(client.completions.create(model="scripted", prompt="FAIL", stream=True))
    r = client.completions.create(model="scripted", prompt="hello")
    assert r.choices[0].text.endswith("Hello there!") and http.get("/health").status_code == 200
