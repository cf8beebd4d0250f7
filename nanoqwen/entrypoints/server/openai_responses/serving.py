"""POST /v1/responses (OpenAI's Responses API), whole or streamed, and GET / DELETE of stored
responses.

A request goes the chat completions' way: its items (after the stored conversation of
`previous_response_id`, if given) become a ChatCompletionRequest (`instructions` as the system
message, function_call items as an assistant turn's tool_calls, function_call_output items as tool
messages, a reasoning item as the next assistant turn's reasoning_content, text.format as
response_format, reasoning.effort "none" or "minimal" as enable_thinking false), which chat.py renders
and structured.py constrains (tool_choice "required" or a named function, json_schema, json_object)
exactly as for /v1/chat/completions. One Generation runs it, and ChatOutputParser splits the answer
into a reasoning item, message items and function_call items.

Accepted with no effect: metadata (stored and echoed), user, service_tier (echoed as "default"),
include (nanoqwen has no encrypted reasoning or logprobs here to include), text.verbosity,
reasoning.summary (the reasoning item carries the reasoning text itself, with an empty summary),
a function's strict (arguments are held to its parameters whenever tool_choice forces a call), and
truncation "disabled" (what nanoqwen always does). Refused with a 400: truncation "auto", background,
conversation (protocol.ResponsesRequest.check_supported).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.background import BackgroundTask

from nanoqwen.entrypoints.server.chat import render_prompt
from nanoqwen.entrypoints.server.openai_responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from nanoqwen.entrypoints.server.openai_responses.store import StoredResponse
from nanoqwen.entrypoints.server.parsers import THINK_END, ChatOutputParser, ToolCall
from nanoqwen.entrypoints.server.protocol import APIError, ChatCompletionRequest
from nanoqwen.entrypoints.server.serving import Generation, ServerState
from nanoqwen.entrypoints.server.structured import structured_outputs
from nanoqwen.outputs import RequestOutput
from nanoqwen.sampling_params import SamplingParams

ITEMS = TypeAdapter(list[InputItem])
TEXT_PART_TYPES = ("input_text", "output_text", "text")
# what chat completions' errors call a field -> its name in the Responses API
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- the request as a chat request


def _text(content: str | list[TextPart], where: str) -> str:
    """A message's (or a function output's) text: its text parts joined."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise APIError(400, f"{where}.content[{j}]: part type {part.type!r} is not supported: "
                                "this model takes text only (input_text)", param="input")
    return "".join(part.text or "" for part in content)


def _messages(instructions: str | None, items: list[Any], first_new: int) -> list[dict[str, Any]]:
    """The chat messages of a conversation's items (items[first_new:] are the request's own input,
    which errors name by their index)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows

    def assistant(content: str) -> dict[str, Any]:
        nonlocal reasoning
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
        return message

    for i, item in enumerate(items):
        where = f"input[{i - first_new}]" if i >= first_new else "previous_response_id"
        if isinstance(item, MessageItem):
            text = _text(item.content, where)
            if item.role == "assistant":
                assistant(text)
            else:
                reasoning = None
                messages.append({"role": item.role, "content": text})
        elif isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning = (reasoning or "") + "".join(p.text for p in parts)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            # calls right after an assistant turn (its text, or other calls) belong to that turn
            last = messages[-1] if messages and messages[-1]["role"] == "assistant" and reasoning is None else None
            (last or assistant("")).setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": _text(item.output, where),
                             "tool_call_id": item.call_id})
    return messages


def chat_request(req: ResponsesRequest, items: list[Any], first_new: int) -> ChatCompletionRequest:
    """The request as /v1/chat/completions takes it: the one path both endpoints share."""
    body: dict[str, Any] = {
        "messages": _messages(req.instructions, items, first_new),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "chat_template_kwargs": {"enable_thinking": req.reasoning is None or req.reasoning.thinking}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            by_alias=True, exclude_none=True, include={"name", "description", "parameters"})}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = (choice if isinstance(choice, str) else
                               {"type": "function", "function": {"name": choice.name}})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if not body["messages"]:
        raise APIError(400, "input is empty: give at least one message", param="input")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # what chat completions refuse that the Responses models let by
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param="input") from None


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
    """Errors from the chat path name fields as the Responses API does (input, text,
    max_output_tokens)."""
    try:
        yield
    except APIError as e:
        if e.param in RESPONSES_NAMES:
            e.param = RESPONSES_NAMES[e.param]
            e.message = (e.message.replace("response_format", "text.format")
                         .replace("max_tokens", "max_output_tokens"))
        raise


# ---------------------------------------------------------------- output items and their events


class OutputBuilder:
    """The response's output items, built from the parser's (reasoning, content, tool calls) parts
    as they come, with the stream events that build them (numbered as they are sent).

    A streamed answer and a whole one go through the same builder, so they end with the same
    items."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item text still goes to
        self.reasoning_text = ""

    def add(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning_text += reasoning
            self._write("reasoning", reasoning, events)
        if self.open is None or self.open["type"] != "message":
            # a message starts at its first non-blank character (Qwen3 writes "\n\n" after </think>)
            content = content.lstrip()
        if content:
            self._write("message", content, events)
        for call in calls:
            self._close(events, "completed")
            item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.id, "name": call.name, "arguments": ""}
            index = len(self.items)
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": dict(item)})
            head = {"item_id": item["id"], "output_index": index}
            events.append({"type": "response.function_call_arguments.delta", **head,
                           "delta": call.arguments})
            events.append({"type": "response.function_call_arguments.done", **head,
                           "name": call.name, "arguments": call.arguments})
            item.update(status="completed", arguments=call.arguments)
            self.items.append(item)
            events.append({"type": "response.output_item.done", "output_index": index,
                           "item": dict(item)})
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the last item; an answer with no item at all gets an empty message."""
        events: list[dict[str, Any]] = []
        if not self.items and self.open is None:
            self._open("message", events)
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    def _write(self, kind: str, text: str, events: list[dict[str, Any]]) -> None:
        if self.open is None or self.open["type"] != kind:
            self._close(events, "completed")
            self._open(kind, events)
        assert self.open is not None
        self.open["text"] += text
        head = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", **head, "delta": text})
        else:
            events.append({"type": "response.output_text.delta", **head, "delta": text,
                           "logprobs": []})

    def _open(self, kind: str, events: list[dict[str, Any]]) -> None:
        self.open = {"type": kind, "id": _new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
        item = self._item(status="in_progress", parts=[])
        events.append({"type": "response.output_item.added", "output_index": len(self.items),
                       "item": item})
        events.append({"type": "response.content_part.added", "item_id": self.open["id"],
                       "output_index": len(self.items), "content_index": 0, "part": self._part()})

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        if self.open is None:
            return
        head = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        text = self.open["text"]
        if self.open["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", **head, "text": text})
        else:
            events.append({"type": "response.output_text.done", **head, "text": text,
                           "logprobs": []})
        part = self._part(text)
        events.append({"type": "response.content_part.done", **head, "part": part})
        item = self._item(status=status, parts=[part])
        events.append({"type": "response.output_item.done", "output_index": len(self.items),
                       "item": item})
        self.items.append(self._item(status=status, parts=[dict(part)]))
        self.open = None

    def _part(self, text: str = "") -> dict[str, Any]:
        assert self.open is not None
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.open is not None
        if self.open["type"] == "reasoning":  # OpenAI's reasoning items carry no status
            return {"id": self.open["id"], "type": "reasoning", "summary": [], "content": parts}
        return {"id": self.open["id"], "type": "message", "role": "assistant", "status": status,
                "content": parts}


# ---------------------------------------------------------------- one response


class ResponseRun:
    """One /v1/responses request: its conversation, its Generation, and the response object it
    makes (and stores)."""

    def __init__(self, state: ServerState, req: ResponsesRequest, items: list[Any],
                 params: SamplingParams, gen: Generation, parser: ChatOutputParser) -> None:
        self.state, self.req, self.items, self.params = state, req, items, params
        self.gen, self.parser = gen, parser
        self.builder = OutputBuilder()

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice or "auto"
        return {
            "id": self.gen.id, "object": "response", "created_at": self.gen.created,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "metadata": req.metadata or {},
            "model": self.gen.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "service_tier": "default", "store": req.store,
            # what sampling used: the request's, or the model's defaults
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                                else {"type": "text"})},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(by_alias=True) for t in req.tools or []],
            "top_logprobs": 0, "truncation": "disabled", "usage": usage, "user": req.user}

    def finish(self, out: RequestOutput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the events that close the output, the finished response, stored if `store`)."""
        c = out.outputs[0]
        incomplete = c.finish_reason == "length"
        events = self.builder.finish(incomplete)
        self.label(c.finish_reason)
        prompt, generated = len(out.prompt_token_ids), len(c.token_ids)
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": generated,
                 "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(c.text, c.token_ids)},
                 "total_tokens": prompt + generated}
        response = self.response("incomplete" if incomplete else "completed", self.builder.items, usage)
        if self.req.store:
            self.state.responses.put(StoredResponse(response, self.items))
        return events, response

    def label(self, finish_reason: str | None) -> None:
        """The finish reason metrics and the log line count, as chat completions name it."""
        self.gen.finish_label = ("tool_calls" if self.parser.tool_calls and finish_reason != "length"
                                 else finish_reason or "stop")

    def _reasoning_tokens(self, text: str, token_ids: list[int]) -> int:
        """The answer's tokens up to its </think>: all of them if it ended inside the block."""
        reasoning = self.parser.reasoning
        if reasoning is None or not self.builder.reasoning_text and reasoning.mode != "reasoning":
            return 0
        if reasoning.mode == "reasoning":
            return len(token_ids)
        tokenizer = self.state.engine.tokenizer
        end = tokenizer.token_to_id(THINK_END)
        if end is not None and end in token_ids:
            return token_ids.index(end) + 1
        # </think> written as ordinary tokens: the reasoning's text counted in tokens
        head = text[:text.find(THINK_END) + len(THINK_END)]
        return min(len(token_ids), len(tokenizer.encode(head)))


async def create_response(state: ServerState, http: Request, req: ResponsesRequest) -> Any:
    req.check_supported()
    history: list[Any] = []
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id, param="previous_response_id")
        history = previous.input_items + ITEMS.validate_python(previous.response["output"])
    new = ([MessageItem(role="user", content=req.input)] if isinstance(req.input, str)
           else list(req.input))
    items = history + new
    engine = state.engine
    with _responses_names():
        chat = chat_request(req, items, len(history))
        token_ids, thinking, in_reasoning = await asyncio.to_thread(render_prompt, state, chat)
        constraint, field = structured_outputs(chat, engine.tokenizer)
        params = chat.sampling_params(engine.input_processor.default_sampling_params(),
                                      chat.max_completion_tokens, None, len(token_ids),
                                      engine.max_model_len, constraint)
        gen = Generation(state, http, "resp")
        gen.id = _new_id("resp")  # OpenAI's form of a response id
        await gen.start(token_ids, params, RESPONSES_NAMES.get(field or "", field))
    run = ResponseRun(state, req, items, params, gen,
                      ChatOutputParser(thinking, in_reasoning, chat.tools_enabled))
    if req.stream:
        return StreamingResponse(_stream(run), media_type="text/event-stream",
                                 background=BackgroundTask(gen.aclose))
    out = await gen.final()
    run.builder.add(*run.parser.feed(out.outputs[0].text))
    run.builder.add(*run.parser.finish())
    _, response = run.finish(out)
    gen.record()
    return JSONResponse(response)


async def _stream(run: ResponseRun) -> AsyncIterator[str]:
    numbers = itertools.count()

    def event(fields: dict[str, Any]) -> str:
        body = {"type": fields["type"], "sequence_number": next(numbers), **fields}
        return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    started = run.response("in_progress", [])
    yield event({"type": "response.created", "response": started})
    yield event({"type": "response.in_progress", "response": started})
    try:
        sent, last = "", None
        async for last in run.gen.outputs():
            c = last.outputs[0]
            delta, sent = c.text[len(sent):], c.text
            events = run.builder.add(*run.parser.feed(delta))
            if c.finish_reason is not None:
                events += run.builder.add(*run.parser.finish())
                run.label(c.finish_reason)
            for e in events:
                yield event(e)
        assert last is not None and last.finished
        events, response = run.finish(last)
        for e in events:
            yield event(e)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event({"type": kind, "response": response})
    except APIError as e:
        # the engine failed mid-stream: the status is already sent, so say it in the stream
        failed = run.response("failed", run.builder.items)
        failed["error"] = {"code": e.code or e.type, "message": e.message}
        yield event({"type": "response.failed", "response": failed})


def get_response(state: ServerState, response_id: str) -> dict[str, Any]:
    return state.responses.get(response_id).response


def delete_response(state: ServerState, response_id: str) -> dict[str, Any]:
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
