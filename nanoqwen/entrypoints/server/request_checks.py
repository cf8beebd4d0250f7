"""What every route does with an HTTP request around its handler: the API key (a bearer token, or Anthropic's
x-api-key), the body (size-capped while it streams in, validated into its pydantic model, a 400 naming the field
otherwise), the model name (the served model, or a LoRA adapter's); and the access log, which counts each response
and logs one line."""

from __future__ import annotations

import hmac
import logging
import time
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoqwen.entrypoints.server.lora import adapter_for
from nanoqwen.entrypoints.server.metrics import ServerMetrics
from nanoqwen.entrypoints.server.pooling import require_task
from nanoqwen.entrypoints.server.protocol import APIError
from nanoqwen.entrypoints.server.serving import ServerState

logger = logging.getLogger("nanoqwen.server")
M = TypeVar("M", bound=BaseModel)


def check_api_key(state: ServerState, request: Request) -> None:
    """A 401 unless the request carries the server's API key (if it has one), as a bearer token or in x-api-key."""
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # or as Anthropic's clients send it
    if "x-api-key" in request.headers:
        scheme, token = "bearer", request.headers["x-api-key"]
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             state.api_key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                            "'x-api-key: <key>'", type="authentication_error", code="invalid_api_key")


async def parse_request(state: ServerState, request: Request, model: type[M], task: str | None) -> M:
    """Auth, then the task the endpoint needs (a 400 that names the right endpoint; None: any), then the body
    (size-capped while it streams in), then the model name (of the body, or of a RootModel's root)."""
    check_api_key(state, request)
    if task is not None:
        require_task(state, task)
    limit = state.max_body_bytes
    too_big = APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    try:
        req = model.model_validate_json(bytes(body))
    except ValidationError as e:
        raise validation_error(e) from None
    name = getattr(getattr(req, "root", req), "model", None)
    if name is not None and name != state.served_model_name:
        if not state.lora_adapters:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{state.served_model_name}`", param="model", code="model_not_found")
        request.state.lora_request = adapter_for(state, name)  # a LoRA adapter's name (a 404 for none)
    return req


def validation_error(e: ValidationError) -> APIError:
    """The first thing wrong with a request body, as a 400 that names the field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    if not err["loc"]:
        return APIError(400, f"request body must be a JSON object: {err['msg']}")
    # e.g. messages.0.role (a union adds its member: stop.str)
    where = ".".join(str(p) for p in err["loc"])
    return APIError(400, f"{where}: {err['msg']} (got {err.get('input')!r:.100})",
                    param=str(err["loc"][0]))


class AccessLog:
    """Pure ASGI middleware (streams pass straight through): counts each response and logs
    one line."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500
        scope.setdefault("state", {})["arrival"] = start

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            self.metrics.count_http(path, status)
            client = ":".join(map(str, scope["client"])) if scope.get("client") else "-"
            extra = scope.get("state", {}).get("log", "")
            logger.info('%s "%s %s" %d %.0fms %s', client, scope["method"], path, status,
                        (time.perf_counter() - start) * 1000, extra)
