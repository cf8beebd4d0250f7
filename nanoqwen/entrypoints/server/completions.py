"""POST /v1/completions: a raw prompt (text, tokenized as is, or token ids), whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from nanoqwen.entrypoints.server.protocol import APIError, CompletionRequest
from nanoqwen.entrypoints.server.serving import SSE_DONE, Generation, ServerState, completion_logprobs, sse, usage
from nanoqwen.entrypoints.server.structured import structured_outputs
from nanoqwen.errors import NanoQwenError


async def create_completion(state: ServerState, http: Request, req: CompletionRequest) -> Any:
    engine = state.engine
    prompt = req.single_prompt()
    try:
        # tokenizes a string, checks the length
        token_ids = await asyncio.to_thread(engine.input_processor.tokenize, prompt)
    except NanoQwenError as e:
        raise APIError(400, str(e), param="prompt") from None
    constraint, field = structured_outputs(req)
    params = req.sampling_params(engine.input_processor.default_sampling_params(), req.max_tokens, req.logprobs,
                                 len(token_ids), engine.max_model_len, constraint)
    gen = Generation(state, http, "cmpl")
    await gen.start(token_ids, params, field)
    if req.stream:
        return StreamingResponse(_stream(state, gen, req), media_type="text/event-stream",
                                 background=BackgroundTask(gen.aclose))
    out = await gen.final()
    gen.record()
    choices = []
    for c in out.outputs:
        lp = (None if req.logprobs is None else
              completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs or [], req.logprobs, 0))
        choices.append({"index": c.index, "text": c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({"id": gen.id, "object": "text_completion", "created": gen.created,
                         "model": state.served_model_name, "choices": choices, "usage": usage(out),
                         "timings": gen.timings(out)})


async def _stream(state: ServerState, gen: Generation,
                  req: CompletionRequest) -> AsyncIterator[str]:
    head = {"id": gen.id, "object": "text_completion", "created": gen.created,
            "model": state.served_model_name}
    if req.include_usage:
        head["usage"] = None
    n, tokenizer = req.n, state.engine.tokenizer
    sent_text, sent_tokens, offsets, done = [""] * n, [0] * n, [0] * n, [False] * n
    try:
        last = None
        async for last in gen.outputs():
            for c in last.outputs:
                i = c.index
                if done[i]:
                    continue
                done[i] = c.finish_reason is not None
                delta = c.text[len(sent_text[i]):]
                if not delta and not done[i]:
                    # text held back (a partial character or stop string); its tokens come
                    # with the next
                    continue
                sent_text[i], new = c.text, slice(sent_tokens[i], len(c.token_ids))
                sent_tokens[i] = len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    # Tokens go with the chunk in which their text appears, so offsets track the
                    # emitted text.
                    lp = completion_logprobs(tokenizer, c.token_ids[new], (c.logprobs or [])[new],
                                             req.logprobs, offsets[i])
                offsets[i] += len(delta)
                stop_reason = {"stop_reason": c.stop_reason} if done[i] else {}
                yield sse({**head, "choices": [{"index": i, "text": delta, "logprobs": lp,
                                                "finish_reason": c.finish_reason, **stop_reason}]})
        if req.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage(last), "timings": gen.timings(last)})
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
