"""/openapi.json for an app whose handlers parse their own bodies.

The handlers read the raw request (API key, a size cap while the body streams in, OpenAI-shaped
400s), so FastAPI cannot see the request models, nor the events a stream sends. ApiDoc documents
them by hand: each route's keyword arguments name its request body, response bodies and errors,
and the app's openapi() adds the schemas FastAPI does not know to components/schemas.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from nanoqwen.entrypoints.server.openai_responses.protocol import ResponsesRequest
from nanoqwen.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from nanoqwen.entrypoints.server.responses import ErrorResponse
from nanoqwen.entrypoints.server.tokenization import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
BEARER = "bearerAuth"
ERRORS = {
    400: "Invalid request: a body that is not JSON or breaks the schema, a value out of range, a "
         "prompt over the context, or an endpoint this model's task does not serve (code "
         "wrong_task)",
    401: "Missing or wrong API key (send 'Authorization: Bearer <key>')",
    404: "`model` names a model this server does not serve (or the stored response asked for does not exist)",
    413: "The body is larger than the server's --max-body-bytes",
    500: "The engine failed",
    503: "The engine is not running, or too many requests wait (--max-waiting; see Retry-After)",
}

# request bodies Swagger UI offers to try (tests/entrypoints/server/test_openapi.py sends each one)
QUESTION = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow."]
EXAMPLES: dict[type[BaseModel], dict[str, Any]] = {
    ChatCompletionRequest: {
        "chat": {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32},
        "streamed, with logprobs and usage": {
            "messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": QUESTION}],
            "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": 2, "chat_template_kwargs": {"enable_thinking": False}},
    },
    CompletionRequest: {
        "completion": {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
        "streamed, two samples with logprobs": {
            "prompt": "Once upon a time", "max_tokens": 16, "n": 2, "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}, "stop": ["\n"]},
    },
    EmbeddingRequest: {
        "texts": {"input": DOCUMENTS},
        "base64, shortened": {"input": QUESTION, "encoding_format": "base64", "dimensions": 32},
    },
    RerankRequest: {"rerank": {"query": QUESTION, "documents": DOCUMENTS, "top_n": 1}},
    ScoreRequest: {"one against many": {"text_1": QUESTION, "text_2": DOCUMENTS}},
    ResponsesRequest: {
        "response": {"input": QUESTION, "max_output_tokens": 64, "reasoning": {"effort": "none"}},
        "streamed, with instructions": {"instructions": "Answer briefly.", "input": QUESTION,
                                        "max_output_tokens": 32, "stream": True}},
    TokenizeRequest: {
        "prompt": {"prompt": "The capital of France is"},
        "chat, with the token strings": {"messages": [{"role": "user", "content": QUESTION}],
                                         "return_token_strs": True}},
    DetokenizeRequest: {"tokens": {"tokens": [785, 6722, 315, 9625, 374]}},
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


class ApiDoc:
    """The models documented by hand, gathered as routes are declared, and the openapi() that adds
    their schemas."""

    def __init__(self, secured: bool) -> None:
        self.secured = secured  # the server checks an API key: document the bearer scheme
        self.models: dict[type[BaseModel], JsonSchemaMode] = {}

    def route(self, response: type[BaseModel], request: type[BaseModel] | None = None,
              stream: type[BaseModel] | None = None, errors: Iterable[int] = (),
              auth: bool = True, description: str | None = None) -> dict[str, Any]:
        """Keyword arguments for app.get / app.post: the JSON request body `request` (required),
        the JSON response `response`, with `stream` also a text/event-stream of `stream` chunks
        (`stream: true`), and `errors` answered with the error body; auth: the route checks the
        API key."""
        extra: dict[str, Any] = {}
        if request is not None:
            self.models[request] = "validation"
            examples = {name: {"value": body} for name, body in EXAMPLES.get(request, {}).items()}
            body = {"schema": _ref(request)} | ({"examples": examples} if examples else {})
            extra["requestBody"] = {"required": True, "content": {"application/json": body}}
        ok: dict[str, Any] = {"model": response, "description": "OK"}
        if stream is not None:
            self.models[stream] = "serialization"
            ok["description"] = f"OK: JSON, or with `stream: true` a stream of {stream.__name__}s"
            ok["content"] = {"text/event-stream": {"itemSchema": _sse_event(stream)}}
        responses: dict[int | str, Any] = {200: ok}
        secured = auth and self.secured
        codes = sorted({*errors, 500} | ({401} if secured else set()))
        responses |= {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}
        if secured:
            extra["security"] = [{BEARER: []}]
        return {"responses": responses, "openapi_extra": extra, "description": description}

    def install(self, app: FastAPI) -> None:
        """Make app.openapi() add the hand-documented schemas to FastAPI's document."""
        generate = app.openapi  # FastAPI's: builds the document once, caches it in openapi_schema

        def openapi() -> dict[str, Any]:
            fresh = app.openapi_schema is None
            schema = generate()
            if fresh:
                self._add_components(schema)
            return schema

        app.openapi = openapi  # type: ignore[method-assign]

    def _add_components(self, schema: dict[str, Any]) -> None:
        refs, defs = models_json_schema(list(self.models.items()), ref_template=REF)
        for model, mode in self.models.items():
            # the routes refer to each model by its class name
            if refs[model, mode] != _ref(model):
                raise RuntimeError(f"{model.__name__} is documented as {refs[model, mode]}")
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name, definition in defs.get("$defs", {}).items():
            # a model FastAPI documented too (e.g. UsageInfo in a response) must be the same
            if schemas.setdefault(name, definition) != definition:
                raise RuntimeError(f"two different schemas are named {name}")
        if self.secured:
            components.setdefault("securitySchemes", {})[BEARER] = {"type": "http",
                                                                    "scheme": "bearer"}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (FastAPI's itemSchema form): `data:` holds a chunk, the
    error that ended the stream early, or [DONE] at the end."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    data = {"type": "string", "anyOf": [
        {"const": "[DONE]"},
        {"contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}
