"""Structured outputs through the server, with the real `openai` client: response_format
(json_schema, json_object), the openai client's parse() with a pydantic model, vLLM's
structured_outputs and guided_* fields, tool_choice "required" / a named tool, thinking on and
off, 400s for constraints that cannot be compiled, and compiling off the event loop.

The server runs in-process under uvicorn (so a test can slow the engine's compile step) on a
random tiny checkpoint: its unconstrained output is gibberish, so valid output is the constraint's
doing. Schemas are bounded (maxLength, enum, maximum) and JSON whitespace compact where an answer
must end, since a random model may otherwise write a string or whitespace forever.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_testing import serve_app

from nanoqwen import LLM
from nanoqwen.entrypoints.server import build_app
from nanoqwen.entrypoints.server.chat import render_prompt
from nanoqwen.entrypoints.server.protocol import ChatCompletionRequest
from nanoqwen.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(180)
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 10},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Time in a zone",
        "parameters": {"type": "object",
                       "properties": {"offset": {"type": "integer", "minimum": -12,
                                                 "maximum": 12}},
                       "required": ["offset"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "description": "No arguments"}},
]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters",
                                                       {"type": "object", "maxProperties": 0})
              for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(checkpoint):
    """A real engine behind the app, served by uvicorn in a thread."""
    engine = LLM(checkpoint("tiny", dtype="float32"), dtype="float32", device="cpu",
                 max_model_len=1024, kv_cache_memory=32 << 20, seed=0).llm_engine
    app = build_app(engine, "tiny")
    with serve_app(app) as base:
        yield SimpleNamespace(engine=engine, state=app.state.server, base=base)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=120)


def still_serves(served) -> None:
    r = httpx.post(f"{served.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def accepts(served, params: StructuredOutputsParams, text: str) -> bool:
    """Whether text is a prefix of what params allow (for answers cut by max_tokens)."""
    matcher = served.engine.grammar_compiler.compile(params).deep_copy()
    return matcher.consume_tokens(served.engine.tokenizer.encode(text))


def test_response_format_json_schema_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, seed=1,
                                       response_format=fmt, extra_body={**NO_THINK, **COMPACT})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, seed=2,
                                            response_format=fmt, stream=True,
                                            extra_body={**NO_THINK, **COMPACT})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.delta.content or "" for c in chunks)), PERSON)


def test_response_format_json_object_and_text(served, client):
    # Any JSON object: a random model's keys may run on, so an answer cut by max_tokens must be
    # the start of one.
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, seed=0,
                                       response_format={"type": "json_object"},
                                       extra_body=NO_THINK)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{") and accepts(served, StructuredOutputsParams(json_object=True), text)
    assert not accepts(served, StructuredOutputsParams(json_object=True), "x" + text)
    # "text" is no constraint: gibberish
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, seed=0,
                                       response_format={"type": "text"}, extra_body=NO_THINK)
    assert not accepts(served, StructuredOutputsParams(json_object=True),
                       r.choices[0].message.content)


class Weather(BaseModel):
    city: str = Field(max_length=10)
    celsius: int = Field(ge=-40, le=50)
    sky: Literal["clear", "cloudy", "rain"]


def test_openai_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(model="tiny", messages=WEATHER, response_format=Weather,
                                           max_tokens=200, seed=3,
                                           extra_body={**NO_THINK, **COMPACT})
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and r.choices[0].finish_reason == "stop"
    assert len(parsed.city) <= 10 and -40 <= parsed.celsius <= 50


@pytest.mark.parametrize("constraint,check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
     lambda t: t in ("alpha", "beta", "gamma")),
    ({"structured_outputs": {"grammar": 'start: ("hi" | "hello") " " NAME\nNAME: /[a-z]{1,6}/'}},
     lambda t: re.fullmatch(r"(hi|hello) [a-z]{1,6}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"(ab|cd){1,3}!"}, lambda t: re.fullmatch(r"(ab|cd){1,3}!", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}, **COMPACT},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
], ids=["regex", "choice", "lark", "gbnf", "guided_regex", "guided_json"])
def test_completions_structured_outputs(client, constraint, check):
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, n=2, seed=4,
                                  extra_body=constraint)
    for c in r.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text
    stream = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, seed=5,
                                       stream=True, extra_body=constraint)
    chunks = [c.choices[0] for c in stream]
    assert chunks[-1].finish_reason == "stop" and check("".join(c.text for c in chunks))


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named(client):
    offered = {t["function"]["name"] for t in TOOLS}
    r = client.chat.completions.create(model="tiny", messages=WEATHER, tools=TOOLS,
                                       tool_choice="required", max_tokens=300, seed=6,
                                       extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message.tool_calls, offered)
    r = client.chat.completions.create(model="tiny", messages=WEATHER, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=300, seed=7, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    for name in ("get_time", "ping"):
        r = client.chat.completions.create(
            model="tiny", messages=WEATHER, tools=TOOLS, max_tokens=300, seed=8,
            tool_choice={"type": "function", "function": {"name": name}}, extra_body=NO_THINK)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        check_calls(calls, {name})


def test_tool_calls_streamed(client):
    for tool_choice, names in (("required", {t["function"]["name"] for t in TOOLS}),
                               ({"type": "function", "function": {"name": "get_weather"}},
                                {"get_weather"})):
        stream = client.chat.completions.create(model="tiny", messages=WEATHER, tools=TOOLS,
                                                tool_choice=tool_choice, max_tokens=300, seed=9,
                                                stream=True, extra_body=NO_THINK)
        chunks = [c.choices[0] for c in stream if c.choices]
        calls = [call for c in chunks for call in c.delta.tool_calls or []]
        assert [c.index for c in calls] == list(range(len(calls)))  # each whole, in one delta
        assert chunks[-1].finish_reason == "tool_calls"
        assert not "".join(c.delta.content or "" for c in chunks)
        check_calls(calls, names)


def test_thinking_on_constrains_after_think_off_from_the_first_token(served, client):
    # Engine side: thinking on, the prompt ends with the assistant header, so the answer starts
    # free (reasoning) until </think>; thinking off, constrained from the first token.
    params = StructuredOutputsParams(choice=["yes", "no"])
    for thinking in (True, False):
        req = ChatCompletionRequest.model_validate(
            {"messages": WEATHER, "chat_template_kwargs": {"enable_thinking": thinking}})
        token_ids, _, _ = render_prompt(served.state, req)
        state = served.engine.grammar_compiler.new_state(params, token_ids)
        assert state.reasoning is thinking and (state.bitmask() is None) is thinking
    # Through the server: a random model does not close </think>, so with thinking on the answer
    # runs free to max_tokens; with thinking off it is one of the choices at once.
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    r = client.chat.completions.create(model="tiny", messages=WEATHER, max_tokens=8, seed=10,
                                       extra_body=body)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    r = client.chat.completions.create(model="tiny", messages=WEATHER, max_tokens=8, seed=10,
                                       extra_body={**body, **NO_THINK})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content in ("yes", "no")


CHAT = {"messages": WEATHER}
BAD = [  # (path, body, param, words in the message)
    ("/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ("/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format", "needs a json_schema"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a(b"}},
     "structured_outputs", "unclosed group"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: missing"}},
     "structured_outputs", "missing"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": 'root ::= "a" | undefined_rule'},
     "guided_grammar", "undefined_rule"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}},
     "structured_outputs", "choice"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs", "structural_tag"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a+"}},
     "structured_outputs", "one structured-output constraint, not 2"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a"},
     "guided_regex", "one structured-output constraint, not 2"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}},
     "tool_choice", "response_format, tool_choice"),
    ("/v1/chat/completions",
     {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not in tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions",
     {**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
         "name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}]},
     "tools", '"not"'),
]


@pytest.mark.parametrize("path,body,param,words", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_problem(served, path, body, param, words):
    r = httpx.post(f"{served.base}{path}", json={**body, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    still_serves(served)


def test_compiling_does_not_block_other_requests(served, monkeypatch):
    """A compile that lasts until another request's stream has sent three more chunks: it ends (and the
    constrained request is answered) only if the stream kept going meanwhile, which it could not if the
    compile held the event loop."""
    engine = served.engine
    prepare = engine.prepare_request
    compiling, streamed_meanwhile = threading.Event(), threading.Event()

    def slow_prepare(params):
        compiling.set()
        streamed_meanwhile.wait(timeout=120)
        return prepare(params)

    monkeypatch.setattr(engine, "prepare_request", slow_prepare)

    def constrained() -> httpx.Response:
        return httpx.post(f"{served.base}/v1/completions", timeout=180, json={
            "prompt": "Pick:", "max_tokens": 8, "structured_outputs": {"choice": ["red", "blue"]}})

    during = 0
    # long enough to outlast the compile; closed once the other is answered
    body = {"prompt": "Tell me a story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", f"{served.base}/v1/completions",
                                                     json=body, timeout=180) as stream:
        slow = None
        for line in stream.iter_lines():
            if not line:
                continue
            if slow is None:
                slow = pool.submit(constrained)
            elif compiling.is_set() and not streamed_meanwhile.is_set():
                during += 1
                if during == 3:
                    streamed_meanwhile.set()
            elif slow.done():
                break
        r = slow.result(timeout=180)
    assert streamed_meanwhile.is_set(), f"{during} chunks while the compile ran"
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("red", "blue")
