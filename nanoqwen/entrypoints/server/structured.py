"""Structured outputs on the server: what a request constrains its answer to, as the one
StructuredOutputsParams the engine enforces (nanoqwen/sample/structured_outputs.py).

A constraint comes from OpenAI's response_format (json_object, json_schema), vLLM's
structured_outputs (json, regex, choice, grammar, json_object) or its older guided_* fields, or, in
chat, from tool_choice "required" or a named tool: a Lark grammar of Qwen3's tool calls,
`<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`, one per offered tool with its
arguments held to the tool's `parameters` schema. At most one constraint per request.
"""

from __future__ import annotations

import json
from typing import Any

from nanoqwen.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, FunctionDef
from nanoqwen.errors import InvalidRequestError
from nanoqwen.sampling_params import KINDS, StructuredOutputsParams

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
# arguments written as Qwen3's chat template writes them (json.dumps' separators): in
# distribution for the model, and no optional whitespace a model could repeat forever
ARGUMENTS_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# OpenAI: a function without parameters takes none
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def structured_outputs(req: ChatCompletionRequest | CompletionRequest, tokenizer: Any = None
                       ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's constraint or None, the field that gave it: what a compile error names).

    tokenizer: the engine's, for the tool-call tokens (chat requests)."""
    found = _constraints(req)
    if isinstance(req, ChatCompletionRequest):
        grammar = tool_choice_grammar(req, tokenizer)
        if grammar is not None:
            found.append(("tool_choice", "grammar", grammar))
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, not {len(found)}: "
                            f"{', '.join(field for field, _, _ in found)}",
                       param=found[1][0].split(".")[0])
    if not found:
        return None, None
    field, kind, value = found[0]
    param = field.split(".")[0]
    # structured_outputs without a kind of its own still sets the JSON's whitespace (as vLLM)
    compact = req.structured_outputs is not None and req.structured_outputs.disable_any_whitespace
    try:
        params = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=compact)
    except InvalidRequestError as e:  # e.g. an empty choice list
        raise APIError(400, f"{field}: {e}", param=param) from None
    # the tool-call grammar is ours: what can fail to compile in it is a tool's parameters
    return params, "tools" if field == "tool_choice" else param


def _constraints(req: ChatCompletionRequest | CompletionRequest) -> list[tuple[str, str, Any]]:
    """Every constraint the request gives outside tool_choice: (field, kind, value)."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, 'response_format of type "json_schema" needs a json_schema',
                           param="response_format")
        schema = fmt.json_schema.schema_
        # OpenAI's schema is optional: without one, any JSON object
        found.append(("response_format", "json", schema) if schema is not None
                     else ("response_format", "json_object", True))
    if req.structured_outputs is not None:
        given = req.structured_outputs.model_dump(by_alias=True)
        found += [(f"structured_outputs.{kind}", kind, given[kind]) for kind in KINDS
                  if given[kind] not in (None, False)]
    for kind in ("json", "regex", "choice", "grammar"):  # vLLM's older spelling
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", kind, value))
    return found


def tool_choice_grammar(req: ChatCompletionRequest, tokenizer: Any) -> str | None:
    """The Lark grammar tool_choice asks for: "required", one or more calls of the offered tools
    (one if parallel_tool_calls is false); a named function, one call of it; else None."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if not req.tools:
        raise APIError(400, "tool_choice needs tools: give the functions the model may call",
                       param="tool_choice")
    if choice == "required":
        tools, repeat = req.tools, req.parallel_tool_calls is not False
    else:
        name = choice.function.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice.function.name must be a function's name",
                           param="tool_choice")
        tools = [t for t in req.tools if t.function.name == name][:1]
        if not tools:
            offered = ", ".join(repr(t.function.name) for t in req.tools)
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                                f"tools (offered: {offered})", param="tool_choice")
        repeat = False  # as OpenAI: one call of the named function
    return tool_calls_grammar([t.function for t in tools], repeat, tokenizer)


def tool_calls_grammar(functions: list[FunctionDef], repeat: bool, tokenizer: Any) -> str:
    """The Lark grammar of one call (repeat: one or more) of any of `functions`, each call's arguments held
    to its parameters schema: what tool_choice "required" or a named tool (OpenAI), "any" or "tool"
    (Anthropic's Messages API) enforce."""
    start, end = _special(tokenizer, TOOL_START), _special(tokenizer, TOOL_END)
    calls = ' ("\\n" call)*' if repeat else ""
    alternatives = "\n    | ".join(f"{start} {_call_body(f)} {end}" for f in functions)
    # up to two newlines first: what Qwen3 writes after </think> before its calls
    return f"start: NL? call{calls}\nNL: /\\n{{1,2}}/\ncall: {alternatives}\n"


def _call_body(function: FunctionDef) -> str:
    """'\\n{"name": "NAME", "arguments": ' ARGUMENTS '}\\n' in Lark: the tool's name as a literal,
    its arguments as its own JSON schema (so the schema's "#/$defs/..." refs resolve as written)."""
    head = f'\n{{"name": {json.dumps(function.name, ensure_ascii=False)}, "arguments": '
    schema = {**(function.parameters or NO_PARAMETERS), "x-guidance": ARGUMENTS_FORMAT}
    arguments, tail = json.dumps(schema, ensure_ascii=False), "}\n"
    return f"{_literal(head)} %json {arguments} {_literal(tail)}"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string: JSON's escapes are Lark's


def _special(tokenizer: Any, tag: str) -> str:
    """A tag as its special token (llguidance's <[id]>), so the call is the token Qwen3's parser
    and template know, not the same text spelled with ordinary tokens."""
    token_id = tokenizer.token_to_id(tag) if tokenizer is not None else None
    return f"<[{token_id}]>" if token_id is not None else _literal(tag)
