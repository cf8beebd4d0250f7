"""POST /v1/embeddings (OpenAI's shape), /v1/rerank (Jina's and Cohere's, as vLLM serves it) and
/score (vLLM's): every input (a text, or a query-document pair) is one prefill-only engine request,
and one HTTP request's inputs are queued together so the scheduler batches them. Which endpoints a
server answers depends on its model's task (generate, embed, score); the others say which to use."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from nanoqwen.entrypoints.server.protocol import APIError, EmbeddingRequest, RerankRequest, ScoreRequest
from nanoqwen.entrypoints.server.serving import ServerState, wait_for_disconnect
from nanoqwen.errors import NanoQwenError
from nanoqwen.outputs import PoolingRequestOutput
from nanoqwen.pooling_params import PoolingParams

# task -> (what the server serves, the endpoints to use)
TASK_ENDPOINTS = {"generate": ("a generative", "POST /v1/chat/completions or /v1/completions"),
                  "embed": ("an embedding", "POST /v1/embeddings"),
                  "score": ("a reranker", "POST /v1/rerank or /score")}


def served_task(state: ServerState) -> str:
    """The engine's task; an engine without one (a test double) generates."""
    return getattr(state.engine, "task", "generate")


def require_task(state: ServerState, task: str) -> None:
    """A 400 naming the endpoints to use when the endpoint needs another task than the model's."""
    served = served_task(state)
    if served != task:
        kind, use = TASK_ENDPOINTS[served]
        raise APIError(400, f"this server serves {kind} model: use {use}", code="wrong_task")


class PoolingJob:
    """One HTTP request's inputs through the engine: queued at once, awaited together, and all
    aborted if one is rejected, the engine fails or the client leaves (no work is left behind)."""

    def __init__(self, state: ServerState, http: Request, prefix: str) -> None:
        self.state, self.http = state, http
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def run(self, token_ids: list[list[int]],
                  params: PoolingParams) -> list[PoolingRequestOutput]:
        """Each input's output, in input order."""
        engine = self.state.async_engine
        engine.admit()  # the request waits as one (--max-waiting), however many inputs it has
        ids = [f"{self.id}-{i}" for i in range(len(token_ids))]
        tasks = [asyncio.ensure_future(self._one(request_id, tokens, params))
                 for request_id, tokens in zip(ids, token_ids, strict=True)]
        results = asyncio.gather(*tasks)
        listener = asyncio.ensure_future(wait_for_disconnect(self.http))
        finish = "error"
        try:
            await asyncio.wait({results, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():
                finish = "abort"
                raise APIError(499, "client disconnected", code="client_disconnected")
            outputs = results.result()  # re-raises the first rejection or engine failure
            finish = "stop"
            return outputs
        finally:
            listener.cancel()
            results.cancel()  # unfinished inputs (cancelled, so no unretrieved error is logged)
            for task in tasks:  # and those still running after another failed
                task.cancel()
            for request_id in ids:
                engine.abort(request_id)  # a no-op for finished ones
            self._record(sum(map(len, token_ids)), len(token_ids), finish)

    async def _one(self, request_id: str, token_ids: list[int],
                   params: PoolingParams) -> PoolingRequestOutput:
        stream = await self.state.async_engine.add(request_id, token_ids, params, admitted=True)
        outputs = [out async for out in stream]  # one: the result (an engine failure raises)
        assert isinstance(outputs[-1], PoolingRequestOutput)
        return outputs[-1]

    def _record(self, prompt_tokens: int, num_inputs: int, finish: str) -> None:
        """Metrics and the request's log line."""
        self.state.metrics.record_request(prompt_tokens, 0, finish, None, None)
        self.http.state.log = (f"{self.id} inputs={num_inputs} prompt={prompt_tokens} "
                               f"finish={finish}")


def _input_ids(names: list[str], param: str,
               build: Callable[[int], list[int]]) -> list[list[int]]:
    """build(i), the engine's input ids, for each input; one the engine rejects (empty, a token
    id out of the vocabulary, over the context) is a 400 that names it ("input[2]: ...")."""
    token_ids = []
    for i, name in enumerate(names):
        try:
            token_ids.append(build(i))
        except NanoQwenError as e:
            raise APIError(400, f"{name}: {e}", param=param) from None
    return token_ids


async def _pool(state: ServerState, http: Request, prefix: str, names: list[str], param: str,
                build: Callable[[int], list[int]],
                params: PoolingParams) -> tuple[PoolingJob, list[PoolingRequestOutput]]:
    """Tokenise every input (off the event loop) before queueing any, then run them."""
    token_ids = await asyncio.to_thread(_input_ids, names, param, build)
    job = PoolingJob(state, http, prefix)
    return job, await job.run(token_ids, params)


def _prompt_tokens(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outputs)


# ---- POST /v1/embeddings


async def create_embedding(state: ServerState, http: Request, req: EmbeddingRequest) -> Any:
    engine = state.engine
    inputs = req.inputs()
    hidden = engine.config.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise APIError(400, f"dimensions={req.dimensions} is more than this model's {hidden}: "
                            f"ask for 1 to {hidden}", param="dimensions")
    try:
        prefix = engine.input_processor.sentence_transformers.prompt(req.prompt_name, None)
    except NanoQwenError as e:
        raise APIError(400, str(e), param="prompt_name") from None
    params = req.pooling_params(engine.max_model_len, req.dimensions)
    names = [req.input_name(i) for i in range(len(inputs))]
    job, outputs = await _pool(
        state, http, "embd", names, "input",
        lambda i: engine.input_processor.embedding_input(inputs[i], prompt=prefix, params=params), params)
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(o.outputs.embedding, req.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = _prompt_tokens(outputs)
    return JSONResponse({"id": job.id, "object": "list", "created": job.created,
                         "model": state.served_model_name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON numbers, or base64 of its little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


# ---- POST /v1/rerank and /score


async def _scores(state: ServerState, http: Request, prefix: str, pairs: list[tuple[str, str]],
                  names: list[str], param: str, req: RerankRequest | ScoreRequest
                  ) -> tuple[PoolingJob, list[float], int]:
    """(job, each pair's relevance in [0, 1], prompt tokens) from the reranker."""
    engine = state.engine
    params = req.pooling_params(engine.max_model_len)
    job, outputs = await _pool(
        state, http, prefix, names, param,
        lambda i: engine.input_processor.score_input(*pairs[i], instruction=req.instruction, params=params), params)
    return job, [o.outputs.score for o in outputs], _prompt_tokens(outputs)


async def create_rerank(state: ServerState, http: Request, req: RerankRequest) -> Any:
    """The documents by relevance to the query, best first, the best top_n of them."""
    docs = req.documents
    names = [f"query with documents[{i}]" for i in range(len(docs))]
    job, scores, tokens = await _scores(state, http, "rerank", [(req.query, d) for d in docs],
                                        names, "documents", req)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: ties keep input order
    results = [{"index": i, "document": {"text": docs[i]}, "relevance_score": scores[i]}
               for i in order[:req.top_n or None]]
    return JSONResponse({"id": job.id, "model": state.served_model_name,
                         "usage": {"total_tokens": tokens}, "results": results})


async def create_score(state: ServerState, http: Request, req: ScoreRequest) -> Any:
    """Each (text_1, text_2) pair's relevance, in text_2's order."""
    pairs = req.pairs()
    names = [req.pair_name(i) for i in range(len(pairs))]
    job, scores, tokens = await _scores(state, http, "score", pairs, names, "text_2", req)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": job.id, "object": "list", "created": job.created,
                         "model": state.served_model_name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                   "completion_tokens": 0}})
