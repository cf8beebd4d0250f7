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


class Timings(_Response):
    """The speed of one answer, in llama.cpp's server's names (its web UI and clients read them)."""

    cache_n: int = Field(description="prompt tokens whose KV came from the prefix cache")
    prompt_n: int = Field(description="prompt tokens computed (the rest of the prompt)")
    prompt_ms: float = Field(description="from the request's arrival to its first token")
    prompt_per_second: float = Field(description="prompt_n over prompt_ms")
    predicted_n: int = Field(description="tokens generated (all choices)")
    predicted_ms: float = Field(description="from the first token to the last")
    predicted_per_second: float = Field(description="tokens after each choice's first, over "
                                                    "predicted_ms")


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


class PromptLogprob(_Response):
    """vLLM's Logprob: a prompt token's (or a top alternative's) log-probability, rank (1 = most likely)
    and text."""

    logprob: float
    rank: int
    decoded_token: str | None


# vLLM's prompt_logprobs: one per prompt token, null for the first, else {token id: PromptLogprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]
PROMPT_LOGPROBS = ("with the request's prompt_logprobs (or a completion's echo with logprobs): each prompt "
                   "token's entry (the prompt token and the top k), null for the first; absent otherwise")


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
    timings: Timings | None = Field(description="null if no token was generated")
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


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
    timings: Timings | None = Field(None, description="with stream_options.include_usage: in "
                                                      "the last chunk, beside usage")


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="null for an echoed prompt's first token")
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    timings: Timings | None = Field(description="null if no token was generated")


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
    timings: Timings | None = Field(None, description="with stream_options.include_usage: in "
                                                      "the last chunk, beside usage")


class SamplingDefaults(_Response):
    """What a request that leaves a field out gets: the checkpoint's generation_config.json."""

    temperature: float
    top_p: float
    top_k: int = Field(description="-1: no top-k")
    min_p: float
    max_tokens: int | None = Field(description="null: up to the context (n_ctx) less the prompt")
    seed: int | None = Field(description="null: a fresh random seed per request")


class DefaultGenerationSettings(_Response):
    n_ctx: int = Field(description="the context: prompt and answer together (max_model_len)")
    params: SamplingDefaults


class ServerProps(_Response):
    """The server's model and defaults, in the shape of llama.cpp's /props (the fields that apply)."""

    model_alias: str = Field(description="the name clients send as `model`")
    model_path: str
    total_slots: int = Field(description="sequences the engine runs at once (max_num_seqs)")
    default_generation_settings: DefaultGenerationSettings
    chat_template: str | None


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
