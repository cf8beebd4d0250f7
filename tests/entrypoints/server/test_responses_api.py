"""OpenAI's Responses API (/v1/responses) with the real `openai` SDK and OpenAI's Agents SDK: text, reasoning on
and off, function tools over two turns (previous_response_id, and the items sent again), text.format json_schema
parsed with pydantic, tool_choice "required", streamed events, GET / DELETE, the store's bound, max_output_tokens.

ScriptedEngine answers what a random model cannot show (reasoning and tool-call parsing, exact prompts); a random
tiny checkpoint shows what the constraints enforce (its free output is gibberish, so a valid call or valid JSON is
the grammar's doing). Every generation is bounded and every test leaves the engine idle.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Literal

import agents
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from server_testing import ScriptedEngine, serve_app, wait_idle

from nanoqwen import LLM
from nanoqwen.entrypoints.server import build_app
from nanoqwen.entrypoints.server.openai_responses.store import ResponseStore
from nanoqwen.tokenizer import Tokenizer

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]
NO_THINK = {"effort": "none"}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object",
                               "properties": {"city": {"type": "string", "maxLength": 10}},
                               "required": ["city"], "additionalProperties": False},
                "strict": True}
THOUGHT = "\nThe user wants the weather.\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# llguidance: JSON with no optional whitespace, so a random model's object must end
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}}


def script(prompt: str) -> str:
    """The scripted model: a final answer after a tool result, a call when asked about the weather, plain text with
    thinking off, else a thought and a greeting."""
    last = prompt.split("<|im_start|>user")[-1]  # (Qwen3's template writes tool results as a user turn)
    if "<tool_response>" in last:
        return "<think>\nGot it.\n</think>\n\nIt is sunny in Paris."
    if prompt.endswith("</think>\n\n"):  # the template's empty think block: thinking off
        return "Plain hello."
    if "weather" in last:
        return f"<think>{THOUGHT}</think>\n\n{CALL}"
    return "<think>\nHmm.\n</think>\n\nHello there!"


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def scripted(model_dir):
    engine = ScriptedEngine(Tokenizer.from_pretrained(model_dir), script)
    app = build_app(engine, "scripted")
    with serve_app(app) as base:
        yield SimpleNamespace(engine=engine, state=app.state.server, base=base,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0))


@pytest.fixture(scope="module")
def random_model(model_dir):
    engine = LLM(model_dir, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                 seed=0).llm_engine
    with serve_app(build_app(engine, "tiny")) as base:
        yield SimpleNamespace(engine=engine, base=base,
                              client=openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                                   timeout=120))


def idle(base: str) -> None:
    m = wait_idle(base)
    assert m["nanoqwen_num_requests_running"] == 0 and m["nanoqwen_num_requests_waiting"] == 0
    assert m["nanoqwen_kv_cache_used_blocks"] == 0


def test_text_with_reasoning_whole_and_streamed(scripted):
    client = scripted.client
    r = client.responses.create(model="scripted", input="Say hi.", instructions="Be kind.",
                                metadata={"k": "v"}, max_output_tokens=100)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.incomplete_details is None and r.model == "scripted" and r.metadata == {"k": "v"}
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == "\nHmm.\n"
    assert reasoning.summary == [] and reasoning.id.startswith("rs_")
    assert message.role == "assistant" and message.status == "completed"
    assert r.output_text == "Hello there!" and message.content[0].annotations == []
    prompt = scripted.engine.prompts[-1]
    assert prompt.startswith("<|im_start|>system\nBe kind.<|im_end|>") and "Say hi." in prompt
    usage = r.usage
    assert usage.output_tokens == len("<think>\nHmm.\n</think>\n\nHello there!") // 3 + 1  # 3 chars a step
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens == len(scripted.engine.tokenizer.encode(prompt))
    assert scripted.engine.params[-1].max_tokens == 100

    with client.responses.stream(model="scripted", input="Say hi.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = {kind: [e.delta for e in events if e.type == kind]
              for kind in ("response.reasoning_text.delta", "response.output_text.delta")}
    assert len(deltas["response.output_text.delta"]) > 1  # streamed in pieces, not at the end
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert "".join(deltas["response.reasoning_text.delta"]) == "\nHmm.\n"
    assert "".join(deltas["response.output_text.delta"]) == "Hello there!"
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.output_text == "Hello there!" and final.output[0].content[0].text == "\nHmm.\n"
    assert [item.model_dump(exclude={"id"}, exclude_none=True) for item in final.output] == [
        item.model_dump(exclude={"id"}, exclude_none=True) for item in r.output]
    # SSE as OpenAI frames it: an event line naming each data line's type, no [DONE]
    with httpx.stream("POST", f"{scripted.base}/v1/responses", json={"input": "Say hi.", "stream": True}) as raw:
        text = raw.read().decode()
    frames = [frame.split("\n") for frame in text.strip().split("\n\n")]
    assert all(f[0] == f"event: {json.loads(f[1].removeprefix('data: '))['type']}" for f in frames)
    assert "[DONE]" not in text
    idle(scripted.base)


def test_reasoning_effort_none_turns_thinking_off(scripted):
    r = scripted.client.responses.create(model="scripted", input="Say hi.", reasoning={"effort": "none"})
    assert [item.type for item in r.output] == ["message"] and r.output_text == "Plain hello."
    assert scripted.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.reasoning.effort == "none"
    r = scripted.client.responses.create(model="scripted", input="Say hi.", reasoning={"effort": "high"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    idle(scripted.base)


def test_function_tools_over_two_turns_stored_and_resent(scripted):
    client, engine = scripted.client, scripted.engine
    question = "What is the weather in Paris?"
    first = client.responses.create(model="scripted", input=question, tools=[WEATHER_TOOL],
                                    instructions="Use tools.")
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed" and call.id.startswith("fc_")
    assert '"name": "get_weather"' in engine.prompts[-1] and first.output_text == ""
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}

    second = client.responses.create(model="scripted", previous_response_id=first.id, input=[result],
                                     tools=[WEATHER_TOOL], instructions="Use tools.")
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    by_id = engine.prompts[-1]
    assert question in by_id and '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in by_id
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in by_id
    # the first turn's reasoning stays in the prompt: Qwen3 keeps it for a turn after the last user message
    assert f"<think>{THOUGHT}</think>" in by_id.split(question)[-1]

    # the same conversation sent whole (nothing stored): the very same prompt
    items = [{"role": "user", "content": question},
             *[item.model_dump(exclude_none=True) for item in first.output], result]
    resent = client.responses.create(model="scripted", input=items, tools=[WEATHER_TOOL],
                                     instructions="Use tools.", store=False)
    assert engine.prompts[-1] == by_id and resent.output_text == second.output_text
    assert httpx.get(f"{scripted.base}/v1/responses/{resent.id}").status_code == 404  # store=False

    # a third turn continues the chain: both earlier turns are in the prompt
    third = client.responses.create(model="scripted", previous_response_id=second.id, input="Thanks!")
    assert question in engine.prompts[-1] and "It is sunny in Paris." in engine.prompts[-1]
    assert third.output_text == "Hello there!"

    # streamed: the call arrives as function_call_arguments events
    with client.responses.stream(model="scripted", input=question, tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert [e.type for e in args] == ["response.function_call_arguments.delta",
                                      "response.function_call_arguments.done"]
    assert json.loads(args[-1].arguments) == {"city": "Paris"}
    assert final.output[1].type == "function_call" and final.output[1].arguments == args[-1].arguments
    idle(scripted.base)


def test_cut_inside_the_think_block_is_a_reasoning_item_alone(scripted):
    r = scripted.client.responses.create(model="scripted", input="Say hi.", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["reasoning"] and r.output[0].content[0].text == "\nHmm."
    assert r.usage.output_tokens == r.usage.output_tokens_details.reasoning_tokens == 4
    idle(scripted.base)


def test_get_delete_and_404(scripted):
    client = scripted.client
    r = client.responses.create(model="scripted", input="Say hi.", metadata={"tag": "x"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"tag": "x"}
    with client.responses.stream(model="scripted", input="Say hi.") as stream:  # a streamed one is stored too
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text == "Hello there!"
    deleted = httpx.delete(f"{scripted.base}/v1/responses/{r.id}")
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model="scripted", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found" and r.id in e.value.body["message"]
    assert e.value.body["param"] == "previous_response_id"
    idle(scripted.base)


def test_store_keeps_the_newest_evicting_least_recently_used(scripted):
    client, state = scripted.client, scripted.state
    saved, state.responses = state.responses, ResponseStore(max_responses=2)
    try:
        a, b = (client.responses.create(model="scripted", input="Say hi.") for _ in range(2))
        client.responses.retrieve(a.id)  # a is now more recent than b
        c = client.responses.create(model="scripted", input="Say hi.")
        assert len(state.responses) == 2
        assert client.responses.retrieve(a.id).id == a.id and client.responses.retrieve(c.id).id == c.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(b.id)
    finally:
        state.responses = saved
    with pytest.raises(ValueError, match="max_responses"):
        ResponseStore(0)
    idle(scripted.base)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "input_image"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input", "not an input item"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "not in tools"),
    ({"input": []}, "input", "empty"),
])
def test_bad_requests_are_400_naming_the_field(scripted, body, param, words):
    r = httpx.post(f"{scripted.base}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    idle(scripted.base)


# ---------------------------------------------------------------- a random model: what the constraints enforce


class Person(BaseModel):
    model_config = ConfigDict(json_schema_extra=COMPACT)
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    sky: Literal["clear", "rain"]


def test_text_format_json_schema_parsed_with_pydantic(random_model):
    r = random_model.client.responses.parse(model="tiny", input="Describe a person.", text_format=Person,
                                            reasoning=NO_THINK, max_output_tokens=200)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
    assert len(r.output_parsed.name) <= 8 and r.text.format.type == "json_schema"
    # streamed, as a raw schema
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    with random_model.client.responses.stream(model="tiny", input="Describe a person.", text={"format": fmt},
                                              reasoning=NO_THINK, max_output_tokens=200) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), schema)
    # no format: gibberish, not JSON
    r = random_model.client.responses.create(model="tiny", input="Describe a person.", reasoning=NO_THINK,
                                             max_output_tokens=20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.output_text)
    idle(random_model.base)


def test_a_schema_that_does_not_compile_is_a_400_naming_text(random_model):
    fmt = {"type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}
    r = httpx.post(f"{random_model.base}/v1/responses", json={"input": "x", "text": {"format": fmt}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    idle(random_model.base)


def test_tool_choice_required_forces_a_call(random_model):
    time_tool = {"type": "function", "name": "get_time", "description": "Time in a zone",
                 "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                             "maximum": 12}},
                                "required": ["offset"], "additionalProperties": False}}
    for choice, names, parallel in (("required", {"get_weather", "get_time"}, False),
                                    ({"type": "function", "name": "get_time"}, {"get_time"}, None)):
        r = random_model.client.responses.create(model="tiny", input="What is the weather?",
                                                 tools=[WEATHER_TOOL, time_tool], tool_choice=choice,
                                                 parallel_tool_calls=parallel, reasoning=NO_THINK,
                                                 max_output_tokens=300)
        calls = [item for item in r.output if item.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].name in names
        tool = WEATHER_TOOL if calls[0].name == "get_weather" else time_tool
        jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    # without a constraint the random model calls nothing
    r = random_model.client.responses.create(model="tiny", input="What is the weather?", tools=[WEATHER_TOOL],
                                             reasoning=NO_THINK, max_output_tokens=20)
    assert not [item for item in r.output if item.type == "function_call"]
    idle(random_model.base)


def test_max_output_tokens_makes_it_incomplete(random_model):
    client = random_model.client
    r = client.responses.create(model="tiny", input="Tell a story.", reasoning=NO_THINK, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[-1].status == "incomplete" and r.max_output_tokens == 5
    with client.responses.stream(model="tiny", input="Tell a story.", reasoning=NO_THINK,
                                 max_output_tokens=4) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 4
    idle(random_model.base)


def test_agents_sdk_loop_with_a_forced_tool_call(scripted, monkeypatch):
    """OpenAI's Agents SDK runs its loop against the server: a call forced by tool_choice, the tool, the
    function_call_output sent back, a final answer. (Scripted: a random model would not end its second, unforced
    turn, which the SDK's reset_tool_choice leaves on "auto"; the grammar the force makes reaches the engine.)"""
    engine = scripted.engine
    # ScriptedEngine compiles no grammars: what matters here is that the forced call's grammar is asked for
    monkeypatch.setattr(engine, "prepare_request", lambda params: None, raising=False)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{scripted.base}/v1", api_key="none", max_retries=0, timeout=60)
    model = agents.OpenAIResponsesModel(model="scripted", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200))
    first = len(engine.params)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert calls == ["Paris"] and result.final_output == "It is sunny in Paris."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item",
                     "message_output_item"]
    forced, answered = engine.params[first:]
    assert "get_weather" in forced.structured_outputs.grammar  # tool_choice "required" as a grammar
    assert answered.structured_outputs is None  # the SDK's reset_tool_choice: "auto" on the next turn
    assert "<tool_response>\nsunny\n</tool_response>" in engine.prompts[-1]
    idle(scripted.base)
