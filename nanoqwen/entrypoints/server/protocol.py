"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields, and vLLM's rerank and score
APIs) as pydantic models, and the error type every endpoint answers with.

Models are strict (a string where a number belongs is a 400, not silently converted; Infinity and NaN
are no numbers) and ignore unknown fields, as OpenAI-compatible servers do, so newer clients that send
more keep working. Every value is then checked by SamplingParams and the engine (token ids inside the
vocabulary, stop lists within the engine's limits): one rule set, whichever way a request comes in.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from nanoqwen.errors import InvalidRequestError
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import MAX_LOGPROBS, REPETITION_PENALTY_RANGE, SamplingParams, StructuredOutputsParams

INT64 = {"ge": -(2**63), "le": 2**63 - 1}


class APIError(Exception):
    """An error answered as OpenAI's {"error": {"message", "type", "param", "code"}} with an
    HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Model(BaseModel):
    # (JSON's Infinity and NaN literals, which Python's parser reads as floats, are refused: no field means them)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool | None = None


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute; None: any JSON object
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always enforced


class ResponseFormat(_Model):
    """OpenAI's response_format: "text" (no constraint), "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Model):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar (Lark or GBNF),
    json_object; or none, to give disable_any_whitespace to a response_format's JSON."""

    # an unknown key (e.g. vLLM's structural_tag) is a 400, never a silently weaker constraint
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    json_: str | dict[str, Any] | None = Field(None, alias="json")  # not to shadow .json()
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _GenerationRequest(_Model):
    """Fields shared by /v1/chat/completions and /v1/completions; None means 'not given'."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, **INT64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    # at most int64 (the sampler's tensors): a larger one failed the engine step, and so every
    # request in it
    top_k: int | None = Field(None, ge=-1, le=INT64["le"])
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # structured outputs (nanoqwen/entrypoints/server/structured.py), as OpenAI and vLLM spell them, with
    # vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: each prompt token's logprob and the k most likely there (SamplingParams.prompt_logprobs), returned as
    # `prompt_logprobs` (a completion's choices, a chat completion's response); not with stream, as in vLLM
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # DRY repetition penalty (llama.cpp's and text-generation-webui's names; SamplingParams checks the values)
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    # vLLM's: at most this many tokens of reasoning, then </think> is forced (SamplingParams.thinking_token_budget)
    thinking_token_budget: int | None = Field(None, ge=0, le=INT64["le"])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None,
                        logprobs: int | None, prompt_len: int, max_model_len: int,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """The model's defaults with every field the request gave on top (SamplingParams checks
        the values).

        max_tokens None runs up to the context; asking for more than the context holds is an
        error, as in vLLM.
        """
        if max_tokens is not None and prompt_len + max_tokens > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                                f"However, you requested {prompt_len + max_tokens} tokens "
                                f"({prompt_len} in the prompt, {max_tokens} in the completion). "
                                "Reduce the prompt or max_tokens.",
                           param="max_tokens")
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stop",
                 "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
                 "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
                 "thinking_token_budget")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.prompt_logprobs is not None:
            if self.stream:
                raise APIError(400, "prompt_logprobs are not available with stream: true (as in vLLM)",
                               param="prompt_logprobs")
            given["prompt_logprobs"] = self.prompt_logprobs
        try:
            return dataclasses.replace(defaults, **given, n=self.n, max_tokens=max_tokens,
                                       logprobs=logprobs, structured_outputs=structured_outputs)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=e.param) from None


class ContentPart(_Model):
    type: str
    text: str | None = None


class FunctionCall(_Model):
    name: str
    # OpenAI clients send a JSON string; the template takes either
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template reads: text parts joined, "developer" as "system" (what
        Qwen3 knows)."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text" or p.text is None]
            if bad:
                raise APIError(400, f"content part type {bad[0]!r} is not supported: "
                                    "this model takes text only",
                               param="messages")
            content = "".join(p.text or "" for p in content)
        msg = self.model_dump(exclude_none=True, exclude={"content", "tool_calls"})
        msg["role"] = "system" if self.role == "developer" else self.role
        msg["content"] = content if content is not None else ""
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return msg


class FunctionDef(_Model):
    # keep every schema key: the template prints them
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes one call
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # the prompt before each choice's text (and with logprobs its tokens' entries first); with max_tokens 0,
    # the prompt alone (nanoqwen/entrypoints/server/completions.py)
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """nanoqwen serves one prompt per request; a list of one prompt is that prompt."""
        prompt = self.prompt
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"got {len(prompt)} prompts: send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        return prompt


# ---- /v1/embeddings, /v1/rerank, /score (nanoqwen/entrypoints/server/pooling.py)


def _one_of(what: str) -> WrapValidator:
    """A union field's error as one message ("input: must be a string or ...") instead of one
    per member of the union."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("type_error", f"must be {what}") from None
    return WrapValidator(validate)


TEXTS = _one_of("a string or a list of strings")


class _PoolingRequest(_Model):
    """Fields shared by the embedding and scoring endpoints."""

    model: str | None = None
    # vLLM's: keep only the last k tokens of a longer input (-1: the whole context) instead of
    # rejecting it
    truncate_prompt_tokens: int | None = None

    def pooling_params(self, max_model_len: int, dimensions: int | None = None) -> PoolingParams:
        k = self.truncate_prompt_tokens
        k = max_model_len if k == -1 else k
        if k is not None and not 1 <= k <= max_model_len:
            raise APIError(400, f"truncate_prompt_tokens={k} is out of range: give 1 to "
                                f"{max_model_len} (the context), or -1 for the whole context",
                           param="truncate_prompt_tokens")
        return PoolingParams(dimensions=dimensions, truncate_prompt_tokens=k)


class EmbeddingRequest(_PoolingRequest):
    """OpenAI's embeddings request; prompt_name (sentence-transformers' name, a nanoqwen extra): one
    of the checkpoint's prompts put before each text, e.g. "query"."""

    input: Annotated[str | list[str] | list[int] | list[list[int]],
                     _one_of("a string, a list of strings, a list of token ids or a list of "
                             "token-id lists")]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    prompt_name: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or a token-id list on its own is one."""
        inp = self.input
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            return [inp]
        if not inp:
            raise APIError(400, "input is an empty list: give at least one text or token-id list",
                           param="input")
        return list(inp)

    def input_name(self, i: int) -> str:
        """How errors name input i: "input" when one was sent on its own, else "input[i]"."""
        single = isinstance(self.input, str) or isinstance(self.input[0], int)
        return "input" if single else f"input[{i}]"


class RerankRequest(_PoolingRequest):
    """vLLM's /v1/rerank (Jina's and Cohere's shape); instruction (a nanoqwen extra): the
    reranker's task, by default web search."""

    query: str
    documents: list[str] = Field(min_length=1)
    # the best n results; None or 0 returns them all (as vLLM)
    top_n: int | None = Field(None, ge=0)
    instruction: str | None = None


class ScoreRequest(_PoolingRequest):
    """vLLM's /score: text_1 against each text_2 (one against many), or pair by pair (lists of equal
    length)."""

    text_1: Annotated[str | list[str], TEXTS]
    text_2: Annotated[str | list[str], TEXTS]
    instruction: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """The (query, document) pairs, in text_2's order."""
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        for name, texts in (("text_1", queries), ("text_2", documents)):
            if not texts:
                raise APIError(400, f"{name} is an empty list: give at least one text", param=name)
        if len(queries) == 1:
            queries = queries * len(documents)
        elif len(queries) != len(documents):
            raise APIError(400, f"text_1 has {len(queries)} texts and text_2 has "
                                f"{len(documents)}: give one text_1 for any number of text_2, or "
                                "lists of the same length (scored pair by pair)",
                           param="text_2")
        return list(zip(queries, documents, strict=True))

    def pair_name(self, i: int) -> str:
        """How errors name pair i, e.g. "text_1 with text_2[3]"."""
        def name(field: str, texts: str | list[str]) -> str:
            return field if isinstance(texts, str) else f"{field}[{i if len(texts) > 1 else 0}]"
        return f"{name('text_1', self.text_1)} with {name('text_2', self.text_2)}"
