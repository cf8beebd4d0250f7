"""POST /v1/completions: a raw prompt (text, tokenized as is, or token ids), whole or streamed.

echo (OpenAI's, as vLLM serves it): each choice's text starts with the prompt (its text, or the token ids
decoded), and with logprobs its tokens' entries come first, the first token's logprob and top_logprobs null
(nothing predicts it). The prompt's entries are its prompt logprobs (SamplingParams.prompt_logprobs: the
request's prompt_logprobs, else its logprobs). max_tokens 0 with echo returns the prompt alone, as vLLM does:
the engine still samples one token (every request does), which is left out of the text, the logprobs and
usage's completion_tokens.

prompt_logprobs (vLLM's extra field) comes back as each choice's prompt_logprobs, as vLLM returns it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from nanoqwen.entrypoints.server.protocol import APIError, CompletionRequest
from nanoqwen.entrypoints.server.serving import (
    SSE_DONE,
    Generation,
    ServerState,
    completion_logprobs,
    prompt_logprobs_json,
    sse,
    usage,
)
from nanoqwen.entrypoints.server.structured import structured_outputs
from nanoqwen.errors import NanoQwenError
from nanoqwen.outputs import CompletionOutput, Logprob, RequestOutput


@dataclasses.dataclass
class Echo:
    """What echo puts before each choice: the prompt's text and, with logprobs, its tokens' entries (the first
    None). only: max_tokens 0, the prompt alone."""

    text: str
    token_ids: list[int]
    only: bool


async def create_completion(state: ServerState, http: Request, req: CompletionRequest) -> Any:
    engine = state.engine
    prompt = req.single_prompt()
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens 0 returns nothing without echo: give max_tokens >= 1, or echo: true "
                            "(the prompt alone)", param="max_tokens")
    try:
        # tokenizes a string, checks the length
        token_ids = await asyncio.to_thread(engine.input_processor.tokenize, prompt)
    except NanoQwenError as e:
        raise APIError(400, str(e), param="prompt") from None
    echo = None
    if req.echo:
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(token_ids)
        echo = Echo(text, token_ids, req.max_tokens == 0)
    constraint, field = structured_outputs(req)
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # (echo alone: its one token is dropped)
    params = req.sampling_params(engine.input_processor.default_sampling_params(), max_tokens, req.logprobs,
                                 len(token_ids), engine.max_model_len, constraint)
    if echo is not None and req.logprobs is not None and params.prompt_logprobs is None:
        params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
    gen = Generation(state, http, "cmpl")
    await gen.start(token_ids, params, field)
    if req.stream:
        return StreamingResponse(_stream(state, gen, req, echo), media_type="text/event-stream",
                                 background=BackgroundTask(gen.aclose))
    out = await gen.final()
    gen.record()
    choices = []
    for c in out.outputs:
        text, lp = _choice(state, req, echo, out, c)
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        choices.append(choice)
    used = usage(out)
    if echo is not None and echo.only:
        used["completion_tokens"], used["total_tokens"] = 0, used["prompt_tokens"]
    return JSONResponse({"id": gen.id, "object": "text_completion", "created": gen.created,
                         "model": gen.model_name, "choices": choices, "usage": used,
                         "timings": gen.timings(out)})


def _choice(state: ServerState, req: CompletionRequest, echo: Echo | None, out: RequestOutput,
            c: CompletionOutput) -> tuple[str, dict[str, list] | None]:
    """A whole choice's text and logprobs, the echoed prompt first."""
    text, token_ids, entries = c.text, c.token_ids, c.logprobs or []
    if echo is not None and echo.only:
        text, token_ids, entries = "", [], []
    if echo is not None:
        text = echo.text + text
        token_ids = echo.token_ids + token_ids
        entries = _prompt_entries(out, echo) + entries
    lp = (None if req.logprobs is None else
          completion_logprobs(state.engine.tokenizer, token_ids, entries, req.logprobs, 0))
    return text, lp


def _prompt_entries(out: RequestOutput, echo: Echo) -> list[dict[int, Logprob] | None]:
    """The echoed prompt's logprob entries (all None where the request asked for no logprobs)."""
    return list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(echo.token_ids)


async def _stream(state: ServerState, gen: Generation, req: CompletionRequest,
                  echo: Echo | None) -> AsyncIterator[str]:
    head = {"id": gen.id, "object": "text_completion", "created": gen.created,
            "model": gen.model_name}
    if req.include_usage:
        head["usage"] = None
    n, tokenizer = req.n, state.engine.tokenizer
    sent_text, sent_tokens, offsets, done = [""] * n, [0] * n, [0] * n, [False] * n
    echoed = [echo is None] * n  # whether the choice's first chunk (which carries the echo) went out
    try:
        last = None
        async for last in gen.outputs():
            for c in last.outputs:
                i = c.index
                if done[i]:
                    continue
                done[i] = c.finish_reason is not None
                text, token_ids, entries = c.text, c.token_ids, c.logprobs or []
                if echo is not None and echo.only:
                    if not done[i]:
                        continue
                    text, token_ids, entries = "", [], []
                delta = text[len(sent_text[i]):]
                held = not delta and not done[i]
                if held and echoed[i]:
                    # text held back (a partial character or stop string); its tokens come
                    # with the next
                    continue
                new = slice(sent_tokens[i], sent_tokens[i] if held else len(token_ids))  # (held: the echo alone)
                sent_text[i], sent_tokens[i] = text, new.stop
                prefix, prefix_lp = "", None
                if not echoed[i]:  # the choice's first chunk: the prompt first, its entries' offsets from 0
                    echoed[i], prefix, offsets[i] = True, echo.text, len(echo.text)
                    if req.logprobs is not None:
                        prefix_lp = completion_logprobs(tokenizer, echo.token_ids, _prompt_entries(last, echo),
                                                        req.logprobs, 0)
                lp = None
                if req.logprobs is not None:
                    # Tokens go with the chunk in which their text appears, so offsets track the
                    # emitted text.
                    lp = completion_logprobs(tokenizer, token_ids[new], entries[new], req.logprobs, offsets[i])
                    if prefix_lp is not None:
                        lp = {key: prefix_lp[key] + lp[key] for key in lp}
                offsets[i] += len(delta)
                delta = prefix + delta
                stop_reason = {"stop_reason": c.stop_reason} if done[i] else {}
                yield sse({**head, "choices": [{"index": i, "text": delta, "logprobs": lp,
                                                "finish_reason": c.finish_reason, **stop_reason}]})
        if req.include_usage and last is not None:
            used = usage(last)
            if echo is not None and echo.only:
                used["completion_tokens"], used["total_tokens"] = 0, used["prompt_tokens"]
            yield sse({**head, "choices": [], "usage": used, "timings": gen.timings(last)})
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
