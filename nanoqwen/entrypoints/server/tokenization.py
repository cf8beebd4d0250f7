"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or messages through the chat template exactly as
/v1/chat/completions renders them), POST /detokenize, and GET /version. Request and response bodies are vLLM's."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, RootModel, Tag, model_validator

from nanoqwen.entrypoints.server.chat import render_template, template_kwargs
from nanoqwen.entrypoints.server.protocol import APIError, ChatMessage, Tool, _Model
from nanoqwen.entrypoints.server.responses import _Response
from nanoqwen.entrypoints.server.serving import ServerState


class TokenizeCompletionRequest(_Model):
    """A raw prompt to tokenize."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="Qwen3 has no BOS, so this changes nothing for it")
    return_token_strs: bool = False


class TokenizeChatRequest(_Model):
    """A conversation to render with the chat template (as /v1/chat/completions would) and tokenize."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = Field(False, description="not supported: always false")
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _not_also_a_prompt(cls, body: Any) -> Any:
        # (the two shapes are one of: a body with both matches neither)
        if isinstance(body, dict) and "prompt" in body:
            raise ValueError("give `prompt` or `messages`, not both")
        return body


def _shape(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "prompt"


class TokenizeRequest(RootModel[Annotated[Annotated[TokenizeCompletionRequest, Tag("prompt")]
                                          | Annotated[TokenizeChatRequest, Tag("chat")], Discriminator(_shape)]]):
    """vLLM's /tokenize body: a prompt, or (with `messages`) a conversation."""


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="each token as the vocabulary spells it, with "
                                                     "return_token_strs")


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


async def tokenize(state: ServerState, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    engine = state.engine
    tokenizer = engine.tokenizer
    if isinstance(req, TokenizeChatRequest):
        kwargs, thinking = template_kwargs(req.chat_template_kwargs)
        tools = ([{"type": "function", "function": t.function.model_dump(exclude_unset=True)} for t in req.tools]
                 if req.tools else None)
        messages = [m.to_template() for m in req.messages]
        prompt = await asyncio.to_thread(render_template, state, messages, tools, thinking, kwargs,
                                         check_context=False, add_generation_prompt=req.add_generation_prompt)
        tokens = prompt.token_ids
    else:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.id_to_token(t) or "" for t in tokens] if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    tokenizer = state.engine.tokenizer
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is not in the vocabulary (0..{tokenizer.vocab_size - 1})",
                       param="tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def version() -> dict[str, str]:
    """nanoqwen's version, as installed."""
    try:
        return {"version": package_version("nanoqwen")}
    except PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}
