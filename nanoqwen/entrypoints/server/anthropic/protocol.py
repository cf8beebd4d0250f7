"""Anthropic's Messages API as pydantic models: the request bodies of POST /v1/messages and
/v1/messages/count_tokens, the response bodies and stream events /openapi.json documents (the handler in
messages.py builds them as plain dicts), and Anthropic's error shape, which these two routes answer with.

Names are the `anthropic` SDK's. Like protocol.py's models these are strict (a string where a number belongs is a
400) and ignore unknown fields. Fields accepted but without effect here: `cache_control` (nanoqwen's prefix cache
reuses any earlier prompt's blocks by itself), `metadata`, output_config's `effort`, a thinking block's
`signature` (never verified), and `redacted_thinking` blocks (encrypted by Anthropic: nothing to render), which
are dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, RootModel, model_validator

from nanoqwen.entrypoints.server.protocol import FunctionDef

# ---------------------------------------------------------------- errors

# Anthropic's error type of each status it answers (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}
# nanoqwen's 503 (a full queue, or the engine not running) is Anthropic's 529 "overloaded"
ANTHROPIC_STATUS = {503: 529}


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(status, body) of an error in Anthropic's shape: the status as Anthropic answers it (503 -> 529) and
    {"type": "error", "error": {"type", "message"}}."""
    status = ANTHROPIC_STATUS.get(status, status)
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# accepted on blocks, system blocks and tools, without effect: the prefix cache needs no breakpoints
CacheControl = Annotated[dict[str, Any] | None, Field(
    None, description="accepted and ignored: nanoqwen's prefix cache reuses earlier prompts without breakpoints")]


# ---------------------------------------------------------------- request bodies


class TextBlockParam(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl


def _text_as_blocks(value: Any) -> Any:
    """A string is one text block; null (an optional field sent as null) none."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else [] if value is None else value


def _string_or_blocks(schema: dict[str, Any]) -> None:
    """The field's JSON schema: a string, null, or its list of blocks."""
    blocks = {k: v for k, v in schema.items() if k not in ("title", "default")}
    for key in blocks:
        del schema[key]
    schema["anyOf"] = [{"type": "string"}, blocks, {"type": "null"}]


def blocks_or_text(block: Any) -> Any:
    """A field of Anthropic's that takes a string or a list of blocks (`block`), validated as the list (a
    string becomes one text block), so an error names the block at fault (messages.0.content.2) rather than a
    member of the union."""
    return Annotated[list[block], BeforeValidator(_text_as_blocks), Field(json_schema_extra=_string_or_blocks)]


TextBlocks = blocks_or_text(TextBlockParam)


class ToolUseBlockParam(_Model):
    """A call the assistant made (an earlier turn's tool_use block, sent back)."""

    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl


class ToolResultBlockParam(_Model):
    """The result of the assistant's call `tool_use_id`, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: TextBlocks = []
    is_error: bool | None = Field(None, description="shown to the model as an 'Error: ' before the content")
    cache_control: CacheControl

    def text(self) -> str:
        text = "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(_Model):
    """The assistant's reasoning in an earlier turn (rendered as the template renders reasoning_content)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = Field(description="accepted and never verified")


class RedactedThinkingBlockParam(_Model):
    """Reasoning Anthropic encrypted: accepted and dropped (nanoqwen cannot read it, and never writes one)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam | RedactedThinkingBlockParam,
    Field(discriminator="type")]


class MessageParam(_Model):
    """One turn: text, or blocks (a user turn's text and tool_result blocks, an assistant turn's thinking, text
    and tool_use blocks)."""

    role: Literal["user", "assistant"]
    content: blocks_or_text(ContentBlockParam)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        own = {"user": ("text", "tool_result"),
               "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}[self.role]
        for block in self.content:
            if block.type not in own:
                raise ValueError(f"a {block.type} block does not belong in a {self.role} turn: a {self.role} "
                                 f"turn holds {' and '.join(own)} blocks")
        return self

    def to_template(self) -> list[dict[str, Any]]:
        """The chat template's messages for this turn: an assistant turn is one message (tool_use blocks as
        its tool_calls, thinking as its reasoning_content); a user turn is a "tool" message per tool_result
        and a "user" message per run of text blocks, in the blocks' order."""
        blocks = self.content
        if self.role == "assistant":
            text = [b.text for b in blocks if isinstance(b, TextBlockParam)]
            thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlockParam)]
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in blocks if isinstance(b, ToolUseBlockParam)]
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
            if thinking:
                message["reasoning_content"] = "\n".join(thinking)
            if calls:
                message["tool_calls"] = calls
            return [message]
        messages: list[dict[str, Any]] = []
        for block in blocks:
            if isinstance(block, ToolResultBlockParam):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, TextBlockParam):
                if messages and messages[-1]["role"] == "user":
                    messages[-1]["content"] += "\n" + block.text
                else:
                    messages.append({"role": "user", "content": block.text})
        return messages


class ToolParam(_Model):
    """A client tool: the model calls it with arguments that follow input_schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description='a JSON schema of "type": "object"')
    type: Literal["custom"] | None = Field(None, description="Anthropic's server tools (web search, code "
                                                            "execution, ...) are not served")
    cache_control: CacheControl

    @model_validator(mode="after")
    def _object_schema(self) -> ToolParam:
        if self.input_schema.get("type") != "object":
            raise ValueError(f'input_schema must be a JSON schema of "type": "object" (got "type": '
                             f'{self.input_schema.get("type")!r})')
        return self

    def function(self) -> FunctionDef:
        """The tool as an OpenAI function: what the chat template prints and the tool-call grammar reads."""
        return FunctionDef(name=self.name, description=self.description, parameters=self.input_schema)


class ToolChoiceAuto(_Model):
    """The model decides (disable_parallel_tool_use: at most one call)."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Model):
    """At least one call of any tool (disable_parallel_tool_use: exactly one), enforced by a grammar."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Model):
    """One call of the tool `name`, enforced by a grammar."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Model):
    """No calls: the model is not told about the tools."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]
ThinkingDisplay = Literal["summarized", "omitted"]


class ThinkingConfigEnabled(_Model):
    """Reasoning (Qwen3's <think> block) of at most budget_tokens tokens, answered as thinking blocks;
    display "omitted" sends them empty."""

    type: Literal["enabled"]
    # Anthropic's floor is 1024; a small model's short reasoning may want less
    budget_tokens: int = Field(ge=1, description="at most this many reasoning tokens (they count toward "
                                                 "max_tokens, so less than it)")
    display: ThinkingDisplay | None = None


class ThinkingConfigAdaptive(_Model):
    """Reasoning of the length the model picks."""

    type: Literal["adaptive"]
    display: ThinkingDisplay | None = None


class ThinkingConfigDisabled(_Model):
    """No reasoning: the template's enable_thinking=False (an empty think block)."""

    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingConfigEnabled | ThinkingConfigAdaptive | ThinkingConfigDisabled,
                           Field(discriminator="type")]


class Metadata(_Model):
    """Accepted and ignored (Anthropic's abuse tracking)."""

    user_id: str | None = None


class JSONOutputFormat(_Model):
    """The answer's text is JSON that follows `schema` (enforced by a grammar, after any reasoning)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")  # "schema" would shadow a BaseModel attribute


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="accepted and ignored (thinking and its budget_tokens set how long Qwen3 reasons)")
    format: JSONOutputFormat | None = None


class MessageCountTokensRequest(_Model):
    """The prompt of a Messages request: what /v1/messages/count_tokens counts."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: TextBlocks = []
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = Field(None, description="omitted: the chat template's default "
                                                              "(Qwen3 reasons)")

    @model_validator(mode="after")
    def _ends_with_a_user_turn(self) -> MessageCountTokensRequest:
        if self.messages[-1].role != "user":
            raise ValueError("the last message must be a user turn: an assistant turn to continue "
                             "(prefill) is not supported")
        return self

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and not isinstance(self.tool_choice, ToolChoiceNone)

    @property
    def thinking_enabled(self) -> bool:
        return not isinstance(self.thinking, ThinkingConfigDisabled)

    def to_template(self) -> list[dict[str, Any]]:
        """The chat template's messages: the system prompt (its blocks joined by newlines) first."""
        system = "\n".join(b.text for b in self.system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [m for message in self.messages for m in message.to_template()]


class MessageCreateRequest(MessageCountTokensRequest):
    """POST /v1/messages. temperature, top_p and top_k not given: the model's defaults (its
    generation_config.json), as chat completions."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**63 - 1, description="0: off")
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


# ---------------------------------------------------------------- response bodies (documentation)


class _Response(BaseModel):
    """A documented response body (never validated on the way out)."""


class TextBlock(_Response):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Response):
    type: Literal["thinking"]
    thinking: str = Field(description="Qwen3's reasoning (empty with display \"omitted\")")
    signature: str = Field(description="the SHA-256 of the reasoning, hex: a digest, not a secret signature "
                                       "(nanoqwen verifies none)")


class ToolUseBlock(_Response):
    type: Literal["tool_use"]
    id: str = Field(description="toolu_...")
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[ThinkingBlock | TextBlock | ToolUseBlock, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(_Response):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int = Field(description="generated tokens, reasoning included")
    cache_read_input_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Message(_Response):
    """An answer of /v1/messages."""

    id: str = Field(description="msg_...")
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = Field(description="the stop_sequences entry that ended the answer")
    usage: Usage


class MessageTokensCount(_Response):
    input_tokens: int = Field(description="the prompt's tokens, as /v1/messages renders it")


class MessageStartEvent(_Response):
    type: Literal["message_start"]
    message: Message = Field(description="content empty, stop_reason null")


class ContentBlockStartEvent(_Response):
    type: Literal["content_block_start"]
    index: int
    content_block: ContentBlock = Field(description="text and thinking empty, input {}")


class TextDelta(_Response):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(_Response):
    type: Literal["thinking_delta"]
    thinking: str


class SignatureDelta(_Response):
    type: Literal["signature_delta"]
    signature: str


class InputJSONDelta(_Response):
    type: Literal["input_json_delta"]
    partial_json: str = Field(description="the tool_use block's input (sent whole, in one delta)")


class ContentBlockDeltaEvent(_Response):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta, Field(discriminator="type")]


class ContentBlockStopEvent(_Response):
    type: Literal["content_block_stop"]
    index: int


class MessageDelta(_Response):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaUsage(_Response):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int


class MessageDeltaEvent(_Response):
    type: Literal["message_delta"]
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(_Response):
    type: Literal["message_stop"]


class PingEvent(_Response):
    type: Literal["ping"]


class MessageStreamEvent(RootModel[Annotated[
        MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
        | MessageDeltaEvent | MessageStopEvent | PingEvent, Field(discriminator="type")]]):
    """One event of a /v1/messages stream (its SSE `event:` is its type)."""


class AnthropicErrorDetail(_Response):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "request_too_large, api_error or overloaded_error")
    message: str


class AnthropicErrorResponse(_Response):
    """Anthropic's error body, which the /v1/messages routes answer every error with."""

    type: Literal["error"]
    error: AnthropicErrorDetail
