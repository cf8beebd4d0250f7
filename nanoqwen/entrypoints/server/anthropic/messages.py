"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the path chat completions take
(the chat template renders the conversation, one Generation runs it, ChatOutputParser splits Qwen3's answer into
reasoning, text and tool calls), answered as Anthropic's content blocks, whole or as its server-sent events.

Anthropic's fields map onto the engine's: system and the turns' blocks onto the template's messages (tool_use
blocks as tool_calls, tool_result blocks as "tool" messages, thinking blocks as reasoning_content); `thinking`
onto the template's enable_thinking and SamplingParams.thinking_token_budget; tool_choice "any" and "tool" onto
structured.py's tool-call grammar, output_config.format onto a JSON schema constraint; stop_sequences onto
SamplingParams.stop. Errors on these routes are in
Anthropic's shape (protocol.anthropic_error), which api.py's handlers give them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from nanoqwen.entrypoints.server.anthropic.protocol import (
    AnthropicErrorResponse,
    MessageCountTokensRequest,
    MessageCreateRequest,
    ThinkingConfigEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceTool,
    anthropic_error,
)
from nanoqwen.entrypoints.server.chat import RenderedPrompt, render_template
from nanoqwen.entrypoints.server.openapi import ApiDoc
from nanoqwen.entrypoints.server.parsers import TOOL_END, ChatOutputParser, ToolCall
from nanoqwen.entrypoints.server.protocol import APIError
from nanoqwen.entrypoints.server.serving import Generation, ServerState
from nanoqwen.entrypoints.server.structured import tool_calls_grammar
from nanoqwen.errors import InvalidRequestError
from nanoqwen.outputs import CompletionOutput, RequestOutput
from nanoqwen.sampling_params import SamplingParams, StructuredOutputsParams

MESSAGES_PATH = "/v1/messages"
API_KEY_HEADER = "apiKeyAuth"
# what the Messages routes answer besides 200 (and 401 with an API key, 500): nanoqwen's 503 is Anthropic's 529
ERRORS = {
    400: "Invalid request: a body that is not JSON or breaks the schema, a value out of range, a prompt over "
         "the context, or a model that does not generate",
    401: "Missing or wrong API key (send 'x-api-key: <key>' or 'Authorization: Bearer <key>')",
    404: "`model` names a model this server does not serve",
    413: "The body is larger than the server's --max-body-bytes",
    500: "The engine failed",
    529: "Overloaded: too many requests wait (--max-waiting; see Retry-After), or the engine is not running",
}
EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
          "message_stop", "ping", "error")
QUESTION = "What is the capital of France?"
EXAMPLES = {
    "message": {"model": "MODEL", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}]},
    "streamed, with a system prompt, without thinking": {
        "model": "MODEL", "max_tokens": 16, "system": "Answer briefly.", "stream": True,
        "thinking": {"type": "disabled"}, "stop_sequences": ["\n"],
        "messages": [{"role": "user", "content": QUESTION}]},
}


def is_messages_path(path: str) -> bool:
    """Whether a request's path is one of the Messages routes, whose errors are in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    status, body = anthropic_error(status, message)
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------- the request to the engine


def render_messages(state: ServerState, req: MessageCountTokensRequest, check_context: bool = True
                    ) -> RenderedPrompt:
    """The request's conversation through the chat template (the tools too, unless tool_choice is "none")."""
    tools = ([{"type": "function", "function": t.function().model_dump(exclude_none=True)} for t in req.tools or []]
             if req.tools_enabled else None)
    return render_template(state, req.to_template(), tools, req.thinking_enabled, check_context=check_context)


def constraint(req: MessageCreateRequest, tokenizer: Any) -> StructuredOutputsParams | None:
    """What the answer must follow: the tool-call grammar of tool_choice "any" or "tool", or
    output_config.format's JSON schema (one of them)."""
    grammar = tool_choice_grammar(req, tokenizer)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return None if grammar is None else StructuredOutputsParams(grammar=grammar)
    if grammar is not None:
        raise APIError(400, f'output_config.format and tool_choice "{req.tool_choice.type}" both constrain the '
                            "answer: give one", param="output_config")
    try:
        return StructuredOutputsParams(json=fmt.schema_)
    except InvalidRequestError as e:
        raise APIError(400, f"output_config.format: {e}", param="output_config") from None


def tool_choice_grammar(req: MessageCreateRequest, tokenizer: Any) -> str | None:
    """The tool-call grammar tool_choice asks for: "any", one or more calls of the tools (one with
    disable_parallel_tool_use); "tool", one call of the named tool; else none."""
    choice = req.tool_choice
    if not isinstance(choice, ToolChoiceAny | ToolChoiceTool):
        return None
    if not req.tools:
        raise APIError(400, f'tool_choice "{choice.type}" needs tools: give the tools the model may call',
                       param="tool_choice")
    if isinstance(choice, ToolChoiceAny):
        functions, repeat = [t.function() for t in req.tools], not choice.disable_parallel_tool_use
    else:
        functions, repeat = [t.function() for t in req.tools if t.name == choice.name][:1], False
        if not functions:
            offered = ", ".join(repr(t.name) for t in req.tools)
            raise APIError(400, f"tool_choice names the tool {choice.name!r}, which is not in tools (offered: "
                                f"{offered})", param="tool_choice")
    return tool_calls_grammar(functions, repeat, tokenizer)


def one_call_only(req: MessageCreateRequest) -> bool:
    """tool_choice "auto" with disable_parallel_tool_use: the answer ends at its first call's </tool_call> (a
    stop string; "any" and "tool" make one call by their grammar)."""
    choice = req.tool_choice
    return (req.tools_enabled and isinstance(choice, ToolChoiceAuto) and bool(choice.disable_parallel_tool_use)
            and TOOL_END not in (req.stop_sequences or []))


def sampling_params(state: ServerState, req: MessageCreateRequest, prompt_len: int,
                    constraint: StructuredOutputsParams | None) -> SamplingParams:
    """The model's defaults with the request's sampling fields on top (SamplingParams checks the values)."""
    engine = state.engine
    if prompt_len + req.max_tokens > engine.max_model_len:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({req.max_tokens}) > "
                            f"{engine.max_model_len}, the model's context: reduce the prompt or max_tokens",
                       param="max_tokens")
    given = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k")
             if getattr(req, name) is not None}
    stop = list(req.stop_sequences or []) + ([TOOL_END] if one_call_only(req) else [])
    if isinstance(req.thinking, ThinkingConfigEnabled):
        budget = req.thinking.budget_tokens
        if budget >= req.max_tokens:  # as Anthropic: the reasoning counts toward max_tokens
            raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                f"({req.max_tokens})", param="thinking")
        given["thinking_token_budget"] = budget
    try:
        return dataclasses.replace(engine.input_processor.default_sampling_params(), **given, n=1,
                                   max_tokens=req.max_tokens, stop=stop, logprobs=None,
                                   structured_outputs=constraint)
    except InvalidRequestError as e:
        field = "stop_sequences" if e.param == "stop" else e.param
        raise APIError(400, f"{field}: {e}", param=field) from None


async def create_message(state: ServerState, http: Request, req: MessageCreateRequest) -> Any:
    prompt = await asyncio.to_thread(render_messages, state, req)
    params = sampling_params(state, req, len(prompt.token_ids), constraint(req, state.engine.tokenizer))
    gen = Generation(state, http, "msg")
    gen.id = f"msg_{uuid.uuid4().hex[:24]}"  # Anthropic's form
    # what fails to compile is a tool's input_schema, or the format's schema
    await gen.start(prompt.token_ids, params, "output_config" if req.output_config is not None else "tools")
    answer = Answer(req, ChatOutputParser(req.thinking_enabled, prompt.in_reasoning, req.tools_enabled))
    if req.stream:
        return StreamingResponse(_stream(state, gen, answer), media_type="text/event-stream",
                                 background=BackgroundTask(gen.aclose))
    out = await gen.final()
    c = out.outputs[0]
    answer.feed(c.text)
    answer.finish(c)
    gen.finish_label = answer.finish_label
    gen.record()
    return JSONResponse({**_head(state, gen, out), "content": answer.blocks, "stop_reason": answer.stop_reason,
                         "stop_sequence": answer.stop_sequence})


async def count_message_tokens(state: ServerState, req: MessageCountTokensRequest) -> JSONResponse:
    """The prompt /v1/messages would give the engine, counted (a prompt over the context too)."""
    prompt = await asyncio.to_thread(render_messages, state, req, False)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


def _usage(out: RequestOutput) -> dict[str, int]:
    cached = out.num_cached_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached,
            "output_tokens": sum(len(c.token_ids) for c in out.outputs), "cache_read_input_tokens": cached}


def _head(state: ServerState, gen: Generation, out: RequestOutput) -> dict[str, Any]:
    return {"id": gen.id, "type": "message", "role": "assistant", "model": gen.model_name,
            "usage": _usage(out)}


# ---------------------------------------------------------------- the answer as content blocks


class Answer:
    """One answer as Anthropic's content blocks: the parser's reasoning, text and tool calls, in order, as the
    stream's content_block_* events, which also build `blocks`, the whole message's content (so a whole answer
    is exactly what its stream adds up to).

    A thinking block's newlines at both ends and a text block's at its start are dropped (what Qwen3 writes
    around its tags, and what its template drops when the turn is sent back). A thinking block's signature is
    the SHA-256 of its text: a digest, not a secret; nanoqwen verifies none it receives.
    """

    def __init__(self, req: MessageCreateRequest, parser: ChatOutputParser) -> None:
        self.parser = parser
        display = getattr(req.thinking, "display", None)
        self.show_thinking = display != "omitted"
        self.user_stops = set(req.stop_sequences or [])
        self.one_call_only = one_call_only(req)
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the block being written (the last of blocks)
        self.held = ""  # newlines at the end of the reasoning so far: dropped if it ends there
        self.reasoning: list[str] = []  # the thinking block's text, for its signature
        self.tail = ""  # the last characters fed, to find a </tool_call> split across deltas
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.finish_label: str | None = None  # the metrics' finish reason, as chat completions name it

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The events for the next piece of the answer's text."""
        events = []
        for piece in self._pieces(delta):
            events += self._add(*self.parser.feed(piece))
        return events

    def finish(self, output: CompletionOutput) -> list[dict[str, Any]]:
        """The events that end the content (the last blocks closed), and the stop reason."""
        # the first call's </tool_call> was a stop string, which the text leaves out
        closing = TOOL_END if self.one_call_only and output.stop_reason == TOOL_END else ""
        events = self.feed(closing) + self._add(*self.parser.finish()) + self._close()
        calls = bool(self.parser.tool_calls)
        if output.finish_reason == "length":
            self.stop_reason, self.finish_label = "max_tokens", "length"
        elif calls:
            self.stop_reason, self.finish_label = "tool_use", "tool_calls"
        elif isinstance(output.stop_reason, str) and output.stop_reason in self.user_stops:
            self.stop_reason, self.stop_sequence, self.finish_label = "stop_sequence", output.stop_reason, "stop"
        else:
            self.stop_reason, self.finish_label = "end_turn", output.finish_reason or "stop"
        return events

    def _pieces(self, delta: str) -> list[str]:
        """The delta cut after each </tool_call>: the parser then returns any text before a call in the same
        piece as the call, and text after it in the next one, so blocks keep the answer's order."""
        text = self.tail + delta
        cuts = [m.end() - len(self.tail) for m in re.finditer(re.escape(TOOL_END), text)]
        self.tail = text[-(len(TOOL_END) - 1):]
        bounds = [0, *cuts, len(delta)]
        return [delta[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def _add(self, reasoning: str, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        events = self._thinking(reasoning) if reasoning else []
        events += self._text(text) if text else []
        for call in calls:
            events += self._tool_use(call)
        return events

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "thinking":
            text = text.lstrip("\n")
            if not text:
                return []
            events = self._close() + self._start({"type": "thinking", "thinking": "", "signature": ""})
        text = self.held + text
        body = text.rstrip("\n")
        self.held = text[len(body):]
        if body:
            self.reasoning.append(body)
            if self.show_thinking:
                self.open["thinking"] += body
                events.append(self._delta({"type": "thinking_delta", "thinking": body}))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "text":
            text = text.lstrip("\n")
            if not text:
                return []
            events = self._close() + self._start({"type": "text", "text": ""})
        self.open["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _tool_use(self, call: ToolCall) -> list[dict[str, Any]]:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": {}}
        events = self._close() + self._start(block)
        block["input"] = json.loads(call.arguments)  # (the parser made it from a JSON object)
        return events + [self._delta({"type": "input_json_delta", "partial_json": call.arguments})] + self._close()

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        self.open = block
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open["type"] == "thinking":
            signature = hashlib.sha256("".join(self.reasoning).encode()).hexdigest()
            self.open["signature"], self.held = signature, ""
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        self.open = None
        return events + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def event(obj: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: `event:` its type, `data:` it."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(state: ServerState, gen: Generation, answer: Answer) -> AsyncIterator[str]:
    sent, started = "", False
    try:
        async for out in gen.outputs():
            c = out.outputs[0]
            if not started:  # at the first output, which tells how much of the prompt was cached
                started = True
                message = {**_head(state, gen, out), "content": [], "stop_reason": None, "stop_sequence": None}
                message["usage"]["output_tokens"] = 0
                yield event({"type": "message_start", "message": message})
                yield event({"type": "ping"})
            delta, sent = c.text[len(sent):], c.text
            events = answer.feed(delta)
            if c.finish_reason is not None:
                events += answer.finish(c)
            for e in events:
                yield event(e)
            if c.finish_reason is not None:
                gen.finish_label = answer.finish_label
                yield event({"type": "message_delta",
                             "delta": {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence},
                             "usage": _usage(out)})
                yield event({"type": "message_stop"})
    except APIError as e:
        # the engine failed mid-stream: the status is already sent, so say it in the stream
        yield event(anthropic_error(e.status, e.message)[1])


# ---------------------------------------------------------------- /openapi.json


def messages_route(doc: ApiDoc, response: type[BaseModel], request: type[BaseModel],
                   stream: type[BaseModel] | None = None, description: str | None = None) -> dict[str, Any]:
    """ApiDoc.route's keyword arguments for a Messages route, in Anthropic's terms: its error bodies, its
    statuses (529, not 503), the x-api-key header, events with an `event:` line, and example bodies."""
    route = doc.route(response, request, stream, errors=(400, 404, 413, 503), description=description)
    responses = route["responses"]
    del responses[503]
    for code in [c for c in responses if c != 200] + [529]:
        responses[code] = {"model": AnthropicErrorResponse, "description": ERRORS[code]}
    if stream is not None:
        responses[200]["content"]["text/event-stream"]["itemSchema"] = _sse_event(stream)
    extra = route["openapi_extra"]
    if "security" in extra:  # either header carries the key
        extra["security"] = [*extra["security"], {API_KEY_HEADER: []}]
    extra["requestBody"]["content"]["application/json"]["examples"] = {
        name: {"value": body} for name, body in EXAMPLES.items()}
    return route


def _sse_event(stream: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a Messages stream: `event:` the type of the JSON in `data:` (an event, or the
    error that ended the stream early)."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{stream.__name__}"},
                         {"$ref": f"#/components/schemas/{AnthropicErrorResponse.__name__}"}]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"enum": list(EVENTS)}, "data": data}}


def document_api_key_header(app: FastAPI, secured: bool) -> None:
    """Add the x-api-key scheme (Anthropic's header, which the server also reads the key from) to app.openapi()'s
    document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()
        if secured:
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes.setdefault(API_KEY_HEADER, {"type": "apiKey", "in": "header", "name": "x-api-key"})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
