"""The FastAPI app over one AsyncEngine: OpenAI's chat completions, completions and Responses API, Anthropic's
Messages API and vLLM's tokenize and LoRA routes for a generative model; embeddings, or rerank and score, for an
embedding or reranker model; errors in OpenAI's shape (Anthropic's on its routes), Prometheus metrics; and the chat
page (ui/) at `/`, which talks to the same /v1/chat/completions. request_checks.py holds what every route does with
a request (API key, body, model name) and the access log."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoqwen.entrypoints.server.anthropic.messages import (
    anthropic_error_response,
    count_message_tokens,
    create_message,
    document_api_key_header,
    is_messages_path,
    messages_route,
)
from nanoqwen.entrypoints.server.anthropic.protocol import Message as AnthropicMessage
from nanoqwen.entrypoints.server.anthropic.protocol import (
    MessageCountTokensRequest,
    MessageCreateRequest,
    MessageStreamEvent,
    MessageTokensCount,
)
from nanoqwen.entrypoints.server.async_engine import AsyncEngine
from nanoqwen.entrypoints.server.chat import create_chat_completion
from nanoqwen.entrypoints.server.completions import create_completion
from nanoqwen.entrypoints.server.lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    adapter_route,
    load_adapter,
    model_cards,
    served_adapters,
    unload_adapter,
)
from nanoqwen.entrypoints.server.metrics import ServerMetrics
from nanoqwen.entrypoints.server.openai_responses.protocol import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from nanoqwen.entrypoints.server.openai_responses.serving import create_response, delete_response, get_response
from nanoqwen.entrypoints.server.openapi import ApiDoc
from nanoqwen.entrypoints.server.pooling import create_embedding, create_rerank, create_score, served_task
from nanoqwen.entrypoints.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from nanoqwen.entrypoints.server.request_checks import AccessLog, check_api_key, parse_request
from nanoqwen.entrypoints.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    EmbeddingResponse,
    HealthResponse,
    ModelList,
    RerankResponse,
    ScoreResponse,
    ServerProps,
)
from nanoqwen.entrypoints.server.serving import ServerState
from nanoqwen.entrypoints.server.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    detokenize,
    tokenize,
    version,
)
from nanoqwen.errors import InvalidRequestError

logger = logging.getLogger("nanoqwen.server")
DEFAULT_MAX_BODY_BYTES = 8 << 20
# what a POST endpoint may answer besides 200 (and 401 with an API key, 500 if the engine fails)
POST_ERRORS = (400, 404, 413, 503)
UI_DIR = Path(__file__).parent / "ui"


def build_app(engine: Any, served_model_name: str, api_key: str | None = None,
              max_waiting: int | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, ui: bool = True) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or anything with its interface) as
    `served_model_name`.

    The engine loop thread starts and stops with the app's lifespan. /openapi.json and /docs
    describe every endpoint and stay public, as in vLLM, when there is an API key; so does the chat
    page (`ui`), whose calls to the API send the key.
    """
    metrics = ServerMetrics(served_model_name, engine.max_model_len)
    state = ServerState(engine, AsyncEngine(engine, max_waiting), metrics, served_model_name, api_key,
                        max_body_bytes, int(time.time()))
    state.lora_adapters.update(served_adapters(engine))  # LoRA adapters loaded at start (--lora-modules)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        yield
        await state.async_engine.stop()

    app = FastAPI(title="nanoqwen", summary="OpenAI-compatible API of a nanoqwen engine",
                  lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    doc = ApiDoc(secured=api_key is not None)
    task = served_task(state)

    def serves(needed: str, what: str) -> str:
        """An endpoint's description, noting when this model's task does not serve it."""
        if task == needed:
            return what
        return f"{what}\n\nThis server's model (task {task}) does not serve it: it answers 400."

    app.state.server = state
    app.add_middleware(AccessLog, metrics=state.metrics)

    # errors on Anthropic's Messages routes are in Anthropic's shape
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if is_messages_path(request.url.path):
            return anthropic_error_response(e.status, e.message, e.headers)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if is_messages_path(request.url.path):
            return anthropic_error_response(e.status_code, str(e.detail), e.headers)
        code = "not_found" if e.status_code == 404 else None
        body = APIError(e.status_code, str(e.detail), code=code).body()
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        # user input the engine rejected
        if is_messages_path(request.url.path):
            return anthropic_error_response(400, str(e))
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        if is_messages_path(request.url.path):
            return anthropic_error_response(500, f"internal server error: {type(e).__name__}")
        error = APIError(500, f"internal server error: {type(e).__name__}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.get("/health", **doc.route(HealthResponse, errors=[503], auth=False))
    async def health() -> Response:
        """Whether the engine loop runs."""
        if not state.async_engine.alive:
            reason = f": {state.async_engine.dead}" if state.async_engine.dead else ""
            raise APIError(503, f"the engine loop is not running{reason}", type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format"}})
    async def metrics() -> Response:
        """Prometheus metrics: requests, tokens, latencies, queue and KV-cache use."""
        a = state.async_engine
        body = state.metrics.render(a.num_running, a.num_waiting, a.stats)
        return Response(body, media_type=state.metrics.content_type)

    @app.get("/v1/models", **doc.route(ModelList))
    async def models(request: Request) -> Response:
        """The one model this server serves."""
        check_api_key(state, request)
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": state.created,
            "owned_by": "nanoqwen", "max_model_len": engine.max_model_len,
            "task": served_task(state)}, *model_cards(state)]})  # task: nanoqwen's (generate, embed or score)

    @app.get("/props", **doc.route(ServerProps))
    async def props(request: Request) -> Response:
        """The model and the sampling a request gets by default, in the shape of llama.cpp's
        /props (the chat page shows them)."""
        check_api_key(state, request)
        return JSONResponse(_server_props(state))

    @app.post("/v1/chat/completions", **doc.route(
        ChatCompletionResponse, ChatCompletionRequest, ChatCompletionChunk, POST_ERRORS,
        description=serves("generate", "OpenAI's chat completions, with reasoning_content and "
                                       "tool calls parsed out.")))
    async def chat_completions(request: Request) -> Any:
        req = await parse_request(state, request, ChatCompletionRequest, "generate")
        return await create_chat_completion(state, request, req)

    @app.post("/v1/completions", **doc.route(
        CompletionResponse, CompletionRequest, CompletionChunk, POST_ERRORS,
        description=serves("generate", "OpenAI's (legacy) completions of one raw prompt.")))
    async def completions(request: Request) -> Any:
        req = await parse_request(state, request, CompletionRequest, "generate")
        return await create_completion(state, request, req)

    # OpenAI's Responses API (openai_responses/)
    @app.post("/v1/responses", **doc.route(
        ResponseObject, ResponsesRequest, ResponseStreamEvent, POST_ERRORS,
        description=serves("generate", "OpenAI's Responses API: a reasoning item, a message and "
                                       "function calls; stored responses continue with "
                                       "previous_response_id.")))
    async def responses(request: Request) -> Any:
        req = await parse_request(state, request, ResponsesRequest, "generate")
        return await create_response(state, request, req)

    @app.get("/v1/responses/{response_id}", **doc.route(ResponseObject, errors=[404]))
    async def retrieve_response(response_id: str, request: Request) -> Response:
        """A stored response (404 once deleted or evicted)."""
        check_api_key(state, request)
        return JSONResponse(get_response(state, response_id))

    @app.delete("/v1/responses/{response_id}", **doc.route(ResponseDeleted, errors=[404]))
    async def remove_response(response_id: str, request: Request) -> Response:
        """Delete a stored response."""
        check_api_key(state, request)
        return JSONResponse(delete_response(state, response_id))

    @app.post("/v1/embeddings", **doc.route(
        EmbeddingResponse, EmbeddingRequest, errors=POST_ERRORS,
        description=serves("embed", "OpenAI's embeddings of texts or token-id lists.")))
    async def embeddings(request: Request) -> Any:
        req = await parse_request(state, request, EmbeddingRequest, "embed")
        return await create_embedding(state, request, req)

    # vLLM serves the rerank API under all three paths
    rerank_doc = doc.route(RerankResponse, RerankRequest, errors=POST_ERRORS, description=serves(
        "score", "vLLM's rerank (Jina's and Cohere's shape): the documents by relevance to the "
                 "query."))

    @app.post("/v1/rerank", **rerank_doc)
    @app.post("/v2/rerank", **rerank_doc)
    @app.post("/rerank", **rerank_doc)
    async def rerank(request: Request) -> Any:
        req = await parse_request(state, request, RerankRequest, "score")
        return await create_rerank(state, request, req)

    score_doc = doc.route(ScoreResponse, ScoreRequest, errors=POST_ERRORS,
                          description=serves("score", "vLLM's score: each (text_1, text_2) "
                                                      "pair's relevance."))

    @app.post("/score", **score_doc)
    @app.post("/v1/score", **score_doc)
    async def score(request: Request) -> Any:
        req = await parse_request(state, request, ScoreRequest, "score")
        return await create_score(state, request, req)

    # vLLM's tokenizer endpoints (tokenization.py): any model's tokenizer, whatever its task
    @app.post("/tokenize", **doc.route(TokenizeResponse, TokenizeRequest, errors=POST_ERRORS))
    async def tokenize_route(request: Request) -> Response:
        """Token ids of a prompt, or of messages rendered by the chat template as /v1/chat/completions renders
        them (vLLM's shape)."""
        req = await parse_request(state, request, TokenizeRequest, None)
        return JSONResponse(await tokenize(state, req.root))

    @app.post("/detokenize", **doc.route(DetokenizeResponse, DetokenizeRequest, errors=POST_ERRORS))
    async def detokenize_route(request: Request) -> Response:
        """The text of a list of token ids (vLLM's shape)."""
        req = await parse_request(state, request, DetokenizeRequest, None)
        return JSONResponse(detokenize(state, req))

    # LoRA adapters at run time, vLLM's routes (lora.py)
    @app.post("/v1/load_lora_adapter", **adapter_route(doc, LoadLoRAAdapterRequest, POST_ERRORS))
    async def load_lora_adapter(request: Request) -> Response:
        """Load a LoRA adapter (a PEFT folder on the server) and serve it by name (needs --enable-lora)."""
        req = await parse_request(state, request, LoadLoRAAdapterRequest, "generate")
        return PlainTextResponse(await load_adapter(state, req))

    @app.post("/v1/unload_lora_adapter", **adapter_route(doc, UnloadLoRAAdapterRequest, POST_ERRORS))
    async def unload_lora_adapter(request: Request) -> Response:
        """Stop serving a LoRA adapter (a 404 for a name not served)."""
        req = await parse_request(state, request, UnloadLoRAAdapterRequest, "generate")
        return PlainTextResponse(await unload_adapter(state, req))

    @app.get("/version", **doc.route(VersionResponse, auth=False))
    async def version_route() -> Response:
        """nanoqwen's version."""
        return JSONResponse(version())

    # Anthropic's Messages API (anthropic/)
    @app.post("/v1/messages", **messages_route(
        doc, AnthropicMessage, MessageCreateRequest, MessageStreamEvent,
        description=serves("generate", "Anthropic's Messages API: Qwen3's reasoning as thinking blocks, its "
                                       "tool calls as tool_use blocks. The key may also come as x-api-key.")))
    async def messages(request: Request) -> Any:
        req = await parse_request(state, request, MessageCreateRequest, "generate")
        return await create_message(state, request, req)

    @app.post("/v1/messages/count_tokens", **messages_route(
        doc, MessageTokensCount, MessageCountTokensRequest,
        description=serves("generate", "Anthropic's token count: the prompt /v1/messages would render for "
                                       "the same body.")))
    async def count_tokens(request: Request) -> Any:
        req = await parse_request(state, request, MessageCountTokensRequest, "generate")
        return await count_message_tokens(state, req)

    if ui:
        @app.get("/", include_in_schema=False)
        async def chat_page() -> FileResponse:
            return FileResponse(UI_DIR / "index.html")

        app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")

    doc.install(app)
    document_api_key_header(app, api_key is not None)
    return app


def _server_props(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    defaults = engine.input_processor.default_sampling_params()
    return {
        "model_alias": state.served_model_name, "model_path": str(engine.model_dir),
        "total_slots": engine.engine_config.max_num_seqs,
        "default_generation_settings": {"n_ctx": engine.max_model_len, "params": {
            "temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
            # a request without max_tokens runs up to the context, as in vLLM and OpenAI
            "min_p": defaults.min_p, "max_tokens": None, "seed": defaults.seed}},
        "chat_template": engine.tokenizer.chat_templates.get("default")}
