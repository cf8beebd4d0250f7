"""Response bodies of the server's endpoints, as pydantic models: what /openapi.json documents. The
handlers build these shapes as plain dicts (never validated on the way out); tests/entrypoints/server/test_openapi.py
checks live answers against the schemas. Request bodies are in protocol.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class _Response(BaseModel):
    """A documented response body (never validated on the way out)."""


class ErrorDetail(_Response):
    message: str
    type: str = Field(description="e.g. invalid_request_error, authentication_error, "
                                  "server_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(description="e.g. invalid_json, model_not_found, request_too_large, "
                                         "wrong_task, queue_full")


class ErrorResponse(_Response):
    """OpenAI's error body, which every error status carries."""

    error: ErrorDetail


class HealthResponse(_Response):
    status: Literal["ok"]


class ModelCard(_Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    task: Literal["generate", "embed", "score"] = Field(
        description="nanoqwen's: which endpoints the model serves")


class ModelList(_Response):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# finish_reason: "stop" (EOS, a stop string or stop token), "length" (max_tokens or the context),
# "tool_calls" (chat only); stop_reason: the stop string or stop_token_ids entry that ended it
StopReason = int | str | None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatLogprob]


class FunctionCallOut(_Response):
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class ToolCallOut(_Response):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int = Field(description="the call's index among all of this choice's calls")


class ChatCompletionMessage(_Response):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCallOut] | None = Field(None, description="absent when there are none")


class ChatCompletionChoice(_Response):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: str
    stop_reason: StopReason


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatDelta(_Response):
    """What a chunk adds to the message; a field is absent when it adds nothing."""

    role: Literal["assistant"] = "assistant"
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = []


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = Field(None, description="only in the choice's last chunk")


class ChatCompletionChunk(_Response):
    """One event of a streamed chat completion (`stream: true`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(description="empty in the usage chunk")
    usage: UsageInfo | None = Field(None, description="with stream_options.include_usage: null, "
                                                      "except in the last chunk")


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunkChoice(CompletionChoice):
    stop_reason: StopReason = Field(None, description="only in the choice's last chunk")


class CompletionChunk(_Response):
    """One event of a streamed completion (`stream: true`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(description="empty in the usage chunk")
    usage: UsageInfo | None = Field(None, description="with stream_options.include_usage: null, "
                                                      "except in the last chunk")


class Embedding(_Response):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="numbers, or with encoding_format base64 "
                                                     "the little-endian float32 bytes in base64")


class PoolingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[Embedding]
    usage: PoolingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int = Field(description="the document's index in the request")
    document: RerankDocument
    relevance_score: float = Field(ge=0, le=1)


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="best first; the top_n best if top_n is given")


class ScoreData(_Response):
    index: int
    object: Literal["score"]
    score: float = Field(ge=0, le=1)


class ScoreUsage(PoolingUsage):
    completion_tokens: int


class ScoreResponse(_Response):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData] = Field(description="one per pair, in text_2's order")
    usage: ScoreUsage
