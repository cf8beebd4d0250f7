"""What the chat and completion endpoints share: one request's life through the AsyncEngine (timing,
metrics, log line, abort when the client goes away), SSE framing, usage and logprobs."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi import Request

from nanoqwen.entrypoints.server.async_engine import AsyncEngine, RequestStream
from nanoqwen.entrypoints.server.metrics import ServerMetrics
from nanoqwen.entrypoints.server.openai_responses.store import ResponseStore
from nanoqwen.entrypoints.server.protocol import APIError
from nanoqwen.errors import InvalidRequestError
from nanoqwen.outputs import Logprob, RequestOutput
from nanoqwen.sampling_params import SamplingParams


@dataclass
class ServerState:
    # the LLMEngine (read-only here: tokenizer, limits, defaults); only AsyncEngine's thread
    # steps it
    engine: Any
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model_name: str
    api_key: str | None
    max_body_bytes: int
    created: int
    # /v1/responses: the responses kept for GET and previous_response_id (openai_responses/)
    responses: ResponseStore = field(default_factory=ResponseStore)
    # LoRA adapters served by name (a request's `model` chooses one): name -> LoRARequest (entrypoints/server/lora.py)
    lora_adapters: dict[str, Any] = field(default_factory=dict)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Generation:
    """One generation request: start it, iterate its outputs, and always close it
    (abort if unfinished)."""

    def __init__(self, state: ServerState, http: Request, prefix: str) -> None:
        self.state, self.http = state, http
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        # TTFT counts from the request's arrival (AccessLog notes it), so parsing and templating
        # are included.
        self.arrival = getattr(http.state, "arrival", None) or time.perf_counter()
        self.stream: RequestStream | None = None
        self.last: RequestOutput | None = None
        self.last_time: float | None = None
        # the time before each token after the first, as outputs arrive (a step's tokens share its gap)
        self.token_gaps: list[float] = []
        self.num_tokens_seen = 0
        # set by the endpoint (e.g. "tool_calls"); default from the output
        self.finish_label: str | None = None
        self.closed = self.recorded = False
        self.defer_record = False  # final(): the endpoint records once it knows the finish reason

    async def start(self, prompt_token_ids: list[int], params: SamplingParams,
                    constraint_field: str | None = None) -> None:
        """Queue the request. constraint_field: the request field that gave
        params.structured_outputs, which a 400 for a grammar that does not compile names."""
        self.prompt_len = len(prompt_token_ids)
        if params.structured_outputs is not None:
            # Compiling a grammar can take a while: in a worker thread, never on the event loop
            # (or the engine thread, which add_request runs on and which then finds it cached).
            try:
                await asyncio.to_thread(self.state.engine.prepare_request, params)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=constraint_field) from None
        # the LoRA adapter the request's `model` named (api.py _parse), if any
        lora_request = getattr(self.http.state, "lora_request", None)
        self.stream = await self.state.async_engine.add(self.id, prompt_token_ids, params, lora_request=lora_request)

    @property
    def model_name(self) -> str:
        """The model an answer names: the LoRA adapter the request chose, else the served model (as vLLM)."""
        lora_request = getattr(self.http.state, "lora_request", None)
        return lora_request.lora_name if lora_request is not None else self.state.served_model_name

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self.stream is not None
        try:
            async for out in self.stream:
                now = time.perf_counter()
                longest = max((len(c.token_ids) for c in out.outputs), default=0)
                new = longest - self.num_tokens_seen
                if new > 0 and self.last_time is not None and self.num_tokens_seen > 0:
                    self.token_gaps += [(now - self.last_time) / new] * new
                if new > 0:
                    self.num_tokens_seen, self.last_time = longest, now
                self.last = out
                yield out
        except APIError:
            self.finish_label = "error"
            raise
        finally:
            self.close()

    async def final(self) -> RequestOutput:
        """The finished output; if the client disconnects first, the request
        is aborted (APIError 499).

        The caller calls record() once it has built the response.
        """
        self.defer_record = True

        async def consume() -> None:
            async for _ in self.outputs():
                pass

        consumer = asyncio.ensure_future(consume())
        listener = asyncio.ensure_future(wait_for_disconnect(self.http))
        try:
            await asyncio.wait({consumer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not consumer.done():
                consumer.cancel()
                self.close()
        if not consumer.done() or consumer.cancelled():
            raise APIError(499, "client disconnected", code="client_disconnected")
        consumer.result()  # re-raises an engine failure
        assert self.last is not None
        return self.last

    def close(self) -> None:
        """Abort the request if it is unfinished (the client left, or the engine failed)."""
        if self.closed or self.stream is None:
            return
        self.closed = True
        finished = self.last is not None and self.last.finished
        if not finished:
            self.state.async_engine.abort(self.id)
        if not (finished and self.defer_record):
            self.record()

    async def aclose(self) -> None:
        """close() as a response's background task: also covers a stream whose client left
        before it began."""
        self.close()

    def timings(self, out: RequestOutput) -> dict[str, Any] | None:
        """The answer's speed in llama.cpp's `timings` names (responses.Timings); None before the
        first token."""
        first = self.stream.first_output_time if self.stream is not None else None
        if first is None or self.last_time is None:
            return None
        prompt_n = len(out.prompt_token_ids) - out.num_cached_tokens
        predicted_n = sum(len(c.token_ids) for c in out.outputs)
        prompt_ms = (first - self.arrival) * 1000
        predicted_ms = (self.last_time - first) * 1000
        return {"cache_n": out.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_second": prompt_n * 1000 / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_second": ((predicted_n - len(out.outputs)) * 1000 / predicted_ms
                                         if predicted_ms > 0 else 0.0)}

    def record(self) -> None:
        """Metrics and the request's log line (once)."""
        if self.recorded or self.stream is None:
            return
        self.recorded = True
        last = self.last
        finished = last is not None and last.finished
        lengths = [len(c.token_ids) for c in last.outputs] if last else []
        reason = self.finish_label or (last.outputs[0].finish_reason if finished else "abort")
        first = self.stream.first_output_time
        ttft = first - self.arrival if first is not None else None
        longest = max(lengths, default=0)
        tpot = ((self.last_time - first) / (longest - 1)
                if first is not None and longest > 1 else None)
        self.state.metrics.record_request(self.prompt_len, sum(lengths), reason, ttft, tpot,
                                          e2e=time.perf_counter() - self.arrival, token_gaps=self.token_gaps)
        self.http.state.log = (f"{self.id} prompt={self.prompt_len} generated={sum(lengths)} "
                               f"finish={reason}"
                               + (f" ttft={ttft * 1000:.0f}ms" if ttft is not None else ""))


async def wait_for_disconnect(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character of each byte in a token's string
    -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The token's raw UTF-8 bytes (a token may hold part of a character, which its text shows
    as U+FFFD)."""
    backend, decoder = getattr(tokenizer, "backend", None), _byte_decoder()
    piece = backend.id_to_token(token_id) if backend is not None else None
    if piece and all(ch in decoder for ch in piece):
        return [decoder[ch] for ch in piece]
    return list(text.encode("utf-8"))


def _finite(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0  # JSON has no -inf


def _token_text(lp: Logprob, tokenizer: Any, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, Logprob]],
                  top_n: int) -> list[dict]:
    """OpenAI's chat logprobs.content items, one per generated token."""
    items = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        def item(tid: int, lp: Logprob) -> dict[str, Any]:
            text = _token_text(lp, tokenizer, tid)
            return {"token": text, "logprob": _finite(lp.logprob),
                    "bytes": token_bytes(tokenizer, tid, text)}
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top_n),
                     key=lambda x: x[1].rank)[:top_n]
        items.append({**item(token_id, entry[token_id]),
                      "top_logprobs": [item(t, lp) for t, lp in top]})
    return items


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                        top_n: int, offset: int) -> dict[str, list]:
    """OpenAI's legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset
    from `offset`). An entry None (an echoed prompt's first token, which nothing predicts) gives its token
    with null logprobs, as OpenAI and vLLM."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = tokenizer.decode([token_id])
            for key, value in (("tokens", text), ("token_logprobs", None), ("top_logprobs", None),
                               ("text_offset", offset)):
                out[key].append(value)
            offset += len(text)
            continue
        chosen = entry[token_id]
        text = _token_text(chosen, tokenizer, token_id)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top_n),
                     key=lambda x: x[1].rank)[:top_n]
        tops = {_token_text(lp, tokenizer, t): _finite(lp.logprob) for t, lp in top}
        # as vLLM: the sampled token is always listed
        tops.setdefault(text, _finite(chosen.logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(chosen.logprob))
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict[str, dict] | None]:
    """RequestOutput.prompt_logprobs as vLLM's responses carry them: per prompt token null (the first) or
    {token id: {logprob, rank, decoded_token}}, -inf as -9999.0."""
    return [None if entry is None else
            {str(token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()}
            for entry in entries]
