"""OpenAI's Responses API (POST /v1/responses): the request body and the response bodies /openapi.json
documents (store.py keeps the responses GET / DELETE /v1/responses/{id} and `previous_response_id` read).

The request takes OpenAI's names and shapes (the `openai` SDK's types/responses/ are the reference).
Fields a text-only server on one model cannot honour are refused with a 400 that says so (a
`background` run, a `conversation`, truncation "auto", tools other than functions, input that is not
text); the few that change nothing here are accepted and echoed (metadata, user, service_tier,
include): see serving.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from nanoqwen.entrypoints.server.protocol import INT64, APIError, _Model

# ---------------------------------------------------------------- input items


class TextPart(_Model):
    """A content part: input_text (what a client writes) or output_text (an assistant message sent
    back); any other type (input_image, input_file, refusal) is refused when the prompt is built."""

    type: str
    text: str | None = None


class MessageItem(_Model):
    """A message; `type` may be left out, as OpenAI's "easy" input messages do."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Model):
    """A call the model made, sent back with its result (function_call_output) after it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Model):
    """What the caller's function returned for the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class SummaryText(_Model):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningText(_Model):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Model):
    """The model's reasoning, sent back: its text becomes the next assistant turn's
    reasoning_content (which Qwen3's template keeps only after the last user message)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="not an input item nanoqwen takes: give a message, "
                                       "function_call, function_call_output or reasoning item")]


# a string is one user message; anything else must be a list of items (an error names the item at fault)
Input = Annotated[Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
                  Discriminator(lambda value: "text" if isinstance(value, str) else "items")]


# ---------------------------------------------------------------- the request


class FunctionTool(_Model):
    """A function the model may call (the only kind of tool a local model can have)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always held to `parameters` under a tool_choice grammar


class FunctionToolChoice(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    """text.format: "text" (no constraint), "json_object" or "json_schema" (name, schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # "schema" shadows BaseModel's
    strict: bool | None = None  # always enforced


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ReasoningConfig(_Model):
    """effort "none" or "minimal" turns Qwen3's thinking off; any other effort, or none given,
    leaves it on (Qwen3 has no degrees of effort)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries: reasoning text
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @property
    def thinking(self) -> bool:
        return self.effort not in ("none", "minimal")


class ResponsesRequest(_Model):
    """OpenAI's POST /v1/responses body, the fields nanoqwen serves (unknown fields are ignored, as
    in the other endpoints)."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64["le"])
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        """A 400 for a field given a value nanoqwen cannot honour (rather than a quiet
        difference)."""
        if self.truncation == "auto":
            raise APIError(400, 'truncation "auto" is not supported: nanoqwen never drops input; '
                                'send "disabled" or leave it out', param="truncation")
        if self.background:
            raise APIError(400, "background responses are not supported: leave background out "
                                "(or false) and wait for the answer, or stream it",
                           param="background")
        if self.conversation is not None:
            raise APIError(400, "conversations are not supported: continue from a response with "
                                "previous_response_id instead", param="conversation")


# ---------------------------------------------------------------- response bodies (for /openapi.json)


class _Doc(BaseModel):
    """A documented response body (never validated on the way out)."""

    model_config = ConfigDict(extra="allow")


class OutputTextPart(_Doc):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(description="always empty")


class ReasoningTextPart(_Doc):
    type: Literal["reasoning_text"]
    text: str


class ResponseReasoningItem(_Doc):
    """The answer's <think> block."""

    type: Literal["reasoning"]
    id: str
    summary: list[dict[str, Any]] = Field(description="always empty: the content is the reasoning itself")
    content: list[ReasoningTextPart]


class ResponseOutputMessage(_Doc):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputTextPart]


class ResponseFunctionToolCall(_Doc):
    """A call of one of the request's functions."""

    type: Literal["function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str = Field(description="what the call's function_call_output gives back")
    name: str
    arguments: str = Field(description="a JSON object, as a string")


OutputItem = ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall


class InputTokensDetails(_Doc):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class OutputTokensDetails(_Doc):
    reasoning_tokens: int = Field(description="tokens of the answer's <think> block")


class ResponseUsage(_Doc):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Doc):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Doc):
    """A response: the answer's items, usage, and the request's settings echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    incomplete_details: IncompleteDetails | None
    error: dict[str, Any] | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = Field(description="null until the answer is done")
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    truncation: Literal["disabled"]
    user: str | None
    service_tier: str | None


class ResponseStreamEvent(_Doc):
    """One event of a streamed response (`stream: true`), sent as `event: TYPE` and `data: JSON`:
    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.reasoning_text.delta / .done,
    response.output_text.delta / .done, response.function_call_arguments.delta / .done,
    response.content_part.done, response.output_item.done, then response.completed or
    response.incomplete (response.failed if the engine fails)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputTextPart | ReasoningTextPart | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None


class ResponseDeleted(_Doc):
    id: str
    object: Literal["response"]
    deleted: Literal[True]
