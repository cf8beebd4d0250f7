"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) driven with the real `anthropic` SDK:
apps served by uvicorn in a thread, over a scripted engine (reasoning, tool-use and stop parsing that a random
model cannot show) and over a real engine on a random tiny checkpoint (max_tokens, stop_sequences, tool_choice
grammars). Every test checks the engine is left idle."""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest
from conftest import CALLS, THOUGHT
from server_testing import ScriptedEngine, serve_app, wait_idle

from nanoqwen import LLM
from nanoqwen.entrypoints.server import build_app
from nanoqwen.outputs import CompletionOutput, RequestOutput
from nanoqwen.tokenizer import Tokenizer

pytestmark = [pytest.mark.timeout(180), pytest.mark.server]
KEY = "sesame"
NO_THINK = {"type": "disabled"}
EMPTY_THINK = "<think>\n\n</think>\n\n"
WEATHER_TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = "<think>\nHmm.\n</think>\n\nHello there!"
SERVER_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"}


def script(prompt: str) -> str:
    """The scripted model's answer to a prompt (its last user turn or tool results decide)."""
    turn = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "FAIL" in turn:
        return "FAIL"
    if prompt.endswith(EMPTY_THINK):  # thinking off: no reasoning
        return "Hello there!"
    if "<tool_response>" in prompt.rsplit("<|im_start|>assistant", 2)[-2]:  # results since the last answer
        return "<think>\nGot it.\n</think>\n\nIt is 18C in Paris."
    if "weather" in turn:
        return THOUGHT + CALLS
    if "check first" in turn:  # text, a call, text
        return ('<think>\nA call.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_time", "arguments": {}}'
                '\n</tool_call>\nDone.')
    if "count" in turn:
        return "<think>\nCounting.\n</think>\n\nOne. Two. STOP here. Three."
    return HELLO


class StoppingEngine(ScriptedEngine):
    """ScriptedEngine that also ends an answer at its first stop string, as the engine does (the text without
    it, stop_reason the string)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stops: dict[str, str] = {}  # request id -> the stop string its answer ends at

    def add_request(self, request_id, prompt, params, prompt_token_ids=None) -> None:
        super().add_request(request_id, prompt, params, prompt_token_ids)
        answer = self.requests[request_id][2]
        hits = [(answer.find(s), s) for s in params.stop if s in answer]
        if hits:
            at, self.stops[request_id] = min(hits)
            self.requests[request_id][2] = answer[:at]

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for out in outputs:
            if out.finished and out.request_id in self.stops:
                c = out.outputs[0]
                out.outputs[0] = CompletionOutput(c.index, c.text, c.token_ids, "stop", self.stops.pop(out.request_id))
        return outputs


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture
def scripted(tokenizer):
    """A scripted engine behind an app with an API key: (engine, base URL, anthropic client)."""
    engine = StoppingEngine(tokenizer, script)
    with serve_app(build_app(engine, "scripted", api_key=KEY, max_waiting=1, max_body_bytes=1 << 16)) as base:
        yield SimpleNamespace(engine=engine, base=base,
                              client=anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=30))
        engine.gate.set()
        assert_idle(base)


@pytest.fixture(scope="module")
def real(model_dir):
    """A real engine on a random tiny checkpoint behind an app without an API key."""
    engine = LLM(model_dir, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                 seed=0).llm_engine
    with serve_app(build_app(engine, "tiny")) as base:
        yield SimpleNamespace(engine=engine, base=base,
                              client=anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120))


def assert_idle(base: str) -> None:
    m = wait_idle(base)
    assert m["nanoqwen_num_requests_running"] == 0 and m["nanoqwen_kv_cache_used_blocks"] == 0, m


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def blocks(message) -> list[tuple]:
    """A message's content blocks as comparable tuples (tool_use ids left out: each answer makes new ones)."""
    out = []
    for b in message.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking, b.signature))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input))
    return out


def raw_events(base: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's (event, data) pairs, read off the wire."""
    with httpx.stream("POST", f"{base}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# ---------------------------------------------------------------- scripted answers


def test_create_and_stream_with_system_and_thinking(scripted, tokenizer):
    engine, client = scripted.engine, scripted.client
    kwargs = dict(model="scripted", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
                  system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}],
                  thinking={"type": "adaptive"}, metadata={"user_id": "u1"},
                  extra_body={"temperature": 0.5, "top_k": 5})
    r = client.messages.create(**kwargs)
    prompt = engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nYou are terse.\nBe kind.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")  # thinking on: no empty think block
    params = engine.params[-1]
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.5, 5, 0.95, 100)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "scripted"
    assert blocks(r) == [("thinking", "Hmm.", digest("Hmm.")), ("text", "Hello there!")]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    prompt_len = len(tokenizer.encode(prompt))
    assert (r.usage.input_tokens, r.usage.cache_read_input_tokens) == (prompt_len, 0)
    assert r.usage.output_tokens == -(-len(HELLO) // engine.chunk)  # one token id per scripted step

    # the server sends a stream's latest output, so steps far apart keep "Hmm." in two deltas on a busy machine
    engine.step_seconds = 0.05
    with client.messages.stream(**kwargs) as stream:
        # (the SDK adds its own events, e.g. "text" with the text so far, beside the server's)
        events = [e for e in stream if e.type in SERVER_EVENTS]
        final = stream.get_final_message()
    assert blocks(final) == blocks(r) and final.stop_reason == "end_turn" and final.usage == r.usage
    kinds = [e.type if e.type != "content_block_delta" else e.delta.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("thinking_delta") > 1 and kinds.count("text_delta") > 1  # really streamed
    assert kinds.index("signature_delta") == kinds.index("content_block_stop") - 1
    # on the wire: each event's `event:` line is its type, and a ping follows message_start
    wire = raw_events(scripted.base, {**kwargs})
    assert all(name == data["type"] for name, data in wire) and [n for n, _ in wire][:2] == ["message_start", "ping"]
    assert wire[-2][1]["usage"]["output_tokens"] == r.usage.output_tokens
    # display "omitted": an empty thinking block, still signed
    r = client.messages.create(**{**kwargs, "thinking": {"type": "adaptive", "display": "omitted"}})
    assert blocks(r) == [("thinking", "", digest("Hmm.")), ("text", "Hello there!")]


def test_thinking_disabled_renders_the_empty_think_block(scripted):
    engine, client = scripted.engine, scripted.client
    r = client.messages.create(model="scripted", max_tokens=50, messages=[{"role": "user", "content": "hi"}],
                               thinking=NO_THINK)
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert blocks(r) == [("text", "Hello there!")] and r.stop_reason == "end_turn"


def test_thinking_budget_reaches_the_engine(scripted):
    engine, client = scripted.engine, scripted.client
    r = client.messages.create(model="scripted", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 7})
    assert engine.params[-1].thinking_token_budget == 7 and blocks(r)[0][0] == "thinking"
    client.messages.create(model="scripted", max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    assert engine.params[-1].thinking_token_budget is None
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens .* must be less than max_tokens"):
        client.messages.create(model="scripted", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 100})


def test_tool_use_over_two_turns_whole_and_streamed(scripted):
    engine, client = scripted.engine, scripted.client
    r = client.messages.create(model="scripted", max_tokens=200, messages=ASK_WEATHER, tools=WEATHER_TOOLS)
    assert '"name": "get_weather"' in engine.prompts[-1]
    assert blocks(r) == [("thinking", "The user wants the weather.", digest("The user wants the weather.")),
                         ("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_time", {})]
    assert r.stop_reason == "tool_use" and all(b.id.startswith("toolu_") for b in r.content[1:])
    with client.messages.stream(model="scripted", max_tokens=200, messages=ASK_WEATHER,
                                tools=WEATHER_TOOLS) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert blocks(final) == blocks(r) and final.stop_reason == "tool_use"
    assert kinds.count("input_json_delta") == 2

    # the second turn: the answer sent back, with the tools' results
    calls = [b for b in r.content if b.type == "tool_use"]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": r.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18C and sunny"},
            {"type": "tool_result", "tool_use_id": calls[1].id, "content": [{"type": "text", "text": "noon"}],
             "is_error": True},
            {"type": "text", "text": "Thanks!"}]}]
    r2 = client.messages.create(model="scripted", max_tokens=200, messages=history, tools=WEATHER_TOOLS)
    prompt = engine.prompts[-1]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt)
    # the assistant turn (before the last user query: the template drops its reasoning)
    assert "<tool_response>\n18C and sunny\n</tool_response>\n<tool_response>\nError: noon\n</tool_response>" \
        in prompt and prompt.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert blocks(r2) == [("thinking", "Got it.", digest("Got it.")), ("text", "It is 18C in Paris.")]
    assert r2.stop_reason == "end_turn"
    # the reasoning of an assistant turn after the last user query is rendered (reasoning_content)
    history = ASK_WEATHER + [{"role": "assistant", "content": r.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18C"}]}]
    client.messages.create(model="scripted", max_tokens=200, messages=history, tools=WEATHER_TOOLS)
    assert "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>" in engine.prompts[-1]

    # tool_choice none: the template gets no tools, and a call the model writes anyway stays text
    r = client.messages.create(model="scripted", max_tokens=200, messages=ASK_WEATHER, tools=WEATHER_TOOLS,
                               tool_choice={"type": "none"})
    assert "# Tools" not in engine.prompts[-1] and r.stop_reason == "end_turn"
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[1].text == CALLS


def test_blocks_keep_the_answers_order(scripted):
    """Text, a call, then text: three blocks in that order, whole and streamed (chunk 3 splits the tags)."""
    client = scripted.client
    kwargs = dict(model="scripted", max_tokens=200, tools=WEATHER_TOOLS,
                  messages=[{"role": "user", "content": "check first"}])
    r = client.messages.create(**kwargs)
    expected = [("thinking", "A call.", digest("A call.")), ("text", "Let me check."),
                ("tool_use", "get_time", {}), ("text", "Done.")]
    assert blocks(r) == expected and r.stop_reason == "tool_use"
    for chunk in (1, 2, 5, 7):
        scripted.engine.chunk = chunk
        with client.messages.stream(**kwargs) as stream:
            assert blocks(stream.get_final_message()) == expected, chunk


def test_stop_sequences_and_one_call_only(scripted):
    engine, client = scripted.engine, scripted.client
    ask = [{"role": "user", "content": "count"}]
    r = client.messages.create(model="scripted", max_tokens=100, messages=ask, stop_sequences=["STOP", "Four"])
    assert engine.params[-1].stop == ["STOP", "Four"]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "STOP"
    assert blocks(r)[1:] == [("text", "One. Two. ")]
    with client.messages.stream(model="scripted", max_tokens=100, messages=ask, stop_sequences=["STOP"]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP" and blocks(final) == blocks(r)
    # auto with disable_parallel_tool_use: the answer ends with its first call
    r = client.messages.create(model="scripted", max_tokens=200, messages=ASK_WEATHER, tools=WEATHER_TOOLS,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert engine.params[-1].stop == ["</tool_call>"]
    assert blocks(r)[1:] == [("tool_use", "get_weather", {"city": "Paris"})] and r.stop_reason == "tool_use"
    r = client.messages.create(model="scripted", max_tokens=200, messages=ASK_WEATHER, tools=WEATHER_TOOLS)
    assert engine.params[-1].stop == [] and len(r.content) == 3


def test_count_tokens_is_the_prompt_messages_renders(scripted, tokenizer):
    engine, client = scripted.engine, scripted.client
    history = ASK_WEATHER + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]}]
    for extra in ({}, {"thinking": NO_THINK}, {"tools": WEATHER_TOOLS},
                  {"tools": WEATHER_TOOLS, "tool_choice": {"type": "none"}, "system": "Be brief."}):
        counted = client.messages.count_tokens(model="scripted", messages=history, **extra).input_tokens
        r = client.messages.create(model="scripted", max_tokens=20, messages=history, **extra)
        assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
        assert counted == len(tokenizer.encode(engine.prompts[-1])), extra
    with_tools = client.messages.count_tokens(model="scripted", messages=history, tools=WEATHER_TOOLS)
    assert with_tools.input_tokens > client.messages.count_tokens(model="scripted", messages=history).input_tokens
    # a prompt over the context is still counted (and refused by /v1/messages)
    long = [{"role": "user", "content": "word " * engine.max_model_len}]
    assert client.messages.count_tokens(model="scripted", messages=long).input_tokens > engine.max_model_len
    with pytest.raises(anthropic.BadRequestError, match="max_model_len"):
        client.messages.create(model="scripted", max_tokens=10, messages=long)


def test_max_tokens_stops_a_scripted_answer(scripted):
    # 4 scripted steps of 3 characters: "<think>\nHmm.", cut inside the reasoning
    r = scripted.client.messages.create(model="scripted", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 4
    assert blocks(r) == [("thinking", "Hmm.", digest("Hmm."))]


def test_errors_are_anthropic_shaped_with_the_sdk_classes(scripted):
    base, client = scripted.base, scripted.client
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="scripted", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.message and "'image'" in e.value.message
    with pytest.raises(anthropic.BadRequestError, match="a tool_use block does not belong in a user turn"):
        client.messages.create(model="scripted", max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
    with pytest.raises(anthropic.BadRequestError, match="'nope', which is not in tools"):
        client.messages.create(model="scripted", max_tokens=10, messages=hi, tools=WEATHER_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.BadRequestError, match='tool_choice "any" needs tools'):
        client.messages.create(model="scripted", max_tokens=10, messages=hi, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        client.messages.create(model="scripted", max_tokens=10, messages=hi, stop_sequences=[""])
    with pytest.raises(anthropic.BadRequestError, match="last message must be a user turn"):
        client.messages.create(model="scripted", max_tokens=10, messages=hi + [{"role": "assistant", "content": "x"}])
    # a body without max_tokens (the SDK would not send one)
    r = httpx.post(f"{base}/v1/messages", json={"model": "scripted", "messages": hi}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=hi)
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{base}/v1/messages", content=b"x" * (1 << 17), headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # the key: x-api-key or a bearer token; none or a wrong one is a 401
    for bad in (anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0),
                anthropic.Anthropic(base_url=base, api_key=None, auth_token="wrong", max_retries=0)):
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="scripted", max_tokens=10, messages=hi)
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model="scripted", messages=hi)
    r = httpx.post(f"{base}/v1/messages", json={"model": "scripted", "max_tokens": 5, "messages": hi})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=base, api_key=None, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="scripted", max_tokens=50, messages=hi).stop_reason == "end_turn"
    # the engine fails: a 500 api_error, or an error event in a stream
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="scripted", max_tokens=10, messages=[{"role": "user", "content": "FAIL"}])
    assert e.value.body["error"]["type"] == "api_error" and "scripted failure" in e.value.message
    with pytest.raises(anthropic.APIStatusError, match="scripted failure"):
        with client.messages.stream(model="scripted", max_tokens=10,
                                    messages=[{"role": "user", "content": "FAIL"}]) as stream:
            list(stream)
    # other routes keep OpenAI's shape, and take x-api-key too
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": hi, "max_tokens": 2}, headers={"x-api-key": "no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_a_full_queue_is_529_overloaded(scripted):
    engine, base, client = scripted.engine, scripted.base, scripted.client
    engine.gate.clear()  # the engine stalls: the first request waits, the second finds the queue full
    body = {"model": "scripted", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(client.messages.create, **body)
            deadline = time.monotonic() + 5
            while "nanoqwen_num_requests_waiting 1.0" not in httpx.get(f"{base}/metrics").text:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(anthropic.OverloadedError) as e:
                client.messages.create(**body)
        finally:
            engine.gate.set()
        assert first.result(timeout=10).stop_reason == "end_turn"
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    assert e.value.response.headers["retry-after"] == "1"


# ---------------------------------------------------------------- a real engine (random weights)


TOOLS = [
    {"name": "get_weather", "description": "Weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "get_time", "description": "Time in a zone",
     "input_schema": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                  "maximum": 12}},
                      "required": ["offset"], "additionalProperties": False}}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


def test_tool_choice_any_and_tool_force_calls_on_a_random_model(real):
    client = real.client
    for choice, names, most in (({"type": "any"}, set(SCHEMAS), None),
                                ({"type": "any", "disable_parallel_tool_use": True}, set(SCHEMAS), 1),
                                ({"type": "tool", "name": "get_time"}, {"get_time"}, 1)):
        kwargs = dict(model="tiny", max_tokens=300, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                      thinking=NO_THINK)
        r = client.messages.create(**kwargs)
        assert r.stop_reason == "tool_use", r.content
        assert r.content and all(b.type == "tool_use" for b in r.content)
        for b in r.content:
            assert b.name in names and b.id.startswith("toolu_")
            jsonschema.validate(b.input, SCHEMAS[b.name])
        assert most is None or len(r.content) == most
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and all(b.type == "tool_use" for b in final.content)
        assert_idle(real.base)
    # without tool_choice, the same random model writes no call
    r = client.messages.create(model="tiny", max_tokens=20, messages=ASK_WEATHER, tools=TOOLS, thinking=NO_THINK)
    assert r.stop_reason == "max_tokens" and all(b.type == "text" for b in r.content)
    assert_idle(real.base)


def test_max_tokens_and_stop_sequences_on_a_random_model(real):
    client = real.client
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Write a haiku about tea."}],
                  thinking=NO_THINK, extra_body={"temperature": 0})
    r = client.messages.create(max_tokens=3, **kwargs)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3 and r.stop_sequence is None
    full = client.messages.create(max_tokens=16, **kwargs).content[0].text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    r = client.messages.create(max_tokens=16, stop_sequences=[stop], **kwargs)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)]
    with client.messages.stream(max_tokens=16, stop_sequences=[stop], **kwargs) as stream:
        assert stream.get_final_message().stop_sequence == stop
    # a prompt seen before: its blocks come from the prefix cache
    again = client.messages.create(max_tokens=3, **kwargs)
    assert again.usage.cache_read_input_tokens > 0
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == client.messages.count_tokens(model="tiny", messages=kwargs["messages"],
                                            thinking=NO_THINK).input_tokens)
    assert_idle(real.base)


def test_messages_are_in_openapi(real):
    doc = httpx.get(f"{real.base}/openapi.json").json()
    create = doc["paths"]["/v1/messages"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessageCreateRequest")
    assert create["responses"]["200"]["content"].keys() == {"application/json", "text/event-stream"}
    assert create["responses"]["529"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicErrorResponse")
    count = doc["paths"]["/v1/messages/count_tokens"]["post"]
    assert count["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/MessageTokensCount")
    # the documented examples are valid requests that the server answers
    schema = {**create["requestBody"]["content"]["application/json"]["schema"], "components": doc["components"]}
    for example in create["requestBody"]["content"]["application/json"]["examples"].values():
        body = {**example["value"], "model": "tiny"}
        jsonschema.Draft202012Validator(schema).validate(body)
        assert httpx.post(f"{real.base}/v1/messages", json=body, timeout=60).status_code == 200
    assert_idle(real.base)



def test_thinking_budget_and_output_format_on_a_random_model(real, tokenizer):
    client = real.client
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    # a random model never closes its reasoning: the budget makes the engine write </think> after one token (the
    # model never wrote <think> either, so the parser reads it all as text)
    r = client.messages.create(model="tiny", max_tokens=12, messages=ask,
                               thinking={"type": "enabled", "budget_tokens": 1})
    text = r.content[0].text
    assert "</think>" in text and len(tokenizer.encode(text[:text.index("</think>")])) <= 2, text
    r = client.messages.create(model="tiny", max_tokens=12, messages=ask, thinking={"type": "adaptive"})
    assert "</think>" not in "".join(b.text for b in r.content if b.type == "text")
    # output_config.format: the text is JSON of the schema
    person = {"type": "object", "properties": {"name": {"enum": ["Ann", "Bob"]}, "age": {"enum": [30, 40]}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "schema": person}}
    for thinking in (NO_THINK, {"type": "enabled", "budget_tokens": 3}):
        r = client.messages.create(model="tiny", max_tokens=60, messages=ask, thinking=thinking, output_config=fmt)
        assert r.stop_reason == "end_turn", r.content
        jsonschema.validate(json.loads(r.content[-1].text.split("</think>")[-1]), person)
    with pytest.raises(anthropic.BadRequestError, match="both constrain the answer"):
        client.messages.create(model="tiny", max_tokens=60, messages=ask, output_config=fmt, tools=TOOLS,
                               tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match="nonsense"):
        client.messages.create(model="tiny", max_tokens=60, messages=ask,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "nonsense"}}})
    assert_idle(real.base)
