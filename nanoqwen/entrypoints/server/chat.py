"""POST /v1/chat/completions: messages through the chat template, answers parsed into
reasoning_content, content and tool_calls, whole or streamed as chat.completion.chunk events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from nanoqwen.entrypoints.server.parsers import THINK_START, ChatOutputParser, ToolCall
from nanoqwen.entrypoints.server.protocol import APIError, ChatCompletionRequest
from nanoqwen.entrypoints.server.serving import (
    SSE_DONE,
    Generation,
    ServerState,
    chat_logprobs,
    prompt_logprobs_json,
    sse,
    usage,
)
from nanoqwen.entrypoints.server.structured import structured_outputs
from nanoqwen.errors import NanoQwenError

RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "tokenize", "add_generation_prompt", "documents"}


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[list[int], bool, bool]:
    """(prompt token ids, thinking on, prompt ends inside <think>): the template rendered as
    transformers does."""
    kwargs, thinking = template_kwargs(req.chat_template_kwargs)
    # tool_choice "none": the model is not told about the tools at all, so it cannot call them.
    tools = ([{"type": "function", "function": t.function.model_dump(exclude_unset=True)}
              for t in req.tools or []]
             if req.tools_enabled else None)
    messages = [m.to_template() for m in req.messages]
    prompt = render_template(state, messages, tools, thinking, kwargs)
    return prompt.token_ids, thinking, prompt.in_reasoning


def template_kwargs(chat_template_kwargs: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """A request's chat_template_kwargs checked: (the other variables, enable_thinking (default on))."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs")
    return kwargs, thinking


@dataclass
class RenderedPrompt:
    """A conversation rendered by the chat template, as the engine gets it."""

    token_ids: list[int]
    # the prompt ends inside <think> (a template that opens it itself: Qwen3 *-Thinking-2507)
    in_reasoning: bool


def render_template(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    thinking: bool, template_kwargs: dict[str, Any] | None = None,
                    check_context: bool = True, add_generation_prompt: bool = True) -> RenderedPrompt:
    """The template's messages and tools rendered as transformers does (what chat completions, Anthropic's
    Messages API and /tokenize share); check_context: a prompt over the context is a 400 (count_tokens and
    /tokenize count it)."""
    tokenizer = state.engine.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=thinking, **(template_kwargs or {}))
        token_ids = tokenizer.encode(text)
        if check_context:
            state.engine.input_processor.validate_prompt(token_ids)
    except NanoQwenError as e:  # a conversation the template rejects, a prompt over the context
        raise APIError(400, str(e), param="messages") from None
    return RenderedPrompt(token_ids, text.rstrip().endswith(THINK_START))


async def create_chat_completion(state: ServerState, http: Request,
                                 req: ChatCompletionRequest) -> Any:
    token_ids, thinking, in_reasoning = await asyncio.to_thread(render_prompt, state, req)
    engine = state.engine
    max_tokens = req.max_completion_tokens or req.max_tokens
    # with thinking on, the engine applies it after </think> (it sees that from the prompt)
    constraint, field = structured_outputs(req, engine.tokenizer)
    params = req.sampling_params(engine.input_processor.default_sampling_params(), max_tokens, req.num_logprobs,
                                 len(token_ids), engine.max_model_len, constraint)
    gen = Generation(state, http, "chatcmpl")
    await gen.start(token_ids, params, field)
    parsers = [ChatOutputParser(thinking, in_reasoning, req.tools_enabled) for _ in range(req.n)]
    if req.stream:
        return StreamingResponse(_stream(state, gen, req, parsers), media_type="text/event-stream",
                                 background=BackgroundTask(gen.aclose))
    out = await gen.final()
    choices, reasons = [], []
    for c in out.outputs:
        reasoning, content, calls = parsers[c.index].parse(c.text)
        reason = _finish_reason(c.finish_reason, calls)
        reasons.append(reason)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not (calls or reasoning) else None,
            "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        lp = (None if req.num_logprobs is None else
              {"content": chat_logprobs(engine.tokenizer, c.token_ids, c.logprobs or [],
                                        req.num_logprobs)})
        choices.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": reason, "stop_reason": c.stop_reason})
    gen.finish_label = reasons[0]
    gen.record()
    body = {"id": gen.id, "object": "chat.completion", "created": gen.created,
            "model": gen.model_name, "choices": choices, "usage": usage(out), "timings": gen.timings(out)}
    if out.prompt_logprobs is not None:  # vLLM's prompt_logprobs field
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return JSONResponse(body)


def _finish_reason(reason: str | None, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls and reason != "length" else (reason or "stop")


async def _stream(state: ServerState, gen: Generation, req: ChatCompletionRequest,
                  parsers: list[ChatOutputParser]) -> AsyncIterator[str]:
    head = {"id": gen.id, "object": "chat.completion.chunk", "created": gen.created,
            "model": gen.model_name}
    if req.include_usage:
        head["usage"] = None  # OpenAI: every chunk has "usage", null except in the last one

    def chunk(index: int, delta: dict, logprobs: list | None = None, **finish: Any) -> str:
        lp = None if logprobs is None else {"content": logprobs}
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None, **finish}
        return sse({**head, "choices": [choice]})

    n, top_n, tokenizer = req.n, req.num_logprobs, state.engine.tokenizer
    sent_text, sent_tokens, done = [""] * n, [0] * n, [False] * n
    # logprobs of tokens whose text is still held back
    pending_lp: list[list[dict]] = [[] for _ in range(n)]
    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        last = None
        async for last in gen.outputs():
            for c in last.outputs:
                i = c.index
                if done[i]:
                    continue
                delta_text, sent_text[i] = c.text[len(sent_text[i]):], c.text
                if top_n is not None:
                    new = slice(sent_tokens[i], len(c.token_ids))
                    pending_lp[i] += chat_logprobs(tokenizer, c.token_ids[new],
                                                   (c.logprobs or [])[new], top_n)
                sent_tokens[i] = len(c.token_ids)
                parts = [parsers[i].feed(delta_text)]
                if c.finish_reason is not None:
                    parts.append(parsers[i].finish())
                    done[i] = True
                delta = _delta(parts, len(parsers[i].tool_calls))
                if delta or (done[i] and pending_lp[i]):
                    yield chunk(i, delta, pending_lp[i] if top_n is not None else None)
                    pending_lp[i] = []
                if done[i]:
                    reason = _finish_reason(c.finish_reason, parsers[i].tool_calls)
                    gen.finish_label = gen.finish_label or reason
                    yield chunk(i, {}, finish_reason=reason, stop_reason=c.stop_reason)
        if req.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage(last), "timings": gen.timings(last)})
    except APIError as e:
        # the engine failed mid-stream: the status is already sent, so say it in the stream
        yield sse(e.body())
    yield SSE_DONE


def _delta(parts: list[tuple[str, str, list[ToolCall]]], num_calls: int) -> dict[str, Any]:
    reasoning = "".join(p[0] for p in parts)
    content = "".join(p[1] for p in parts)
    calls = [c for p in parts for c in p[2]]
    delta: dict[str, Any] = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        first = num_calls - len(calls)  # the index of each call among all of this answer's calls
        delta["tool_calls"] = [call.to_dict(first + k) for k, call in enumerate(calls)]
    return delta
