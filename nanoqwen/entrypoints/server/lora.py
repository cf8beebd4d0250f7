"""LoRA adapters on the server, as vLLM serves them: a request's `model` field names the base model or an adapter;
/v1/models lists each adapter with its `parent`; POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind
the API key) add and remove adapters at run time. The engine must run with --enable-lora (docs/lora.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from nanoqwen.entrypoints.server.openapi import ApiDoc
from nanoqwen.entrypoints.server.protocol import APIError
from nanoqwen.entrypoints.server.serving import ServerState
from nanoqwen.errors import InvalidRequestError
from nanoqwen.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter: the adapter's name (what requests give as `model`) and its PEFT folder."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter: the adapter's name (lora_int_id, if given, must be its id)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None


def adapter_route(doc: ApiDoc, request: type[BaseModel], errors: Iterable[int]) -> dict[str, Any]:
    """app.post's keyword arguments for a load/unload route: its JSON body, and vLLM's plain-text success line."""
    route = doc.route(request, request, errors=errors)
    route["responses"][200] = {"description": "OK: vLLM's success line"}
    return {**route, "response_class": PlainTextResponse}


def served_adapters(engine: Any) -> dict[str, LoRARequest]:
    """The adapters the engine already holds (--lora-modules), by name."""
    lora = getattr(engine, "lora", None)
    return {x.request.lora_name: x.request for x in lora.registry.values()} if lora is not None else {}


def adapter_for(state: ServerState, name: str) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model's name); a 404 in OpenAI's shape for a name
    that is neither."""
    if name == state.served_model_name:
        return None
    adapter = state.lora_adapters.get(name)
    if adapter is None:
        served = ", ".join(f"`{n}`" for n in [state.served_model_name, *state.lora_adapters])
        raise APIError(404, f"The model `{name}` does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    return adapter


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters, each with its base model as `parent` (as vLLM lists them)."""
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "nanoqwen",
             "root": lora.lora_path, "parent": state.served_model_name, "max_model_len": state.engine.max_model_len}
            for name, lora in state.lora_adapters.items()]


async def load_adapter(state: ServerState, req: LoadLoRAAdapterRequest) -> str:
    """Read an adapter into the engine and serve it by name; vLLM's success text."""
    if getattr(state.engine, "lora", None) is None:
        raise APIError(400, "this server runs no LoRA adapters: start it with --enable-lora", param="lora_name")
    name = req.lora_name
    if name in state.lora_adapters or name == state.served_model_name:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    lora_int_id = max((x.lora_int_id for x in state.lora_adapters.values()), default=0) + 1
    try:
        lora = LoRARequest(name, lora_int_id, req.lora_path)
        await state.async_engine.call(lambda engine: engine.add_lora(lora))
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    state.lora_adapters[name] = lora
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(state: ServerState, req: UnloadLoRAAdapterRequest) -> str:
    """Stop serving an adapter and drop it from the engine (a 404 for one not served; a 400 while requests
    still run with it); vLLM's success text."""
    lora = state.lora_adapters.get(req.lora_name)
    if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                       code="model_not_found")
    try:
        await state.async_engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    state.lora_adapters.pop(req.lora_name, None)
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
